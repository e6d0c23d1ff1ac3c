//! The engine on the CUDA backend, with a real model, against the CPU backend. On a
//! GPU host bench/gpu/run.sh points `BATON_MODEL` at the first 2 layers of SmolLM2
//! (cut by bench/gpu/prepare.sh: the full model does not travel to the device tool).
//! Without a GPU every test says loudly that it was skipped (and fails when
//! `BATON_REQUIRE_GPU=1`).
//!
//! - One forward pass: each row's logits correlate with the CPU's (Pearson >= 0.98;
//!   the GPU multiplies bf16-expanded weights and bf16 activations, the CPU quantized
//!   weights and int8 activations, so they differ in the last bits, not in shape) and
//!   at least 70% of the rows pick the same top token (the bounds of the fp8-KV test,
//!   `kv_fp8.rs`, for a difference of the same size).
//! - Gemma 3 (`BATON_GEMMA_MODEL`, a cut of 2 layers on the GPU host) the same way:
//!   every family op beyond Llama's on the GPU in a real model.
//! - The determinism contract on the GPU: a greedy request gives the same tokens alone,
//!   with smaller prefill chunks and in a batch of mixed requests, and the engine ends
//!   with no block held.
#![cfg(feature = "cuda")]

mod common;

use std::io::Write;

use baton_engine::kv::OwnerId;
use baton_engine::model::load_gguf;
use baton_engine::{Engine, EngineConfig, Request};
use baton_kernels::{CpuBackend, CudaBackend, KvDtype};
use baton_text::sampling::SamplingParams;
use common::*;

fn gpu() -> Option<CudaBackend> {
    match CudaBackend::new(0) {
        Ok(b) => Some(b),
        Err(e) if std::env::var("BATON_REQUIRE_GPU").as_deref() == Ok("1") => panic!("BATON_REQUIRE_GPU=1 but {e}"),
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "\n!!!!! SKIPPED: {e}; the engine on CUDA is NOT tested !!!!!\n");
            None
        }
    }
}

fn argmax(v: &[f32]) -> usize {
    v.iter().enumerate().fold(0, |best, (i, &x)| if x > v[best] { i } else { best })
}

#[test]
fn one_forward_pass_matches_the_cpu() {
    let Some(g) = gpu() else { return };
    let Some(path) = model_path() else { return };
    let c = CpuBackend::new(2).unwrap();
    let on_cpu = load_gguf(&c, &path).expect("load on the CPU");
    let on_gpu = load_gguf(&g, &path).expect("load on the GPU");
    let tokens: Vec<u32> = on_cpu.tokenizer.encode("<|im_start|>user\nWhy is the sky blue at noon and red at sunset?<|im_end|>\n", true).unwrap();
    let rows: Vec<usize> = (0..tokens.len()).collect();
    for dtype in [KvDtype::F16, KvDtype::BF16, KvDtype::F8E4M3] {
        let want = logits_at(&c, &on_cpu.model, &tokens, &rows, dtype);
        let got = logits_at(&g, &on_gpu.model, &tokens, &rows, dtype);
        let worst = want.iter().zip(&got).map(|(w, h)| pearson(w, h)).fold(1.0f64, f64::min);
        let same_top = want.iter().zip(&got).filter(|(w, h)| argmax(w) == argmax(h)).count();
        println!("{dtype:?} KV: worst Pearson {worst:.5}; {same_top} of {} rows pick the same top token", rows.len());
        assert!(worst >= 0.98, "{dtype:?}: Pearson {worst:.5} between CPU and GPU logits");
        assert!(same_top * 10 >= rows.len() * 7, "{dtype:?}: only {same_top} of {} rows agree on the top token", rows.len());
    }
}

/// Gemma 3 on the GPU: GeGLU, QK-norm, the embedding scale, post norms and its local
/// and global layers (sliding-window attention, two rotary tables). On the GPU host
/// `BATON_GEMMA_MODEL` is bench/gpu/prepare.sh's cut (2 layers, an 8,192-token
/// vocabulary, a window of 24 tokens with every second layer global, so that it is
/// carried under 64 MiB and a 120-token prompt crosses the window); the bounds are
/// SmolLM2's above.
#[test]
fn gemma3_forward_pass_matches_the_cpu() {
    let Some(g) = gpu() else { return };
    let Some(path) = gemma_path() else { return };
    for dtype in [KvDtype::F16, KvDtype::BF16, KvDtype::F8E4M3] {
        let r = common::families::compare(&g, &path, 120, 1, dtype);
        println!("Gemma 3, {dtype:?} KV: worst Pearson {:.5}; {} of {} rows pick the same top token", r.worst_pearson, r.same_top, r.rows);
        assert!(r.worst_pearson >= 0.98, "Gemma 3, {dtype:?}: Pearson {:.5} between CPU and GPU logits", r.worst_pearson);
        assert!(r.same_top * 10 >= r.rows * 7, "Gemma 3, {dtype:?}: only {} of {} rows agree on the top token", r.same_top, r.rows);
    }
}

