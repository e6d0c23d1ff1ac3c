//! Shared helpers of the engine's integration tests.
#![allow(dead_code)]

use baton_engine::kv::OwnerId;
use baton_engine::model::{load_gguf, LoadedModel};
use baton_text::sampling::SamplingParams;
use baton_engine::{Engine, EngineConfig, Event, Request};
use baton_text::{FinishReason, Usage};
use baton_engine::model::{Model, Scratch, StepInput};
use baton_kernels::{AttnRow, Backend, CpuBackend, KvDtype, KvLayout};
use std::path::PathBuf;

pub mod families;

/// The default model, or `None` (the test then says it is skipped). CI
/// always fetches it first (scripts/fetch-model.sh). Resolved as that script
/// does: `BATON_MODEL` (used as given), else `BATON_MODEL_CACHE`, `XDG_CACHE_HOME/baton/models`
/// or `~/.cache/baton/models`.
pub fn model_path() -> Option<PathBuf> {
    cached_model("BATON_MODEL", "SmolLM2-135M-Instruct.Q4_1.gguf", "model", "scripts/fetch-model.sh")
}

/// Gemma 3 270M: `BATON_GEMMA_MODEL`, else the model cache (as
/// scripts/fetch-model.sh gemma3 leaves it); `None` (skipped) when absent.
pub fn gemma_path() -> Option<PathBuf> {
    cached_model("BATON_GEMMA_MODEL", "gemma-3-270m-q4_k_m.gguf", "Gemma 3", "scripts/fetch-model.sh gemma3")
}

/// SmolLM2 requantized by llama.cpp to `kind` (`Q4_K_M` or `Q6_K`): `BATON_SMOLLM2_<kind>_MODEL`,
/// else the model cache, where scripts/llamacpp/requantize.sh puts it (it needs a llama.cpp
/// build, so CI does not make these files and their tests skip there).
pub fn smollm2_requantized_path(kind: &str) -> Option<PathBuf> {
    cached_model(
        &format!("BATON_SMOLLM2_{kind}_MODEL"),
        &format!("SmolLM2-135M-Instruct.{kind}.gguf"),
        &format!("SmolLM2 {kind}"),
        "scripts/llamacpp/build.sh, then scripts/llamacpp/requantize.sh",
    )
}

/// A model file: the path in `env_var` (used as given: a wrong path fails the test),
/// else `file` in the model cache, found as scripts/fetch-model.sh puts it
/// (`BATON_MODEL_CACHE`, `XDG_CACHE_HOME/baton/models` or `~/.cache/baton/models`).
/// `None` when absent, saying that `what` is skipped and that `fetch` fetches it.
fn cached_model(env_var: &str, file: &str, what: &str, fetch: &str) -> Option<PathBuf> {
    if let Some(p) = std::env::var_os(env_var) {
        return Some(PathBuf::from(p));
    }
    let p = baton_text::model_cache::model_cache_dir()?.join(file);
    if p.exists() {
        Some(p)
    } else {
        eprintln!("skipped: {what} not found at {}; run {fetch}", p.display());
        None
    }
}

pub fn load(threads: usize) -> Option<(CpuBackend, LoadedModel<CpuBackend>)> {
    Some(load_file(&model_path()?, threads))
}

/// The model at `path` on a CPU backend of `threads` threads.
pub fn load_file(path: &std::path::Path, threads: usize) -> (CpuBackend, LoadedModel<CpuBackend>) {
    let backend = CpuBackend::new(threads).expect("threads");
    let loaded = load_gguf(&backend, path).expect("load model");
    (backend, loaded)
}

pub fn engine(config: EngineConfig) -> Option<Engine> {
    let (backend, loaded) = load(2)?;
    Some(Engine::start(backend, loaded, config).expect("engine start"))
}

pub fn greedy(max_tokens: usize) -> baton_text::sampling::ValidSamplingParams {
    SamplingParams { max_tokens, temperature: 0.0, ..SamplingParams::default() }.validate().unwrap()
}

pub fn request(prompt: Vec<u32>, user: &str, max_tokens: usize) -> Request {
    Request { prompt, owner: OwnerId::parse(user).unwrap(), platform_prefix_len: 0, conversation: None, sampling: greedy(max_tokens), ignore_eos: true }
}

/// Everything a finished request produced.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub tokens: Vec<u32>,
    pub text: String,
    pub reason: FinishReason,
    pub usage: Usage,
}

pub fn collect(mut s: baton_engine::RequestStream) -> Outcome {
    let mut tokens = Vec::new();
    let mut text = String::new();
    loop {
        match s.blocking_next().expect("stream ended without a final event") {
            Event::Token(t) => {
                tokens.push(t.id);
                text.push_str(&t.text);
            }
            Event::Finished { reason, usage, trailing_text, .. } => {
                text.push_str(&trailing_text);
                return Outcome { tokens, text, reason, usage };
            }
            Event::Failed(e) => panic!("request failed: {e}"),
        }
    }
}

