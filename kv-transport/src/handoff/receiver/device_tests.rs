//! Data frames whose payload stayed in device memory (an RDMA ring in GPU memory): the
//! receiver checks them by the checksum the device computed and installs them with device
//! copies into a device pool, or through the host into any other; a corrupted payload is
//! refused like any frame, and every frame lets go of its slot once installed.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;

use crate::handoff::frame::{FrameHeader, HEADER_LEN, TRAILER_LEN};
use crate::handoff::{KvReceiver, ReceiverConfig};
use crate::pool::ArenaPool;
use crate::transport::device_memory::host_device::HostDevice;
use crate::transport::device_memory::{DeviceMemory, DevicePayload};
use crate::transport::inproc::InProcNetwork;
use crate::transport::{Connector, Link, Peer};
use crate::types::TEST_LAYOUT as LAYOUT;

use super::*;

/// Counts the slots held by frames still alive.
struct Slot(&'static AtomicUsize);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A ring in "device" memory, written the way the NIC writes it: header, payload and trailer
/// in slot `slot`, then taken as a device frame (header and trailer read, checksum computed
/// by the device). `corrupt` flips a payload byte after the trailer was computed.
fn device_frame(ring: &DeviceMemory, slot: usize, header: FrameHeader, payload: &[u8], corrupt: bool, held: &'static AtomicUsize) -> Frame {
    let f = Frame::new(header, Bytes::copy_from_slice(payload));
    let mut wire = bytes::BytesMut::new();
    f.encode_to(&mut wire);
    let at = slot * (HEADER_LEN + payload.len() + TRAILER_LEN);
    if corrupt {
        wire[HEADER_LEN + 3] ^= 0x40;
    }
    ring.copy.write(at, &wire).unwrap();
    let sum = ring.copy.checksum(at, HEADER_LEN + payload.len()).unwrap();
    held.fetch_add(1, Ordering::SeqCst);
    let hold: Arc<dyn std::any::Any + Send + Sync> = Arc::new(Slot(held));
    Frame::on_device(f.header, DevicePayload::new(ring.clone(), at + HEADER_LEN, payload.len(), sum, hold), f.checksum)
}

struct Run {
    pool: Arc<ArenaPool>,
    blocks: Result<Vec<BlockId>>,
    reply: Option<Frame>,
}

/// Sends an Open frame, then `data(reservation, epoch)`'s frames, then Done, over an
/// in-process link to a receiver over `pool`.
async fn run(pool: ArenaPool, blocks: usize, data: impl FnOnce(ReservationId, Epoch) -> Vec<Frame>) -> Run {
    let pool = Arc::new(pool);
    let receiver = KvReceiver::new(pool.clone(), ReceiverConfig::default()).unwrap();
    let net = InProcNetwork::new();
    let _listener = net.listen("decode-0", receiver.clone()).unwrap();
    let res = receiver.reserve(blocks, Some(Duration::from_secs(10))).unwrap();
    let g = res.grant();
    let Link { mut tx, mut rx, .. } = net.connector().open(&Peer::InProc { name: "decode-0".into() }).await.unwrap();
    let mut frames = vec![Frame::open(g.reservation, g.epoch, &g.layout, g.layers.clone(), g.blocks.len() as u32)];
    frames.extend(data(g.reservation, g.epoch));
    frames.push(Frame::control(FrameKind::Done, g.reservation, g.epoch));
    for f in frames {
        if tx.send(f).await.is_err() {
            break;
        }
    }
    let blocks = tokio::time::timeout(Duration::from_secs(10), res.finished()).await.expect("the transfer ended");
    let reply = tokio::time::timeout(Duration::from_millis(200), rx.recv()).await.ok().and_then(|r| r.ok().flatten());
    Run { pool, blocks, reply }
}

fn header(reservation: ReservationId, epoch: Epoch, layer: u32, first: u32, count: u32) -> FrameHeader {
    let mut h = FrameHeader::new(FrameKind::Data, reservation, epoch);
    (h.layer, h.first_block, h.block_count) = (layer, first, count);
    h
}

/// Block-layer `(block, layer)`'s bytes: distinct everywhere.
fn bytes_of(block: u32, layer: u32, bl: usize) -> Vec<u8> {
    (0..bl).map(|i| (i as u32).wrapping_mul(31).wrapping_add(block * 7 + layer * 101) as u8).collect()
}

/// Two blocks, both layers: one frame per layer carrying both blocks.
fn frames<'a>(ring: &'a DeviceMemory, held: &'static AtomicUsize, corrupt_layer: Option<u32>) -> impl FnOnce(ReservationId, Epoch) -> Vec<Frame> + 'a {
    move |r, e| {
        let bl = LAYOUT.bytes_per_block_layer();
        (0..LAYOUT.layers)
            .map(|layer| {
                let payload: Vec<u8> = (0..2).flat_map(|b| bytes_of(b, layer, bl)).collect();
                device_frame(ring, layer as usize, header(r, e, layer, 0, 2), &payload, corrupt_layer == Some(layer), held)
            })
            .collect()
    }
}

fn check_blocks(run: &Run) {
    let bl = LAYOUT.bytes_per_block_layer();
    let blocks = run.blocks.as_ref().expect("the transfer completed");
    for (b, &id) in blocks.iter().enumerate() {
        let got = run.pool.read_block(id).unwrap();
        for layer in 0..LAYOUT.layers {
            let at = layer as usize * bl;
            assert_eq!(&got[at..at + bl], bytes_of(b as u32, layer, bl).as_slice(), "block {b} layer {layer}");
        }
    }
}

const RING: usize = 64 << 10;

#[tokio::test]
async fn device_payloads_go_device_to_device_into_a_device_pool() {
    static HELD: AtomicUsize = AtomicUsize::new(0);
    let (ring, ring_dev) = HostDevice::memory("cuda:0", RING);
    let (staging, staging_dev) = HostDevice::memory("cuda:0", ArenaPool::bytes_for(LAYOUT, 4).unwrap());
    let run = run(ArenaPool::on_device(LAYOUT, 4, staging).unwrap(), 2, frames(&ring, &HELD, None)).await;
    check_blocks(&run);
    // Not one payload byte came to the host: one device copy per frame (the two blocks are
    // consecutive), and only the pool's own readback (check_blocks) read the staging memory.
    assert_eq!(ring_dev.host_reads.load(Ordering::SeqCst), 0);
    assert_eq!(ring_dev.device_copies.load(Ordering::SeqCst), 2);
    assert_eq!(staging_dev.host_reads.load(Ordering::SeqCst), 2 * LAYOUT.bytes_per_block() as u64);
    assert_eq!(HELD.load(Ordering::SeqCst), 0, "every frame let go of its slot");
}

#[tokio::test]
async fn device_payloads_reach_a_host_pool_or_another_device_through_the_host() {
    static HELD: AtomicUsize = AtomicUsize::new(0);
    let (ring, ring_dev) = HostDevice::memory("cuda:0", RING);
    let run1 = run(ArenaPool::new(LAYOUT, 4).unwrap(), 2, frames(&ring, &HELD, None)).await;
    check_blocks(&run1);
    let payload_bytes = 2 * LAYOUT.bytes_per_block() as u64;
    assert_eq!(ring_dev.host_reads.load(Ordering::SeqCst), payload_bytes);
    assert_eq!(ring_dev.device_copies.load(Ordering::SeqCst), 0);
    // A pool on another GPU cannot take a copy from this one's memory.
    let (other, _) = HostDevice::memory("cuda:1", ArenaPool::bytes_for(LAYOUT, 4).unwrap());
    let run2 = run(ArenaPool::on_device(LAYOUT, 4, other).unwrap(), 2, frames(&ring, &HELD, None)).await;
    check_blocks(&run2);
    assert_eq!(ring_dev.host_reads.load(Ordering::SeqCst), 2 * payload_bytes);
    assert_eq!(ring_dev.device_copies.load(Ordering::SeqCst), 0);
    assert_eq!(HELD.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn a_corrupted_device_payload_is_refused_by_its_checksum() {
    static HELD: AtomicUsize = AtomicUsize::new(0);
    let (ring, ring_dev) = HostDevice::memory("cuda:0", RING);
    let (staging, _) = HostDevice::memory("cuda:0", ArenaPool::bytes_for(LAYOUT, 4).unwrap());
    let run = run(ArenaPool::on_device(LAYOUT, 4, staging).unwrap(), 2, frames(&ring, &HELD, Some(1))).await;
    match run.blocks {
        Err(Error::FrameChecksum { layer: 1, .. }) => {}
        other => panic!("expected a checksum failure on layer 1, got {other:?}"),
    }
    let reply = run.reply.expect("the receiver replied");
    assert_eq!(reply.header.kind, FrameKind::Failed);
    assert_eq!(crate::error::KINDS[reply.failure().code as usize], "frame_checksum");
    // Layer 0 went in (one copy) before layer 1 was refused; nothing of layer 1 did; the
    // blocks are free.
    assert_eq!(ring_dev.device_copies.load(Ordering::SeqCst), 1);
    assert_eq!(run.pool.layer_writes(), 2);
    assert_eq!(run.pool.free_blocks(), 4);
    assert_eq!(HELD.load(Ordering::SeqCst), 0);
}
