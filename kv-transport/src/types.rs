//! Identifiers and the KV layout that both ends of a handoff agree on.
//!
//! Owns: the newtypes that name reservations, blocks and receiver incarnations, and
//! [`KvLayout`], the shape of one KV block.
//! Invariants: a layout that passed [`KvLayout::validate`] has every dimension non-zero and
//! a per-block-layer size of at most [`MAX_BLOCK_LAYER_BYTES`], so sizes derived from it
//! never overflow and always fit in one frame.

use std::fmt;

use crate::error::{Error, Result};

/// Largest size of one block of one layer (K and V) that the transport accepts.
pub const MAX_BLOCK_LAYER_BYTES: usize = 16 << 20;

/// A block in a node's KV pool. Only meaningful on the node that owns the pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId(pub u32);

/// Names one reservation on one receiver incarnation (see [`Epoch`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ReservationId(pub u64);

/// A receiver incarnation. Drawn at random when a receiver starts, so a frame that names a
/// reservation of a previous incarnation (a restarted node reusing reservation numbers) is
/// rejected instead of landing in someone else's blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Epoch(pub u64);

impl fmt::Display for BlockId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}
impl fmt::Display for ReservationId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "r{}", self.0)
    }
}
impl fmt::Display for Epoch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// Element type of the KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvDtype {
    F16,
    Bf16,
    F32,
    /// FP8 E4M3, one byte per element.
    F8E4M3,
}

impl KvDtype {
    /// Bytes per element.
    pub const fn size_bytes(self) -> usize {
        match self {
            KvDtype::F8E4M3 => 1,
            KvDtype::F16 | KvDtype::Bf16 => 2,
            KvDtype::F32 => 4,
        }
    }
    /// Stable wire code.
    pub const fn code(self) -> u8 {
        match self {
            KvDtype::F16 => 1,
            KvDtype::Bf16 => 2,
            KvDtype::F32 => 3,
            KvDtype::F8E4M3 => 4,
        }
    }
    /// Inverse of [`KvDtype::code`].
    pub const fn from_code(code: u8) -> Option<Self> {
        match code {
            1 => Some(KvDtype::F16),
            2 => Some(KvDtype::Bf16),
            3 => Some(KvDtype::F32),
            4 => Some(KvDtype::F8E4M3),
            _ => None,
        }
    }
}

impl fmt::Display for KvDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            KvDtype::F16 => "f16",
            KvDtype::Bf16 => "bf16",
            KvDtype::F32 => "f32",
            KvDtype::F8E4M3 => "f8e4m3",
        })
    }
}

/// Shape of one KV block: `block_tokens` tokens of K and V for every layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KvLayout {
    pub layers: u32,
    pub block_tokens: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    pub dtype: KvDtype,
}

impl KvLayout {
    /// SmolLM2-135M, Baton's default model: 30 layers, 3 KV heads of 64, blocks of 16 tokens.
    pub const fn smollm2_135m(dtype: KvDtype) -> Self {
        KvLayout {
            layers: 30,
            block_tokens: 16,
            kv_heads: 3,
            head_dim: 64,
            dtype,
        }
    }

    /// Checks every dimension is non-zero and one block-layer fits in a frame.
    pub fn validate(&self) -> Result<()> {
        let dims = [self.layers, self.block_tokens, self.kv_heads, self.head_dim];
        if dims.contains(&0) {
            return Err(Error::InvalidArgument {
                what: "layout dimensions must be non-zero",
            });
        }
        let bytes = 2u128
            * u128::from(self.block_tokens)
            * u128::from(self.kv_heads)
            * u128::from(self.head_dim)
            * self.dtype.size_bytes() as u128;
        if bytes > MAX_BLOCK_LAYER_BYTES as u128 {
            return Err(Error::InvalidArgument {
                what: "one block-layer exceeds the transport's maximum frame size",
            });
        }
        Ok(())
    }

    /// Bytes of K and V for one block in one layer.
    pub const fn bytes_per_block_layer(&self) -> usize {
        2 * self.block_tokens as usize
            * self.kv_heads as usize
            * self.head_dim as usize
            * self.dtype.size_bytes()
    }

    /// Bytes of one block across all layers.
    pub const fn bytes_per_block(&self) -> usize {
        self.bytes_per_block_layer() * self.layers as usize
    }

    /// KV bytes per token across all layers.
    pub const fn bytes_per_token(&self) -> usize {
        self.bytes_per_block() / self.block_tokens as usize
    }

    /// Blocks needed to hold `tokens` tokens.
    pub const fn blocks_for_tokens(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_tokens as usize)
    }
}

/// A small layout (2 layers, 16-token blocks, one 8-wide f16 head) for unit tests.
#[cfg(test)]
pub(crate) const TEST_LAYOUT: KvLayout = KvLayout { layers: 2, block_tokens: 16, kv_heads: 1, head_dim: 8, dtype: KvDtype::F16 };

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smollm2_sizes_match_the_model_facts() {
        let l = KvLayout::smollm2_135m(KvDtype::F16);
        assert_eq!(l.bytes_per_token(), 23_040);
        assert_eq!(l.bytes_per_block_layer(), 2 * 16 * 3 * 64 * 2);
        assert_eq!(l.blocks_for_tokens(150), 10);
        assert!(l.validate().is_ok());
        let bad = KvLayout { layers: 0, ..l };
        assert!(bad.validate().is_err());
    }

    #[test]
    fn dtype_codes_round_trip() {
        for d in [KvDtype::F16, KvDtype::Bf16, KvDtype::F32, KvDtype::F8E4M3] {
            assert_eq!(KvDtype::from_code(d.code()), Some(d));
        }
        assert_eq!(KvDtype::from_code(0), None);
    }
}
