//! One layer of some KV blocks copied out of the arena during a forward pass, for a
//! pipelined export ([`crate::Backend::kv_blocks_layer_out`]), without holding up the
//! compute that follows.
//!
//! The pack kernel runs on the compute stream right after the layer's `kv_write` (stream
//! order is what makes it read the keys and values just written) into a slot's device
//! buffer; an event recorded behind it lets a side stream start the slot's device-to-host
//! DMA into page-locked memory while the compute stream goes on with the layer's attention
//! and the next layers. The copy engine then moves layer `l` while the SMs compute `l + 1`.
//! A second event marks the DMA done; [`PendingLayer::wait`] (on the consumer's thread,
//! never the engine's) waits for it, copies the bytes out and returns the slot.
//!
//! Invariants: a slot is in the free list only when no GPU work touches it (it goes back
//! after its DMA event was waited on, by `wait` or, for a dropped pending copy, by its
//! drop), so neither the pack of a later layer nor the host reads a buffer still in use.
//! Slots are made on demand and reused; there are as many as copies in flight at once.
//! Where page-locking fails a slot's host buffer is ordinary memory, into which a copy
//! returns only once done: that copy is left to `wait`, so that it holds up the consumer's
//! thread rather than the engine's until the layer is computed.

use std::sync::{Arc, Mutex};

use cudarc::driver::{result, CudaContext, CudaEvent, CudaSlice, CudaStream, DriverError};

use super::staging::HostBuf;
use crate::backend::PendingKvBytes;

/// Device and host buffers of one copy, and its two events.
pub(super) struct Slot {
    host: HostBuf,
    /// The packed layer (32-bit words, as `kv_pack` writes them).
    pub device: CudaSlice<u32>,
    /// Recorded on the compute stream after the pack.
    packed: CudaEvent,
    /// Recorded on the side stream after the DMA.
    copied: CudaEvent,
}

impl Slot {
    fn capacity(&self) -> usize {
        self.host.as_slice().len()
    }

    /// Whether its DMA can be queued behind the compute without waiting for it.
    fn pinned(&self) -> bool {
        matches!(self.host, HostBuf::Pinned { .. })
    }
}

/// Which of slots of these capacities takes a copy of `bytes`: the smallest that fits, as a
/// small layer taking a large slot would leave the next large one to allocate (page-locking
/// on the engine's thread, between two layers).
fn smallest_fitting(capacities: impl Iterator<Item = usize>, bytes: usize) -> Option<usize> {
    capacities.enumerate().filter(|&(_, c)| c >= bytes).min_by_key(|&(_, c)| c).map(|(i, _)| i)
}

/// The side stream and the free slots.
pub(super) struct LayerOut {
    ctx: Arc<CudaContext>,
    side: Arc<CudaStream>,
    free: Mutex<Vec<Slot>>,
}

impl LayerOut {
    pub fn new(ctx: &Arc<CudaContext>) -> Result<Self, DriverError> {
        Ok(LayerOut { ctx: ctx.clone(), side: ctx.new_stream()?, free: Mutex::new(Vec::new()) })
    }

    /// A free slot of at least `bytes` (a multiple of 4), made if none is large enough.
    pub fn take(&self, compute: &Arc<CudaStream>, bytes: usize) -> Result<Slot, DriverError> {
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(i) = smallest_fitting(free.iter().map(Slot::capacity), bytes) {
            return Ok(free.swap_remove(i));
        }
        drop(free);
        // Whole MiB, so that slots of a few sizes serve every chunk.
        let cap = bytes.next_multiple_of(1 << 20);
        let host = HostBuf::new(&self.ctx, cap, true).or_else(|_| HostBuf::new(&self.ctx, cap, false))?;
        Ok(Slot { host, device: compute.alloc_zeros::<u32>(cap / 4)?, packed: self.ctx.new_event(None)?, copied: self.ctx.new_event(None)? })
    }

    /// Behind whatever `compute` queued so far (the pack into `slot.device`): the DMA of
    /// its first `bytes` to the slot's host buffer, on the side stream (for a pinned slot;
    /// `PendingLayer::wait` copies into an ordinary one).
    pub fn queue_copy(&self, compute: &Arc<CudaStream>, slot: &mut Slot, bytes: usize) -> Result<(), DriverError> {
        slot.packed.record(compute)?;
        match slot.pinned() {
            true => self.copy(slot, bytes),
            false => Ok(()),
        }
    }

    /// The side stream's DMA of `slot.device[..bytes]` to its host buffer, after `packed`.
    fn copy(&self, slot: &mut Slot, bytes: usize) -> Result<(), DriverError> {
        use cudarc::driver::DevicePtr;
        self.side.wait(&slot.packed)?;
        let (src, _guard) = slot.device.device_ptr(&self.side);
        // SAFETY: `bytes` fits both buffers (`take`); nothing reads or writes the host buffer
        // before `copied` was waited on (`PendingLayer`).
        unsafe { result::memcpy_dtoh_async(&mut slot.host.as_mut_slice()[..bytes], src, self.side.cu_stream()) }?;
        slot.copied.record(&self.side)
    }

    fn put_back(&self, slot: Slot) {
        self.free.lock().unwrap_or_else(|p| p.into_inner()).push(slot);
    }
}

/// A layer's bytes on their way to the host.
pub(super) struct PendingLayer {
    pub slot: Option<Slot>,
    pub len: usize,
    pub owner: Arc<LayerOut>,
}

impl PendingKvBytes for PendingLayer {
    fn wait(mut self: Box<Self>) -> Vec<u8> {
        let mut slot = self.slot.take().expect("a pending layer holds its slot until waited on");
        if !slot.pinned() {
            // Into ordinary memory the copy returns once done (here, not on the engine's thread).
            self.owner.copy(&mut slot, self.len).unwrap_or_else(|e| super::fail("kv layer export", e));
        }
        slot.copied.synchronize().unwrap_or_else(|e| super::fail("kv layer export", e));
        let out = slot.host.as_slice()[..self.len].to_vec();
        self.owner.put_back(slot);
        out
    }
}

impl Drop for PendingLayer {
    fn drop(&mut self) {
        if let Some(slot) = self.slot.take() {
            // Never waited on (the consumer went away): the DMA may still write the host
            // buffer, so the slot is reused only after it finished (an ordinary slot's
            // copy was never queued: its event is an earlier one's, done).
            match slot.copied.synchronize() {
                Ok(()) => self.owner.put_back(slot),
                // A broken context: never free memory a DMA may still target.
                Err(_) => std::mem::forget(slot),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::smallest_fitting;

    #[test]
    fn a_copy_takes_the_smallest_free_slot_that_fits() {
        const MIB: usize = 1 << 20;
        let free = [16 * MIB, MIB, 4 * MIB, MIB];
        assert_eq!(smallest_fitting(free.into_iter(), 100), Some(1), "the first of the smallest");
        assert_eq!(smallest_fitting(free.into_iter(), MIB + 1), Some(2));
        assert_eq!(smallest_fitting(free.into_iter(), 16 * MIB), Some(0));
        assert_eq!(smallest_fitting(free.into_iter(), 16 * MIB + 1), None, "none fits: a slot is made");
        assert_eq!(smallest_fitting(std::iter::empty(), 1), None);
    }
}
