//! The RDMA control channel: messages the two ends exchange over one QUIC stream per link.
//!
//! Owns: [`Msg`], its byte encoding, and reading/writing messages on a byte stream.
//! Encoding (little-endian): tag `u8`, body length `u32`, body. The sender opens the stream
//! with [`Msg::Hello`] (its queue pair); the receiver answers [`Msg::Accept`] (its queue pair
//! and the ring the sender may write into) or [`Msg::Refuse`]. Afterwards the receiver sends
//! [`Msg::Credit`]s and its replies ([`Msg::Reply`], encoded frames), and the sender ends with
//! [`Msg::Bye`] before it finishes the stream.
//! Invariants: decoding never panics and never allocates more than [`MAX_BODY`] bytes; an
//! unknown tag, a body of the wrong size or a wrong version is an error, never skipped.

use bytes::{BufMut, Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::error::{Error, Result};
use crate::handoff::frame::read_head;

/// Version of the control protocol; bumped on any incompatible change.
pub const SETUP_VERSION: u16 = 1;
/// Largest body accepted: replies are payload-less control frames.
pub const MAX_BODY: usize = 4096;
const PREFIX: usize = 5;
const QP_INFO_LEN: usize = 27;

/// What one end tells the other about its queue pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpInfo {
    /// Queue pair number.
    pub qpn: u32,
    /// First packet sequence number this end sends with.
    pub psn: u32,
    /// Port LID (InfiniBand; zero on RoCE).
    pub lid: u16,
    /// The port's active MTU as an `ibv_mtu` value (1 = 256 bytes ... 5 = 4096 bytes).
    pub mtu: u8,
    /// The GID used for global routing (RoCE, or InfiniBand across subnets).
    pub gid: [u8; 16],
}

/// The receiver's ring: where the sender's RDMA WRITEs go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingInfo {
    /// Virtual address of slot 0 in the receiver's registered region.
    pub addr: u64,
    /// Remote key of the region that covers exactly this ring.
    pub rkey: u32,
    /// Bytes per slot (one encoded frame at most).
    pub slot_bytes: u32,
    /// Slots in the ring; also the sender's initial credit.
    pub slots: u32,
}

/// One control message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Msg {
    /// Sender -> receiver: open a link.
    Hello { version: u16, qp: QpInfo },
    /// Receiver -> sender: the receiver's queue pair is ready to receive into `ring`.
    Accept { qp: QpInfo, ring: RingInfo },
    /// Receiver -> sender: no link; `code` indexes [`KINDS`](crate::error::KINDS).
    Refuse { code: u16 },
    /// Receiver -> sender: frames consumed so far (cumulative, so a lost batch cannot skew it).
    Credit { consumed: u64 },
    /// Receiver -> sender: one encoded frame (`Completed`, `Failed`).
    Reply(Bytes),
    /// Sender -> receiver: the sender is done; `frames` frames are known to have landed.
    Bye { frames: u64 },
}

impl Msg {
    fn tag(&self) -> u8 {
        match self {
            Msg::Hello { .. } => 1,
            Msg::Accept { .. } => 2,
            Msg::Refuse { .. } => 3,
            Msg::Credit { .. } => 4,
            Msg::Reply(_) => 5,
            Msg::Bye { .. } => 6,
        }
    }

    /// The message with its tag and length prefix.
    pub fn encode(&self) -> Bytes {
        let mut body = BytesMut::new();
        match self {
            Msg::Hello { version, qp } => {
                body.put_u16_le(*version);
                put_qp(&mut body, qp);
            }
            Msg::Accept { qp, ring } => {
                put_qp(&mut body, qp);
                body.put_u64_le(ring.addr);
                body.put_u32_le(ring.rkey);
                body.put_u32_le(ring.slot_bytes);
                body.put_u32_le(ring.slots);
            }
            Msg::Refuse { code } => body.put_u16_le(*code),
            Msg::Credit { consumed } => body.put_u64_le(*consumed),
            Msg::Reply(frame) => body.put_slice(frame),
            Msg::Bye { frames } => body.put_u64_le(*frames),
        }
        let mut out = BytesMut::with_capacity(PREFIX + body.len());
        out.put_u8(self.tag());
        out.put_u32_le(body.len() as u32);
        out.put_slice(&body);
        out.freeze()
    }

    /// Parses a body for `tag`.
    pub fn decode(tag: u8, body: &[u8]) -> Result<Msg> {
        let bad = |what| Error::FrameMalformed { what };
        let expect = |len: usize| {
            if body.len() == len {
                Ok(())
            } else {
                Err(bad("RDMA control message has the wrong length"))
            }
        };
        let u64_at = |i: usize| u64::from_le_bytes(body[i..i + 8].try_into().unwrap_or([0; 8]));
        let u32_at = |i: usize| u32::from_le_bytes(body[i..i + 4].try_into().unwrap_or([0; 4]));
        Ok(match tag {
            1 => {
                expect(2 + QP_INFO_LEN)?;
                let version = u16::from_le_bytes([body[0], body[1]]);
                if version != SETUP_VERSION {
                    return Err(Error::UnsupportedVersion {
                        version: u8::try_from(version).unwrap_or(u8::MAX),
                    });
                }
                Msg::Hello {
                    version,
                    qp: get_qp(&body[2..]),
                }
            }
            2 => {
                expect(QP_INFO_LEN + 20)?;
                let r = QP_INFO_LEN;
                Msg::Accept {
                    qp: get_qp(&body[..r]),
                    ring: RingInfo {
                        addr: u64_at(r),
                        rkey: u32_at(r + 8),
                        slot_bytes: u32_at(r + 12),
                        slots: u32_at(r + 16),
                    },
                }
            }
            3 => {
                expect(2)?;
                Msg::Refuse {
                    code: u16::from_le_bytes([body[0], body[1]]),
                }
            }
            4 => {
                expect(8)?;
                Msg::Credit { consumed: u64_at(0) }
            }
            5 => Msg::Reply(Bytes::copy_from_slice(body)),
            6 => {
                expect(8)?;
                Msg::Bye { frames: u64_at(0) }
            }
            _ => return Err(bad("unknown RDMA control message")),
        })
    }
}

