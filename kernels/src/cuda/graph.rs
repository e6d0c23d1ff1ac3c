//! CUDA graphs of decode steps: a pure-decode step's hundreds of kernel
//! launches and cuBLAS calls recorded once per shape and replayed with one
//! `cuGraphLaunch`, so a step costs the GPU's time rather than the host's
//! launch overhead.
//!
//! How a step becomes replayable (`Backend::decode_step`):
//! - The engine pads a decode-shaped step to its batch bucket
//!   (`crate::step`); its [`StepShape`] is the bucket and the attention
//!   capacity (partitions a row may have, a power of two).
//! - Its inputs are written into page-locked host memory (two halves, so
//!   filling one never waits for the copy out of the other) and copied with
//!   one asynchronous copy into the shape's device buffer (`Scratch::step_words`,
//!   allocated once per shape); every kernel of the step reads them from there
//!   (`step_inputs.rs`), and attention launches the capacity's fixed grid.
//! - The first step of a shape runs eagerly from those buffers (which grows
//!   every scratch buffer to the shape); the next is captured (stream capture,
//!   thread-local mode) and instantiated, and it and every later one replays.
//!
//! - Run-ahead decoding (`crate::run_ahead`) feeds a step the last step's
//!   greedy picks: after the staging copy, device-to-device copies put them
//!   over the step's staged tokens, so the step is queued before the host has
//!   seen its tokens, eager, captured or replayed alike.
//!
//! A graph holds device addresses, so it is valid only while no buffer it
//! captured is reallocated: [`crate::step::CaptureGuard`] counts every allocation of a
//! tensor, scratch buffer or arena (its generation), and a graph captured at
//! another generation is captured again. During a capture the guard refuses
//! allocations and pageable uploads (which a capture cannot hold); anything
//! refused, or any capture error, throws the capture away, runs the step
//! eagerly and logs why. A shape that fails [`MAX_FAILURES`] times stays
//! eager. Graphs are keyed by the caller's program (its scratch buffers), the
//! arena and the shape; at most [`MAX_GRAPHS`] are kept.
//!
//! `BATON_CUDA_GRAPHS=0` turns graphs off: the backend then runs every step
//! eagerly on the legacy default stream, as before graphs (A/B comparisons).

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::sys::{CUdeviceptr, CUgraph, CUgraphExec, CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{result, CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DriverError};

use super::staging::HostBuf;
use super::step_inputs::{StepLayout, StepShape};
use super::{fail, CudaBackend, CudaKv};
use crate::run_ahead::fed_runs;
use crate::step::StepInput;

/// Graphs kept at once; past it every graph is dropped (shapes in use are
/// captured again on their next steps).
pub const MAX_GRAPHS: usize = 64;
/// Failed captures of one shape before it stays eager.
pub const MAX_FAILURES: u32 = 3;
/// Words of host staging per half to start with (grown for larger shapes).
const INITIAL_WORDS: usize = 1 << 16;

/// Whether `BATON_CUDA_GRAPHS` leaves graphs on (unset, `1`, `on`, `true`).
pub fn graphs_enabled() -> Result<bool, String> {
    match std::env::var("BATON_CUDA_GRAPHS").as_deref() {
        Err(_) | Ok("1") | Ok("on") | Ok("true") => Ok(true),
        Ok("0") | Ok("off") | Ok("false") => Ok(false),
        Ok(other) => Err(format!("BATON_CUDA_GRAPHS={other}: expected 1 or 0 (on or off)")),
    }
}

/// Which captured step a graph is: whose buffers (`program`, the caller's
/// scratch), which arena, which shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct GraphKey {
    pub program: usize,
    pub arena: u64,
    pub shape: StepShape,
}

/// The step under way, for the kernels that read its inputs.
pub(super) struct ActiveStep {
    pub key: GraphKey,
    pub layout: StepLayout,
    /// Bounds the host checks an eager step against (the embedding table's
    /// rows, the rope table's positions), seen while this step ran eagerly or
    /// was captured; a replay checks its inputs against them.
    pub limits: StepLimits,
}

#[derive(Clone, Copy, Debug, Default)]
pub(super) struct StepLimits {
    pub tokens: Option<usize>,
    pub positions: Option<usize>,
}

impl StepLimits {
    pub fn tokens(&mut self, n: usize) {
        self.tokens = Some(self.tokens.map_or(n, |t| t.min(n)));
    }

    pub fn positions(&mut self, n: usize) {
        self.positions = Some(self.positions.map_or(n, |p| p.min(n)));
    }

