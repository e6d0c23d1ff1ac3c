//! A sampled token into its sequence: appended, detokenized, checked against the
//! stop rules and the length limits, and streamed to the client.

use super::sequence::Sequence;
use super::{Event, FinishReason, Shared, TokenOut};
use baton_kernels::GreedyRow;
use baton_text::sampling::{Sampled, SamplingError};
use baton_text::tokenizer::Tokenizer;

/// A token the backend picked greedily, as [`baton_text::sampling::Sampler::sample`] reports it: the
/// kernel follows the sampler's rules, and a greedy draw leaves the sampler as it was.
pub(crate) fn greedy_sampled(row: GreedyRow) -> Result<Sampled, SamplingError> {
    match row {
        GreedyRow::Token(token) => Ok(Sampled { token, logprob: 0.0, top_logprobs: Vec::new() }),
        GreedyRow::NonFinite(index) => Err(SamplingError::NonFiniteLogit { index: index as usize }),
        GreedyRow::AllMasked => Err(SamplingError::AllMasked),
    }
}

/// Takes `seq`'s sampled next token (or fails it); returns why it ends, if it does.
pub(crate) fn sample_into(seq: &mut Sequence, sampled: Result<Sampled, SamplingError>, tokenizer: &Tokenizer, max_context: usize, shared: &Shared) -> Option<FinishReason> {
    let sampled = match sampled {
        Ok(s) => s,
        Err(e) => {
            let _ = seq.events.send(Event::Failed(e.into()));
            return Some(FinishReason::Cancelled);
        }
    };
    accept_token(seq, sampled, tokenizer, max_context, shared)
}

/// Appends a sampled token to `seq` and emits it; returns why it ends, if it does.
pub(crate) fn accept_token(seq: &mut Sequence, sampled: Sampled, tokenizer: &Tokenizer, max_context: usize, shared: &Shared) -> Option<FinishReason> {
    let id = sampled.token;
    seq.tokens.push(id);
    seq.generated += 1;
    shared.stats.lock().unwrap_or_else(|p| p.into_inner()).generated_tokens += 1;
    let params = &seq.request.sampling;
    let is_stop = params.is_stop_token(id) || (!seq.request.ignore_eos && tokenizer.is_end_of_generation(id));
    let mut text = String::new();
    let mut stopped = is_stop;
    if !is_stop && !tokenizer.is_special(id) {
        let chunk = seq.decoder.push(id);
        let check = seq.stop.push(&chunk);
        text = check.text;
        stopped = check.stopped;
    }
    let out = TokenOut {
        id,
        text,
        logprob: params.logprobs.then_some(sampled.logprob),
        top_logprobs: sampled.top_logprobs,
        elapsed: seq.submitted.elapsed(),
    };
    if !seq.emit(out) {
        return Some(FinishReason::Cancelled);
    }
    if stopped {
        Some(FinishReason::Stop)
    } else if length_reached(seq.generated, seq.tokens.len(), seq.request.sampling.max_tokens, max_context) {
        Some(FinishReason::Length)
    } else {
        None
    }
}

/// Whether a sequence with `generated` tokens out of `tokens` ends for length.
pub(crate) fn length_reached(generated: usize, tokens: usize, max_tokens: usize, max_context: usize) -> bool {
    generated >= max_tokens || tokens >= max_context
}

/// Whether `seq` ends for length at its next token, whatever the token (run-ahead
/// computes no row for it past that one).
pub(crate) fn ends_at_next_token(seq: &Sequence, max_context: usize) -> bool {
    length_reached(seq.generated + 1, seq.tokens.len() + 1, seq.request.sampling.max_tokens, max_context)
}
