//! One forward step's per-row inputs, and what a backend that replays
//! captured decode steps (the CUDA backend's graphs, `cuda/graph.rs`) needs
//! to know about them without a GPU: which steps are decode-shaped, the batch
//! bucket a step is padded to, the padding rows, and the guard that keeps
//! allocations and pageable uploads out of a capture.
//!
//! A captured step is a fixed program: the same kernels with the same
//! arguments (device addresses, grid sizes) every time it is replayed. So a
//! step that may be replayed has a fixed number of rows, a bucket (1, 2, 4, ...,
//! [`MAX_STEP_ROWS`]): the real rows first, then padding rows. A padding row
//! is a sequence of one token whose keys and values live in a block of its
//! own ([`PAD_BLOCK`], which the backend maps to a spare block of the arena
//! nobody else reads); its logits are computed and never returned. Every
//! operation of the forward pass treats rows independently (the determinism
//! contract), so a real row's bits are the same with or without padding.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

use crate::attention::AttnRow;

/// What one forward step computes.
pub struct StepInput<'a> {
    /// Token of each row.
    pub tokens: &'a [u32],
    /// Position of each row in its sequence.
    pub positions: &'a [u32],
    /// `(block, slot)` that receives each row's keys and values.
    pub slots: &'a [(u32, u32)],
    /// Block table and position of each row, for attention.
    pub attn: &'a [AttnRow<'a>],
    /// Rows whose logits are wanted, in the order they are returned.
    pub logit_rows: &'a [usize],
}

/// The block of a padding row's KV slot and block table; a backend that pads
/// maps it to a block of its own.
pub const PAD_BLOCK: u32 = u32::MAX;

/// The largest batch a decode step is captured for; larger steps run eagerly.
pub const MAX_STEP_ROWS: usize = 256;

/// The bucket a decode-shaped step of `rows` rows is padded to: the next power
/// of two, up to [`MAX_STEP_ROWS`]; `None` for an empty or larger step.
pub fn bucket(rows: usize) -> Option<usize> {
    (1..=MAX_STEP_ROWS).contains(&rows).then(|| rows.next_power_of_two())
}

/// The rows a step runs as when it may be replayed: its bucket if it is
/// decode-shaped (every row on a block table of its own, one position each,
/// as many logit rows as rows at most, every one of them a row of the step),
/// `None` otherwise (prefill chunks and mixed steps run eagerly).
pub fn decode_rows(input: &StepInput) -> Option<usize> {
    let n = input.tokens.len();
    let consistent = input.positions.len() == n && input.slots.len() == n && input.attn.len() == n;
    if !consistent || input.logit_rows.len() > n || input.logit_rows.iter().any(|&r| r >= n) {
        return None;
    }
    // A prefill chunk's rows share one table; two rows of one sequence in a step are not a decode step.
    let mut tables: Vec<*const u32> = input.attn.iter().map(|r| r.block_table.as_ptr()).collect();
    tables.sort_unstable();
    if tables.windows(2).any(|w| w[0] == w[1]) || input.attn.iter().any(|r| r.block_table.is_empty()) {
        return None;
    }
    bucket(n)
}

/// Block tables of padding rows, one each (a row's table is its own slice, so
/// no two padding rows look like one sequence's chunk).
pub fn pad_tables(n: usize) -> Vec<[u32; 1]> {
    vec![[PAD_BLOCK]; n]
}

/// A step padded to its bucket: the real rows, then padding rows (token 0 at
/// position 0 of [`PAD_BLOCK`]); the logit rows are the real ones first, then
/// others up to one per row, so the product for logits has a fixed size too.
pub struct PaddedStep<'a> {
    tokens: Vec<u32>,
    positions: Vec<u32>,
    slots: Vec<(u32, u32)>,
    attn: Vec<AttnRow<'a>>,
    logit_rows: Vec<usize>,
}

