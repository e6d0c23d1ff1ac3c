//! Test bodies of the conformance suite. Each takes the transport kind, builds a [`Rig`],
//! and ends by checking the pools are exactly as they started.

use std::time::{Duration, Instant};

use std::sync::Arc;

use bytes::Bytes;

use super::{Kind, Rig};
use crate::error::{Error, Side};
use crate::handoff::{Grant, KvSender, Reservation, Transfer};
use crate::pool::{ArenaPool, BlockSink};
use crate::transport::Peer;
use crate::handoff::frame::{Frame, FrameHeader, FrameKind};
use crate::transport::Link;
use crate::types::{BlockId, Epoch, KvDtype, KvLayout, ReservationId};

/// 1 KiB per block-layer: many blocks per frame, several frames per layer.
const SMALL: KvLayout = KvLayout {
    layers: 4,
    block_tokens: 16,
    kv_heads: 2,
    head_dim: 8,
    dtype: KvDtype::F16,
};

/// Slack for scheduling on a loaded 2-core machine when checking "by the deadline".
const SLACK: Duration = Duration::from_millis(1500);
const LONG: Option<Duration> = Some(Duration::from_secs(20));

async fn within<T>(limit: Duration, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(limit, f)
        .await
        .expect("did not finish in time")
}

fn kind_of<T: std::fmt::Debug>(r: crate::Result<T>) -> &'static str {
    match r {
        Ok(v) => panic!("expected an error, got {v:?}"),
        Err(e) => e.label(),
    }
}

/// Opens a transfer of `src` into `res` over the rig's link (no layer sent yet).
async fn start(rig: &Rig, res: &Reservation, src: &[BlockId]) -> Transfer {
    rig.sender
        .start(&rig.peer, res.grant(), rig.src.clone(), src.to_vec())
        .await
        .unwrap()
}

/// Sends layer 0 and waits until the receiver has installed it, so the transfer is
/// known to be under way when a case then breaks it.
async fn first_layer_landed(t: &mut Transfer, res: &mut Reservation) {
    t.send_layer(0).await.unwrap();
    within(Duration::from_secs(5), res.wait_ready_layers(1))
        .await
        .unwrap();
}

/// Sends every layer after the first and finishes: the rest of a transfer that
/// [`first_layer_landed`] began.
async fn send_rest(mut t: Transfer) -> crate::Result<()> {
    for layer in 1..SMALL.layers {
        t.send_layer(layer).await?;
    }
    t.finish().await
}

/// Owned copies of what [`KvSender::start`] takes, for a transfer run in its own task.
fn owned_send_parts(rig: &Rig, res: &Reservation, src: &[BlockId]) -> (KvSender, Peer, Grant, Arc<ArenaPool>, Vec<BlockId>) {
    (rig.sender.clone(), rig.peer.clone(), res.grant().clone(), rig.src.clone(), src.to_vec())
}

pub async fn round_trip_bit_exact(kind: Kind) {
    let cases = [
        (SMALL, 150),
        (KvLayout::smollm2_135m(KvDtype::F16), 23),
        (KvLayout::smollm2_135m(KvDtype::F32), 3),
        (KvLayout::smollm2_135m(KvDtype::Bf16), 1),
        (KvLayout::smollm2_135m(KvDtype::F8E4M3), 5),
    ];
    for (i, (layout, n)) in cases.into_iter().enumerate() {
        let rig = Rig::new(kind, layout).await;
        let seed = i as u64 ^ Instant::now().elapsed().as_nanos() as u64 ^ 0x5eed;
        let src = rig.source_blocks(n, seed);
        let res = rig.receiver.reserve(n, LONG).unwrap();
        within(
            Duration::from_secs(20),
            rig.sender.send(&rig.peer, res.grant(), rig.src.clone(), src.clone()),
        )
        .await
        .unwrap();
        let dst = res.finished().await.unwrap();
        rig.assert_same(&src, &dst);
        let rs = rig.receiver.stats().snapshot();
        assert_eq!(rs.reservations_completed, 1);
        assert_eq!(rs.block_layers, (n * layout.layers as usize) as u64);
        let ss = rig.sender.stats().snapshot();
        assert_eq!(ss.transfers, 1);
        assert_eq!(ss.transport, rig.connector.transport());
        assert!(ss.bytes >= (n * layout.bytes_per_block()) as u64);
        let per = rig.receiver.transport_stats();
        let ls = per
            .iter()
            .find(|s| s.transport == rig.connector.transport())
            .expect("stats for the transport");
        let ls = ls.snapshot();
        assert_eq!((ls.transfers, ls.block_layers), (1, rs.block_layers));
        rig.finish(&src, &dst);
    }
}

