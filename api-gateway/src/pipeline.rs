//! One generation as the API sees it: limits admitted, the generator's
//! tokens passed through the output filter, and the end metered. Both the
//! OpenAI endpoint and conversation turns read replies through [`Reply`].
//!
//! Dropping a [`Reply`] drops the generator stream (the engine cancels the
//! sequence) and the limits permit, and meters what was generated.

use crate::alternatives::{Alternative, AlternativesFilter};
use crate::checks::{Filtered, OutputFilter};
use crate::context::Prompt;
use crate::error::ApiError;
use crate::generator::{GenEvent, GenerateError, GenerateRequest, GenerationStream};
use crate::key_cache::KeyHash;
use crate::limits::{LimitOverrides, LimitSubject, Permit};
use crate::metrics;
use crate::state::App;
use crate::slo::TurnClock;
use crate::store::UsageCounts;
use baton_text::sampling::SamplingParams;
use baton_text::{FinishReason, Usage};
use baton_vocab::{ConversationId, OwnerId};
use futures::StreamExt;
use std::sync::Arc;
use std::time::Instant;

/// A generated token as sent to the client. Its strings are filtered output, never the
/// tokenizer's spelling of an ID ([`crate::alternatives`]): whatever renders a
/// `logprobs` field must take its text from here.
#[derive(Clone, Debug)]
pub struct TokenInfo {
    pub id: u32,
    pub logprob: Option<f32>,
    /// What this token released of the reply's filtered text (may be empty: held back,
    /// removed, or a special token).
    pub text: String,
    /// The top alternatives, each with the text it released in its rank's own filter.
    pub top_logprobs: Vec<Alternative>,
}

/// What a reply yields.
#[derive(Debug)]
pub enum Piece {
    /// Text to send (may be empty) and the token it came from, if any.
    Delta { text: String, token: Option<TokenInfo> },
    /// The last piece.
    End(End),
}

/// How a reply ended.
#[derive(Debug, Clone)]
pub struct End {
    /// `stop`, `length`, `cancelled`, `content_filter` or `error`.
    pub finish_reason: &'static str,
    pub usage: Usage,
    /// The output check's reason when it stopped the reply.
    pub blocked: Option<String>,
    pub error: Option<GenerateError>,
}

/// A reply in progress.
pub struct Reply {
    app: Arc<App>,
    user: String,
    events: Option<GenerationStream>,
    filter: OutputFilter,
    /// The filters of the top alternatives' ranks (when the request asked for them).
    alternatives: AlternativesFilter,
    permit: Option<Permit>,
    prompt_len: usize,
    /// When the request started and when its tokens arrived (TTFT, ITL, the SLO).
    clock: TurnClock,
    queued_end: Option<End>,
    /// Every token ID received, in order (what the next prompt appends).
    pub output_ids: Vec<u32>,
    /// Every piece of text sent, concatenated.
    pub text: String,
    ended: bool,
}

impl App {
    /// Checks limits and starts a generation.
    pub async fn start_reply(
        self: &Arc<Self>,
        owner: &OwnerId,
        key: &KeyHash,
        prompt: Prompt,
        conversation: ConversationId,
        sampling: SamplingParams,
    ) -> Result<Reply, ApiError> {
        let sampling = sampling.validate().map_err(|e| ApiError::bad_request(e.to_string()))?.into_inner();
        let (bucket, overrides) = self.limits_for(owner.as_str(), key).await?;
        let permit = self.limiter.admit_with(&bucket, prompt.ids.len(), overrides.as_ref()).await?;
        let prompt_len = prompt.ids.len();
        let started = Instant::now();
        let events = self
            .generator
            .generate(GenerateRequest {
                prompt: prompt.ids,
                owner: owner.clone(),
                platform_prefix_len: prompt.platform_prefix_len,
                conversation,
                sampling,
            })
            .await?;
        metrics::stream_opened();
        Ok(Reply {
            app: self.clone(),
            user: owner.as_str().to_string(),
            events: Some(events),
            filter: OutputFilter::new(self.checks.clone(), self.links.clone(), self.check_window),
            alternatives: AlternativesFilter::new(self.context.tokenizer.clone(), self.checks.clone(), self.links.clone(), self.check_window),
            permit: Some(permit),
            prompt_len,
            clock: TurnClock::start(started),
            queued_end: None,
            output_ids: Vec::new(),
            text: String::new(),
            ended: false,
        })
    }
}

