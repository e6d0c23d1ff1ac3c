//! The wire format: one versioned, checksummed frame type for every handoff message.
//!
//! Layout (little-endian), [`HEADER_LEN`] bytes of header, then `payload_len` bytes of
//! payload, then a CRC-32 of header and payload:
//!
//! ```text
//!  0 magic "BKV1"   4 version u8   5 kind u8   6 flags u16 (0)
//!  8 reservation u64   16 epoch u64
//! 24 layer u32   28 first_block u32   32 block_count u32   36 aux u32   40 payload_len u32
//! 44 payload ...   then crc32 u32
//! ```
//!
//! Invariants: decoding never panics on any input and never allocates more than the
//! payload length after it was checked against [`FrameLimits`]; the decoder does not judge
//! the checksum (the receiver does, so it can fail the reservation the link is bound to,
//! whatever a corrupted header claims).

use bytes::{BufMut, Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::error::{Error, Result, WireFailure};
use crate::handoff::buffers::BufferPool;
use crate::transport::device_memory::DevicePayload;
use crate::types::{Epoch, KvDtype, KvLayout, ReservationId};

pub const MAGIC: [u8; 4] = *b"BKV1";
pub const WIRE_VERSION: u8 = 1;
pub const HEADER_LEN: usize = 44;
pub const TRAILER_LEN: usize = 4;
/// Payload of an `Open` frame: the layout.
pub const OPEN_PAYLOAD_LEN: usize = 20;

/// What a frame says.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FrameKind {
    /// Sender -> receiver: binds the link to a reservation; payload is the sender's layout,
    /// `layer`/`aux` the layer range, `block_count` the number of blocks.
    Open,
    /// Sender -> receiver: `block_count` blocks of one layer starting at reservation block
    /// index `first_block`.
    Data,
    /// Sender -> receiver: every layer was sent.
    Done,
    /// Sender -> receiver: give up, release everything.
    Cancel,
    /// Receiver -> sender: everything was installed.
    Completed,
    /// Receiver -> sender: the reservation ended; `aux` is the error code, `layer` and
    /// `first_block` its location.
    Failed,
}

impl FrameKind {
    pub const fn code(self) -> u8 {
        match self {
            FrameKind::Open => 1,
            FrameKind::Data => 2,
            FrameKind::Done => 3,
            FrameKind::Cancel => 4,
            FrameKind::Completed => 5,
            FrameKind::Failed => 6,
        }
    }
    pub const fn from_code(c: u8) -> Option<Self> {
        Some(match c {
            1 => FrameKind::Open,
            2 => FrameKind::Data,
            3 => FrameKind::Done,
            4 => FrameKind::Cancel,
            5 => FrameKind::Completed,
            6 => FrameKind::Failed,
            _ => return None,
        })
    }
    pub const fn name(self) -> &'static str {
        match self {
            FrameKind::Open => "open",
            FrameKind::Data => "data",
            FrameKind::Done => "done",
            FrameKind::Cancel => "cancel",
            FrameKind::Completed => "completed",
            FrameKind::Failed => "failed",
        }
    }
}

/// Caps a decoder checks before it allocates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameLimits {
    /// Largest `Data` payload accepted.
    pub max_payload: u32,
}

impl FrameLimits {
    /// What a link accepts before its `Open` frame: no `Data` payload at all (an `Open`
    /// frame's payload has its own fixed length). A stream's first frame can then never
    /// make the receiver allocate more than a header and an `Open` payload, whoever sent it.
    pub const OPENING: FrameLimits = FrameLimits { max_payload: 0 };
}

impl Default for FrameLimits {
    fn default() -> Self {
        FrameLimits {
            max_payload: 64 << 20,
        }
    }
}

/// The fixed-size part of a frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    pub kind: FrameKind,
    pub reservation: ReservationId,
    pub epoch: Epoch,
    pub layer: u32,
    pub first_block: u32,
    pub block_count: u32,
    pub aux: u32,
    pub payload_len: u32,
}

