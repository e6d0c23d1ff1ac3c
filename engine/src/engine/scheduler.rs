//! The engine's worker: continuous batching with chunked prefill.
//!
//! Each step: apply commands (submit, cancel, evict); plan a batch under the
//! token budget — decode rows of running sequences first, then prefill
//! chunks of running sequences, then newly admitted ones (admission needs
//! blocks for the whole prompt, net of prefix-cache hits); run one forward
//! pass; sample where a sequence's pending tokens are done; register newly
//! full blocks in the prefix index; finish what is finished. When a decode
//! row needs a block and none can be had, the most recently admitted
//! sequence is preempted (recompute, or swap to the second tier).
//!
//! Those planning rules live in `plan.rs`, tested without a model; this file
//! gives them the real sequences and block cache (the [`Queues`] impl) and
//! runs the step they plan. With an ITL target, each step's prefill budget
//! comes from the step cost model (`cost.rs`), which every step's measured
//! time refits.

use super::sequence::{Parked, Sequence};
use super::handoff::layers::LayerJob;
use super::handoff::{plan_import, ExportTo, ImportPlan};
use super::cost::{CostModel, RecentSteps, StepCost, StepShape};
use super::plan::{plan_step, Admission, Limits, Queues, SeqProgress};
use super::{Command, EngineConfig, EngineError, Event, FinishReason, ImportBlocks, ImportUse, KvExport, KvImport, PrefixQuery, Request, Shared};
use crate::kv::{BlockHasher, BlockId, BlockOwner, BlockStore, HashChain, KvCache, KvError, Registered, SeqId, WindowRule};
use crate::model::{Model, Scratch, StepInput};
use super::arena::ArenaPlan;
use super::accept::{accept_token, ends_at_next_token, greedy_sampled, sample_into};
use baton_kernels::{AttnRow, Backend, KvLayout, PendingPicks};
use baton_text::sampling::{Sampled, Sampler, StopMatcher};
use baton_text::tokenizer::{IncrementalDecoder, Tokenizer};
use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

/// How far back the p95 of decode steps looks (what a node reports as its ITL
/// standing): long enough for a stable p95, short enough to follow the load.
const RECENT_STEPS: Duration = Duration::from_secs(5);

/// What to do with a running sequence when memory runs out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PreemptionMode {
    /// Release its blocks; it recomputes later (its full blocks stay in the
    /// prefix cache, so little is lost unless they are evicted meanwhile).
    Recompute,
    /// Copy its blocks to the second tier; fall back to recompute when the
    /// tier is full.
    Swap,
}

/// The backend's KV arena seen as a [`BlockStore`].
pub(crate) struct ArenaStore<'a, B: Backend> {
    pub backend: &'a B,
    pub kv: &'a mut B::Kv,
    pub block_bytes: usize,
}

impl<B: Backend> BlockStore for ArenaStore<'_, B> {
    fn block_bytes(&self) -> usize {
        self.block_bytes
    }
    fn copy_out(&self, block: BlockId, out: &mut [u8]) {
        self.backend.kv_copy_block_out(self.kv, block.index(), out);
    }
    fn copy_in(&mut self, block: BlockId, data: &[u8]) {
        self.backend.kv_copy_block_in(self.kv, block.index(), data);
    }
    fn map(&mut self, block: BlockId, units: &[u32]) {
        self.backend.kv_map(self.kv, block.index(), units);
    }
}

/// A row of a queued step, by sequence (the running queue may change before the
/// step completes when it was queued ahead).
struct LaunchedRow {
    id: SeqId,
    /// Where the sequence was in the running queue when the step was queued.
    hint: usize,
    len: usize,
    wants_logits: bool,
}

/// A step queued on the backend, as [`Worker::complete`] takes its results in.
struct Launched {
    rows: Vec<LaunchedRow>,
    shape: StepShape,
    /// The cost model's prediction of the step, made before it ran.
    predicted: f64,
    started: Instant,
    prefill_budget: usize,
    decode_tokens: u64,
    prefill_tokens: u64,
}

/// A queued step whose tokens the host has not taken yet: with `picks` (run-ahead
/// decoding, [`baton_kernels::run_ahead`]) its greedy tokens are on their way from
/// the backend; without, its logits wait in the scratch.
struct InFlight {
    step: Launched,
    picks: Option<PendingPicks>,
}

/// Copies of arena blocks `ids` (all layers), in one backend call.
fn copy_blocks_out<B: Backend>(backend: &B, kv: &B::Kv, ids: &[usize], block_bytes: usize) -> Vec<Vec<u8>> {
    let mut blocks = vec![vec![0u8; block_bytes]; ids.len()];
    let mut outs: Vec<&mut [u8]> = blocks.iter_mut().map(Vec::as_mut_slice).collect();
    backend.kv_blocks_out(kv, ids, &mut outs);
    blocks
}

pub(crate) struct Worker<B: Backend> {
    backend: B,
    model: Model<B>,
    kv: B::Kv,
    layout: KvLayout,
    cache: KvCache,
    /// The model's sliding windows: which imported blocks lack their local layers.
    window: WindowRule,
    /// Hashes every block chain (the canonical XXH64 outside collision tests).
    hasher: Arc<dyn BlockHasher>,
    config: EngineConfig,
    max_context: usize,
    tokenizer: Arc<Tokenizer>,
    shared: Arc<Shared>,
    rx: mpsc::Receiver<Command>,
    /// Running sequences in admission order (the last is preempted first).
    running: Vec<Sequence>,
    waiting: VecDeque<Sequence>,
    scratch: Scratch<B>,
    /// What a step costs, fitted from the steps run so far.
    cost: CostModel,
    /// Times of the recent steps with decode rows.
    recent: RecentSteps,
    /// The step queued whose tokens are not taken yet (at most one between steps).
    in_flight: Option<InFlight>,
    /// When the last step's tokens were taken (a step queued ahead is timed from there).
    last_completed: Instant,
}

