//! `baton bench responses`: what a stateful client gains from the Responses API. A
//! chain of responses (`previous_response_id`) whose first turn carries a long
//! history (`--history-tokens`) is answered by the gateway from the stored, token-exact
//! conversation, so turns 2.. find every earlier turn in the prefix cache; the same
//! turns are also sent statelessly (`/v1/chat/completions` with the whole history) as a
//! user whose owner-scoped cache holds none of it, i.e. to a cold node for that prompt.
//! Both go through one gateway over one in-process engine, over HTTP on loopback, in
//! this process: the table prints each turn's time to first token side by side.
//!
//! Every repetition and every stateless turn runs as a fresh user (a new API key), so
//! nothing is cached across repetitions or between the two sides.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use baton::local_generator::LocalGenerator;
use baton_api_gateway::store::{ConversationStore, SqliteStore};
use baton_bench::load::responses::{http_client, stream_response};
use baton_bench::load::{stream_turn, Endpoint, Message};
use clap::{Args, Parser};

use crate::engine_args::EngineArgs;

#[derive(Args, Debug)]
pub struct BenchResponsesArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Tokens of history the chain's first turn carries (turns 2.. are at least this deep).
    #[arg(long, default_value_t = 2000)]
    pub history_tokens: usize,
    /// Turns of the chain (the first builds the history; the rest are measured).
    #[arg(long, default_value_t = 4)]
    pub turns: usize,
    /// Reply tokens per turn.
    #[arg(long, default_value_t = 16)]
    pub max_tokens: usize,
    /// Repetitions (medians are reported).
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Also write the results as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// The gateway's own flags, parsed as `baton gateway` parses them.
#[derive(Parser)]
struct GatewayFlags {
    #[command(flatten)]
    args: baton_api_gateway::Args,
}

const QUESTIONS: &[&str] = &[
    "Which item in the list came first?",
    "Now name the last item you remember.",
    "How many items were there, roughly?",
    "Summarize the whole list in one sentence.",
    "Which colors did the list mention?",
];

/// One measured turn of one repetition.
#[derive(Clone, Copy, Debug, Default)]
struct Sample {
    warm_ttft: Duration,
    cold_ttft: Duration,
    warm_input: u64,
    warm_cached: u64,
    cold_input: u64,
    cold_cached: u64,
}

#[derive(Debug, serde::Serialize)]
struct TurnRow {
    turn: usize,
    warm_input_tokens: u64,
    warm_cached_tokens: u64,
    warm_ttft_ms: f64,
    cold_input_tokens: u64,
    cold_cached_tokens: u64,
    cold_ttft_ms: f64,
    speedup: f64,
}