impl FrameHeader {
    /// A header with every numeric field zero.
    pub fn new(kind: FrameKind, reservation: ReservationId, epoch: Epoch) -> Self {
        FrameHeader {
            kind,
            reservation,
            epoch,
            layer: 0,
            first_block: 0,
            block_count: 0,
            aux: 0,
            payload_len: 0,
        }
    }

    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC);
        b[4] = WIRE_VERSION;
        b[5] = self.kind.code();
        // b[6..8]: flags, zero in version 1.
        b[8..16].copy_from_slice(&self.reservation.0.to_le_bytes());
        b[16..24].copy_from_slice(&self.epoch.0.to_le_bytes());
        b[24..28].copy_from_slice(&self.layer.to_le_bytes());
        b[28..32].copy_from_slice(&self.first_block.to_le_bytes());
        b[32..36].copy_from_slice(&self.block_count.to_le_bytes());
        b[36..40].copy_from_slice(&self.aux.to_le_bytes());
        b[40..44].copy_from_slice(&self.payload_len.to_le_bytes());
        b
    }

    /// Parses and validates a header; the payload length is checked against `limits`.
    pub fn decode(b: &[u8; HEADER_LEN], limits: &FrameLimits) -> Result<Self> {
        if b[0..4] != MAGIC {
            return Err(Error::FrameMalformed { what: "bad magic" });
        }
        if b[4] != WIRE_VERSION {
            return Err(Error::UnsupportedVersion { version: b[4] });
        }
        let kind = FrameKind::from_code(b[5]).ok_or(Error::FrameMalformed {
            what: "unknown frame kind",
        })?;
        if b[6] != 0 || b[7] != 0 {
            return Err(Error::FrameMalformed {
                what: "unknown flags",
            });
        }
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(a)
        };
        let h = FrameHeader {
            kind,
            reservation: ReservationId(u64_at(8)),
            epoch: Epoch(u64_at(16)),
            layer: u32_at(24),
            first_block: u32_at(28),
            block_count: u32_at(32),
            aux: u32_at(36),
            payload_len: u32_at(40),
        };
        let max = match kind {
            FrameKind::Data => limits.max_payload,
            FrameKind::Open => OPEN_PAYLOAD_LEN as u32,
            _ => 0,
        };
        if h.payload_len > max {
            return Err(Error::FrameTooLarge {
                len: u64::from(h.payload_len),
                max: u64::from(max),
            });
        }
        if kind == FrameKind::Open && h.payload_len != max {
            return Err(Error::FrameMalformed {
                what: "open frame payload has the wrong length",
            });
        }
        Ok(h)
    }
}

/// One frame: header, payload and the checksum that came with them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frame {
    pub header: FrameHeader,
    /// The payload, on the host; empty when it stayed on the device (`device`).
    pub payload: Bytes,
    pub checksum: u32,
    /// A `Data` frame's payload left in the device memory the NIC wrote it to (an RDMA
    /// ring in GPU memory), checked there; `None` for every other frame.
    pub device: Option<DevicePayload>,
}

impl Frame {
    /// Builds a frame, setting `payload_len` and the checksum.
    pub fn new(mut header: FrameHeader, payload: Bytes) -> Self {
        header.payload_len = u32::try_from(payload.len()).unwrap_or(u32::MAX);
        let checksum = checksum(&header, &payload);
        Frame {
            header,
            payload,
            checksum,
            device: None,
        }
    }

    /// A frame whose checksum the caller computed (over the encoded header, then the
    /// payload), so the payload is hashed while it is still in cache.
    pub(crate) fn from_parts(header: FrameHeader, payload: Bytes, checksum: u32) -> Self {
        Frame {
            header,
            payload,
            checksum,
            device: None,
        }
    }

    /// A `Data` frame whose payload stayed in device memory: `header` and `checksum` (the
    /// trailer) were read from the slot, the payload's own checksum computed on the device.
    pub fn on_device(header: FrameHeader, payload: DevicePayload, checksum: u32) -> Self {
        Frame {
            header,
            payload: Bytes::new(),
            checksum,
            device: Some(payload),
        }
    }

    /// Payload bytes, wherever they are.
    pub fn payload_len(&self) -> usize {
        self.device.as_ref().map_or(self.payload.len(), DevicePayload::len)
    }