fn put_qp(b: &mut BytesMut, qp: &QpInfo) {
    b.put_u32_le(qp.qpn);
    b.put_u32_le(qp.psn);
    b.put_u16_le(qp.lid);
    b.put_u8(qp.mtu);
    b.put_slice(&qp.gid);
}

/// `b` is exactly [`QP_INFO_LEN`] long (checked by the caller).
fn get_qp(b: &[u8]) -> QpInfo {
    let mut gid = [0u8; 16];
    gid.copy_from_slice(&b[11..27]);
    QpInfo {
        qpn: u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        psn: u32::from_le_bytes([b[4], b[5], b[6], b[7]]),
        lid: u16::from_le_bytes([b[8], b[9]]),
        mtu: b[10],
        gid,
    }
}

/// Reads one message. `Ok(None)`: the stream ended cleanly between messages.
pub async fn read_msg<R: AsyncRead + Unpin>(r: &mut R) -> Result<Option<Msg>> {
    let mut prefix = [0u8; PREFIX];
    let (op, cut) = ("reading an RDMA control message", "control stream ended inside a message");
    if !read_head(r, &mut prefix, op, cut).await? {
        return Ok(None);
    }
    let len = u32::from_le_bytes([prefix[1], prefix[2], prefix[3], prefix[4]]) as usize;
    if len > MAX_BODY {
        return Err(Error::FrameTooLarge {
            len: len as u64,
            max: MAX_BODY as u64,
        });
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).await.map_err(|e| Error::io(op, e))?;
    Msg::decode(prefix[0], &body).map(Some)
}

/// Writes one message.
pub async fn write_msg<W: AsyncWrite + Unpin>(w: &mut W, msg: &Msg) -> Result<()> {
    w.write_all(&msg.encode())
        .await
        .map_err(|e| Error::io("writing an RDMA control message", e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qp(n: u32) -> QpInfo {
        QpInfo {
            qpn: n,
            psn: n.wrapping_mul(7) & 0xff_ffff,
            lid: 3,
            mtu: 5,
            gid: [n as u8; 16],
        }
    }

    #[tokio::test]
    async fn every_message_round_trips_through_a_stream() {
        let msgs = vec![
            Msg::Hello { version: SETUP_VERSION, qp: qp(1) },
            Msg::Accept {
                qp: qp(2),
                ring: RingInfo { addr: 0xdead_beef_0000, rkey: 77, slot_bytes: 65_600, slots: 8 },
            },
            Msg::Refuse { code: 27 },
            Msg::Credit { consumed: u64::MAX - 1 },
            Msg::Reply(Bytes::from_static(b"frame bytes")),
            Msg::Bye { frames: 12 },
        ];
        let mut wire = Vec::new();
        for m in &msgs {
            write_msg(&mut wire, m).await.unwrap();
        }
        let mut r = &wire[..];
        for m in &msgs {
            assert_eq!(read_msg(&mut r).await.unwrap().as_ref(), Some(m));
        }
        assert_eq!(read_msg(&mut r).await.unwrap(), None);
    }

    #[test]
    fn rejects_wrong_version_length_and_tag() {
        let mut hello = Msg::Hello { version: SETUP_VERSION, qp: qp(1) }.encode().to_vec();
        hello[5] = 9; // version low byte
        assert_eq!(Msg::decode(1, &hello[5..]).unwrap_err().label(), "unsupported_version");
        assert_eq!(Msg::decode(4, &[0; 7]).unwrap_err().label(), "frame_malformed");
        assert_eq!(Msg::decode(2, &[0; 3]).unwrap_err().label(), "frame_malformed");
        assert_eq!(Msg::decode(99, &[]).unwrap_err().label(), "frame_malformed");
    }

    #[tokio::test]
    async fn cut_or_oversized_messages_are_errors() {
        let full = Msg::Credit { consumed: 5 }.encode();
        let mut cut = &full[..full.len() - 1];
        assert!(read_msg(&mut cut).await.is_err());
        let mut cut = &full[..2];
        assert_eq!(read_msg(&mut cut).await.unwrap_err().label(), "frame_malformed");
        let mut huge = vec![5u8];
        huge.extend_from_slice(&(MAX_BODY as u32 + 1).to_le_bytes());
        let mut r = &huge[..];
        assert_eq!(read_msg(&mut r).await.unwrap_err().label(), "frame_too_large");
    }
}
