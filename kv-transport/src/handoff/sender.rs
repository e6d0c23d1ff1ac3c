//! The sending end of a handoff: streams a grant's blocks, layer by layer, over a link.
//!
//! Owns: [`KvSender`] (one per node and transport) and [`Transfer`] (one per grant), which
//! batches the blocks of a layer into frames of about `frame_bytes`, checksums them, and
//! watches the receiver's replies while it sends. A transfer is fed either from a
//! [`BlockSource`] holding whole blocks ([`KvSender::start`], [`Transfer::send_layer`]) or,
//! pipelined, with one layer of a run of blocks at a time as the engine writes them
//! ([`KvSender::open`], [`Transfer::send_blocks`] from host memory,
//! [`Transfer::send_device_blocks`] from the GPU, for a link that sends from device
//! memory: [`KvSender::sends_from_device`]); either way it keeps the receiver's own
//! bookkeeping of which (layer, block) went out, refuses to send one twice or outside the
//! grant, and [`Transfer::missing`] says what is still owed. Completeness is the
//! receiver's to judge: `Done` with anything missing fails the reservation there.
//! Invariants: every await of a transfer is bounded by the grant's deadline, measured on this
//! node's clock from when the grant arrived, so a dead or silent receiver fails the transfer
//! by then at the latest; a failure the receiver reports wins over the local symptom it
//! causes (a reset stream); dropping a [`Transfer`] closes its link, which the receiver
//! treats as the sender going away.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::error::{Error, Result, Side};
use crate::handoff::buffers::BufferPool;
use crate::handoff::frame::{Frame, FrameHeader, FrameKind};
use crate::handoff::grant::Grant;
use crate::handoff::progress::Progress;
use crate::metrics::TransportStats;
use crate::pool::BlockSource;
use crate::transport::device_memory::{DeviceRange, DeviceSource};
use crate::transport::{Connector, LinkTx, Peer};
use crate::types::BlockId;

/// How a sender cuts layers into frames.
#[derive(Clone, Debug)]
pub struct SenderConfig {
    /// Target payload size of one frame; blocks of a layer are batched up to it.
    pub frame_bytes: usize,
}

impl Default for SenderConfig {
    fn default() -> Self {
        SenderConfig {
            frame_bytes: 1 << 20,
        }
    }
}

/// The sending end for one transport. Cheap to clone.
#[derive(Clone)]
pub struct KvSender {
    connector: Arc<dyn Connector>,
    config: SenderConfig,
    stats: Arc<TransportStats>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Remote {
    Pending,
    Completed,
    Failed(crate::error::WireFailure),
    Gone,
}

/// One grant being filled. Send layers in any order, then [`Transfer::finish`].
pub struct Transfer {
    grant: Grant,
    /// Whole blocks to read layers from, and which fills each grant block; None for a
    /// transfer fed by [`Transfer::send_blocks`].
    source: Option<(Arc<dyn BlockSource>, Vec<BlockId>)>,
    tx: Box<dyn LinkTx>,
    remote: watch::Receiver<Remote>,
    reader: JoinHandle<()>,
    stats: Arc<TransportStats>,
    frame_blocks: usize,
    /// Which (layer, block) went out: the receiver's rules, applied before sending.
    sent: Progress,
    started: Instant,
    #[cfg(test)]
    pub(crate) corrupt_layer: Option<u32>,
}

impl KvSender {
    pub fn new(connector: Arc<dyn Connector>) -> Self {
        Self::with_config(connector, SenderConfig::default())
    }

    pub fn with_config(connector: Arc<dyn Connector>, config: SenderConfig) -> Self {
        let stats = Arc::new(TransportStats::new(connector.transport(), Side::Sender));
        KvSender {
            connector,
            config,
            stats,
        }
    }

    /// Counters of this sender.
    pub fn stats(&self) -> &Arc<TransportStats> {
        &self.stats
    }

    /// Whether its links send a layer left in device memory without a copy to the host
    /// ([`Transfer::send_device_blocks`]); a node keeps its exported KV on the GPU only then.
    pub fn sends_from_device(&self) -> bool {
        self.connector.sends_from_device()
    }