pub async fn layer_by_layer_arrival(kind: Kind) {
    let rig = Rig::new(kind, SMALL).await;
    let src = rig.source_blocks(70, 1);
    let mut res = rig.receiver.reserve(70, LONG).unwrap();
    let mut t = start(&rig, &res, &src).await;
    for layer in 0..SMALL.layers {
        assert_eq!(res.ready_layers(), layer);
        t.send_layer(layer).await.unwrap();
        // The receiver installs layer L before the sender has produced layer L+1.
        within(Duration::from_secs(10), res.wait_ready_layers(layer + 1))
            .await
            .unwrap();
        assert_eq!(res.ready_layers(), layer + 1);
    }
    t.finish().await.unwrap();
    let dst = res.finished().await.unwrap();
    rig.assert_same(&src, &dst);
    rig.finish(&src, &dst);
}

pub async fn partial_layer_range(kind: Kind) {
    let rig = Rig::new(kind, SMALL).await;
    let src = rig.source_blocks(5, 2);
    let mut res = rig.receiver.reserve_layers(5, 1..3, LONG).unwrap();
    let mut t = start(&rig, &res, &src).await;
    assert_eq!(kind_of(t.send_layer(0).await), "out_of_range");
    t.send_layer(2).await.unwrap();
    t.send_layer(1).await.unwrap();
    within(Duration::from_secs(10), res.wait_ready_layers(2))
        .await
        .unwrap();
    t.finish().await.unwrap();
    let dst = res.finished().await.unwrap();
    for (s, d) in src.iter().zip(&dst) {
        for layer in 1..3 {
            let bl = SMALL.bytes_per_block_layer();
            let (mut a, mut b) = (vec![0; bl], vec![0; bl]);
            crate::pool::BlockSource::read_layer(&*rig.src, *s, layer, &mut a).unwrap();
            crate::pool::BlockSource::read_layer(&*rig.dst, *d, layer, &mut b).unwrap();
            assert_eq!(a, b);
        }
    }
    rig.finish(&src, &dst);
}

/// A sliding-window receiver skips leading blocks of some layers: the sender leaves them off
/// the wire, the wanted block-layers land bit-exact, the skipped ones read as zeros (never
/// an earlier reservation's bytes), and a sender that ships a skipped block is refused.
pub async fn skipped_block_layers_stay_off_the_wire(kind: Kind) {
    let rig = Rig::new(kind, SMALL).await;
    let n = 9;
    let src = rig.source_blocks(n, 7);
    // Fill the receiver's blocks once, so a later reservation reuses dirty blocks.
    let res = rig.receiver.reserve(n, LONG).unwrap();
    rig.sender.send(&rig.peer, res.grant(), rig.src.clone(), src.clone()).await.unwrap();
    let dirty = res.finished().await.unwrap();
    rig.dst.release(&dirty);
    let sent_before = rig.sender.stats().snapshot().bytes;

    let skip = vec![5, 0, 9, 2];
    let res = rig.receiver.reserve_skipping(n, 0..SMALL.layers, skip.clone(), LONG).unwrap();
    assert_eq!(res.grant().skipped_block_layers(), 16);
    within(Duration::from_secs(20), rig.sender.send(&rig.peer, res.grant(), rig.src.clone(), src.clone())).await.unwrap();
    let dst = res.finished().await.unwrap();
    assert_landed_skipping(&rig, &src, &dst, &skip);
    let wanted = (n * SMALL.layers as usize - 16) as u64;
    assert_eq!(rig.sender.stats().snapshot().block_layers, (n * SMALL.layers as usize) as u64 + wanted);
    let sent = rig.sender.stats().snapshot().bytes - sent_before;
    let bl = SMALL.bytes_per_block_layer();
    assert!(sent >= wanted * bl as u64 && sent < (wanted + 1) * bl as u64 + 64 * 1024, "sent {sent} bytes for {wanted} block-layers");

    // A sender that ignores the skip (ships layer 0 from block 0) is refused.
    let res = rig.receiver.reserve_skipping(n, 0..SMALL.layers, skip, LONG).unwrap();
    let mut greedy = res.grant().clone();
    greedy.skip = vec![0; SMALL.layers as usize];
    let mut t = rig.sender.start(&rig.peer, &greedy, rig.src.clone(), src.clone()).await.unwrap();
    let r = t.send_layer(0).await.and(t.finish().await);
    assert_eq!(kind_of(r), "out_of_range");
    assert_eq!(kind_of(res.finished().await), "out_of_range");
    // Skips must be one per layer and at most the block count.
    assert!(rig.receiver.reserve_skipping(n, 0..SMALL.layers, vec![1], LONG).is_err());
    assert!(rig.receiver.reserve_skipping(n, 0..SMALL.layers, vec![0, 0, 10, 0], LONG).is_err());
    rig.finish(&src, &dst);
}

