//! One RDMA link: frames go out as RDMA WRITE WITH IMMEDIATE into a slot of the receiver's
//! ring; credits, replies and the goodbye travel on the link's QUIC control stream.
//!
//! Owns: the sender's halves (`SenderTx`, `SenderRx` and the task that reads credits
//! and replies) and the receiver's halves (`ReceiverTx`, `ReceiverRx` and the task that
//! watches the control stream for the goodbye).
//! Invariants:
//! - Frame `seq` is written to slot `seq % slots` with immediate data `seq`; the receiver
//!   accepts only the sequence it expects, so a lost or reordered write is an error.
//! - The receiver is done with a frame's slot before it returns the credit for it (a frame
//!   copied out at once; a `Data` frame left in a device ring once the receiver installed
//!   it and dropped it), credits go back in order, and the sender writes into a slot only
//!   with a credit for it ([`SendWindow`]).
//! - A frame other than `Data` (`Open`, `Done`, `Cancel`) is sent only once every earlier
//!   write completed, so the goodbye, which counts completed writes, covers it.
//! - Queue pairs are destroyed before the ring they write to or from is given back (field
//!   order), so no DMA can reach a ring another link holds.
//! - Waiting on a completion queue is polling with `yield_now`, then 1 ms sleeps when idle;
//!   completion channels would avoid the polling and are not used yet.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, watch, Mutex};

use crate::error::{Error, Result};
use crate::handoff::frame::{self, Frame, FrameHeader, FrameKind, FrameLimits, HEADER_LEN, TRAILER_LEN};
use crate::transport::rdma::ring::{imm_for, RingGeometry, RingLease, SendWindow, SlotCredits};
use crate::transport::rdma::setup::{read_msg, write_msg, Msg, RingInfo};
use crate::transport::device_memory::{DevicePayload, DeviceRange};
use crate::transport::rdma::send_slot::{self, SlotFrame, SlotMemory};
use crate::transport::rdma::memory::RingRegion;
use crate::transport::rdma::verbs::{Completion, QueuePair, WriteImm};
use crate::transport::{BoxFuture, LinkRx, LinkTx};

pub(crate) const NAME: &str = "rdma";

/// How long a receiver waits, after the goodbye, for writes the sender saw complete.
const BYE_GRACE: Duration = Duration::from_secs(2);

fn link_err(detail: impl Into<String>) -> Error {
    Error::Link {
        transport: NAME,
        detail: detail.into(),
    }
}

/// Spins on the scheduler first (completions come within microseconds while data flows),
/// then sleeps so an idle link does not burn a core.
struct Backoff(u32);