    fn check(&self, step: &StepInput) -> Result<(), String> {
        if let Some(&t) = self.tokens.and_then(|n| step.tokens.iter().find(|&&t| t as usize >= n)) {
            return Err(format!("token {t} beyond the embedding table"));
        }
        if let Some(&p) = self.positions.and_then(|n| step.positions.iter().find(|&&p| p as usize >= n)) {
            return Err(format!("position {p} beyond the rope table"));
        }
        Ok(())
    }
}

/// An instantiated graph: its exec and the graph it came from, destroyed
/// together (an exec still running is freed by the driver when it completes).
/// Our own rather than cudarc's `CudaGraph`, whose `end_capture` leaks the
/// graph when `cuGraphInstantiate` fails and instantiates even a capture
/// that is about to be thrown away.
struct Captured {
    graph: CUgraph,
    exec: CUgraphExec,
    stream: Arc<CudaStream>,
}
// SAFETY: a CUgraphExec is used by one thread at a time (under `CudaBackend::graphs`).
unsafe impl Send for Captured {}

impl Captured {
    /// Instantiates `graph`, taking ownership of it (destroyed on failure too).
    fn instantiate(graph: CUgraph, stream: &Arc<CudaStream>) -> Result<Captured, DriverError> {
        // Graphs hold no allocations (the guard refuses them), so freeing on launch changes nothing.
        // SAFETY: a graph just returned by cuStreamEndCapture, owned here.
        match unsafe { result::graph::instantiate(graph, CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH) } {
            Ok(exec) => Ok(Captured { graph, exec, stream: stream.clone() }),
            Err(e) => {
                // SAFETY: as above; nothing else refers to it.
                unsafe { result::graph::destroy(graph) }.ok();
                Err(e)
            }
        }
    }

    fn launch(&self) -> Result<(), DriverError> {
        self.stream.context().bind_to_thread()?;
        // SAFETY: a live exec, launched on the stream it was captured on.
        unsafe { result::graph::launch(self.exec, self.stream.cu_stream()) }
    }
}

impl Drop for Captured {
    fn drop(&mut self) {
        let _ = self.stream.context().bind_to_thread();
        // SAFETY: made by `instantiate`, destroyed once; the driver defers freeing a running exec.
        unsafe {
            result::graph::exec_destroy(self.exec).ok();
            result::graph::destroy(self.graph).ok();
        }
    }
}

struct Entry {
    /// The graph and the generation it was captured at.
    graph: Option<(Captured, u64)>,
    /// The generation after this shape's last eager run: capture when it still holds.
    warm_at: Option<u64>,
    failures: u32,
    limits: StepLimits,
}

/// Counts for `describe` and the benchmark.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GraphStats {
    pub captures: u64,
    pub replays: u64,
    /// Steps run eagerly because a capture failed or the step did not fit.
    pub fallbacks: u64,
    /// Steps whose tokens were the last step's picks, copied on the device (run-ahead).
    pub fed: u64,
}

/// Captured graphs and the page-locked staging of step inputs.
pub(super) struct Graphs {
    pub enabled: bool,
    entries: HashMap<GraphKey, Entry>,
    host: [HostBuf; 2],
    /// Recorded after the copy out of `host[i]`.
    copied: [CudaEvent; 2],
    next: usize,
    words: Vec<u32>,
    pub stats: GraphStats,
    pub pageable_because: Option<String>,
}

impl Graphs {
    pub fn new(ctx: &Arc<CudaContext>, enabled: bool) -> Result<Graphs, DriverError> {
        let bytes = if enabled { INITIAL_WORDS * 4 } else { 4 };
        let (host, pageable_because) = HostBuf::pair(ctx, bytes)?;
        let copied = [ctx.new_event(None)?, ctx.new_event(None)?];
        Ok(Graphs { enabled, entries: HashMap::new(), host, copied, next: 0, words: Vec::new(), stats: GraphStats::default(), pageable_because })
    }

