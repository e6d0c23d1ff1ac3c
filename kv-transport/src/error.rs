//! The crate's one error type.
//!
//! Owns: [`Error`], its stable [`Error::label`] strings (metric label and API error type) and
//! the wire codes a receiver uses to tell a sender why a reservation ended.
//! Invariants: `label()` strings never change once shipped; a wire code always decodes to an
//! error with the same `label()` (unknown codes decode to `remote` with kind `unknown`).

use std::fmt;
use std::time::Duration;

use crate::types::{BlockId, Epoch, ReservationId};
use baton_vocab::{ErrorKind, HasKind};

/// Result with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// One end of a handoff.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Side {
    Sender,
    Receiver,
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Side::Sender => "sender",
            Side::Receiver => "receiver",
        })
    }
}

/// Everything that can go wrong while moving KV blocks.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    #[error("reservation {reservation} is unknown to this receiver")]
    UnknownReservation { reservation: ReservationId },
    #[error("reservation {reservation} names epoch {got}, the receiver is at epoch {expected}")]
    StaleEpoch {
        reservation: ReservationId,
        expected: Epoch,
        got: Epoch,
    },
    #[error("reservation {reservation} expired before it completed")]
    ReservationExpired { reservation: ReservationId },
    #[error("reservation {reservation} has already ended")]
    ReservationEnded { reservation: ReservationId },
    #[error("transfer for reservation {reservation} was cancelled by the {by}")]
    Cancelled {
        reservation: ReservationId,
        by: Side,
    },
    #[error("checksum mismatch in a frame for reservation {reservation}, layer {layer}, block index {block}")]
    FrameChecksum {
        reservation: ReservationId,
        layer: u32,
        block: u32,
    },
    #[error("malformed frame: {what}")]
    FrameMalformed { what: &'static str },
    #[error("frame payload of {len} bytes exceeds the limit of {max} bytes")]
    FrameTooLarge { len: u64, max: u64 },
    #[error("unsupported wire version {version}")]
    UnsupportedVersion { version: u8 },
    #[error("reservation {reservation}: the sender's {what} does not match the reservation")]
    LayoutMismatch {
        reservation: ReservationId,
        what: &'static str,
    },
    #[error("reservation {reservation}: layer {layer}, block index {block} is outside the reservation")]
    OutOfRange {
        reservation: ReservationId,
        layer: u32,
        block: u32,
    },
    #[error("reservation {reservation}: layer {layer}, block index {block} was sent twice")]
    DuplicateBlock {
        reservation: ReservationId,
        layer: u32,
        block: u32,
    },
    #[error("reservation {reservation}: finished with {missing} block-layers missing")]
    Incomplete {
        reservation: ReservationId,
        missing: u64,
    },
    #[error("reservation {reservation} already has a sender attached")]
    AlreadyAttached { reservation: ReservationId },
    #[error("reservation {reservation}: unexpected {what} frame")]
    UnexpectedFrame {
        reservation: ReservationId,
        what: &'static str,
    },
    #[error("block pool has {free} free blocks, {requested} requested")]
    PoolExhausted { requested: usize, free: usize },
    #[error("block pool: block {block}, layer {layer}: {what}")]
    Sink {
        block: BlockId,
        layer: u32,
        what: &'static str,
    },
    #[error("the peer went away before reservation {reservation} finished")]
    PeerGone { reservation: ReservationId },
    #[error("reservation {reservation}: deadline of {deadline:?} passed while {during}")]
    DeadlineExceeded {
        reservation: ReservationId,
        deadline: Duration,
        during: &'static str,
    },
    #[error("the receiver failed reservation {reservation} ({kind})")]
    Remote {
        reservation: ReservationId,
        kind: &'static str,
    },
    #[error("invalid argument: {what}")]
    InvalidArgument { what: &'static str },
    #[error("I/O error while {op}")]
    Io {
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("{transport}: cannot connect to {peer}: {detail}")]
    Connect {
        transport: &'static str,
        peer: String,
        detail: String,
    },
    #[error("{transport}: link failed: {detail}")]
    Link {
        transport: &'static str,
        detail: String,
    },
    #[error("TLS configuration: {detail}")]
    Tls { detail: String },
    #[error("certificates: {source}")]
    Certs {
        #[source]
        source: baton_identity::Error,
    },
    #[error("RDMA transport unavailable: {reason}")]
    RdmaUnavailable { reason: String },
    #[error("RDMA: {op} failed")]
    Rdma {
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("RDMA work completion failed: {status} (vendor error {vendor_err:#x})")]
    RdmaCompletion { status: String, vendor_err: u32 },
}

/// Stable kinds, indexed by wire code. Index 0 is the catch-all for codes this build does
/// not know. Append only.
pub const KINDS: &[&str] = &[
    "unknown",
    "unknown_reservation",
    "stale_epoch",
    "reservation_expired",
    "reservation_ended",
    "cancelled",
    "frame_checksum",
    "frame_malformed",
    "frame_too_large",
    "unsupported_version",
    "layout_mismatch",
    "out_of_range",
    "duplicate_block",
    "incomplete",
    "already_attached",
    "unexpected_frame",
    "pool_exhausted",
    "sink",
    "peer_gone",
    "deadline_exceeded",
    "remote",
    "invalid_argument",
    "io",
    "connect",
    "link",
    "tls",
    "certs",
    "rdma_unavailable",
    "rdma",
    "rdma_completion",
];

/// Wire detail for `cancelled`: who cancelled.
const CANCELLED_BY_SENDER: u32 = 0;
const CANCELLED_BY_RECEIVER: u32 = 1;

/// What a receiver sends when it ends a reservation: enough to rebuild the error's kind and
/// location on the sender, and nothing internal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WireFailure {
    pub code: u16,
    pub layer: u32,
    pub block: u32,
}

