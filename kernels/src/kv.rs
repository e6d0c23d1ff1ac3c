//! The paged KV arena: fixed-size blocks of keys and values for all layers.
//!
//! Layout of one block: for each layer, the keys of its `block_tokens` slots
//! then their values, each slot holding `kv_heads x head_dim` elements. One
//! block's data for one layer is therefore contiguous, which is what the
//! transport ships layer by layer.

use half::{bf16, f16, slice::{HalfBitsSliceExt, HalfFloatSliceExt}};

/// Element type of stored keys and values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvDtype {
    F32,
    F16,
    BF16,
    /// FP8 E4M3 (see [`crate::fp8`]): half the bytes of f16, for twice the tokens per GiB.
    F8E4M3,
}

impl KvDtype {
    pub fn bytes(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::F16 | KvDtype::BF16 => 2,
            KvDtype::F8E4M3 => 1,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
            KvDtype::BF16 => "bf16",
            KvDtype::F8E4M3 => "f8e4m3",
        }
    }
}

/// Shape of the KV arena.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvLayout {
    pub layers: usize,
    pub block_tokens: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub dtype: KvDtype,
}

impl KvLayout {
    /// Elements of one token's keys (or values) in one layer.
    pub fn token_elems(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Elements of one block in one layer (keys and values).
    pub fn block_layer_elems(&self) -> usize {
        2 * self.block_tokens * self.token_elems()
    }

    /// Elements of one block across all layers.
    pub fn block_elems(&self) -> usize {
        self.layers * self.block_layer_elems()
    }

    pub fn block_bytes(&self) -> usize {
        self.block_elems() * self.dtype.bytes()
    }

    pub fn block_layer_bytes(&self) -> usize {
        self.block_layer_elems() * self.dtype.bytes()
    }

    /// KV bytes per token: 2 x layers x kv_heads x head_dim x element size.
    pub fn bytes_per_token(&self) -> usize {
        2 * self.layers * self.token_elems() * self.dtype.bytes()
    }
}

enum KvData {
    F32(Vec<f32>),
    /// f16 or bf16 bits, per `KvLayout::dtype`.
    Half(Vec<u16>),
    /// FP8 E4M3 bytes.
    Byte(Vec<u8>),
}

/// Host memory holding `num_blocks` KV blocks.
pub struct KvStorage {
    pub layout: KvLayout,
    pub num_blocks: usize,
    data: KvData,
}

impl KvStorage {
    /// Allocates zeroed storage. The caller has already checked the size
    /// against its memory budget.
    pub fn new(layout: KvLayout, num_blocks: usize) -> Self {
        let n = layout.block_elems() * num_blocks;
        let data = match layout.dtype {
            KvDtype::F32 => KvData::F32(vec![0.0; n]),
            KvDtype::F16 | KvDtype::BF16 => KvData::Half(vec![0; n]),
            KvDtype::F8E4M3 => KvData::Byte(vec![0; n]),
        };
        KvStorage { layout, num_blocks, data }
    }

    #[inline]
    fn base(&self, block: usize, layer: usize) -> usize {
        (block * self.layout.layers + layer) * self.layout.block_layer_elems()
    }

    /// Stores one token's keys and values (`kv_heads x head_dim` each) of one
    /// layer into slot `slot` of `block`.
    pub fn write_token(&mut self, layer: usize, block: usize, slot: usize, k: &[f32], v: &[f32]) {
        let te = self.layout.token_elems();
        let kb = self.base(block, layer) + slot * te;
        let vb = kb + self.layout.block_tokens * te;
        match &mut self.data {
            KvData::F32(d) => {
                d[kb..kb + te].copy_from_slice(&k[..te]);
                d[vb..vb + te].copy_from_slice(&v[..te]);
            }
            KvData::Half(d) => match self.layout.dtype {
                KvDtype::F16 => {
                    d[kb..kb + te].reinterpret_cast_mut::<f16>().convert_from_f32_slice(&k[..te]);
                    d[vb..vb + te].reinterpret_cast_mut::<f16>().convert_from_f32_slice(&v[..te]);
                }
                _ => {
                    d[kb..kb + te].reinterpret_cast_mut::<bf16>().convert_from_f32_slice(&k[..te]);
                    d[vb..vb + te].reinterpret_cast_mut::<bf16>().convert_from_f32_slice(&v[..te]);
                }
            },
            KvData::Byte(d) => {
                crate::fp8::encode_slice(&k[..te], &mut d[kb..kb + te]);
                crate::fp8::encode_slice(&v[..te], &mut d[vb..vb + te]);
            }
        }
    }

