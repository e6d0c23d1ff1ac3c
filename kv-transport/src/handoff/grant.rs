//! The grant: what a receiver hands out so that a sender may fill its reserved blocks.
//!
//! Owns: [`Grant`] and its byte encoding, which the node services carry inside their own
//! RPCs (the transport does not care how a grant travels).
//! Invariants: a decoded grant has a valid layout, a non-empty layer range inside it, at most
//! [`MAX_GRANT_BLOCKS`] blocks (checked before allocating), one skip count per layer of the
//! range, none above the block count, and a deadline measured from the moment it was decoded
//! on this node, so clocks of different nodes never need to agree.
//!
//! Skips are how a sliding-window layer's blocks that no later row will read stay off the
//! wire: the receiver, which knows the position its engine continues from, names for each
//! layer how many leading blocks it does not want; the sender sends the rest, and the
//! receiver refuses the skipped ones like any block outside the grant.

use std::ops::Range;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::types::{BlockId, Epoch, KvDtype, KvLayout, ReservationId};

/// Largest number of blocks one grant may name.
pub const MAX_GRANT_BLOCKS: usize = 1 << 20;

const GRANT_MAGIC: [u8; 4] = *b"BKVG";
/// Version 2 added the per-layer skip counts after the block list.
const GRANT_VERSION: u8 = 2;
const GRANT_FIXED_LEN: usize = 4 + 1 + 8 + 8 + 4 * 4 + 1 + 4 + 4 + 8 + 4;

/// Permission to fill one reservation on one receiver.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Grant {
    pub reservation: ReservationId,
    pub epoch: Epoch,
    pub layout: KvLayout,
    /// Layers the sender must deliver, in `layout.layers`.
    pub layers: Range<u32>,
    /// The receiver's blocks, in the order the sender's blocks map onto them.
    pub blocks: Vec<BlockId>,
    /// For each layer of `layers`, in order, how many leading `blocks` the receiver does not
    /// want (a sliding-window layer's blocks that fall before every later row's window); the
    /// sender ships blocks `skip[i]..` of layer `layers.start + i`. All zero: every block.
    pub skip: Vec<u32>,
    /// How long the reservation lives, measured from `issued_at`.
    pub deadline: Duration,
    /// When this node created or decoded the grant.
    pub issued_at: Instant,
}

impl Grant {
    /// The moment, on this node's clock, after which the reservation is gone.
    pub fn deadline_at(&self) -> Instant {
        self.issued_at + self.deadline
    }

    /// Time left before the deadline.
    pub fn remaining(&self) -> Duration {
        self.deadline_at().saturating_duration_since(Instant::now())
    }

    /// Block-layers a complete transfer delivers.
    pub fn block_layers(&self) -> u64 {
        self.blocks.len() as u64 * u64::from(self.layers.end - self.layers.start) - self.skipped_block_layers()
    }

    /// Block-layers the receiver does not want (see [`Grant::skip`]).
    pub fn skipped_block_layers(&self) -> u64 {
        self.skip.iter().map(|&s| u64::from(s)).sum()
    }

    /// Bytes a complete transfer leaves off the wire because of [`Grant::skip`].
    pub fn skipped_bytes(&self) -> u64 {
        self.skipped_block_layers() * self.layout.bytes_per_block_layer() as u64
    }

    /// The first grant block index shipped for `layer` (0 for a layer outside the range).
    pub fn first_block(&self, layer: u32) -> u32 {
        layer
            .checked_sub(self.layers.start)
            .and_then(|i| self.skip.get(i as usize))
            .copied()
            .unwrap_or(0)
    }

