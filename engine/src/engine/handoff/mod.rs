//! KV handoff between engines: the types a prefill node and a decode node
//! exchange through their engines, and the pure rules that decide how much of
//! an import is used.
//!
//! - Export (prefill node): [`Engine::submit_with`](super::Engine::submit_with)
//!   with [`SubmitOptions::export_from_block`] computes the prompt (matching
//!   its own owner-scoped prefix cache first), samples the first token and, at
//!   that moment, copies the KV blocks from the given block to the prompt's end
//!   out of the arena into a [`KvExport`].
//! - Import (decode node): [`SubmitOptions::import`] carries blocks computed
//!   elsewhere. At admission the engine matches its own prefix cache (`m`
//!   blocks), allocates the rest and copies in the imported blocks it lacks.
//!   With a [`ImportedToken`] the import covers the whole prompt and the
//!   sequence starts decoding from that token without computing the prompt;
//!   without one it covers a whole-block prefix and the engine computes the
//!   rest (a prefill node that pulled a prefix from a decode node).
//! - Prefix export (decode node):
//!   [`Engine::export_prefix`](super::Engine::export_prefix) copies the cached
//!   blocks of a prefix out so a prefill node that lacks them can pull them.
//!
//! - Pipelined export (prefill node):
//!   [`Engine::submit_exporting_layers`](super::Engine::submit_exporting_layers) sends
//!   each layer of the prompt's blocks as soon as that layer's KV is written, while the
//!   forward pass computes the later layers ([`layers`]).
//!
//! Invariants: an import is used only when it is contiguous with what the
//! cache matched (no gap); otherwise it is dropped and the sequence computes
//! its prompt locally, which gives the same tokens. Imported bytes only ever
//! land in blocks the sequence itself allocated, never in shared cached ones.
//! Every block pinned for an export is released before the export is sent.

use crate::engine::EngineError;

pub mod layers;

/// Where a sequence's export goes.
pub(crate) enum ExportTo {
    /// Whole blocks from `start` on, copied out at the first token.
    Whole { start: usize, tx: tokio::sync::oneshot::Sender<KvExport> },
    /// Layer by layer during the forward passes that write them.
    Layers(layers::LayerExporter),
}

/// KV blocks of one sequence computed elsewhere.
#[derive(Clone, Debug)]
pub struct KvImport {
    /// Index (in the sequence) of the first block in `blocks`.
    pub start_block: usize,
    /// Whole blocks (all layers, the arena's block layout), in sequence order.
    pub blocks: ImportBlocks,
    /// The token sampled after the prompt by the engine that computed it.
    /// Present: the import covers the whole prompt (its last block may be
    /// partial). Absent: the import covers whole blocks of a prefix only.
    pub first_token: Option<ImportedToken>,
}

/// An import's blocks: on the host, or still in device memory of the engine's device.
#[derive(Clone, Debug)]
pub enum ImportBlocks {
    Host(Vec<Vec<u8>>),
    Device(DeviceBlocks),
}

impl ImportBlocks {
    /// Blocks `range` on the host: borrowed, or copied off the device.
    pub fn host(&self, range: std::ops::Range<usize>) -> Result<std::borrow::Cow<'_, [Vec<u8>]>, String> {
        match self {
            ImportBlocks::Host(b) => Ok(std::borrow::Cow::Borrowed(&b[range])),
            ImportBlocks::Device(d) => d.to_host(range).map(std::borrow::Cow::Owned),
        }
    }

    pub fn len(&self) -> usize {
        match self {
            ImportBlocks::Host(b) => b.len(),
            ImportBlocks::Device(d) => d.addrs.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl From<Vec<Vec<u8>>> for ImportBlocks {
    fn from(blocks: Vec<Vec<u8>>) -> Self {
        ImportBlocks::Host(blocks)
    }
}

/// What holds an import's device blocks (a node's staging pool in the engine's GPU
/// memory): keeps them from reuse until dropped, and copies one to the host for a backend
/// that cannot copy on the device.
pub trait DeviceBlockHolder: Send + Sync {
    /// Copies block `i` of the import (`out.len()` bytes) to the host.
    fn read_block(&self, i: usize, out: &mut [u8]) -> Result<(), String>;
}

/// Whole blocks that arrived in device memory (GPUDirect RDMA into a staging pool on the
/// engine's GPU): the engine copies them into its arena on the device
/// ([`Backend::kv_blocks_in_device`](baton_kernels::Backend::kv_blocks_in_device)).
#[derive(Clone)]
pub struct DeviceBlocks {
    /// Device address of each block's first byte, in sequence order.
    pub addrs: Vec<u64>,
    /// Bytes of each block.
    pub block_bytes: usize,
    pub holder: std::sync::Arc<dyn DeviceBlockHolder>,
}

impl DeviceBlocks {
    /// Blocks `range`, copied to the host.
    pub fn to_host(&self, range: std::ops::Range<usize>) -> Result<Vec<Vec<u8>>, String> {
        range
            .map(|i| {
                let mut out = vec![0u8; self.block_bytes];
                self.holder.read_block(i, &mut out).map(|()| out)
            })
            .collect()
    }
}

impl std::fmt::Debug for DeviceBlocks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBlocks").field("blocks", &self.addrs.len()).field("block_bytes", &self.block_bytes).finish_non_exhaustive()
    }
}

