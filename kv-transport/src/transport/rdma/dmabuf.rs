//! Registering device memory with the NIC through its dma-buf (`ibv_reg_dmabuf_mr`), so
//! RDMA reads and writes reach accelerator memory with no host copy (GPUDirect RDMA).
//!
//! Owns: the run-time lookup of `ibv_reg_dmabuf_mr`, the checks of its arguments and
//! [`DmaBufRegion`] (device memory with one registration per part).
//! Invariants: a registration holds the memory's keeper and the [`Device`] alive and is
//! deregistered before either is released (field order).
//!
//! What this relies on (libibverbs `ibv_reg_mr(3)`, rdma-core v34 and later; the bindings
//! are from v55):
//! - `ibv_reg_dmabuf_mr(pd, offset, length, iova, fd, access)` registers `length` bytes of
//!   the dma-buf `fd` from `offset`; work requests and remote peers address them as
//!   `iova..iova + length`. `iova` must have the same page offset as `offset`; we keep both
//!   page-aligned (the CUDA export is page-aligned anyway). It returns NULL with `errno` set
//!   on failure: `EOPNOTSUPP` when the kernel or the NIC driver cannot import dma-bufs
//!   (kernel 5.12+ and a driver with `reg_user_mr_dmabuf`, e.g. mlx5), `EBADF`/`EINVAL`
//!   when the fd is not a dma-buf or the range lies outside it.
//! - The symbol carries version `IBVERBS_1.12`. It is looked up at run time in the
//!   libibverbs this process already loaded, so an older library gives a reason (and the
//!   host fallback) instead of a binary that will not start.
//! - The exporter side (CUDA `cuMemGetHandleForAddressRange` with
//!   `CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD`) needs a page-aligned address and size, and
//!   `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED` checked first; that lives with the backend.

use std::ffi::{c_int, c_void, CStr};
use std::io;
use std::ptr::NonNull;
use std::sync::{Arc, OnceLock};

use ibverbs_sys as ffi;

use crate::error::{Error, Result};
use crate::transport::device_memory::DeviceMemory;
use crate::transport::rdma::verbs::{Device, Keys};

/// `struct ibv_mr *ibv_reg_dmabuf_mr(struct ibv_pd *, uint64_t offset, size_t length,
/// uint64_t iova, int fd, int access)`.
type RegDmabufMr = unsafe extern "C" fn(*mut ffi::ibv_pd, u64, usize, u64, c_int, c_int) -> *mut ffi::ibv_mr;

const LIBIBVERBS: &CStr = c"libibverbs.so.1";
const REG_DMABUF_MR: &CStr = c"ibv_reg_dmabuf_mr";
const REG_DMABUF_MR_VERSION: &CStr = c"IBVERBS_1.12";

fn unavailable(reason: String) -> Error {
    Error::RdmaUnavailable { reason }
}

