//! The receiving end of a handoff: reservations, their deadlines, and installing frames.
//!
//! Owns: [`KvReceiver`] (one per node and pool), the table of live reservations, one timer
//! per reservation, and the per-link task body [`KvReceiver::serve_link`] that every
//! transport's listener runs.
//! Invariants:
//! - A reservation's blocks go back to the sink exactly once, by whichever comes first:
//!   deadline, cancel (either side), a rejected frame, the link closing early, receiver
//!   shutdown, or the [`Reservation`] handle being dropped. The only other way out is
//!   [`Reservation::finished`], which hands the blocks to the caller.
//! - A block-layer is written only while its reservation is open, under the reservation's
//!   lock, and after the frame's checksum and coordinates were checked; release takes the
//!   same lock, so no write can land in a block after it was released.
//! - A frame for an unknown, ended or stale-epoch reservation never touches the sink.

use std::collections::{HashMap, VecDeque};
use std::ops::Range;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tokio::task::AbortHandle;

use crate::error::{Error, Result, Side, WireFailure, KINDS};
use crate::handoff::frame::{Frame, FrameKind, FrameLimits};
use crate::handoff::grant::{Grant, MAX_GRANT_BLOCKS};
use crate::handoff::progress::Progress;
use crate::metrics::TransportStats;
use crate::pool::BlockSink;
use crate::transport::device_memory::DevicePayload;
use crate::transport::Link;
use crate::types::{BlockId, Epoch, KvLayout, ReservationId};

#[cfg(test)]
mod device_tests;
mod frames;
mod reservation;

/// How a receiver treats reservations and links.
#[derive(Clone, Debug)]
pub struct ReceiverConfig {
    /// Deadline of a reservation when the caller names none.
    pub default_deadline: Duration,
    /// Longest deadline a caller may ask for.
    pub max_deadline: Duration,
    /// A link that does not say which reservation it is for within this time is dropped.
    pub open_timeout: Duration,
    /// How long a link keeps reading (and discarding) after a failure was reported, so a
    /// byte-stream transport does not reset the connection before the sender read why.
    pub linger: Duration,
    /// Caps on incoming frames.
    pub limits: FrameLimits,
    /// Bytes of frame payload one connection may hold allocated at once
    /// ([`ConnBudget`](crate::transport::ConnBudget): QUIC carries many links on one
    /// connection). At least `limits.max_payload`, so every acceptable frame fits.
    pub connection_budget: u32,
    /// Live QUIC connections one peer certificate may hold on a listener: each has its own
    /// `connection_budget`, so a peer pins at most this many budgets. At least 1.
    pub max_connections_per_peer: u32,
    /// How many ended reservations are remembered to explain late frames.
    pub remember_ended: usize,
}

impl Default for ReceiverConfig {
    fn default() -> Self {
        ReceiverConfig {
            default_deadline: Duration::from_secs(30),
            max_deadline: Duration::from_secs(600),
            open_timeout: Duration::from_secs(10),
            linger: Duration::from_secs(2),
            limits: FrameLimits::default(),
            // Four of the largest frames: a sender's parallel streams keep flowing, and a
            // peer that stalls them pins at most this much.
            connection_budget: 256 << 20,
            // A sender keeps one connection per receiver (redialling once after a failure);
            // the rest is headroom for restarts racing the old connection's close.
            max_connections_per_peer: 8,
            remember_ended: 4096,
        }
    }
}

/// Terminal or ongoing state visible to the handle and the link task.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Phase {
    pub ready_layers: u32,
    pub outcome: Option<Outcome>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    Completed,
    Failed(WireFailure),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Status {
    Open,
    /// Everything installed; blocks still owned by the reservation until taken.
    Completed,
    /// Blocks handed to the caller.
    Taken,
    /// Blocks released.
    Ended(WireFailure),
}

struct EntryState {
    status: Status,
    progress: Progress,
    attached: bool,
}