    /// Opens a link to `peer` for `grant`. `src_blocks[i]` (in `source`) fills the grant's
    /// i-th block.
    pub async fn start(
        &self,
        peer: &Peer,
        grant: &Grant,
        source: Arc<dyn BlockSource>,
        src_blocks: Vec<BlockId>,
    ) -> Result<Transfer> {
        let reservation = grant.reservation;
        let checked = if source.layout() != grant.layout {
            Err(Error::LayoutMismatch { reservation, what: "source layout" })
        } else if src_blocks.len() != grant.blocks.len() {
            Err(Error::LayoutMismatch { reservation, what: "block count" })
        } else {
            Ok(())
        };
        if let Err(e) = checked {
            self.stats.record_failure(&e);
            return Err(e);
        }
        self.open_with(peer, grant, Some((source, src_blocks))).await
    }

    /// Opens a link to `peer` for `grant`, to be fed layer by layer with
    /// [`Transfer::send_blocks`] as the blocks are computed (a pipelined export).
    pub async fn open(&self, peer: &Peer, grant: &Grant) -> Result<Transfer> {
        self.open_with(peer, grant, None).await
    }

    async fn open_with(&self, peer: &Peer, grant: &Grant, source: Option<(Arc<dyn BlockSource>, Vec<BlockId>)>) -> Result<Transfer> {
        // One place records why a start failed, whichever step failed.
        let opened: Result<Transfer> = async {
            let reservation = grant.reservation;
            let started = Instant::now();
            let deadline = tokio::time::Instant::from_std(grant.deadline_at());
            let link = match tokio::time::timeout_at(deadline, self.connector.open(peer)).await {
                Ok(link) => link?,
                Err(_) => {
                    return Err(Error::DeadlineExceeded {
                        reservation,
                        deadline: grant.deadline,
                        during: "connecting",
                    })
                }
            };
            let (remote_tx, remote_rx) = watch::channel(Remote::Pending);
            let mut rx = link.rx;
            let reader = tokio::spawn(async move {
                let state = match rx.recv().await {
                    Ok(Some(f)) if f.verify() => match f.header.kind {
                        FrameKind::Completed => Remote::Completed,
                        FrameKind::Failed => Remote::Failed(f.failure()),
                        _ => Remote::Gone,
                    },
                    Ok(Some(_)) | Ok(None) | Err(_) => Remote::Gone,
                };
                let _ = remote_tx.send(state);
                // Keep the receive half open until the transfer ends, so the peer's last
                // frames are not answered with a reset.
                while let Ok(Some(_)) = rx.recv().await {}
            });
            let bl = grant.layout.bytes_per_block_layer();
            let mut t = Transfer {
                grant: grant.clone(),
                source,
                tx: link.tx,
                remote: remote_rx,
                reader,
                stats: self.stats.clone(),
                frame_blocks: (self.config.frame_bytes / bl).max(1),
                sent: Progress::new(grant.blocks.len() as u32, grant.layers.clone(), &grant.skip),
                started,
                #[cfg(test)]
                corrupt_layer: None,
            };
            let open = Frame::open(
                reservation,
                grant.epoch,
                &grant.layout,
                grant.layers.clone(),
                grant.blocks.len() as u32,
            );
            t.send_frame(open, "opening").await?;
            Ok(t)
        }
        .await;
        if let Err(e) = &opened {
            self.stats.record_failure(e);
        }
        opened
    }

    /// Ships every layer of `grant` and waits for the receiver to confirm.
    pub async fn send(
        &self,
        peer: &Peer,
        grant: &Grant,
        source: Arc<dyn BlockSource>,
        src_blocks: Vec<BlockId>,
    ) -> Result<()> {
        let mut t = self.start(peer, grant, source, src_blocks).await?;
        for layer in grant.layers.clone() {
            t.send_layer(layer).await?;
        }
        t.finish().await
    }
}

impl Transfer {
    pub fn grant(&self) -> &Grant {
        &self.grant
    }