impl<'a> PaddedStep<'a> {
    /// `input` padded to `rows` rows, the padding rows on `pads` (at least
    /// `rows - input rows` of [`pad_tables`]).
    pub fn new(input: &StepInput<'a>, rows: usize, pads: &'a [[u32; 1]]) -> PaddedStep<'a> {
        let n = input.tokens.len();
        assert!(rows >= n && pads.len() >= rows - n, "padding {n} rows to {rows} with {} padding tables", pads.len());
        let extra = rows - n;
        let mut tokens = input.tokens.to_vec();
        tokens.resize(rows, 0);
        let mut positions = input.positions.to_vec();
        positions.resize(rows, 0);
        let mut slots = input.slots.to_vec();
        slots.resize(rows, (PAD_BLOCK, 0));
        let mut attn: Vec<AttnRow<'a>> = input.attn.iter().map(|r| AttnRow { block_table: r.block_table, pos: r.pos }).collect();
        attn.extend(pads[..extra].iter().map(|t| AttnRow { block_table: &t[..], pos: 0 }));
        // The wanted rows first (returned in this order), then the padding rows, then row 0 again.
        let mut logit_rows = input.logit_rows.to_vec();
        logit_rows.extend(n..rows);
        logit_rows.resize(rows, 0);
        PaddedStep { tokens, positions, slots, attn, logit_rows }
    }

    pub fn input(&self) -> StepInput<'_> {
        StepInput { tokens: &self.tokens, positions: &self.positions, slots: &self.slots, attn: &self.attn, logit_rows: &self.logit_rows }
    }
}

/// Watches a backend's allocations and uploads from ordinary (pageable) host
/// memory, neither of which may happen while a step is being captured: an
/// allocation would be recorded into the graph (or invalidate the capture),
/// and an upload from pageable memory synchronizes, which a capture forbids.
/// While armed, [`CaptureGuard::alloc`] and [`CaptureGuard::allow`] refuse
/// and remember what asked; the backend skips the operation, and the capture
/// is thrown away and the step run eagerly. The allocation counter is the
/// generation a captured graph is valid for: any allocation of a buffer a
/// graph may hold (a tensor, scratch, the arena) moves it on.
#[derive(Default)]
pub struct CaptureGuard {
    armed: AtomicBool,
    generation: AtomicU64,
    refused: Mutex<Vec<&'static str>>,
}

impl CaptureGuard {
    /// Whether an allocation for `what` may run now; counts it if so.
    pub fn alloc(&self, what: &'static str) -> bool {
        if self.refuse(what) {
            return false;
        }
        self.generation.fetch_add(1, Ordering::Relaxed);
        true
    }

    /// Whether `what` (an upload from pageable host memory, or anything else a
    /// capture cannot hold) may run now.
    pub fn allow(&self, what: &'static str) -> bool {
        !self.refuse(what)
    }

    fn refuse(&self, what: &'static str) -> bool {
        if !self.armed.load(Ordering::Relaxed) {
            return false;
        }
        self.refused.lock().unwrap_or_else(|p| p.into_inner()).push(what);
        true
    }