impl Backoff {
    async fn wait(&mut self) {
        self.0 += 1;
        if self.0 < 256 {
            tokio::task::yield_now().await;
        } else {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
}

/// Aborts a task when the last half of a link that needs it is dropped.
pub(crate) struct TaskGuard(pub tokio::task::AbortHandle);

impl Drop for TaskGuard {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A connector's registered send memory (host or device, local access only): `rings`
/// rings cut by `geometry`, one lkey.
pub(crate) struct SendArena {
    pub region: RingRegion,
    pub lkey: u32,
    pub geometry: RingGeometry,
}

/// What the sender's control task learned: cumulative credits, or that the stream ended.
#[derive(Clone, Copy, Debug)]
struct CreditState {
    consumed: u64,
    closed: bool,
}

/// Sending half on the sender.
pub(crate) struct SenderTx {
    // Field order is drop order: the QP must go before the lease and the memory.
    qp: QueuePair,
    lease: RingLease,
    arena: Arc<SendArena>,
    remote: RingInfo,
    /// The receiver's ring cut by its own slot size and count (which may differ from ours).
    remote_geometry: RingGeometry,
    window: SendWindow,
    credits: watch::Receiver<CreditState>,
    ctrl: Option<quinn::SendStream>,
    done: Vec<Completion>,
    _task: Arc<TaskGuard>,
}

/// Receiving half on the sender: the receiver's replies.
pub(crate) struct SenderRx {
    replies: mpsc::Receiver<Result<Frame>>,
    _task: Arc<TaskGuard>,
}

/// Builds the sender's halves once the queue pair is connected.
pub(crate) fn sender_link(
    qp: QueuePair,
    lease: RingLease,
    arena: Arc<SendArena>,
    remote: RingInfo,
    ctrl_send: quinn::SendStream,
    mut ctrl_recv: quinn::RecvStream,
) -> (SenderTx, SenderRx) {
    let (credit_tx, credits) = watch::channel(CreditState {
        consumed: 0,
        closed: false,
    });
    let (reply_tx, replies) = mpsc::channel(4);
    let task = tokio::spawn(async move {
        let end = loop {
            match read_msg(&mut ctrl_recv).await {
                Ok(Some(Msg::Credit { consumed })) => {
                    credit_tx.send_modify(|c| c.consumed = c.consumed.max(consumed));
                }
                Ok(Some(Msg::Reply(bytes))) => {
                    let limits = FrameLimits { max_payload: 0 };
                    let parsed = match frame::decode(&bytes, &limits) {
                        Ok(Some((f, used))) if used == bytes.len() => Ok(f),
                        Ok(_) => Err(Error::FrameMalformed {
                            what: "RDMA reply is not exactly one frame",
                        }),
                        Err(e) => Err(e),
                    };
                    if reply_tx.send(parsed).await.is_err() {
                        // Nobody reads replies any more; keep serving credits.
                        continue;
                    }
                }
                Ok(Some(_)) => {
                    break Some(Error::FrameMalformed {
                        what: "unexpected RDMA control message from the receiver",
                    })
                }
                Ok(None) => break None,
                Err(e) => break Some(e),
            }
        };
        credit_tx.send_modify(|c| c.closed = true);
        if let Some(e) = end {
            let _ = reply_tx.send(Err(e)).await;
        }
    });
    let guard = Arc::new(TaskGuard(task.abort_handle()));
    let slots = remote.slots.min(arena.geometry.slots);
    let remote_geometry = RingGeometry {
        rings: 1,
        slots: remote.slots,
        slot_bytes: remote.slot_bytes,
    };
    (
        SenderTx {
            qp,
            lease,
            arena,
            remote,
            remote_geometry,
            window: SendWindow::new(slots),
            credits,
            ctrl: Some(ctrl_send),
            done: Vec::new(),
            _task: guard.clone(),
        },
        SenderRx {
            replies,
            _task: guard,
        },
    )
}

impl SenderTx {
    /// Polls send completions into the window.
    fn reap(&mut self) -> Result<()> {
        self.done.clear();
        self.qp.poll(&mut self.done, 16)?;
        for _ in 0..self.done.len() {
            self.window.completed()?;
        }
        Ok(())
    }

    fn absorb_credits(&mut self) -> Result<bool> {
        let c = *self.credits.borrow_and_update();
        self.window.credit(c.consumed)?;
        Ok(c.closed)
    }

    async fn send_frame(&mut self, frame: SlotFrame<'_>) -> Result<()> {
        let len = frame.wire_len();
        let max = self.remote.slot_bytes.min(self.arena.geometry.slot_bytes) as usize;
        if len > max {
            return Err(Error::FrameTooLarge {
                len: len as u64,
                max: max.saturating_sub(HEADER_LEN + TRAILER_LEN) as u64,
            });
        }
        let mut backoff = Backoff(0);
        let seq = loop {
            self.reap()?;
            let closed = self.absorb_credits()?;
            if let Some(seq) = self.window.next() {
                break seq;
            }
            if closed {
                return Err(link_err("the receiver closed the control stream"));
            }
            backoff.wait().await;
        };
        let geometry = self.arena.geometry;
        let offset = geometry.ring_offset(self.lease.index) + geometry.slot_offset(seq);
        let slot = match &self.arena.region {
            // SAFETY: the slot lies inside the arena (geometry checked at creation) and
            // belongs to this link's lease; the window guarantees the previous write from it
            // completed, so the NIC is not reading it.
            RingRegion::Host { region, .. } => SlotMemory::Host(unsafe { std::slice::from_raw_parts_mut(region.base().add(offset), len) }),
            RingRegion::Device { region, .. } => SlotMemory::Device(region.memory(), offset),
        };
        send_slot::fill(slot, &frame)?;
        let kind = match &frame {
            SlotFrame::Host(f) => f.header.kind,
            SlotFrame::Device(h, _) => h.kind,
        };
        // The receiver finds frame `seq` at `seq % its slots`, whatever our ring looks like.
        let remote_addr = self.remote.addr + self.remote_geometry.slot_offset(seq) as u64;
        // SAFETY: the slot is registered under `lkey` (a host address, or the device address
        // that is the dma-buf registration's I/O virtual address) and stays untouched until
        // the window sees this write complete; the arena outlives the QP (field order).
        unsafe {
            self.qp.post_write_imm(&WriteImm {
                wr_id: seq,
                local: self.arena.region.addr(offset),
                len: len as u32,
                lkey: self.arena.lkey,
                remote_addr,
                rkey: self.remote.rkey,
                imm: imm_for(seq),
            })?;
        }
        self.window.posted();
        if kind != FrameKind::Data {
            // Control frames are rare: wait until they landed, so a goodbye sent right
            // after counts them.
            let mut backoff = Backoff(0);
            while self.window.in_flight() > 0 {
                self.reap()?;
                if self.window.in_flight() > 0 {
                    backoff.wait().await;
                }
            }
        }
        Ok(())
    }
}

impl LinkTx for SenderTx {
    fn send(&mut self, frame: Frame) -> BoxFuture<'_, Result<()>> {
        Box::pin(async move { self.send_frame(SlotFrame::Host(&frame)).await })
    }

    /// Straight from the engine's device memory into the slot: device to device where the
    /// send rings are in device memory, else one copy off the device into the host slot.
    fn send_device(&mut self, header: FrameHeader, payload: DeviceRange) -> BoxFuture<'_, Result<()>> {
        Box::pin(async move { self.send_frame(SlotFrame::Device(header, &payload)).await })
    }
}

impl Drop for SenderTx {
    fn drop(&mut self) {
        // Best effort: writes whose completion was polled are known to have landed; tell
        // the receiver how many, so it drains them before it sees the link end.
        let _ = self.reap();
        let frames = self.window.completed_count();
        if let (Some(mut ctrl), Ok(rt)) = (self.ctrl.take(), tokio::runtime::Handle::try_current()) {
            rt.spawn(async move {
                let bye = write_msg(&mut ctrl, &Msg::Bye { frames }).await;
                if bye.is_ok() {
                    let _ = ctrl.finish();
                }
            });
        }
    }
}

impl LinkRx for SenderRx {
    fn recv(&mut self) -> BoxFuture<'_, Result<Option<Frame>>> {
        Box::pin(async move {
            match self.replies.recv().await {
                Some(r) => r.map(Some),
                None => Ok(None),
            }
        })
    }
}

