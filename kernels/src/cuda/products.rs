//! Where the matrix products' cuBLAS calls run.
//!
//! A product runs as calls of exactly [`super::GEMM_ROWS`] rows (batch
//! invariance). One such call fills only part of a large GPU: at 128 rows and
//! 4,096 outputs, cuBLAS's 128 x 128 tiles make 32 thread blocks for 132
//! SMs. So the calls of a product of many rows (a prefill chunk) are spread
//! over a few side streams that run at once, each with its own cuBLAS handle
//! and workspace. Every call is still the same call on the same shape, so a
//! row's bits do not depend on which stream ran it or how many there were.
//! A decode step (at most one call per product) stays on the main stream, and
//! so does every product of a step being captured as a CUDA graph (`graph.rs`):
//! a capture records one stream's work, with no side streams to fork and join.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::sys::{CUevent, CUevent_flags, CUevent_wait_flags, CUstream};
use cudarc::driver::{result, CudaContext, DriverError};

use super::blas::BlasHandle;
use crate::backend::KernelError;

/// Side streams made at start-up (`BATON_CUDA_GEMM_STREAMS` overrides; 1 runs
/// every call on the main stream).
pub const DEFAULT_STREAMS: usize = 4;

struct Lane {
    stream: CUstream,
    blas: BlasHandle,
    /// Recorded on `stream` after its share of a product.
    done: CUevent,
}

impl Lane {
    /// A non-blocking stream (no implicit ordering with the legacy main
    /// stream: `Products::run` orders them with events), its handle and event.
    fn new() -> Result<Lane, KernelError> {
        let stream = result::stream::create(result::stream::StreamKind::NonBlocking).map_err(|e| driver("creating a stream", e))?;
        let made = result::event::create(CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(|e| driver("creating an event", e))
            .and_then(|done| match BlasHandle::new(stream as *mut c_void) {
                Ok(blas) => Ok(Lane { stream, blas, done }),
                Err(e) => {
                    // SAFETY: made just above, unused.
                    unsafe { result::event::destroy(done) }.ok();
                    Err(e)
                }
            });
        if made.is_err() {
            // SAFETY: made above, unused.
            unsafe { result::stream::destroy(stream) }.ok();
        }
        made
    }
}

/// The main stream's cuBLAS handle and the side lanes. Used under the backend's lock.
pub struct Products {
    /// Kept for Drop: the streams and events must be destroyed in a live, current context.
    ctx: Arc<CudaContext>,
    main_stream: CUstream,
    main: BlasHandle,
    lanes: Vec<Lane>,
    /// Recorded on the main stream before a product's calls: its input is ready.
    inputs_ready: CUevent,
    /// Lanes a product may use (1 = the main stream alone).
    pub streams: usize,
}

// SAFETY: raw CUDA handles, used only under the backend's mutex, in its context.
unsafe impl Send for Products {}

fn driver(op: &str, e: DriverError) -> KernelError {
    KernelError::BackendUnavailable { backend: "cuda", reason: format!("{op}: {e:?}") }
}

impl Products {
    /// `streams` lanes (at least 1: the main stream's handle alone). `ctx`
    /// must be current.
    pub fn new(ctx: &Arc<CudaContext>, main_stream: CUstream, streams: usize) -> Result<Products, KernelError> {
        let main = BlasHandle::new(main_stream as *mut c_void)?;
        let inputs_ready = result::event::create(CUevent_flags::CU_EVENT_DISABLE_TIMING).map_err(|e| driver("creating an event", e))?;
        let mut p = Products { ctx: ctx.clone(), main_stream, main, lanes: Vec::new(), inputs_ready, streams: 1 };
        if streams > 1 {
            for _ in 0..streams {
                // Pushed whole, so on an error Drop frees the lanes made so far.
                p.lanes.push(Lane::new()?);
            }
            p.streams = streams;
        }
        Ok(p)
    }

    /// Lanes available (the most `streams` can be).
    pub fn lanes(&self) -> usize {
        self.lanes.len().max(1)
    }

    /// Runs calls `0..calls`, each `call(handle, index)` queuing one cuBLAS
    /// call on `handle`'s stream; with more than one call and lane, the calls
    /// go round-robin over the lanes, which start after the main stream's work
    /// so far and which the main stream then waits for. `main_only` keeps every
    /// call on the main stream (a step being captured).
    pub fn run<E>(&self, calls: usize, main_only: bool, mut call: impl FnMut(&BlasHandle, usize) -> Result<(), E>) -> Result<(), KernelError>
    where
        E: std::fmt::Debug,
    {
        let lanes = if main_only { 1 } else { self.streams.min(self.lanes.len()).min(calls) };
        if lanes <= 1 {
            for c in 0..calls {
                call(&self.main, c).map_err(|e| product_failed(&e))?;
            }
            return Ok(());
        }
        let used = &self.lanes[..lanes];
        // SAFETY: live events and streams of the current context.
        unsafe {
            result::event::record(self.inputs_ready, self.main_stream).map_err(|e| device("cuEventRecord", &e))?;
            for lane in used {
                result::stream::wait_event(lane.stream, self.inputs_ready, CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT).map_err(|e| device("cuStreamWaitEvent", &e))?;
            }
        }
        let mut outcome = Ok(());
        for c in 0..calls {
            if let Err(e) = call(&used[c % lanes].blas, c) {
                outcome = Err(product_failed(&e));
                break;
            }
        }
        // Join every lane back, even after a failed call, so nothing queued later
        // on the main stream can overtake work still running on a lane.
        for lane in used {
            // SAFETY: as above.
            unsafe {
                result::event::record(lane.done, lane.stream).map_err(|e| device("cuEventRecord", &e))?;
                result::stream::wait_event(self.main_stream, lane.done, CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT).map_err(|e| device("cuStreamWaitEvent", &e))?;
            }
        }
        outcome
    }
}

/// A failed stream or event call of the driver.
fn device(call: &'static str, e: &impl std::fmt::Debug) -> KernelError {
    KernelError::Device { call, detail: format!("{e:?}") }
}

/// A failed product call (its own status, as the caller's closure gave it).
fn product_failed(e: &impl std::fmt::Debug) -> KernelError {
    device("a cuBLAS product", e)
}

impl Drop for Products {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        for lane in self.lanes.drain(..) {
            // SAFETY: each stream and event was made by `new` and is destroyed once,
            // after its queued work and after its cuBLAS handle.
            unsafe {
                let _ = result::stream::synchronize(lane.stream);
                drop(lane.blas);
                let _ = result::event::destroy(lane.done);
                let _ = result::stream::destroy(lane.stream);
            }
        }
        // SAFETY: made by `new`, destroyed once.
        unsafe {
            let _ = result::event::destroy(self.inputs_ready);
        }
    }
}
