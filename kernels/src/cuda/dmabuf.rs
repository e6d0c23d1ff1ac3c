//! Device memory exported as a dma-buf, so a NIC can read and write it directly
//! (GPUDirect RDMA through `ibv_reg_dmabuf_mr`, done by the KV transport).
//!
//! Owns: [`DmaBuf`] (one device allocation, the page-aligned range exported from it and the
//! dma-buf file descriptor) and why a GPU cannot export one.
//! Invariants: the fd is closed before the memory is freed (field order, then `Drop`); the
//! exported range is host-page aligned in address and length, inside the allocation.
//!
//! What this relies on (CUDA driver API, 11.7 and later; cudarc binds it from 12.4):
//! - `cuMemGetHandleForAddressRange(&fd, dptr, size, CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0)`
//!   returns a dma-buf fd for `dptr..dptr + size` of a `cuMemAlloc` allocation; `dptr` and
//!   `size` must be aligned to the host page size, and `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`
//!   must be checked first (it is 0 with the proprietary kernel modules or an old kernel:
//!   dma-buf export needs the open modules and Linux 5.12+).
//! - `CU_POINTER_ATTRIBUTE_SYNC_MEMOPS` = 1 on the allocation makes every synchronous copy
//!   on it synchronize with other work touching the memory, which is what a buffer a NIC
//!   writes needs: a synchronous copy on it does not overtake other work on the memory.
//! - It does not make the NIC's writes visible to the GPU: a polled RDMA completion means the
//!   NIC posted them over PCIe, not that the GPU's own engines (a copy out of the ring)
//!   observe them. `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING` says whether they
//!   do natively (`OWNER` or wider); below that `cuFlushGPUDirectRDMAWrites(CURRENT_CTX,
//!   TO_OWNER)` blocks until they are, where `..._FLUSH_WRITES_OPTIONS` has the `HOST` bit.
//!   A GPU with neither cannot be a safe target: the export is refused (the transport then
//!   keeps its rings in host memory). See [`rdma_visibility`].
//!
//! A frame stays where the NIC wrote it: [`DmaBuf::checksum`] computes its CRC-32 on the GPU
//! (crc.cu, compiled on first use: one module, stream and pair of small buffers per
//! `DmaBuf`) and [`DmaBuf::copy_to_device`] / [`DmaBuf::copy_rows_to_device`] move it to
//! other memory of the same GPU, all after the same flush as [`DmaBuf::read`]; only 4 bytes
//! of a checksum reach the host. The device-to-device copies are synchronous because the
//! allocation has `SYNC_MEMOPS` (without it a `cuMemcpyDtoD` may return before it is done).

use std::ffi::{c_int, c_uint, c_void};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{result, sys, CudaContext, CudaFunction, CudaSlice, CudaStream, LaunchConfig};

use super::{args, compile, plan};
use crate::backend::KernelError;

/// Largest host page size the export is aligned to (4 KiB on x86-64, up to 64 KiB on
/// aarch64): a multiple of every page size, so the range is aligned whatever the host.
pub const EXPORT_ALIGN: usize = 64 << 10;

fn unavailable(reason: String) -> KernelError {
    KernelError::BackendUnavailable { backend: "cuda", reason }
}

/// The exported range inside an allocation at `base` of `alloc` bytes: its offset from
/// `base` and its length (`bytes` rounded up to [`EXPORT_ALIGN`]), or `None` when it does
/// not fit. The allocation is made `align - 1` bytes larger than the range for this.
pub fn export_span(base: u64, alloc: usize, bytes: usize, align: usize) -> Option<(usize, usize)> {
    let len = bytes.checked_next_multiple_of(align)?;
    let start = base.checked_next_multiple_of(align as u64)?;
    let offset = usize::try_from(start - base).ok()?;
    (offset.checked_add(len)? <= alloc).then_some((offset, len))
}

/// How the GPU's own copies come to see what a NIC wrote into its memory (GPUDirect RDMA).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RdmaVisibility {
    /// The GPU orders remote writes before its own later work natively.
    Native,
    /// `cuFlushGPUDirectRDMAWrites` must run before each copy out of NIC-written memory.
    Flush,
}

