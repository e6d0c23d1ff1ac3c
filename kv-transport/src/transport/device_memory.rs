//! A neutral description of accelerator memory the KV transport may use (GPUDirect RDMA
//! through dma-buf), so that this crate needs no CUDA.
//!
//! Owns: [`DeviceMemory`] (where the memory is, its dma-buf, what keeps it alive, how bytes
//! get in and out), [`DeviceCopy`] (the copies and the checksum the owner's runtime
//! performs), [`DeviceBytes`] (a range of it), [`DevicePayload`] (a frame's payload left
//! where the NIC wrote it) and, on the sending side, [`DeviceSource`] / [`DeviceRange`]
//! (bytes the engine left on its GPU, which a link with send rings in device memory copies
//! there device to device).
//! Invariants: the dma-buf fd covers exactly `len` bytes from `device_addr` (dma-buf offset
//! 0 is `device_addr`), and stays open and the memory allocated while any clone of the
//! `keeper` lives; every registration of this memory holds a clone of the keeper, so it
//! is deregistered before the memory can be freed. A [`DevicePayload`] holds its ring slot:
//! the sender may write the slot again only after the payload is dropped.
//!
//! The backend that allocates the memory (the kernels crate's CUDA backend,
//! `kernels/src/cuda/dmabuf.rs`) builds one of these, and the node hands it to the RDMA
//! transport ([`RingMemory::Device`]) and to its staging pool
//! ([`ArenaPool::on_device`](crate::ArenaPool::on_device)).

use std::any::Any;
use std::fmt;
use std::os::fd::RawFd;
use std::sync::Arc;

/// What the owner's runtime does with the device memory a [`DeviceMemory`] describes. Each
/// returns once done; a failure is the runtime's message.
pub trait DeviceCopy: Send + Sync {
    /// Copies `dst.len()` bytes from `offset` bytes past the start into `dst`, seeing every
    /// RDMA write into the memory whose completion the caller polled before the call: a
    /// polled completion does not make a NIC's writes visible to the device's own engines,
    /// so the owner orders or flushes them first (CUDA: `cuFlushGPUDirectRDMAWrites` where
    /// the GPU does not order them natively).
    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), String>;
    /// Copies `src` to `offset` bytes past the start.
    fn write(&self, offset: usize, src: &[u8]) -> Result<(), String>;
    /// The frame checksum (CRC-32, as [`checksum`](crate::handoff::frame::checksum)
    /// computes it) of the `len` bytes from `offset`, computed on the device, seeing NIC
    /// writes as [`DeviceCopy::read`] does: only 4 bytes come to the host.
    fn checksum(&self, offset: usize, len: usize) -> Result<u32, String>;
    /// Copies `rows` rows of `row_bytes`, contiguous from `offset`, to the device address
    /// `dst` of the same device (another allocation of the owner's), row `i` to
    /// `dst + i * dst_pitch`, in one copy (CUDA: `cuMemcpy2D`), seeing NIC writes as
    /// [`DeviceCopy::read`] does. A frame's payload (one layer of consecutive blocks) goes
    /// to consecutive blocks of a pool this way: block-layers `dst_pitch` apart.
    fn copy_rows_to_device(&self, offset: usize, row_bytes: usize, rows: usize, dst: u64, dst_pitch: usize) -> Result<(), String>;
    /// Copies `len` bytes from the device address `src` of the same device (another
    /// allocation of the owner's, e.g. a layer the engine packed) to `offset` bytes past the
    /// start; returns once they landed. A send ring slot is filled this way.
    fn copy_from_device(&self, offset: usize, src: u64, len: usize) -> Result<(), String>;
}

/// Bytes a sender's device holds (a layer the engine packed on its GPU), which a link may
/// send without bringing them to the host first. The address comes from this node's own
/// engine, never from a peer. Dropping the last reference gives the memory back.
pub trait DeviceSource: Send + Sync {
    /// The device address of the first byte, on the device the node's send rings are on.
    fn device_addr(&self) -> u64;
    /// Length in bytes.
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Copies `dst.len()` bytes from `offset` to the host; returns once done.
    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), String>;
}

/// `len` bytes at `offset` of a [`DeviceSource`]: one frame's payload to send.
#[derive(Clone)]
pub struct DeviceRange {
    pub source: Arc<dyn DeviceSource>,
    pub offset: usize,
    pub len: usize,
}

