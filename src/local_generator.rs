//! A [`Generator`] over one in-process [`Engine`]: `baton gateway` and
//! `baton up` in single-process mode. The engine's request stream is adapted
//! to a `futures::Stream`; dropping it drops the engine's stream, which
//! cancels the sequence at the next step.
//!
//! It lives in the root crate, not in `baton-api-gateway`, so that the gateway
//! does not depend on the engine (or, through it, on the kernels).

use baton_api_gateway::generator::{Eviction, GenEvent, GenerateError, GenerateRequest, GenerationStream, Generator};
use baton_engine::kv::ConversationId;
use baton_engine::{Engine, EngineError, Event, Request};
use std::sync::Arc;
use std::time::Duration;

/// Runs every generation on one engine in this process.
pub struct LocalGenerator {
    engine: Arc<Engine>,
}

impl LocalGenerator {
    pub fn new(engine: Arc<Engine>) -> Self {
        LocalGenerator { engine }
    }

    pub fn engine(&self) -> &Arc<Engine> {
        &self.engine
    }
}

/// The gateway's error for an engine error.
fn generate_error(e: EngineError) -> GenerateError {
    match e {
        EngineError::Overloaded { .. } => GenerateError::Overloaded { retry_after: Duration::from_secs(1) },
        EngineError::ContextTooLong { prompt, max_tokens, max_context } => {
            GenerateError::ContextTooLong { prompt, max_tokens, max_context }
        }
        EngineError::Sampling(s) => GenerateError::BadRequest(s.to_string()),
        EngineError::EmptyPrompt | EngineError::BadToken { .. } | EngineError::BadPlatformPrefix { .. } => {
            GenerateError::BadRequest(e.to_string())
        }
        EngineError::Stopped => GenerateError::Unavailable("the engine has stopped".into()),
        other => GenerateError::Internal(other.to_string()),
    }
}

#[async_trait::async_trait]
impl Generator for LocalGenerator {
    async fn generate(&self, req: GenerateRequest) -> Result<GenerationStream, GenerateError> {
        let sampling = req.sampling.validate().map_err(|e| GenerateError::BadRequest(e.to_string()))?;
        let stream = self.engine.submit(Request {
            prompt: req.prompt,
            owner: req.owner,
            platform_prefix_len: req.platform_prefix_len,
            conversation: Some(req.conversation),
            sampling,
            ignore_eos: false,
        })
        .map_err(generate_error)?;
        let events = futures::stream::unfold(Some(stream), |state| async move {
            let mut stream = state?;
            match stream.next().await {
                Some(Event::Token(t)) => Some((GenEvent::Token(t), Some(stream))),
                Some(Event::Finished { reason, usage, trailing_text, .. }) => {
                    Some((GenEvent::Finished { reason, usage, trailing_text }, None))
                }
                Some(Event::Failed(e)) => Some((GenEvent::Failed(generate_error(e)), None)),
                None => Some((GenEvent::Failed(GenerateError::Unavailable("the engine has stopped".into())), None)),
            }
        });
        Ok(Box::pin(events))
    }

    async fn evict_conversation(&self, conversation: &ConversationId) -> Result<Eviction, GenerateError> {
        let engine = self.engine.clone();
        let id = conversation.clone();
        tokio::task::spawn_blocking(move || engine.evict_conversation(id)).await.map_err(|e| GenerateError::Internal(e.to_string()))?.map_err(generate_error)?;
        Ok(Eviction { acked: vec!["local".into()], owed: vec![] })
    }
}