/// From the two device attributes (`GPU_DIRECT_RDMA_WRITES_ORDERING`,
/// `GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS`): how NIC writes become visible to this GPU's
/// copies, or why they cannot be made to (no native ordering and no host flush).
pub fn rdma_visibility(ordering: i32, flush_options: i32) -> Result<RdmaVisibility, String> {
    let owner = sys::CUGPUDirectRDMAWritesOrdering::CU_GPU_DIRECT_RDMA_WRITES_ORDERING_OWNER as i32;
    let host_flush = sys::CUflushGPUDirectRDMAWritesOptions::CU_FLUSH_GPU_DIRECT_RDMA_WRITES_OPTION_HOST as i32;
    if ordering >= owner {
        Ok(RdmaVisibility::Native)
    } else if flush_options & host_flush != 0 {
        Ok(RdmaVisibility::Flush)
    } else {
        Err(format!(
            "the GPU neither orders RDMA writes before its own copies (GPU_DIRECT_RDMA_WRITES_ORDERING is {ordering}) \
             nor can flush them (GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS is {flush_options}), so a frame a NIC wrote could be read stale"
        ))
    }
}

/// One device allocation exported as a dma-buf.
pub struct DmaBuf {
    // Declared first: the fd is closed before the memory is freed (Drop below).
    fd: Option<OwnedFd>,
    /// What cuMemAlloc returned (freed on drop).
    alloc: sys::CUdeviceptr,
    /// The exported range: `addr..addr + len`, inside the allocation.
    addr: sys::CUdeviceptr,
    len: usize,
    /// What a copy out needs first to see the NIC's writes.
    visibility: RdmaVisibility,
    /// The checksum's kernels and buffers, made by the first [`DmaBuf::checksum`] (or why not).
    crc: OnceLock<Result<Mutex<Crc>, String>>,
    ctx: Arc<CudaContext>,
}

/// The CRC-32 kernels (crc.cu) on a stream of their own, with their partials and result.
struct Crc {
    stream: Arc<CudaStream>,
    chunks: CudaFunction,
    finish: CudaFunction,
    partials: CudaSlice<u32>,
    out: CudaSlice<u32>,
}

impl Crc {
    /// Compiles crc.cu for the context's GPU (through the PTX caches) and loads it.
    fn new(ctx: &Arc<CudaContext>) -> Result<Crc, String> {
        let gpu = ctx.ordinal();
        let (major, minor) = ctx.compute_capability().map_err(|e| format!("GPU {gpu}: reading the compute capability: {e:?}"))?;
        let arch = compile::arch_for(major, minor).map_err(|e| format!("GPU {gpu}: {e}"))?;
        let ptx = compile::compile_one("crc", arch).map_err(|e| format!("GPU {gpu}: compiling the checksum kernels: {e}"))?;
        let module = ctx.load_module(ptx).map_err(|e| format!("GPU {gpu}: loading crc.cu: {e:?}"))?;
        let get = |f: &str| module.load_function(f).map_err(|e| format!("GPU {gpu}: finding {f} in crc.cu: {e:?}"));
        let stream = ctx.new_stream().map_err(|e| format!("GPU {gpu}: creating the checksum stream: {e:?}"))?;
        let partials = stream.alloc_zeros::<u32>(plan::CRC_MAX_BLOCKS).map_err(|e| format!("GPU {gpu}: allocating checksum partials: {e:?}"))?;
        let out = stream.alloc_zeros::<u32>(1).map_err(|e| format!("GPU {gpu}: allocating the checksum: {e:?}"))?;
        Ok(Crc { chunks: get("crc32_chunks")?, finish: get("crc32_finish")?, stream, partials, out })
    }