impl DeviceRange {
    /// The range, checked against the source's length.
    pub fn new(source: Arc<dyn DeviceSource>, offset: usize, len: usize) -> Result<Self, String> {
        match offset.checked_add(len) {
            Some(end) if end <= source.len() => Ok(DeviceRange { source, offset, len }),
            _ => Err(format!("{len} bytes at {offset} run past the {}-byte device source", source.len())),
        }
    }

    /// The device address of the range's first byte.
    pub fn device_addr(&self) -> u64 {
        self.source.device_addr() + self.offset as u64
    }

    /// Copies the range into `dst` (exactly `len` bytes) on the host.
    pub fn read_into(&self, dst: &mut [u8]) -> Result<(), String> {
        if dst.len() != self.len {
            return Err(format!("a {}-byte device range read into {} bytes", self.len, dst.len()));
        }
        self.source.read(self.offset, dst)
    }
}

impl fmt::Debug for DeviceRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceRange")
            .field("device_addr", &format_args!("{:#x}", self.device_addr()))
            .field("len", &self.len)
            .finish()
    }
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

/// `len` bytes at `offset` of `memory`.
#[derive(Clone, Copy, Debug)]
pub struct DeviceBytes<'a> {
    pub memory: &'a DeviceMemory,
    pub offset: usize,
    pub len: usize,
}

impl DeviceBytes<'_> {
    /// The bytes, copied to the host.
    pub fn to_host(&self) -> Result<Vec<u8>, String> {
        let mut out = vec![0u8; self.len];
        self.memory.copy.read(self.offset, &mut out)?;
        Ok(out)
    }
}

/// A `Data` frame's payload left in the device ring slot the NIC wrote it to, with the
/// checksum the device computed over the slot's header and payload (what
/// [`Frame::verify`](crate::handoff::frame::Frame::verify) compares with the trailer).
/// Holds the slot: the link returns its credit only once every clone is dropped.
#[derive(Clone)]
pub struct DevicePayload {
    memory: DeviceMemory,
    offset: usize,
    len: usize,
    checksum: u32,
    _slot: Arc<dyn Any + Send + Sync>,
}

impl DevicePayload {
    /// The payload at `offset..offset + len` of `memory`, whose frame's checksum the device
    /// computed as `checksum`; `slot` is held until the last clone is dropped.
    pub fn new(memory: DeviceMemory, offset: usize, len: usize, checksum: u32, slot: Arc<dyn Any + Send + Sync>) -> Self {
        DevicePayload { memory, offset, len, checksum, _slot: slot }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The checksum the device computed over the frame's header and this payload.
    pub fn checksum(&self) -> u32 {
        self.checksum
    }

    /// Where the payload is.
    pub fn bytes(&self) -> DeviceBytes<'_> {
        DeviceBytes { memory: &self.memory, offset: self.offset, len: self.len }
    }

    /// The whole payload, copied to the host.
    pub fn to_host(&self) -> Result<Vec<u8>, String> {
        self.bytes().to_host()
    }
}

impl fmt::Debug for DevicePayload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DevicePayload")
            .field("memory", &self.memory.label)
            .field("offset", &self.offset)
            .field("len", &self.len)
            .field("checksum", &format_args!("{:#010x}", self.checksum))
            .finish_non_exhaustive()
    }
}

/// The same bytes of the same memory.
impl PartialEq for DevicePayload {
    fn eq(&self, other: &Self) -> bool {
        (&self.memory, self.offset, self.len, self.checksum) == (&other.memory, other.offset, other.len, other.checksum)
    }
}

impl Eq for DevicePayload {}

/// Host memory standing in for one device's memory, for tests of the device paths on
/// machines without a GPU: addresses are host addresses, and a copy to another
/// [`HostDevice`]'s address is a host copy. Feature `test-support` (and this crate's tests).
#[cfg(any(test, feature = "test-support"))]
pub mod host_device {
    use std::any::Any;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{Arc, Mutex};

    use super::{DeviceCopy, DeviceMemory, DeviceSource};

    /// Every live allocation, so that a copy finds the one its address falls in.
    static ALL: Mutex<Vec<std::sync::Weak<HostDevice>>> = Mutex::new(Vec::new());

