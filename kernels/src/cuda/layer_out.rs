//! One layer of some KV blocks copied out of the arena during a forward pass, for a
//! pipelined export ([`crate::Backend::kv_blocks_layer_out`]), without holding up the
//! compute that follows.
//!
//! Owns: the export slots (a device buffer the layer is packed into, a host buffer, two
//! events), the side stream their DMAs run on, and the two forms a packed layer takes:
//! [`PendingLayer`] (on its way to the host) and [`DeviceLayer`] (kept on the device).
//!
//! The pack kernel runs on the compute stream right after the layer's `kv_write` (stream
//! order is what makes it read the keys and values just written) into a slot's device
//! buffer; an event recorded behind it lets a side stream start the slot's device-to-host
//! DMA into page-locked memory while the compute stream goes on with the layer's attention
//! and the next layers. The copy engine then moves layer `l` while the SMs compute `l + 1`.
//! A second event marks the DMA done; [`PendingLayer::wait`] (on the consumer's thread,
//! never the engine's) waits for it, copies the bytes out and returns the slot.
//!
//! Kept on the device (GPUDirect RDMA sending, [`crate::Backend::keep_layer_exports_on_device`]):
//! no DMA is queued, as the transport copies the packed layer device to device into its
//! send ring and the NIC reads it there. [`PendingLayer::into_device`] waits for the pack
//! only and hands the slot over as a [`DeviceLayer`], whose device buffer stays the
//! consumer's until it is dropped. `wait` still works, copying on the consumer's thread.
//!
//! Invariants: a slot is in the free list only when no GPU work but the compute stream's
//! touches it (it goes back after its DMA event was waited on, by `wait` or by a drop;
//! a slot with no DMA queued goes back at once, since a later pack into it is queued
//! behind everything earlier on the compute stream and every other access to its device
//! buffer, a `DeviceLayer`'s reads and its consumer's copies, returns only once done), so
//! neither the pack of a later layer nor the host reads a buffer still in use. A slot's
//! `dma_queued` says whether its `copied` event marks a DMA of its current contents.
//! Slots are made on demand and reused; there are as many as copies in flight at once.
//! Where page-locking fails a slot's host buffer is ordinary memory, into which a copy
//! returns only once done: that copy is left to `wait`, so that it holds up the consumer's
//! thread rather than the engine's until the layer is computed. A slot whose use failed on
//! the device is leaked, never freed: a DMA may still target it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::{result, CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr, DriverError};

use super::staging::HostBuf;
use crate::backend::{DeviceKvBytes, PendingKvBytes};

/// Device and host buffers of one copy, and its two events.
pub(super) struct Slot {
    host: HostBuf,
    /// The packed layer (32-bit words, as `kv_pack` writes them).
    pub device: CudaSlice<u32>,
    /// Recorded on the compute stream after the pack.
    packed: CudaEvent,
    /// Recorded on the side stream after the DMA.
    copied: CudaEvent,
    /// Whether `queue_copy` queued the DMA of the current contents (`copied` marks it):
    /// not for an ordinary host buffer, nor with exports kept on the device.
    dma_queued: bool,
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
    /// Set by [`crate::Backend::keep_layer_exports_on_device`]: queue no DMA behind a pack.
    /// A lone flag read at each queueing (no other memory is published through it), so
    /// relaxed ordering suffices; a change applies from the next export.
    pub keep_on_device: AtomicBool,
}

impl LayerOut {
    pub fn new(ctx: &Arc<CudaContext>) -> Result<Self, DriverError> {
        Ok(LayerOut { ctx: ctx.clone(), side: ctx.new_stream()?, free: Mutex::new(Vec::new()), keep_on_device: AtomicBool::new(false) })
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
        // Page-locked even when exports are kept on the device: `wait` may still be asked
        // for the bytes, and the mode may change while the slot lives.
        let host = HostBuf::new(&self.ctx, cap, true).or_else(|_| HostBuf::new(&self.ctx, cap, false))?;
        let (packed, copied) = (self.ctx.new_event(None)?, self.ctx.new_event(None)?);
        Ok(Slot { host, device: compute.alloc_zeros::<u32>(cap / 4)?, packed, copied, dma_queued: false })
    }

    /// Behind whatever `compute` queued so far (the pack into `slot.device`): the DMA of
    /// its first `bytes` to the slot's host buffer, on the side stream (for a pinned slot
    /// with exports not kept on the device; otherwise `PendingLayer::wait` copies).
    pub fn queue_copy(&self, compute: &Arc<CudaStream>, slot: &mut Slot, bytes: usize) -> Result<(), DriverError> {
        slot.packed.record(compute)?;
        slot.dma_queued = slot.pinned() && !self.keep_on_device.load(Ordering::Relaxed);
        match slot.dma_queued {
            true => self.copy(slot, bytes),
            false => Ok(()),
        }
    }