    /// Keys (`which == 0`) or values (`1`) of the first `n` slots of `block`
    /// in `layer`, converted to f32 into `out` (`n x kv_heads x head_dim`).
    pub fn read_slots(&self, layer: usize, block: usize, which: usize, n: usize, out: &mut [f32]) {
        let te = self.layout.token_elems();
        let b = self.base(block, layer) + which * self.layout.block_tokens * te;
        let len = n * te;
        match &self.data {
            KvData::F32(d) => out[..len].copy_from_slice(&d[b..b + len]),
            KvData::Half(d) => match self.layout.dtype {
                KvDtype::F16 => d[b..b + len].reinterpret_cast::<f16>().convert_to_f32_slice(&mut out[..len]),
                _ => d[b..b + len].reinterpret_cast::<bf16>().convert_to_f32_slice(&mut out[..len]),
            },
            KvData::Byte(d) => crate::fp8::decode_slice(&d[b..b + len], &mut out[..len]),
        }
    }

    /// Raw bytes of one block in one layer (little-endian elements).
    pub fn block_layer_bytes(&self, block: usize, layer: usize) -> &[u8] {
        let b = self.base(block, layer);
        let n = self.layout.block_layer_elems();
        match &self.data {
            KvData::F32(d) => as_bytes(&d[b..b + n]),
            KvData::Half(d) => as_bytes(&d[b..b + n]),
            KvData::Byte(d) => &d[b..b + n],
        }
    }

    /// Overwrites one block in one layer from raw bytes.
    pub fn set_block_layer_bytes(&mut self, block: usize, layer: usize, bytes: &[u8]) {
        let b = self.base(block, layer);
        let n = self.layout.block_layer_elems();
        match &mut self.data {
            KvData::F32(d) => as_bytes_mut(&mut d[b..b + n]).copy_from_slice(bytes),
            KvData::Half(d) => as_bytes_mut(&mut d[b..b + n]).copy_from_slice(bytes),
            KvData::Byte(d) => d[b..b + n].copy_from_slice(bytes),
        }
    }

    /// Copies a whole block (all layers) out as bytes.
    pub fn copy_block_out(&self, block: usize, out: &mut [u8]) {
        let lb = self.layout.block_layer_bytes();
        for l in 0..self.layout.layers {
            out[l * lb..(l + 1) * lb].copy_from_slice(self.block_layer_bytes(block, l));
        }
    }

    /// Overwrites a whole block (all layers) from bytes.
    pub fn copy_block_in(&mut self, block: usize, data: &[u8]) {
        let lb = self.layout.block_layer_bytes();
        for l in 0..self.layout.layers {
            self.set_block_layer_bytes(block, l, &data[l * lb..(l + 1) * lb]);
        }
    }
}

impl KvStorage {
    pub(crate) fn raw(&self) -> crate::attention::Raw<'_> {
        match &self.data {
            KvData::F32(d) => crate::attention::Raw::F32(d),
            KvData::Half(d) => crate::attention::Raw::Half(d),
            KvData::Byte(d) => crate::attention::Raw::Byte(d),
        }
    }
}

fn as_bytes<T: Copy>(s: &[T]) -> &[u8] {
    // SAFETY: f32 and u16 have no padding and any byte pattern is valid u8.
    unsafe { std::slice::from_raw_parts(s.as_ptr() as *const u8, std::mem::size_of_val(s)) }
}

fn as_bytes_mut<T: Copy>(s: &mut [T]) -> &mut [u8] {
    // SAFETY: every byte pattern is a valid f32 or u16.
    unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr() as *mut u8, std::mem::size_of_val(s)) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_read_round_trip_each_dtype() {
        for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::BF16, KvDtype::F8E4M3] {
            let layout = KvLayout { layers: 2, block_tokens: 4, kv_heads: 2, head_dim: 8, dtype };
            let mut s = KvStorage::new(layout, 3);
            let k: Vec<f32> = (0..16).map(|i| i as f32 * 0.5).collect();
            let v: Vec<f32> = (0..16).map(|i| -(i as f32)).collect();
            s.write_token(1, 2, 3, &k, &v);
            let mut out = vec![0f32; 4 * 16];
            s.read_slots(1, 2, 0, 4, &mut out);
            assert_eq!(&out[48..64], &k[..]);
            s.read_slots(1, 2, 1, 4, &mut out);
            assert_eq!(&out[48..64], &v[..]);
            let mut bytes = vec![0u8; layout.block_bytes()];
            s.copy_block_out(2, &mut bytes);
            s.copy_block_in(0, &bytes);
            s.read_slots(1, 0, 1, 4, &mut out);
            assert_eq!(&out[48..64], &v[..]);
        }
    }
}
