//! What a generation reports: why it ended, its token counts, and each token. The
//! engine produces these; the nodes carry them over the wire and the gateway turns
//! them into API responses, so they live here rather than in the engine.

use std::time::Duration;

/// Why a sequence ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token or stop string.
    Stop,
    /// `max_tokens` or the context limit.
    Length,
    /// The caller cancelled (or went away).
    Cancelled,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "cancelled",
        }
    }
}

/// Token counts of a finished request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    /// Prompt tokens served from the prefix cache (both tiers).
    pub cached_tokens: usize,
    pub completion_tokens: usize,
}

/// One generated token.
#[derive(Clone, Debug)]
pub struct TokenOut {
    pub id: u32,
    /// Text this token completes (may be empty while a multi-byte character
    /// or a possible stop string is held back).
    pub text: String,
    pub logprob: Option<f32>,
    pub top_logprobs: Vec<(u32, f32)>,
    /// Time since the request was submitted.
    pub elapsed: Duration,
}