/// A token sampled by another engine.
#[derive(Clone, Debug, PartialEq)]
pub struct ImportedToken {
    pub id: u32,
    pub logprob: f32,
    pub top_logprobs: Vec<(u32, f32)>,
}

/// KV blocks copied out of an engine's arena.
#[derive(Clone, Debug, Default)]
pub struct KvExport {
    /// Index (in the sequence) of the first block in `blocks`.
    pub start_block: usize,
    /// Whole blocks (all layers), in sequence order.
    pub blocks: Vec<Vec<u8>>,
}

/// Extras of [`Engine::submit_with`](super::Engine::submit_with).
#[derive(Clone, Debug, Default)]
pub struct SubmitOptions {
    /// KV computed elsewhere for part or all of the prompt.
    pub import: Option<KvImport>,
    /// Copy the prompt's blocks from this block on out of the arena when the
    /// first token is sampled (delivered on [`Submission::export`]).
    pub export_from_block: Option<usize>,
}

/// What [`Engine::submit_with`](super::Engine::submit_with) returns.
pub struct Submission {
    pub stream: super::RequestStream,
    /// The export, when one was asked for. Fails (sender dropped) if the
    /// sequence ended before its first token.
    pub export: Option<tokio::sync::oneshot::Receiver<KvExport>>,
    /// With an import: whether the engine used it, decided at the sequence's first
    /// admission and sent before its first token. Fails (sender dropped) if the
    /// sequence ended before it was admitted.
    pub import: Option<tokio::sync::oneshot::Receiver<ImportUse>>,
}

/// What the engine did with an import at admission (an import that is dropped is
/// recomputed locally, giving the same tokens: callers learn it only from this).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ImportUse {
    /// Its blocks were copied in (past what the prefix cache already held).
    Used,
    /// It did not start where the cache match ended: a gap no one computed.
    NotContiguous,
    /// No memory for its blocks' sliding-window layers.
    NoWindowMemory,
    /// Its blocks were in device memory and could not be copied out of it.
    DeviceCopyFailed,
}

/// Checks an import's shape against the prompt.
pub(crate) fn validate_import(import: &KvImport, prompt_len: usize, block_tokens: usize, block_bytes: usize) -> Result<(), EngineError> {
    if import.blocks.is_empty() {
        return Err(EngineError::BadImport { what: "no blocks" });
    }
    let sizes_ok = match &import.blocks {
        ImportBlocks::Host(blocks) => blocks.iter().all(|b| b.len() == block_bytes),
        ImportBlocks::Device(d) => d.block_bytes == block_bytes,
    };
    if !sizes_ok {
        return Err(EngineError::BadImport { what: "block size differs from this engine's blocks" });
    }
    let end = import.start_block + import.blocks.len();
    if import.first_token.is_some() {
        if end != prompt_len.div_ceil(block_tokens) {
            return Err(EngineError::BadImport { what: "an import with a first token must end at the prompt's last block" });
        }
    } else if end * block_tokens > prompt_len.saturating_sub(1) {
        return Err(EngineError::BadImport { what: "a prefix import must leave at least one prompt token to compute" });
    }
    Ok(())
}