pub async fn corrupted_payload_is_detected_and_not_installed(kind: Kind) {
    let rig = Rig::new(kind, SMALL).await;
    let src = rig.source_blocks(8, 3);
    let mut res = rig.receiver.reserve(8, LONG).unwrap();
    let mut t = start(&rig, &res, &src).await;
    t.send_layer(0).await.unwrap();
    within(Duration::from_secs(10), res.wait_ready_layers(1))
        .await
        .unwrap();
    let writes = rig.dst.layer_writes();
    t.corrupt_layer = Some(1);
    let sent = t.send_layer(1).await;
    let outcome = match sent {
        Err(e) => Err(e),
        Ok(()) => within(Duration::from_secs(10), t.finish()).await,
    };
    assert_eq!(kind_of(outcome), "frame_checksum");
    match res.finished().await {
        Err(Error::FrameChecksum { layer: 1, .. }) => {}
        other => panic!("expected a checksum failure on layer 1, got {other:?}"),
    }
    assert_eq!(rig.dst.layer_writes(), writes, "a corrupted block-layer was written");
    let rs = rig.receiver.stats();
    assert!(rs.snapshot().rejected_frames >= 1);
    assert_eq!(rs.failures_of("frame_checksum"), 1);
    rig.finish(&src, &[]);
}

pub async fn unknown_or_stale_reservation_is_rejected(kind: Kind) {
    let rig = Rig::new(kind, SMALL).await;
    let src = rig.source_blocks(4, 4);
    let res = rig.receiver.reserve(4, LONG).unwrap();
    let mut unknown = res.grant().clone();
    unknown.reservation = ReservationId(res.id().0 + 1000);
    let r = rig
        .sender
        .send(&rig.peer, &unknown, rig.src.clone(), src.clone())
        .await;
    assert!(matches!(r, Err(Error::UnknownReservation { .. })), "{r:?}");
    let mut stale = res.grant().clone();
    stale.epoch = Epoch(stale.epoch.0 ^ 0x8000);
    let r = rig
        .sender
        .send(&rig.peer, &stale, rig.src.clone(), src.clone())
        .await;
    assert_eq!(kind_of(r), "stale_epoch");
    assert_eq!(rig.dst.layer_writes(), 0, "a rejected link wrote into the pool");
    // The foreign attempts did not disturb the real reservation.
    rig.sender
        .send(&rig.peer, res.grant(), rig.src.clone(), src.clone())
        .await
        .unwrap();
    let dst = res.finished().await.unwrap();
    rig.assert_same(&src, &dst);
    assert_eq!(rig.receiver.stats().snapshot().rejected_frames, 2);
    rig.finish(&src, &dst);
}

pub async fn expired_reservation_is_released_once_and_rejects_late_frames(kind: Kind) {
    let rig = Rig::new(kind, SMALL).await;
    let src = rig.source_blocks(4, 5);
    let deadline = Duration::from_millis(200);
    let started = Instant::now();
    let res = rig.receiver.reserve(4, Some(deadline)).unwrap();
    let grant = res.grant().clone();
    let r = within(deadline + SLACK, res.finished()).await;
    assert!(matches!(r, Err(Error::ReservationExpired { .. })), "{r:?}");
    assert!(started.elapsed() >= deadline);
    rig.assert_receiver_restored();
    // A late sender (its own deadline still running) is told the reservation expired.
    let mut late = grant;
    late.deadline = Duration::from_secs(10);
    late.issued_at = Instant::now();
    let r = rig.sender.send(&rig.peer, &late, rig.src.clone(), src.clone()).await;
    assert_eq!(kind_of(r), "reservation_expired");
    let s = rig.receiver.stats().snapshot();
    assert_eq!((s.reservations_expired, s.reservations_released), (1, 1));
    assert_eq!(rig.dst.layer_writes(), 0);
    rig.finish(&src, &[]);
}

