//! `baton bench load`: multi-turn chat traffic against any OpenAI-compatible endpoint
//! (Baton's gateway, llama.cpp's `llama-server`, ...), shaped like the seed's workload
//! and scaled down to one machine.
//!
//! Each offered-load level opens N conversations at once; every conversation makes its
//! turns one after another, resending the whole history plus a new message and thinking
//! for an exponential time between turns (a closed loop, like real users). The run prints
//! a table per level with goodput (share and rate of turns inside the TTFT and per-turn
//! p95 ITL targets), and can write JSON and an SVG chart that also carries earlier runs
//! (`--compare`), so two servers measured with the same seed sit side by side.

pub mod chart;
mod client;
pub mod conversation;
mod report;
pub mod responses;
mod traffic;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use serde::{Deserialize, Serialize};

use crate::error::BadValue;

pub use client::{stream_turn, Endpoint, Message, SseEvent, SseParser, TurnError, TurnResult};
pub use report::{LevelReport, Percentiles, Targets};
pub use traffic::{system_prompt, ConversationScript, TrafficShape};

/// Flags of `baton bench load`.
#[derive(Args, Debug, Clone)]
pub struct LoadArgs {
    /// Base URL of the OpenAI-compatible API, up to and including `/v1`.
    #[arg(long, env = "BATON_BENCH_URL", default_value = "http://127.0.0.1:8080/v1")]
    pub url: String,
    /// Bearer token sent with every request.
    #[arg(long, env = "BATON_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Model name to request; default: the first one `/models` lists.
    #[arg(long)]
    pub model: Option<String>,
    /// Name of this run in the table, JSON and chart.
    #[arg(long, default_value = "server")]
    pub label: String,
    /// Offered-load levels: conversations open at once, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    pub levels: Vec<usize>,
    /// Turns each conversation makes.
    #[arg(long, default_value_t = 4)]
    pub turns: usize,
    /// Words of the shared system prompt.
    #[arg(long, default_value_t = 150)]
    pub system_words: usize,
    /// Words of an ordinary user message.
    #[arg(long, default_value_t = 25)]
    pub message_words: usize,
    /// Probability that a message is a long pasted document.
    #[arg(long, default_value_t = 0.05)]
    pub long_doc_probability: f64,
    /// Words of a pasted document.
    #[arg(long, default_value_t = 600)]
    pub long_doc_words: usize,
    /// Mean think time between a conversation's turns (exponential), e.g. `2s`, `500ms`.
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    pub think_time: Duration,
    /// Reply cap per turn.
    #[arg(long, default_value_t = 48)]
    pub max_tokens: usize,
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Goodput's time-to-first-token target: a turn is inside the SLO when its first
    /// token came within this and its own p95 inter-token gap is within --itl-target.
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    pub ttft_target: Duration,
    /// Goodput's inter-token latency target, against each turn's own p95 gap.
    #[arg(long, default_value = "50ms", value_parser = parse_duration)]
    pub itl_target: Duration,
    /// Seed of the traffic: the same seed offers the same messages and think times.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Send each conversation's ID in `X-Baton-Conversation` (Baton only); by default
    /// requests are plain OpenAI ones.
    #[arg(long)]
    pub conversation_header: bool,
    /// Which API the turns use: `chat` resends the whole history through
    /// `/chat/completions`; `responses` sends only each new message through
    /// `/responses`, chained by `previous_response_id` (the server keeps the history).
    #[arg(long, env = "BATON_BENCH_API", value_enum, default_value = "chat")]
    pub api: Api,
    /// Per-request timeout.
    #[arg(long, default_value = "300s", value_parser = parse_duration)]
    pub timeout: Duration,
    /// Write the run as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Draw latency percentiles over offered load into this SVG file.
    #[arg(long)]
    pub chart: Option<PathBuf>,
    /// Earlier runs' JSON files to print and draw beside this one.
    #[arg(long)]
    pub compare: Vec<PathBuf>,
}

