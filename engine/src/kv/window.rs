//! Sliding-window layers and the KV blocks they no longer read.
//!
//! A block holds every layer of its tokens. A local layer with window `W` reads, for a
//! row at position `p`, only positions `p + 1 - W..=p` (the attention kernel skips the
//! blocks wholly before that), so once a sequence continues from position `next`, the
//! leading blocks that end at or before `next + 1 - W` are never read by that layer
//! again. Those slices need not travel: a receiver asks not to get them (the transport's
//! per-layer skip) and keeps zeros there, and the block is marked as lacking its local
//! layers (in the prefix cache's entry, both tiers).
//!
//! Invariant (what keeps results bit-identical): a block that lacks its local layers is
//! only ever read by rows that skip it, because
//! - [`WindowRule::unread_blocks`] is the one rule for what a receiver skips, and
//!   [`WindowRule::partial_blocks`] marks at least every block it skipped;
//! - [`WindowRule::usable_prefix`] cuts every prefix-cache match so that the first row
//!   computed after it starts past every local window that would reach a marked block;
//!   later rows only move the windows forward.

/// The per-layer windows of a model over blocks of `block_tokens` tokens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WindowRule {
    block_tokens: usize,
    windows: Vec<Option<usize>>,
}

impl WindowRule {
    /// `windows[l]`: layer `l`'s sliding window (`None`: a global layer).
    pub fn new(block_tokens: usize, windows: Vec<Option<usize>>) -> Self {
        Self { block_tokens: block_tokens.max(1), windows }
    }

    /// Layers with a window.
    pub fn local_layers(&self) -> usize {
        self.windows.iter().filter(|w| w.is_some()).count()
    }

    /// Whether any layer has a window (otherwise nothing is ever skipped).
    pub fn has_local_layers(&self) -> bool {
        self.windows.iter().any(Option::is_some)
    }

    /// Per layer: how many leading blocks no row at position `next_pos` or later reads
    /// (0 for global layers). Counted from the start of `next_pos`'s block, one block-layer
    /// short of the most at times, so that a later match of exactly the blocks before
    /// `next_pos` is never cut by [`WindowRule::usable_prefix`].
    pub fn unread_blocks(&self, next_pos: usize) -> Vec<usize> {
        let from = next_pos / self.block_tokens * self.block_tokens;
        self.windows.iter().map(|w| w.map_or(0, |w| (from + 1).saturating_sub(w) / self.block_tokens)).collect()
    }

    /// Leading blocks of which some layer may have been skipped by an import that
    /// continues at `next_pos` (the most any layer skips).
    pub fn partial_blocks(&self, next_pos: usize) -> usize {
        self.unread_blocks(next_pos).into_iter().max().unwrap_or(0)
    }

    /// Leading blocks whose sliding-window layers a sequence continuing at `next_pos`
    /// may give back ([`super::KvCache::trim_local`]): those no local layer reads from
    /// `next_pos` on, counted from the start of `next_pos`'s block like
    /// [`WindowRule::unread_blocks`], so that a later match of exactly the blocks
    /// before `next_pos` is never cut. Every block from here on keeps them.
    pub fn reclaimable_blocks(&self, next_pos: usize) -> usize {
        if !self.has_local_layers() {
            return 0;
        }
        let from = next_pos / self.block_tokens * self.block_tokens;
        self.unread_by_every_local_layer(from)
    }

    /// Leading blocks that no local layer reads from `next_pos` on (the least any local
    /// layer skips), so a block lacking its local layers below it is never read.
    fn unread_by_every_local_layer(&self, next_pos: usize) -> usize {
        self.windows
            .iter()
            .flatten()
            .map(|&w| (next_pos + 1).saturating_sub(w) / self.block_tokens)
            .min()
            .unwrap_or(usize::MAX)
    }