pub(crate) struct Entry {
    id: ReservationId,
    blocks: Vec<BlockId>,
    layers: Range<u32>,
    created: Instant,
    state: Mutex<EntryState>,
    phase: watch::Sender<Phase>,
    timer: Mutex<Option<AbortHandle>>,
    /// Who may fill it: a link whose peer certificate does not name this identity is
    /// refused ([`Reservation::only_from`]); None: any peer the transport authenticated.
    sender: Mutex<Option<baton_identity::Expect>>,
}

impl Entry {
    fn lock(&self) -> MutexGuard<'_, EntryState> {
        // Every critical section leaves the state consistent before it can panic.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[derive(Default)]
struct Table {
    live: HashMap<ReservationId, Arc<Entry>>,
    ended: HashMap<ReservationId, WireFailure>,
    ended_order: VecDeque<ReservationId>,
}

struct Inner {
    sink: Arc<dyn BlockSink>,
    layout: KvLayout,
    epoch: Epoch,
    config: ReceiverConfig,
    table: Mutex<Table>,
    /// Receiver-wide: reservations, and every frame whatever carried it.
    stats: Arc<TransportStats>,
    /// Per transport: what arrived over its links.
    link_stats: Mutex<Vec<Arc<TransportStats>>>,
    /// Frame payload bytes held under every connection's budget right now.
    frame_bytes: Arc<std::sync::atomic::AtomicU64>,
}

/// The receiving end for one pool. Cheap to clone; clones share everything.
#[derive(Clone)]
pub struct KvReceiver {
    inner: Arc<Inner>,
}

/// A live reservation. Dropping it before [`Reservation::finished`] returned the blocks
/// releases them.
pub struct Reservation {
    inner: Arc<Inner>,
    entry: Arc<Entry>,
    grant: Grant,
    phase: watch::Receiver<Phase>,
    settled: bool,
}

enum Step {
    Continue,
    Completed,
    Failed(WireFailure),
    CancelledBySender,
}

/// 64 bits from the operating system's CSPRNG. Epochs and reservation IDs are what a
/// grant names, so a peer that never saw the grant must not be able to guess them.
fn random_u64() -> u64 {
    let rng = ring::rand::SystemRandom::new();
    let bytes: [u8; 8] = ring::rand::generate(&rng).expect("the OS random source works").expose();
    u64::from_le_bytes(bytes)
}

fn random_epoch() -> Epoch {
    Epoch(random_u64() | 1)
}

impl KvReceiver {
    /// A receiver that installs into `sink`, with the transport label used in its stats.
    pub fn new(sink: Arc<dyn BlockSink>, config: ReceiverConfig) -> Result<Self> {
        let layout = sink.layout();
        layout.validate()?;
        let bl = layout.bytes_per_block_layer() as u64;
        if u64::from(config.limits.max_payload) < bl {
            return Err(Error::InvalidArgument {
                what: "frame limit is smaller than one block-layer",
            });
        }
        if config.connection_budget < config.limits.max_payload {
            return Err(Error::InvalidArgument {
                what: "connection budget is smaller than the frame limit",
            });
        }
        if config.max_connections_per_peer == 0 {
            return Err(Error::InvalidArgument {
                what: "a peer must be allowed at least one connection",
            });
        }
        Ok(KvReceiver {
            inner: Arc::new(Inner {
                sink,
                layout,
                epoch: random_epoch(),
                config,
                table: Mutex::new(Table::default()),
                stats: Arc::new(TransportStats::new("all", Side::Receiver)),
                link_stats: Mutex::new(Vec::new()),
                frame_bytes: Arc::default(),
            }),
        })
    }

    /// This incarnation's epoch.
    pub fn epoch(&self) -> Epoch {
        self.inner.epoch
    }

    /// The pool's layout.
    pub fn layout(&self) -> KvLayout {
        self.inner.layout
    }

    /// Caps a transport applies to frames it reads for this receiver.
    pub fn frame_limits(&self) -> FrameLimits {
        self.inner.config.limits
    }

