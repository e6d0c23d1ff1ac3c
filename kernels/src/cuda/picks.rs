//! Greedy picks on the device (`argmax_rows` in sampling.cu), kept in buffers
//! reused from step to step, and their way to the host.
//!
//! [`Backend::greedy_rows`](crate::Backend::greedy_rows) waits for them at once.
//! Run-ahead decoding ([`crate::run_ahead`]) does not: the picks' download to a
//! page-locked half is queued behind the kernel and an event recorded, the next
//! step copies the picks it needs from `token` into its own staged tokens on the
//! device (`graph.rs`), and the host reads the half when it gets to it. Two
//! halves, so that step N's picks wait in one while step N+1's land in the other.

use std::sync::Arc;

use cudarc::driver::{result, CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr, DriverError};

use super::staging::HostBuf;
use crate::backend::GreedyRow;
use crate::run_ahead::{PendingPicks, PickQueue};
use crate::step::MAX_STEP_ROWS;

pub(super) struct Picks {
    /// The latest picks' tokens and statuses, a word a row.
    pub token: CudaSlice<u32>,
    pub status: CudaSlice<u32>,
    /// `rows` tokens then `rows` statuses of each ticket in flight.
    host: [HostBuf; 2],
    landed: [CudaEvent; 2],
    queue: PickQueue,
    /// Why the halves are not page-locked, if they are not (then the "asynchronous"
    /// download waits for the step: correct, without the overlap).
    pub pageable_because: Option<String>,
}

impl Picks {
    pub fn new(ctx: &Arc<CudaContext>, stream: &Arc<CudaStream>) -> Result<Picks, DriverError> {
        // Sized for the largest replayable step, so run-ahead never grows them.
        let bytes = 2 * MAX_STEP_ROWS * 4;
        let (host, pageable_because) = HostBuf::pair(ctx, bytes)?;
        Ok(Picks {
            token: stream.alloc_zeros::<u32>(MAX_STEP_ROWS)?,
            status: stream.alloc_zeros::<u32>(MAX_STEP_ROWS)?,
            host,
            landed: [ctx.new_event(None)?, ctx.new_event(None)?],
            queue: PickQueue::default(),
            pageable_because,
        })
    }

    /// Makes room for `rows` picks on the device. Not captured and not read by any
    /// graph (a fed step copies out of it before its graph runs), so no capture
    /// generation moves; a buffer dropped here is freed in stream order, after the
    /// copies already queued from it.
    pub fn reserve(&mut self, stream: &Arc<CudaStream>, rows: usize) -> Result<(), DriverError> {
        if self.token.len() < rows {
            self.token = stream.alloc_zeros::<u32>(rows.next_power_of_two())?;
            self.status = stream.alloc_zeros::<u32>(rows.next_power_of_two())?;
        }
        Ok(())
    }

    /// Whether [`Picks::start`] would take picks of `rows` rows now.
    pub fn can_start(&self, rows: usize) -> bool {
        rows <= MAX_STEP_ROWS && self.queue.can_start()
    }

    /// After `argmax_rows` of `rows` rows was queued: queues their download into a free
    /// half; `None` (nothing queued) when the rows do not fit a half or both hold unread picks.
    pub fn start(&mut self, stream: &Arc<CudaStream>, rows: usize) -> Result<Option<PendingPicks>, DriverError> {
        if !self.can_start(rows) {
            return Ok(None);
        }
        let (picks, half) = self.queue.start(rows).expect("a free half (checked above)");
        let host = self.host[half].as_mut_slice();
        let (token, _t) = self.token.device_ptr(stream);
        let (status, _s) = self.status.device_ptr(stream);
        // SAFETY: both device buffers hold at least `rows` words (`reserve`), the half
        // 2 x MAX_STEP_ROWS; it is not read before its event, nor refilled before its
        // ticket is finished.
        unsafe {
            result::memcpy_dtoh_async(&mut host[..4 * rows], token, stream.cu_stream())?;
            result::memcpy_dtoh_async(&mut host[4 * rows..8 * rows], status, stream.cu_stream())?;
        }
        self.landed[half].record(stream)?;
        Ok(Some(picks))
    }

    /// Waits for `picks` to land and decodes them.
    pub fn finish(&mut self, picks: PendingPicks) -> Result<Vec<GreedyRow>, DriverError> {
        let rows = picks.rows;
        let half = self.queue.finish(picks);
        self.landed[half].synchronize()?;
        let bytes = self.host[half].as_slice();
        let word = |i: usize| u32::from_ne_bytes(bytes[4 * i..4 * i + 4].try_into().expect("four bytes"));
        Ok((0..rows).map(|r| GreedyRow::from_kernel(word(r), word(rows + r))).collect())
    }

    /// Whether `picks` are the ones in `token` now.
    pub fn is_latest(&self, picks: &PendingPicks) -> bool {
        self.queue.is_latest(picks)
    }
}

impl Drop for Picks {
    fn drop(&mut self) {
        // No download may still write a half about to be freed.
        let _ = self.landed[0].synchronize();
        let _ = self.landed[1].synchronize();
    }
}