    /// Copies `self.words` into the next host half and from there into `dst`, asynchronously.
    fn stage(&mut self, ctx: &Arc<CudaContext>, stream: &Arc<CudaStream>, dst: &mut CudaSlice<u32>) -> Result<(), DriverError> {
        let half = self.next;
        self.next = 1 - half;
        // The copy queued from this half two steps ago must be done before it is refilled.
        self.copied[half].synchronize()?;
        let bytes = self.words.len() * 4;
        if self.host[half].as_slice().len() < bytes {
            let len = bytes.next_power_of_two();
            // A page-locking refused at growth leaves this half in ordinary memory (a slower
            // copy), as at start-up, rather than failing the step.
            let pinned = match self.pageable_because {
                None => HostBuf::new(ctx, len, true).map_err(|e| self.pageable_because = Some(format!("cuMemHostAlloc of {len} bytes: {e:?}"))).ok(),
                Some(_) => None,
            };
            self.host[half] = match pinned {
                Some(buf) => buf,
                None => HostBuf::new(ctx, len, false)?,
            };
        }
        // SAFETY: a u32 slice viewed as its bytes (any bit pattern is a valid u8).
        let src = unsafe { std::slice::from_raw_parts(self.words.as_ptr().cast::<u8>(), bytes) };
        self.host[half].as_mut_slice()[..bytes].copy_from_slice(src);
        let (dptr, _guard) = dst.device_ptr_mut(stream);
        // SAFETY: `dst` holds the layout's words (allocated for it); the host half is not
        // touched again before its event says the copy is done.
        unsafe { result::memcpy_htod_async(dptr, &self.host[half].as_slice()[..bytes], stream.cu_stream()) }?;
        self.copied[half].record(stream)
    }
}

impl Drop for Graphs {
    fn drop(&mut self) {
        // No copy may still read a host half about to be freed.
        let _ = self.copied[0].synchronize();
        let _ = self.copied[1].synchronize();
    }
}

/// A fed step's tokens (`Backend::decode_step_fed`): row `i < from.len()` takes
/// the word `from[i]` of the picks at `src` (device memory).
pub(super) struct Fed<'a> {
    pub src: CUdeviceptr,
    pub from: &'a [u32],
}

/// How one step runs.
enum Run {
    Replay,
    Capture,
    Eager,
}

impl CudaBackend {
    /// `Backend::decode_step`, and with `fed` `Backend::decode_step_fed` (false,
    /// nothing queued, when a fed step cannot run from staged inputs): see the module comment.
    pub(super) fn run_decode_step(&self, kv: &mut CudaKv, step: &StepInput, program: usize, fed: Option<Fed>, body: &mut dyn FnMut(&mut CudaKv)) -> bool {
        let mut guard = self.graphs.lock().unwrap_or_else(|p| p.into_inner());
        let g = &mut *guard;
        if !g.enabled {
            if fed.is_some() {
                return false;
            }
            drop(guard);
            body(kv);
            return true;
        }
        let shape = StepShape::of(step);
        let layout = StepLayout::new(shape, kv.layout.block_tokens);
        let (arena, _) = kv.arena.device_ptr(&self.stream);
        let key = GraphKey { program, arena, shape };
        let mut s = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
        if !g.entries.contains_key(&key) && g.entries.len() >= MAX_GRAPHS {
            g.entries.clear();
            s.step_words.clear();
        }
        let limits = g.entries.get(&key).map(|e| e.limits).unwrap_or_default();
        g.words.resize(layout.words, 0);
        // The spare block past the engine's (`Backend::kv` allocates it) takes the padding rows.
        let fits = limits.check(step).and_then(|()| layout.fill(step, kv.blocks, kv.blocks as u32, &mut g.words));
        if let Err(why) = fits {
            if fed.is_some() {
                // Its tokens are on the device only: the caller reads them and runs it as usual.
                return false;
            }
            g.stats.fallbacks += 1;
            tracing::warn!(reason = %why, rows = shape.rows, parts = shape.parts, "decode step does not fit its CUDA graph; running it eagerly");
            drop((s, guard));
            body(kv);
            return true;
        }
        // Not counted as an allocation: no other shape's graph holds this buffer.
        let dst = s.step_words.entry(key).or_insert_with(|| self.stream.alloc_zeros::<u32>(layout.words).unwrap_or_else(|e| fail("allocating step inputs", e)));
        g.stage(&self.ctx, &self.stream, dst).unwrap_or_else(|e| fail("copying step inputs", e));
        if let Some(fed) = fed {
            let (words, _guard) = dst.device_ptr_mut(&self.stream);
            let tokens = words + 4 * layout.tokens.start as u64;
            for run in fed_runs(fed.from) {
                let (to, from) = (tokens + 4 * run.dst as u64, fed.src + 4 * run.src as u64);
                // SAFETY: `dst` holds the layout's tokens (run.dst + run.len <= rows), the picks
                // buffer the last step's rows (the engine feeds from those); queued after the
                // staging copy and before the step, in stream order.
                unsafe { result::memcpy_dtod_async(to, from, 4 * run.len, self.stream.cu_stream()) }.unwrap_or_else(|e| fail("feeding picks to the step", e));
            }
            g.stats.fed += 1;
        }
        s.active = Some(ActiveStep { key, layout, limits });
        drop(s);

        let generation = self.capture.generation();
        let entry = g.entries.entry(key).or_insert(Entry { graph: None, warm_at: None, failures: 0, limits });
        let run = match (&entry.graph, entry.warm_at) {
            (Some((_, at)), _) if *at == generation => Run::Replay,
            (_, Some(warm)) if warm == generation && entry.failures < MAX_FAILURES => Run::Capture,
            _ => Run::Eager,
        };
        match run {
            Run::Replay => {
                let (graph, _) = entry.graph.as_ref().expect("matched above");
                graph.launch().unwrap_or_else(|e| fail("cuGraphLaunch", e));
                g.stats.replays += 1;
            }
            Run::Capture => match self.capture_step(kv, body) {
                Ok(graph) => {
                    graph.launch().unwrap_or_else(|e| fail("cuGraphLaunch", e));
                    entry.graph = Some((graph, generation));
                    g.stats.captures += 1;
                }
                Err(why) => {
                    entry.failures += 1;
                    entry.graph = None;
                    g.stats.fallbacks += 1;
                    let gave_up = entry.failures >= MAX_FAILURES;
                    tracing::warn!(reason = %why, rows = shape.rows, parts = shape.parts, gave_up, "CUDA graph capture failed; running the step eagerly");
                    body(kv);
                    entry.warm_at = Some(self.capture.generation());
                }
            },
            Run::Eager => {
                entry.graph = None;
                body(kv);
                entry.warm_at = Some(self.capture.generation());
            }
        }
        let mut s = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(active) = s.active.take() {
            entry.limits = active.limits;
        }
        true
    }