    /// Of a matched prefix whose block `i` lacks its local layers when `partial[i]`, how
    /// many leading blocks a sequence may use when it computes on from the end of them:
    /// the longest `m` such that every marked block below `m` lies before every local
    /// window of a row at position `m * block_tokens`.
    pub fn usable_prefix(&self, partial: &[bool]) -> usize {
        let mut last_partial = None;
        // last_partial_below[m]: the last marked block below m.
        let mut last_partial_below = Vec::with_capacity(partial.len() + 1);
        last_partial_below.push(None);
        for (i, &p) in partial.iter().enumerate() {
            if p {
                last_partial = Some(i);
            }
            last_partial_below.push(last_partial);
        }
        (0..=partial.len())
            .rev()
            .find(|&m| last_partial_below[m].is_none_or(|t| t < self.unread_by_every_local_layer(m * self.block_tokens)))
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Gemma 3's pattern in small: five local layers of window 8, then a global one.
    fn rule() -> WindowRule {
        WindowRule::new(4, [Some(8), Some(8), None].into_iter().collect())
    }

    #[test]
    fn unread_blocks_follow_the_window() {
        let r = rule();
        // A row at 12 reads 5..=12: block 0 (0..4) is out of the window; counted from
        // its block's start, 15 skips no more.
        assert_eq!(r.unread_blocks(12), vec![1, 1, 0]);
        assert_eq!(r.unread_blocks(15), vec![1, 1, 0]);
        assert_eq!(r.unread_blocks(11), vec![0, 0, 0]);
        assert_eq!(r.unread_blocks(100), vec![23, 23, 0]);
        assert_eq!(r.partial_blocks(100), 23);
        assert!(!WindowRule::new(4, vec![None, None]).has_local_layers());
        assert_eq!(WindowRule::new(4, vec![None]).usable_prefix(&[true, true]), 2);
        // Reclaimable: the least any local layer skips, from the block's start.
        let r2 = WindowRule::new(4, vec![Some(8), Some(12), None]);
        assert_eq!(r2.reclaimable_blocks(15), 0);
        assert_eq!(r2.reclaimable_blocks(16), 1);
        assert_eq!(r2.reclaimable_blocks(100), 22);
        assert_eq!(rule().reclaimable_blocks(100), 23);
        assert_eq!(WindowRule::new(4, vec![None]).reclaimable_blocks(100), 0);
    }

    /// Blocks given back at any position are never read again by the rows after it,
    /// and a match of exactly the blocks before the position is never cut.
    #[test]
    fn reclaimed_blocks_are_behind_every_window() {
        let r = WindowRule::new(3, vec![Some(5), Some(7), None]);
        for next in 0..60 {
            let k = r.reclaimable_blocks(next);
            for w in [5usize, 7] {
                // The first row after `next` reads from `next + 1 - w`.
                assert!(k * 3 <= (next + 1).saturating_sub(w), "next {next}: block {k} is read by window {w}");
            }
            let n = next / 3;
            let partial: Vec<bool> = (0..n).map(|b| b < k).collect();
            assert_eq!(r.usable_prefix(&partial), n, "next {next}");
        }
    }

    #[test]
    fn a_match_is_cut_before_a_row_could_read_a_partial_block() {
        let r = rule();
        assert_eq!(r.usable_prefix(&[false; 5]), 5);
        // Block 0 partial: a row at m*4 reads from m*4-7, so m >= 3 (row 12 reads 5..).
        assert_eq!(r.usable_prefix(&[true, false, false, false]), 4);
        assert_eq!(r.usable_prefix(&[true, false, false]), 3);
        assert_eq!(r.usable_prefix(&[true, false]), 0);
        // Marks the import rule makes are always usable from where the import continued.
        for next in 0..60 {
            let n = next / 4;
            let partial: Vec<bool> = (0..n).map(|b| b < r.partial_blocks(next)).collect();
            assert_eq!(r.usable_prefix(&partial), n, "next {next}");
        }
    }

    /// Brute force over positions: whatever `usable_prefix` allows, no row at or after
    /// the cut reads a partial block in any local layer.
    #[test]
    fn usable_prefix_never_reads_a_partial_block() {
        let r = WindowRule::new(3, vec![Some(5), Some(7), None]);
        for bits in 0u32..1 << 8 {
            let partial: Vec<bool> = (0..8).map(|i| bits & (1 << i) != 0).collect();
            let m = r.usable_prefix(&partial);
            for w in [5usize, 7] {
                let first_read = (m * 3 + 1).saturating_sub(w) / 3;
                assert!(partial[first_read..m].iter().all(|&p| !p), "{partial:?} cut at {m} reads a partial block (window {w})");
            }
        }
    }
}