/// The API a load run drives.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Api {
    Chat,
    Responses,
}

/// A whole run: what was offered and what each level measured.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RunReport {
    pub label: String,
    pub url: String,
    pub model: String,
    pub turns_per_conversation: usize,
    pub max_tokens: usize,
    pub seed: u64,
    pub levels: Vec<LevelReport>,
}

/// Parses `500ms`, `2s`, `1.5s`, `3m` or a bare number of seconds.
pub fn parse_duration(s: &str) -> Result<Duration, BadValue> {
    let s = s.trim();
    let (num, scale) = if let Some(v) = s.strip_suffix("ms") {
        (v, 1e-3)
    } else if let Some(v) = s.strip_suffix('s') {
        (v, 1.0)
    } else if let Some(v) = s.strip_suffix('m') {
        (v, 60.0)
    } else {
        (s, 1.0)
    };
    let not_a_duration = || BadValue::new(s, "a duration (use e.g. 500ms, 2s, 1m)");
    let v: f64 = num.trim().parse().map_err(|_| not_a_duration())?;
    if !(v.is_finite() && v >= 0.0) {
        return Err(not_a_duration());
    }
    Ok(Duration::from_secs_f64(v * scale))
}

/// Runs the command.
pub fn run(args: LoadArgs) -> Result<()> {
    if args.levels.is_empty() || args.levels.contains(&0) || args.turns == 0 {
        bail!("--levels must list positive conversation counts and --turns must be positive");
    }
    if !(0.0..=1.0).contains(&args.long_doc_probability) {
        bail!("--long-doc-probability must be within [0, 1]");
    }
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let report = rt.block_on(run_levels(&args))?;
    let targets = targets(&args);
    let mut out = String::new();
    let mut runs = Vec::new();
    for path in &args.compare {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let earlier: RunReport = serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        out.push_str(&report::table(&earlier.label, &earlier.levels, targets));
        out.push('\n');
        runs.push(earlier);
    }
    out.push_str(&report::table(&report.label, &report.levels, targets));
    crate::emit(&out)?;
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&report)?).with_context(|| format!("writing {}", path.display()))?;
    }
    runs.push(report);
    if let Some(path) = &args.chart {
        chart::draw(path, &runs)?;
    }
    Ok(())
}

fn targets(args: &LoadArgs) -> Targets {
    Targets { ttft_ms: args.ttft_target.as_secs_f64() * 1e3, itl_ms: args.itl_target.as_secs_f64() * 1e3 }
}

/// Runs every level against the endpoint and returns the report (no printing).
pub async fn run_levels(args: &LoadArgs) -> Result<RunReport> {
    let http = reqwest::Client::builder().timeout(args.timeout).build()?;
    let model = match &args.model {
        Some(m) => m.clone(),
        None => first_model(&http, &args.url, args.api_key.as_deref()).await?,
    };
    let endpoint = Endpoint {
        base_url: args.url.clone(),
        api_key: args.api_key.clone(),
        model: model.clone(),
        max_tokens: args.max_tokens,
        temperature: args.temperature,
    };
    let shape = TrafficShape {
        system_words: args.system_words,
        message_words: args.message_words,
        long_doc_probability: args.long_doc_probability,
        long_doc_words: args.long_doc_words,
        turns: args.turns,
        think_time: args.think_time,
        seed: args.seed,
    };
    let mut levels = Vec::new();
    for (i, &n) in args.levels.iter().enumerate() {
        // Fresh conversations per level, so one level's warm caches do not flatter the next.
        let first_index = (i as u64) << 32;
        levels.push(run_level(&http, &endpoint, &shape, n, first_index, args.conversation_header, args.api, targets(args)).await);
    }
    Ok(RunReport {
        label: args.label.clone(),
        url: args.url.clone(),
        model,
        turns_per_conversation: args.turns,
        max_tokens: args.max_tokens,
        seed: args.seed,
        levels,
    })
}