impl App {
    /// Charges `tokens` stored without a generation (items a client adds to a
    /// conversation) to the caller's limits like a turn's prompt: one turn, its tokens
    /// against the prompt-token budget; refused (429) like a turn.
    pub async fn charge_prompt_tokens(&self, owner: &OwnerId, key: &KeyHash, tokens: usize) -> Result<(), ApiError> {
        let (bucket, overrides) = self.limits_for(owner.as_str(), key).await?;
        let permit = self.limiter.admit_with(&bucket, tokens, overrides.as_ref()).await?;
        drop(permit); // nothing streams: the open-stream slot is given back at once
        Ok(())
    }

    /// Admits model work that is not a reply (a summary) under `owner`'s limits like
    /// a turn: one turn, `prompt_tokens` charged, an open-stream slot held by the
    /// permit while it runs; the caller charges its output with the permit.
    pub async fn admit_generation(&self, owner: &OwnerId, key: &KeyHash, prompt_tokens: usize) -> Result<Permit, ApiError> {
        let (bucket, overrides) = self.limits_for(owner.as_str(), key).await?;
        Ok(self.limiter.admit_with(&bucket, prompt_tokens, overrides.as_ref()).await?)
    }

    /// The buckets a request is charged to and the overrides they run under:
    /// the user's overrides with its key's on top. A key with overrides of
    /// its own has its own buckets (its user's ID plus the key hash), so a
    /// batch key's budget neither starves nor is starved by the user's other
    /// keys; every other key of a user shares the user's buckets.
    async fn limits_for(&self, user: &str, key: &KeyHash) -> Result<(String, Option<LimitOverrides>), ApiError> {
        let of_user = self.cached_overrides(LimitSubject::User(user.to_string())).await?;
        match self.cached_overrides(LimitSubject::Key(key.0.clone())).await? {
            None => Ok((user.to_string(), of_user)),
            Some(k) => Ok((format!("{user}\u{0}{}", key.0), Some(of_user.unwrap_or_default().under(&k)))),
        }
    }

    /// Overrides from the store, cached for a few seconds (a change takes
    /// effect within that time on every gateway replica).
    async fn cached_overrides(&self, subject: LimitSubject) -> Result<Option<LimitOverrides>, ApiError> {
        const TTL: std::time::Duration = std::time::Duration::from_secs(10);
        if let Some((o, at)) = self.overrides_cache.lock().unwrap_or_else(|p| p.into_inner()).get(&subject) {
            if at.elapsed() < TTL {
                return Ok(o.clone());
            }
        }
        let o = match &subject {
            LimitSubject::User(u) => self.store.user_limits(u).await?,
            LimitSubject::Key(k) => self.store.key_limits(k).await?,
        };
        let mut cache = self.overrides_cache.lock().unwrap_or_else(|p| p.into_inner());
        if cache.len() > 100_000 {
            cache.clear();
        }
        cache.insert(subject, (o.clone(), Instant::now()));
        Ok(o)
    }
}