fn gpu_engine(step_tokens: usize) -> Option<Engine> {
    let g = gpu()?;
    let path = model_path()?;
    let loaded = load_gguf(&g, &path).expect("load on the GPU");
    let config = EngineConfig { step_token_budget: step_tokens, kv_memory_bytes: 256 << 20, max_context: Some(2048), ..EngineConfig::default() };
    Some(Engine::start(g, loaded, config).expect("engine on the GPU"))
}

#[test]
fn greedy_replies_on_the_gpu_do_not_depend_on_batch_or_chunks() {
    let Some(e) = gpu_engine(512) else { return };
    let prompt = chat_prompt(&e, "You are a careful assistant.", "Explain in two sentences why bread rises when it is baked.");
    let alone = collect(e.submit(request(prompt.clone(), "alice", 24)).unwrap());
    assert_eq!(alone.tokens.len(), 24);
    assert_no_leaks(&e);
    e.shutdown();

    let e = gpu_engine(16).unwrap();
    let chunked = collect(e.submit(request(prompt.clone(), "alice", 24)).unwrap());
    assert_eq!(chunked.tokens, alone.tokens, "prefill in chunks of 16 tokens");
    let mut streams = Vec::new();
    for i in 0..6 {
        let p = chat_prompt(&e, "You are terse.", &format!("List {} rivers of Europe.", 2 + i * 3));
        let sampling = SamplingParams { max_tokens: 8 + i * 5, temperature: 0.7, seed: Some(i as u64), ..Default::default() }.validate().unwrap();
        streams.push(e.submit(Request { prompt: p, owner: OwnerId::parse(format!("u{i}")).unwrap(), platform_prefix_len: 0, conversation: None, sampling, ignore_eos: true }).unwrap());
        if i == 2 {
            streams.push(e.submit(request(prompt.clone(), "bob", 24)).unwrap());
        }
    }
    let outcomes: Vec<_> = streams.into_iter().map(collect).collect();
    assert_eq!(outcomes[3].tokens, alone.tokens, "in a batch of 7 mixed requests");
    assert_no_leaks(&e);
    e.shutdown();
}

/// Run-ahead decoding on the GPU (`baton_kernels::run_ahead`): step N+1 queued with
/// its tokens copied on the device from step N's picks, before the host reads them.
/// Eight greedy streams (one of them stopped by a token only the host sees) get the
/// same tokens with and without; the time the batch takes is printed both ways.
#[test]
fn run_ahead_on_the_gpu_gives_the_same_replies() {
    let Some(probe) = gpu() else { return };
    drop(probe);
    let Some(path) = model_path() else { return };
    let run = |run_ahead: bool, stop: Option<u32>| {
        let g = gpu().unwrap().with_run_ahead(run_ahead);
        let loaded = load_gguf(&g, &path).expect("load on the GPU");
        let config = EngineConfig { step_token_budget: 512, kv_memory_bytes: 256 << 20, max_context: Some(2048), ..EngineConfig::default() };
        let e = Engine::start(g, loaded, config).expect("engine on the GPU");
        let t0 = std::time::Instant::now();
        let streams: Vec<_> = (0..8)
            .map(|i| {
                let p = chat_prompt(&e, "You are terse.", &format!("Name {} birds that live near water.", 2 + i));
                let mut params = SamplingParams { max_tokens: 40 + 7 * i, temperature: 0.0, ..Default::default() };
                if i == 5 {
                    params.stop_token_ids = stop.into_iter().collect();
                }
                e.submit(Request { prompt: p, owner: OwnerId::parse(format!("u{i}")).unwrap(), platform_prefix_len: 0, conversation: None, sampling: params.validate().unwrap(), ignore_eos: true }).unwrap()
            })
            .collect();
        let outs: Vec<Vec<u32>> = streams.into_iter().map(|s| collect(s).tokens).collect();
        let took = t0.elapsed();
        assert_no_leaks(&e);
        let st = e.stats();
        e.shutdown();
        (outs, took, st)
    };
    let (waited, t_waited, st_waited) = run(false, None);
    let (ahead, t_ahead, st_ahead) = run(true, None);
    println!(
        "run-ahead decoding, 8 greedy streams of 40-89 tokens: {:.1} ms waiting for each step's tokens, {:.1} ms running ahead ({} of {} steps ran ahead)",
        t_waited.as_secs_f64() * 1e3,
        t_ahead.as_secs_f64() * 1e3,
        st_ahead.run_ahead_steps,
        st_ahead.steps
    );
    assert_eq!(st_waited.run_ahead_steps, 0);
    assert!(st_ahead.run_ahead_steps > 0, "no step ran ahead on the GPU: {st_ahead:?}");
    assert_eq!(ahead, waited, "greedy replies with and without run-ahead");
    let stop = waited[5][10];
    let first = waited[5].iter().position(|&t| t == stop).unwrap();
    let (stopped, _, st_stopped) = run(true, Some(stop));
    let mut want = waited.clone();
    want[5].truncate(first + 1);
    assert_eq!(stopped, want, "a stream stopped while a step ran ahead of it");
    assert_eq!(st_stopped.run_ahead_discarded_rows, 1);
}
