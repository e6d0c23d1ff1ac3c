//! Where a listener's receive rings and a connector's send rings live: host memory
//! (`ibv_reg_mr`) or device memory registered through its dma-buf (GPUDirect RDMA), with
//! the fallback to host memory.
//!
//! Owns: [`RingRegion`] (the registered rings, host or device, and how a frame is read out
//! of them or written into them), [`Rings`] (which of the two, and so what peers may do)
//! and [`choose`] (the fallback decision).
//! Invariants: each receive ring is its own registration, page-aligned on the device, so a
//! peer's rkey reaches only its own ring whichever memory holds it; send rings are
//! registered for local access only (their rkey is never sent, and no peer may read or
//! write them); device memory is read and written only through the owner's copies
//! ([`DeviceCopy`](crate::transport::device_memory::DeviceCopy)), never through a host
//! pointer.

use std::sync::Arc;

use crate::error::{Error, Result};
use crate::transport::device_memory::{DeviceMemory, RingMemory};
use crate::transport::rdma::dmabuf::{page_size, DmaBufRegion};
use crate::transport::rdma::verbs::{Device, Keys, Region};
use crate::transport::select::RingPlacement;

/// Which rings a region holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rings {
    /// A listener's: peers RDMA WRITE frames into them (one registration per ring).
    Receive,
    /// A connector's: the NIC reads frames out of them; local access only.
    Send,
}

impl Rings {
    /// `receive` or `send`, for logs and [`RingPlacement`].
    pub fn name(self) -> &'static str {
        match self {
            Rings::Receive => "receive",
            Rings::Send => "send",
        }
    }
}

/// Runs `device` where `source` asks for device memory and falls back to `host` when it
/// fails with a reason a node can run without ([`Error::RdmaUnavailable`] or an argument
/// the memory does not satisfy); logs that reason once. Any other error, and every error of
/// `host`, is returned.
pub fn choose<T>(rings: Rings, source: &RingMemory, device: impl FnOnce(&DeviceMemory) -> Result<T>, host: impl FnOnce() -> Result<T>) -> Result<(T, RingPlacement)> {
    let placed = |memory, fallback| RingPlacement { rings: rings.name(), memory, fallback };
    let reason = match source {
        RingMemory::Host => return Ok((host()?, placed("host", None))),
        RingMemory::Wanted(reason) => reason.clone(),
        RingMemory::Device(mem) => match device(mem) {
            Ok(t) => return Ok((t, placed("device", None))),
            Err(Error::RdmaUnavailable { reason }) => reason,
            Err(Error::InvalidArgument { what }) => format!("{}: {what}", mem.label),
            Err(e) => return Err(e),
        },
    };
    tracing::warn!(%reason, rings = rings.name(), "RDMA rings cannot use device memory; using host memory");
    Ok((host()?, placed("host", Some(reason))))
}

/// Registered rings: `rings` registrations, ring `i` at `i * stride` bytes from the start.
pub enum RingRegion {
    Host { region: Region, stride: usize },
    Device { region: DmaBufRegion, stride: usize },
}

impl RingRegion {
    /// Registers `rings` rings of `ring_bytes` each where `source` asks (remote write
    /// allowed only for [`Rings::Receive`]), falling back to host memory ([`choose`]).
    pub fn register(device: &Arc<Device>, source: &RingMemory, role: Rings, rings: u32, ring_bytes: usize) -> Result<(RingRegion, Vec<Keys>, RingPlacement)> {
        let remote_write = role == Rings::Receive;
        let ((region, keys), placement) = choose(
            role,
            source,
            |mem| {
                // Every registration page-aligned: the stride rounds a ring up to whole pages
                // (the tail of a ring's last page belongs to that ring's registration only).
                let stride = ring_bytes.checked_next_multiple_of(page_size()).ok_or(Error::InvalidArgument { what: "RDMA ring size overflows" })?;
                let need = stride.checked_mul(rings as usize).ok_or(Error::InvalidArgument { what: "RDMA ring region size overflows" })?;
                if need > mem.len {
                    return Err(Error::RdmaUnavailable {
                        reason: format!("{}: the {} rings need {need} bytes, the device memory has {}", mem.label, role.name(), mem.len),
                    });
                }
                let (region, keys) = DmaBufRegion::register(device, mem, rings, stride, remote_write)?;
                Ok((RingRegion::Device { region, stride }, keys))
            },
            || {
                let (region, keys) = Region::register(device, rings, ring_bytes, remote_write)?;
                Ok((RingRegion::Host { region, stride: ring_bytes }, keys))
            },
        )?;
        Ok((region, keys, placement))
    }

    /// Byte offset of ring `ring` from the start.
    pub fn ring_offset(&self, ring: u32) -> usize {
        let (RingRegion::Host { stride, .. } | RingRegion::Device { stride, .. }) = self;
        ring as usize * stride
    }

    /// The address peers and work requests use for `offset` (a host pointer, or the I/O
    /// virtual address of the dma-buf registration, which is the device address).
    pub fn addr(&self, offset: usize) -> u64 {
        match self {
            RingRegion::Host { region, .. } => region.base() as u64 + offset as u64,
            RingRegion::Device { region, .. } => region.iova() + offset as u64,
        }
    }