    /// Allocations so far: a graph captured at one generation is stale at any other.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Relaxed)
    }

    pub fn arm(&self) {
        self.refused.lock().unwrap_or_else(|p| p.into_inner()).clear();
        self.armed.store(true, Ordering::Relaxed);
    }

    pub fn armed(&self) -> bool {
        self.armed.load(Ordering::Relaxed)
    }

    /// Ends a capture; returns what was refused during it (empty: the capture is sound).
    pub fn disarm(&self) -> Vec<&'static str> {
        self.armed.store(false, Ordering::Relaxed);
        std::mem::take(&mut *self.refused.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_powers_of_two_up_to_the_largest() {
        let got: Vec<Option<usize>> = [0, 1, 2, 3, 5, 64, 65, 200, 256, 257].into_iter().map(bucket).collect();
        assert_eq!(got, [None, Some(1), Some(2), Some(4), Some(8), Some(64), Some(128), Some(256), Some(256), None]);
    }

    fn step<'a>(tokens: &'a [u32], positions: &'a [u32], slots: &'a [(u32, u32)], attn: &'a [AttnRow<'a>], logit_rows: &'a [usize]) -> StepInput<'a> {
        StepInput { tokens, positions, slots, attn, logit_rows }
    }

    #[test]
    fn only_decode_shaped_steps_are_bucketed() {
        let (a, b, c): (Vec<u32>, Vec<u32>, Vec<u32>) = (vec![3, 4], vec![7], vec![9, 10, 11]);
        let attn = [AttnRow { block_table: &a, pos: 20 }, AttnRow { block_table: &b, pos: 5 }, AttnRow { block_table: &c, pos: 40 }];
        let slots = [(4, 4), (7, 5), (11, 8)];
        assert_eq!(decode_rows(&step(&[1, 2, 3], &[20, 5, 40], &slots, &attn, &[0, 1, 2])), Some(4));
        assert_eq!(decode_rows(&step(&[1, 2, 3], &[20, 5, 40], &slots, &attn, &[2])), Some(4), "fewer logit rows");
        // A prefill chunk: two rows on one table.
        let chunk = [AttnRow { block_table: &a, pos: 19 }, AttnRow { block_table: &a, pos: 20 }];
        assert_eq!(decode_rows(&step(&[1, 2], &[19, 20], &slots[..2], &chunk, &[1])), None);
        assert_eq!(decode_rows(&step(&[1, 2, 3], &[20, 5, 40], &slots, &attn, &[0, 3])), None, "a logit row past the step");
        assert_eq!(decode_rows(&step(&[1, 2], &[20, 5, 40], &slots, &attn, &[0])), None, "inconsistent lengths");
        assert_eq!(decode_rows(&step(&[], &[], &[], &[], &[])), None);
    }

    #[test]
    fn padding_keeps_the_real_rows_first_and_fills_every_row() {
        let (a, b): (Vec<u32>, Vec<u32>) = (vec![3, 4], vec![7]);
        let attn = [AttnRow { block_table: &a, pos: 20 }, AttnRow { block_table: &b, pos: 5 }, AttnRow { block_table: &a[1..], pos: 9 }];
        let input = step(&[11, 12, 13], &[20, 5, 9], &[(4, 4), (7, 5), (4, 9)], &attn, &[2, 0]);
        let pads = pad_tables(5);
        let p = PaddedStep::new(&input, 8, &pads);
        let s = p.input();
        assert_eq!(s.tokens, [11, 12, 13, 0, 0, 0, 0, 0]);
        assert_eq!(s.positions, [20, 5, 9, 0, 0, 0, 0, 0]);
        assert_eq!(&s.slots[..3], input.slots);
        assert!(s.slots[3..].iter().all(|&s| s == (PAD_BLOCK, 0)));
        assert_eq!(s.logit_rows, [2, 0, 3, 4, 5, 6, 7, 0], "the wanted rows first, in their order");
        assert!(s.attn[3..].iter().all(|r| r.block_table == [PAD_BLOCK] && r.pos == 0));
        // Each padding row on a table of its own: the padded step is decode-shaped.
        assert_eq!(decode_rows(&s), Some(8));
    }

    #[test]
    fn the_guard_refuses_only_while_armed_and_counts_allocations() {
        let g = CaptureGuard::default();
        assert!(g.alloc("a tensor") && g.allow("indices"));
        assert_eq!(g.generation(), 1, "an allocation moves the generation; an upload does not");
        g.arm();
        assert!(!g.alloc("a tensor"), "no allocation inside a capture");
        assert!(!g.allow("rope positions"), "no pageable upload inside a capture");
        assert_eq!(g.generation(), 1, "a refused allocation allocates nothing");
        assert_eq!(g.disarm(), ["a tensor", "rope positions"]);
        assert!(g.disarm().is_empty());
        assert!(g.alloc("a tensor"));
        assert_eq!(g.generation(), 2);
    }
}
