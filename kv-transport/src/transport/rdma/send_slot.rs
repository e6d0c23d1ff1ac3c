//! Writing one frame into a send ring slot, from which the NIC reads it: header, payload
//! and checksum trailer laid out exactly as [`frame::encode`](crate::handoff::frame::encode)
//! lays them out on a byte stream, whichever memory the slot and the payload are in.
//!
//! Owns: [`SlotFrame`] (what is sent: a frame on the host, or a `Data` frame's header with
//! its payload in this node's device memory), [`SlotMemory`] (the slot: host bytes, or a
//! range of device memory) and [`fill`].
//! Invariants: the trailer is the CRC-32 of the slot's own header and payload bytes, so it
//! covers what the NIC reads, wherever the payload came from; a device payload going into
//! a device slot is copied device to device and checksummed on the device (only the header,
//! the trailer and 4 bytes of checksum cross PCIe); a device slot is written only through
//! the owner's copies, never through a host pointer.

use crate::error::{Error, Result};
use crate::handoff::frame::{self, Frame, FrameHeader, HEADER_LEN};
use crate::transport::device_memory::{DeviceMemory, DeviceRange};
use crate::transport::rdma::link::NAME;

/// What goes into a slot.
pub(crate) enum SlotFrame<'a> {
    /// Any frame, payload on the host.
    Host(&'a Frame),
    /// A `Data` frame whose payload is in this node's device memory.
    Device(FrameHeader, &'a DeviceRange),
}

impl SlotFrame<'_> {
    /// Bytes the frame takes in a slot.
    pub fn wire_len(&self) -> usize {
        match self {
            SlotFrame::Host(f) => f.wire_len(),
            SlotFrame::Device(_, p) => frame::wire_len(p.len),
        }
    }
}