pub async fn silent_sender_is_released_at_deadline(kind: Kind) {
    let rig = Rig::new(kind, SMALL).await;
    let src = rig.source_blocks(6, 6);
    let deadline = Duration::from_millis(500);
    let res = rig.receiver.reserve(6, Some(deadline)).unwrap();
    let started = Instant::now();
    let mut t = start(&rig, &res, &src).await;
    t.send_layer(0).await.unwrap();
    // The sender now stalls (a hung prefill node): the receiver's timer must act.
    let r = within(deadline + SLACK, res.finished()).await;
    assert!(matches!(r, Err(Error::ReservationExpired { .. })), "{r:?}");
    let took = started.elapsed();
    assert!(took >= deadline && took < deadline + SLACK, "{took:?}");
    rig.assert_receiver_restored();
    // Whichever timer the sender sees first, it fails too.
    let k = kind_of(within(SLACK, t.finish()).await);
    assert!(k == "reservation_expired" || k == "deadline_exceeded", "{k}");
    rig.finish(&src, &[]);
}

pub async fn sender_dropped_mid_transfer_releases(kind: Kind) {
    let rig = Rig::new(kind, SMALL).await;
    let src = rig.source_blocks(6, 7);
    let deadline = Duration::from_secs(10);
    let mut res = rig.receiver.reserve(6, Some(deadline)).unwrap();
    let mut t = start(&rig, &res, &src).await;
    first_layer_landed(&mut t, &mut res).await;
    let dropped = Instant::now();
    drop(t);
    let r = within(deadline, res.finished()).await;
    assert_eq!(kind_of(r), "peer_gone");
    // Well within the deadline: the closed link is noticed at once.
    assert!(dropped.elapsed() < Duration::from_secs(3));
    rig.finish(&src, &[]);
}

pub async fn sender_task_aborted_mid_transfer_releases(kind: Kind) {
    let rig = Rig::new(kind, SMALL).await;
    let src = rig.source_blocks(6, 8);
    let deadline = Duration::from_secs(3);
    let mut res = rig.receiver.reserve(6, Some(deadline)).unwrap();
    let (sender, peer, grant, source, blocks) = owned_send_parts(&rig, &res, &src);
    let task = tokio::spawn(async move {
        let mut t = sender.start(&peer, &grant, source, blocks).await.unwrap();
        t.send_layer(0).await.unwrap();
        std::future::pending::<()>().await;
    });
    within(Duration::from_secs(5), res.wait_ready_layers(1))
        .await
        .unwrap();
    task.abort();
    let r = within(deadline + SLACK, res.finished()).await;
    assert!(r.is_err(), "{r:?}");
    rig.finish(&src, &[]);
}

pub async fn receiver_gone_sender_fails_within_deadline(kind: Kind) {
    let rig = Rig::new(kind, SMALL).await;
    let src = rig.source_blocks(6, 9);
    let deadline = Duration::from_secs(2);
    let mut res = rig.receiver.reserve(6, Some(deadline)).unwrap();
    let started = Instant::now();
    let mut t = start(&rig, &res, &src).await;
    first_layer_landed(&mut t, &mut res).await;
    rig.listener.shutdown();
    // The receiver's side of the link dies with the listener and releases the reservation
    // (listener shutdown is asynchronous for some transports: wait for it to land).
    assert!(within(deadline + SLACK, res.finished()).await.is_err());
    let r = within(deadline + SLACK, send_rest(t)).await;
    assert!(r.is_err(), "{r:?}");
    assert!(started.elapsed() < deadline + SLACK);
    rig.finish(&src, &[]);
}

