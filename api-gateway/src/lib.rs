//! Baton API gateway: the user-facing edge. OpenAI-compatible chat
//! completions with server-sent events, the conversations API with
//! idempotent turns and resumable streams, API-key auth, per-user limits,
//! the conversation store, the context builder, input/output checks,
//! metering and a web chat page.
//!
//! It talks to token producers only through [`generator::Generator`], so the
//! same gateway runs in front of one in-process engine or the cluster:
//! `run(config, generator, shutdown)`.

pub mod admission;
pub mod alternatives;
pub mod auth;
pub mod checks;
pub mod client;
pub mod completions;
pub mod conn_table;
pub mod context;
pub mod conv_common;
pub mod conv_items;
pub mod conversation_items;
pub mod conversations;
pub mod error;
pub mod evictions;
pub mod generator;
pub mod key_cache;
pub mod limits;
pub mod listen;
pub mod live;
pub mod lookup_limits;
pub mod markdown;
pub mod metrics;
pub mod openai;
pub mod openai_common;
pub mod page;
pub mod params;
pub mod pipeline;
pub mod polled;
pub mod proxy;
pub mod responses;
pub mod server;
pub mod slo;
pub mod state;
pub mod store;
pub mod tls;
pub mod turns;

use anyhow::{Context as _, Result};
use baton_identity::AdminKey;
use baton_text::chat_template::ChatTemplate;
use baton_text::gguf::GgufFile;
use baton_text::tokenizer::Tokenizer;
use checks::RuleCheck;
use generator::Generator;
use limits::LimitConfig;
use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use store::ConversationStore;

pub use auth::ensure_key;
pub use error::Error;
pub use state::{build_app, App};
pub use store::sqlite;