    /// One allocation; counts the bytes that left for the host and the device-side copies.
    pub struct HostDevice {
        bytes: Mutex<Box<[u8]>>,
        base: u64,
        len: usize,
        /// Bytes copied out to the host by `read`.
        pub host_reads: AtomicU64,
        /// Device-to-device copies out of this allocation (`copy_rows_to_device`, or another
        /// allocation's `copy_from_device` reading it).
        pub device_copies: AtomicU64,
    }

    impl HostDevice {
        /// `len` zeroed bytes on the device called `label`.
        pub fn memory(label: &str, len: usize) -> (DeviceMemory, Arc<HostDevice>) {
            let bytes = vec![0u8; len].into_boxed_slice();
            let base = bytes.as_ptr() as u64;
            let dev = Arc::new(HostDevice { bytes: Mutex::new(bytes), base, len, host_reads: AtomicU64::new(0), device_copies: AtomicU64::new(0) });
            let mut all = ALL.lock().unwrap();
            all.retain(|d| d.strong_count() > 0);
            all.push(Arc::downgrade(&dev));
            let mem = DeviceMemory { device_addr: base, len, dmabuf_fd: -1, label: label.into(), copy: dev.clone(), keeper: dev.clone() as Arc<dyn Any + Send + Sync> };
            (mem, dev)
        }

        /// The live allocation holding `len` bytes from address `addr`.
        fn holding(addr: u64, len: usize) -> Result<Arc<HostDevice>, String> {
            let found = ALL.lock().unwrap().iter().filter_map(std::sync::Weak::upgrade).find(|d| addr >= d.base && addr + len as u64 <= d.base + d.len as u64);
            found.ok_or_else(|| format!("{len} bytes at device address {addr:#x} are in no allocation"))
        }

        fn range(&self, offset: usize, n: usize) -> Result<std::ops::Range<usize>, String> {
            match offset.checked_add(n) {
                Some(end) if end <= self.len => Ok(offset..end),
                _ => Err(format!("{n} bytes at {offset} run past the {}-byte allocation", self.len)),
            }
        }
    }

    impl DeviceCopy for HostDevice {
        fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), String> {
            let r = self.range(offset, dst.len())?;
            dst.copy_from_slice(&self.bytes.lock().unwrap()[r]);
            self.host_reads.fetch_add(dst.len() as u64, Ordering::Relaxed);
            Ok(())
        }

        fn write(&self, offset: usize, src: &[u8]) -> Result<(), String> {
            let r = self.range(offset, src.len())?;
            self.bytes.lock().unwrap()[r].copy_from_slice(src);
            Ok(())
        }

        fn checksum(&self, offset: usize, len: usize) -> Result<u32, String> {
            let r = self.range(offset, len)?;
            Ok(crc32fast::hash(&self.bytes.lock().unwrap()[r]))
        }

        fn copy_rows_to_device(&self, offset: usize, row_bytes: usize, rows: usize, dst: u64, dst_pitch: usize) -> Result<(), String> {
            let r = self.range(offset, row_bytes * rows)?;
            let bytes = self.bytes.lock().unwrap()[r].to_vec();
            let span = (dst_pitch * rows.saturating_sub(1) + row_bytes) as u64;
            let target = Self::holding(dst, span as usize)?;
            let mut to = target.bytes.lock().unwrap();
            for (i, row) in bytes.chunks_exact(row_bytes.max(1)).enumerate() {
                let at = (dst - target.base) as usize + i * dst_pitch;
                to[at..at + row_bytes].copy_from_slice(row);
            }
            self.device_copies.fetch_add(1, Ordering::Relaxed);
            Ok(())
        }

        fn copy_from_device(&self, offset: usize, src: u64, len: usize) -> Result<(), String> {
            let r = self.range(offset, len)?;
            let from = Self::holding(src, len)?;
            let at = (src - from.base) as usize;
            // Copied out first: `from` may be this very allocation.
            let bytes = from.bytes.lock().unwrap()[at..at + len].to_vec();
            self.bytes.lock().unwrap()[r].copy_from_slice(&bytes);
            from.device_copies.fetch_add(1, Ordering::Relaxed);
            Ok(())
        }
    }

    /// The whole allocation as bytes to send from.
    impl DeviceSource for HostDevice {
        fn device_addr(&self) -> u64 {
            self.base
        }

        fn len(&self) -> usize {
            self.len
        }

        fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), String> {
            DeviceCopy::read(self, offset, dst)
        }
    }
}