impl Reply {
    /// The next piece; `None` after the end.
    pub async fn next(&mut self) -> Option<Piece> {
        if self.ended {
            return None;
        }
        if let Some(end) = self.queued_end.take() {
            return Some(self.finish(end));
        }
        let ev = match self.events.as_mut() {
            Some(s) => s.next().await,
            None => return None,
        };
        Some(match ev {
            Some(GenEvent::Token(t)) => {
                metrics::token(&mut self.clock);
                self.output_ids.push(t.id);
                // A special token (end of turn and the like) is never text, whatever the
                // node that sent it says.
                let raw = if self.app.context.tokenizer.is_special(t.id) { "" } else { t.text.as_str() };
                match self.filter.push(raw) {
                    Filtered::Text(text) => {
                        self.text.push_str(&text);
                        let top_logprobs = self.alternatives.push(&t.top_logprobs);
                        let token = Some(TokenInfo { id: t.id, logprob: t.logprob, text: text.clone(), top_logprobs });
                        Piece::Delta { text, token }
                    }
                    Filtered::Blocked(reason) => {
                        let usage = self.partial_usage();
                        self.finish(End { finish_reason: "content_filter", usage, blocked: Some(reason), error: None })
                    }
                }
            }
            Some(GenEvent::Finished { reason, usage, trailing_text }) => {
                let mut text = String::new();
                let mut blocked = None;
                for f in [self.filter.push(&trailing_text), self.filter.finish()] {
                    match f {
                        Filtered::Text(t) => text.push_str(&t),
                        Filtered::Blocked(r) => {
                            blocked = Some(r);
                            break;
                        }
                    }
                }
                let finish_reason = match (reason, &blocked) {
                    (_, Some(_)) => "content_filter",
                    (FinishReason::Stop, _) => "stop",
                    (FinishReason::Length, _) => "length",
                    (FinishReason::Cancelled, _) => "cancelled",
                };
                let end = End { finish_reason, usage, blocked: blocked.clone(), error: None };
                if blocked.is_some() || text.is_empty() {
                    self.finish(end)
                } else {
                    self.text.push_str(&text);
                    self.queued_end = Some(end);
                    Piece::Delta { text, token: None }
                }
            }
            Some(GenEvent::Failed(e)) => {
                let usage = self.partial_usage();
                self.finish(End { finish_reason: "error", usage, blocked: None, error: Some(e) })
            }
            None => {
                let usage = self.partial_usage();
                let e = GenerateError::Unavailable("the generation stream ended early".into());
                self.finish(End { finish_reason: "error", usage, blocked: None, error: Some(e) })
            }
        })
    }

    /// Stops the reply now (stop button, disconnect).
    pub fn cancel(&mut self) -> Option<Piece> {
        if self.ended {
            return None;
        }
        let usage = self.partial_usage();
        Some(self.finish(End { finish_reason: "cancelled", usage, blocked: None, error: None }))
    }

    fn partial_usage(&self) -> Usage {
        Usage { prompt_tokens: self.prompt_len, cached_tokens: 0, completion_tokens: self.output_ids.len() }
    }

    fn finish(&mut self, end: End) -> Piece {
        self.ended = true;
        self.events = None;
        let u = end.usage;
        if let Some(p) = self.permit.take() {
            p.charge_output(u.completion_tokens);
        }
        metrics::stream_closed(end.finish_reason, self.clock.started());
        if matches!(end.finish_reason, "stop" | "length") {
            metrics::turn_slo(self.clock.outcome(self.app.config.slo));
        }
        metrics::tokens(u.prompt_tokens, u.cached_tokens, u.completion_tokens);
        metrics::metered(&self.user, &u);
        let store = self.app.store.clone();
        let user = self.user.clone();
        let counts = UsageCounts {
            requests: 1,
            prompt_tokens: u.prompt_tokens as i64,
            cached_tokens: u.cached_tokens as i64,
            completion_tokens: u.completion_tokens as i64,
        };
        tokio::spawn(async move {
            if let Err(e) = store.add_usage(&user, counts).await {
                metrics::metering_failed();
                tracing::warn!(error = %e, "metering write failed");
            }
        });
        Piece::End(end)
    }
}

impl Drop for Reply {
    fn drop(&mut self) {
        if !self.ended {
            // The client went away: the generator stream drops with us (the
            // engine cancels the sequence); meter what was generated.
            let _ = self.cancel();
        }
    }
}