/// Flags of the gateway (`baton gateway`, `baton up`).
#[derive(clap::Args, Clone, Debug)]
pub struct Args {
    /// Address the HTTP API listens on.
    #[arg(long, env = "BATON_GATEWAY_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// The store of keys, conversations and turns: a SQLite file path, or a
    /// `postgres://user:password@host:port/db` URL (several replicas share it).
    #[arg(long, env = "BATON_DB", default_value = "baton-gateway.db", hide_env_values = true)]
    pub db: PathBuf,
    /// Replicas sharing one PostgreSQL: a replica whose heartbeat is older than this is
    /// dead, and a retry of a turn it was streaming takes the turn over (at least 2s;
    /// heartbeats are sent six times as often).
    #[arg(long, env = "BATON_REPLICA_DEAD_AFTER", default_value = "60s", value_parser = parse_duration)]
    pub replica_dead_after: Duration,
    /// The model whose tokenizer and chat template the gateway uses (GGUF
    /// file); by default the engine's model.
    #[arg(long, env = "BATON_TOKENIZER_MODEL")]
    pub tokenizer_model: Option<PathBuf>,
    /// The name `/v1/models` reports; default: the model file's stem.
    #[arg(long, env = "BATON_SERVED_MODEL_NAME")]
    pub served_model_name: Option<String>,
    /// The platform's system prompt for conversations.
    #[arg(long, env = "BATON_SYSTEM_PROMPT", default_value = "You are a helpful assistant.")]
    pub system_prompt: String,
    /// Version of the system prompt (stored with every turn).
    #[arg(long, env = "BATON_SYSTEM_PROMPT_VERSION", default_value_t = 1)]
    pub system_prompt_version: u32,
    /// Largest request body, in bytes.
    #[arg(long, env = "BATON_MAX_BODY_BYTES", default_value_t = 1 << 20)]
    pub max_body_bytes: usize,
    /// max_tokens when a request does not say.
    #[arg(long, env = "BATON_DEFAULT_MAX_TOKENS", default_value_t = 512)]
    pub default_max_tokens: usize,
    #[arg(long, env = "BATON_LIMIT_TURNS_PER_MINUTE", default_value_t = 60.0)]
    pub turns_per_minute: f64,
    #[arg(long, env = "BATON_LIMIT_OPEN_STREAMS", default_value_t = 8)]
    pub open_streams: usize,
    #[arg(long, env = "BATON_LIMIT_PROMPT_TOKENS_PER_HOUR", default_value_t = 2_000_000.0)]
    pub prompt_tokens_per_hour: f64,
    #[arg(long, env = "BATON_LIMIT_OUTPUT_TOKENS_PER_HOUR", default_value_t = 200_000.0)]
    pub output_tokens_per_hour: f64,
    /// Conversation creates and lists per minute, per owner (429 above it).
    #[arg(long, env = "BATON_LIMIT_CONVERSATION_REQUESTS_PER_MINUTE", default_value_t = 120.0)]
    pub conversation_requests_per_minute: f64,
    /// Days a conversation is kept after its last turn.
    #[arg(long, env = "BATON_RETENTION_DAYS", default_value_t = 30)]
    pub retention_days: u64,
    /// Rule file of the input/output checks (`input: phrase`, `output: phrase`).
    #[arg(long, env = "BATON_CHECK_RULES")]
    pub check_rules: Option<PathBuf>,
    /// Hosts whose links replies may keep (comma-separated); others become plain text.
    #[arg(long, env = "BATON_LINK_ALLOWLIST", value_delimiter = ',')]
    pub link_allowlist: Vec<String>,
    /// Summarize a conversation at the turn boundary where its history passes
    /// this many tokens (0: never).
    #[arg(long, env = "BATON_SUMMARY_THRESHOLD_TOKENS", default_value_t = 6000)]
    pub summary_threshold_tokens: usize,
    /// Recent turns kept verbatim after a summary.
    #[arg(long, env = "BATON_SUMMARY_KEEP_TURNS", default_value_t = 2)]
    pub summary_keep_turns: usize,
    /// Longest summary, in tokens.
    #[arg(long, env = "BATON_SUMMARY_MAX_TOKENS", default_value_t = 256)]
    pub summary_max_tokens: usize,
    /// Seconds a turn keeps generating after its last client disconnected
    /// (a reconnect with Last-Event-ID within it resumes).
    #[arg(long, env = "BATON_RESUME_GRACE_SECONDS", default_value_t = 10)]
    pub resume_grace_seconds: u64,
    /// PEM certificate chain (leaf first): with --tls-key, the listener serves HTTPS only.
    #[arg(long, env = "BATON_GATEWAY_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert (PKCS#8, PKCS#1 or SEC1).
    #[arg(long, env = "BATON_GATEWAY_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
    /// The largest max_tokens a request may ask for; above it the request gets a 400.
    #[arg(long, env = "BATON_MAX_TOKENS_CEILING", default_value_t = 4096)]
    pub max_tokens_ceiling: usize,
    /// Client connections open at once; past it a new connection is closed at once.
    /// Lowered at start, with a warning, to fit the open-files limit (less 512 for the
    /// process's own files), after raising the soft limit to the hard one.
    #[arg(long, env = "BATON_MAX_CONNECTIONS", default_value_t = 8192)]
    pub max_connections: usize,
    /// Reverse proxies (addresses or CIDRs, comma-separated) whose `X-Forwarded-For`
    /// names the client; from any other peer the header is ignored. Per-address budgets
    /// (requests without a key) then count the real client, not the proxy.
    #[arg(long, env = "BATON_TRUSTED_PROXIES", value_delimiter = ',')]
    pub trusted_proxies: Vec<String>,
    /// Client connections open at once from one IP address.
    #[arg(long, env = "BATON_MAX_CONNECTIONS_PER_ADDRESS", default_value_t = 256)]
    pub max_connections_per_address: usize,
    /// Seconds a client has to send a request's headers; a keep-alive connection idle
    /// this long is closed. Request bodies have the same deadline.
    #[arg(long, env = "BATON_HEADER_TIMEOUT_SECONDS", default_value_t = 15)]
    pub header_timeout_seconds: u64,
    /// A second listener for operators, serving /metrics and /healthz without a key: bind
    /// it to a private address (Prometheus scrapes it; the public edge never routes to it).
    #[arg(long, env = "BATON_GATEWAY_ADMIN_LISTEN")]
    pub admin_listen: Option<SocketAddr>,
    /// File holding the admin key (or set BATON_ADMIN_KEY): with one, /metrics on the
    /// public listener answers to `Authorization: Bearer <admin key>`; without one it is
    /// served only on --admin-listen.
    #[arg(long, env = "BATON_ADMIN_KEY_FILE")]
    pub admin_key_file: Option<PathBuf>,
    /// Wait before the first retry of a deleted conversation's eviction that some node
    /// did not acknowledge; each further retry waits twice as long (with jitter).
    #[arg(long, env = "BATON_EVICT_RETRY_MIN", default_value = "1s", value_parser = parse_duration)]
    pub evict_retry_min: Duration,
    /// The longest wait between eviction retries.
    #[arg(long, env = "BATON_EVICT_RETRY_MAX", default_value = "5m", value_parser = parse_duration)]
    pub evict_retry_max: Duration,
    /// SLO target for time to first token (request received to first token): delivered
    /// replies are counted in baton_gateway_turns_slo_total as met or missed.
    #[arg(long, env = "BATON_SLO_TTFT", default_value = "1s", value_parser = parse_duration)]
    pub slo_ttft: Duration,
    /// SLO target for a turn's own p95 gap between consecutive tokens (e.g. 50ms).
    #[arg(long, env = "BATON_SLO_ITL", default_value = "50ms", value_parser = parse_duration)]
    pub slo_itl: Duration,
}