/// The receiver's registered ring memory, shared by every link of one listener.
pub(crate) struct RecvArena {
    pub region: RingRegion,
    /// One registration (rkey) per ring: a peer can only write into its own ring.
    pub rkeys: Vec<u32>,
    pub geometry: RingGeometry,
}

impl RecvArena {
    pub fn ring_info(&self, ring: u32) -> RingInfo {
        RingInfo {
            addr: self.region.addr(self.region.ring_offset(ring)),
            rkey: self.rkeys[ring as usize],
            slot_bytes: self.geometry.slot_bytes,
            slots: self.geometry.slots,
        }
    }
}

/// What the receiver's control task saw from the sender.
#[derive(Clone, Copy, Debug, Default)]
struct ByeState {
    bye: Option<u64>,
    closed: bool,
}

/// Receiving half on the receiver: frames out of the ring.
pub(crate) struct ReceiverRx {
    // Field order is drop order: the QP before the lease and the memory.
    qp: QueuePair,
    /// Shared with every [`SlotHold`] still alive: the ring goes back to the pool only once
    /// no payload left in it is in use.
    lease: Arc<RingLease>,
    arena: Arc<RecvArena>,
    limits: FrameLimits,
    /// The next frame's sequence number (= frames taken out of the ring).
    seq: u64,
    /// Which frames are done with their slots, and how many were credited back.
    credits: SlotCredits,
    /// Where a dropped [`SlotHold`] says its frame is done with the slot.
    slot_done_tx: mpsc::UnboundedSender<u64>,
    slot_done: mpsc::UnboundedReceiver<u64>,
    ctrl: Arc<Mutex<quinn::SendStream>>,
    bye: watch::Receiver<ByeState>,
    done: Vec<Completion>,
    /// A frame copied out of a device ring.
    scratch: Vec<u8>,
    _task: TaskGuard,
}

