//! `baton bench cluster`: time to first token of a cold long turn and of the
//! warm next turn (a short new message on top of the history), through the
//! cluster in this process (coordinator, decode node and prefill node over
//! gRPC and QUIC on loopback), once with every tail prefilled on the decode
//! node and once with long tails on the prefill node, beside the decode
//! node's own engine called in-process for the same requests: the difference
//! is the cluster's overhead.
//!
//! Every repetition runs as a fresh owner, so nothing is cached across
//! repetitions or modes and each cold turn is really cold.

use baton_proto::plane::{Expect, Plane, Role as IdRole};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use baton_engine::kv::{ConversationId, OwnerId};
use baton_text::sampling::SamplingParams;
use baton_engine::{Engine, Event, Request};
use baton_proto::node as pb;
use baton_proto::node::decode_node_client::DecodeNodeClient;
use clap::Args;
use tokio::sync::watch;

use crate::core_split::CoreSplit;
use crate::engine_args::EngineArgs;
use crate::up::{start_cluster, start_engines, ClusterSpec};
use baton_prefill_node::KvExportMode;

#[derive(Args, Debug)]
pub struct BenchClusterArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Prompt tokens of the cold turn.
    #[arg(long, default_value_t = 3000)]
    pub cold_tokens: usize,
    /// New tokens of the warm next turn (on top of the cold prompt and its reply).
    #[arg(long, default_value_t = 150)]
    pub warm_tokens: usize,
    /// Reply tokens per turn.
    #[arg(long, default_value_t = 16)]
    pub max_tokens: usize,
    /// Repetitions per mode (medians are reported).
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Uncached tails at least this long go to the prefill node in the remote mode.
    #[arg(long, default_value_t = 64)]
    pub remote_threshold: u32,
    /// Also write the results as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// One turn's timings.
#[derive(Clone, Copy, Debug, Default)]
struct Timing {
    ttft: Duration,
    total: Duration,
    cached: usize,
}

/// Medians of one mode.
#[derive(Debug, Default, serde::Serialize)]
struct ModeResult {
    mode: &'static str,
    cold_ttft_ms: f64,
    warm_ttft_ms: f64,
    cold_total_ms: f64,
    warm_total_ms: f64,
    warm_cached_tokens: usize,
}

pub fn run(a: BenchClusterArgs) -> Result<()> {
    if a.cold_tokens < 32 || a.warm_tokens == 0 || a.max_tokens == 0 || a.repeats == 0 {
        bail!("--cold-tokens must be at least 32 and --warm-tokens, --max-tokens, --repeats positive");
    }
    let model = a.engine.model_path();
    if !model.exists() {
        bail!("model {} not found; run `bash scripts/fetch-model.sh` or pass --model", model.display());
    }
    let mut engine_args = a.engine.clone();
    let need = a.cold_tokens + a.warm_tokens + 2 * a.max_tokens + 16;
    engine_args.max_context = Some(engine_args.max_context.unwrap_or(0).max(need));
    crate::process::runtime()?.block_on(async move {
        // One turn at a time: the engines do not compute at once, so each may use every thread.
        let engines = start_engines(&engine_args, CoreSplit::shared(engine_args.threads)).await?;
        let text = prompt_text(&engines.0, a.cold_tokens + a.warm_tokens)?;
        let (cold, extra) = text.split_at(a.cold_tokens);
        let extra = &extra[..a.warm_tokens];
        eprintln!("baton bench cluster: {} cold tokens, {} new warm tokens, {} reply tokens, {} repeats", a.cold_tokens, a.warm_tokens, a.max_tokens, a.repeats);

        let mut results = Vec::new();
        let single = engines.0.clone();
        results.push(measure("single engine", &a, cold, extra, |owner, prompt| in_process(single.clone(), owner, prompt, a.max_tokens)).await?);
        // The remote mode twice: KV shipped after the prefill (the baseline), then pipelined
        // (each layer while later layers compute), in the same process one after the other.
        let modes = [
            ("cluster, local prefill", u32::MAX, KvExportMode::Pipelined),
            ("cluster, remote, after", a.remote_threshold, KvExportMode::AfterPrefill),
            ("cluster, remote, pipelined", a.remote_threshold, KvExportMode::Pipelined),
        ];
        for (mode, threshold, kv_export) in modes {
            let (stop_tx, stop_rx) = watch::channel(false);
            let loopback = SocketAddr::from(([127, 0, 0, 1], 0));
            let spec = ClusterSpec {
                engine: &engine_args,
                split: CoreSplit::shared(engine_args.threads),
                model: &model,
                coordinator_listen: loopback,
                coordinator_http_listen: loopback,
                decode_http_listen: loopback,
                prefill_http_listen: loopback,
                local_prefill_threshold: threshold,
                kv_transport: baton_kv_transport::transport::select::TransportChoice::Quic,
                kv_export,
                insecure_plaintext_internal: false,
                admin_key: None,
                extra_names: Vec::new(),
                certs_out: None,
            };
            let mut cluster = start_cluster(spec, engines.clone(), stop_rx).await.context("starting the cluster")?;
            let grpc = format!("http://{}", cluster.decode_grpc);
            let plane = cluster.gateway_plane.clone();
            let r = measure(mode, &a, cold, extra, |owner, prompt| through_cluster(plane.clone(), grpc.clone(), owner, prompt, a.max_tokens)).await;
            let _ = stop_tx.send(true);
            while cluster.tasks.join_next().await.is_some() {}
            results.push(r?);
        }
        for e in [&engines.0, &engines.1] {
            e.shutdown();
        }
        print_table(&results);
        if let Some(path) = &a.json {
            std::fs::write(path, serde_json::to_string_pretty(&results)?).with_context(|| format!("writing {}", path.display()))?;
        }
        Ok(())
    })
}