/// Looks `name@version` up in the libibverbs already loaded (never loads one: this crate
/// links it, so a missing one is a broken install, named in the reason).
fn resolve(name: &CStr, version: &CStr) -> std::result::Result<NonNull<c_void>, String> {
    // SAFETY: RTLD_NOLOAD only returns a handle to a library already mapped; the handle is
    // never closed, so the library stays mapped for the life of the process.
    let lib = unsafe { libc::dlopen(LIBIBVERBS.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
    if lib.is_null() {
        return Err(format!("{} is not loaded in this process", LIBIBVERBS.to_string_lossy()));
    }
    // SAFETY: `lib` is a live handle and both strings are NUL-terminated.
    let sym = unsafe { libc::dlvsym(lib, name.as_ptr(), version.as_ptr()) };
    NonNull::new(sym).ok_or_else(|| {
        format!(
            "this libibverbs has no {}@{} (dma-buf registration needs rdma-core v34 or later)",
            name.to_string_lossy(),
            version.to_string_lossy()
        )
    })
}

/// `ibv_reg_dmabuf_mr`, or why this process cannot call it. Looked up once.
pub fn reg_dmabuf_mr_symbol() -> std::result::Result<(), String> {
    reg_dmabuf_mr().map(|_| ())
}

fn reg_dmabuf_mr() -> std::result::Result<RegDmabufMr, String> {
    static SYM: OnceLock<std::result::Result<usize, String>> = OnceLock::new();
    let addr = SYM.get_or_init(|| resolve(REG_DMABUF_MR, REG_DMABUF_MR_VERSION).map(|p| p.as_ptr() as usize));
    // SAFETY: the symbol is `ibv_reg_dmabuf_mr` at the version whose signature RegDmabufMr
    // spells (verbs.h of rdma-core v34..v55).
    addr.clone().map(|a| unsafe { std::mem::transmute::<usize, RegDmabufMr>(a) })
}

pub fn page_size() -> usize {
    // SAFETY: plain sysconf query.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(p).ok().filter(|&p| p > 0).unwrap_or(4096)
}

/// Checks one registration of `part_bytes` at `offset` of a dma-buf of `buf_len` bytes
/// mapped at `iova_base`: non-empty, inside the buffer without overflow, and page-aligned
/// (offset, length and the I/O address), which both the exporter and `ibv_reg_dmabuf_mr`
/// require. Returns the part's I/O virtual address.
pub fn check_part(buf_len: usize, iova_base: u64, offset: usize, part_bytes: usize, page: usize) -> Result<u64> {
    let bad = |what| Err(Error::InvalidArgument { what });
    if part_bytes == 0 {
        return bad("dma-buf registration of zero bytes");
    }
    let Some(end) = offset.checked_add(part_bytes) else {
        return bad("dma-buf registration range overflows");
    };
    if end > buf_len {
        return bad("dma-buf registration runs past the end of the device memory");
    }
    if !offset.is_multiple_of(page) || !part_bytes.is_multiple_of(page) || !iova_base.is_multiple_of(page as u64) {
        return bad("dma-buf registration is not aligned to the host page size");
    }
    iova_base.checked_add(offset as u64).map_or(bad("dma-buf I/O address overflows"), Ok)
}

/// Why `ibv_reg_dmabuf_mr` failed, in words an operator can act on.
pub fn registration_reason(device: &str, err: &io::Error) -> String {
    let why = match err.raw_os_error() {
        Some(libc::EOPNOTSUPP) => "the kernel or the NIC driver cannot import dma-bufs (needs Linux 5.12+ and a driver with dma-buf support, e.g. mlx5)",
        Some(libc::EBADF) => "the dma-buf file descriptor is not open",
        Some(libc::EINVAL) => "the fd is not a dma-buf or the range lies outside it",
        Some(libc::ENOMEM) => "out of memory for the registration",
        Some(libc::EFAULT | libc::EPERM | libc::EACCES) => "the driver refused access to the device memory",
        _ => "",
    };
    if why.is_empty() {
        format!("RDMA device {device} cannot register device memory: {err}")
    } else {
        format!("RDMA device {device} cannot register device memory: {why} ({err})")
    }
}

/// Device memory with `parts` registrations of `part_bytes` each, back to back.
pub struct DmaBufRegion {
    // Declared first: deregistered before the memory's keeper and the device go.
    mrs: Vec<DmaBufRegistration>,
    memory: DeviceMemory,
    _device: Arc<Device>,
}

struct DmaBufRegistration(NonNull<ffi::ibv_mr>);

impl Drop for DmaBufRegistration {
    fn drop(&mut self) {
        // SAFETY: registered by DmaBufRegion::register; the queue pairs using it are gone
        // (they go before the region, see link.rs).
        unsafe { ffi::ibv_dereg_mr(self.0.as_ptr()) };
    }
}

// SAFETY: the registrations are libibverbs objects (thread-safe verbs); the memory is only
// touched through the owner's DeviceCopy, which is Send + Sync.
unsafe impl Send for DmaBufRegion {}
unsafe impl Sync for DmaBufRegion {}

impl DmaBufRegion {
    /// Registers `parts` ranges of `part_bytes` of `memory`, from its start; `remote_write`
    /// lets peers RDMA WRITE into them. One registration per part, so a peer's rkey reaches
    /// only its own part. Any failure is [`Error::RdmaUnavailable`] naming the reason.
    pub fn register(device: &Arc<Device>, memory: &DeviceMemory, parts: u32, part_bytes: usize, remote_write: bool) -> Result<(DmaBufRegion, Vec<Keys>)> {
        let reg = reg_dmabuf_mr().map_err(unavailable)?;
        if memory.dmabuf_fd < 0 {
            return Err(unavailable(format!("{}: no dma-buf file descriptor", memory.label)));
        }
        let page = page_size();
        let mut access = ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE;
        if remote_write {
            access |= ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE;
        }
        let mut region = DmaBufRegion { mrs: Vec::with_capacity(parts as usize), memory: memory.clone(), _device: device.clone() };
        let mut keys = Vec::with_capacity(parts as usize);
        for i in 0..parts as usize {
            let offset = i.checked_mul(part_bytes).ok_or(Error::InvalidArgument { what: "dma-buf registration range overflows" })?;
            let iova = check_part(memory.len, memory.device_addr, offset, part_bytes, page)?;
            // SAFETY: the PD is live; the range lies inside the dma-buf (checked above), whose
            // fd the keeper holds open for as long as `region` (which holds a clone) lives.
            let mr = unsafe { reg(device.pd_ptr(), offset as u64, part_bytes, iova, memory.dmabuf_fd, access.0 as c_int) };
            let mr = NonNull::new(mr).ok_or_else(|| unavailable(registration_reason(&device.name, &io::Error::last_os_error())))?;
            // SAFETY: a registered MR is valid until deregistered.
            let (lkey, rkey) = unsafe { ((*mr.as_ptr()).lkey, (*mr.as_ptr()).rkey) };
            region.mrs.push(DmaBufRegistration(mr));
            keys.push(Keys { lkey, rkey });
        }
        Ok((region, keys))
    }

    /// The I/O virtual address of the first byte (work requests and peers use it).
    pub fn iova(&self) -> u64 {
        self.memory.device_addr
    }

    pub fn memory(&self) -> &DeviceMemory {
        &self.memory
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolves_only_versions_the_loaded_libibverbs_has() {
        // `ibv_reg_mr@IBVERBS_1.1` is in every libibverbs this crate links against (the
        // crate calls it), so the lookup itself works here.
        resolve(c"ibv_reg_mr", c"IBVERBS_1.1").expect("ibv_reg_mr@IBVERBS_1.1 must resolve");
        let e = resolve(c"ibv_reg_dmabuf_mr", c"IBVERBS_0.9").unwrap_err();
        assert!(e.contains("ibv_reg_dmabuf_mr@IBVERBS_0.9") && e.contains("rdma-core v34"), "{e}");
        // The real one: present from rdma-core v34; either way the answer names itself.
        match reg_dmabuf_mr_symbol() {
            Ok(()) => eprintln!("ibv_reg_dmabuf_mr@IBVERBS_1.12 resolved"),
            Err(e) => assert!(e.contains("ibv_reg_dmabuf_mr@IBVERBS_1.12"), "{e}"),
        }
    }

    #[test]
    fn part_checks() {
        let p = 4096;
        let base = 0x7f00_0000_0000u64;
        assert_eq!(check_part(4 * p, base, p, 2 * p, p).unwrap(), base + p as u64);
        assert_eq!(check_part(4 * p, base, 0, 4 * p, p).unwrap(), base);
        let what = |r: Result<u64>| match r {
            Err(Error::InvalidArgument { what }) => what,
            other => panic!("expected an argument error, got {other:?}"),
        };
        assert!(what(check_part(4 * p, base, 0, 0, p)).contains("zero"));
        assert!(what(check_part(4 * p, base, usize::MAX - 10, p, p)).contains("overflows"));
        assert!(what(check_part(4 * p, base, 3 * p, 2 * p, p)).contains("past the end"));
        assert!(what(check_part(4 * p, base, 100, p, p)).contains("aligned"));
        assert!(what(check_part(4 * p, base, 0, p + 1, p)).contains("aligned"));
        assert!(what(check_part(4 * p, base + 8, 0, p, p)).contains("aligned"));
        assert!(what(check_part(4 * p, u64::MAX - (p as u64 - 1), p, p, p)).contains("overflows"));
    }

    #[test]
    fn registration_reasons_name_the_cause() {
        let r = registration_reason("mlx5_0", &io::Error::from_raw_os_error(libc::EOPNOTSUPP));
        assert!(r.contains("mlx5_0") && r.contains("cannot import dma-bufs"), "{r}");
        let r = registration_reason("mlx5_0", &io::Error::from_raw_os_error(libc::EBADF));
        assert!(r.contains("not open"), "{r}");
        let r = registration_reason("mlx5_0", &io::Error::from_raw_os_error(libc::EIO));
        assert!(r.contains("cannot register device memory") && r.contains("os error"), "{r}");
    }
}