    /// Records `body` on the main stream and instantiates it; what the guard
    /// refused, or the driver's error, otherwise. The stream leaves capture
    /// mode whatever happens.
    fn capture_step(&self, kv: &mut CudaKv, body: &mut dyn FnMut(&mut CudaKv)) -> Result<Captured, String> {
        self.stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).map_err(|e| format!("cuStreamBeginCapture: {e:?}"))?;
        self.capture.arm();
        // An operation the capture invalidated fails, and the backend panics on a failed
        // operation: caught here, so that the step falls back to eager instead.
        let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| body(kv)));
        let refused = self.capture.disarm();
        // Always ended, even after a failure (an invalidated capture still has to be
        // ended), or the stream would stay capturing and reject the eager rerun.
        // SAFETY: the stream this function began capturing.
        let ended = unsafe { result::stream::end_capture(self.stream.cu_stream()) };
        // cudarc keeps an error of a call whose result it cannot return (a buffer's free in
        // Drop: illegal in a capture for memory the graph did not allocate) and hands it to
        // the next call that binds the context; taken here, it fails this capture instead
        // of the eager rerun.
        let recorded = self.ctx.check_err();
        // A graph that is thrown away is destroyed without being instantiated.
        let discard = |graph: &Result<CUgraph, DriverError>| {
            if let Ok(&g) = graph.as_ref() {
                if !g.is_null() {
                    // SAFETY: returned by cuStreamEndCapture, owned here, used by nothing.
                    unsafe { result::graph::destroy(g) }.ok();
                }
            }
        };
        if let Err(panic) = ran {
            discard(&ended);
            let why = panic.downcast_ref::<String>().map(String::as_str).or_else(|| panic.downcast_ref::<&str>().copied()).unwrap_or("a panic");
            return Err(format!("an operation failed during capture: {why}"));
        }
        if !refused.is_empty() {
            discard(&ended);
            return Err(format!("refused during capture: {}", refused.join(", ")));
        }
        if let Err(e) = recorded {
            discard(&ended);
            return Err(format!("a deferred driver error during capture: {e:?}"));
        }
        let graph = ended.map_err(|e| format!("cuStreamEndCapture: {e:?}"))?;
        if graph.is_null() {
            return Err("the capture recorded nothing".to_string());
        }
        Captured::instantiate(graph, &self.stream).map_err(|e| format!("cuGraphInstantiate: {e:?}"))
    }

    /// Captures, replays and eager fallbacks so far.
    pub fn graph_stats(&self) -> GraphStats {
        self.graphs.lock().unwrap_or_else(|p| p.into_inner()).stats
    }

    /// Turns graphs on or off (benchmarks compare both in one process; on only
    /// if the backend was made with them, on a stream that can be captured).
    pub fn set_graphs(&self, on: bool) -> bool {
        let mut g = self.graphs.lock().unwrap_or_else(|p| p.into_inner());
        g.enabled = on && self.capturable;
        g.enabled
    }
}