/// Ordinary text tokens, as many as asked, from a long varied passage.
fn prompt_text(engine: &Engine, n: usize) -> Result<Vec<u32>> {
    const PASSAGE: &str = "The river rises in the high meadows, where snowmelt gathers in shallow pools before it finds a channel. \
        Farmers along its middle course have argued for centuries about the right to draw water in dry summers, and the courts \
        of three kingdoms kept records of those quarrels. Downstream the valley widens; towns grew at every ford, each with a \
        bridge, a market and a customs house. Engineers later straightened the bends to speed the barges, which raised floods \
        in the spring and lowered the wells in autumn. ";
    let mut out = Vec::with_capacity(n);
    let mut i = 0;
    while out.len() < n {
        let chunk = format!("Chapter {i}. {PASSAGE}");
        out.extend(engine.tokenizer.encode(&chunk, false).map_err(|e| anyhow::anyhow!("tokenizing the bench prompt: {e}"))?);
        i += 1;
    }
    out.truncate(n);
    Ok(out)
}

/// Runs the cold and warm turn `repeats` times with fresh owners; medians.
async fn measure<F, Fut>(mode: &'static str, a: &BenchClusterArgs, cold: &[u32], extra: &[u32], turn: F) -> Result<ModeResult>
where
    F: Fn(String, Vec<u32>) -> Fut,
    Fut: std::future::Future<Output = Result<(Timing, Vec<u32>)>>,
{
    let mut colds = Vec::new();
    let mut warms = Vec::new();
    for rep in 0..a.repeats {
        let owner = format!("bench-{}-{rep}-{}", mode.replace([' ', ','], ""), std::process::id());
        let (c, reply) = turn(owner.clone(), cold.to_vec()).await?;
        let mut next = cold.to_vec();
        next.extend(&reply);
        next.extend(extra);
        let (w, _) = turn(owner, next).await?;
        eprintln!("  {mode:<24} rep {rep}: cold ttft {:>7.1} ms, warm ttft {:>6.1} ms (cached {})", ms(c.ttft), ms(w.ttft), w.cached);
        colds.push(c);
        warms.push(w);
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let pick = |v: &[Timing], f: fn(&Timing) -> Duration| median(&mut v.iter().map(|t| ms(f(t))).collect());
    Ok(ModeResult {
        mode,
        cold_ttft_ms: pick(&colds, |t| t.ttft),
        warm_ttft_ms: pick(&warms, |t| t.ttft),
        cold_total_ms: pick(&colds, |t| t.total),
        warm_total_ms: pick(&warms, |t| t.total),
        warm_cached_tokens: warms.iter().map(|t| t.cached).min().unwrap_or(0),
    })
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn greedy(max_tokens: usize) -> Result<baton_text::sampling::ValidSamplingParams> {
    SamplingParams { max_tokens, temperature: 0.0, ..SamplingParams::default() }.validate().map_err(|e| anyhow::anyhow!("{e}"))
}

/// One turn on the engine itself, in this process.
async fn in_process(engine: Arc<Engine>, owner: String, prompt: Vec<u32>, max_tokens: usize) -> Result<(Timing, Vec<u32>)> {
    let req = Request {
        prompt,
        owner: OwnerId::parse(owner.clone())?,
        platform_prefix_len: 0,
        conversation: Some(ConversationId::parse(owner)?),
        sampling: greedy(max_tokens)?,
        ignore_eos: true,
    };
    let started = Instant::now();
    let mut stream = engine.submit(req)?;
    let mut t = Timing::default();
    let mut reply = Vec::new();
    loop {
        match stream.next().await {
            Some(Event::Token(tok)) => {
                if reply.is_empty() {
                    t.ttft = started.elapsed();
                }
                reply.push(tok.id);
            }
            Some(Event::Finished { usage, .. }) => {
                t.total = started.elapsed();
                t.cached = usage.cached_tokens;
                return Ok((t, reply));
            }
            Some(Event::Failed(e)) => return Err(e.into()),
            None => bail!("the engine stopped"),
        }
    }
}

/// One turn through the decode node's gRPC API (routing, remote prefill and KV transfer included).
async fn through_cluster(plane: Plane, grpc: String, owner: String, prompt: Vec<u32>, max_tokens: usize) -> Result<(Timing, Vec<u32>)> {
    let started = Instant::now();
    let endpoint = plane.endpoint(&grpc)?;
    let channel = plane.connect(&endpoint, Expect::Role(IdRole::Decode)).await.context("connecting to the decode node")?;
    let mut client = DecodeNodeClient::new(channel);
    let req = pb::GenerateRequest {
        turn: Some(pb::Turn { prompt, owner: owner.clone(), platform_prefix_len: 0, conversation: owner }),
        sampling: Some(pb::SamplingParams { temperature: 0.0, top_p: 1.0, max_tokens: max_tokens as u32, ignore_eos: true, ..Default::default() }),
        prefix_source: String::new(),
        prefix_source_node: String::new(),
    };
    let mut stream = client.generate(req).await.context("Generate")?.into_inner();
    let mut t = Timing::default();
    let mut reply = Vec::new();
    while let Some(ev) = stream.message().await.context("the token stream")? {
        match ev.event {
            Some(pb::generate_event::Event::Token(tok)) => {
                if reply.is_empty() {
                    t.ttft = started.elapsed();
                }
                reply.push(tok.id);
            }
            Some(pb::generate_event::Event::Finished(f)) => {
                t.total = started.elapsed();
                t.cached = f.usage.map(|u| u.cached_tokens as usize).unwrap_or(0);
                return Ok((t, reply));
            }
            None => bail!("an empty event from the decode node"),
        }
    }
    bail!("the stream ended without its final event")
}

fn print_table(results: &[ModeResult]) {
    println!("\n{:<26} {:>14} {:>14} {:>11} {:>14} {:>14} {:>12}", "mode", "cold TTFT ms", "warm TTFT ms", "cold/warm", "cold total ms", "warm total ms", "warm cached");
    for r in results {
        println!(
            "{:<26} {:>14.1} {:>14.1} {:>10.1}x {:>14.1} {:>14.1} {:>12}",
            r.mode,
            r.cold_ttft_ms,
            r.warm_ttft_ms,
            r.cold_ttft_ms / r.warm_ttft_ms.max(1e-6),
            r.cold_total_ms,
            r.warm_total_ms,
            r.warm_cached_tokens
        );
    }
    if let Some(single) = results.first() {
        println!("\ncluster overhead over the single engine (end to end, cold + warm turn):");
        for r in &results[1..] {
            let base = single.cold_total_ms + single.warm_total_ms;
            let total = r.cold_total_ms + r.warm_total_ms;
            println!("  {:<26} {:>+8.1} ms ({:>+5.1}% of end-to-end)", r.mode, total - base, 100.0 * (total - base) / total.max(1e-6));
        }
    }
    let find = |m: &str| results.iter().find(|r| r.mode == m);
    if let (Some(single), Some(after), Some(piped)) = (results.first(), find("cluster, remote, after"), find("cluster, remote, pipelined")) {
        let base = single.cold_total_ms + single.warm_total_ms;
        let over = |r: &ModeResult| r.cold_total_ms + r.warm_total_ms - base;
        println!(
            "\nremote-prefill overhead, KV shipped after the prefill -> pipelined: {:+.1} ms -> {:+.1} ms end to end; cold TTFT {:.1} ms -> {:.1} ms",
            over(after),
            over(piped),
            after.cold_ttft_ms,
            piped.cold_ttft_ms
        );
    }
    for line in judge_targets(results) {
        println!("{line}");
    }
}

/// Issue #38's targets, each judged `met` or `NOT met`: the cluster's overhead over the
/// single engine (end to end, cold + warm turn) at most 5% with local prefill and 10% with
/// remote (pipelined) prefill, and a warm turn's TTFT at least 5x lower than a cold one's
/// in every mode.
fn judge_targets(results: &[ModeResult]) -> Vec<String> {
    let Some(single) = results.first() else { return Vec::new() };
    let base = single.cold_total_ms + single.warm_total_ms;
    let share = |r: &ModeResult| {
        let total = r.cold_total_ms + r.warm_total_ms;
        100.0 * (total - base) / total.max(1e-6)
    };
    let verdict = |ok: bool| if ok { "met" } else { "NOT met" };
    let mut out = Vec::new();
    for (mode, limit) in [("cluster, local prefill", 5.0), ("cluster, remote, pipelined", 10.0)] {
        if let Some(r) = results.iter().find(|r| r.mode == mode) {
            let s = share(r);
            out.push(format!("target: {mode} overhead <= {limit:.0}% of end-to-end: {s:+.1}% ({})", verdict(s <= limit)));
        }
    }
    for r in results {
        let ratio = r.cold_ttft_ms / r.warm_ttft_ms.max(1e-6);
        out.push(format!("target: {} warm TTFT >= 5x lower than cold: {ratio:.1}x ({})", r.mode, verdict(ratio >= 5.0)));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mode(mode: &'static str, cold_ttft_ms: f64, warm_ttft_ms: f64, total_ms: f64) -> ModeResult {
        ModeResult { mode, cold_ttft_ms, warm_ttft_ms, cold_total_ms: total_ms / 2.0, warm_total_ms: total_ms / 2.0, warm_cached_tokens: 0 }
    }

    #[test]
    fn targets_are_judged_against_the_single_engine() {
        let results = [
            mode("single engine", 60.0, 10.0, 100.0),
            // 104 ms end to end: +3.8% of it.
            mode("cluster, local prefill", 60.0, 10.0, 104.0),
            mode("cluster, remote, after", 90.0, 30.0, 130.0),
            // 115 ms: +13.0%.
            mode("cluster, remote, pipelined", 70.0, 20.0, 115.0),
        ];
        let lines = judge_targets(&results);
        assert_eq!(lines[0], "target: cluster, local prefill overhead <= 5% of end-to-end: +3.8% (met)");
        assert_eq!(lines[1], "target: cluster, remote, pipelined overhead <= 10% of end-to-end: +13.0% (NOT met)");
        assert_eq!(lines[2], "target: single engine warm TTFT >= 5x lower than cold: 6.0x (met)");
        assert_eq!(lines[5], "target: cluster, remote, pipelined warm TTFT >= 5x lower than cold: 3.5x (NOT met)");
        assert_eq!(lines.len(), 6);
    }
}