fn parse_duration(s: &str) -> std::result::Result<Duration, humantime::DurationError> {
    humantime::parse_duration(s)
}

/// A validated configuration.
#[derive(Clone, Debug)]
pub struct Config {
    pub listen: SocketAddr,
    pub db: PathBuf,
    /// Heartbeat age after which another replica is dead (PostgreSQL store).
    pub replica_dead_after: Duration,
    pub tokenizer_model: Option<PathBuf>,
    pub served_model_name: Option<String>,
    pub system_prompt: String,
    pub system_prompt_version: u32,
    pub max_body_bytes: usize,
    pub default_max_tokens: usize,
    pub limits: LimitConfig,
    pub retention: Duration,
    pub rules: RuleCheck,
    pub link_allowlist: Vec<String>,
    pub resume_grace: Duration,
    pub summary_threshold_tokens: usize,
    pub summary_keep_turns: usize,
    pub summary_max_tokens: usize,
    /// HTTPS on the listener; `None`: plain HTTP.
    pub tls: Option<tls::TlsConfig>,
    /// Requests asking for more max_tokens are refused.
    pub max_tokens_ceiling: usize,
    /// Open connections, header and body deadlines.
    pub connections: listen::ConnLimits,
    /// Peers whose `X-Forwarded-For` is believed.
    pub trusted_proxies: proxy::TrustedProxies,
    /// Operators' listener (/metrics, /healthz without a key).
    pub admin_listen: Option<SocketAddr>,
    /// Opens /metrics on the public listener.
    pub admin_key: Option<AdminKey>,
    /// Waits between retries of evictions some node did not acknowledge.
    pub evict_retry: evictions::Backoff,
    /// Targets each delivered reply is judged against (`baton_gateway_turns_slo_total`).
    pub slo: slo::SloTargets,
}

impl TryFrom<Args> for Config {
    type Error = anyhow::Error;

    fn try_from(a: Args) -> Result<Config> {
        let positive = |v: f64, name: &str| -> Result<f64> {
            anyhow::ensure!(v.is_finite() && v > 0.0, "--{name} must be positive");
            Ok(v)
        };
        anyhow::ensure!(a.replica_dead_after >= Duration::from_secs(2), "--replica-dead-after must be at least 2s");
        anyhow::ensure!(a.max_body_bytes >= 1024, "--max-body-bytes must be at least 1024");
        anyhow::ensure!(a.default_max_tokens >= 1, "--default-max-tokens must be at least 1");
        anyhow::ensure!(
            a.max_tokens_ceiling >= a.default_max_tokens,
            "--max-tokens-ceiling ({}) must be at least --default-max-tokens ({})",
            a.max_tokens_ceiling,
            a.default_max_tokens
        );
        anyhow::ensure!(a.max_connections >= 1 && a.max_connections_per_address >= 1, "connection limits must be at least 1");
        anyhow::ensure!(a.header_timeout_seconds >= 1, "--header-timeout-seconds must be at least 1");
        anyhow::ensure!(a.open_streams >= 1, "--open-streams must be at least 1");
        anyhow::ensure!(a.retention_days >= 1, "--retention-days must be at least 1");
        anyhow::ensure!(a.evict_retry_min >= Duration::from_millis(10), "--evict-retry-min must be at least 10ms");
        anyhow::ensure!(
            a.evict_retry_max >= a.evict_retry_min,
            "--evict-retry-max ({:?}) must be at least --evict-retry-min ({:?})",
            a.evict_retry_max,
            a.evict_retry_min
        );
        anyhow::ensure!(!a.slo_ttft.is_zero() && !a.slo_itl.is_zero(), "--slo-ttft and --slo-itl must be positive");
        let rules = match &a.check_rules {
            Some(p) => RuleCheck::load(p)?,
            None => RuleCheck::default(),
        };
        let trusted_proxies = proxy::TrustedProxies::parse(&a.trusted_proxies).map_err(|e| anyhow::anyhow!("--trusted-proxies: {e}"))?;
        let tls = tls::TlsConfig::from_flags(a.tls_cert.as_deref(), a.tls_key.as_deref())?;
        anyhow::ensure!(a.admin_listen != Some(a.listen), "--admin-listen must differ from --listen");
        let admin_key = AdminKey::from_env_or_file(a.admin_key_file.as_deref()).context("the admin key")?;
        Ok(Config {
            admin_listen: a.admin_listen,
            admin_key,
            tls,
            listen: a.listen,
            db: a.db,
            replica_dead_after: a.replica_dead_after,
            tokenizer_model: a.tokenizer_model,
            served_model_name: a.served_model_name,
            system_prompt: a.system_prompt,
            system_prompt_version: a.system_prompt_version,
            max_body_bytes: a.max_body_bytes,
            default_max_tokens: a.default_max_tokens,
            limits: LimitConfig {
                turns_per_minute: positive(a.turns_per_minute, "turns-per-minute")?,
                open_streams: a.open_streams,
                prompt_tokens_per_hour: positive(a.prompt_tokens_per_hour, "prompt-tokens-per-hour")?,
                output_tokens_per_hour: positive(a.output_tokens_per_hour, "output-tokens-per-hour")?,
                conversation_requests_per_minute: positive(a.conversation_requests_per_minute, "conversation-requests-per-minute")?,
            },
            retention: Duration::from_secs(a.retention_days * 86_400),
            rules,
            link_allowlist: a.link_allowlist.into_iter().map(|h| h.trim().to_string()).filter(|h| !h.is_empty()).collect(),
            resume_grace: Duration::from_secs(a.resume_grace_seconds),
            summary_threshold_tokens: a.summary_threshold_tokens,
            summary_keep_turns: a.summary_keep_turns,
            summary_max_tokens: a.summary_max_tokens.max(1),
            max_tokens_ceiling: a.max_tokens_ceiling,
            connections: listen::ConnLimits {
                max_connections: a.max_connections,
                max_per_address: a.max_connections_per_address,
                header_timeout: Duration::from_secs(a.header_timeout_seconds),
            },
            trusted_proxies,
            evict_retry: evictions::Backoff { min: a.evict_retry_min, max: a.evict_retry_max },
            slo: slo::SloTargets { ttft: a.slo_ttft, itl: a.slo_itl },
        })
    }
}