/// Sending half on the receiver: replies on the control stream.
pub(crate) struct ReceiverTx {
    ctrl: Arc<Mutex<quinn::SendStream>>,
}

/// Builds the receiver's halves; `qp` is connected and has `slots` receives posted.
pub(crate) fn receiver_link(
    qp: QueuePair,
    lease: RingLease,
    arena: Arc<RecvArena>,
    limits: FrameLimits,
    ctrl_send: quinn::SendStream,
    mut ctrl_recv: quinn::RecvStream,
) -> (ReceiverTx, ReceiverRx) {
    let (bye_tx, bye) = watch::channel(ByeState::default());
    let task = tokio::spawn(async move {
        // Anything but a goodbye (end, error, a stray message) ends the control channel.
        while let Ok(Some(Msg::Bye { frames })) = read_msg(&mut ctrl_recv).await {
            bye_tx.send_modify(|b| b.bye = Some(frames));
        }
        bye_tx.send_modify(|b| b.closed = true);
    });
    let ctrl = Arc::new(Mutex::new(ctrl_send));
    let (slot_done_tx, slot_done) = mpsc::unbounded_channel();
    (
        ReceiverTx { ctrl: ctrl.clone() },
        ReceiverRx {
            qp,
            lease: Arc::new(lease),
            arena,
            limits,
            seq: 0,
            credits: SlotCredits::default(),
            slot_done_tx,
            slot_done,
            ctrl,
            bye,
            done: Vec::new(),
            scratch: Vec::new(),
            _task: TaskGuard(task.abort_handle()),
        },
    )
}

/// A frame's hold on its ring slot: while it lives, the sender gets no credit for the slot
/// (and the ring stays leased to this link); dropped, it tells the receiver the slot is free.
struct SlotHold {
    seq: u64,
    done: mpsc::UnboundedSender<u64>,
    _ring: Arc<RingLease>,
}

impl Drop for SlotHold {
    fn drop(&mut self) {
        // The link may be gone: then nobody needs the credit.
        let _ = self.done.send(self.seq);
    }
}

impl ReceiverRx {
    /// Takes the frame of the completion `c` out of its slot and checks its place in the
    /// sequence: a `Data` frame in a device ring stays there (its header and trailer read,
    /// its checksum computed on the device) and holds the slot; any other frame is copied
    /// out, and its slot is free at once.
    fn take_frame(&mut self, c: Completion) -> Result<Frame> {
        let imm = c.imm.ok_or(Error::FrameMalformed {
            what: "RDMA completion without immediate data",
        })?;
        if imm != imm_for(self.seq) {
            return Err(Error::FrameMalformed {
                what: "RDMA write out of sequence",
            });
        }
        let g = self.arena.geometry;
        let len = c.byte_len as usize;
        if len > g.slot_bytes as usize {
            return Err(Error::FrameMalformed {
                what: "RDMA write larger than a slot",
            });
        }
        let offset = self.arena.region.ring_offset(self.lease.index) + g.slot_offset(self.seq);
        if let Some(frame) = self.device_frame(offset, len)? {
            return Ok(frame);
        }
        // SAFETY: the slot lies inside this link's ring; the sender writes it again only
        // after the credit sent below, so nothing writes it while it is read here. The
        // completion was polled, which orders the data before this read in host memory; a
        // device ring's owner makes the NIC's writes visible to its copy out first
        // (DeviceCopy::read: the GPU's native ordering or cuFlushGPUDirectRDMAWrites).
        let bytes = unsafe { self.arena.region.read(offset, len, &mut self.scratch)? };
        let frame = match frame::decode(bytes, &self.limits)? {
            Some((f, used)) if used == len => f,
            _ => {
                return Err(Error::FrameMalformed {
                    what: "RDMA write is not exactly one frame",
                })
            }
        };
        self.credits.done(self.seq);
        Ok(frame)
    }

