//! `baton gateway` (the API gateway in front of an in-process engine),
//! `baton keys` (API keys in the gateway's store) and `baton chat` (a
//! terminal client of the conversations API).

use crate::engine_args::EngineArgs;
use crate::process::{runtime, shutdown_signal};
use anyhow::{bail, Context, Result};
use baton_api_gateway::client::{Client, Method};
use baton_api_gateway::generator::cluster::{ClusterConfig, ClusterGenerator};
use baton::local_generator::LocalGenerator;
use baton_api_gateway::{auth, Config};
use baton_proto::plane::{Plane, Role};
use clap::{Args, Subcommand};
use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Args, Debug)]
pub struct GatewayArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    #[command(flatten)]
    pub gateway: baton_api_gateway::Args,
    /// Serve the cluster behind this coordinator (e.g. http://10.0.0.2:7100), or behind
    /// every replica given comma-separated (a turn fails over between them), instead of
    /// an in-process engine; the model file then only supplies the tokenizer.
    #[arg(long, env = "BATON_COORDINATOR", value_delimiter = ',')]
    pub coordinator: Vec<String>,
    /// With --coordinator: when no coordinator answers, route turns on the last known
    /// membership for at most this long after the last answer (then fail them as
    /// unavailable). /healthz and baton_gateway_routing_degraded report the state.
    #[arg(long, env = "BATON_DEGRADED_ROUTING_FOR", default_value = "60s", value_parser = humantime::parse_duration)]
    pub degraded_routing_for: std::time::Duration,
    /// With --coordinator: folder with ca.pem and the gateway's certificate and key
    /// (`baton certs`), for the internal plane's mutual TLS.
    #[arg(long, env = "BATON_CERTS_DIR", default_value = "certs")]
    pub certs_dir: PathBuf,
    /// File name of the certificate in --certs-dir (NAME.pem, NAME.key); it must name a
    /// gateway identity (NAME.gateway.baton).
    #[arg(long, env = "BATON_TLS_NAME", default_value = "gateway")]
    pub tls_name: String,
    /// INSECURE: call the coordinator and decode nodes without TLS or identities. Only for
    /// a network of trusted processes.
    #[arg(long, env = "BATON_INSECURE_PLAINTEXT_INTERNAL")]
    pub insecure_plaintext_internal: bool,
}

pub fn run_gateway(a: GatewayArgs) -> Result<()> {
    let config = Config::try_from(a.gateway)?;
    let model = a.engine.model_path();
    let coordinators: Vec<String> = a.coordinator.iter().map(|u| u.trim().to_string()).filter(|u| !u.is_empty()).collect();
    if !coordinators.is_empty() {
        let plane = Plane::from_flags(&a.certs_dir, &a.tls_name, Role::Gateway, a.insecure_plaintext_internal)?;
        // The cluster client's lazy channels need the runtime when they are created.
        let rt = runtime()?;
        let generator = {
            let _in_runtime = rt.enter();
            let cluster = ClusterConfig { degraded_for: a.degraded_routing_for, ..ClusterConfig::default() };
            Arc::new(ClusterGenerator::new(&coordinators, cluster, plane).map_err(|e| anyhow::anyhow!("{e}"))?)
        };
        return rt.block_on(baton_api_gateway::run(config, generator, &model, shutdown_signal()));
    }
    let engine = Arc::new(a.engine.start()?);
    let generator = Arc::new(LocalGenerator::new(engine.clone()));
    let rt = runtime()?;
    let r = rt.block_on(baton_api_gateway::run(config, generator, &model, shutdown_signal()));
    engine.shutdown();
    r
}

#[derive(Subcommand, Debug)]
pub enum KeysCommand {
    /// Create a key for a user and print it (it is shown only once).
    Create {
        #[arg(long)]
        user: String,
        #[arg(long, default_value = "")]
        label: String,
    },
    /// List keys (prefixes, users, state).
    List,
    /// Revoke every key starting with PREFIX.
    Revoke { prefix: String },
    /// Override the limits of a user (--user) or of one key (--key PREFIX); unset
    /// flags keep the defaults, --clear removes the overrides. A key's overrides
    /// apply on top of its user's, and a key with overrides has its own buckets.
    Limits {
        #[arg(long, required_unless_present = "key", conflicts_with = "key")]
        user: Option<String>,
        /// The key's first characters, as `baton keys list` shows them.
        #[arg(long)]
        key: Option<String>,
        #[arg(long)]
        turns_per_minute: Option<f64>,
        #[arg(long)]
        open_streams: Option<usize>,
        #[arg(long)]
        prompt_tokens_per_hour: Option<f64>,
        #[arg(long)]
        output_tokens_per_hour: Option<f64>,
        #[arg(long)]
        clear: bool,
    },
}

#[derive(Args, Debug)]
pub struct KeysArgs {
    /// The gateway's store: a SQLite file or a `postgres://` URL.
    #[arg(long, env = "BATON_DB", default_value = "baton-gateway.db", hide_env_values = true)]
    pub db: PathBuf,
    #[command(subcommand)]
    pub command: KeysCommand,
}