pub async fn silent_receiver_sender_fails_by_deadline(kind: Kind) {
    let rig = Rig::new(kind, SMALL).await;
    let src = rig.source_blocks(6, 10);
    let (silent, _guard) = rig.silent_peer().await;
    let deadline = Duration::from_millis(700);
    let res = rig.receiver.reserve(6, Some(deadline)).unwrap();
    let started = Instant::now();
    let r = within(
        deadline + SLACK,
        rig.sender.send(&silent, res.grant(), rig.src.clone(), src.clone()),
    )
    .await;
    assert_eq!(kind_of(r), "deadline_exceeded");
    let took = started.elapsed();
    assert!(took >= deadline - Duration::from_millis(50), "{took:?}");
    drop(res);
    rig.finish(&src, &[]);
}

pub async fn cancel_from_receiver(kind: Kind) {
    let rig = Rig::new(kind, SMALL).await;
    let src = rig.source_blocks(6, 11);
    let mut res = rig.receiver.reserve(6, LONG).unwrap();
    let mut t = start(&rig, &res, &src).await;
    first_layer_landed(&mut t, &mut res).await;
    res.cancel();
    // Released at once, not when the sender notices.
    rig.assert_receiver_restored();
    let r = within(Duration::from_secs(5), send_rest(t)).await;
    assert!(
        matches!(r, Err(Error::Cancelled { by: Side::Receiver, .. })),
        "{r:?}"
    );
    rig.finish(&src, &[]);
}

pub async fn cancel_from_sender(kind: Kind) {
    let rig = Rig::new(kind, SMALL).await;
    let src = rig.source_blocks(6, 12);
    let mut res = rig.receiver.reserve(6, LONG).unwrap();
    let mut t = start(&rig, &res, &src).await;
    first_layer_landed(&mut t, &mut res).await;
    t.cancel().await;
    let r = within(Duration::from_secs(5), res.finished()).await;
    assert!(
        matches!(r, Err(Error::Cancelled { by: Side::Sender, .. })),
        "{r:?}"
    );
    rig.finish(&src, &[]);
}

pub async fn incomplete_transfer_is_rejected(kind: Kind) {
    let rig = Rig::new(kind, SMALL).await;
    let src = rig.source_blocks(3, 13);
    let res = rig.receiver.reserve(3, LONG).unwrap();
    let mut t = start(&rig, &res, &src).await;
    t.send_layer(0).await.unwrap();
    assert_eq!(kind_of(t.finish().await), "incomplete");
    assert_eq!(kind_of(res.finished().await), "incomplete");
    rig.finish(&src, &[]);
}

/// Layer `layer` of `src[first..end]`, block-layer after block-layer: what a pipelined
/// export hands the sender as the engine writes the layer.
/// Every layer of `dst` holds `src`'s bytes, except the first `skip[layer]` blocks of a
/// layer, which stay zero (never written).
fn assert_landed_skipping(rig: &Rig, src: &[BlockId], dst: &[BlockId], skip: &[u32]) {
    let bl = SMALL.bytes_per_block_layer();
    for layer in 0..SMALL.layers {
        for (i, (s, d)) in src.iter().zip(dst).enumerate() {
            let (mut a, mut b) = (vec![0; bl], vec![0; bl]);
            crate::pool::BlockSource::read_layer(&*rig.src, *s, layer, &mut a).unwrap();
            crate::pool::BlockSource::read_layer(&*rig.dst, *d, layer, &mut b).unwrap();
            if i < skip[layer as usize] as usize {
                assert!(b.iter().all(|&x| x == 0), "skipped block {i} of layer {layer} is not zero");
            } else {
                assert_eq!(a, b, "block {i} of layer {layer}");
            }
        }
    }
}

fn layer_run(rig: &Rig, src: &[BlockId], layer: u32, blocks: std::ops::Range<usize>) -> Vec<u8> {
    let bl = crate::pool::BlockSource::layout(&*rig.src).bytes_per_block_layer();
    let mut out = vec![0u8; blocks.len() * bl];
    for (o, b) in out.chunks_exact_mut(bl).zip(&src[blocks]) {
        crate::pool::BlockSource::read_layer(&*rig.src, *b, layer, o).unwrap();
    }
    out
}