impl<B: Backend> Worker<B> {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        backend: B,
        model: Model<B>,
        kv: B::Kv,
        layout: KvLayout,
        arena: ArenaPlan,
        tier2_blocks: usize,
        max_context: usize,
        config: EngineConfig,
        hasher: Arc<dyn BlockHasher>,
        tokenizer: Arc<Tokenizer>,
        shared: Arc<Shared>,
        rx: mpsc::Receiver<Command>,
    ) -> Self {
        let scratch = Scratch::new(&backend);
        let window = WindowRule::new(layout.block_tokens, model.config.windows());
        let mut cache = match arena.grouped {
            None => KvCache::new(arena.blocks as u32, tier2_blocks),
            Some(g) => KvCache::with_units(arena.blocks as u32, tier2_blocks, g.units, g.local),
        };
        cache.set_window_rule(window.clone());
        let mut worker = Worker {
            backend,
            model,
            kv,
            layout,
            cache,
            window,
            hasher,
            config,
            max_context,
            tokenizer,
            shared,
            rx,
            running: Vec::new(),
            waiting: VecDeque::new(),
            scratch,
            cost: CostModel::new(StepCost::PRIOR),
            recent: RecentSteps::new(RECENT_STEPS),
            in_flight: None,
            last_completed: Instant::now(),
        };
        // Before the thread starts: a node that registers at once reports its
        // real free blocks, not the zeros of a default (a coordinator reads
        // those as a full pool and routes around the node).
        worker.publish_stats(0.0);
        worker
    }

    pub fn run(mut self) {
        let backend = std::ptr::addr_of!(self.backend);
        // SAFETY: `run` on the backend only borrows it for the duration of
        // the closure, which owns `self` exclusively otherwise; the backend
        // is never moved or dropped while the closure runs.
        let backend: &B = unsafe { &*backend };
        backend.run(move || self.main_loop());
    }

    fn main_loop(&mut self) {
        loop {
            let idle = self.running.is_empty() && self.waiting.is_empty();
            if idle {
                // Rows queued ahead for streams that have all ended since.
                self.drain();
                self.publish_stats(0.0);
                // Wakes now and then while idle so the recent steps' p95 ages out
                // (an idle node has all its ITL headroom back).
                match self.rx.recv_timeout(RECENT_STEPS / 4) {
                    Ok(cmd) => {
                        if !self.apply(cmd) {
                            return self.shutdown();
                        }
                    }
                    Err(mpsc::RecvTimeoutError::Timeout) => continue,
                    Err(mpsc::RecvTimeoutError::Disconnected) => return self.shutdown(),
                }
            }
            loop {
                match self.rx.try_recv() {
                    Ok(cmd) => {
                        if !self.apply(cmd) {
                            return self.shutdown();
                        }
                    }
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => return self.shutdown(),
                }
            }
            let t0 = Instant::now();
            self.step();
            self.publish_stats(t0.elapsed().as_secs_f64());
        }
    }

    fn shutdown(&mut self) {
        self.drain();
        let ids: Vec<SeqId> = self.running.iter().chain(self.waiting.iter()).map(|s| s.id).collect();
        for id in ids {
            self.cancel(id);
        }
        self.publish_stats(0.0);
    }

    /// Applies one command; false means stop.
    fn apply(&mut self, cmd: Command) -> bool {
        match cmd {
            Command::Submit { id, request, events, import, export } => self.admit_to_queue(id, *request, events, import, export),
            Command::PeekPrefix { query, reply } => {
                let _ = reply.send(self.peek_prefix(&query));
            }
            Command::ExportPrefix { query, start_block, reply } => {
                let _ = reply.send(self.export_prefix(&query, start_block));
            }
            Command::Cancel(id) => {
                // A cancel releases a running stream's blocks: the step queued ahead
                // completes first, so no queued step runs over blocks given away. The
                // other commands touch the queue or unreferenced cached blocks only.
                self.drain();
                self.cancel(id)
            }
            Command::EvictConversation(conv, reply) => {
                let _ = reply.send(self.cache.evict_conversation(&conv));
            }
            Command::EvictOwner(user, reply) => {
                let _ = reply.send(self.cache.evict_owner(&user));
            }
            Command::KeepLayerExportsOnDevice(keep) => self.backend.keep_layer_exports_on_device(keep),
            Command::Shutdown => return false,
        }
        true
    }

    /// Cached prompt tokens an admission would match (see `start_fresh`).
    fn peek_prefix(&self, q: &PrefixQuery) -> usize {
        let bt = self.layout.block_tokens;
        let matchable = q.tokens.len().saturating_sub(1) / bt;
        let mut chain = HashChain::with_hasher(bt, q.platform_prefix_len, q.owner.clone(), self.hasher.clone());
        chain.update(&q.tokens[..matchable * bt]);
        let peek = self.cache.peek_prefix(&chain.keys(&q.tokens, matchable));
        (peek.primary + peek.tier2) * bt
    }

    /// Copies the cached whole blocks of a prefix from `start_block` on.
    fn export_prefix(&mut self, q: &PrefixQuery, start_block: usize) -> KvExport {
        let bt = self.layout.block_tokens;
        let full = q.tokens.len() / bt;
        let mut chain = HashChain::with_hasher(bt, q.platform_prefix_len, q.owner.clone(), self.hasher.clone());
        chain.update(&q.tokens[..full * bt]);
        let bytes = self.layout.block_bytes();
        let mut store = ArenaStore { backend: &self.backend, kv: &mut self.kv, block_bytes: bytes };
        // Matched against the asker's own tokens and owner: a block is exported only
        // if it holds exactly those tokens for that owner, whatever the hashes say.
        let m = self.cache.match_prefix(&chain.keys(&q.tokens, full), &mut store);
        let ids: Vec<usize> = m.blocks.iter().skip(start_block).map(|b| b.index()).collect();
        let blocks = copy_blocks_out(&self.backend, &self.kv, &ids, bytes);
        if let Err(e) = self.cache.release(&m.blocks) {
            tracing::error!(error = %e, "release of exported blocks refused");
        }
        KvExport { start_block, blocks }
    }

    /// Copies the prompt blocks of `seq` from `start` on out of the arena.
    fn export_blocks(&self, seq: &Sequence, start: usize) -> KvExport {
        let bt = self.layout.block_tokens;
        let end = seq.prompt_len.div_ceil(bt).min(seq.blocks.len());
        let bytes = self.layout.block_bytes();
        let ids: Vec<usize> = seq.blocks[start.min(end)..end].iter().map(|b| b.index()).collect();
        let blocks = copy_blocks_out(&self.backend, &self.kv, &ids, bytes);
        KvExport { start_block: start, blocks }
    }

    /// This step's pipelined exports: for each sequence exporting layer by layer, the
    /// blocks its slice completes (and any complete earlier that did not go out yet).
    fn layer_jobs(&self, slices: &[super::plan::Slice]) -> Vec<LayerJob> {
        let bt = self.layout.block_tokens;
        let mut jobs = Vec::new();
        for sl in slices {
            let s = &self.running[sl.seq];
            let Some(ExportTo::Layers(x)) = &s.export else { continue };
            let due = x.due(sl.start + sl.len, s.prompt_len, bt);
            let due = due.start..due.end.min(s.blocks.len());
            if !due.is_empty() {
                let arena = s.blocks[due.clone()].iter().map(|b| b.index()).collect();
                jobs.push(LayerJob::new(sl.seq, x, due, arena));
            }
        }
        jobs
    }

    fn admit_to_queue(
        &mut self,
        id: SeqId,
        request: Request,
        events: tokio::sync::mpsc::UnboundedSender<Event>,
        import: Option<(Box<KvImport>, tokio::sync::oneshot::Sender<ImportUse>)>,
        export: Option<ExportTo>,
    ) {
        let (import, import_use) = import.unzip();
        let prompt_len = request.prompt.len();
        let mut sampling = request.sampling.clone();
        // Never generate past the context.
        let room = self.max_context.saturating_sub(prompt_len);
        if room == 0 {
            let _ = events.send(Event::Failed(EngineError::ContextTooLong {
                prompt: prompt_len,
                max_tokens: sampling.max_tokens,
                max_context: self.max_context,
            }));
            self.shared.in_flight.fetch_sub(1, Ordering::SeqCst);
            return;
        }
        if sampling.max_tokens > room {
            let mut p = sampling.into_inner();
            p.max_tokens = room;
            sampling = match p.validate() {
                Ok(v) => v,
                Err(e) => {
                    let _ = events.send(Event::Failed(e.into()));
                    self.shared.in_flight.fetch_sub(1, Ordering::SeqCst);
                    return;
                }
            };
        }
        let chain = HashChain::with_hasher(self.layout.block_tokens, request.platform_prefix_len, request.owner.clone(), self.hasher.clone());
        let seq = Sequence {
            id,
            tokens: request.prompt.clone(),
            prompt_len,
            computed: 0,
            blocks: Vec::new(),
            chain,
            registered: 0,
            links: Vec::new(),
            cached_tokens: None,
            generated: 0,
            sampler: Sampler::new(&sampling),
            decoder: IncrementalDecoder::new(self.tokenizer.clone()),
            stop: StopMatcher::new(&sampling.stop_strings),
            events,
            submitted: Instant::now(),
            first_token: None,
            parked: None,
            import,
            import_use,
            imported_first: None,
            local_layers_absent_below: 0,
            trimmed: 0,
            export,
            request: Request { sampling, ..request },
        };
        self.waiting.push_back(seq);
    }

    fn cancel(&mut self, id: SeqId) {
        if let Some(i) = self.running.iter().position(|s| s.id == id) {
            let seq = self.running.remove(i);
            self.finish(seq, FinishReason::Cancelled);
        } else if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
            if let Some(seq) = self.waiting.remove(i) {
                self.finish(seq, FinishReason::Cancelled);
            }
        }
    }

    /// Returns every block of `seq` (publishing its full ones first) or its
    /// swap, and sends the final event.
    fn finish(&mut self, mut seq: Sequence, reason: FinishReason) {
        register_full_blocks(&mut self.cache, self.layout.block_tokens, &mut seq);
        let without_window = seq.blocks.iter().filter(|&&b| !self.cache.has_local(b)).count();
        let window_layers = self.window.local_layers();
        let window_saved_bytes = (without_window * window_layers * self.layout.block_layer_bytes()) as u64;
        self.release_blocks(&mut seq);
        if let Some(Parked::Swapped(h)) = seq.parked.take() {
            self.cache.drop_swap(h);
        }
        // Counted before the final event goes out, so whoever sees the event also sees
        // the count (a test or a scrape reading stats right after a reply ended).
        self.shared.in_flight.fetch_sub(1, Ordering::SeqCst);
        {
            let mut st = self.shared.stats.lock().unwrap_or_else(|p| p.into_inner());
            st.finished += 1;
            if reason == FinishReason::Cancelled {
                st.cancelled += 1;
            }
        }
        let event = seq.finish_event(reason, window_saved_bytes);
        let _ = seq.events.send(event);
    }

    fn release_blocks(&mut self, seq: &mut Sequence) {
        let blocks = std::mem::take(&mut seq.blocks);
        if let Err(e) = self.cache.release(&blocks) {
            // A double release is a scheduler bug; the cache refused it and
            // its accounting is intact, so report and carry on.
            tracing::error!(seq = seq.id.0, error = %e, "block release refused");
        }
        seq.computed = 0;
        seq.registered = 0;
        seq.trimmed = 0;
        seq.links.clear();
    }

    /// Tries to give `seq` blocks for its first `upto` tokens, with memory for the
    /// window layers of every block its next rows (up to `upto`) write or read. All or
    /// nothing.
    fn grow_blocks(&mut self, seq_idx: usize, upto: usize) -> bool {
        let bt = self.layout.block_tokens;
        let need = upto.div_ceil(bt).saturating_sub(self.running[seq_idx].blocks.len());
        let mut store = ArenaStore { backend: &self.backend, kv: &mut self.kv, block_bytes: self.layout.block_bytes() };
        let new = match self.cache.allocate(need, &mut store) {
            Ok(b) => b,
            Err(_) => return false,
        };
        let seq = &mut self.running[seq_idx];
        seq.blocks.extend(&new);
        let first = self.window.reclaimable_blocks(seq.computed).min(seq.blocks.len());
        let last = upto.div_ceil(bt).min(seq.blocks.len());
        if self.cache.ensure_local(&seq.blocks[first..last.max(first)], &mut store).is_err() {
            seq.blocks.truncate(seq.blocks.len() - new.len());
            if let Err(e) = self.cache.release(&new) {
                tracing::error!(seq = seq.id.0, error = %e, "release of new blocks refused");
            }
            return false;
        }
        true
    }

    /// Gives back the window layers' memory of `seq`'s blocks that no row after its
    /// computed tokens reads. The platform prefix (the shared system prompt) keeps
    /// them: new conversations start inside its window.
    fn trim_window(&mut self, seq_idx: usize) {
        let bt = self.layout.block_tokens;
        let seq = &mut self.running[seq_idx];
        let upto = self.window.reclaimable_blocks(seq.computed).min(seq.blocks.len());
        let from = seq.trimmed.max(seq.request.platform_prefix_len / bt);
        if upto > from {
            let mut store = ArenaStore { backend: &self.backend, kv: &mut self.kv, block_bytes: self.layout.block_bytes() };
            self.cache.trim_local(&seq.blocks[from..upto], &mut store);
        }
        seq.trimmed = seq.trimmed.max(upto);
    }

    /// Parks running sequence `i` back at the front of the queue, its full
    /// blocks published first so a recompute finds them in the prefix cache.
    fn park(&mut self, i: usize) {
        let mut seq = self.running.remove(i);
        register_full_blocks(&mut self.cache, self.layout.block_tokens, &mut seq);
        let mut parked = Parked::Recompute;
        if self.config.preemption == super::PreemptionMode::Swap && !seq.blocks.is_empty() {
            let mut store = ArenaStore { backend: &self.backend, kv: &mut self.kv, block_bytes: self.layout.block_bytes() };
            if let Ok(h) = self.cache.swap_out(&seq.blocks, &mut store) {
                seq.blocks.clear();
                parked = Parked::Swapped(h);
            }
        }
        if matches!(parked, Parked::Recompute) {
            self.release_blocks(&mut seq);
        }
        seq.parked = Some(parked);
        self.shared.stats.lock().unwrap_or_else(|p| p.into_inner()).preemptions += 1;
        tracing::debug!(seq = seq.id.0, "preempted");
        self.waiting.push_front(seq);
    }

    /// Takes the head of the queue and tries to start it: swap its blocks
    /// back in, or match the prefix cache and reserve blocks for the rest.
    fn start_head(&mut self) -> Admission {
        let bt = self.layout.block_tokens;
        let Some(mut seq) = self.waiting.pop_front() else { return Admission::NoRoom };
        let ok = match seq.parked.take() {
            Some(Parked::Swapped(h)) => {
                let mut store = ArenaStore { backend: &self.backend, kv: &mut self.kv, block_bytes: self.layout.block_bytes() };
                match self.cache.swap_in(h, &mut store) {
                    Ok(blocks) => {
                        // Swap-out kept `computed`: a sequence parked mid-prefill
                        // has blocks reserved past it that hold nothing yet.
                        seq.computed = seq.computed.min(blocks.len() * bt);
                        seq.registered = seq.computed / bt;
                        // The swapped-in copies are private; the links still
                        // name the published blocks they equal.
                        seq.links.resize(seq.registered, None);
                        seq.blocks = blocks;
                        true
                    }
                    Err(KvError::SwapIn { handle, source }) => {
                        tracing::debug!(error = %source, "swap-in deferred");
                        seq.parked = Some(Parked::Swapped(handle));
                        false
                    }
                    Err(e) => {
                        // The handle is gone (not ours): recompute instead.
                        tracing::error!(error = %e, "swap-in failed");
                        seq.parked = Some(Parked::Recompute);
                        false
                    }
                }
            }
            _ => self.start_fresh(&mut seq),
        };
        if !ok {
            self.waiting.push_front(seq);
            return Admission::NoRoom;
        }
        if let Some(first) = seq.imported_first.take() {
            // The peer drew this token from the sampler's first draw.
            seq.sampler.skip_draw();
            let sampled = Sampled { token: first.id, logprob: first.logprob, top_logprobs: first.top_logprobs };
            if let Some(reason) = accept_token(&mut seq, sampled, &self.tokenizer, self.max_context, &self.shared) {
                self.finish(seq, reason);
                return Admission::Finished;
            }
        }
        self.running.push(seq);
        Admission::Running
    }

    /// Matches the prefix cache and reserves blocks for the rest of the
    /// sequence's tokens. All or nothing.
    fn start_fresh(&mut self, seq: &mut Sequence) -> bool {
        let bt = self.layout.block_tokens;
        seq.local_layers_absent_below = 0;
        // At least one token must be computed to get logits.
        let matchable = (seq.tokens.len() - 1) / bt;
        seq.chain.update(&seq.tokens[..matchable * bt]);
        let need_total = (seq.tokens.len() + 1).div_ceil(bt);
        let mut store = ArenaStore { backend: &self.backend, kv: &mut self.kv, block_bytes: self.layout.block_bytes() };
        let m = self.cache.match_prefix(&seq.chain.keys(&seq.tokens, matchable), &mut store);
        let rest = need_total - m.blocks.len();
        match self.cache.allocate(rest, &mut store) {
            Ok(more) => {
                let matched = m.blocks.len();
                let cached = matched * bt;
                let cached_tier2 = m.tier2_hits * bt;
                seq.blocks = m.blocks;
                seq.blocks.extend(more);
                seq.links = m.links.into_iter().map(Some).collect();
                seq.computed = cached;
                seq.registered = cached / bt;
                if let Some(import) = seq.import.take() {
                    let has_first = import.first_token.is_some();
                    let used = match plan_import(matched, import.start_block, import.blocks.len(), bt, seq.prompt_len, has_first) {
                        ImportPlan::Gap => {
                            tracing::debug!(seq = seq.id.0, matched, start = import.start_block, "import not contiguous with the cache; computing locally");
                            ImportUse::NotContiguous
                        }
                        ImportPlan::Use { first, end, computed }
                            if self
                                .cache
                                .ensure_local(&seq.blocks[self.window.reclaimable_blocks(computed).clamp(first, end)..end], &mut store)
                                .is_err() =>
                        {
                            tracing::debug!(seq = seq.id.0, "no memory for the import's window layers; computing locally");
                            ImportUse::NoWindowMemory
                        }
                        ImportPlan::Use { first, end, computed } => {
                            // Blocks behind every window of the rows after `computed` get
                            // no window layers' memory: the import's zeros there are dropped.
                            let ids: Vec<usize> = seq.blocks[first..end].iter().map(|b| b.index()).collect();
                            let range = first - import.start_block..end - import.start_block;
                            let copied = match &import.blocks {
                                // On the device: copied there where the backend can, else
                                // through the host like a host import.
                                ImportBlocks::Device(d) if store.backend.kv_blocks_in_device(store.kv, &ids, &d.addrs[range.clone()]) => Ok(()),
                                blocks => blocks.host(range).map(|blocks| {
                                    let data: Vec<&[u8]> = blocks.iter().map(Vec::as_slice).collect();
                                    store.backend.kv_blocks_in(store.kv, &ids, &data);
                                }),
                            };
                            match copied {
                                Ok(()) => {
                                    // The sender may have left these blocks' local layers out (the
                                    // receiver skipped them by the same rule, continuing at `computed`).
                                    seq.local_layers_absent_below = self.window.partial_blocks(computed).min(end);
                                    seq.computed = computed;
                                    seq.imported_first = import.first_token;
                                    ImportUse::Used
                                }
                                Err(e) => {
                                    tracing::warn!(seq = seq.id.0, error = %e, "the import's device blocks could not be copied; computing locally");
                                    ImportUse::DeviceCopyFailed
                                }
                            }
                        }
                    };
                    // Sent before the imported first token is: a caller reading the
                    // token finds the answer already there.
                    if let Some(tx) = seq.import_use.take() {
                        let _ = tx.send(used);
                    }
                }
                if seq.cached_tokens.is_none() {
                    seq.cached_tokens = Some(cached.min(seq.prompt_len));
                    let mut st = self.shared.stats.lock().unwrap_or_else(|p| p.into_inner());
                    st.prompt_tokens += seq.prompt_len as u64;
                    st.cached_prompt_tokens += cached.min(seq.prompt_len) as u64;
                    st.cached_tier2_prompt_tokens += cached_tier2.min(seq.prompt_len) as u64;
                }
                true
            }
            Err(_) => {
                if let Err(e) = self.cache.release(&m.blocks) {
                    tracing::error!(error = %e, "release of matched blocks refused");
                }
                false
            }
        }
    }

    /// The prefill tokens that fit beside the decode rows the next step will
    /// run under the ITL target (`usize::MAX` without a target or decode rows;
    /// the planner applies its floor).
    fn prefill_budget(&self) -> usize {
        let Some(target) = self.config.itl_target else { return usize::MAX };
        let (mut rows, mut attended) = (0, 0);
        for s in self.running.iter().filter(|s| s.tokens.len() - s.computed == 1) {
            rows += 1;
            attended += s.tokens.len();
        }
        if rows == 0 {
            return usize::MAX;
        }
        // Each prefill token attends about as far as the prompt it belongs to
        // (an upper bound: the chunk starts before its end).
        let context = self
            .running
            .iter()
            .find(|s| s.tokens.len() - s.computed > 1)
            .or(self.waiting.front())
            .map_or(0, |s| s.tokens.len());
        let cap = self.config.step_token_budget.saturating_sub(rows);
        self.cost.prefill_budget(target, rows.min(self.config.step_token_budget), attended, context, cap)
    }

    /// Whether a prompt still to prefill has waited past `prefill_wait_limit`
    /// (its share of the TTFT budget): then the streams yield to it.
    fn prompt_overdue(&self) -> bool {
        let mut prefilling = self.running.iter().filter(|s| s.tokens.len() - s.computed > 1).chain(self.waiting.front());
        prefilling.any(|s| s.submitted.elapsed() > self.config.prefill_wait_limit)
    }

    fn step(&mut self) {
        if let Some(prev) = self.in_flight.take() {
            // Step N is queued and its tokens not yet read: queue step N+1 fed from them
            // on the device, then take step N's tokens while N+1 runs.
            match self.launch_ahead(&prev) {
                Some(next) => {
                    self.complete(prev);
                    self.in_flight = Some(next);
                    return;
                }
                None => self.complete(prev),
            }
        }
        let started = Instant::now();
        let prefill_budget = self.prefill_budget();
        let limits = Limits {
            step_token_budget: self.config.step_token_budget,
            prefill_token_budget: if prefill_budget == usize::MAX || self.prompt_overdue() { usize::MAX } else { prefill_budget },
            max_running: self.config.max_running,
            block_tokens: self.layout.block_tokens,
        };
        let plan = plan_step(self, limits);
        let rows = plan.tokens();
        let slices = plan.slices;
        if slices.is_empty() {
            if plan.reject_head {
                // The head of the queue can never fit: fail it rather than spin.
                if let Some(mut seq) = self.waiting.pop_front() {
                    let err = EngineError::Config(format!(
                        "a sequence of {} tokens cannot get KV blocks ({} free)",
                        seq.tokens.len(),
                        self.cache.available_for_allocation()
                    ));
                    let _ = seq.events.send(Event::Failed(err));
                    seq.events = tokio::sync::mpsc::unbounded_channel().0;
                    self.finish(seq, FinishReason::Cancelled);
                }
            }
            return;
        }
        let bt = self.layout.block_tokens;
        let tables: Vec<Vec<u32>> = slices.iter().map(|sl| self.running[sl.seq].blocks.iter().map(|b| b.0).collect()).collect();
        let mut tokens = Vec::with_capacity(rows);
        let mut positions = Vec::with_capacity(rows);
        let mut slots = Vec::with_capacity(rows);
        let mut attn = Vec::with_capacity(rows);
        let mut logit_rows = Vec::new();
        for (sl, table) in slices.iter().zip(&tables) {
            let s = &self.running[sl.seq];
            for p in sl.start..sl.start + sl.len {
                tokens.push(s.tokens[p]);
                positions.push(p as u32);
                slots.push((table[p / bt], (p % bt) as u32));
                attn.push(AttnRow { block_table: table, pos: p });
            }
            if sl.wants_logits {
                logit_rows.push(tokens.len() - 1);
            }
        }
        let launched = self.launched(&slices, &positions, prefill_budget, started);
        let input = StepInput { tokens: &tokens, positions: &positions, slots: &slots, attn: &attn, logit_rows: &logit_rows };
        let jobs = self.layer_jobs(&slices);
        if jobs.is_empty() {
            self.model.step(&self.backend, &mut self.kv, &input, &mut self.scratch);
        } else {
            let bl = self.layout.block_layer_bytes();
            let mut on_layer = |backend: &B, kv: &B::Kv, layer: usize| {
                for job in &jobs {
                    job.send(layer, backend.kv_blocks_layer_out(kv, &job.arena, layer, bl));
                }
            };
            self.model.step_with(&self.backend, &mut self.kv, &input, &mut self.scratch, &mut on_layer);
            for job in &jobs {
                if let Some(ExportTo::Layers(x)) = &mut self.running[job.seq].export {
                    job.sent(x);
                }
            }
        }
        if jobs.is_empty() && self.may_run_ahead_from(&slices) {
            if let Some(picks) = self.model.greedy_start(&self.backend, &self.scratch, logit_rows.len()) {
                self.in_flight = Some(InFlight { step: launched, picks: Some(picks) });
                return;
            }
        }
        self.complete(InFlight { step: launched, picks: None });
    }

    /// What [`Worker::complete`] needs of a step about to be queued: whose rows it
    /// runs, its shape for the cost model, and the counts it adds to the stats.
    fn launched(&self, slices: &[super::plan::Slice], positions: &[u32], prefill_budget: usize, started: Instant) -> Launched {
        let decode_rows = slices.iter().filter(|sl| sl.len == 1 && sl.wants_logits).count();
        let shape = StepShape { decode_rows, prefill_tokens: positions.len() - decode_rows, attended: positions.iter().map(|&p| p as usize + 1).sum() };
        let (mut decode_tokens, mut prefill_tokens) = (0, 0);
        for sl in slices {
            let s = &self.running[sl.seq];
            if sl.len == 1 && s.computed + 1 == s.tokens.len() && s.generated > 0 {
                decode_tokens += 1;
            } else {
                prefill_tokens += sl.len as u64;
            }
        }
        let rows = slices.iter().map(|sl| LaunchedRow { id: self.running[sl.seq].id, hint: sl.seq, len: sl.len, wants_logits: sl.wants_logits }).collect();
        Launched { rows, shape, predicted: self.cost.predict(shape), started, prefill_budget, decode_tokens, prefill_tokens }
    }

    /// Whether the step of `slices` may leave its tokens on the backend for a next
    /// step to be queued before they are read: every row decodes one greedy token (so the
    /// next step's rows are known, one position further), no prompt leaves with it,
    /// and no block changes its layers' memory as the window slides (a grouped arena
    /// remaps units between steps, which a queued step would not see; a plain one,
    /// CUDA's, keeps every layer of a block for good).
    fn may_run_ahead_from(&self, slices: &[super::plan::Slice]) -> bool {
        !self.cache.is_grouped()
            && slices.iter().all(|sl| {
                let s = &self.running[sl.seq];
                sl.len == 1 && sl.wants_logits && s.sampler.is_plain_greedy() && s.export.is_none()
            })
    }

    /// Queues the step after `prev` (still running, its tokens unread) with each
    /// row's token taken from `prev`'s picks on the device; `None`, having queued
    /// nothing, when the next step is not the same streams one token further (a
    /// sequence waits to start, memory runs short, the backend declines).
    fn launch_ahead(&mut self, prev: &InFlight) -> Option<InFlight> {
        let picks = prev.picks.as_ref()?;
        if !self.waiting.is_empty() || self.running.len() != prev.step.rows.len() {
            return None;
        }
        let started = Instant::now();
        let bt = self.layout.block_tokens;
        // Each stream one row further, fed by its pick, unless the pick is surely its last.
        let mut next = Vec::with_capacity(prev.step.rows.len());
        for (pick, row) in prev.step.rows.iter().enumerate() {
            let i = self.position_of(row)?;
            let s = &self.running[i];
            debug_assert_eq!(s.tokens.len(), s.computed + 1, "a decode row computes its sequence's last token");
            if ends_at_next_token(s, self.max_context) {
                continue;
            }
            let pos = s.computed + 1;
            if !self.grow_blocks(i, pos + 1) {
                return None;
            }
            next.push((i, pos, pick as u32));
        }
        if next.is_empty() {
            return None;
        }
        let tables: Vec<Vec<u32>> = next.iter().map(|&(i, _, _)| self.running[i].blocks.iter().map(|b| b.0).collect()).collect();
        let positions: Vec<u32> = next.iter().map(|&(_, pos, _)| pos as u32).collect();
        let slots: Vec<(u32, u32)> = next.iter().zip(&tables).map(|(&(_, pos, _), t)| (t[pos / bt], (pos % bt) as u32)).collect();
        let attn: Vec<AttnRow> = next.iter().zip(&tables).map(|(&(_, pos, _), t)| AttnRow { block_table: t, pos }).collect();
        let from: Vec<u32> = next.iter().map(|&(_, _, pick)| pick).collect();
        let logit_rows: Vec<usize> = (0..next.len()).collect();
        // Placeholders: the backend puts the picks there.
        let tokens = vec![0u32; next.len()];
        let input = StepInput { tokens: &tokens, positions: &positions, slots: &slots, attn: &attn, logit_rows: &logit_rows };
        if !self.model.step_fed(&self.backend, &mut self.kv, &input, &mut self.scratch, picks, &from) {
            return None;
        }
        let slices: Vec<super::plan::Slice> = next.iter().map(|&(i, pos, _)| super::plan::Slice { seq: i, start: pos, len: 1, wants_logits: true }).collect();
        let mut step = self.launched(&slices, &positions, self.prefill_budget(), started);
        // Counted as it will stand once the previous step's tokens are in: every row decodes.
        (step.decode_tokens, step.prefill_tokens) = (next.len() as u64, 0);
        let picks = self.model.greedy_start(&self.backend, &self.scratch, next.len());
        self.shared.stats.lock().unwrap_or_else(|p| p.into_inner()).run_ahead_steps += 1;
        Some(InFlight { step, picks })
    }

    /// Where the sequence of `row` is in the running queue now (`None`: it ended).
    fn position_of(&self, row: &LaunchedRow) -> Option<usize> {
        match self.running.get(row.hint) {
            Some(s) if s.id == row.id => Some(row.hint),
            _ => self.running.iter().position(|s| s.id == row.id),
        }
    }

    /// Takes the tokens of a queued step (waiting for them if they are still on
    /// the backend) into its sequences, and finishes those that end.
    fn complete(&mut self, done_step: InFlight) {
        let InFlight { step, picks } = done_step;
        let logit_count = step.rows.iter().filter(|r| r.wants_logits).count();
        // Rows that all take the argmax and want no log-probabilities are sampled where
        // the logits are: 8 bytes a row come back instead of the vocabulary.
        let all_greedy = || step.rows.iter().filter(|r| r.wants_logits).filter_map(|r| self.position_of(r)).all(|i| self.running[i].sampler.is_plain_greedy());
        let mut picked = match picks {
            Some(p) => Some(self.backend.greedy_rows_finish(p)),
            None if all_greedy() => self.model.greedy(&self.backend, &self.scratch, logit_count),
            None => None,
        }
        .map(Vec::into_iter);
        let logits = if picked.is_some() { Vec::new() } else { self.model.logits(&self.backend, &self.scratch, logit_count) };
        {
            let mut st = self.shared.stats.lock().unwrap_or_else(|p| p.into_inner());
            st.steps += 1;
            st.decode_tokens += step.decode_tokens;
            st.prefill_tokens += step.prefill_tokens;
        }
        let bt = self.layout.block_tokens;
        let vocab = self.model.config.vocab;
        let mut done: Vec<(SeqId, FinishReason)> = Vec::new();
        let mut discarded = 0;
        let mut next_li = 0;
        for row in &step.rows {
            // The index of this row's logits (or pick), if it has any.
            let li = row.wants_logits.then(|| {
                next_li += 1;
                next_li - 1
            });
            let pick = li.and_then(|_| picked.as_mut().and_then(Iterator::next));
            let Some(i) = self.position_of(row) else {
                // Its sequence ended at the step before, while this one was queued.
                discarded += 1;
                continue;
            };
            let seq = &mut self.running[i];
            seq.computed += row.len;
            register_full_blocks(&mut self.cache, bt, seq);
            self.trim_window(i);
            let Some(li) = li else { continue };
            let seq = &mut self.running[i];
            let sampled = match pick {
                Some(row) => greedy_sampled(row),
                None => seq.sampler.sample(&logits[li * vocab..(li + 1) * vocab]),
            };
            let reason = sample_into(seq, sampled, &self.tokenizer, self.max_context, &self.shared);
            if seq.generated == 1 {
                match seq.export.take() {
                    Some(ExportTo::Whole { start, tx }) => {
                        let seq = &self.running[i];
                        let _ = tx.send(self.export_blocks(seq, start));
                    }
                    Some(ExportTo::Layers(x)) => x.finish(seq.prompt_len, bt),
                    None => {}
                }
            }
            if let Some(reason) = reason {
                done.push((self.running[i].id, reason));
            }
        }
        for (id, reason) in done {
            if let Some(i) = self.running.iter().position(|s| s.id == id) {
                let seq = self.running.remove(i);
                self.finish(seq, reason);
            }
        }
        // Planning, the forward pass and sampling: what a stream waits between tokens
        // (from the previous step's end where this step was queued before it).
        let ended = Instant::now();
        let measured = ended.duration_since(step.started.max(self.last_completed)).as_secs_f64();
        self.last_completed = ended;
        self.cost.observe(step.shape, measured);
        if step.shape.decode_rows > 0 {
            self.recent.push(ended, measured);
        }
        let mut st = self.shared.stats.lock().unwrap_or_else(|p| p.into_inner());
        st.run_ahead_discarded_rows += discarded;
        st.predicted_step_seconds += step.predicted;
        st.measured_step_seconds += measured;
        st.prefill_budget_tokens = if step.shape.decode_rows > 0 { step.prefill_budget.min(self.config.step_token_budget) } else { self.config.step_token_budget };
        st.step_cost = Some(self.cost.cost());
    }

    /// Completes the step in flight, if there is one: before anything changes the
    /// running sequences or their blocks from outside a step.
    fn drain(&mut self) {
        if let Some(step) = self.in_flight.take() {
            self.complete(step);
        }
    }

    fn publish_stats(&mut self, busy: f64) {
        let mut st = self.shared.stats.lock().unwrap_or_else(|p| p.into_inner());
        st.kv = self.cache.stats();
        st.running = self.running.len();
        st.waiting = self.waiting.len();
        st.swapped = self.waiting.iter().filter(|s| matches!(s.parked, Some(Parked::Swapped(_)))).count();
        st.busy_seconds += busy;
        self.recent.expire(Instant::now());
        st.step_p95_seconds = self.recent.p95();
        if self.running.is_empty() {
            // Nothing decodes: the whole step budget is prefill's.
            st.prefill_budget_tokens = self.config.step_token_budget;
        }
    }
}

