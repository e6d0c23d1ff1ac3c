//! The paged KV arena: fixed-size blocks of keys and values for all layers.
//!
//! Layout of one block in one layer: the keys of its `block_tokens` slots then
//! their values, each slot holding `kv_heads x head_dim` elements, so one block's
//! data for one layer is contiguous, which is what the transport ships layer by
//! layer.
//!
//! The layers are stored in *groups* of equal size, and the memory of a block's
//! group is a *unit* of the arena that the block is mapped to. A plain arena
//! ([`KvStorage::new`]) has one group of all layers and maps block `b` to unit `b`.
//! A grouped arena ([`KvStorage::grouped`]) puts a model's sliding-window layers
//! and its global layers in different groups and starts with nothing mapped: the
//! caller (the engine's block accounting) maps each block's groups to units and
//! unmaps the window layers' units of a block no row will read again, so that
//! memory serves other blocks. An unmapped group reads as zeros and ignores
//! writes.

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

/// A block group with no unit: reads as zeros, ignores writes.
pub const UNMAPPED: u32 = u32::MAX;

/// How an arena's layers are grouped (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvGroups {
    /// Per layer: its group and its place in the group.
    place: Vec<(usize, usize)>,
    groups: usize,
    /// Layers per group (every group has as many).
    group_layers: usize,
}

impl KvGroups {
    /// One group of all `layers` layers: the plain layout.
    pub fn single(layers: usize) -> Self {
        Self { place: (0..layers).map(|l| (0, l)).collect(), groups: 1, group_layers: layers.max(1) }
    }

    /// `group_of[l]`: layer `l`'s group, `0..groups`; every group must have as many
    /// layers (a unit has one size). Within a group, layers keep their order.
    pub fn new(group_of: &[usize]) -> Result<Self, String> {
        let groups = group_of.iter().max().map_or(0, |&g| g + 1);
        let mut count = vec![0usize; groups];
        let place = group_of
            .iter()
            .map(|&g| {
                count[g] += 1;
                (g, count[g] - 1)
            })
            .collect();
        let group_layers = count.first().copied().unwrap_or(0);
        if groups == 0 || count.iter().any(|&c| c != group_layers) {
            return Err(format!("KV layer groups must be non-empty and of one size, got {count:?} layers per group"));
        }
        Ok(Self { place, groups, group_layers })
    }

    /// Number of groups (units per block when every group is mapped).
    pub fn groups(&self) -> usize {
        self.groups
    }

    /// Layers in each group.
    pub fn group_layers(&self) -> usize {
        self.group_layers
    }

    /// Layer `layer`'s group.
    pub fn group_of(&self, layer: usize) -> usize {
        self.place[layer].0
    }
}

/// Host memory holding `num_blocks` KV blocks.
pub struct KvStorage {
    pub layout: KvLayout,
    pub num_blocks: usize,
    groups: KvGroups,
    /// Units of the arena (each `group_layers` layers of one block), plus one more
    /// that stays zero: where unmapped groups read.
    units: usize,
    /// `unit_of[block * groups + group]`: the unit holding that group of the block.
    unit_of: Vec<u32>,
    data: KvData,
}

impl KvStorage {
    /// Allocates zeroed storage with one group of all layers, block `b` in unit `b`.
    /// The caller has already checked the size against its memory budget.
    pub fn new(layout: KvLayout, num_blocks: usize) -> Self {
        let mut s = Self::grouped(layout, num_blocks, num_blocks, KvGroups::single(layout.layers));
        s.unit_of = (0..num_blocks as u32).collect();
        s
    }

    /// Allocates zeroed storage of `units` units of `groups.group_layers()` layers,
    /// for blocks `0..num_blocks`, none of them mapped yet ([`KvStorage::map`]).
    pub fn grouped(layout: KvLayout, num_blocks: usize, units: usize, groups: KvGroups) -> Self {
        assert_eq!(groups.place.len(), layout.layers, "one group per layer");
        let n = layout.block_layer_elems() * groups.group_layers * (units + 1);
        let data = match layout.dtype {
            KvDtype::F32 => KvData::F32(vec![0.0; n]),
            KvDtype::F16 | KvDtype::BF16 => KvData::Half(vec![0; n]),
            KvDtype::F8E4M3 => KvData::Byte(vec![0; n]),
        };
        let unit_of = vec![UNMAPPED; num_blocks * groups.groups];
        KvStorage { layout, num_blocks, groups, units, unit_of, data }
    }

