//! Between the wire messages of `node.proto` and the engine's types. IDs are read
//! through `baton_proto::ids`, the one place a wire string becomes an ID.

use baton_proto::ids;
use baton_text::sampling::{SamplingParams, ValidSamplingParams};
use baton_engine::Request;
use baton_text::{FinishReason, TokenOut};
use baton_proto::node as pb;
use tonic::Status;

/// A turn as the engine takes it. Fills in a seed for a sampled request
/// without one, so a remote prefill and this node draw from one generator.
pub fn request(turn: Option<pb::Turn>, sampling: Option<pb::SamplingParams>) -> Result<Request, Status> {
    let turn = turn.ok_or_else(|| Status::invalid_argument("turn is missing"))?;
    let s = sampling.unwrap_or_default();
    let (sampling, ignore_eos) = sampling_params(&s)?;
    Ok(Request {
        prompt: turn.prompt,
        owner: ids::owner(turn.owner)?,
        platform_prefix_len: turn.platform_prefix_len as usize,
        conversation: ids::optional_conversation(turn.conversation)?,
        sampling,
        ignore_eos,
    })
}

pub fn sampling_params(s: &pb::SamplingParams) -> Result<(ValidSamplingParams, bool), Status> {
    let p = SamplingParams {
        temperature: s.temperature,
        top_k: s.top_k as usize,
        top_p: if s.top_p == 0.0 { 1.0 } else { s.top_p },
        seed: s.seed,
        max_tokens: if s.max_tokens == 0 { SamplingParams::default().max_tokens } else { s.max_tokens as usize },
        stop_token_ids: s.stop_token_ids.clone(),
        stop_strings: s.stop_strings.clone(),
        logprobs: s.logprobs,
        top_logprobs: s.top_logprobs as usize,
    };
    let v = p.validate().map_err(|e| Status::invalid_argument(e.to_string()))?;
    Ok((v, s.ignore_eos))
}

/// The wire form of a request's sampling parameters.
pub fn sampling_to_wire(r: &Request) -> pb::SamplingParams {
    let p = r.sampling.clone().into_inner();
    pb::SamplingParams {
        temperature: p.temperature,
        top_k: p.top_k as u32,
        top_p: p.top_p,
        seed: p.seed,
        max_tokens: p.max_tokens as u32,
        stop_token_ids: p.stop_token_ids,
        stop_strings: p.stop_strings,
        logprobs: p.logprobs,
        top_logprobs: p.top_logprobs as u32,
        ignore_eos: r.ignore_eos,
    }
}

pub fn token(t: &TokenOut) -> pb::TokenEvent {
    pb::TokenEvent {
        id: t.id,
        text: t.text.clone(),
        logprob: t.logprob,
        top_logprobs: t.top_logprobs.iter().map(|&(id, logprob)| pb::TopLogprob { id, logprob }).collect(),
    }
}

pub fn finish_reason(r: FinishReason) -> pb::FinishReason {
    match r {
        FinishReason::Stop => pb::FinishReason::Stop,
        FinishReason::Length => pb::FinishReason::Length,
        FinishReason::Cancelled => pb::FinishReason::Cancelled,
    }
}