/// A deterministic history of about `tokens` tokens: a numbered list of short lines.
fn history_text(engine: &baton_engine::Engine, tokens: usize) -> Result<String> {
    const COLORS: &[&str] = &["red", "green", "blue", "amber", "violet", "teal", "ochre", "silver"];
    const THINGS: &[&str] = &["kite", "lamp", "river", "garden", "violin", "harbor", "lantern", "meadow", "engine", "orchard"];
    let mut text = String::from("Here is a list of things I saw this week:\n");
    let mut i = 0;
    loop {
        let n = engine.tokenizer.encode(&text, false).map_err(|e| anyhow::anyhow!("tokenizer: {e}"))?.len();
        if n >= tokens {
            return Ok(text);
        }
        text.push_str(&format!("{}. a {} {} near the {} station\n", i + 1, COLORS[i % COLORS.len()], THINGS[(i * 7) % THINGS.len()], THINGS[(i * 3 + 1) % THINGS.len()]));
        i += 1;
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

pub fn run(a: BenchResponsesArgs) -> Result<()> {
    if a.history_tokens < 32 || a.turns < 2 || a.turns > QUESTIONS.len() + 1 || a.max_tokens == 0 || a.repeats == 0 {
        bail!("--history-tokens must be at least 32, --turns 2 to {}, --max-tokens and --repeats positive", QUESTIONS.len() + 1);
    }
    let model = a.engine.model_path();
    if !model.exists() {
        bail!("model {} not found; run `bash scripts/fetch-model.sh` or pass --model", model.display());
    }
    let mut engine_args = a.engine.clone();
    let need = a.history_tokens + a.turns * (a.max_tokens + 64) + 256;
    engine_args.max_context = Some(engine_args.max_context.unwrap_or(0).max(need));
    let engine = Arc::new(engine_args.start().context("starting the engine")?);
    let dir = tempfile::tempdir()?;
    let db = dir.path().join("bench.db");
    let flags = GatewayFlags::try_parse_from(["gateway", "--db", &db.display().to_string()])?;
    let config = baton_api_gateway::Config::try_from(flags.args)?;
    let rows = crate::process::runtime()?.block_on(async {
        let store = Arc::new(SqliteStore::open(&db)?);
        let generator = Arc::new(LocalGenerator::new(engine.clone()));
        let app = baton_api_gateway::build_app(config, generator, store.clone(), engine.tokenizer.clone(), engine.template.clone(), "bench".into())?;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let base = format!("http://{}/v1", listener.local_addr()?);
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(baton_api_gateway::server::serve(listener, app, async move {
            let _ = stop_rx.await;
        }));
        let history = history_text(&engine, a.history_tokens)?;
        eprintln!(
            "baton bench responses: {} history tokens, {} turns ({} measured), {} reply tokens, {} repeats",
            a.history_tokens,
            a.turns,
            a.turns - 1,
            a.max_tokens,
            a.repeats
        );
        let http = http_client();
        let endpoint = |key: String| Endpoint { base_url: base.clone(), api_key: Some(key), model: "bench".into(), max_tokens: a.max_tokens, temperature: 0.0 };
        let store: Arc<dyn ConversationStore> = store;
        let mut samples: Vec<Vec<Sample>> = vec![Vec::new(); a.turns - 1];
        for rep in 0..a.repeats {
            let chain = endpoint(baton_api_gateway::auth::create_key(store.as_ref(), &format!("chain-{rep}"), "bench").await?);
            let first = format!("{history}\nRemember this list; I will ask about it.");
            let mut prev = stream_response(&http, &chain, &first, None, None).await.map_err(|e| anyhow::anyhow!("turn 1: {e}"))?;
            let mut messages = vec![Message { role: "user", content: first }, Message { role: "assistant", content: prev.reply.clone() }];
            for (k, q) in QUESTIONS.iter().take(a.turns - 1).enumerate() {
                let warm = stream_response(&http, &chain, q, Some(&prev.id), None).await.map_err(|e| anyhow::anyhow!("turn {}: {e}", k + 2))?;
                messages.push(Message { role: "user", content: q.to_string() });
                let cold_user = endpoint(baton_api_gateway::auth::create_key(store.as_ref(), &format!("cold-{rep}-{k}"), "bench").await?);
                let cold = stream_turn(&http, &cold_user, &messages, None).await.map_err(|e| anyhow::anyhow!("stateless turn {}: {e}", k + 2))?;
                messages.push(Message { role: "assistant", content: warm.reply.clone() });
                let (Some(w), Some(c)) = (warm.ttft, cold.ttft) else { bail!("turn {}: a reply without text (no TTFT)", k + 2) };
                eprintln!(
                    "  rep {rep} turn {}: chain ttft {:>7.1} ms (cached {} of {}), stateless cold ttft {:>7.1} ms (cached {} of {})",
                    k + 2,
                    ms(w),
                    warm.cached_tokens,
                    warm.input_tokens,
                    ms(c),
                    cold.cached_tokens,
                    cold.prompt_tokens
                );
                samples[k].push(Sample {
                    warm_ttft: w,
                    cold_ttft: c,
                    warm_input: warm.input_tokens,
                    warm_cached: warm.cached_tokens,
                    cold_input: cold.prompt_tokens,
                    cold_cached: cold.cached_tokens,
                });
                prev = warm;
            }
        }
        let _ = stop_tx.send(());
        let _ = server.await;
        let rows: Vec<TurnRow> = samples
            .iter()
            .enumerate()
            .map(|(k, s)| {
                let warm = median(s.iter().map(|x| ms(x.warm_ttft)).collect());
                let cold = median(s.iter().map(|x| ms(x.cold_ttft)).collect());
                TurnRow {
                    turn: k + 2,
                    warm_input_tokens: s.iter().map(|x| x.warm_input).min().unwrap_or(0),
                    warm_cached_tokens: s.iter().map(|x| x.warm_cached).min().unwrap_or(0),
                    warm_ttft_ms: warm,
                    cold_input_tokens: s.iter().map(|x| x.cold_input).min().unwrap_or(0),
                    cold_cached_tokens: s.iter().map(|x| x.cold_cached).max().unwrap_or(0),
                    cold_ttft_ms: cold,
                    speedup: if warm > 0.0 { cold / warm } else { 0.0 },
                }
            })
            .collect();
        anyhow::Ok(rows)
    })?;
    engine.shutdown();
    println!(
        "\n{:<6} {:>13} {:>13} {:>16} {:>14} {:>13} {:>16} {:>9}",
        "turn", "input tokens", "cached", "responses TTFT", "cold input", "cold cached", "cold TTFT", "speedup"
    );
    for r in &rows {
        println!(
            "{:<6} {:>13} {:>13} {:>13.1} ms {:>14} {:>13} {:>13.1} ms {:>8.1}x",
            r.turn, r.warm_input_tokens, r.warm_cached_tokens, r.warm_ttft_ms, r.cold_input_tokens, r.cold_cached_tokens, r.cold_ttft_ms, r.speedup
        );
    }
    let worst = rows.iter().map(|r| r.speedup).fold(f64::INFINITY, f64::min);
    println!("\nresponses chain vs stateless cold: TTFT {worst:.1}x lower at the least (medians of {} repeats)", a.repeats);
    if let Some(path) = &a.json {
        std::fs::write(path, serde_json::to_string_pretty(&rows)?).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