    /// Encodes the grant; the deadline written is the time remaining now.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(GRANT_FIXED_LEN + 4 * (self.blocks.len() + self.skip.len()));
        b.extend_from_slice(&GRANT_MAGIC);
        b.push(GRANT_VERSION);
        b.extend_from_slice(&self.reservation.0.to_le_bytes());
        b.extend_from_slice(&self.epoch.0.to_le_bytes());
        for v in [
            self.layout.layers,
            self.layout.block_tokens,
            self.layout.kv_heads,
            self.layout.head_dim,
        ] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b.push(self.layout.dtype.code());
        b.extend_from_slice(&self.layers.start.to_le_bytes());
        b.extend_from_slice(&self.layers.end.to_le_bytes());
        let remaining_us = u64::try_from(self.remaining().as_micros()).unwrap_or(u64::MAX);
        b.extend_from_slice(&remaining_us.to_le_bytes());
        b.extend_from_slice(&(self.blocks.len() as u32).to_le_bytes());
        for blk in &self.blocks {
            b.extend_from_slice(&blk.0.to_le_bytes());
        }
        for s in &self.skip {
            b.extend_from_slice(&s.to_le_bytes());
        }
        b
    }

    /// Decodes a grant; its deadline starts counting now.
    pub fn from_bytes(b: &[u8]) -> Result<Grant> {
        let bad = |what| Error::FrameMalformed { what };
        if b.len() < GRANT_FIXED_LEN {
            return Err(bad("grant is too short"));
        }
        if b[0..4] != GRANT_MAGIC {
            return Err(bad("bad grant magic"));
        }
        if b[4] != GRANT_VERSION {
            return Err(Error::UnsupportedVersion { version: b[4] });
        }
        let mut at = 5;
        let mut take = |n: usize| {
            let s = &b[at..at + n];
            at += n;
            s
        };
        let u64_of = |s: &[u8]| {
            let mut a = [0u8; 8];
            a.copy_from_slice(s);
            u64::from_le_bytes(a)
        };
        let u32_of = |s: &[u8]| u32::from_le_bytes([s[0], s[1], s[2], s[3]]);
        let reservation = ReservationId(u64_of(take(8)));
        let epoch = Epoch(u64_of(take(8)));
        let layers_n = u32_of(take(4));
        let block_tokens = u32_of(take(4));
        let kv_heads = u32_of(take(4));
        let head_dim = u32_of(take(4));
        let dtype = KvDtype::from_code(take(1)[0]).ok_or(bad("unknown dtype in grant"))?;
        let start = u32_of(take(4));
        let end = u32_of(take(4));
        let deadline = Duration::from_micros(u64_of(take(8)));
        let n = u32_of(take(4)) as usize;
        let layout = KvLayout {
            layers: layers_n,
            block_tokens,
            kv_heads,
            head_dim,
            dtype,
        };
        layout.validate()?;
        if start >= end || end > layout.layers {
            return Err(bad("grant layer range is empty or outside the layout"));
        }
        if n > MAX_GRANT_BLOCKS {
            return Err(Error::FrameTooLarge {
                len: n as u64,
                max: MAX_GRANT_BLOCKS as u64,
            });
        }
        // One skip count per layer of the range follows the blocks.
        let n_layers = (end - start) as usize;
        if b.len() != GRANT_FIXED_LEN + 4 * (n + n_layers) {
            return Err(bad("grant length does not match its block and layer counts"));
        }
        let (block_bytes, skip_bytes) = b[GRANT_FIXED_LEN..].split_at(4 * n);
        let blocks = block_bytes.chunks_exact(4).map(|c| BlockId(u32_of(c))).collect();
        let skip: Vec<u32> = skip_bytes.chunks_exact(4).map(u32_of).collect();
        if skip.iter().any(|&s| s as usize > n) {
            return Err(bad("grant skips more blocks of a layer than it names"));
        }
        Ok(Grant {
            reservation,
            epoch,
            layout,
            layers: start..end,
            blocks,
            skip,
            deadline,
            issued_at: Instant::now(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn grant(blocks: Vec<BlockId>) -> Grant {
        Grant {
            reservation: ReservationId(42),
            epoch: Epoch(0xdead_beef),
            layout: KvLayout::smollm2_135m(KvDtype::F16),
            layers: 0..30,
            skip: (0..30).map(|l| (l % 3 == 0) as u32 * blocks.len().min(2) as u32).collect(),
            blocks,
            deadline: Duration::from_secs(30),
            issued_at: Instant::now(),
        }
    }

    #[test]
    fn rejects_lengths_that_disagree_with_the_block_count() {
        let mut b = grant(vec![BlockId(1), BlockId(2)]).to_bytes();
        b.pop();
        assert!(Grant::from_bytes(&b).is_err());
        let mut b = grant(vec![]).to_bytes();
        let n = GRANT_FIXED_LEN - 4;
        b[n..n + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(Grant::from_bytes(&b).unwrap_err().label(), "frame_too_large");
    }

    #[test]
    fn skips_are_one_per_layer_and_never_above_the_block_count() {
        let g = grant(vec![BlockId(1), BlockId(2), BlockId(3)]);
        assert_eq!(g.skipped_block_layers(), 10 * 2);
        assert_eq!(g.block_layers(), 30 * 3 - 20);
        assert_eq!((g.first_block(0), g.first_block(1), g.first_block(30)), (2, 0, 0));
        assert_eq!(g.skipped_bytes(), 20 * g.layout.bytes_per_block_layer() as u64);
        // A skip count that names more blocks than the grant has.
        let mut b = g.to_bytes();
        let at = b.len() - 4;
        b[at..].copy_from_slice(&4u32.to_le_bytes());
        assert_eq!(Grant::from_bytes(&b).unwrap_err().to_string(), Error::FrameMalformed { what: "grant skips more blocks of a layer than it names" }.to_string());
        // Skip counts missing (a version-1 body under a version-2 header) or one too many.
        let b = g.to_bytes();
        assert!(Grant::from_bytes(&b[..b.len() - 4 * 30]).is_err());
        let mut longer = g.to_bytes();
        longer.extend_from_slice(&0u32.to_le_bytes());
        assert!(Grant::from_bytes(&longer).is_err());
        // A version-1 grant is refused by its version, not misread.
        let mut v1 = g.to_bytes();
        v1[4] = 1;
        assert_eq!(Grant::from_bytes(&v1).unwrap_err().label(), "unsupported_version");
    }

    proptest! {
        #[test]
        fn round_trip(ids in prop::collection::vec(any::<u32>(), 0..300)) {
            let g = grant(ids.into_iter().map(BlockId).collect());
            let back = Grant::from_bytes(&g.to_bytes()).unwrap();
            prop_assert_eq!(back.reservation, g.reservation);
            prop_assert_eq!(back.epoch, g.epoch);
            prop_assert_eq!(back.layout, g.layout);
            prop_assert_eq!(&back.layers, &g.layers);
            prop_assert_eq!(&back.blocks, &g.blocks);
            prop_assert_eq!(&back.skip, &g.skip);
            prop_assert!(back.deadline <= g.deadline);
            prop_assert!(back.deadline > Duration::from_secs(29));
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
            let _ = Grant::from_bytes(&bytes);
        }

        #[test]
        fn arbitrary_tails_after_a_valid_prefix_never_panic(
            tail in prop::collection::vec(any::<u8>(), 0..128), cut in 0usize..GRANT_FIXED_LEN
        ) {
            let mut b = grant(vec![BlockId(1)]).to_bytes();
            b.truncate(cut);
            b.extend_from_slice(&tail);
            let _ = Grant::from_bytes(&b);
        }
    }
}