    /// The CRC-32 of the `len` bytes at device address `data`, waited for.
    fn run(&mut self, data: u64, len: usize) -> Result<u32, String> {
        let p = plan::crc32(len);
        let cfg = |g: plan::Geometry| LaunchConfig { grid_dim: g.grid, block_dim: (g.block, 1, 1), shared_mem_bytes: g.shared_bytes };
        let (len, blocks) = (len as u64, p.chunks.grid.0 as i32);
        let mut b = self.stream.launch_builder(&self.chunks);
        args::crc32_chunks(&mut b, args::RawIn(&data), &len, &p.chunk, &mut self.partials);
        // SAFETY: `data..data + len` is device memory of this context (the caller checked it
        // against the exported range); the plan's blocks fit the partials buffer.
        unsafe { b.launch(cfg(p.chunks)) }.map_err(|e| format!("launching crc32_chunks: {e:?}"))?;
        let mut b = self.stream.launch_builder(&self.finish);
        args::crc32_finish(&mut b, &self.partials, &blocks, &mut self.out);
        // SAFETY: reads the `blocks` partials just written, writes one word.
        unsafe { b.launch(cfg(p.finish)) }.map_err(|e| format!("launching crc32_finish: {e:?}"))?;
        let mut sum = [0u32; 1];
        self.stream.memcpy_dtoh(&self.out, &mut sum[..]).map_err(|e| format!("reading the checksum: {e:?}"))?;
        self.stream.synchronize().map_err(|e| format!("computing the checksum: {e:?}"))?;
        Ok(sum[0])
    }
}