    /// A control frame with no payload.
    pub fn control(kind: FrameKind, reservation: ReservationId, epoch: Epoch) -> Self {
        Frame::new(FrameHeader::new(kind, reservation, epoch), Bytes::new())
    }

    /// The `Open` frame for a transfer of `block_count` blocks over `layers`.
    pub fn open(
        reservation: ReservationId,
        epoch: Epoch,
        layout: &KvLayout,
        layers: std::ops::Range<u32>,
        block_count: u32,
    ) -> Self {
        let mut h = FrameHeader::new(FrameKind::Open, reservation, epoch);
        h.layer = layers.start;
        h.aux = layers.end;
        h.block_count = block_count;
        Frame::new(h, Bytes::copy_from_slice(&encode_layout(layout)))
    }

    /// A `Failed` frame carrying `failure`.
    pub fn failed(reservation: ReservationId, epoch: Epoch, failure: WireFailure) -> Self {
        let mut h = FrameHeader::new(FrameKind::Failed, reservation, epoch);
        h.aux = u32::from(failure.code);
        h.layer = failure.layer;
        h.first_block = failure.block;
        Frame::new(h, Bytes::new())
    }

    /// The failure a `Failed` frame carries.
    pub fn failure(&self) -> WireFailure {
        WireFailure {
            code: u16::try_from(self.header.aux).unwrap_or(0),
            layer: self.header.layer,
            block: self.header.first_block,
        }
    }

    /// The layout an `Open` frame carries.
    pub fn open_layout(&self) -> Result<KvLayout> {
        decode_layout(&self.payload)
    }

    /// Whether the checksum matches header and payload.
    /// A device payload's checksum was computed on the device, over the same slot bytes the
    /// header was read from.
    pub fn verify(&self) -> bool {
        match &self.device {
            Some(d) => self.header.payload_len as usize == d.len() && self.payload.is_empty() && d.checksum() == self.checksum,
            None => self.header.payload_len as usize == self.payload.len() && checksum(&self.header, &self.payload) == self.checksum,
        }
    }

    /// Bytes this frame takes on a byte-stream link.
    pub fn wire_len(&self) -> usize {
        wire_len(self.payload_len())
    }

    /// Appends the encoded frame to `out`.
    pub fn encode_to(&self, out: &mut BytesMut) {
        assert!(self.device.is_none(), "a received device payload is never sent on");
        out.reserve(self.wire_len());
        out.put_slice(&self.header.encode());
        out.put_slice(&self.payload);
        out.put_u32_le(self.checksum);
    }
}

/// Bytes a frame with `payload` bytes of payload takes on a link: header, payload, trailer.
pub fn wire_len(payload: usize) -> usize {
    HEADER_LEN + payload + TRAILER_LEN
}

/// CRC-32 of the encoded header and the payload.
pub fn checksum(header: &FrameHeader, payload: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(&header.encode());
    h.update(payload);
    h.finalize()
}

fn encode_layout(l: &KvLayout) -> [u8; OPEN_PAYLOAD_LEN] {
    let mut b = [0u8; OPEN_PAYLOAD_LEN];
    b[0..4].copy_from_slice(&l.layers.to_le_bytes());
    b[4..8].copy_from_slice(&l.block_tokens.to_le_bytes());
    b[8..12].copy_from_slice(&l.kv_heads.to_le_bytes());
    b[12..16].copy_from_slice(&l.head_dim.to_le_bytes());
    b[16] = l.dtype.code();
    b
}

fn decode_layout(b: &[u8]) -> Result<KvLayout> {
    if b.len() != OPEN_PAYLOAD_LEN {
        return Err(Error::FrameMalformed {
            what: "layout has the wrong length",
        });
    }
    let u = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    let dtype = KvDtype::from_code(b[16]).ok_or(Error::FrameMalformed {
        what: "unknown dtype",
    })?;
    if b[17..].iter().any(|&x| x != 0) {
        return Err(Error::FrameMalformed {
            what: "layout padding is not zero",
        });
    }
    Ok(KvLayout {
        layers: u(0),
        block_tokens: u(4),
        kv_heads: u(8),
        head_dim: u(12),
        dtype,
    })
}

