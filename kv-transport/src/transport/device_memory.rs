//! A neutral description of accelerator memory the RDMA transport may use as a ring
//! (GPUDirect RDMA through dma-buf), so that this crate needs no CUDA.
//!
//! Owns: [`DeviceMemory`] (where the memory is, its dma-buf, what keeps it alive, how bytes
//! get in and out) and [`DeviceCopy`] (the copies the owner's runtime performs).
//! Invariants: the dma-buf fd covers exactly `len` bytes from `device_addr` (dma-buf offset
//! 0 is `device_addr`), and stays open and the memory allocated while any clone of the
//! `keeper` lives; every registration of this memory holds a clone of the keeper, so it
//! is deregistered before the memory can be freed.
//!
//! The backend that allocates the memory (the kernels crate's CUDA backend,
//! `kernels/src/cuda/dmabuf.rs`) builds one of these, and the node hands it to the RDMA
//! transport ([`RingMemory::Device`]).

use std::any::Any;
use std::fmt;
use std::os::fd::RawFd;
use std::sync::Arc;

/// Copies out of the device memory a [`DeviceMemory`] describes: what the transport needs
/// to check a frame the NIC wrote there. Returns once the bytes arrived; fails with the
/// runtime's message.
pub trait DeviceCopy: Send + Sync {
    /// Copies `dst.len()` bytes from `offset` bytes past the start into `dst`, seeing every
    /// RDMA write into the memory whose completion the caller polled before the call: a
    /// polled completion does not make a NIC's writes visible to the device's own engines,
    /// so the owner orders or flushes them first (CUDA: `cuFlushGPUDirectRDMAWrites` where
    /// the GPU does not order them natively).
    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), String>;
}

/// Device memory exported as a dma-buf.
#[derive(Clone)]
pub struct DeviceMemory {
    /// The device address of the first byte (what the device's own copies use). The RDMA
    /// registration uses it as the I/O virtual address, so work requests and the peer's
    /// remote addresses name bytes by it.
    pub device_addr: u64,
    /// Length in bytes, a multiple of the host page size (the dma-buf export requires it).
    pub len: usize,
    /// The dma-buf file descriptor covering the whole range; owned by `keeper`.
    pub dmabuf_fd: RawFd,
    /// Which device, for logs (`cuda:0`).
    pub label: String,
    /// The owner's runtime copies out of the memory.
    pub copy: Arc<dyn DeviceCopy>,
    /// Keeps the allocation and the fd alive (dropping the last clone frees both).
    pub keeper: Arc<dyn Any + Send + Sync>,
}

impl fmt::Debug for DeviceMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceMemory")
            .field("device_addr", &format_args!("{:#x}", self.device_addr))
            .field("len", &self.len)
            .field("dmabuf_fd", &self.dmabuf_fd)
            .field("label", &self.label)
            .finish_non_exhaustive()
    }
}

/// The same memory: the same range, fd and owner.
impl PartialEq for DeviceMemory {
    fn eq(&self, other: &Self) -> bool {
        (self.device_addr, self.len, self.dmabuf_fd, &self.label) == (other.device_addr, other.len, other.dmabuf_fd, &other.label)
            && Arc::ptr_eq(&self.keeper, &other.keeper)
    }
}

impl Eq for DeviceMemory {}

/// Where an RDMA listener keeps its receive rings.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum RingMemory {
    /// Page-aligned host memory registered with `ibv_reg_mr` (the default).
    #[default]
    Host,
    /// Device memory registered through its dma-buf; host memory where that fails.
    Device(DeviceMemory),
    /// Device memory was asked for and none was supplied (the reason says why, e.g. the
    /// node runs no GPU backend): host memory, reported as a fallback with that reason. A
    /// node parses its flag into this and replaces it with [`RingMemory::Device`] once it
    /// has the memory.
    Wanted(String),
}