pub fn run_keys(a: KeysArgs) -> Result<()> {
    let rt = runtime()?;
    rt.block_on(async {
        let shown = baton_api_gateway::store::postgres::redact_url(&a.db.to_string_lossy());
        let store = baton_api_gateway::store::open(&a.db).await.with_context(|| format!("opening the store {shown}"))?;
        match a.command {
            KeysCommand::Create { user, label } => {
                anyhow::ensure!(!user.trim().is_empty(), "--user must not be empty");
                println!("{}", auth::create_key(store.as_ref(), &user, &label).await?);
            }
            KeysCommand::List => {
                for k in store.list_keys().await? {
                    let limits = k.limits.map(|l| serde_json::to_string(&l)).transpose()?.unwrap_or_default();
                    println!("{}\t{}\t{}\t{}\t{limits}", k.prefix, k.user, if k.revoked { "revoked" } else { "active" }, k.label);
                }
            }
            KeysCommand::Revoke { prefix } => {
                anyhow::ensure!(prefix.len() >= 6, "give at least 6 characters of the key");
                let n = store.revoke_keys(&prefix).await?;
                println!("revoked {n} key(s)");
            }
            KeysCommand::Limits { user, key, turns_per_minute, open_streams, prompt_tokens_per_hour, output_tokens_per_hour, clear } => {
                let o = baton_api_gateway::limits::LimitOverrides { turns_per_minute, open_streams, prompt_tokens_per_hour, output_tokens_per_hour };
                let o = (!clear).then_some(&o);
                match (user, key) {
                    (Some(user), _) => {
                        store.set_user_limits(&user, o).await?;
                        println!("{}", serde_json::to_string(&store.user_limits(&user).await?)?);
                    }
                    (None, Some(prefix)) => {
                        anyhow::ensure!(prefix.len() >= 6, "give at least 6 characters of the key");
                        let active = |keys: Vec<baton_api_gateway::store::ApiKeyInfo>| {
                            keys.into_iter().filter(|k| !k.revoked && k.prefix.starts_with(&prefix)).collect::<Vec<_>>()
                        };
                        let matching = active(store.list_keys().await?);
                        if matching.len() != 1 {
                            bail!("{} active keys start with {prefix:?}; give one key's prefix (see `baton keys list`)", matching.len());
                        }
                        if store.set_key_limits(&matching[0].prefix, o).await? == 0 && o.is_some() {
                            bail!("another key shares the prefix {:?}; revoke one of them", matching[0].prefix);
                        }
                        let now = active(store.list_keys().await?).pop().and_then(|k| k.limits);
                        println!("{}", serde_json::to_string(&now)?);
                    }
                    (None, None) => bail!("give --user or --key"),
                }
            }
        }
        Ok(())
    })
}

#[derive(Args, Debug)]
pub struct ChatArgs {
    /// The gateway's base URL.
    #[arg(long, env = "BATON_URL", default_value = "http://127.0.0.1:8080")]
    pub url: String,
    #[arg(long, env = "BATON_API_KEY", hide_env_values = true)]
    pub key: String,
    /// Continue this conversation instead of starting one.
    #[arg(long)]
    pub conversation: Option<String>,
    #[arg(long, default_value_t = 512)]
    pub max_tokens: u32,
}

pub fn run_chat(a: ChatArgs) -> Result<()> {
    let rt = runtime()?;
    rt.block_on(async {
        let client = Client::new(a.url.clone(), Some(a.key.clone()));
        let conv = match a.conversation {
            Some(c) => c,
            None => {
                let (st, v) = client.json(Method::POST, "/v1/conversations", Some(&serde_json::json!({"title": "baton chat"}))).await?;
                if !st.is_success() {
                    bail!("creating a conversation: {st} {v}");
                }
                v["id"].as_str().unwrap_or_default().to_string()
            }
        };
        eprintln!("conversation {conv} (empty line or Ctrl-D to quit)");
        let stdin = std::io::stdin();
        loop {
            eprint!("> ");
            let mut line = String::new();
            if stdin.lock().read_line(&mut line)? == 0 || line.trim().is_empty() {
                return Ok(());
            }
            let body = serde_json::json!({"message": line.trim_end(), "max_tokens": a.max_tokens});
            let mut r =
                client.send(Method::POST, &format!("/v1/conversations/{conv}/turns"), Some(body.to_string().into_bytes()), &[]).await?;
            if !r.status.is_success() {
                let st = r.status;
                eprintln!("error {st}: {}", String::from_utf8_lossy(&r.bytes().await?));
                continue;
            }
            while let Some(ev) = r.next_event().await? {
                let v: serde_json::Value = serde_json::from_str(&ev.data).unwrap_or_default();
                match ev.event.as_deref() {
                    Some("delta") => {
                        print!("{}", v["text"].as_str().unwrap_or(""));
                        std::io::stdout().flush()?;
                    }
                    Some("moderation") => eprintln!("\n[stopped: {}]", v["reason"].as_str().unwrap_or("")),
                    Some("done") => break,
                    _ => {}
                }
            }
            println!();
        }
    })
}