    /// A `Data` frame with a payload in a device ring, left there: `None` for a host ring
    /// or any other frame. The header is decoded (and judged against the limits) before
    /// anything else is read; the checksum the device computes covers the same slot bytes.
    fn device_frame(&mut self, offset: usize, len: usize) -> Result<Option<Frame>> {
        let RingRegion::Device { region, .. } = &self.arena.region else { return Ok(None) };
        let mem = region.memory();
        let copy_err = |what: &str, detail: String| Error::Link { transport: NAME, detail: format!("{what} in {}: {detail}", mem.label) };
        if len < HEADER_LEN + TRAILER_LEN {
            return Err(Error::FrameMalformed { what: "RDMA write is not exactly one frame" });
        }
        let mut head = [0u8; HEADER_LEN];
        mem.copy.read(offset, &mut head).map_err(|d| copy_err("reading a frame header", d))?;
        let header = frame::FrameHeader::decode(&head, &self.limits)?;
        if header.kind != FrameKind::Data || header.payload_len == 0 {
            return Ok(None);
        }
        let payload = header.payload_len as usize;
        if HEADER_LEN + payload + TRAILER_LEN != len {
            return Err(Error::FrameMalformed { what: "RDMA write is not exactly one frame" });
        }
        let mut trailer = [0u8; TRAILER_LEN];
        mem.copy.read(offset + HEADER_LEN + payload, &mut trailer).map_err(|d| copy_err("reading a frame checksum", d))?;
        let sum = mem.copy.checksum(offset, HEADER_LEN + payload).map_err(|d| copy_err("checksumming a frame", d))?;
        let hold = Arc::new(SlotHold { seq: self.seq, done: self.slot_done_tx.clone(), _ring: self.lease.clone() });
        let payload = DevicePayload::new(mem.clone(), offset + HEADER_LEN, payload, sum, hold);
        Ok(Some(Frame::on_device(header, payload, u32::from_le_bytes(trailer))))
    }

    /// Credits back every slot whose frame is done, in order: one receive re-armed per slot
    /// and one cumulative credit message for all of them.
    async fn credit_released(&mut self) -> Result<()> {
        while let Ok(seq) = self.slot_done.try_recv() {
            self.credits.done(seq);
        }
        let before = self.credits.credited();
        let Some(consumed) = self.credits.advance() else { return Ok(()) };
        for seq in before + 1..=consumed {
            self.qp.post_recv_empty(seq)?;
        }
        let credit = Msg::Credit { consumed };
        write_msg(&mut *self.ctrl.lock().await, &credit).await.map_err(|e| link_err(format!("returning a credit: {e}")))
    }

    async fn next_frame(&mut self) -> Result<Option<Frame>> {
        let mut backoff = Backoff(0);
        let mut bye_seen: Option<Instant> = None;
        loop {
            // Slots freed since the last call (a device frame dropped after it was installed).
            self.credit_released().await?;
            self.done.clear();
            self.qp.poll(&mut self.done, 1)?;
            if let Some(&c) = self.done.first() {
                let frame = self.take_frame(c)?;
                self.seq += 1;
                // A frame copied out frees its slot now: re-arm one receive and hand the
                // sender its credit.
                self.credit_released().await?;
                return Ok(Some(frame));
            }
            let state = *self.bye.borrow_and_update();
            match state.bye {
                Some(frames) if self.seq >= frames => return Ok(None),
                Some(_) => {
                    let since = *bye_seen.get_or_insert_with(Instant::now);
                    if since.elapsed() > BYE_GRACE {
                        return Err(link_err("the sender's last writes never arrived"));
                    }
                }
                None if state.closed => {
                    return Err(link_err("the sender's control stream ended without goodbye"))
                }
                None => {}
            }
            backoff.wait().await;
        }
    }
}

impl LinkRx for ReceiverRx {
    fn recv(&mut self) -> BoxFuture<'_, Result<Option<Frame>>> {
        Box::pin(self.next_frame())
    }
}

impl LinkTx for ReceiverTx {
    fn send(&mut self, frame: Frame) -> BoxFuture<'_, Result<()>> {
        Box::pin(async move {
            let mut bytes = bytes::BytesMut::new();
            frame.encode_to(&mut bytes);
            write_msg(&mut *self.ctrl.lock().await, &Msg::Reply(bytes.freeze()))
                .await
                .map_err(|e| link_err(format!("sending a reply: {e}")))
        })
    }
}
