//! The node's engine flags and loading the model into a started engine.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::error::{Error, Result};
use baton_engine::{model, Engine, EngineConfig};
use baton_kernels::{Backend, CpuBackend};

/// Which compute backend runs the engine.
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BackendChoice {
    /// The CPU backend.
    #[default]
    Cpu,
    /// The CUDA backend on GPU `--gpu`; fails when there is none.
    Cuda,
    /// CUDA when this build has it and a GPU is there, else the CPU (and says why).
    Auto,
}

/// Where the model is and how much memory the engine gets.
#[derive(clap::Args, Clone, Debug)]
pub struct NodeEngineArgs {
    /// A GGUF file or a Hugging Face model folder.
    #[arg(long, env = "BATON_MODEL")]
    pub model: PathBuf,
    /// Compute backend.
    #[arg(long, env = "BATON_BACKEND", value_enum, default_value = "cpu")]
    pub backend: BackendChoice,
    /// GPU ordinal (CUDA backend).
    #[arg(long, env = "BATON_GPU", default_value_t = 0)]
    pub gpu: usize,
    /// Compute threads (CPU backend).
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
    /// Inter-token latency target of running streams, ms: a step that decodes takes
    /// only the prefill tokens the engine's measured step cost fits within it (at
    /// least one KV block). 0: no target (prefill takes what --step-tokens leaves).
    #[arg(long, env = "BATON_ITL_TARGET_MS", default_value_t = 50)]
    pub itl_target_ms: u64,
}

/// The engine's ITL target from `--itl-target-ms` (0: none).
pub fn itl_target(ms: u64) -> Option<std::time::Duration> {
    (ms > 0).then(|| std::time::Duration::from_millis(ms))
}

/// A validated engine setup: the model and the engine's configuration.
#[derive(Clone, Debug)]
pub struct EngineSetup {
    pub model: PathBuf,
    pub backend: BackendChoice,
    pub gpu: usize,
    pub threads: usize,
    pub config: EngineConfig,
}

impl TryFrom<NodeEngineArgs> for EngineSetup {
    type Error = Error;
    fn try_from(a: NodeEngineArgs) -> Result<Self> {
        if a.threads == 0 {
            return Err(Error::config("--threads must be at least 1"));
        }
        let config = EngineConfig {
            kv_memory_bytes: a.kv_memory_mib << 20,
            tier2_bytes: a.kv_tier2_mib << 20,
            max_context: a.max_context,
            step_token_budget: a.step_tokens,
            itl_target: crate::engine_args::itl_target(a.itl_target_ms),
            ..EngineConfig::default()
        };
        Ok(EngineSetup { model: a.model, backend: a.backend, gpu: a.gpu, threads: a.threads, config })
    }
}

impl EngineSetup {
    /// Loads the model on the chosen backend and starts the engine.
    pub fn start(&self) -> Result<Arc<Engine>> {
        Ok(Arc::new(start_engine(self.backend, self.gpu, self.threads, &self.model, self.config.clone())?))
    }
}

/// Loads `path` (GGUF file or Hugging Face folder) on the chosen backend and
/// starts the engine, logging which backend runs it (and, for `auto`, why
/// not CUDA).
pub fn start_engine(choice: BackendChoice, gpu: usize, threads: usize, path: &Path, config: EngineConfig) -> Result<Engine> {
    if !path.exists() {
        return Err(Error::ModelMissing(path.to_path_buf()));
    }
    let engine = match choice {
        BackendChoice::Cpu => start_on(CpuBackend::new(threads)?, path, config)?,
        BackendChoice::Cuda => start_on(cuda_backend(gpu)?, path, config)?,
        BackendChoice::Auto => match cuda_backend(gpu) {
            Ok(backend) => start_on(backend, path, config)?,
            Err(e) => {
                tracing::info!(reason = %e, "CUDA backend unavailable; using the CPU backend");
                start_on(CpuBackend::new(threads)?, path, config)?
            }
        },
    };
    tracing::info!(backend = %engine.info.backend, model = %engine.info.model_source, kv_blocks = engine.info.kv_blocks, "engine started");
    Ok(engine)
}

#[cfg(feature = "cuda")]
fn cuda_backend(gpu: usize) -> Result<baton_kernels::CudaBackend> {
    Ok(baton_kernels::CudaBackend::new(gpu)?)
}

/// Without the feature this is never constructed; the type only has to be a backend.
#[cfg(not(feature = "cuda"))]
fn cuda_backend(_gpu: usize) -> Result<CpuBackend> {
    Err(Error::Backend(baton_kernels::cuda_unavailable()))
}

/// Loads `path` on `backend` and starts the engine.
pub fn start_on<B: Backend + 'static>(backend: B, path: &Path, config: EngineConfig) -> Result<Engine> {
    let loaded = if path.is_dir() { model::load_hf_dir(&backend, path) } else { model::load_gguf(&backend, path) }
        .map_err(|e| Error::Model { path: path.to_path_buf(), source: e.into() })?;
    Ok(Engine::start(backend, loaded, config).map_err(baton_engine::Error::from)?)
}
