//! The serving engine: a worker thread that owns the model, the KV arena and
//! the block cache, and runs continuous batching with chunked prefill; and
//! [`Engine`], the thread-safe handle callers submit requests through.
//!
//! Callers give token IDs plus an owner scope and the length of the
//! platform-shared prefix; tokens stream back with per-token timings.
//! Dropping a [`RequestStream`] cancels its sequence at the next step, and
//! every path out of a sequence (finish, stop, error, cancel, preemption)
//! returns its blocks exactly once.

mod accept;
mod arena;
mod cost;
mod handoff;
mod plan;
mod scheduler;
mod sequence;

use arena::ArenaPlan;

use crate::kv::{BlockHasher, ConversationId, KvError, KvStats, SeqId, OwnerId, Xxh64BlockHasher};
use crate::model::LoadedModel;
use baton_kernels::{Backend, KvDtype, KvLayout, OptionalOp};
use baton_text::chat_template::ChatTemplate;
use baton_text::sampling::{SamplingError, ValidSamplingParams};
use baton_text::tokenizer::Tokenizer;
use baton_text::{FinishReason, TokenOut, Usage};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

pub use cost::StepCost;
pub use handoff::layers::{LayerChunk, LayerExport, LayerExportEvent};
pub use handoff::{DeviceBlockHolder, DeviceBlocks, ImportBlocks, ImportUse, ImportedToken, KvExport, KvImport, SubmitOptions, Submission};
pub use scheduler::PreemptionMode;

/// How the engine uses memory and schedules work.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Bytes of KV memory in the primary pool.
    pub kv_memory_bytes: usize,
    pub kv_dtype: KvDtype,
    /// Tokens per KV block.
    pub block_tokens: usize,
    /// Most tokens (prompt plus reply) of one sequence; `None` = the model's, lowered to
    /// what `kv_memory_bytes` holds when that is less (an explicit value that does not fit
    /// is refused, [`EngineError::KvTooSmall`]).
    pub max_context: Option<usize>,
    /// Bytes of the second (host memory) tier; 0 disables it.
    pub tier2_bytes: usize,
    /// Tokens one step may process (decode rows first, then prefill chunks).
    pub step_token_budget: usize,
    /// Inter-token latency running streams should see: a step with decode rows
    /// takes only the prefill tokens the step cost model says fit within it
    /// (at least one KV block). `None`: prefill takes whatever the step budget
    /// leaves.
    pub itl_target: Option<Duration>,
    /// How long a prompt may wait for prefill budget beside running streams (its
    /// share of the time to first token): once the oldest prompt still to prefill
    /// was submitted longer ago than this, steps stop holding prefill to the ITL
    /// target until it is through. Under more load than the target allows this
    /// keeps prompts from queueing without bound (the old, unprotected behaviour).
    pub prefill_wait_limit: Duration,
    /// Most sequences in a batch.
    pub max_running: usize,
    /// Most requests waiting for admission; more are refused.
    pub max_waiting: usize,
    pub preemption: PreemptionMode,
    /// Give the memory of sliding-window layers that no row reads any more (blocks
    /// behind every window) to other blocks: a grouped arena, where the backend has
    /// one and the model has window layers. Off: every block holds every layer.
    pub reclaim_window_layers: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            kv_memory_bytes: 512 << 20,
            kv_dtype: KvDtype::F16,
            block_tokens: crate::kv::DEFAULT_BLOCK_TOKENS,
            max_context: None,
            tier2_bytes: 1 << 30,
            step_token_budget: 512,
            itl_target: Some(Duration::from_millis(50)),
            prefill_wait_limit: Duration::from_millis(500),
            max_running: 64,
            max_waiting: 1024,
            preemption: PreemptionMode::Recompute,
            reclaim_window_layers: true,
        }
    }
}

