//! One sequence in the engine: its tokens, its KV blocks and where it stands.

use super::handoff::ExportTo;
use super::{Event, FinishReason, ImportUse, ImportedToken, KvImport, Request, TokenOut, Usage};
use crate::kv::{BlockId, ChainLink, HashChain, SeqId, SwapHandle};
use baton_text::sampling::{Sampler, StopMatcher};
use baton_text::tokenizer::IncrementalDecoder;
use std::time::{Duration, Instant};

/// Where a sequence's KV lives while it is not running.
pub(crate) enum Parked {
    /// Its blocks were released; it recomputes (with prefix-cache help).
    Recompute,
    /// Its blocks sit in the second tier.
    Swapped(SwapHandle),
}

pub(crate) struct Sequence {
    pub id: SeqId,
    pub request: Request,
    /// Prompt followed by the generated tokens.
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    /// Tokens whose keys and values are in `blocks`.
    pub computed: usize,
    pub blocks: Vec<BlockId>,
    /// Hashes of the full blocks of `tokens`.
    pub chain: HashChain,
    /// Full blocks already offered to the prefix index.
    pub registered: usize,
    /// The prefix-cache link of each of the first `registered` blocks (from the
    /// match or the register); `None` where a block could not be published, which
    /// leaves every later block unpublished too.
    pub links: Vec<Option<ChainLink>>,
    /// Prompt tokens that came from the prefix cache at first admission.
    pub cached_tokens: Option<usize>,
    pub generated: usize,
    pub sampler: Sampler,
    pub decoder: IncrementalDecoder,
    pub stop: StopMatcher,
    pub events: tokio::sync::mpsc::UnboundedSender<Event>,
    pub submitted: Instant,
    pub first_token: Option<Duration>,
    pub parked: Option<Parked>,
    /// KV computed elsewhere, applied (or dropped) at first admission.
    pub import: Option<Box<KvImport>>,
    /// Where to say what became of `import`.
    pub import_use: Option<tokio::sync::oneshot::Sender<ImportUse>>,
    /// The imported first token, accepted right after admission.
    pub imported_first: Option<ImportedToken>,
    /// Blocks below this index came in an import that may lack their sliding-window
    /// layers: they are published as such (see `crate::kv::WindowRule`).
    pub local_layers_absent_below: usize,
    /// Blocks below this index were offered to `KvCache::trim_local` (their window
    /// layers' memory given back unless another sequence holds them).
    pub trimmed: usize,
    /// Where the prompt's blocks go: whole at the first token, or layer by layer.
    pub export: Option<ExportTo>,
}

impl Sequence {
    pub fn usage(&self) -> Usage {
        Usage { prompt_tokens: self.prompt_len, cached_tokens: self.cached_tokens.unwrap_or(0), completion_tokens: self.generated }
    }

    /// Sends a token; false when the receiver is gone.
    pub fn emit(&mut self, out: TokenOut) -> bool {
        if self.first_token.is_none() {
            self.first_token = Some(out.elapsed);
        }
        self.events.send(Event::Token(out)).is_ok()
    }

    /// The final event; `window_saved_bytes`: see [`Event::Finished`].
    pub fn finish_event(&mut self, reason: FinishReason, window_saved_bytes: u64) -> Event {
        let mut trailing_text = String::new();
        if reason != FinishReason::Cancelled && !self.stop.is_stopped() {
            let tail = self.decoder.finish();
            let check = self.stop.push(&tail);
            trailing_text.push_str(&check.text);
            if !check.stopped {
                trailing_text.push_str(&self.stop.finish());
            }
        }
        Event::Finished {
            reason,
            usage: self.usage(),
            ttft: self.first_token,
            total: self.submitted.elapsed(),
            trailing_text,
            window_saved_bytes,
        }
    }
}
