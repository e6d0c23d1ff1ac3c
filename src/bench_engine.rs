//! `baton bench engine`: prefill tokens/s at 512 prompt tokens, decode
//! tokens/s at batch 1, 8 and 32, and peak memory, printed beside llama.cpp's
//! `llama-bench` (pp512 / tg128) on the same file when a build is present.

use crate::engine_args::EngineArgs;
use anyhow::{bail, Result};
use baton_engine::kv::OwnerId;
use baton_text::sampling::SamplingParams;
use baton_engine::{Engine, Event, Request};
use clap::Args;
use std::path::PathBuf;
use std::time::Duration;

/// The decode measurements' prompt when `--decode-context` is not given: a
/// short one, compared with llama-bench's decode from an empty context.
const DEFAULT_DECODE_CONTEXT: usize = 32;

#[derive(Args, Debug)]
pub struct BenchEngineArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Prompt tokens of the prefill measurement.
    #[arg(long, default_value_t = 512)]
    pub prompt_tokens: usize,
    /// Tokens generated per sequence in the decode measurements.
    #[arg(long, default_value_t = 128)]
    pub decode_tokens: usize,
    /// Batch sizes of the decode measurements.
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 8, 32])]
    pub batches: Vec<usize>,
    /// Prompt tokens of each sequence of the decode measurements: its context
    /// when decoding starts (a chat history of several turns is some hundreds).
    /// Above the default, llama-bench decodes after as many (`-d`).
    #[arg(long, default_value_t = DEFAULT_DECODE_CONTEXT)]
    pub decode_context: usize,
    /// Repetitions of each measurement (the best is reported).
    #[arg(long, default_value_t = 3)]
    pub reps: usize,
    /// llama.cpp's llama-bench binary; default: .cache/llamacpp/bin/llama-bench
    /// if present (built by scripts/llamacpp/build.sh).
    #[arg(long, env = "BATON_LLAMA_BENCH")]
    pub llama_bench: Option<PathBuf>,
    /// Skip llama-bench even when present.
    #[arg(long)]
    pub no_llama: bool,
}

/// Distinct synthetic prompt tokens (ordinary vocabulary IDs), so no two
/// runs share a cached prefix.
fn prompt(len: usize, salt: usize) -> Vec<u32> {
    (0..len).map(|i| 300 + ((i * 7919 + salt * 104_729) % 40_000) as u32).collect()
}

fn request(prompt: Vec<u32>, max_tokens: usize, owner: String) -> Result<Request> {
    Ok(Request {
        prompt,
        owner: OwnerId::parse(owner)?,
        platform_prefix_len: 0,
        conversation: None,
        sampling: SamplingParams { max_tokens, temperature: 0.0, ..SamplingParams::default() }.validate()?,
        ignore_eos: true,
    })
}

/// Runs `n` sequences at once; returns (time to the last first token,
/// decode tokens/s aggregated from each sequence's first to last token).
fn run_batch(engine: &Engine, n: usize, prompt_len: usize, max_tokens: usize, salt: usize) -> Result<(Duration, f64)> {
    let mut streams = Vec::new();
    for i in 0..n {
        streams.push(engine.submit(request(prompt(prompt_len, salt * 1000 + i), max_tokens, format!("bench-{salt}-{i}"))?)?);
    }
    let mut firsts = Vec::new();
    let mut lasts = Vec::new();
    let mut tokens = 0usize;
    for s in &mut streams {
        let mut first = None;
        let mut last = Duration::ZERO;
        while let Some(ev) = s.blocking_next() {
            match ev {
                Event::Token(t) => {
                    first.get_or_insert(t.elapsed);
                    last = t.elapsed;
                    tokens += 1;
                }
                Event::Finished { .. } => break,
                Event::Failed(e) => bail!(e),
            }
        }
        firsts.push(first.unwrap_or_default());
        lasts.push(last);
    }
    let first_all = firsts.iter().max().copied().unwrap_or_default();
    let last_all = lasts.iter().max().copied().unwrap_or_default();
    // Decode rate: tokens after each sequence's first, over the span from
    // the moment all sequences decode together to the last token.
    let decode_tokens = tokens.saturating_sub(n);
    let span = last_all.saturating_sub(first_all).as_secs_f64().max(1e-9);
    Ok((first_all, decode_tokens as f64 / span))
}

fn peak_rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("VmHWM:")).and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok()))
        .map_or(0.0, |kb| kb / 1024.0)
}

struct LlamaBench {
    pp: f64,
    tg: f64,
}