impl Error {
    /// Stable label for metrics and API error types.
    pub fn label(&self) -> &'static str {
        KINDS[self.code() as usize]
    }

    /// Index of [`Error::label`] in [`KINDS`].
    pub fn code(&self) -> u16 {
        match self {
            Error::UnknownReservation { .. } => 1,
            Error::StaleEpoch { .. } => 2,
            Error::ReservationExpired { .. } => 3,
            Error::ReservationEnded { .. } => 4,
            Error::Cancelled { .. } => 5,
            Error::FrameChecksum { .. } => 6,
            Error::FrameMalformed { .. } => 7,
            Error::FrameTooLarge { .. } => 8,
            Error::UnsupportedVersion { .. } => 9,
            Error::LayoutMismatch { .. } => 10,
            Error::OutOfRange { .. } => 11,
            Error::DuplicateBlock { .. } => 12,
            Error::Incomplete { .. } => 13,
            Error::AlreadyAttached { .. } => 14,
            Error::UnexpectedFrame { .. } => 15,
            Error::PoolExhausted { .. } => 16,
            Error::Sink { .. } => 17,
            Error::PeerGone { .. } => 18,
            Error::DeadlineExceeded { .. } => 19,
            // A remote failure is reported with the remote's own kind.
            Error::Remote { kind, .. } => KINDS.iter().position(|k| k == kind).unwrap_or(20) as u16,
            Error::InvalidArgument { .. } => 21,
            Error::Io { .. } => 22,
            Error::Connect { .. } => 23,
            Error::Link { .. } => 24,
            Error::Tls { .. } => 25,
            Error::Certs { .. } => 26,
            Error::RdmaUnavailable { .. } => 27,
            Error::Rdma { .. } => 28,
            Error::RdmaCompletion { .. } => 29,
        }
    }

    /// What a receiver tells the sender about this error.
    pub fn to_wire(&self) -> WireFailure {
        let (layer, block) = match self {
            Error::FrameChecksum { layer, block, .. }
            | Error::OutOfRange { layer, block, .. }
            | Error::DuplicateBlock { layer, block, .. } => (*layer, *block),
            Error::Cancelled { by: Side::Receiver, .. } => (0, CANCELLED_BY_RECEIVER),
            Error::Cancelled { by: Side::Sender, .. } => (0, CANCELLED_BY_SENDER),
            _ => (0, 0),
        };
        WireFailure {
            code: self.code(),
            layer,
            block,
        }
    }

    /// Rebuilds a receiver's failure on the sender. Kinds whose details stay on the receiver
    /// come back as [`Error::Remote`] with the same `label()`.
    pub fn from_wire(reservation: ReservationId, w: WireFailure) -> Error {
        let (layer, block) = (w.layer, w.block);
        match w.code {
            1 => Error::UnknownReservation { reservation },
            3 => Error::ReservationExpired { reservation },
            4 => Error::ReservationEnded { reservation },
            5 => Error::Cancelled {
                reservation,
                by: if block == CANCELLED_BY_RECEIVER {
                    Side::Receiver
                } else {
                    Side::Sender
                },
            },
            6 => Error::FrameChecksum {
                reservation,
                layer,
                block,
            },
            11 => Error::OutOfRange {
                reservation,
                layer,
                block,
            },
            12 => Error::DuplicateBlock {
                reservation,
                layer,
                block,
            },
            code => Error::Remote {
                reservation,
                kind: KINDS.get(code as usize).copied().unwrap_or(KINDS[0]),
            },
        }
    }

    pub(crate) fn io(op: &'static str, source: std::io::Error) -> Error {
        Error::Io { op, source }
    }
}