/// A pipelined export: the transfer is fed one layer of a run of blocks at a time, chunk
/// after chunk (every layer of blocks 0..3, then of 3..8, ...), with sliding-window skips
/// that the sender drops; everything lands bit-exact, and nothing twice or outside the
/// grant is sent.
pub async fn pipelined_layer_runs_land_bit_exact(kind: Kind) {
    let rig = Rig::new(kind, SMALL).await;
    let n = 11;
    let src = rig.source_blocks(n, 21);
    let skip = vec![0, 4, 0, 11];
    let res = rig.receiver.reserve_skipping(n, 0..SMALL.layers, skip.clone(), LONG).unwrap();
    let mut t = within(Duration::from_secs(10), rig.sender.open(&rig.peer, res.grant())).await.unwrap();
    let wanted = res.grant().block_layers();
    for chunk in [0..3, 3..8, 8..11] {
        for layer in 0..SMALL.layers {
            t.send_blocks(layer, chunk.start as u32, &layer_run(&rig, &src, layer, chunk.clone())).await.unwrap();
        }
        if chunk.start == 0 {
            assert_eq!(kind_of(t.send_blocks(0, 1, &layer_run(&rig, &src, 0, 1..2)).await), "duplicate_block", "a block-layer twice");
        }
    }
    assert_eq!(t.missing(), 0);
    t.finish().await.unwrap();
    let dst = res.finished().await.unwrap();
    assert_landed_skipping(&rig, &src, &dst, &skip);
    assert_eq!(rig.receiver.stats().snapshot().block_layers, wanted, "each wanted block-layer once, no skipped one");
    rig.finish(&src, &dst);

    // Outside the grant: refused here, before anything goes on the wire.
    let src = rig.source_blocks(2, 22);
    let res = rig.receiver.reserve(2, LONG).unwrap();
    let mut t = within(Duration::from_secs(10), rig.sender.open(&rig.peer, res.grant())).await.unwrap();
    assert_eq!(kind_of(t.send_blocks(SMALL.layers, 0, &layer_run(&rig, &src, 0, 0..1)).await), "out_of_range");
    assert_eq!(kind_of(t.send_blocks(0, 1, &layer_run(&rig, &src, 0, 0..2)).await), "out_of_range", "past the last block");
    assert_eq!(kind_of(t.send_blocks(0, 0, &[0u8; 3]).await), "layout_mismatch", "not whole block-layers");
    t.cancel().await;
    assert!(res.finished().await.is_err());
    rig.finish(&src, &[]);
}

/// `bytes` on a stand-in device (host memory; see `host_device`), as the engine's packed
/// layer would be on its GPU.
fn on_device(bytes: &[u8]) -> (Arc<dyn crate::transport::device_memory::DeviceSource>, Arc<crate::transport::device_memory::host_device::HostDevice>) {
    use crate::transport::device_memory::DeviceCopy;
    let (_, dev) = crate::transport::device_memory::host_device::HostDevice::memory("cuda:0", bytes.len());
    dev.write(0, bytes).unwrap();
    (dev.clone(), dev)
}