impl DmaBuf {
    /// Allocates at least `bytes` (zeroed) on the context's GPU and exports them. Fails,
    /// naming the reason, where the GPU or its driver cannot export dma-bufs.
    pub fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Result<DmaBuf, KernelError> {
        if bytes == 0 {
            return Err(unavailable("a dma-buf of zero bytes".into()));
        }
        let gpu = ctx.ordinal();
        let supported = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED)
            .map_err(|e| unavailable(format!("GPU {gpu}: querying dma-buf support: {e:?}")))?;
        if supported == 0 {
            return Err(unavailable(format!(
                "GPU {gpu}: the driver cannot export device memory as a dma-buf (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED is 0; \
                 it needs the open GPU kernel modules and Linux 5.12+)"
            )));
        }
        let attr = |a, what| ctx.attribute(a).map_err(|e| unavailable(format!("GPU {gpu}: querying {what}: {e:?}")));
        let ordering = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING, "RDMA write ordering")?;
        let flush = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS, "RDMA write flush support")?;
        let visibility = rdma_visibility(ordering, flush).map_err(|why| unavailable(format!("GPU {gpu}: {why}")))?;
        let len = bytes.checked_next_multiple_of(EXPORT_ALIGN).ok_or_else(|| unavailable("dma-buf size overflows".into()))?;
        let alloc_len = len.checked_add(EXPORT_ALIGN - 1).ok_or_else(|| unavailable("dma-buf size overflows".into()))?;
        ctx.bind_to_thread().map_err(|e| unavailable(format!("GPU {gpu}: binding the context: {e:?}")))?;
        // SAFETY: the context is current; the allocation is freed by `Drop` (or below).
        let alloc = unsafe { result::malloc_sync(alloc_len) }.map_err(|e| unavailable(format!("GPU {gpu}: allocating {alloc_len} bytes for a dma-buf: {e:?}")))?;
        let mut buf = DmaBuf { fd: None, alloc, addr: alloc, len, visibility, crc: OnceLock::new(), ctx: ctx.clone() };
        let (offset, len) = export_span(alloc, alloc_len, bytes, EXPORT_ALIGN).ok_or_else(|| unavailable("dma-buf range does not fit its allocation".into()))?;
        buf.addr = alloc + offset as u64;
        buf.len = len;
        let sync: c_uint = 1;
        // SAFETY: `alloc` is a live allocation of this context; the value is an unsigned int
        // as the attribute requires.
        unsafe { sys::cuPointerSetAttribute((&sync as *const c_uint).cast::<c_void>(), sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_SYNC_MEMOPS, alloc) }
            .result()
            .map_err(|e| unavailable(format!("GPU {gpu}: setting SYNC_MEMOPS on the dma-buf memory: {e:?}")))?;
        // Zeroed: a slot read before any write must not show an earlier allocation's data.
        // SAFETY: the whole allocation is ours.
        unsafe { result::memset_d8_sync(alloc, 0, alloc_len) }.map_err(|e| unavailable(format!("GPU {gpu}: zeroing the dma-buf memory: {e:?}")))?;
        let mut fd: c_int = -1;
        // SAFETY: `addr..addr + len` lies inside one cuMemAlloc allocation and is aligned to
        // EXPORT_ALIGN (a multiple of the host page size); the handle is an int for DMA_BUF_FD;
        // flags must be 0.
        unsafe {
            sys::cuMemGetHandleForAddressRange(
                (&mut fd as *mut c_int).cast::<c_void>(),
                buf.addr,
                len,
                sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                0,
            )
        }
        .result()
        .map_err(|e| unavailable(format!("GPU {gpu}: exporting {len} bytes as a dma-buf: {e:?}")))?;
        if fd < 0 {
            return Err(unavailable(format!("GPU {gpu}: the dma-buf export returned no file descriptor")));
        }
        // SAFETY: the driver just opened this fd for us and nothing else owns it.
        buf.fd = Some(unsafe { OwnedFd::from_raw_fd(fd) });
        Ok(buf)
    }

    /// [`DmaBuf::new`] on GPU `ordinal`'s primary context (the one the CUDA backend on that
    /// GPU uses), for a caller that holds no backend; checks for the driver first, so a
    /// machine without one gets an error, not a panic.
    pub fn on_gpu(ordinal: usize, bytes: usize) -> Result<DmaBuf, KernelError> {
        let driver = super::runtime::check_cuda()?;
        if ordinal >= driver.devices as usize {
            return Err(unavailable(format!("GPU {ordinal} requested; the driver sees {}", driver.devices)));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| unavailable(format!("GPU {ordinal}: opening its context: {e:?}")))?;
        DmaBuf::new(&ctx, bytes)
    }

    /// The device address of the exported range's first byte (dma-buf offset 0).
    pub fn device_addr(&self) -> u64 {
        self.addr
    }

    /// Bytes exported: at least what was asked, a multiple of [`EXPORT_ALIGN`].
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The dma-buf file descriptor; valid while `self` lives.
    pub fn fd(&self) -> RawFd {
        self.fd.as_ref().map_or(-1, AsRawFd::as_raw_fd)
    }

    /// The GPU's ordinal.
    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    fn check(&self, offset: usize, n: usize) -> Result<u64, String> {
        match offset.checked_add(n) {
            Some(end) if end <= self.len => Ok(self.addr + offset as u64),
            _ => Err(format!("{n} bytes at offset {offset} run past the {}-byte dma-buf", self.len)),
        }
    }

    /// Copies `src` to `offset` bytes into the exported range; returns once it landed.
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<(), String> {
        let dst = self.check(offset, src.len())?;
        self.ctx.bind_to_thread().map_err(|e| format!("binding the CUDA context: {e:?}"))?;
        // SAFETY: the destination range lies inside the allocation (checked).
        unsafe { result::memcpy_htod_sync(dst, src) }.map_err(|e| format!("copying into the dma-buf: {e:?}"))
    }

    /// How a copy out comes to see what a NIC wrote (fixed at export).
    pub fn rdma_visibility(&self) -> RdmaVisibility {
        self.visibility
    }

    /// Binds the context and makes every RDMA write whose completion the caller has polled
    /// visible to this GPU's own work that follows (flushed where it does not order them
    /// itself): what every copy or kernel reading the range needs first.
    fn see_nic_writes(&self) -> Result<(), String> {
        self.ctx.bind_to_thread().map_err(|e| format!("binding the CUDA context: {e:?}"))?;
        if self.visibility == RdmaVisibility::Flush {
            // SAFETY: plain driver call on the context just bound.
            unsafe {
                sys::cuFlushGPUDirectRDMAWrites(
                    sys::CUflushGPUDirectRDMAWritesTarget::CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX,
                    sys::CUflushGPUDirectRDMAWritesScope::CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER,
                )
            }
            .result()
            .map_err(|e| format!("flushing RDMA writes to the GPU: {e:?}"))?;
        }
        Ok(())
    }

    /// Copies `dst.len()` bytes from `offset` bytes into the exported range, after every
    /// RDMA write whose completion the caller has polled (flushed to the GPU first where
    /// it does not order them itself).
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), String> {
        let src = self.check(offset, dst.len())?;
        self.see_nic_writes()?;
        // SAFETY: the source range lies inside the allocation (checked).
        unsafe { result::memcpy_dtoh_sync(dst, src) }.map_err(|e| format!("copying out of the dma-buf: {e:?}"))
    }

    /// The CRC-32 (crc32fast's, the KV frame checksum) of `len` bytes from `offset` bytes
    /// into the exported range, computed on the GPU after the RDMA writes as [`DmaBuf::read`]
    /// sees them; relies on crc.cu, compiled for this GPU on the first call (an error names
    /// why it could not be).
    pub fn checksum(&self, offset: usize, len: usize) -> Result<u32, String> {
        let data = self.check(offset, len)?;
        let crc = self.crc.get_or_init(|| Crc::new(&self.ctx).map(Mutex::new)).as_ref().map_err(|why| format!("no checksum kernel: {why}"))?;
        self.see_nic_writes()?;
        crc.lock().unwrap_or_else(|p| p.into_inner()).run(data, len)
    }

    /// Copies `len` bytes from device address `src` of the same GPU (another allocation,
    /// or this one's) to `offset` bytes into the exported range; returns once they landed
    /// (a synchronous copy on memory with `SYNC_MEMOPS`, set at export).
    pub fn copy_from_device(&self, offset: usize, src: u64, len: usize) -> Result<(), String> {
        let dst = self.check(offset, len)?;
        self.ctx.bind_to_thread().map_err(|e| format!("binding the CUDA context: {e:?}"))?;
        if len == 0 {
            return Ok(());
        }
        // SAFETY: the destination lies inside the allocation (checked); the caller vouches
        // for `src..src + len` on this GPU.
        unsafe { result::memcpy_dtod_sync(dst, src, len) }.map_err(|e| format!("copying into the dma-buf from device memory: {e:?}"))
    }

    /// Copies `len` bytes from `offset` bytes into the exported range to device address
    /// `dst` of the same GPU, seeing the RDMA writes as [`DmaBuf::read`] does; returns once
    /// they landed (synchronous, as [`DmaBuf::copy_from_device`]).
    pub fn copy_to_device(&self, offset: usize, dst: u64, len: usize) -> Result<(), String> {
        let src = self.check(offset, len)?;
        self.see_nic_writes()?;
        if len == 0 {
            return Ok(());
        }
        // SAFETY: the source lies inside the allocation (checked); the caller vouches for
        // `dst..dst + len` on this GPU.
        unsafe { result::memcpy_dtod_sync(dst, src, len) }.map_err(|e| format!("copying out of the dma-buf to device memory: {e:?}"))
    }

    /// Copies `rows` rows of `row_bytes`, contiguous from `offset` bytes into the exported
    /// range, to device address `dst` of the same GPU, row `i` at `dst + i * dst_pitch`, in
    /// one copy (`cuMemcpy2D`), seeing the RDMA writes as [`DmaBuf::read`] does; returns once
    /// they landed (synchronous, as [`DmaBuf::copy_from_device`]). A frame of consecutive
    /// blocks' layer goes to a pool's blocks this way (the transport's `copy_rows_to_device`).
    pub fn copy_rows_to_device(&self, offset: usize, row_bytes: usize, rows: usize, dst: u64, dst_pitch: usize) -> Result<(), String> {
        let total = row_bytes.checked_mul(rows).ok_or_else(|| format!("{rows} rows of {row_bytes} bytes overflow"))?;
        let src = self.check(offset, total)?;
        if rows > 1 && dst_pitch < row_bytes {
            return Err(format!("rows of {row_bytes} bytes cannot be {dst_pitch} bytes apart"));
        }
        self.see_nic_writes()?;
        if total == 0 {
            return Ok(());
        }
        let copy = sys::CUDA_MEMCPY2D {
            srcXInBytes: 0,
            srcY: 0,
            srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            srcHost: std::ptr::null(),
            srcDevice: src,
            srcArray: std::ptr::null_mut(),
            srcPitch: row_bytes,
            dstXInBytes: 0,
            dstY: 0,
            dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            dstHost: std::ptr::null_mut(),
            dstDevice: dst,
            dstArray: std::ptr::null_mut(),
            dstPitch: dst_pitch.max(row_bytes),
            WidthInBytes: row_bytes,
            Height: rows,
        };
        // SAFETY: the source rows lie inside the allocation (checked); the caller vouches for
        // the destination rows on this GPU.
        unsafe { sys::cuMemcpy2D_v2(&copy) }.result().map_err(|e| format!("copying {rows} rows out of the dma-buf to device memory: {e:?}"))
    }
}