async fn first_model(http: &reqwest::Client, url: &str, key: Option<&str>) -> Result<String> {
    #[derive(Deserialize)]
    struct Models {
        data: Vec<ModelEntry>,
    }
    #[derive(Deserialize)]
    struct ModelEntry {
        id: String,
    }
    let mut req = http.get(format!("{}/models", url.trim_end_matches('/')));
    if let Some(k) = key {
        req = req.bearer_auth(k);
    }
    let resp = req.send().await.with_context(|| format!("listing models at {url}"))?;
    if !resp.status().is_success() {
        bail!("listing models at {url}: HTTP {}", resp.status());
    }
    let models: Models = resp.json().await.context("parsing /models")?;
    models.data.into_iter().next().map(|m| m.id).context("the server lists no model")
}

#[allow(clippy::too_many_arguments)]
async fn run_level(
    http: &reqwest::Client,
    endpoint: &Endpoint,
    shape: &TrafficShape,
    conversations: usize,
    first_index: u64,
    conversation_header: bool,
    api: Api,
    targets: Targets,
) -> LevelReport {
    let bar = indicatif::ProgressBar::new((conversations * shape.turns) as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{prefix:>12} [{bar:30}] {pos}/{len} turns {elapsed}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar.set_prefix(format!("{conversations} conv"));
    let system = Arc::new(system_prompt(shape));
    let start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for c in 0..conversations {
        let (http, endpoint, shape, system, bar) = (http.clone(), endpoint.clone(), shape.clone(), system.clone(), bar.clone());
        let index = first_index + c as u64;
        tasks.spawn(async move {
            let mut script = ConversationScript::new(&shape, index);
            let id = conversation_header.then(|| format!("load-{:x}-{index}", shape.seed));
            let mut history = vec![Message { role: "system", content: system.to_string() }];
            let mut previous: Option<String> = None;
            let mut results = Vec::new();
            let mut errors = Vec::new();
            // Stagger the start so conversations do not move in lockstep.
            let stagger = script.think_time().mul_f64(0.5);
            tokio::time::sleep(stagger).await;
            for turn in 0..shape.turns {
                if turn > 0 {
                    tokio::time::sleep(script.think_time()).await;
                }
                history.push(Message { role: "user", content: script.next_message() });
                let sent = match api {
                    Api::Chat => stream_turn(&http, &endpoint, &history, id.as_deref()).await,
                    // Only the new message: the server holds the history of the chain.
                    Api::Responses => {
                        let first = previous.is_none().then_some(system.as_str());
                        let message = &history[history.len() - 1].content;
                        responses::stream_response(&http, &endpoint, message, previous.as_deref(), first).await.map(|r| {
                            previous = Some(r.id.clone());
                            TurnResult::from(r)
                        })
                    }
                };
                match sent {
                    Ok(r) => {
                        history.push(Message { role: "assistant", content: r.reply.clone() });
                        results.push(r);
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, conversation = index, "turn failed");
                        errors.push(e.label());
                        // The turn is lost; the next one resends the history without it.
                        history.pop();
                    }
                }
                bar.inc(1);
            }
            (results, errors)
        });
    }
    let mut turns = Vec::new();
    let mut errors = Vec::new();
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok((r, e)) => {
                turns.extend(r);
                errors.extend(e);
            }
            Err(e) => errors.push(format!("task: {e}")),
        }
    }
    bar.finish_and_clear();
    LevelReport::new(conversations, start.elapsed(), &turns, &errors, targets)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_with_units_and_reject_garbage() {
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("2s").unwrap(), Duration::from_secs(2));
        assert_eq!(parse_duration("1.5").unwrap(), Duration::from_millis(1500));
        assert_eq!(parse_duration("1m").unwrap(), Duration::from_secs(60));
        assert!(parse_duration("fast").is_err());
        assert!(parse_duration("-1s").is_err());
    }
}