    /// The side stream's DMA of `slot.device[..bytes]` to its host buffer, after `packed`.
    fn copy(&self, slot: &mut Slot, bytes: usize) -> Result<(), DriverError> {
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

    /// Gives back a slot whose bytes nobody wants any more: once its DMA is done, if one
    /// was queued (it may still write the host buffer).
    fn release(&self, slot: Slot) {
        if !slot.dma_queued {
            return self.put_back(slot);
        }
        match slot.copied.synchronize() {
            Ok(()) => self.put_back(slot),
            // A broken context: never free memory a DMA may still target.
            Err(_) => std::mem::forget(slot),
        }
    }
}

/// A device failure while `slot` is out of the free list: the slot is leaked (a DMA may
/// still target its buffers), then the backend's panic for a failed device.
fn broken(slot: Slot, e: DriverError) -> ! {
    std::mem::forget(slot);
    super::fail("kv layer export", e)
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
        if !slot.dma_queued {
            // Into ordinary memory the copy returns once done; into page-locked memory it
            // was not queued as the layer was to stay on the device. Either way it runs
            // here, not on the engine's thread.
            if let Err(e) = self.owner.copy(&mut slot, self.len) {
                broken(slot, e);
            }
        }
        if let Err(e) = slot.copied.synchronize() {
            broken(slot, e);
        }
        let out = slot.host.as_slice()[..self.len].to_vec();
        self.owner.put_back(slot);
        out
    }

    fn into_device(mut self: Box<Self>) -> Result<Box<dyn DeviceKvBytes>, Box<dyn PendingKvBytes>> {
        let slot = self.slot.take().expect("a pending layer holds its slot until waited on");
        // The pack ran on the compute stream: a consumer's copy from the device address
        // (on another stream, or synchronous) is ordered behind it by nothing but this.
        if let Err(e) = slot.packed.synchronize() {
            broken(slot, e);
        }
        // The backend turned cudarc's event tracking off, so the guard dropped here records
        // nothing; the address is the slot's, valid while the `DeviceLayer` holds it.
        let addr = slot.device.device_ptr(&self.owner.side).0;
        Ok(Box::new(DeviceLayer { slot: Mutex::new(Some(slot)), addr, len: self.len, owner: self.owner.clone() }))
    }
}

impl Drop for PendingLayer {
    fn drop(&mut self) {
        // Never waited on (the consumer went away): the slot is reused only after its DMA.
        if let Some(slot) = self.slot.take() {
            self.owner.release(slot);
        }
    }
}

/// A packed layer kept in its slot's device buffer for a consumer that sends it from
/// there; the slot goes back to the free list when this is dropped.
pub(super) struct DeviceLayer {
    /// Behind a mutex only so that this is `Sync` (a slot's page-locked host buffer is a
    /// raw pointer); only the drop takes it (through `get_mut`, never locking).
    slot: Mutex<Option<Slot>>,
    /// The slot's device buffer: `len` bytes of the packed layer from here.
    addr: u64,
    len: usize,
    owner: Arc<LayerOut>,
}

impl DeviceKvBytes for DeviceLayer {
    fn device_addr(&self) -> u64 {
        self.addr
    }

    fn len(&self) -> usize {
        self.len
    }

    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), String> {
        match offset.checked_add(dst.len()) {
            Some(end) if end <= self.len => {}
            _ => return Err(format!("{} bytes at offset {offset} run past the {}-byte packed layer", dst.len(), self.len)),
        }
        if dst.is_empty() {
            return Ok(());
        }
        self.owner.ctx.bind_to_thread().map_err(|e| format!("binding the CUDA context: {e:?}"))?;
        // SAFETY: `addr + offset..addr + offset + dst.len()` lies inside the slot's device
        // buffer (checked against `len`, which fits it), held by `self` and written by
        // nothing while it lives (its pack finished in `into_device`).
        unsafe { result::memcpy_dtoh_sync(dst, self.addr + offset as u64) }.map_err(|e| format!("copying the packed layer to the host: {e:?}"))
    }
}

impl Drop for DeviceLayer {
    fn drop(&mut self) {
        // No copy from the device buffer is still running (the consumer's are done when it
        // drops this); a DMA queued before the layer was kept may be.
        if let Some(slot) = self.slot.get_mut().unwrap_or_else(|p| p.into_inner()).take() {
            self.owner.release(slot);
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