/// Errors of the engine.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(
        "max context of {max_context} tokens needs {needed_blocks} KV blocks ({needed_bytes} bytes at {dtype}), \
         but the KV memory budget of {budget_bytes} bytes holds only {blocks} blocks ({tokens} tokens); \
         raise the KV memory or lower the max context"
    )]
    KvTooSmall {
        max_context: usize,
        needed_blocks: usize,
        needed_bytes: usize,
        dtype: &'static str,
        budget_bytes: usize,
        blocks: usize,
        tokens: usize,
    },
    #[error("invalid engine configuration: {0}")]
    Config(String),
    #[error("request queue is full ({waiting} waiting); retry later")]
    Overloaded { waiting: usize },
    #[error("prompt of {prompt} tokens plus max_tokens {max_tokens} exceeds the max context of {max_context} tokens")]
    ContextTooLong { prompt: usize, max_tokens: usize, max_context: usize },
    #[error("empty prompt")]
    EmptyPrompt,
    #[error("token {token} is outside the vocabulary of {vocab}")]
    BadToken { token: u32, vocab: usize },
    #[error("platform prefix of {platform} tokens is longer than the prompt of {prompt}")]
    BadPlatformPrefix { platform: usize, prompt: usize },
    #[error(transparent)]
    Sampling(#[from] SamplingError),
    #[error(transparent)]
    Kv(#[from] KvError),
    #[error("the engine has stopped")]
    Stopped,
    #[error("imported KV rejected: {what}")]
    BadImport { what: &'static str },
}

impl EngineError {
    /// Stable label for metrics and logs.
    pub fn label(&self) -> &'static str {
        match self {
            EngineError::KvTooSmall { .. } => "kv_too_small",
            EngineError::Config(_) => "config",
            EngineError::Overloaded { .. } => "overloaded",
            EngineError::ContextTooLong { .. } => "context_too_long",
            EngineError::EmptyPrompt => "empty_prompt",
            EngineError::BadToken { .. } => "bad_token",
            EngineError::BadPlatformPrefix { .. } => "bad_platform_prefix",
            EngineError::Sampling(_) => "sampling",
            EngineError::Kv(_) => "kv",
            EngineError::Stopped => "stopped",
            EngineError::BadImport { .. } => "bad_import",
        }
    }
}

/// One generation request.
#[derive(Clone, Debug)]
pub struct Request {
    pub prompt: Vec<u32>,
    pub owner: OwnerId,
    /// Leading prompt tokens supplied by the platform (the system prompt):
    /// their full blocks are shared across users.
    pub platform_prefix_len: usize,
    /// Tags the blocks this request publishes, for deletion.
    pub conversation: Option<ConversationId>,
    pub sampling: ValidSamplingParams,
    /// Keep generating past the end-of-sequence token (benchmarks).
    pub ignore_eos: bool,
}

/// What a request stream yields.
#[derive(Debug)]
pub enum Event {
    Token(TokenOut),
    /// `window_saved_bytes`: the memory of sliding-window layers that the turn's blocks
    /// did not hold at its end, because no later row reads them (not received, or
    /// given back once its rows had moved past them; 0 without a grouped arena).
    Finished { reason: FinishReason, usage: Usage, ttft: Option<Duration>, total: Duration, trailing_text: String, window_saved_bytes: u64 },
    Failed(EngineError),
}

/// Counters and gauges of the engine, refreshed every step.
#[derive(Clone, Debug, Default)]
pub struct EngineStats {
    pub kv: KvStats,
    pub running: usize,
    pub waiting: usize,
    pub swapped: usize,
    pub steps: u64,
    pub prefill_tokens: u64,
    pub decode_tokens: u64,
    pub prompt_tokens: u64,
    pub cached_prompt_tokens: u64,
    /// The part of `cached_prompt_tokens` promoted from the second tier.
    pub cached_tier2_prompt_tokens: u64,
    pub generated_tokens: u64,
    pub preemptions: u64,
    pub finished: u64,
    pub cancelled: u64,
    pub busy_seconds: f64,
    /// Sum over steps of the cost model's prediction of each (made before it ran).
    pub predicted_step_seconds: f64,
    /// Sum over the same steps of their measured time.
    pub measured_step_seconds: f64,
    /// Prefill tokens the cost model let the last step add beside its decode
    /// rows under the ITL target (0: the decode rows alone reach it, prefill
    /// gets the planner's floor of one block); the step budget when nothing
    /// decodes or there is no target.
    pub prefill_budget_tokens: usize,
    /// p95 of the measured times of steps with decode rows over the last few
    /// seconds (0 when there were none): the gaps running streams see.
    pub step_p95_seconds: f64,
    /// The step cost model's coefficients as last fitted (`None` before the first step).
    pub step_cost: Option<StepCost>,
    /// Decode steps queued before the previous step's tokens were read (run-ahead
    /// decoding: the host's work on step N overlapped with step N+1 on the GPU).
    pub run_ahead_steps: u64,
    /// Rows of such steps thrown away because their stream ended at the step before
    /// (a stop token, a stop string, a cancel): the price of running ahead.
    pub run_ahead_discarded_rows: u64,
}

/// Which export a submission asks for, from which block.
#[derive(Clone, Copy)]
enum Export {
    Whole(usize),
    Layers(usize),
}

pub(crate) enum Command {
    Submit {
        id: SeqId,
        request: Box<Request>,
        events: tokio::sync::mpsc::UnboundedSender<Event>,
        import: Option<(Box<KvImport>, tokio::sync::oneshot::Sender<ImportUse>)>,
        export: Option<handoff::ExportTo>,
    },
    PeekPrefix { query: PrefixQuery, reply: mpsc::Sender<usize> },
    ExportPrefix { query: PrefixQuery, start_block: usize, reply: mpsc::Sender<KvExport> },
    Cancel(SeqId),
    EvictConversation(ConversationId, mpsc::Sender<usize>),
    EvictOwner(OwnerId, mpsc::Sender<usize>),
    /// [`Engine::keep_layer_exports_on_device`].
    KeepLayerExportsOnDevice(bool),
    Shutdown,
}

struct Shared {
    stats: Mutex<EngineStats>,
    /// Requests submitted and not yet finished.
    in_flight: AtomicUsize,
}

/// Facts about the loaded model and memory, fixed at start.
#[derive(Clone, Debug)]
pub struct EngineInfo {
    pub backend: String,
    pub model_source: String,
    pub vocab: usize,
    pub max_context: usize,
    pub kv_layout: KvLayout,
    /// Sliding window of each of the layout's layers (`None`: global). On a backend
    /// with a grouped arena a block holds its local layers only while a row may read
    /// them (`crate::kv::KvCache::trim_local`); nodes reserve transfers by these
    /// windows, so out-of-window blocks of local layers are not shipped
    /// (`crate::kv::WindowRule`).
    pub layer_windows: Vec<Option<usize>>,
    /// Block IDs of the pool. In a grouped arena more than its memory would hold with
    /// every layer: blocks behind every window hold only their global layers.
    pub kv_blocks: usize,
    /// Bytes of the arena's memory (the KV budget, rounded down to whole blocks or units).
    pub kv_arena_bytes: usize,
    /// Bytes of one unit when the arena is grouped (window layers' memory given back
    /// block by block; see [`crate::kv::KvCache::with_units`]); `None` for a plain one.
    pub kv_unit_bytes: Option<usize>,
    pub tier2_blocks: usize,
    pub weight_bytes: usize,
    pub eos: Option<u32>,
    /// The ITL target the planner keeps decode steps within (`EngineConfig::itl_target`).
    pub itl_target: Option<Duration>,
}

/// A prompt prefix as the prefix cache sees it.
#[derive(Clone, Debug)]
pub(crate) struct PrefixQuery {
    pub tokens: Vec<u32>,
    pub owner: OwnerId,
    pub platform_prefix_len: usize,
}

/// Handle to a running engine. Cheap to share behind an `Arc`.
pub struct Engine {
    tx: Mutex<mpsc::Sender<Command>>,
    shared: Arc<Shared>,
    next_id: AtomicU64,
    max_waiting: usize,
    pub info: EngineInfo,
    pub tokenizer: Arc<Tokenizer>,
    pub template: Arc<ChatTemplate>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

/// The stream of one request's events. Dropping it cancels the request.
pub struct RequestStream {
    pub id: SeqId,
    events: tokio::sync::mpsc::UnboundedReceiver<Event>,
    cancel: mpsc::Sender<Command>,
    done: bool,
}

impl RequestStream {
    /// Next event, blocking the thread (for synchronous callers).
    pub fn blocking_next(&mut self) -> Option<Event> {
        let e = self.events.blocking_recv();
        self.note(&e);
        e
    }

    /// Next event (for async callers).
    pub async fn next(&mut self) -> Option<Event> {
        let e = self.events.recv().await;
        self.note(&e);
        e
    }

    fn note(&mut self, e: &Option<Event>) {
        if matches!(e, None | Some(Event::Finished { .. }) | Some(Event::Failed(_))) {
            self.done = true;
        }
    }

    /// Asks the engine to stop this request at its next step.
    pub fn cancel(&self) {
        let _ = self.cancel.send(Command::Cancel(self.id));
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        if !self.done {
            self.cancel();
        }
    }
}

impl Engine {
    /// Sizes the KV pool, checks the configuration and starts the worker.
    pub fn start<B: Backend + 'static>(backend: B, loaded: LoadedModel<B>, config: EngineConfig) -> Result<Engine, EngineError> {
        Self::start_with_block_hasher(backend, loaded, config, Arc::new(Xxh64BlockHasher))
    }

    /// [`Engine::start`] with another block hasher. For tests that forge hash
    /// collisions ([`ConstantHasher`](crate::kv::ConstantHasher)): the prefix cache
    /// must stay correct and owner-isolated with any hasher. Nodes use
    /// [`Engine::start`]; engines that exchange KV must hash alike.
    pub fn start_with_block_hasher<B: Backend + 'static>(
        backend: B,
        loaded: LoadedModel<B>,
        config: EngineConfig,
        hasher: Arc<dyn BlockHasher>,
    ) -> Result<Engine, EngineError> {
        let LoadedModel { model, tokenizer, template, source } = loaded;
        let mc = &model.config;
        if config.block_tokens == 0 || config.step_token_budget == 0 || config.max_running == 0 {
            return Err(EngineError::Config("block tokens, step token budget and max running must be positive".into()));
        }
        if config.itl_target.is_some_and(|t| t.is_zero()) {
            return Err(EngineError::Config("the ITL target must be positive (None turns it off)".into()));
        }
        let layout = KvLayout {
            layers: mc.n_layers,
            block_tokens: config.block_tokens,
            kv_heads: mc.n_kv_heads,
            head_dim: mc.head_dim,
            dtype: config.kv_dtype,
        };
        let windows = mc.windows();
        let arena = ArenaPlan::new(layout, &windows, config.kv_memory_bytes, config.step_token_budget, config.reclaim_window_layers && backend.supports(OptionalOp::GroupedKv));
        let blocks = arena.blocks;
        let fits = arena.context_fits();
        let max_context = match config.max_context {
            Some(c) if c > mc.context_length => {
                return Err(EngineError::Config(format!("max context {c} is longer than the model's context length {}", mc.context_length)));
            }
            Some(c) => c,
            // Unasked, the model's own context as far as the budget holds it: a
            // long-context model (Gemma 3 270M: 32,768 tokens, 576 MiB of f16 KV) starts on
            // the default budget with a shorter context instead of refusing. An asked-for
            // context that does not fit is still refused below.
            None if fits > 0 && fits < mc.context_length => {
                tracing::warn!(
                    model_context = mc.context_length,
                    max_context = fits,
                    kv_memory_bytes = config.kv_memory_bytes,
                    "the model's context does not fit the KV memory: serving a shorter max context (raise the KV memory, or set the max context to silence this)"
                );
                fits
            }
            None => mc.context_length,
        };
        let needed_blocks = max_context.div_ceil(config.block_tokens);
        if !arena.fits(max_context) {
            return Err(EngineError::KvTooSmall {
                max_context,
                needed_blocks,
                needed_bytes: arena.bytes_for(max_context),
                dtype: config.kv_dtype.name(),
                budget_bytes: config.kv_memory_bytes,
                blocks: fits / config.block_tokens,
                tokens: fits,
            });
        }
        let units = arena.grouped.as_ref().map_or(0, |g| g.units);
        if blocks > u32::MAX as usize || units >= baton_kernels::UNMAPPED as usize {
            return Err(EngineError::Config(format!("{blocks} KV blocks ({units} units) is more than one pool can address")));
        }
        let tier2_blocks = config.tier2_bytes / layout.block_bytes();
        let info = EngineInfo {
            backend: backend.describe(),
            model_source: source.display().to_string(),
            vocab: mc.vocab,
            max_context,
            kv_layout: layout,
            layer_windows: windows,
            kv_blocks: blocks,
            kv_arena_bytes: arena.arena_bytes(),
            kv_unit_bytes: arena.unit_bytes(),
            tier2_blocks,
            weight_bytes: model.weight_bytes,
            eos: tokenizer.eos_id(),
            itl_target: config.itl_target,
        };
        let tokenizer = Arc::new(tokenizer);
        let template = Arc::new(template);
        let shared = Arc::new(Shared { stats: Mutex::new(EngineStats::default()), in_flight: AtomicUsize::new(0) });
        let (tx, rx) = mpsc::channel();
        let kv = match &arena.grouped {
            None => backend.kv(layout, blocks),
            Some(g) => backend.kv_grouped(layout, blocks, g.units, g.groups.clone()),
        }
        .map_err(|e| EngineError::Config(e.to_string()))?;
        let worker = scheduler::Worker::new(backend, model, kv, layout, arena, tier2_blocks, max_context, config.clone(), hasher, tokenizer.clone(), shared.clone(), rx);
        let thread = std::thread::Builder::new()
            .name("baton-engine".into())
            .spawn(move || worker.run())
            .map_err(|e| EngineError::Config(format!("cannot start the engine thread: {e}")))?;
        Ok(Engine {
            tx: Mutex::new(tx),
            shared,
            next_id: AtomicU64::new(1),
            max_waiting: config.max_waiting,
            info,
            tokenizer,
            template,
            thread: Mutex::new(Some(thread)),
        })
    }

    fn sender(&self) -> mpsc::Sender<Command> {
        self.tx.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Queues a request. Fails at once when the queue is full or the request
    /// cannot fit the context; otherwise its events arrive on the stream.
    pub fn submit(&self, request: Request) -> Result<RequestStream, EngineError> {
        Ok(self.submit_with(request, SubmitOptions::default())?.stream)
    }

    /// [`Engine::submit`] with KV handoff extras: KV imported from another
    /// engine, and/or an export of the prompt's blocks at the first token
    /// (see [`handoff`](self::handoff)).
    pub fn submit_with(&self, request: Request, options: SubmitOptions) -> Result<Submission, EngineError> {
        let export = options.export_from_block.map(Export::Whole);
        Ok(self.submit_inner(request, options.import, export)?.0)
    }

    /// [`Engine::submit_with`] exporting the prompt's blocks from `start_block` on layer
    /// by layer while they are computed (see [`handoff::layers`]): each layer of a block
    /// leaves on the returned stream right after the forward pass wrote it, and
    /// [`LayerExportEvent::Done`] follows the last one at the first token. `import`: a
    /// pulled prefix (whole blocks before the export; no first token).
    pub fn submit_exporting_layers(&self, request: Request, import: Option<KvImport>, start_block: usize) -> Result<(Submission, LayerExport), EngineError> {
        if import.as_ref().is_some_and(|i| i.first_token.is_some()) {
            return Err(EngineError::BadImport { what: "an exported prompt is computed here, not imported with its first token" });
        }
        let (sub, layers) = self.submit_inner(request, import, Some(Export::Layers(start_block)))?;
        Ok((sub, layers.ok_or(EngineError::Stopped)?))
    }

    fn submit_inner(&self, request: Request, import: Option<KvImport>, export: Option<Export>) -> Result<(Submission, Option<LayerExport>), EngineError> {
        if request.prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        if let Some(&token) = request.prompt.iter().find(|&&t| t as usize >= self.info.vocab) {
            return Err(EngineError::BadToken { token, vocab: self.info.vocab });
        }
        if request.platform_prefix_len > request.prompt.len() {
            return Err(EngineError::BadPlatformPrefix { platform: request.platform_prefix_len, prompt: request.prompt.len() });
        }
        if request.prompt.len() >= self.info.max_context {
            return Err(EngineError::ContextTooLong {
                prompt: request.prompt.len(),
                max_tokens: request.sampling.max_tokens,
                max_context: self.info.max_context,
            });
        }
        let layout = self.info.kv_layout;
        if let Some(import) = &import {
            handoff::validate_import(import, request.prompt.len(), layout.block_tokens, layout.block_bytes())?;
            if let Some(first) = &import.first_token {
                handoff::validate_first_token(first, self.info.vocab)?;
            }
        }
        if let Some(Export::Whole(start) | Export::Layers(start)) = export {
            if start >= request.prompt.len().div_ceil(layout.block_tokens) {
                return Err(EngineError::BadImport { what: "export starts past the prompt's last block" });
            }
        }
        let in_flight = self.shared.in_flight.fetch_add(1, Ordering::SeqCst);
        if in_flight >= self.max_waiting {
            self.shared.in_flight.fetch_sub(1, Ordering::SeqCst);
            return Err(EngineError::Overloaded { waiting: in_flight });
        }
        let id = SeqId(self.next_id.fetch_add(1, Ordering::Relaxed));
        let (etx, erx) = tokio::sync::mpsc::unbounded_channel();
        let (export, export_rx, layers_rx) = match export {
            Some(Export::Whole(start)) => {
                let (tx, rx) = tokio::sync::oneshot::channel();
                (Some(handoff::ExportTo::Whole { start, tx }), Some(rx), None)
            }
            Some(Export::Layers(start)) => {
                let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
                (Some(handoff::ExportTo::Layers(handoff::layers::LayerExporter::new(tx, start))), None, Some(rx))
            }
            None => (None, None, None),
        };
        let (import, import_rx) = match import {
            Some(i) => {
                let (tx, rx) = tokio::sync::oneshot::channel();
                (Some((Box::new(i), tx)), Some(rx))
            }
            None => (None, None),
        };
        let tx = self.sender();
        let cmd = Command::Submit { id, request: Box::new(request), events: etx, import, export };
        if tx.send(cmd).is_err() {
            self.shared.in_flight.fetch_sub(1, Ordering::SeqCst);
            return Err(EngineError::Stopped);
        }
        Ok((Submission { stream: RequestStream { id, events: erx, cancel: tx, done: false }, export: export_rx, import: import_rx }, layers_rx))
    }

    /// Prompt tokens (whole blocks, both tiers) an admission of `prompt` for
    /// `owner` would find in the prefix cache now, leaving at least one token
    /// to compute. Changes nothing.
    pub fn cached_prefix_tokens(&self, prompt: &[u32], owner: &OwnerId, platform_prefix_len: usize) -> Result<usize, EngineError> {
        let (tx, rx) = mpsc::channel();
        let query = PrefixQuery { tokens: prompt.to_vec(), owner: owner.clone(), platform_prefix_len };
        self.sender().send(Command::PeekPrefix { query, reply: tx }).map_err(|_| EngineError::Stopped)?;
        rx.recv().map_err(|_| EngineError::Stopped)
    }

    /// Copies the cached blocks of `prefix` (whole blocks only) from block
    /// `start_block` on out of the cache, for a prefill node that lacks them.
    /// The export stops at the first block not cached (it may be empty).
    pub fn export_prefix(&self, prefix: &[u32], owner: &OwnerId, platform_prefix_len: usize, start_block: usize) -> Result<KvExport, EngineError> {
        let (tx, rx) = mpsc::channel();
        let query = PrefixQuery { tokens: prefix.to_vec(), owner: owner.clone(), platform_prefix_len };
        self.sender().send(Command::ExportPrefix { query, start_block, reply: tx }).map_err(|_| EngineError::Stopped)?;
        rx.recv().map_err(|_| EngineError::Stopped)
    }

    /// Removes every block one conversation published, from both tiers.
    pub fn evict_conversation(&self, conversation: ConversationId) -> Result<usize, EngineError> {
        let (tx, rx) = mpsc::channel();
        self.sender().send(Command::EvictConversation(conversation, tx)).map_err(|_| EngineError::Stopped)?;
        rx.recv().map_err(|_| EngineError::Stopped)
    }

    /// Removes every block of one user, from both tiers.
    pub fn evict_owner(&self, user: OwnerId) -> Result<usize, EngineError> {
        let (tx, rx) = mpsc::channel();
        self.sender().send(Command::EvictOwner(user, tx)).map_err(|_| EngineError::Stopped)?;
        rx.recv().map_err(|_| EngineError::Stopped)
    }

    /// Whether pipelined exports ([`Engine::submit_exporting_layers`]) leave each layer in
    /// device memory only ([`baton_kernels::Backend::keep_layer_exports_on_device`]): for
    /// a node whose KV transport sends from there. Applies to layers exported after it
    /// (commands are applied in order); does nothing on a host backend.
    pub fn keep_layer_exports_on_device(&self, keep: bool) -> Result<(), EngineError> {
        self.sender().send(Command::KeepLayerExportsOnDevice(keep)).map_err(|_| EngineError::Stopped)
    }

    /// A snapshot of the engine's counters (as of the last step).
    pub fn stats(&self) -> EngineStats {
        self.shared.stats.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Cancels every request and stops the worker.
    pub fn shutdown(&self) {
        let _ = self.sender().send(Command::Shutdown);
        if let Some(t) = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = t.join();
        }
    }
}