    /// The arena's layer groups.
    pub fn groups(&self) -> &KvGroups {
        &self.groups
    }

    /// Maps `block`'s groups: `units[g]` holds group `g` ([`UNMAPPED`]: none). A unit
    /// newly mapped keeps whatever it held; the caller writes before it reads.
    pub fn map(&mut self, block: usize, units: &[u32]) {
        let g = self.groups.groups;
        assert_eq!(units.len(), g, "one unit per group");
        assert!(units.iter().all(|&u| u == UNMAPPED || (u as usize) < self.units), "unit out of range");
        self.unit_of[block * g..(block + 1) * g].copy_from_slice(units);
    }

    /// Where `block`'s data of `layer` starts, and whether it is mapped (an unmapped
    /// group points at the zero unit).
    #[inline]
    fn locate(&self, block: usize, layer: usize) -> (usize, bool) {
        let (g, i) = self.groups.place[layer];
        let u = self.unit_of[block * self.groups.groups + g];
        let mapped = u != UNMAPPED;
        let unit = if mapped { u as usize } else { self.units };
        ((unit * self.groups.group_layers + i) * self.layout.block_layer_elems(), mapped)
    }

    #[inline]
    pub(crate) fn base(&self, block: usize, layer: usize) -> usize {
        self.locate(block, layer).0
    }

    /// Stores one token's keys and values (`kv_heads x head_dim` each) of one
    /// layer into slot `slot` of `block` (nothing when that layer is unmapped).
    pub fn write_token(&mut self, layer: usize, block: usize, slot: usize, k: &[f32], v: &[f32]) {
        let te = self.layout.token_elems();
        let (base, mapped) = self.locate(block, layer);
        if !mapped {
            return;
        }
        let kb = base + slot * te;
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

    /// Overwrites one block in one layer from raw bytes (nothing when that layer
    /// is unmapped).
    pub fn set_block_layer_bytes(&mut self, block: usize, layer: usize, bytes: &[u8]) {
        let (b, mapped) = self.locate(block, layer);
        if !mapped {
            return;
        }
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

    /// A grouped arena reads and writes each layer where its group's unit is, reads
    /// zeros where a group is unmapped, ignores writes there, and copies a block out
    /// and in group by group as a plain arena does.
    #[test]
    fn grouped_arena_maps_groups_to_units() {
        let layout = KvLayout { layers: 4, block_tokens: 2, kv_heads: 1, head_dim: 4, dtype: KvDtype::F16 };
        // Layers 0 and 2 local (group 1), 1 and 3 global (group 0).
        let groups = KvGroups::new(&[1, 0, 1, 0]).unwrap();
        assert!(KvGroups::new(&[0, 0, 1]).is_err(), "groups of unequal size");
        let mut g = KvStorage::grouped(layout, 3, 4, groups);
        let mut plain = KvStorage::new(layout, 3);
        g.map(2, &[3, 0]);
        g.map(1, &[1, UNMAPPED]);
        let k = [1.0f32, 2.0, 3.0, 4.0];
        let v = [-1.0f32, -2.0, -3.0, -4.0];
        for layer in 0..4 {
            for block in [1, 2] {
                g.write_token(layer, block, 1, &k, &v);
                plain.write_token(layer, block, 1, &k, &v);
            }
        }
        let mut out = [0f32; 8];
        for layer in 0..4 {
            g.read_slots(layer, 2, 1, 2, &mut out);
            assert_eq!(out[4..], v, "block 2 layer {layer}");
            g.read_slots(layer, 1, 0, 2, &mut out);
            // Block 1's local group is unmapped: zeros, the write went nowhere.
            let want = if layer % 2 == 0 { [0.0; 4] } else { k };
            assert_eq!(out[4..], want, "block 1 layer {layer}");
        }
        let mut a = vec![0u8; layout.block_bytes()];
        let mut b = vec![0u8; layout.block_bytes()];
        g.copy_block_out(2, &mut a);
        plain.copy_block_out(2, &mut b);
        assert_eq!(a, b, "a fully mapped block copies out like the plain arena's");
        // Unmapping a group and mapping another unit: nothing of block 2 moved.
        g.map(0, &[2, 1]);
        g.copy_block_in(0, &b);
        g.copy_block_out(0, &mut a);
        assert_eq!(a, b);
        g.read_slots(0, 2, 0, 2, &mut out);
        assert_eq!(out[4..], k);
    }
}