/// Loads the tokenizer and chat template of a GGUF model (no weights).
pub fn load_tokenizer(path: &Path) -> Result<(Arc<Tokenizer>, Arc<ChatTemplate>)> {
    let f = GgufFile::open(path).with_context(|| format!("opening {}", path.display()))?;
    let tok = Tokenizer::from_gguf(&f).with_context(|| format!("tokenizer of {}", path.display()))?;
    let tmpl = ChatTemplate::from_gguf(&f).with_context(|| format!("chat template of {}", path.display()))?;
    Ok((Arc::new(tok), Arc::new(tmpl)))
}

/// Opens the configured store, SQLite or PostgreSQL (see [`store::open`]),
/// marking turns a crash left streaming as failed.
pub async fn open_store(config: &Config) -> Result<Arc<dyn ConversationStore>> {
    let shown = store::postgres::redact_url(&config.db.to_string_lossy());
    let s = store::open_with(&config.db, config.replica_dead_after).await.with_context(|| format!("opening the store {shown}"))?;
    let n = s.fail_streaming_turns().await?;
    if n > 0 {
        tracing::warn!(turns = n, "turns interrupted by the last shutdown marked failed");
    }
    Ok(s)
}

/// Runs the gateway in front of `generator` until `shutdown` completes.
/// `model` is the GGUF file whose tokenizer and template prompts are built
/// with (used when the config names none).
pub async fn run(
    config: Config,
    generator: Arc<dyn Generator>,
    model: &Path,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<()> {
    let store = open_store(&config).await?;
    run_with_store(config, generator, store, model, shutdown).await
}

/// [`run`] over a store the caller opened (e.g. after [`ensure_key`]).
pub async fn run_with_store(
    config: Config,
    generator: Arc<dyn Generator>,
    store: Arc<dyn ConversationStore>,
    model: &Path,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<()> {
    let model = config.tokenizer_model.clone().unwrap_or_else(|| model.to_path_buf());
    let (tok, tmpl) = load_tokenizer(&model)?;
    let model_id = config
        .served_model_name
        .clone()
        .unwrap_or_else(|| model.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "baton".into()));
    let listener = tokio::net::TcpListener::bind(config.listen).await.with_context(|| format!("binding {}", config.listen))?;
    let app = build_app(config, generator, store, tok, tmpl, model_id)?;
    tracing::info!(addr = %listener.local_addr()?, "gateway listening");
    server::serve(listener, app, shutdown).await?;
    Ok(())
}

/// A random ID (hex, 96 bits) for conversations, turns and completions.
pub fn request_id() -> String {
    use rand::Rng;
    let b: [u8; 12] = rand::rng().random();
    b.iter().map(|x| format!("{x:02x}")).collect()
}
