//! The pipelined export: a prompt's KV leaves the arena layer by layer while the
//! forward pass computes the later layers, instead of all at once after it.
//!
//! Owns: what the caller receives ([`LayerExport`], a stream of [`LayerExportEvent`]),
//! the sequence's side of it ([`LayerExporter`]: which blocks went out already), and the
//! per-step plan ([`LayerJob`]) that the scheduler hands to `Model::step_with`.
//!
//! A block goes out once every token of it (up to the prompt's end) has its keys and
//! values in a layer: in the step whose chunk completes it, each layer right after that
//! layer's KV write ([`baton_kernels::Backend::kv_blocks_layer_out`]). Blocks already
//! complete when the sequence first runs (this engine's own prefix cache held them) go
//! out in its first step. With chunked prefill a block completed by chunk `c` goes out
//! during chunk `c`, so the tail's transfer overlaps the rest of the prompt's compute too.
//!
//! Invariants: every (block, layer) of `start..prompt blocks` is sent exactly once
//! (a preempted sequence that recomputes sends nothing twice: the same bytes already
//! left); [`LayerExportEvent::Done`] is sent only after all of them, at the first
//! token; a sequence that ends before that drops its sender without `Done`, which the
//! consumer must treat as a failed export (never ship a partial one as complete).

use std::ops::Range;

use baton_kernels::KvBytes;
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender};

/// One layer of a run of consecutive prompt blocks.
#[derive(Debug)]
pub struct LayerChunk {
    /// The layer.
    pub layer: usize,
    /// Sequence index of the first block (the export's start block or later).
    pub first_block: usize,
    /// Blocks in the run.
    pub blocks: usize,
    /// `blocks` block-layers, one after another (maybe still on their way off a device).
    pub bytes: KvBytes,
}

/// What a pipelined export delivers, in order.
#[derive(Debug)]
pub enum LayerExportEvent {
    /// One layer of some blocks, as soon as that layer's KV was written.
    Layer(LayerChunk),
    /// Every layer of every block from the start block to the prompt's end was sent
    /// (`blocks` of them); sent when the first token is sampled.
    Done { blocks: usize },
}

/// The consumer's end. Ends without [`LayerExportEvent::Done`] when the sequence ended
/// before its first token (failed, cancelled): the export is incomplete.
pub type LayerExport = UnboundedReceiver<LayerExportEvent>;

/// Blocks of a `prompt_len`-token prompt whose every token is computed once `computed`
/// tokens are (the last, partial block counts at the prompt's end).
pub(crate) fn complete_blocks(computed: usize, prompt_len: usize, block_tokens: usize) -> usize {
    if computed >= prompt_len {
        prompt_len.div_ceil(block_tokens)
    } else {
        computed / block_tokens
    }
}

/// A sequence's pipelined export.
pub(crate) struct LayerExporter {
    tx: UnboundedSender<LayerExportEvent>,
    start: usize,
    /// Blocks below this index went out in every layer.
    sent: usize,
}

impl LayerExporter {
    pub fn new(tx: UnboundedSender<LayerExportEvent>, start: usize) -> Self {
        LayerExporter { tx, start, sent: start }
    }

    /// Blocks that a step computing the prompt up to `computed_after` tokens completes
    /// and that did not go out yet.
    pub fn due(&self, computed_after: usize, prompt_len: usize, block_tokens: usize) -> Range<usize> {
        self.sent..complete_blocks(computed_after, prompt_len, block_tokens).max(self.sent)
    }

    /// At the first token: `Done` if every block went out; otherwise the export is
    /// dropped unfinished (the consumer sees it end without `Done`).
    pub fn finish(self, prompt_len: usize, block_tokens: usize) {
        let end = prompt_len.div_ceil(block_tokens);
        if self.sent >= end {
            let _ = self.tx.send(LayerExportEvent::Done { blocks: end - self.start });
        } else {
            tracing::error!(sent = self.sent, end, "a pipelined export reached the first token with blocks unsent; dropped");
        }
    }
}

/// One step's export of one sequence: these blocks, every layer, during the forward pass.
pub(crate) struct LayerJob {
    /// The sequence's index in the running queue.
    pub seq: usize,
    /// Arena indices of the blocks.
    pub arena: Vec<usize>,
    /// Sequence indices of the blocks.
    pub blocks: Range<usize>,
    tx: UnboundedSender<LayerExportEvent>,
}

impl LayerJob {
    pub fn new(seq: usize, exporter: &LayerExporter, blocks: Range<usize>, arena: Vec<usize>) -> Self {
        debug_assert_eq!(blocks.len(), arena.len());
        LayerJob { seq, arena, blocks, tx: exporter.tx.clone() }
    }

    /// Sends layer `layer` of the job's blocks (a consumer that went away is the
    /// sequence's cancel to handle, not the forward pass's).
    pub fn send(&self, layer: usize, bytes: KvBytes) {
        let chunk = LayerChunk { layer, first_block: self.blocks.start, blocks: self.blocks.len(), bytes };
        let _ = self.tx.send(LayerExportEvent::Layer(chunk));
    }

    /// After the forward pass: the job's blocks went out in every layer.
    pub fn sent(&self, exporter: &mut LayerExporter) {
        exporter.sent = exporter.sent.max(self.blocks.end);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_complete_at_their_last_token_or_the_prompt_end() {
        // 40 tokens in blocks of 16: blocks 0, 1 full, block 2 partial.
        assert_eq!(complete_blocks(0, 40, 16), 0);
        assert_eq!(complete_blocks(15, 40, 16), 0);
        assert_eq!(complete_blocks(16, 40, 16), 1);
        assert_eq!(complete_blocks(39, 40, 16), 2);
        assert_eq!(complete_blocks(40, 40, 16), 3);
        assert_eq!(complete_blocks(32, 32, 16), 2);
    }

    #[test]
    fn chunks_send_each_block_once_and_done_only_when_all_went() {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let mut x = LayerExporter::new(tx, 1);
        // Chunks of 20 tokens over a 70-token prompt (5 blocks; the export from block 1).
        let mut seen = Vec::new();
        for computed in [20, 40, 60, 70] {
            let due = x.due(computed, 70, 16);
            seen.extend(due.clone());
            x.sent = x.sent.max(due.end);
        }
        assert_eq!(seen, vec![1, 2, 3, 4], "blocks 1..5, each once, in order");
        // A preempted sequence recomputing from the start sends nothing again.
        assert!(x.due(40, 70, 16).is_empty());
        x.finish(70, 16);
        assert!(matches!(rx.try_recv(), Ok(LayerExportEvent::Done { blocks: 4 })));

        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let x = LayerExporter::new(tx, 0);
        x.finish(70, 16);
        assert!(rx.try_recv().is_err(), "an unfinished export ends without Done");
    }
}