/// The worker's queues and block cache, as the planner drives them.
impl<B: Backend> Queues for Worker<B> {
    fn running_len(&self) -> usize {
        self.running.len()
    }
    fn progress(&self, running: usize) -> SeqProgress {
        let s = &self.running[running];
        SeqProgress { id: s.id, tokens: s.tokens.len(), computed: s.computed, blocks: s.blocks.len() }
    }
    fn has_waiting(&self) -> bool {
        !self.waiting.is_empty()
    }
    fn grow(&mut self, running: usize, upto: usize) -> bool {
        self.grow_blocks(running, upto)
    }
    fn preempt(&mut self, running: usize) {
        self.park(running);
    }
    fn admit_head(&mut self) -> Admission {
        self.start_head()
    }
    fn requeue_last(&mut self) {
        // Parked, not just moved: a sequence waiting with blocks in hand would
        // have them overwritten by its next start, and they would never return.
        if let Some(last) = self.running.len().checked_sub(1) {
            self.park(last);
        }
    }
}

/// Publishes the full blocks of `seq` that hold computed tokens, each keyed by
/// this sequence's own tokens and chained to its own previous block: imported
/// bytes are published only under the identity this engine computed and compared.
fn register_full_blocks(cache: &mut KvCache, bt: usize, seq: &mut Sequence) {
    let full = seq.computed / bt;
    if full <= seq.registered {
        return;
    }
    seq.chain.update(&seq.tokens[..full * bt]);
    seq.links.resize(seq.registered, None);
    for i in seq.registered..full {
        // After a block without a link (a collision) nothing can be chained.
        let parent = match i.checked_sub(1) {
            None => None,
            Some(p) => match seq.links[p] {
                Some(link) => Some(link),
                None => {
                    seq.links.push(None);
                    continue;
                }
            },
        };
        let owner = if (i + 1) * bt <= seq.request.platform_prefix_len {
            BlockOwner::Platform
        } else {
            BlockOwner::User { owner: seq.request.owner.clone(), conversation: seq.request.conversation.clone() }
        };
        let Some(key) = seq.chain.key(&seq.tokens, i) else {
            seq.links.push(None);
            continue;
        };
        let registered = cache.register(seq.blocks[i], key, parent, &owner);
        if i < seq.local_layers_absent_below && matches!(registered, Ok(Registered::Published(_))) {
            cache.mark_without_local_layers(seq.blocks[i]);
        }
        let link = match registered {
            Ok(r @ Registered::Collision { .. }) => {
                tracing::warn!(seq = seq.id.0, block = i, "block hash collision: the block stays private");
                r.link()
            }
            Ok(r) => r.link(),
            Err(e) => {
                tracing::error!(seq = seq.id.0, error = %e, "block register refused");
                None
            }
        };
        seq.links.push(link);
    }
    seq.registered = full;
}
