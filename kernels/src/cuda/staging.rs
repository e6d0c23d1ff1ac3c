//! Host staging for KV blocks that leave or enter the GPU arena (the
//! transport's exports and imports, the second tier).
//!
//! Blocks move in groups of up to [`STAGING_BYTES`]: the GPU packs a group
//! into one device buffer (`kv_pack`) and copies it to a page-locked host
//! buffer with one DMA, while the host copies the previous group out of the
//! other buffer. Two host buffers, one event each, recorded after the last
//! copy that touched the buffer; the host waits on it before reading or
//! refilling that buffer.
//!
//! The host buffers come from `cuMemHostAlloc` with no flags: cacheable
//! page-locked memory. cudarc's `alloc_pinned` asks for write-combined
//! memory, which is uncached for host reads, the wrong kind for a buffer the
//! host reads every byte of. When page-locking fails (a locked-memory limit),
//! staging falls back to ordinary memory, which the driver copies through its
//! own small pinned buffers: correct, only slower, and `describe` says so.

use std::ptr::NonNull;
use std::sync::Arc;

use cudarc::driver::{result, CudaContext, CudaEvent, CudaSlice, CudaStream, DriverError};

/// Bytes of one staging buffer (there are two): large enough that a group's
/// DMA runs near the link's speed, small enough to keep locked memory modest.
pub const STAGING_BYTES: usize = 16 << 20;

/// Host memory for one group of packed blocks (and a captured step's inputs, `graph.rs`).
pub(super) enum HostBuf {
    /// Page-locked by the driver; freed with `cuMemFreeHost`.
    Pinned { ptr: NonNull<u8>, len: usize, ctx: Arc<CudaContext> },
    /// Ordinary memory, when page-locking failed.
    Pageable(Vec<u8>),
}

// SAFETY: the pinned pointer is owned by this value alone, like a Vec's.
unsafe impl Send for HostBuf {}

impl HostBuf {
    pub(super) fn new(ctx: &Arc<CudaContext>, len: usize, pinned: bool) -> Result<HostBuf, DriverError> {
        if !pinned {
            return Ok(HostBuf::Pageable(vec![0; len]));
        }
        ctx.bind_to_thread()?;
        // SAFETY: a plain allocation; flags 0 = cacheable, this context only.
        let ptr = unsafe { result::malloc_host(len, 0) }?;
        let ptr = NonNull::new(ptr.cast::<u8>()).expect("cuMemHostAlloc returned success and a null pointer");
        Ok(HostBuf::Pinned { ptr, len, ctx: ctx.clone() })
    }

    /// Two buffers of `len` bytes, page-locked if the driver allows both, else ordinary
    /// memory with the reason (a locked-memory limit): double-buffered copies stay
    /// correct, only slower.
    pub(super) fn pair(ctx: &Arc<CudaContext>, len: usize) -> Result<([HostBuf; 2], Option<String>), DriverError> {
        Ok(match (HostBuf::new(ctx, len, true), HostBuf::new(ctx, len, true)) {
            (Ok(a), Ok(b)) => ([a, b], None),
            (Err(e), _) | (_, Err(e)) => ([HostBuf::new(ctx, len, false)?, HostBuf::new(ctx, len, false)?], Some(format!("cuMemHostAlloc of {len} bytes: {e:?}"))),
        })
    }

    pub(super) fn as_slice(&self) -> &[u8] {
        match self {
            // SAFETY: `len` bytes allocated by cuMemHostAlloc, owned by self.
            HostBuf::Pinned { ptr, len, .. } => unsafe { std::slice::from_raw_parts(ptr.as_ptr(), *len) },
            HostBuf::Pageable(v) => v,
        }
    }

    pub(super) fn as_mut_slice(&mut self) -> &mut [u8] {
        match self {
            // SAFETY: as in as_slice, and `&mut self` makes the borrow unique.
            HostBuf::Pinned { ptr, len, .. } => unsafe { std::slice::from_raw_parts_mut(ptr.as_ptr(), *len) },
            HostBuf::Pageable(v) => v,
        }
    }
}

impl Drop for HostBuf {
    fn drop(&mut self) {
        if let HostBuf::Pinned { ptr, ctx, .. } = self {
            // Staging's own Drop has waited for every DMA queued on this buffer.
            let _ = ctx.bind_to_thread();
            // SAFETY: allocated by cuMemHostAlloc and freed once.
            let _ = unsafe { result::free_host(ptr.as_ptr().cast()) };
        }
    }
}

/// The two host buffers, their events and the device buffer a group is packed into.
pub struct Staging {
    host: [HostBuf; 2],
    /// Recorded after the last copy that read or wrote `host[i]`.
    done: [CudaEvent; 2],
    /// One group, packed (32-bit words, as `kv_pack` writes them).
    pub device: CudaSlice<u32>,
    /// Why staging is not page-locked, if it is not.
    pub pageable_because: Option<String>,
}

impl Staging {
    /// Two buffers of `bytes` each (a multiple of 4), page-locked if the driver allows.
    pub fn new(ctx: &Arc<CudaContext>, stream: &Arc<CudaStream>, bytes: usize) -> Result<Staging, DriverError> {
        assert!(bytes.is_multiple_of(4), "staging holds whole 32-bit words");
        let (host, pageable_because) = HostBuf::pair(ctx, bytes)?;
        let done = [ctx.new_event(None)?, ctx.new_event(None)?];
        let device = stream.alloc_zeros::<u32>(bytes / 4)?;
        Ok(Staging { host, done, device, pageable_because })
    }

    /// Bytes of one buffer.
    pub fn capacity(&self) -> usize {
        self.host[0].as_slice().len()
    }

    /// Queues `device[..bytes] -> host[half]` on `stream`, then the half's event.
    pub fn download(&mut self, stream: &Arc<CudaStream>, half: usize, bytes: usize) -> Result<(), DriverError> {
        use cudarc::driver::DevicePtr;
        let (src, _guard) = self.device.device_ptr(stream);
        // SAFETY: `bytes` fits both buffers (callers pack at most `capacity()`); the
        // host buffer is not touched again before `wait(half)`.
        unsafe { result::memcpy_dtoh_async(&mut self.host[half].as_mut_slice()[..bytes], src, stream.cu_stream()) }?;
        self.done[half].record(stream)
    }

    /// Queues `host[half][..bytes] -> device` on `stream`, then the half's event.
    pub fn upload(&mut self, stream: &Arc<CudaStream>, half: usize, bytes: usize) -> Result<(), DriverError> {
        use cudarc::driver::DevicePtrMut;
        let (dst, _guard) = self.device.device_ptr_mut(stream);
        // SAFETY: as in download; the host buffer is not refilled before `wait(half)`.
        unsafe { result::memcpy_htod_async(dst, &self.host[half].as_slice()[..bytes], stream.cu_stream()) }?;
        self.done[half].record(stream)
    }

    /// Waits until the copies queued on `host[half]` are done; an event never
    /// recorded is done at once.
    pub fn wait(&self, half: usize) -> Result<(), DriverError> {
        self.done[half].synchronize()
    }

    /// `host[half]`, for reading after `wait(half)`.
    pub fn host(&self, half: usize) -> &[u8] {
        self.host[half].as_slice()
    }

    /// `host[half]`, for filling after `wait(half)`.
    pub fn host_mut(&mut self, half: usize) -> &mut [u8] {
        self.host[half].as_mut_slice()
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        // No DMA may still target a buffer about to be freed.
        let _ = self.wait(0);
        let _ = self.wait(1);
    }
}
