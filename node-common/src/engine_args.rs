//! The node's engine flags and loading the model into a started engine.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result};
use baton_engine::{model, Engine, EngineConfig};
use baton_kernels::CpuBackend;

/// Where the model is and how much memory the engine gets.
#[derive(clap::Args, Clone, Debug)]
pub struct NodeEngineArgs {
    /// A GGUF file or a Hugging Face model folder.
    #[arg(long, env = "BATON_MODEL")]
    pub model: PathBuf,
    /// Compute threads.
    #[arg(long, env = "BATON_THREADS", default_value_t = 2)]
    pub threads: usize,
    /// KV memory of the primary pool, MiB.
    #[arg(long, env = "BATON_KV_MEMORY_MIB", default_value_t = 512)]
    pub kv_memory_mib: usize,
    /// Second (host memory) tier, MiB; 0 disables it.
    #[arg(long, env = "BATON_KV_TIER2_MIB", default_value_t = 1024)]
    pub kv_tier2_mib: usize,
    /// Most tokens of one sequence (default: the model's).
    #[arg(long, env = "BATON_MAX_CONTEXT")]
    pub max_context: Option<usize>,
    /// Tokens one engine step may process.
    #[arg(long, env = "BATON_STEP_TOKENS", default_value_t = 512)]
    pub step_tokens: usize,
}

/// A validated engine setup: the model and the engine's configuration.
#[derive(Clone, Debug)]
pub struct EngineSetup {
    pub model: PathBuf,
    pub threads: usize,
    pub config: EngineConfig,
}

impl TryFrom<NodeEngineArgs> for EngineSetup {
    type Error = anyhow::Error;
    fn try_from(a: NodeEngineArgs) -> Result<Self> {
        if a.threads == 0 {
            anyhow::bail!("--threads must be at least 1");
        }
        let config = EngineConfig {
            kv_memory_bytes: a.kv_memory_mib << 20,
            tier2_bytes: a.kv_tier2_mib << 20,
            max_context: a.max_context,
            step_token_budget: a.step_tokens,
            ..EngineConfig::default()
        };
        Ok(EngineSetup { model: a.model, threads: a.threads, config })
    }
}

impl EngineSetup {
    /// Loads the model on the CPU backend and starts the engine.
    pub fn start(&self) -> Result<Arc<Engine>> {
        start_engine(&self.model, self.threads, self.config.clone())
    }
}

fn start_engine(path: &Path, threads: usize, config: EngineConfig) -> Result<Arc<Engine>> {
    let backend = CpuBackend::new(threads)?;
    let loaded = if path.is_dir() { model::load_hf_dir(&backend, path) } else { model::load_gguf(&backend, path) }
        .with_context(|| format!("loading {}", path.display()))?;
    Ok(Arc::new(Engine::start(backend, loaded, config)?))
}