/// Decodes one frame from the front of `buf`. `Ok(None)`: more bytes are needed.
/// On success returns the frame and the number of bytes it took.
pub fn decode(buf: &[u8], limits: &FrameLimits) -> Result<Option<(Frame, usize)>> {
    let Some(head) = buf.first_chunk::<HEADER_LEN>() else {
        return Ok(None);
    };
    let header = FrameHeader::decode(head, limits)?;
    let total = HEADER_LEN + header.payload_len as usize + TRAILER_LEN;
    if buf.len() < total {
        return Ok(None);
    }
    let mut payload = BufferPool::frames().take(header.payload_len as usize);
    payload.copy_from_slice(&buf[HEADER_LEN..total - TRAILER_LEN]);
    let payload = payload.freeze();
    let mut c = [0u8; 4];
    c.copy_from_slice(&buf[total - TRAILER_LEN..total]);
    Ok(Some((Frame::from_parts(header, payload, u32::from_le_bytes(c)), total)))
}

/// Fills `head` from `r`. `Ok(false)`: the stream ended cleanly before its first byte;
/// ending inside it is `FrameMalformed { what: cut }`. Errors reading are `Error::io(op)`.
pub(crate) async fn read_head<R: AsyncRead + Unpin>(
    r: &mut R,
    head: &mut [u8],
    op: &'static str,
    cut: &'static str,
) -> Result<bool> {
    let mut got = 0;
    while got < head.len() {
        let n = r.read(&mut head[got..]).await.map_err(|e| Error::io(op, e))?;
        if n == 0 {
            if got == 0 {
                return Ok(false);
            }
            return Err(Error::FrameMalformed { what: cut });
        }
        got += n;
    }
    Ok(true)
}

/// Reads one frame from a byte stream. `Ok(None)`: clean end of stream at a frame boundary.
pub async fn read_frame<R: AsyncRead + Unpin>(
    r: &mut R,
    limits: &FrameLimits,
) -> Result<Option<Frame>> {
    Ok(read_frame_within(r, limits, None).await?.map(|(f, _)| f))
}

/// [`read_frame`], taking the payload's bytes from `budget` (the connection's) before
/// allocating them; the permit returned with the frame gives them back when dropped.
pub(crate) async fn read_frame_within<R: AsyncRead + Unpin>(
    r: &mut R,
    limits: &FrameLimits,
    budget: Option<&crate::transport::ConnBudget>,
) -> Result<Option<(Frame, Option<crate::transport::BudgetPermit>)>> {
    let mut head = [0u8; HEADER_LEN];
    if !read_head(r, &mut head, "reading a frame header", "stream ended inside a frame header").await? {
        return Ok(None);
    }
    let header = FrameHeader::decode(&head, limits)?;
    // Only block data is budgeted: every other kind's payload is fixed and small.
    let permit = match budget {
        Some(b) if header.kind == FrameKind::Data && header.payload_len > 0 => Some(b.take(header.payload_len).await?),
        _ => None,
    };
    // Bounded by `limits` in `FrameHeader::decode`, and by the connection's budget.
    let mut payload = BufferPool::frames().take(header.payload_len as usize);
    r.read_exact(&mut payload).await.map_err(|e| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => Error::FrameMalformed { what: "stream ended inside a frame payload" },
        _ => Error::io("reading a frame payload", e),
    })?;
    let mut c = [0u8; 4];
    r.read_exact(&mut c)
        .await
        .map_err(|e| Error::io("reading a frame checksum", e))?;
    Ok(Some((Frame::from_parts(header, payload.freeze(), u32::from_le_bytes(c)), permit)))
}

/// Writes one frame to a byte stream (not flushed).
pub async fn write_frame<W: AsyncWrite + Unpin>(w: &mut W, f: &Frame) -> Result<()> {
    let op = "writing a frame";
    assert!(f.device.is_none(), "a received device payload is never sent on");
    w.write_all(&f.header.encode())
        .await
        .map_err(|e| Error::io(op, e))?;
    w.write_all(&f.payload).await.map_err(|e| Error::io(op, e))?;
    w.write_all(&f.checksum.to_le_bytes())
        .await
        .map_err(|e| Error::io(op, e))?;
    Ok(())
}

#[cfg(test)]
mod tests;