/// A send slot of at least the frame's length.
pub(crate) enum SlotMemory<'a> {
    Host(&'a mut [u8]),
    /// `offset` bytes into `memory`.
    Device(&'a DeviceMemory, usize),
}

fn device_err(memory: &DeviceMemory, what: &str, detail: String) -> Error {
    Error::Link { transport: NAME, detail: format!("{what} ({}): {detail}", memory.label) }
}

/// Writes `frame` into `slot`; returns its length.
pub(crate) fn fill(slot: SlotMemory<'_>, frame: &SlotFrame<'_>) -> Result<usize> {
    let len = frame.wire_len();
    match (slot, frame) {
        (SlotMemory::Host(slot), SlotFrame::Host(f)) => {
            let (head, rest) = slot[..len].split_at_mut(HEADER_LEN);
            head.copy_from_slice(&f.header.encode());
            let (payload, trailer) = rest.split_at_mut(f.payload.len());
            payload.copy_from_slice(&f.payload);
            trailer.copy_from_slice(&f.checksum.to_le_bytes());
        }
        (SlotMemory::Host(slot), SlotFrame::Device(header, payload)) => {
            let header = with_len(*header, payload.len)?;
            let (framed, trailer) = slot[..len].split_at_mut(HEADER_LEN + payload.len);
            framed[..HEADER_LEN].copy_from_slice(&header.encode());
            payload
                .read_into(&mut framed[HEADER_LEN..])
                .map_err(|detail| Error::Link { transport: NAME, detail: format!("copying a frame's payload off the device: {detail}") })?;
            trailer.copy_from_slice(&crc32fast::hash(framed).to_le_bytes());
        }
        (SlotMemory::Device(memory, at), SlotFrame::Host(f)) => {
            // One copy in: the frame as a byte stream would carry it.
            let mut bytes = bytes::BytesMut::with_capacity(len);
            f.encode_to(&mut bytes);
            memory.copy.write(at, &bytes).map_err(|d| device_err(memory, "writing a frame into a device send slot", d))?;
        }
        (SlotMemory::Device(memory, at), SlotFrame::Device(header, payload)) => {
            let header = with_len(*header, payload.len)?;
            let copy = &memory.copy;
            copy.write(at, &header.encode()).map_err(|d| device_err(memory, "writing a frame header into a device send slot", d))?;
            copy.copy_from_device(at + HEADER_LEN, payload.device_addr(), payload.len)
                .map_err(|d| device_err(memory, "copying a payload into a device send slot", d))?;
            let sum = copy.checksum(at, HEADER_LEN + payload.len).map_err(|d| device_err(memory, "checksumming a device send slot", d))?;
            copy.write(at + HEADER_LEN + payload.len, &sum.to_le_bytes())
                .map_err(|d| device_err(memory, "writing a frame trailer into a device send slot", d))?;
        }
    }
    Ok(len)
}

/// `header` announcing a payload of `len` bytes.
fn with_len(mut header: FrameHeader, len: usize) -> Result<FrameHeader> {
    header.payload_len = u32::try_from(len).map_err(|_| Error::FrameTooLarge { len: len as u64, max: u64::from(u32::MAX) })?;
    Ok(header)
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;
    use std::sync::Arc;

    use super::*;
    use crate::handoff::frame::{self, FrameKind, FrameLimits};
    use crate::transport::device_memory::host_device::HostDevice;
    use crate::transport::device_memory::DeviceCopy;
    use crate::types::{Epoch, ReservationId};

    fn header() -> FrameHeader {
        let mut h = FrameHeader::new(FrameKind::Data, ReservationId(7), Epoch(3));
        h.layer = 2;
        h.first_block = 5;
        h.block_count = 2;
        h
    }

    /// What a byte-stream link would carry for `header` and `payload`.
    fn encoded(payload: &[u8]) -> Vec<u8> {
        let mut b = bytes::BytesMut::new();
        Frame::new(header(), bytes::Bytes::copy_from_slice(payload)).encode_to(&mut b);
        b.to_vec()
    }

    /// The engine's packed layer: `n` bytes on a stand-in device, at an offset into it.
    fn packed(n: usize) -> (Arc<HostDevice>, DeviceRange, Vec<u8>) {
        let (_, dev) = HostDevice::memory("cuda:0", n + 96);
        let bytes: Vec<u8> = (0..n).map(|i| (i * 31 % 251) as u8).collect();
        dev.write(64, &bytes).unwrap();
        let range = DeviceRange::new(dev.clone(), 64, n).unwrap();
        (dev, range, bytes)
    }

    #[test]
    fn every_memory_pair_gives_the_byte_stream_encoding() {
        let (src, range, bytes) = packed(1000);
        let want = encoded(&bytes);
        let host_frame = Frame::new(header(), bytes::Bytes::copy_from_slice(&bytes));
        for frame in [SlotFrame::Host(&host_frame), SlotFrame::Device(header(), &range)] {
            // A host slot, with room to spare.
            let mut slot = vec![0xAAu8; want.len() + 10];
            assert_eq!(fill(SlotMemory::Host(&mut slot), &frame).unwrap(), want.len());
            assert_eq!(&slot[..want.len()], &want[..]);
            assert!(slot[want.len()..].iter().all(|&b| b == 0xAA), "nothing past the frame is written");
            // A device slot at an offset into its ring.
            let (ring, dev) = HostDevice::memory("cuda:0", 4096);
            assert_eq!(fill(SlotMemory::Device(&ring, 100), &frame).unwrap(), want.len());
            let mut got = vec![0u8; want.len()];
            dev.read(100, &mut got).unwrap();
            assert_eq!(got, want);
            // And the receiver reads it as the frame it is.
            let limits = FrameLimits { max_payload: 1 << 20 };
            let (f, used) = frame::decode(&got, &limits).unwrap().unwrap();
            assert!(used == got.len() && f.verify() && f.payload[..] == bytes[..]);
        }
        drop(src);
    }

    #[test]
    fn a_device_payload_into_a_device_slot_never_reaches_the_host() {
        let (src, range, _) = packed(4096);
        let (ring, dev) = HostDevice::memory("cuda:0", 8192);
        fill(SlotMemory::Device(&ring, 0), &SlotFrame::Device(header(), &range)).unwrap();
        assert_eq!(src.host_reads.load(Ordering::Relaxed), 0, "the payload was read to the host");
        assert_eq!(src.device_copies.load(Ordering::Relaxed), 1, "one device-to-device copy");
        assert_eq!(dev.host_reads.load(Ordering::Relaxed), 0, "the slot was read back to the host");
        // Into a host slot it is one copy off the device, straight into the slot.
        let mut slot = vec![0u8; 8192];
        fill(SlotMemory::Host(&mut slot), &SlotFrame::Device(header(), &range)).unwrap();
        assert_eq!(src.host_reads.load(Ordering::Relaxed), 4096);
    }

    #[test]
    fn a_slot_too_small_or_a_failing_copy_is_an_error_not_a_partial_frame_sent() {
        let (_src, range, _) = packed(512);
        let (ring, _dev) = HostDevice::memory("cuda:0", 256);
        let e = fill(SlotMemory::Device(&ring, 0), &SlotFrame::Device(header(), &range)).unwrap_err();
        assert_eq!(e.label(), "link");
        assert!(e.to_string().contains("cuda:0"), "{e}");
        // A source that fails to copy (its memory went away).
        struct Gone;
        impl crate::transport::device_memory::DeviceSource for Gone {
            fn device_addr(&self) -> u64 {
                8
            }
            fn len(&self) -> usize {
                64
            }
            fn read(&self, _: usize, _: &mut [u8]) -> std::result::Result<(), String> {
                Err("context destroyed".into())
            }
        }
        let gone = DeviceRange::new(Arc::new(Gone), 0, 64).unwrap();
        let mut slot = vec![0u8; 256];
        assert!(fill(SlotMemory::Host(&mut slot), &SlotFrame::Device(header(), &gone)).unwrap_err().to_string().contains("context destroyed"));
        let (ring, _dev) = HostDevice::memory("cuda:0", 256);
        assert!(fill(SlotMemory::Device(&ring, 0), &SlotFrame::Device(header(), &gone)).is_err(), "an address in no allocation");
    }
}
