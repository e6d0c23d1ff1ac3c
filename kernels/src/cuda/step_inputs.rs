//! A replayable decode step's inputs as one array of 32-bit words: tokens,
//! positions, KV slots, the rows whose logits are gathered, and attention's
//! index arrays (`AttentionPlan::index_words`' five arrays), each at an offset
//! fixed by the step's [`StepShape`]. The host writes them into page-locked
//! memory and one asynchronous copy moves them into a device buffer whose
//! address never changes for that shape, so a graph captured once reads every
//! later step's inputs from the same places (`graph.rs`).
//!
//! The attention arrays are laid out for the shape's capacity, not the step's
//! contexts: each row's block table has a slot of [`StepLayout::table_cap`]
//! words (enough for `parts` partitions of keys) and runs are rows, one each
//! (a decode step's rows are sequences of their own). Pure host code: the
//! emulated tests run the attention kernels from these words.

use std::ops::Range;

use super::plan::ATTN_PART;
use crate::step::{StepInput, PAD_BLOCK};

/// What a captured step is captured for: its rows (a bucket of
/// `crate::step::bucket`) and the partitions of keys a row may have.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct StepShape {
    pub rows: usize,
    pub parts: usize,
}

/// The attention capacity for rows up to position `max_pos`: their partitions
/// rounded up to a power of two, so a growing context changes the shape (and
/// needs a new capture) only at 256, 512, 1,024, 2,048, 4,096, ... keys.
pub fn capacity_parts(max_pos: usize) -> usize {
    (max_pos / ATTN_PART + 1).next_power_of_two()
}

impl StepShape {
    /// The shape of a step (already padded to its bucket).
    pub fn of(input: &StepInput) -> StepShape {
        let max_pos = input.attn.iter().map(|r| r.pos).max().unwrap_or(0);
        StepShape { rows: input.tokens.len(), parts: capacity_parts(max_pos) }
    }
}

/// Where each input sits in the step's words.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepLayout {
    pub shape: StepShape,
    pub block_tokens: usize,
    /// Words of one row's block table: enough blocks for `parts` partitions.
    pub table_cap: usize,
    pub tokens: Range<usize>,
    /// Rope's positions, and attention's (the same array).
    pub positions: Range<usize>,
    /// `(block, slot)` pairs, flattened (`kv_write`'s words).
    pub slots: Range<usize>,
    /// `gather_rows`' row indices.
    pub logit_rows: Range<usize>,
    pub tables: Range<usize>,
    pub offsets: Range<usize>,
    pub run_start: Range<usize>,
    pub run_len: Range<usize>,
    /// Words in all.
    pub words: usize,
}

impl StepLayout {
    pub fn new(shape: StepShape, block_tokens: usize) -> StepLayout {
        assert!(block_tokens > 0 && shape.rows > 0 && shape.parts > 0, "an empty step shape");
        let table_cap = (shape.parts * ATTN_PART).div_ceil(block_tokens);
        let rows = shape.rows;
        let mut at = 0;
        let mut take = |n: usize| {
            at += n;
            at - n..at
        };
        let (tokens, positions, slots, logit_rows) = (take(rows), take(rows), take(2 * rows), take(rows));
        let (tables, offsets, run_start, run_len) = (take(rows * table_cap), take(rows), take(rows), take(rows));
        StepLayout { shape, block_tokens, table_cap, tokens, positions, slots, logit_rows, tables, offsets, run_start, run_len, words: at }
    }

    /// Attention's five arrays in `AttentionPlan::index_words` order: tables,
    /// offsets, positions, run starts, run lengths.
    pub fn attention_ranges(&self) -> [Range<usize>; 5] {
        [self.tables.clone(), self.offsets.clone(), self.positions.clone(), self.run_start.clone(), self.run_len.clone()]
    }

