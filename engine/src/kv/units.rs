//! The units of a grouped KV arena: which unit of memory holds each layer group of
//! each block, and which units are free.
//!
//! A model with sliding-window layers stores its layers in groups of equal size
//! (`baton_kernels::KvGroups`): some groups hold only global layers, the others only
//! window (local) layers. Every block in use holds a unit for each global group; it
//! holds units for its local groups only while some row may read them. Blocks lacking
//! them are exactly the blocks [`super::WindowRule`] lets matches skip, so the memory
//! of a long conversation's old blocks serves other blocks instead of sitting idle.
//!
//! Invariants (checked by `KvCache::assert_consistent` in tests): a unit is free or
//! mapped to exactly one (block, group); a block's global groups are mapped iff the
//! block is not free; its local groups are all mapped or all unmapped.

use baton_kernels::UNMAPPED;

use super::ids::BlockId;
use super::BlockStore;

#[derive(Debug)]
pub(crate) struct Units {
    /// Per group: holds window layers.
    local: Vec<bool>,
    local_groups: usize,
    total: usize,
    /// Free units; a stack so that recently freed units (warm in caches) go first.
    free: Vec<u32>,
    /// `map[block * groups + g]`: the unit of block `block`'s group `g`.
    map: Vec<u32>,
}

impl Units {
    /// `total` units for `blocks` blocks whose groups are local where `local[g]`.
    pub(crate) fn new(blocks: usize, total: usize, local: Vec<bool>) -> Self {
        let local_groups = local.iter().filter(|&&l| l).count();
        let map = vec![UNMAPPED; blocks * local.len()];
        Self { local, local_groups, total, free: (0..total as u32).rev().collect(), map }
    }

    fn groups(&self) -> usize {
        self.local.len()
    }

    pub(crate) fn total(&self) -> usize {
        self.total
    }

    pub(crate) fn free(&self) -> usize {
        self.free.len()
    }

    /// Units one block takes: its global groups, plus its local ones `with_local`.
    pub(crate) fn per_block(&self, with_local: bool) -> usize {
        self.groups() - if with_local { 0 } else { self.local_groups }
    }

    /// Units of the local groups of one block.
    pub(crate) fn local_per_block(&self) -> usize {
        self.local_groups
    }

    fn row(&self, block: BlockId) -> &[u32] {
        let g = self.groups();
        &self.map[block.index() * g..(block.index() + 1) * g]
    }

    /// Whether `block` holds its local groups (true when the model has none).
    pub(crate) fn has_local(&self, block: BlockId) -> bool {
        self.local.iter().zip(self.row(block)).all(|(&l, &u)| !l || u != UNMAPPED)
    }

    /// Units `block` holds now.
    pub(crate) fn held(&self, block: BlockId) -> usize {
        self.row(block).iter().filter(|&&u| u != UNMAPPED).count()
    }

    /// Maps the groups of `block` that are unmapped and wanted (global ones always,
    /// local ones `with_local`) to free units. The caller has checked that enough
    /// are free.
    pub(crate) fn take(&mut self, block: BlockId, with_local: bool, store: &mut dyn BlockStore) {
        let g = self.groups();
        for i in 0..g {
            let slot = block.index() * g + i;
            if self.map[slot] == UNMAPPED && (with_local || !self.local[i]) {
                self.map[slot] = self.free.pop().expect("the caller checked the free units");
            }
        }
        store.map(block, self.row(block));
    }

    /// Gives back the units of `block`'s local groups (`only_local`) or of all of
    /// them. Returns how many.
    pub(crate) fn give_back(&mut self, block: BlockId, only_local: bool, store: &mut dyn BlockStore) -> usize {
        let g = self.groups();
        let mut n = 0;
        for i in 0..g {
            let slot = block.index() * g + i;
            if self.map[slot] != UNMAPPED && (!only_local || self.local[i]) {
                self.free.push(self.map[slot]);
                self.map[slot] = UNMAPPED;
                n += 1;
            }
        }
        if n > 0 {
            store.map(block, self.row(block));
        }
        n
    }

    /// Audit: every unit free or mapped once; local groups all or none; `in_use(b)`
    /// says which blocks must hold their global groups.
    #[cfg(test)]
    pub(crate) fn assert_consistent(&self, in_use: impl Fn(BlockId) -> bool) {
        let mut seen = vec![0u32; self.total];
        for &u in self.map.iter().chain(&self.free) {
            if u != UNMAPPED {
                seen[u as usize] += 1;
            }
        }
        assert!(seen.iter().all(|&n| n == 1), "a unit is lost or mapped twice: {seen:?}");
        for b in 0..self.map.len() / self.groups() {
            let block = BlockId(b as u32);
            let row = self.row(block);
            let global_mapped = self.local.iter().zip(row).filter(|(&l, _)| !l).all(|(_, &u)| u != UNMAPPED);
            let global_unmapped = self.local.iter().zip(row).filter(|(&l, _)| !l).all(|(_, &u)| u == UNMAPPED);
            let local: Vec<bool> = self.local.iter().zip(row).filter(|(&l, _)| l).map(|(_, &u)| u != UNMAPPED).collect();
            assert!(local.iter().all(|&m| m == local[0]) || local.is_empty(), "{block}: local groups half mapped");
            if in_use(block) {
                assert!(global_mapped, "{block} is in use without its global groups");
            } else {
                assert!(global_unmapped && !local.iter().any(|&m| m), "free {block} holds units");
            }
        }
    }
}