impl Drop for DmaBuf {
    fn drop(&mut self) {
        // The fd first: once every importer let go of it, nothing maps the memory.
        self.fd = None;
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated in `new` on this context; nothing of ours uses it any more.
            let _ = unsafe { result::free_sync(self.alloc) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The transport keeps a `DmaBuf` in an `Arc<dyn Any + Send + Sync>` and checksums from
    /// any thread: the lazily made kernels must not take that away.
    #[test]
    fn a_dma_buf_is_shared_between_threads() {
        fn shared<T: Send + Sync + 'static>() {}
        shared::<DmaBuf>();
    }

    #[test]
    fn the_exported_span_is_aligned_and_inside_the_allocation() {
        let a = EXPORT_ALIGN;
        // An aligned base: the range starts at it.
        assert_eq!(export_span(0x7000_0000_0000, 2 * a - 1, 10, a), Some((0, a)));
        // An unaligned base: the range starts at the next boundary, still inside.
        let base = 0x7000_0000_0100u64;
        let (off, len) = export_span(base, 3 * a - 1, a + 1, a).unwrap();
        assert_eq!((base + off as u64) % a as u64, 0);
        assert_eq!(len, 2 * a);
        assert!(off + len < 3 * a);
        // Too small an allocation, and overflow, are refused.
        assert_eq!(export_span(base, a, a, a), None);
        assert_eq!(export_span(base, usize::MAX, usize::MAX, a), None);
        assert_eq!(export_span(u64::MAX - 5, 4 * a, a, a), None);
    }

    #[test]
    fn nic_writes_reach_the_gpu_natively_by_flush_or_not_at_all() {
        use sys::CUGPUDirectRDMAWritesOrdering as O;
        let host = sys::CUflushGPUDirectRDMAWritesOptions::CU_FLUSH_GPU_DIRECT_RDMA_WRITES_OPTION_HOST as i32;
        let memops = sys::CUflushGPUDirectRDMAWritesOptions::CU_FLUSH_GPU_DIRECT_RDMA_WRITES_OPTION_MEMOPS as i32;
        for ordering in [O::CU_GPU_DIRECT_RDMA_WRITES_ORDERING_OWNER, O::CU_GPU_DIRECT_RDMA_WRITES_ORDERING_ALL_DEVICES] {
            assert_eq!(rdma_visibility(ordering as i32, 0), Ok(RdmaVisibility::Native));
            assert_eq!(rdma_visibility(ordering as i32, host), Ok(RdmaVisibility::Native));
        }
        let none = O::CU_GPU_DIRECT_RDMA_WRITES_ORDERING_NONE as i32;
        assert_eq!(rdma_visibility(none, host), Ok(RdmaVisibility::Flush));
        assert_eq!(rdma_visibility(none, host | memops), Ok(RdmaVisibility::Flush));
        // The stream-ordered flush alone is no use to a host-side copy.
        for options in [0, memops] {
            let why = rdma_visibility(none, options).unwrap_err();
            assert!(why.contains("WRITES_ORDERING is 0") && why.contains(&format!("OPTIONS is {options}")), "{why}");
        }
    }
}
