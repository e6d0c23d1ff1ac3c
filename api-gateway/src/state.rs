//! The gateway's shared state: [`App`], which every request handler reads through
//! `State<Arc<App>>` (`openai`, `completions`, `conversations`, and the request plumbing
//! they share: `auth`, `pipeline`, `turns`, `polled`), and [`build_app`], which builds it
//! from a config, a generator, a store and the model's tokenizer and template.
//!
//! This module imports no handler module, none of that plumbing, and not `server`: its
//! parts are plain data modules (`key_cache`, `live`, `limits`, `admission`, ...) that
//! import no state back. Handlers import the state, `server` imports handlers and
//! routes to them, so every dependency runs one way.

use crate::key_cache::KeyCache;
use crate::checks::{self, ContentCheck, LinkPolicy};
use crate::context::ContextBuilder;
use crate::generator::Generator;
use crate::limits::Limiter;
use crate::store::ConversationStore;
use crate::live::Registry;
use crate::{evictions, Config};
use anyhow::Result;
use baton_text::chat_template::ChatTemplate;
use baton_text::tokenizer::Tokenizer;
use std::sync::Arc;
use std::time::Duration;

/// Everything a request handler needs.
pub struct App {
    pub config: Config,
    pub generator: Arc<dyn Generator>,
    pub store: Arc<dyn ConversationStore>,
    pub context: ContextBuilder,
    pub limiter: Arc<Limiter>,
    pub checks: Arc<dyn ContentCheck>,
    pub links: Arc<LinkPolicy>,
    /// Bytes of reply tail the output check needs to see.
    pub check_window: usize,
    pub key_cache: KeyCache,
    /// Budgets of requests without a valid key (never charged to valid keys).
    pub lookups: crate::lookup_limits::LookupLimits,
    pub live: Registry,
    /// Per-conversation turn admission (idempotency decisions of one conversation see
    /// each other; different conversations never wait on each other).
    pub admission: crate::admission::Admission,
    /// Deleted conversations' evictions, retried until every node acknowledged.
    pub evictions: Arc<crate::evictions::Evictions>,
    pub model_id: String,
    /// Users' and keys' limit overrides with when they were read.
    pub overrides_cache: std::sync::Mutex<
        std::collections::HashMap<crate::limits::LimitSubject, (Option<crate::limits::LimitOverrides>, std::time::Instant)>,
    >,
}

/// Builds the gateway's shared state.
pub fn build_app(
    config: Config,
    generator: Arc<dyn Generator>,
    store: Arc<dyn ConversationStore>,
    tokenizer: Arc<Tokenizer>,
    template: Arc<ChatTemplate>,
    model_id: String,
) -> Result<Arc<App>> {
    let context = ContextBuilder::new(tokenizer, template, config.system_prompt.clone(), config.system_prompt_version)?;
    let check_window = checks::rule_window(&config.rules);
    let checks: Arc<dyn ContentCheck> = Arc::new(config.rules.clone());
    let evictions = evictions::Evictions::new(store.clone(), generator.clone(), config.evict_retry);
    Ok(Arc::new(App {
        evictions,
        limiter: match store.limit_ledger() {
            Some(ledger) => Limiter::shared(config.limits.clone(), ledger),
            None => Limiter::new(config.limits.clone()),
        },
        links: Arc::new(LinkPolicy { allowed_hosts: config.link_allowlist.clone() }),
        checks,
        check_window,
        context,
        key_cache: KeyCache::new(Duration::from_secs(10)),
        lookups: Default::default(),
        live: Default::default(),
        admission: Default::default(),
        model_id,
        overrides_cache: Default::default(),
        generator,
        store,
        config,
    }))
}