    /// The `len` bytes at `offset`: borrowed from host memory, or copied out of device
    /// memory into `scratch`.
    ///
    /// # Safety
    /// `offset..offset + len` lies inside one ring, and nothing writes it (no RDMA write may
    /// target it) until the returned slice is dropped.
    pub unsafe fn read<'a>(&'a self, offset: usize, len: usize, scratch: &'a mut Vec<u8>) -> Result<&'a [u8]> {
        match self {
            // SAFETY: in bounds and not written meanwhile (the caller's contract).
            RingRegion::Host { region, .. } => Ok(unsafe { std::slice::from_raw_parts(region.base().add(offset), len) }),
            RingRegion::Device { region, .. } => {
                scratch.resize(len, 0);
                let mem = region.memory();
                mem.copy.read(offset, scratch).map_err(|detail| Error::Link {
                    transport: super::link::NAME,
                    detail: format!("copying a frame out of {}: {detail}", mem.label),
                })?;
                Ok(scratch)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::device_memory::host_device;
    use crate::transport::rdma::dmabuf::check_part;

    /// Host memory standing in for a device allocation at `device_addr` (only its
    /// description matters to the decision tested here).
    fn memory(device_addr: u64, len: usize) -> DeviceMemory {
        DeviceMemory { device_addr, ..host_device::HostDevice::memory("cuda:0", len).0 }
    }

    #[test]
    fn host_is_asked_for_and_used() {
        let (v, p) = choose(Rings::Receive, &RingMemory::Host, |_| -> Result<u8> { panic!("device path for host memory") }, || Ok(1u8)).unwrap();
        assert_eq!((v, p.memory, p.fallback), (1, "host", None));
        assert_eq!(p_describe("host", None), "receive rings in host memory");
    }

    fn p_describe(memory: &'static str, fallback: Option<&str>) -> String {
        RingPlacement { rings: "receive", memory, fallback: fallback.map(Into::into) }.describe()
    }

    #[test]
    fn device_is_used_when_it_registers() {
        let src = RingMemory::Device(memory(0x7f00_0000_0000, 1 << 20));
        let (v, p) = choose(Rings::Receive, &src, |_| Ok(2u8), || -> Result<u8> { panic!("host path although the device registered") }).unwrap();
        assert_eq!((v, p.memory, p.fallback.as_deref()), (2, "device", None));
        assert_eq!(p.describe(), "receive rings in device memory");
        let (_, p) = choose(Rings::Send, &src, |_| Ok(2u8), || Ok(1u8)).unwrap();
        assert_eq!(p.describe(), "send rings in device memory");
        let (_, p) = choose(Rings::Send, &RingMemory::Wanted("no GPU".into()), |_| Ok(2u8), || Ok(1u8)).unwrap();
        assert_eq!(p.describe(), "send rings in host memory (device memory refused: no GPU)");
    }

    /// The reasons a real registration gives without a device or support: the argument
    /// checks `DmaBufRegion::register` runs, and a libibverbs without the symbol.
    #[test]
    fn refused_device_memory_falls_back_to_host_with_the_reason() {
        let page = page_size();
        // Device memory not aligned to the host page size: the registration's own check.
        let src = RingMemory::Device(memory(0x7f00_0000_0010, 4 * page));
        let (v, p) = choose(Rings::Receive, &src, |m| check_part(m.len, m.device_addr, 0, page, page).map(|_| 2u8), || Ok(1u8)).unwrap();
        assert_eq!((v, p.memory), (1, "host"));
        let why = p.fallback.clone().unwrap();
        assert!(why.starts_with("cuda:0: ") && why.contains("aligned"), "{why}");
        assert!(p.describe().contains("device memory refused: cuda:0: "), "{}", p.describe());
        // No usable driver support: what the registration reports, passed on as it is.
        let refused = || Err::<u8, _>(Error::RdmaUnavailable { reason: "this libibverbs has no ibv_reg_dmabuf_mr@IBVERBS_1.12".into() });
        let (v, p) = choose(Rings::Receive, &src, |_| refused(), || Ok(1u8)).unwrap();
        assert_eq!(v, 1);
        assert!(p.fallback.unwrap().contains("IBVERBS_1.12"));
        // Asked for, never supplied: host memory with the reason the node gave.
        let wanted = RingMemory::Wanted("the node runs no GPU backend".into());
        let (v, p) = choose(Rings::Receive, &wanted, |_| -> Result<u8> { panic!("no memory to register") }, || Ok(1u8)).unwrap();
        assert_eq!((v, p.memory, p.fallback.as_deref()), (1, "host", Some("the node runs no GPU backend")));
    }

    #[test]
    fn other_failures_are_not_hidden_by_the_fallback() {
        let src = RingMemory::Device(memory(0, 1 << 20));
        let broken = || Err::<u8, _>(Error::Rdma { op: "registering memory", source: std::io::Error::other("x") });
        assert_eq!(choose(Rings::Receive, &src, |_| broken(), || Ok(1u8)).unwrap_err().label(), "rdma");
        let host_fails = || Err::<u8, _>(Error::Rdma { op: "registering memory", source: std::io::Error::other("y") });
        let e = choose(Rings::Receive, &src, |_| Err(Error::RdmaUnavailable { reason: "no".into() }), host_fails).unwrap_err();
        assert_eq!(e.label(), "rdma");
        assert!(choose(Rings::Receive, &RingMemory::Host, |_| Ok(2u8), host_fails).is_err());
    }
}