    /// Sends one layer of every block. Call as soon as the layer is computed.
    pub async fn send_layer(&mut self, layer: u32) -> Result<()> {
        let r = self.send_layer_inner(layer).await;
        self.note(r)
    }

    async fn send_layer_inner(&mut self, layer: u32) -> Result<()> {
        let reservation = self.grant.reservation;
        let Some((source, src_blocks)) = self.source.clone() else {
            return Err(Error::InvalidArgument { what: "a transfer without a block source is fed with send_blocks" });
        };
        if !self.grant.layers.contains(&layer) {
            return Err(Error::OutOfRange { reservation, layer, block: 0 });
        }
        let n = src_blocks.len() as u32;
        // Blocks before the receiver's skip are never read there: they stay here.
        let first = self.grant.first_block(layer).min(n);
        if first == n {
            return Ok(());
        }
        self.sent.admit(reservation, layer, first, n - first)?;
        self.sent.record(layer, first, n - first);
        self.send_frames(layer, first as usize, n as usize, |block, out| {
            source
                .read_layer(src_blocks[block], layer, out)
                .inspect_err(|e| tracing::warn!(error = %e, "reading a source block"))
        })
        .await
    }

    /// Sends layer `layer` of grant blocks `first_block..first_block + n`, whose bytes are
    /// `data` (`n` block-layers, one after another). Blocks before the grant's skip for the
    /// layer are dropped here (the receiver does not want them). Call as soon as the
    /// layer of those blocks is computed; any order across layers and runs.
    pub async fn send_blocks(&mut self, layer: u32, first_block: u32, data: &[u8]) -> Result<()> {
        let r = self.send_blocks_inner(layer, first_block, data).await;
        self.note(r)
    }

    async fn send_blocks_inner(&mut self, layer: u32, first_block: u32, data: &[u8]) -> Result<()> {
        let Some((first, end)) = self.admit_run(layer, first_block, data.len())? else {
            return Ok(());
        };
        let bl = self.grant.layout.bytes_per_block_layer();
        let base = first_block as usize;
        self.send_frames(layer, first as usize, end as usize, |block, out| {
            let at = (block - base) * bl;
            out.copy_from_slice(&data[at..at + bl]);
            Ok(())
        })
        .await
    }

    /// [`Transfer::send_blocks`] for bytes in this node's device memory (`data`: `n`
    /// block-layers, one after another): each frame's payload is a range of `data`, which
    /// the link copies device to device into its send ring and checksums there
    /// ([`LinkTx::send_device`]; a link without device send rings copies it to the host).
    /// `data` is held until every frame from it went out.
    pub async fn send_device_blocks(&mut self, layer: u32, first_block: u32, data: Arc<dyn DeviceSource>) -> Result<()> {
        let r = self.send_device_blocks_inner(layer, first_block, data).await;
        self.note(r)
    }

    async fn send_device_blocks_inner(&mut self, layer: u32, first_block: u32, data: Arc<dyn DeviceSource>) -> Result<()> {
        let reservation = self.grant.reservation;
        let Some((first, end)) = self.admit_run(layer, first_block, data.len())? else {
            return Ok(());
        };
        let bl = self.grant.layout.bytes_per_block_layer();
        let mut block = first as usize;
        while block < end as usize {
            let count = self.frame_blocks.min(end as usize - block);
            let h = self.data_header(layer, block, count);
            let offset = (block - first_block as usize) * bl;
            let payload = DeviceRange::new(data.clone(), offset, count * bl).map_err(|_| Error::LayoutMismatch { reservation, what: "exported bytes" })?;
            self.send_out(Outgoing::Device(h, payload), "sending data").await?;
            self.stats.add(&self.stats.block_layers, count as u64);
            block += count;
        }
        Ok(())
    }

