//! Flags shared by every command that runs the engine, and loading the model
//! into a started engine.

use anyhow::Result;
use baton_engine::{Engine, EngineConfig, PreemptionMode};
use baton_kernels::KvDtype;
pub use baton_node_common::engine_args::BackendChoice;
use clap::{Args, ValueEnum};
use std::path::PathBuf;

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum KvDtypeArg {
    F32,
    F16,
    Bf16,
    /// FP8 E4M3: half the memory of f16 per token.
    Fp8,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum PreemptionArg {
    Recompute,
    Swap,
}

/// Where the model is and how the engine runs it.
#[derive(Args, Clone, Debug)]
pub struct EngineArgs {
    /// A GGUF file or a Hugging Face model folder (config.json, safetensors,
    /// tokenizer.json). Default: the model fetched by scripts/fetch-model.sh.
    #[arg(long, env = "BATON_MODEL")]
    pub model: Option<PathBuf>,
    /// Compute backend.
    #[arg(long, env = "BATON_BACKEND", value_enum, default_value = "cpu")]
    pub backend: BackendChoice,
    /// GPU ordinal (CUDA backend).
    #[arg(long, env = "BATON_GPU", default_value_t = 0)]
    pub gpu: usize,
    /// Compute threads (CPU backend).
    #[arg(long, env = "BATON_THREADS", default_value_t = default_threads())]
    pub threads: usize,
    /// KV cache memory of the primary pool, in MiB.
    #[arg(long, env = "BATON_KV_MEMORY_MIB", default_value_t = 512)]
    pub kv_memory_mib: usize,
    /// Second-tier (host) memory for evicted prefix blocks, in MiB.
    #[arg(long, env = "BATON_KV_TIER2_MIB", default_value_t = 1024)]
    pub kv_tier2_mib: usize,
    #[arg(long, env = "BATON_KV_DTYPE", value_enum, default_value = "f16")]
    pub kv_dtype: KvDtypeArg,
    /// Tokens per KV block.
    #[arg(long, env = "BATON_BLOCK_TOKENS", default_value_t = 16)]
    pub block_tokens: usize,
    /// Most tokens (prompt plus reply) per sequence; default: the model's.
    #[arg(long, env = "BATON_MAX_CONTEXT")]
    pub max_context: Option<usize>,
    /// Tokens per engine step (decode rows plus prefill chunks).
    #[arg(long, env = "BATON_STEP_TOKENS", default_value_t = 512)]
    pub step_tokens: usize,
    /// Inter-token latency target of running streams, ms: a step that decodes takes
    /// only the prefill tokens the engine's measured step cost fits within it (at
    /// least one KV block). 0: no target (prefill takes what --step-tokens leaves).
    #[arg(long, env = "BATON_ITL_TARGET_MS", default_value_t = 50)]
    pub itl_target_ms: u64,
    /// Most sequences decoding at once.
    #[arg(long, env = "BATON_MAX_RUNNING", default_value_t = 64)]
    pub max_running: usize,
    /// Most requests queued or running; more get an overload error.
    #[arg(long, env = "BATON_MAX_WAITING", default_value_t = 1024)]
    pub max_waiting: usize,
    #[arg(long, env = "BATON_PREEMPTION", value_enum, default_value = "recompute")]
    pub preemption: PreemptionArg,
    /// Keep every layer of every KV block. By default a model with sliding-window
    /// layers (Gemma 3) gives the memory of those layers' blocks that no row reads any
    /// more to other blocks, so the same KV memory holds longer conversations; this
    /// turns that off (to measure what it saves).
    #[arg(long, env = "BATON_KV_KEEP_WINDOW_LAYERS")]
    pub kv_keep_window_layers: bool,
}

fn default_threads() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
}

/// The default model's path: the cache folder of scripts/fetch-model.sh.
pub fn default_model_path() -> PathBuf {
    // With none of the cache's variables set: `.cache/baton/models` below the working folder.
    let cache = baton_text::model_cache::model_cache_dir().unwrap_or_else(|| PathBuf::from(".cache/baton/models"));
    cache.join("SmolLM2-135M-Instruct.Q4_1.gguf")
}

impl EngineArgs {
    pub fn model_path(&self) -> PathBuf {
        self.model.clone().unwrap_or_else(default_model_path)
    }

    pub fn engine_config(&self) -> EngineConfig {
        EngineConfig {
            kv_memory_bytes: self.kv_memory_mib << 20,
            kv_dtype: match self.kv_dtype {
                KvDtypeArg::F32 => KvDtype::F32,
                KvDtypeArg::F16 => KvDtype::F16,
                KvDtypeArg::Bf16 => KvDtype::BF16,
                KvDtypeArg::Fp8 => KvDtype::F8E4M3,
            },
            block_tokens: self.block_tokens,
            max_context: self.max_context,
            tier2_bytes: self.kv_tier2_mib << 20,
            step_token_budget: self.step_tokens,
            itl_target: baton_node_common::engine_args::itl_target(self.itl_target_ms),
            prefill_wait_limit: EngineConfig::default().prefill_wait_limit,
            max_running: self.max_running,
            max_waiting: self.max_waiting,
            preemption: match self.preemption {
                PreemptionArg::Recompute => PreemptionMode::Recompute,
                PreemptionArg::Swap => PreemptionMode::Swap,
            },
            reclaim_window_layers: !self.kv_keep_window_layers,
        }
    }

    /// Loads the model and starts an engine on the chosen backend.
    pub fn start(&self) -> Result<Engine> {
        Ok(baton_node_common::engine_args::start_engine(self.backend, self.gpu, self.threads, &self.model_path(), self.engine_config())?)
    }
}