/// A pipelined export from device memory ([`crate::Transfer::send_device_blocks`]): runs
/// of more blocks than one frame holds (each frame a range of the run), sliding-window
/// skips dropped, the same refusals as from host memory; everything lands bit-exact. A
/// link with device send rings copies each range device to device; every other link
/// brings it to the host first, which is what this checks on a machine without either.
pub async fn pipelined_device_layer_runs_land_bit_exact(kind: Kind) {
    let rig = Rig::new(kind, SMALL).await;
    let n = 150;
    let src = rig.source_blocks(n, 24);
    let skip = vec![0, 90, 0, 3];
    let res = rig.receiver.reserve_skipping(n, 0..SMALL.layers, skip.clone(), LONG).unwrap();
    let mut t = within(Duration::from_secs(10), rig.sender.open(&rig.peer, res.grant())).await.unwrap();
    let wanted = res.grant().block_layers();
    let mut held = Vec::new();
    for chunk in [0..70, 70..150] {
        for layer in 0..SMALL.layers {
            let (source, dev) = on_device(&layer_run(&rig, &src, layer, chunk.clone()));
            t.send_device_blocks(layer, chunk.start as u32, source).await.unwrap();
            held.push(dev);
        }
    }
    let (again, _) = on_device(&layer_run(&rig, &src, 0, 1..2));
    assert_eq!(kind_of(t.send_device_blocks(0, 1, again).await), "duplicate_block", "a block-layer twice");
    assert_eq!(t.missing(), 0);
    t.finish().await.unwrap();
    let dst = res.finished().await.unwrap();
    assert_landed_skipping(&rig, &src, &dst, &skip);
    assert_eq!(rig.receiver.stats().snapshot().block_layers, wanted, "each wanted block-layer once, no skipped one");
    // Whatever the link, nothing but the wanted block-layers came off the device.
    let bl = SMALL.bytes_per_block_layer() as u64;
    let read: u64 = held.iter().map(|d| d.host_reads.load(std::sync::atomic::Ordering::Relaxed)).sum();
    if !rig.connector.sends_from_device() {
        assert_eq!(read, wanted * bl, "skipped block-layers were read off the device");
    }
    rig.finish(&src, &dst);

    let src = rig.source_blocks(2, 25);
    let res = rig.receiver.reserve(2, LONG).unwrap();
    let mut t = within(Duration::from_secs(10), rig.sender.open(&rig.peer, res.grant())).await.unwrap();
    assert_eq!(kind_of(t.send_device_blocks(SMALL.layers, 0, on_device(&layer_run(&rig, &src, 0, 0..1)).0).await), "out_of_range");
    assert_eq!(kind_of(t.send_device_blocks(0, 1, on_device(&layer_run(&rig, &src, 0, 0..2)).0).await), "out_of_range", "past the last block");
    assert_eq!(kind_of(t.send_device_blocks(0, 0, on_device(&[0u8; 3]).0).await), "layout_mismatch", "not whole block-layers");
    t.cancel().await;
    assert!(res.finished().await.is_err());
    rig.finish(&src, &[]);
}

/// A pipelined export whose last layer never came (the prefill died, or the engine
/// dropped the export): `Done` is refused as incomplete, nothing is adopted and every
/// reserved block goes back.
pub async fn pipelined_missing_layer_is_never_adopted(kind: Kind) {
    let rig = Rig::new(kind, SMALL).await;
    let n = 6;
    let src = rig.source_blocks(n, 23);
    let res = rig.receiver.reserve(n, LONG).unwrap();
    let mut t = within(Duration::from_secs(10), rig.sender.open(&rig.peer, res.grant())).await.unwrap();
    for chunk in [0..4, 4..6] {
        for layer in 0..SMALL.layers {
            if chunk.start == 4 && layer == SMALL.layers - 1 {
                continue;
            }
            t.send_blocks(layer, chunk.start as u32, &layer_run(&rig, &src, layer, chunk.clone())).await.unwrap();
        }
    }
    assert_eq!(t.missing(), 2);
    assert_eq!(kind_of(t.finish().await), "incomplete");
    assert_eq!(kind_of(res.finished().await), "incomplete");
    rig.finish(&src, &[]);
}

/// Opens a raw link and sends `frames`; returns the receiver's reply.
async fn raw_exchange(rig: &Rig, frames: Vec<Frame>) -> Option<Frame> {
    let Link { mut tx, mut rx, .. } = rig.connector.open(&rig.peer).await.unwrap();
    for f in frames {
        if tx.send(f).await.is_err() {
            break;
        }
    }
    within(Duration::from_secs(10), rx.recv()).await.ok().flatten()
}

fn data(res: &crate::Reservation, layer: u32, first: u32, count: u32, bl: usize) -> Frame {
    let mut h = FrameHeader::new(FrameKind::Data, res.id(), res.grant().epoch);
    h.layer = layer;
    h.first_block = first;
    h.block_count = count;
    Frame::new(h, Bytes::from(vec![7u8; count as usize * bl]))
}

fn open(res: &crate::Reservation) -> Frame {
    let g = res.grant();
    Frame::open(g.reservation, g.epoch, &g.layout, g.layers.clone(), g.blocks.len() as u32)
}

fn failure_kind(reply: Option<Frame>) -> &'static str {
    let f = reply.expect("the receiver replied");
    assert_eq!(f.header.kind, FrameKind::Failed);
    crate::error::KINDS[f.failure().code as usize]
}