    /// Checks a run of `len` bytes of layer `layer` from grant block `first_block` against
    /// the grant and what went out, and records it as sent: the blocks to send,
    /// `first..end` (those before the layer's skip dropped), or `None` when none are left.
    fn admit_run(&mut self, layer: u32, first_block: u32, len: usize) -> Result<Option<(u32, u32)>> {
        let reservation = self.grant.reservation;
        let bl = self.grant.layout.bytes_per_block_layer();
        if bl == 0 || !len.is_multiple_of(bl) {
            return Err(Error::LayoutMismatch { reservation, what: "exported bytes are not whole block-layers" });
        }
        let n = u32::try_from(len / bl).map_err(|_| Error::OutOfRange { reservation, layer, block: first_block })?;
        let end = first_block.checked_add(n).ok_or(Error::OutOfRange { reservation, layer, block: first_block })?;
        if !self.grant.layers.contains(&layer) {
            return Err(Error::OutOfRange { reservation, layer, block: first_block });
        }
        let first = first_block.max(self.grant.first_block(layer).min(end));
        if first == end {
            return Ok(None);
        }
        self.sent.admit(reservation, layer, first, end - first)?;
        self.sent.record(layer, first, end - first);
        Ok(Some((first, end)))
    }

    /// Frames of layer `layer` for grant blocks `first..end`, each block-layer filled by
    /// `fill(block, out)`.
    async fn send_frames(&mut self, layer: u32, mut first: usize, end: usize, mut fill: impl FnMut(usize, &mut [u8]) -> Result<()>) -> Result<()> {
        let bl = self.grant.layout.bytes_per_block_layer();
        while first < end {
            let count = self.frame_blocks.min(end - first);
            let h = self.data_header(layer, first, count);
            // Checksum each block-layer right after copying it, while it is in cache.
            let mut crc = crc32fast::Hasher::new();
            crc.update(&h.encode());
            let mut buf = BufferPool::frames().take(count * bl);
            for (i, out) in buf.chunks_exact_mut(bl).enumerate() {
                fill(first + i, out)?;
                crc.update(out);
            }
            #[allow(unused_mut)]
            let mut frame = Frame::from_parts(h, buf.freeze(), crc.finalize());
            debug_assert!(frame.verify());
            #[cfg(test)]
            if self.corrupt_layer == Some(layer) {
                let mut p = frame.payload.to_vec();
                let mid = p.len() / 2;
                p[mid] ^= 0x40;
                frame.payload = bytes::Bytes::from(p);
            }
            self.send_frame(frame, "sending data").await?;
            self.stats.add(&self.stats.block_layers, count as u64);
            first += count;
        }
        Ok(())
    }

    /// The header of a `Data` frame carrying layer `layer` of grant blocks
    /// `first..first + count`.
    fn data_header(&self, layer: u32, first: usize, count: usize) -> FrameHeader {
        let mut h = FrameHeader::new(FrameKind::Data, self.grant.reservation, self.grant.epoch);
        h.layer = layer;
        h.first_block = first as u32;
        h.block_count = count as u32;
        h.payload_len = (count * self.grant.layout.bytes_per_block_layer()) as u32;
        h
    }

    /// Block-layers the grant wants that were not sent yet.
    pub fn missing(&self) -> u64 {
        self.sent.missing()
    }

    /// Says every layer was sent and waits for the receiver to confirm it installed them.
    pub async fn finish(mut self) -> Result<()> {
        let r = self.finish_inner().await;
        if r.is_ok() {
            self.stats.record_transfer(self.started.elapsed());
        }
        self.note(r)
    }

    async fn finish_inner(&mut self) -> Result<()> {
        let done = Frame::control(FrameKind::Done, self.grant.reservation, self.grant.epoch);
        self.send_frame(done, "finishing").await?;
        let deadline = tokio::time::Instant::from_std(self.grant.deadline_at());
        let wait = self.remote.wait_for(|r| *r != Remote::Pending);
        let state = match tokio::time::timeout_at(deadline, wait).await {
            Ok(Ok(r)) => Some(*r),
            Ok(Err(_)) => Some(Remote::Gone),
            Err(_) => None,
        };
        match state {
            Some(s) => self.remote_result(s),
            None => Err(self.deadline_error("waiting for the receiver to confirm")),
        }
    }