impl HasKind for Error {
    fn kind(&self) -> ErrorKind {
        match self {
            Error::UnknownReservation { .. } => ErrorKind::NotFound,
            Error::StaleEpoch { .. } | Error::ReservationEnded { .. } | Error::RdmaUnavailable { .. } => ErrorKind::FailedPrecondition,
            Error::ReservationExpired { .. } | Error::DeadlineExceeded { .. } => ErrorKind::DeadlineExceeded,
            Error::Cancelled { .. } => ErrorKind::Cancelled,
            // The peer sent something this end can never accept.
            Error::FrameChecksum { .. }
            | Error::FrameMalformed { .. }
            | Error::FrameTooLarge { .. }
            | Error::UnsupportedVersion { .. }
            | Error::LayoutMismatch { .. }
            | Error::OutOfRange { .. }
            | Error::DuplicateBlock { .. }
            | Error::UnexpectedFrame { .. }
            | Error::InvalidArgument { .. } => ErrorKind::InvalidArgument,
            Error::AlreadyAttached { .. } => ErrorKind::Conflict,
            Error::PoolExhausted { .. } => ErrorKind::ResourceExhausted,
            // The link or the peer failed: another try (or a local prefill) may succeed.
            Error::Incomplete { .. }
            | Error::PeerGone { .. }
            | Error::Remote { .. }
            | Error::Io { .. }
            | Error::Connect { .. }
            | Error::Link { .. }
            | Error::Rdma { .. }
            | Error::RdmaCompletion { .. } => ErrorKind::Unavailable,
            Error::Tls { .. } => ErrorKind::Unauthenticated,
            Error::Certs { source, .. } => source.kind(),
            Error::Sink { .. } => ErrorKind::Internal,
        }
    }
}

impl From<baton_identity::Error> for Error {
    fn from(source: baton_identity::Error) -> Self {
        match source {
            baton_identity::Error::Tls(detail) => Error::Tls { detail },
            source => Error::Certs { source },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_round_trip_keeps_kind_and_location() {
        let r = ReservationId(7);
        let errors = [
            Error::UnknownReservation { reservation: r },
            Error::ReservationExpired { reservation: r },
            Error::Cancelled { reservation: r, by: Side::Receiver },
            Error::Cancelled { reservation: r, by: Side::Sender },
            Error::FrameChecksum { reservation: r, layer: 3, block: 9 },
            Error::Incomplete { reservation: r, missing: 4 },
            Error::StaleEpoch { reservation: r, expected: Epoch(1), got: Epoch(2) },
        ];
        for e in errors {
            let back = Error::from_wire(r, e.to_wire());
            assert_eq!(back.label(), e.label(), "{e}");
            assert_eq!(back.to_wire(), e.to_wire());
        }
        let unknown = Error::from_wire(r, WireFailure { code: 999, layer: 0, block: 0 });
        assert_eq!(unknown.label(), "unknown");
    }

    #[test]
    fn every_code_indexes_kinds() {
        let e = Error::RdmaUnavailable { reason: String::new() };
        assert_eq!(e.label(), "rdma_unavailable");
        let e = Error::Rdma { op: "x", source: std::io::Error::other("y") };
        assert_eq!(e.label(), "rdma");
        let e = Error::RdmaCompletion { status: "x".into(), vendor_err: 0 };
        assert_eq!(e.label(), "rdma_completion");
        assert_eq!(KINDS.len(), 30);
    }
}