pub async fn hostile_frames_are_rejected(kind: Kind) {
    let rig = Rig::new(kind, SMALL).await;
    let bl = SMALL.bytes_per_block_layer();

    // Data before Open: the link is refused and the reservation untouched.
    let res = rig.receiver.reserve(4, LONG).unwrap();
    let reply = raw_exchange(&rig, vec![data(&res, 0, 0, 1, bl)]).await;
    assert_eq!(failure_kind(reply), "unexpected_frame");
    assert_eq!(rig.receiver.live_reservations(), 1);

    // A block index past the reservation.
    let reply = raw_exchange(&rig, vec![open(&res), data(&res, 0, 3, 2, bl)]).await;
    assert_eq!(failure_kind(reply), "out_of_range");
    assert_eq!(kind_of(res.finished().await), "out_of_range");

    // The same block-layer twice.
    let res = rig.receiver.reserve(4, LONG).unwrap();
    let reply = raw_exchange(
        &rig,
        vec![open(&res), data(&res, 0, 0, 2, bl), data(&res, 0, 1, 1, bl)],
    )
    .await;
    assert_eq!(failure_kind(reply), "duplicate_block");
    assert_eq!(kind_of(res.finished().await), "duplicate_block");

    // A payload that does not match the block count.
    let res = rig.receiver.reserve(4, LONG).unwrap();
    let mut short = data(&res, 0, 0, 2, bl);
    short = Frame::new(short.header, short.payload.slice(..bl));
    let reply = raw_exchange(&rig, vec![open(&res), short]).await;
    assert_eq!(failure_kind(reply), "layout_mismatch");
    drop(res);

    // A sender whose layout disagrees fails the reservation before any data.
    let res = rig.receiver.reserve(4, LONG).unwrap();
    let g = res.grant();
    let other = KvLayout { head_dim: 16, ..SMALL };
    let bad_open = Frame::open(g.reservation, g.epoch, &other, g.layers.clone(), 4);
    let reply = raw_exchange(&rig, vec![bad_open]).await;
    assert_eq!(failure_kind(reply), "layout_mismatch");
    assert_eq!(kind_of(res.finished().await), "layout_mismatch");

    // A second link for a reservation that already has one is refused, the first goes on.
    let src = rig.source_blocks(4, 14);
    let mut res = rig.receiver.reserve(4, LONG).unwrap();
    let mut t = start(&rig, &res, &src).await;
    first_layer_landed(&mut t, &mut res).await;
    let reply = raw_exchange(&rig, vec![open(&res), data(&res, 1, 0, 1, bl)]).await;
    assert_eq!(failure_kind(reply), "already_attached");
    send_rest(t).await.unwrap();
    let dst = res.finished().await.unwrap();
    rig.assert_same(&src, &dst);
    rig.finish(&src, &dst);
}

/// A stream's first frame is read under the limits of a link that has not opened: a data
/// header announcing a 60 MiB payload is refused from its header alone, before anything
/// is allocated or read (the receiver used to allocate the payload first, for any
/// certificate of the cluster, on each of 1,024 streams per connection).
pub async fn a_first_frame_cannot_make_the_receiver_allocate(kind: Kind) {
    let rig = Rig::new(kind, SMALL).await;
    let res = rig.receiver.reserve(4, LONG).unwrap();
    let mut claim = data(&res, 0, 0, 0, 0);
    claim.header.payload_len = 60 << 20;
    // The payload never follows: a receiver waiting for it would not answer in time.
    let reply = raw_exchange(&rig, vec![claim]).await;
    assert_eq!(failure_kind(reply), "unexpected_frame");
    assert_eq!(rig.receiver.live_reservations(), 1, "the reservation is untouched");
    drop(res);
}

pub async fn concurrent_transfers_are_isolated(kind: Kind) {
    let rig = Rig::new(kind, SMALL).await;
    let sizes = [1usize, 17, 64, 90];
    let mut jobs = Vec::new();
    for (i, &n) in sizes.iter().enumerate() {
        let src = rig.source_blocks(n, 100 + i as u64);
        let res = rig.receiver.reserve(n, LONG).unwrap();
        let (sender, peer, grant, source, blocks) = owned_send_parts(&rig, &res, &src);
        let job = tokio::spawn(async move { sender.send(&peer, &grant, source, blocks).await });
        jobs.push((src, res, job));
    }
    for (src, res, job) in jobs {
        within(Duration::from_secs(20), job).await.unwrap().unwrap();
        let dst = res.finished().await.unwrap();
        rig.assert_same(&src, &dst);
        rig.src.release(&src);
        rig.dst.release(&dst);
    }
    rig.assert_restored();
}