    /// Bytes one connection may hold in frames being read ([`ReceiverConfig::connection_budget`]).
    pub fn connection_budget(&self) -> u32 {
        self.inner.config.connection_budget
    }

    /// Live connections one peer certificate may hold ([`ReceiverConfig::max_connections_per_peer`]).
    pub fn max_connections_per_peer(&self) -> u32 {
        self.inner.config.max_connections_per_peer
    }

    /// Frame payload bytes held under connection budgets right now, all connections together.
    pub fn frame_bytes_in_flight(&self) -> u64 {
        self.inner.frame_bytes.load(Ordering::Relaxed)
    }

    pub(crate) fn frame_bytes_counter(&self) -> Arc<std::sync::atomic::AtomicU64> {
        self.inner.frame_bytes.clone()
    }

    /// Counters of this receiver across all transports (transport label `all`), including
    /// the reservation counters.
    pub fn stats(&self) -> &Arc<TransportStats> {
        &self.inner.stats
    }

    /// Counters of what arrived over each transport's links (bytes, frames, block-layers,
    /// rejected frames, completed transfers, link failures by kind).
    pub fn transport_stats(&self) -> Vec<Arc<TransportStats>> {
        self.inner
            .link_stats
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Reservations granted and not yet completed or released.
    pub fn live_reservations(&self) -> usize {
        self.inner.table().live.len()
    }

    /// Reserves `blocks` blocks for all layers. `deadline`: `None` for the configured default.
    /// Must be called inside a Tokio runtime (the deadline is a Tokio timer).
    pub fn reserve(&self, blocks: usize, deadline: Option<Duration>) -> Result<Reservation> {
        self.reserve_layers(blocks, 0..self.inner.layout.layers, deadline)
    }

    /// Reserves `blocks` blocks to be filled for `layers` only.
    pub fn reserve_layers(
        &self,
        blocks: usize,
        layers: Range<u32>,
        deadline: Option<Duration>,
    ) -> Result<Reservation> {
        self.reserve_skipping(blocks, layers, Vec::new(), deadline)
    }

    /// Reserves `blocks` blocks for `layers`, of which layer `layers.start + i` is filled from
    /// block `skip[i]` on (see [`Grant::skip`]; an empty `skip` wants every block). The
    /// skipped block-layers are zeroed here, so they hold nothing of an earlier reservation.
    pub fn reserve_skipping(
        &self,
        blocks: usize,
        layers: Range<u32>,
        skip: Vec<u32>,
        deadline: Option<Duration>,
    ) -> Result<Reservation> {
        let inner = &self.inner;
        let deadline = deadline.unwrap_or(inner.config.default_deadline);
        if deadline.is_zero() || deadline > inner.config.max_deadline {
            return Err(Error::InvalidArgument {
                what: "deadline is zero or above the configured maximum",
            });
        }
        if blocks == 0 || blocks > MAX_GRANT_BLOCKS {
            return Err(Error::InvalidArgument {
                what: "block count is zero or above the grant limit",
            });
        }
        if layers.start >= layers.end || layers.end > inner.layout.layers {
            return Err(Error::InvalidArgument {
                what: "layer range is empty or outside the layout",
            });
        }
        let skip = if skip.is_empty() { vec![0; (layers.end - layers.start) as usize] } else { skip };
        if skip.len() != (layers.end - layers.start) as usize || skip.iter().any(|&s| s as usize > blocks) {
            return Err(Error::InvalidArgument {
                what: "skip counts must be one per layer, none above the block count",
            });
        }
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| Error::InvalidArgument {
            what: "reserve must be called inside a Tokio runtime",
        })?;
        let block_ids = inner.sink.reserve(blocks)?;
        if let Err(e) = zero_skipped(&*inner.sink, &block_ids, &layers, &skip) {
            inner.sink.release(&block_ids);
            return Err(e);
        }
        // Random, not sequential: knowing one's own grant says nothing about another's.
        let id = {
            let table = inner.table();
            loop {
                let id = ReservationId(random_u64());
                if id.0 != 0 && !table.live.contains_key(&id) {
                    break id;
                }
            }
        };
        let created = Instant::now();
        let (phase_tx, phase_rx) = watch::channel(Phase {
            ready_layers: 0,
            outcome: None,
        });
        let entry = Arc::new(Entry {
            id,
            blocks: block_ids.clone(),
            layers: layers.clone(),
            created,
            state: Mutex::new(EntryState {
                status: Status::Open,
                progress: Progress::new(blocks as u32, layers.clone(), &skip),
                attached: false,
            }),
            phase: phase_tx,
            timer: Mutex::new(None),
            sender: Mutex::new(None),
        });
        inner.table().live.insert(id, entry.clone());
        inner.stats.add(&inner.stats.reservations_created, 1);
        inner.stats.reservations_live.fetch_add(1, Ordering::Relaxed);

        let weak_inner: Weak<Inner> = Arc::downgrade(inner);
        let weak_entry = Arc::downgrade(&entry);
        let at = tokio::time::Instant::from_std(created + deadline);
        let timer = runtime.spawn(async move {
            tokio::time::sleep_until(at).await;
            if let (Some(inner), Some(entry)) = (weak_inner.upgrade(), weak_entry.upgrade()) {
                inner.end(&entry, &Error::ReservationExpired { reservation: entry.id });
            }
        });
        *entry.timer.lock().unwrap_or_else(|p| p.into_inner()) = Some(timer.abort_handle());
        tracing::debug!(reservation = id.0, blocks, ?deadline, "reserved");
        Ok(Reservation {
            inner: inner.clone(),
            grant: Grant {
                reservation: id,
                epoch: inner.epoch,
                layout: inner.layout,
                layers,
                blocks: block_ids,
                skip,
                deadline,
                issued_at: created,
            },
            entry,
            phase: phase_rx,
            settled: false,
        })
    }