    /// Writes `input` (of this shape) into `out` (`words` long): [`PAD_BLOCK`]
    /// becomes `spare`, the arena's block for padding rows. Checks what the
    /// kernels would otherwise index out of bounds with (blocks below
    /// `kv_blocks`, slots within a block, a table long enough for its position,
    /// positions within the capacity, logit rows within the step); a step that
    /// fails runs eagerly, whose own checks name the fault.
    pub fn fill(&self, input: &StepInput, kv_blocks: usize, spare: u32, out: &mut [u32]) -> Result<(), String> {
        let rows = self.shape.rows;
        if input.tokens.len() != rows || input.positions.len() != rows || input.slots.len() != rows || input.attn.len() != rows || input.logit_rows.len() != rows {
            return Err(format!("a step of {} rows for a shape of {rows}", input.tokens.len()));
        }
        assert_eq!(out.len(), self.words, "step words");
        let block = |b: u32| -> Result<u32, String> {
            match b {
                PAD_BLOCK => Ok(spare),
                b if (b as usize) < kv_blocks => Ok(b),
                b => Err(format!("block {b} past the arena's {kv_blocks}")),
            }
        };
        out[self.tokens.clone()].copy_from_slice(input.tokens);
        out[self.positions.clone()].copy_from_slice(input.positions);
        for (o, &(b, s)) in out[self.slots.clone()].chunks_exact_mut(2).zip(input.slots) {
            if s as usize >= self.block_tokens {
                return Err(format!("slot {s} past a block of {} tokens", self.block_tokens));
            }
            o.copy_from_slice(&[block(b)?, s]);
        }
        for (o, &r) in out[self.logit_rows.clone()].iter_mut().zip(input.logit_rows) {
            if r >= rows {
                return Err(format!("logit row {r} past the step's {rows}"));
            }
            *o = r as u32;
        }
        let capacity = self.shape.parts * ATTN_PART;
        for (r, row) in input.attn.iter().enumerate() {
            let needed = row.pos / self.block_tokens + 1;
            if row.pos >= capacity || row.pos != input.positions[r] as usize {
                return Err(format!("row {r} at position {} in a step of capacity {capacity}", row.pos));
            }
            if row.block_table.len() < needed {
                return Err(format!("row {r} at position {} has {} blocks", row.pos, row.block_table.len()));
            }
            let slot = &mut out[self.tables.start + r * self.table_cap..][..self.table_cap];
            for (o, &b) in slot.iter_mut().zip(&row.block_table[..needed]) {
                *o = block(b)?;
            }
            slot[needed..].fill(spare);
            out[self.offsets.start + r] = (r * self.table_cap) as u32;
            out[self.run_start.start + r] = r as u32;
            out[self.run_len.start + r] = 1;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention::AttnRow;
    use crate::step::{pad_tables, PaddedStep};

    #[test]
    fn capacity_grows_in_powers_of_two_partitions() {
        let got: Vec<usize> = [0, 255, 256, 511, 512, 767, 1023, 1024, 2999, 4095, 4096].into_iter().map(capacity_parts).collect();
        assert_eq!(got, [1, 1, 2, 2, 4, 4, 4, 8, 16, 16, 32]);
    }

    #[test]
    fn a_padded_step_lays_out_at_fixed_offsets() {
        let (a, b): (Vec<u32>, Vec<u32>) = ((10..30).collect(), vec![5, 6]);
        let attn = [AttnRow { block_table: &a, pos: 300 }, AttnRow { block_table: &b, pos: 17 }];
        let input = StepInput { tokens: &[7, 8], positions: &[300, 17], slots: &[(28, 12), (6, 1)], attn: &attn, logit_rows: &[1, 0] };
        let pads = pad_tables(2);
        let padded = PaddedStep::new(&input, 4, &pads);
        let step = padded.input();
        let shape = StepShape::of(&step);
        assert_eq!(shape, StepShape { rows: 4, parts: 2 });
        let l = StepLayout::new(shape, 16);
        assert_eq!(l.table_cap, 32, "two partitions of 256 keys in blocks of 16");
        assert_eq!((l.tokens.clone(), l.positions.clone(), l.slots.clone(), l.logit_rows.clone()), (0..4, 4..8, 8..16, 16..20));
        assert_eq!((l.tables.clone(), l.offsets.clone(), l.run_start.clone(), l.run_len.clone()), (20..148, 148..152, 152..156, 156..160));
        assert_eq!(l.words, 160);
        let mut w = vec![0u32; l.words];
        l.fill(&step, 40, 40, &mut w).unwrap();
        assert_eq!(w[l.tokens.clone()], [7, 8, 0, 0]);
        assert_eq!(w[l.slots.clone()], [28, 12, 6, 1, 40, 0, 40, 0], "padding rows write the spare block");
        assert_eq!(w[l.logit_rows.clone()], [1, 0, 2, 3]);
        assert_eq!(w[l.tables.start..l.tables.start + 20], a[..19].iter().copied().chain([40]).collect::<Vec<_>>(), "the blocks a row needs, then spare");
        assert_eq!(w[l.tables.start + 32..l.tables.start + 34], [5, 6]);
        assert_eq!(w[l.tables.start + 64], 40, "a padding row's table is the spare block");
        assert_eq!(w[l.offsets.clone()], [0, 32, 64, 96]);
        assert_eq!((w[l.run_start.clone()].to_vec(), w[l.run_len.clone()].to_vec()), (vec![0, 1, 2, 3], vec![1; 4]));

        // The next step of the same shape writes the same places.
        let attn = [AttnRow { block_table: &a, pos: 301 }, AttnRow { block_table: &b, pos: 18 }];
        let next = StepInput { tokens: &[9, 3], positions: &[301, 18], slots: &[(28, 13), (6, 2)], attn: &attn, logit_rows: &[1, 0] };
        let padded = PaddedStep::new(&next, 4, &pads);
        assert_eq!(StepShape::of(&padded.input()), shape);
        l.fill(&padded.input(), 40, 40, &mut w).unwrap();
        assert_eq!(w[l.tokens.clone()], [9, 3, 0, 0]);
    }

    #[test]
    fn a_step_that_does_not_fit_is_refused() {
        let a: Vec<u32> = (0..40).collect();
        let attn = [AttnRow { block_table: &a, pos: 600 }];
        let l = StepLayout::new(StepShape { rows: 1, parts: 2 }, 16);
        let mut w = vec![0u32; l.words];
        let fill = |tokens: &[u32], positions: &[u32], slots: &[(u32, u32)], attn: &[AttnRow], w: &mut [u32]| {
            l.fill(&StepInput { tokens, positions, slots, attn, logit_rows: &[0] }, 40, 40, w)
        };
        assert!(fill(&[1], &[600], &[(37, 8)], &attn, &mut w).unwrap_err().contains("capacity"), "position past the capacity");
        let attn = [AttnRow { block_table: &a, pos: 500 }];
        assert!(fill(&[1], &[500], &[(41, 4)], &attn, &mut w).unwrap_err().contains("past the arena"));
        assert!(fill(&[1], &[500], &[(31, 16)], &attn, &mut w).unwrap_err().contains("slot 16"));
        let short = [AttnRow { block_table: &a[..3], pos: 500 }];
        assert!(fill(&[1], &[500], &[(2, 4)], &short, &mut w).unwrap_err().contains("has 3 blocks"));
        assert!(fill(&[1, 2], &[500], &[(31, 4)], &attn, &mut w).is_err(), "two tokens for one row");
        fill(&[1], &[500], &[(31, 4)], &attn, &mut w).unwrap();
    }
}
