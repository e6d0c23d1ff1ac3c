//! How the KV memory budget becomes an arena: plain (every block holds every layer)
//! or grouped (a model with sliding-window layers: a block holds its window layers
//! only while a row may read them, see `crate::kv::KvCache::with_units`).
//!
//! A grouped arena stores the layers in groups of `k` layers, `k` the greatest common
//! divisor of the global and the window layer counts, so that every group is one size
//! and any unit of memory can serve any group of any block (Gemma 3 270M: 3 global and
//! 15 window layers, six groups of three). A sequence of `n` blocks then needs `n`
//! units per global group but, per window group, units only for the blocks a row can
//! still read: the largest window plus one step's tokens, and two blocks of slack for
//! the block boundaries.

use baton_kernels::{KvGroups, KvLayout};

/// The arena's shape for one KV memory budget.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ArenaPlan {
    /// Block IDs of the pool.
    pub blocks: usize,
    /// `None`: a plain arena of `blocks` blocks.
    pub grouped: Option<Grouped>,
    block_tokens: usize,
    block_bytes: usize,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Grouped {
    /// Units of `groups.group_layers()` layers of one block.
    pub units: usize,
    pub groups: KvGroups,
    /// Per group: holds window layers.
    pub local: Vec<bool>,
    /// Units of a block's global groups, and of its window groups.
    global_units: usize,
    local_units: usize,
    /// Blocks whose window layers one sequence holds at most: its largest window and
    /// one step's tokens, plus two.
    window_blocks: usize,
    unit_bytes: usize,
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

impl ArenaPlan {
    /// The arena for `memory` bytes: grouped when some layer has a window and
    /// `grouped_ok` (the backend has a grouped arena), else plain. `step_tokens`: the
    /// most tokens one step computes.
    pub fn new(layout: KvLayout, windows: &[Option<usize>], memory: usize, step_tokens: usize, grouped_ok: bool) -> Self {
        let bt = layout.block_tokens;
        let plain = Self { blocks: memory / layout.block_bytes(), grouped: None, block_tokens: bt, block_bytes: layout.block_bytes() };
        let n_local = windows.iter().filter(|w| w.is_some()).count();
        let n_global = windows.len() - n_local;
        if !grouped_ok || n_local == 0 || windows.len() != layout.layers {
            return plain;
        }
        let k = gcd(n_global, n_local);
        let (mut seen_global, mut seen_local) = (0, 0);
        let group_of: Vec<usize> = windows
            .iter()
            .map(|w| match w {
                None => {
                    seen_global += 1;
                    (seen_global - 1) / k
                }
                Some(_) => {
                    seen_local += 1;
                    n_global / k + (seen_local - 1) / k
                }
            })
            .collect();
        let Ok(groups) = KvGroups::new(&group_of) else { return plain };
        let local: Vec<bool> = (0..groups.groups()).map(|g| g >= n_global / k).collect();
        let unit_bytes = k * layout.block_layer_bytes();
        // One more unit stays zero: where unmapped groups read.
        let units = (memory / unit_bytes).saturating_sub(1);
        let (global_units, local_units) = (n_global / k, n_local / k);
        let max_window = windows.iter().flatten().copied().max().unwrap_or(0);
        let window_blocks = (max_window + step_tokens).div_ceil(bt) + 2;
        // With no global layer a block whose window layers are given back holds no
        // memory at all; its ID is still bounded, by the units.
        let blocks = units.checked_div(global_units).unwrap_or(units);
        Self {
            blocks,
            grouped: Some(Grouped { units, groups, local, global_units, local_units, window_blocks, unit_bytes }),
            block_tokens: bt,
            block_bytes: layout.block_bytes(),
        }
    }

    /// Bytes of one unit, for a grouped arena.
    pub fn unit_bytes(&self) -> Option<usize> {
        self.grouped.as_ref().map(|g| g.unit_bytes)
    }

    /// Bytes of the arena (without the grouped arena's zero unit).
    pub fn arena_bytes(&self) -> usize {
        match &self.grouped {
            None => self.blocks * self.block_bytes,
            Some(g) => g.units * g.unit_bytes,
        }
    }

    /// Bytes one sequence of `tokens` tokens holds at most.
    pub fn bytes_for(&self, tokens: usize) -> usize {
        let n = tokens.div_ceil(self.block_tokens);
        match &self.grouped {
            None => n * self.block_bytes,
            Some(g) => (n * g.global_units + n.min(g.window_blocks) * g.local_units) * g.unit_bytes,
        }
    }

    /// Whether one sequence of `tokens` tokens fits the arena alone.
    pub fn fits(&self, tokens: usize) -> bool {
        let n = tokens.div_ceil(self.block_tokens);
        n <= self.blocks
            && match &self.grouped {
                None => true,
                Some(g) => n * g.global_units + n.min(g.window_blocks) * g.local_units <= g.units,
            }
    }

    /// The longest sequence that fits the arena alone, in whole blocks of tokens.
    pub fn context_fits(&self) -> usize {
        let n = match &self.grouped {
            None => self.blocks,
            Some(g) => {
                // `n` blocks take n x global + min(n, window_blocks) x local units.
                let whole = g.units / (g.global_units + g.local_units).max(1);
                if whole < g.window_blocks {
                    whole // every block of it within the window
                } else {
                    // Without global layers, blocks behind the window take nothing.
                    (g.units - g.window_blocks * g.local_units).checked_div(g.global_units).unwrap_or(self.blocks)
                }
            }
        };
        n.min(self.blocks) * self.block_tokens
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use baton_kernels::KvDtype;

    fn layout(layers: usize) -> KvLayout {
        KvLayout { layers, block_tokens: 16, kv_heads: 1, head_dim: 256, dtype: KvDtype::F16 }
    }

    /// Gemma 3 270M: five window layers (512) then a global one, three times.
    fn gemma() -> Vec<Option<usize>> {
        (0..18).map(|l| if l % 6 == 5 { None } else { Some(512) }).collect()
    }

    #[test]
    fn gemma_groups_three_layers_and_holds_only_the_window() {
        let l = layout(18);
        let unit = 3 * l.block_layer_bytes();
        let p = ArenaPlan::new(l, &gemma(), 1001 * unit, 512, true);
        let g = p.grouped.as_ref().unwrap();
        assert_eq!((g.units, g.groups.groups(), g.groups.group_layers()), (1000, 6, 3));
        assert_eq!(g.local, vec![false, true, true, true, true, true]);
        // The global layers 5, 11, 17 share group 0; layer 0 is in group 1.
        assert_eq!((g.groups.group_of(5), g.groups.group_of(17), g.groups.group_of(0), g.groups.group_of(16)), (0, 0, 1, 5));
        assert_eq!(p.blocks, 1000);
        // 64 + 32 + 2 blocks of window layers at most: 98 x 5 units, the rest global.
        assert_eq!(g.window_blocks, 66);
        assert_eq!(p.context_fits(), (1000 - 66 * 5) * 16);
        assert!(p.fits(p.context_fits()) && !p.fits(p.context_fits() + 16));
        // Short sequences pay for every layer.
        assert_eq!(p.bytes_for(160), 10 * 6 * unit);
        assert_eq!(p.bytes_for(32768), (2048 + 66 * 5) * unit);
    }

    #[test]
    fn without_windows_or_a_grouped_backend_the_arena_is_plain() {
        let l = layout(4);
        let p = ArenaPlan::new(l, &[None; 4], 10 * l.block_bytes(), 512, true);
        assert_eq!((p.blocks, p.grouped.is_none(), p.context_fits()), (10, true, 160));
        let p = ArenaPlan::new(layout(18), &gemma(), 10 * layout(18).block_bytes(), 512, false);
        assert_eq!((p.blocks, p.grouped.is_none()), (10, true));
        assert!(p.fits(160) && !p.fits(161));
    }

    #[test]
    fn uneven_and_all_window_layers_group_by_their_gcd() {
        // Gemma 3 1B's pattern at 26 layers: 4 global, 22 window: groups of two.
        let w: Vec<Option<usize>> = (0..26).map(|l| if l % 6 == 5 { None } else { Some(512) }).collect();
        let p = ArenaPlan::new(layout(26), &w, 1 << 30, 512, true);
        let g = p.grouped.unwrap();
        assert_eq!((g.groups.group_layers(), g.global_units, g.local_units), (2, 2, 11));
        // Every layer windowed (Mistral): one group; old blocks hold nothing.
        let p = ArenaPlan::new(layout(4), &[Some(64); 4], 201 * 4 * layout(4).block_layer_bytes(), 64, true);
        let g = p.grouped.as_ref().unwrap();
        assert_eq!((g.groups.groups(), g.global_units, p.blocks), (1, 0, 200));
        assert_eq!(p.context_fits(), 200 * 16);
        assert!(p.fits(200 * 16));
    }
}