    /// Ends every live reservation (node shutdown). Later frames for them are rejected.
    pub fn shutdown(&self) {
        self.inner.end_all();
    }

    /// Runs one link to completion: binds it to a reservation with its `Open` frame, installs
    /// its data, and reports the outcome back. Transports spawn one of these per link.
    pub async fn serve_link(&self, link: Link) {
        let inner = &self.inner;
        let Link {
            mut tx,
            mut rx,
            transport,
            peer: link_peer,
        } = link;
        let ls = inner.link_stats(transport);
        let first = match tokio::time::timeout(inner.config.open_timeout, rx.recv()).await {
            Ok(Ok(Some(f))) => f,
            Ok(Ok(None)) => return,
            Ok(Err(e)) => {
                // A first frame refused before its payload was read (a data frame before
                // open): say why, as for a whole frame refused below.
                tracing::debug!(error = %e, "link failed before opening");
                if matches!(e, Error::UnexpectedFrame { .. } | Error::FrameTooLarge { .. } | Error::FrameMalformed { .. }) {
                    for s in [&inner.stats, &ls] {
                        s.add(&s.rejected_frames, 1);
                        s.record_failure(&e);
                    }
                    let _ = send_bounded(&mut *tx, Frame::failed(ReservationId(0), Epoch(0), e.to_wire())).await;
                    linger(&mut *rx, inner.config.linger).await;
                }
                return;
            }
            Err(_) => {
                tracing::debug!("link did not open in time");
                return;
            }
        };
        inner.stats.add_frame(first.wire_len());
        ls.add_frame(first.wire_len());
        let (reservation, epoch) = (first.header.reservation, first.header.epoch);
        let entry = match inner.accept_open(&first, link_peer.as_ref()) {
            Ok(entry) => entry,
            Err(e) => {
                for s in [&inner.stats, &ls] {
                    s.add(&s.rejected_frames, 1);
                    s.record_failure(&e);
                }
                tracing::info!(reservation = reservation.0, kind = e.label(), "link rejected");
                let _ = send_bounded(&mut *tx, Frame::failed(reservation, epoch, e.to_wire())).await;
                linger(&mut *rx, inner.config.linger).await;
                return;
            }
        };
        // From here on a data frame carries at most one layer of this reservation's
        // blocks: a larger one is refused before its payload is read.
        let most = entry.blocks.len() as u64 * inner.layout.bytes_per_block_layer() as u64;
        rx.limit(FrameLimits { max_payload: u32::try_from(most).unwrap_or(u32::MAX) });
        // Whatever ends this task (return, panic, abort by a listener shutdown) ends the
        // reservation if it is still open.
        let _guard = LinkGuard {
            inner: inner.clone(),
            entry: entry.clone(),
        };
        let mut phase = entry.phase.subscribe();
        let step = loop {
            tokio::select! {
                biased;
                changed = phase.changed() => {
                    if changed.is_err() {
                        break Step::Failed(Error::PeerGone { reservation }.to_wire());
                    }
                    let outcome = phase.borrow_and_update().outcome;
                    if let Some(Outcome::Failed(w)) = outcome {
                        break Step::Failed(w);
                    }
                }
                msg = rx.recv() => match msg {
                    Ok(Some(frame)) => match inner.on_frame(&entry, frame, &ls) {
                        Step::Continue => {}
                        other => break other,
                    },
                    Ok(None) | Err(_) => {
                        let w = inner.end(&entry, &Error::PeerGone { reservation });
                        break Step::Failed(w);
                    }
                },
            }
        };
        match step {
            Step::Completed => {
                let _ = send_bounded(&mut *tx, Frame::control(FrameKind::Completed, reservation, epoch))
                    .await;
            }
            Step::Failed(w) => {
                let _ = send_bounded(&mut *tx, Frame::failed(reservation, epoch, w)).await;
                linger(&mut *rx, inner.config.linger).await;
            }
            Step::CancelledBySender | Step::Continue => {}
        }
    }
}

/// Zeroes the block-layers a reservation does not want, so a block never carries bytes of
/// an earlier reservation (perhaps another owner's) into the engine.
fn zero_skipped(sink: &dyn BlockSink, blocks: &[BlockId], layers: &Range<u32>, skip: &[u32]) -> Result<()> {
    if skip.iter().all(|&s| s == 0) {
        return Ok(());
    }
    let zeros = vec![0u8; sink.layout().bytes_per_block_layer()];
    for (layer, &n) in layers.clone().zip(skip) {
        for &block in &blocks[..n as usize] {
            sink.write_layer(block, layer, &zeros)?;
        }
    }
    Ok(())
}

async fn send_bounded(tx: &mut dyn crate::transport::LinkTx, frame: Frame) -> Result<()> {
    match tokio::time::timeout(Duration::from_secs(1), tx.send(frame)).await {
        Ok(r) => r,
        Err(_) => Err(Error::Link {
            transport: "any",
            detail: "peer did not take a status frame in time".into(),
        }),
    }
}

/// Reads and drops frames until the peer closes or `limit` passes.
async fn linger(rx: &mut dyn crate::transport::LinkRx, limit: Duration) {
    let _ = tokio::time::timeout(limit, async {
        while let Ok(Some(_)) = rx.recv().await {}
    })
    .await;
}

struct LinkGuard {
    inner: Arc<Inner>,
    entry: Arc<Entry>,
}

impl Drop for LinkGuard {
    fn drop(&mut self) {
        let open = self.entry.lock().status == Status::Open;
        if open {
            self.inner.end(
                &self.entry,
                &Error::PeerGone {
                    reservation: self.entry.id,
                },
            );
        }
    }
}

impl Inner {
    fn table(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Finds a live reservation or says why there is none.
    fn lookup(&self, reservation: ReservationId, epoch: Epoch) -> Result<Arc<Entry>> {
        if epoch != self.epoch {
            return Err(Error::StaleEpoch {
                reservation,
                expected: self.epoch,
                got: epoch,
            });
        }
        let table = self.table();
        if let Some(e) = table.live.get(&reservation) {
            return Ok(e.clone());
        }
        match table.ended.get(&reservation) {
            Some(&w) => Err(Error::from_wire(reservation, w)),
            None => Err(Error::UnknownReservation { reservation }),
        }
    }

    fn link_stats(&self, transport: &'static str) -> Arc<TransportStats> {
        let mut all = self.link_stats.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(s) = all.iter().find(|s| s.transport == transport) {
            return s.clone();
        }
        let s = Arc::new(TransportStats::new(transport, Side::Receiver));
        all.push(s.clone());
        s
    }

    /// Ends a reservation that is open or completed-but-not-taken, releasing its blocks.
    /// Returns the reason the reservation ended (this one or an earlier one).
    fn end(&self, entry: &Entry, why: &Error) -> WireFailure {
        let w = why.to_wire();
        let mut st = entry.lock();
        match st.status {
            Status::Open | Status::Completed => {}
            Status::Ended(earlier) => return earlier,
            Status::Taken => return Error::ReservationEnded { reservation: entry.id }.to_wire(),
        }
        st.status = Status::Ended(w);
        // Under the entry lock: no install can be writing into these blocks, and
        // whoever finds the reservation ended (a cancel racing the deadline timer)
        // also finds it gone from the table and the live gauge: with these after
        // the unlock, a cancel could return while the timer's thread still held
        // the entry in `live`.
        self.sink.release(&entry.blocks);
        self.retire(entry.id, w);
        self.stats.reservations_live.fetch_sub(1, Ordering::Relaxed);
        drop(st);
        self.abort_timer(entry);
        let s = &self.stats;
        s.add(&s.reservations_released, 1);
        if matches!(why, Error::ReservationExpired { .. }) {
            s.add(&s.reservations_expired, 1);
        }
        s.record_failure(why);
        entry.phase.send_modify(|p| p.outcome = Some(Outcome::Failed(w)));
        tracing::info!(reservation = entry.id.0, kind = why.label(), "reservation released");
        w
    }

    /// Hands a completed reservation's blocks to the caller.
    fn take(&self, entry: &Entry) -> Result<Vec<BlockId>> {
        let mut st = entry.lock();
        match st.status {
            Status::Completed => {}
            Status::Ended(w) => return Err(Error::from_wire(entry.id, w)),
            Status::Open | Status::Taken => {
                return Err(Error::ReservationEnded {
                    reservation: entry.id,
                })
            }
        }
        st.status = Status::Taken;
        // As in `end`: table and gauge change with the status.
        self.retire(entry.id, Error::ReservationEnded { reservation: entry.id }.to_wire());
        self.stats.reservations_live.fetch_sub(1, Ordering::Relaxed);
        drop(st);
        let s = &self.stats;
        s.add(&s.reservations_completed, 1);
        Ok(entry.blocks.clone())
    }

    fn retire(&self, id: ReservationId, w: WireFailure) {
        let mut t = self.table();
        t.live.remove(&id);
        t.ended.insert(id, w);
        t.ended_order.push_back(id);
        while t.ended_order.len() > self.config.remember_ended {
            if let Some(old) = t.ended_order.pop_front() {
                t.ended.remove(&old);
            }
        }
    }

    fn abort_timer(&self, entry: &Entry) {
        if let Some(h) = entry.timer.lock().unwrap_or_else(|p| p.into_inner()).take() {
            h.abort();
        }
    }

    fn end_all(&self) {
        let live: Vec<Arc<Entry>> = self.table().live.values().cloned().collect();
        for e in live {
            self.end(
                &e,
                &Error::Cancelled {
                    reservation: e.id,
                    by: Side::Receiver,
                },
            );
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.end_all();
    }
}