/// The first token another node sampled is data from a peer: an ID outside this
/// engine's vocabulary would index past its tables (it panicked the engine's thread), and a
/// logprob must be one (finite or -inf, never above 0, never NaN).
pub(crate) fn validate_first_token(first: &ImportedToken, vocab: usize) -> Result<(), EngineError> {
    let logprob_ok = |l: f32| !l.is_nan() && l <= 0.0;
    if first.id as usize >= vocab || first.top_logprobs.iter().any(|&(id, _)| id as usize >= vocab) {
        return Err(EngineError::BadImport { what: "the imported first token is outside the vocabulary" });
    }
    if !logprob_ok(first.logprob) || first.top_logprobs.iter().any(|&(_, l)| !logprob_ok(l)) {
        return Err(EngineError::BadImport { what: "the imported first token's logprob is not a log-probability" });
    }
    Ok(())
}

/// How an import is applied once the cache matched `matched` blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ImportPlan {
    /// The import starts after the matched prefix: a gap no one computed.
    /// Drop it and compute locally.
    Gap,
    /// Copy import blocks `[first, end)` (sequence indices) into the
    /// sequence's blocks; the sequence has computed `computed` tokens.
    Use { first: usize, end: usize, computed: usize },
}

/// Decides how an import meets a cache match of `matched` blocks.
pub(crate) fn plan_import(matched: usize, start_block: usize, len: usize, block_tokens: usize, prompt_len: usize, has_first: bool) -> ImportPlan {
    if matched < start_block {
        return ImportPlan::Gap;
    }
    let end = start_block + len;
    let first = matched.min(end);
    let computed = if has_first { prompt_len } else { (end * block_tokens).max(matched * block_tokens) };
    ImportPlan::Use { first, end, computed }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn import(start: usize, n: usize, first: bool) -> KvImport {
        KvImport {
            start_block: start,
            blocks: vec![vec![0u8; 8]; n].into(),
            first_token: first.then(|| ImportedToken { id: 1, logprob: 0.0, top_logprobs: vec![] }),
        }
    }

    #[test]
    fn validation() {
        // 40-token prompt, blocks of 16: 3 blocks, the last partial.
        assert!(validate_import(&import(1, 2, true), 40, 16, 8).is_ok());
        assert!(validate_import(&import(1, 1, true), 40, 16, 8).is_err(), "must reach the last block");
        assert!(validate_import(&import(0, 2, false), 40, 16, 8).is_ok());
        assert!(validate_import(&import(0, 3, false), 40, 16, 8).is_err(), "prefix import past the prompt");
        // A prefix import may not cover every prompt token.
        assert!(validate_import(&import(0, 2, false), 32, 16, 8).is_err());
        assert!(validate_import(&import(0, 2, false), 33, 16, 8).is_ok());
        let mut bad = import(1, 2, true);
        let ImportBlocks::Host(blocks) = &mut bad.blocks else { unreachable!() };
        blocks[1].push(0);
        assert!(validate_import(&bad, 40, 16, 8).is_err());
        assert!(validate_import(&import(0, 0, false), 40, 16, 8).is_err());
    }

    #[test]
    fn a_first_token_from_a_peer_is_checked() {
        let ok = ImportedToken { id: 9, logprob: -0.5, top_logprobs: vec![(9, -0.5), (3, f32::NEG_INFINITY)] };
        assert!(validate_first_token(&ok, 10).is_ok());
        for bad in [
            ImportedToken { id: 10, ..ok.clone() },
            ImportedToken { id: u32::MAX, ..ok.clone() },
            ImportedToken { top_logprobs: vec![(10, -1.0)], ..ok.clone() },
            ImportedToken { logprob: f32::NAN, ..ok.clone() },
            ImportedToken { logprob: 3.0, ..ok.clone() },
            ImportedToken { top_logprobs: vec![(1, f32::NAN)], ..ok.clone() },
        ] {
            assert!(validate_first_token(&bad, 10).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn plans() {
        assert_eq!(plan_import(0, 1, 2, 16, 40, true), ImportPlan::Gap);
        assert_eq!(plan_import(1, 1, 2, 16, 40, true), ImportPlan::Use { first: 1, end: 3, computed: 40 });
        // The cache grew since the grant: skip what it holds.
        assert_eq!(plan_import(2, 1, 2, 16, 40, true), ImportPlan::Use { first: 2, end: 3, computed: 40 });
        assert_eq!(plan_import(0, 0, 2, 16, 40, false), ImportPlan::Use { first: 0, end: 2, computed: 32 });
        assert_eq!(plan_import(1, 0, 1, 16, 40, false), ImportPlan::Use { first: 1, end: 1, computed: 16 });
    }
}