/// llama-bench's prefill rate at `pp` prompt tokens (from an empty context) and its
/// decode rate over `tg` tokens after `depth` tokens of context.
fn llama_bench(bin: &PathBuf, model: &std::path::Path, threads: usize, pp: usize, tg: usize, depth: usize) -> Result<LlamaBench> {
    let run = |pp: usize, tg: usize, depth: usize| -> Result<serde_json::Value> {
        let mut args = ["-m", &model.display().to_string(), "-t", &threads.to_string(), "-p", &pp.to_string(), "-n", &tg.to_string(), "-o", "json", "-r", "3"].map(String::from).to_vec();
        // Only when asked for: a llama-bench older than `-d` still serves the default.
        if depth > 0 {
            args.extend(["-d".to_string(), depth.to_string()]);
        }
        let out = std::process::Command::new(bin).args(args).output()?;
        if !out.status.success() {
            bail!("llama-bench failed: {}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(serde_json::from_slice(&out.stdout)?)
    };
    // A depth applies to every test of a run: the prefill test goes alone then.
    let runs = if depth == 0 { vec![run(pp, tg, 0)?] } else { vec![run(pp, 0, 0)?, run(0, tg, depth)?] };
    let mut r = LlamaBench { pp: 0.0, tg: 0.0 };
    for row in runs.iter().filter_map(|v| v.as_array()).flatten() {
        let ts = row.get("avg_ts").and_then(|x| x.as_f64()).unwrap_or(0.0);
        if row.get("n_prompt").and_then(|x| x.as_u64()).unwrap_or(0) > 0 {
            r.pp = ts;
        } else {
            r.tg = ts;
        }
    }
    Ok(r)
}

/// Blocks cached and the KV memory they hold, once the engine is idle: every layer of
/// every block in a plain arena, the units they hold in a grouped one.
fn cached_kv(engine: &Engine) -> (usize, usize) {
    for _ in 0..1000 {
        let st = engine.stats();
        if st.running == 0 && st.waiting == 0 {
            let k = st.kv;
            let bytes = match engine.info.kv_unit_bytes {
                None => k.cached * engine.info.kv_layout.block_bytes(),
                Some(unit) => k.units_cached * unit,
            };
            return (k.cached, bytes);
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    (0, 0)
}

pub fn run(a: BenchEngineArgs) -> Result<()> {
    let mut args = a.engine.clone();
    args.step_tokens = args.step_tokens.max(a.prompt_tokens);
    args.max_running = args.max_running.max(a.batches.iter().copied().max().unwrap_or(1));
    let engine = args.start()?;
    println!("baton engine benchmark");
    println!("  model    {}", engine.info.model_source);
    println!("  backend  {}", engine.info.backend);
    println!("  kv       {} blocks x {} tokens, {}", engine.info.kv_blocks, engine.info.kv_layout.block_tokens, engine.info.kv_layout.dtype.name());
    // Warm up (page in weights, grow buffers).
    run_batch(&engine, 1, 64, 4, 9999)?;

    let mut prefill = 0f64;
    // What one prompt's blocks hold once it is done (cached for a next turn).
    let mut kv_held = (0, 0);
    for rep in 0..a.reps {
        let before = cached_kv(&engine);
        let (ttft, _) = run_batch(&engine, 1, a.prompt_tokens, 1, 100 + rep)?;
        prefill = prefill.max(a.prompt_tokens as f64 / ttft.as_secs_f64());
        if rep == 0 {
            let after = cached_kv(&engine);
            kv_held = (after.0.saturating_sub(before.0), after.1.saturating_sub(before.1));
        }
    }
    let mut decode = Vec::new();
    for &b in &a.batches {
        let mut best = 0f64;
        for rep in 0..a.reps.clamp(1, 2) {
            let (_, rate) = run_batch(&engine, b, a.decode_context, a.decode_tokens, 200 + rep + b * 10)?;
            best = best.max(rate);
        }
        decode.push((b, best));
    }
    let peak = peak_rss_mib();
    let (engine_block_bytes, grouped) = (engine.info.kv_layout.block_bytes(), engine.info.kv_unit_bytes.is_some());
    engine.shutdown();

    let llama_bin = a.llama_bench.clone().or_else(|| {
        let p = PathBuf::from(".cache/llamacpp/bin/llama-bench");
        p.exists().then_some(p)
    });
    let llama = match (&llama_bin, a.no_llama) {
        (Some(bin), false) => match llama_bench(bin, &a.engine.model_path(), a.engine.threads, a.prompt_tokens, a.decode_tokens, if a.decode_context > DEFAULT_DECODE_CONTEXT { a.decode_context } else { 0 }) {
            Ok(r) => Some(r),
            Err(e) => {
                eprintln!("llama-bench: {e:#}");
                None
            }
        },
        _ => None,
    };
    println!();
    println!("{:<34} {:>12} {:>14} {:>8}", "measurement", "baton", "llama.cpp", "ratio");
    let row = |name: &str, ours: f64, theirs: Option<f64>| {
        let (t, r) = match theirs {
            Some(t) if t > 0.0 => (format!("{t:.1}"), format!("{:.2}x", ours / t)),
            _ => ("-".into(), "-".into()),
        };
        println!("{name:<34} {ours:>12.1} {t:>14} {r:>8}");
    };
    row(&format!("prefill tok/s (pp{})", a.prompt_tokens), prefill, llama.as_ref().map(|l| l.pp));
    for (b, rate) in &decode {
        let theirs = if *b == 1 { llama.as_ref().map(|l| l.tg) } else { None };
        let name = if a.decode_context == DEFAULT_DECODE_CONTEXT { format!("decode tok/s batch {b} (tg{})", a.decode_tokens) } else { format!("decode tok/s batch {b} (tg{} @ {})", a.decode_tokens, a.decode_context) };
        row(&name, *rate, theirs);
    }
    if let (Some((_, b1)), Some((bmax, bn))) = (decode.first(), decode.last()) {
        println!("aggregate decode batch {bmax} / batch 1: {:.2}x", bn / b1);
    }
    println!("peak memory (RSS): {peak:.0} MiB");
    let every_layer = kv_held.0 * engine_block_bytes;
    let mib = |b: usize| b as f64 / (1 << 20) as f64;
    println!(
        "kv memory of one {}-token prompt's {} cached blocks: {:.2} MiB ({}; every layer of every block: {:.2} MiB)",
        a.prompt_tokens,
        kv_held.0,
        mib(kv_held.1),
        if grouped { "window layers behind the window given back" } else { "plain arena" },
        mib(every_layer)
    );
    if llama.is_none() {
        println!("(llama.cpp not measured: build it with scripts/llamacpp/build.sh or pass --llama-bench)");
    }
    Ok(())
}