pub fn chat_prompt(engine: &Engine, system: &str, user: &str) -> Vec<u32> {
    use baton_text::chat_template::ChatMessage;
    let text = engine.template.render(&[ChatMessage::new("system", system), ChatMessage::new("user", user)], true).unwrap();
    engine.tokenizer.encode(&text, true).unwrap()
}

/// Waits until the engine has no sequence left and returns its stats.
pub fn settled(engine: &Engine) -> baton_engine::EngineStats {
    for _ in 0..2000 {
        let st = engine.stats();
        if st.running == 0 && st.waiting == 0 {
            return st;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    panic!("engine did not settle: {:?}", engine.stats());
}

/// Asserts no block is pinned and the accounting adds up.
pub fn assert_no_leaks(engine: &Engine) {
    let st = settled(engine);
    assert_eq!(st.kv.used, 0, "blocks still pinned: {:?}", st.kv);
    assert_eq!(st.kv.free + st.kv.cached, st.kv.total, "{:?}", st.kv);
    assert_eq!(st.kv.swapped, 0, "{:?}", st.kv);
    assert_eq!(st.kv.units_free + st.kv.units_cached, st.kv.units_total, "window layers' memory still held: {:?}", st.kv);
}

/// Logits at `rows` of one forward pass over `tokens` (one sequence, one
/// chunk), straight through the model without the scheduler.
pub fn logits_at<B: Backend>(backend: &B, model: &Model<B>, tokens: &[u32], rows: &[usize], dtype: KvDtype) -> Vec<Vec<f32>> {
    let c = &model.config;
    let layout = KvLayout { layers: c.n_layers, block_tokens: 16, kv_heads: c.n_kv_heads, head_dim: c.head_dim, dtype };
    let blocks = tokens.len().div_ceil(16);
    let mut kv = backend.kv(layout, blocks).unwrap();
    let table: Vec<u32> = (0..blocks as u32).collect();
    let positions: Vec<u32> = (0..tokens.len() as u32).collect();
    let slots: Vec<(u32, u32)> = (0..tokens.len()).map(|p| ((p / 16) as u32, (p % 16) as u32)).collect();
    let attn: Vec<AttnRow> = (0..tokens.len()).map(|p| AttnRow { block_table: &table, pos: p }).collect();
    let mut scratch = Scratch::new(backend);
    let input = StepInput { tokens, positions: &positions, slots: &slots, attn: &attn, logit_rows: rows };
    let flat = backend.run(|| model.forward(backend, &mut kv, &input, &mut scratch));
    flat.chunks_exact(c.vocab).map(|r| r.to_vec()).collect()
}

/// Pearson correlation of two logit vectors.
pub fn pearson(a: &[f32], b: &[f32]) -> f64 {
    let n = a.len() as f64;
    let (ma, mb) = (a.iter().map(|&x| x as f64).sum::<f64>() / n, b.iter().map(|&x| x as f64).sum::<f64>() / n);
    let (mut sab, mut saa, mut sbb) = (0.0, 0.0, 0.0);
    for (&x, &y) in a.iter().zip(b) {
        let (dx, dy) = (x as f64 - ma, y as f64 - mb);
        sab += dx * dy;
        saa += dx * dx;
        sbb += dy * dy;
    }
    sab / (saa.sqrt() * sbb.sqrt())
}

/// What a prefill engine hands over: the first token and the tail's blocks.
pub struct Prefilled {
    pub first: baton_engine::ImportedToken,
    pub export: baton_engine::KvExport,
}

impl Prefilled {
    /// The import a decode node builds from the handover.
    pub fn into_import(self) -> baton_engine::KvImport {
        baton_engine::KvImport { start_block: self.export.start_block, blocks: self.export.blocks.into(), first_token: Some(self.first) }
    }
}

/// Prefills `req` (one token) on `engine`, optionally over a `pulled` prefix, and
/// exports its blocks from `from_block`: what a prefill node does for a turn.
pub fn prefill(engine: &Engine, mut req: Request, from_block: usize, pulled: Option<baton_engine::KvImport>) -> Prefilled {
    use baton_engine::{ImportedToken, SubmitOptions};
    let mut p = req.sampling.clone().into_inner();
    p.max_tokens = 1;
    req.sampling = p.validate().unwrap();
    let sub = engine.submit_with(req, SubmitOptions { import: pulled, export_from_block: Some(from_block) }).unwrap();
    let mut stream = sub.stream;
    let mut first = None;
    loop {
        match stream.blocking_next().expect("final event") {
            Event::Token(t) => first = Some(ImportedToken { id: t.id, logprob: t.logprob.unwrap_or(0.0), top_logprobs: t.top_logprobs }),
            Event::Finished { .. } => break,
            Event::Failed(e) => panic!("prefill failed: {e}"),
        }
    }
    let export = sub.export.unwrap().blocking_recv().expect("export sent");
    Prefilled { first: first.expect("a first token"), export }
}