    /// Gives up: tells the receiver to release everything, without waiting for it.
    pub async fn cancel(mut self) {
        let cancel = Frame::control(FrameKind::Cancel, self.grant.reservation, self.grant.epoch);
        let limit = tokio::time::Instant::from_std(self.grant.deadline_at())
            .min(tokio::time::Instant::now() + Duration::from_secs(1));
        let _ = tokio::time::timeout_at(limit, self.tx.send(cancel)).await;
        self.stats.record_failure(&Error::Cancelled {
            reservation: self.grant.reservation,
            by: Side::Sender,
        });
    }

    fn note(&self, r: Result<()>) -> Result<()> {
        if let Err(e) = &r {
            self.stats.record_failure(e);
        }
        r
    }

    fn deadline_error(&self, during: &'static str) -> Error {
        Error::DeadlineExceeded {
            reservation: self.grant.reservation,
            deadline: self.grant.deadline,
            during,
        }
    }

    fn remote_result(&self, state: Remote) -> Result<()> {
        let reservation = self.grant.reservation;
        match state {
            Remote::Completed => Ok(()),
            Remote::Failed(w) => Err(Error::from_wire(reservation, w)),
            Remote::Gone => Err(Error::PeerGone { reservation }),
            Remote::Pending => Ok(()),
        }
    }

    async fn send_frame(&mut self, frame: Frame, during: &'static str) -> Result<()> {
        self.send_out(Outgoing::Frame(frame), during).await
    }

    /// Sends a frame unless the receiver already failed the transfer, bounded by the deadline.
    async fn send_out(&mut self, out: Outgoing, during: &'static str) -> Result<()> {
        let state = *self.remote.borrow();
        if state != Remote::Pending {
            // Completed before we finished sending cannot happen with a correct receiver.
            return match state {
                Remote::Completed => Err(Error::UnexpectedFrame {
                    reservation: self.grant.reservation,
                    what: "completed before done",
                }),
                s => self.remote_result(s),
            };
        }
        let deadline = tokio::time::Instant::from_std(self.grant.deadline_at());
        let len = out.wire_len();
        enum Sent {
            Link(std::result::Result<Result<()>, tokio::time::error::Elapsed>),
            Remote(Remote),
        }
        let sent = {
            let tx = &mut self.tx;
            let failed = self
                .remote
                .wait_for(|r| matches!(r, Remote::Failed(_) | Remote::Gone));
            let send = match out {
                Outgoing::Frame(frame) => tx.send(frame),
                Outgoing::Device(header, payload) => tx.send_device(header, payload),
            };
            tokio::select! {
                r = tokio::time::timeout_at(deadline, send) => Sent::Link(r),
                s = failed => Sent::Remote(s.map(|s| *s).unwrap_or(Remote::Gone)),
            }
        };
        let result = match sent {
            Sent::Link(r) => r,
            Sent::Remote(s) => return self.remote_result(s),
        };
        match result {
            Ok(Ok(())) => {
                self.stats.add_frame(len);
                Ok(())
            }
            Ok(Err(e)) => {
                // The link broke; if the receiver said why, report that instead.
                let grace = deadline.min(tokio::time::Instant::now() + Duration::from_millis(200));
                let wait = self.remote.wait_for(|r| *r != Remote::Pending);
                let state = match tokio::time::timeout_at(grace, wait).await {
                    Ok(Ok(s)) => Some(*s),
                    _ => None,
                };
                match state {
                    Some(s @ Remote::Failed(_)) => self.remote_result(s),
                    _ => Err(e),
                }
            }
            Err(_) => Err(self.deadline_error(during)),
        }
    }
}

/// What [`Transfer::send_out`] hands the link: a frame on the host, or a `Data` frame's
/// header and its payload in device memory.
enum Outgoing {
    Frame(Frame),
    Device(FrameHeader, DeviceRange),
}

impl Outgoing {
    fn wire_len(&self) -> usize {
        match self {
            Outgoing::Frame(f) => f.wire_len(),
            Outgoing::Device(_, p) => crate::handoff::frame::wire_len(p.len),
        }
    }
}

impl Drop for Transfer {
    fn drop(&mut self) {
        self.reader.abort();
    }
}
