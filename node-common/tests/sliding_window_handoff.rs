//! Gemma 3's sliding-window layers over the real KV transport: a turn longer than the
//! 512-token window, prefilled on one engine and shipped over QUIC into a decode engine's
//! import, gives exactly the tokens of one engine doing both, while the local layers'
//! blocks before the window stay off the wire (the shipped bytes are smaller by exactly
//! those block-layers). The decode engine then holds blocks lacking their local layers:
//! a later prompt that shares only an early part of them must not read them (the match is
//! cut and it computes, giving the reference's tokens), and the conversation's next turn
//! still hits the cache.
//!
//! Needs Gemma 3 270M (`scripts/fetch-model.sh gemma3`, or `BATON_GEMMA_MODEL`); says it
//! is skipped otherwise.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use baton_engine::kv::OwnerId;
use baton_engine::model::load_gguf;
use baton_engine::{Engine, EngineConfig, Event, ImportedToken, KvImport, Request, SubmitOptions};
use baton_kernels::CpuBackend;
use baton_kv_transport::generate_dev_certs;
use baton_kv_transport::transport::select::TransportChoice;
use baton_node_common::kv::{parse_endpoint, transport_layout, ExportSource, KvNode};
use baton_text::sampling::SamplingParams;

fn gemma_path() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("BATON_GEMMA_MODEL") {
        return Some(PathBuf::from(p));
    }
    let p = baton_text::model_cache::model_cache_dir()?.join("gemma-3-270m-q4_k_m.gguf");
    if p.exists() {
        return Some(p);
    }
    eprintln!("skipped: Gemma 3 not found at {}; run scripts/fetch-model.sh gemma3", p.display());
    None
}

fn engine(path: &Path) -> Engine {
    let backend = CpuBackend::new(2).expect("threads");
    let loaded = load_gguf(&backend, path).expect("load Gemma 3");
    let config = EngineConfig { step_token_budget: 256, kv_memory_bytes: 96 << 20, max_context: Some(2048), tier2_bytes: 0, ..EngineConfig::default() };
    Engine::start(backend, loaded, config).expect("engine start")
}

fn request(prompt: Vec<u32>, max_tokens: usize) -> Request {
    let sampling = SamplingParams { max_tokens, temperature: 0.0, ..SamplingParams::default() }.validate().unwrap();
    Request { prompt, owner: OwnerId::parse("alice").unwrap(), platform_prefix_len: 0, conversation: None, sampling, ignore_eos: true }
}

/// Tokens and cached prompt tokens of a finished request.
async fn run(engine: &Engine, req: Request, import: Option<KvImport>) -> (Vec<u32>, usize) {
    let sub = engine.submit_with(req, SubmitOptions { import, export_from_block: None }).unwrap();
    let mut stream = sub.stream;
    let mut tokens = Vec::new();
    loop {
        match stream.next().await.expect("a final event") {
            Event::Token(t) => tokens.push(t.id),
            Event::Finished { usage, .. } => return (tokens, usage.cached_tokens),
            Event::Failed(e) => panic!("request failed: {e}"),
        }
    }
}

/// What a prefill node does: one token, and the prompt's blocks exported.
async fn prefill(engine: &Engine, mut req: Request) -> (ImportedToken, Vec<Vec<u8>>) {
    let mut p = req.sampling.clone().into_inner();
    p.max_tokens = 1;
    req.sampling = p.validate().unwrap();
    let sub = engine.submit_with(req, SubmitOptions { import: None, export_from_block: Some(0) }).unwrap();
    let mut stream = sub.stream;
    let mut first = None;
    loop {
        match stream.next().await.expect("a final event") {
            Event::Token(t) => first = Some(ImportedToken { id: t.id, logprob: t.logprob.unwrap_or(0.0), top_logprobs: t.top_logprobs }),
            Event::Finished { .. } => break,
            Event::Failed(e) => panic!("prefill failed: {e}"),
        }
    }
    (first.expect("a first token"), sub.export.unwrap().await.expect("the export").blocks)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_longer_than_the_window_ships_without_out_of_window_blocks_and_decodes_the_same() {
    let Some(path) = gemma_path() else { return };
    let (reference, prefiller, decoder) = (engine(&path), engine(&path), engine(&path));
    let info = &decoder.info;
    let window = info.layer_windows.iter().flatten().copied().max().expect("Gemma 3 has sliding-window layers");
    let local_layers = info.layer_windows.iter().filter(|w| w.is_some()).count();
    let bt = info.kv_layout.block_tokens;

    let mut text = String::new();
    let prompt = loop {
        text.push_str("The river flows past the old mill, and the miller counts his sacks of grain one by one. ");
        let t = decoder.tokenizer.encode(&format!("{text}\nWhat does the miller count? He counts"), true).unwrap();
        if t.len() > window + 150 && t.len() % bt != 0 {
            break t;
        }
    };
    let n = prompt.len();
    let (local, _) = run(&reference, request(prompt.clone(), 12), None).await;

    // Two nodes over QUIC on loopback; the decode node reserves by the model's windows.
    let certs = generate_dev_certs("test", &["decode-0", "prefill-0"]).unwrap();
    let loopback = "127.0.0.1:0".parse().unwrap();
    let layout = transport_layout(info).unwrap();
    let staging = 2 * n.div_ceil(bt);
    let decode = KvNode::start("decode-0", loopback, &certs.node_tls("decode-0").unwrap(), &TransportChoice::Quic, layout, staging)
        .unwrap()
        .with_windows(info.layer_windows.clone());
    let prefill_node = KvNode::start("prefill-0", loopback, &certs.node_tls("prefill-0").unwrap(), &TransportChoice::Quic, layout, 1).unwrap();
    let peer = parse_endpoint(&decode.endpoint).unwrap();

    let (first, blocks) = prefill(&prefiller, request(prompt.clone(), 12)).await;
    assert_eq!(first.id, local[0]);
    assert_eq!(blocks.len(), n.div_ceil(bt));
    let source = Arc::new(ExportSource { layout, blocks });
    let deadline = Duration::from_secs(60);

    // Everything, as a model without windows ships it.
    let sent = || prefill_node.sender.stats().snapshot().bytes;
    let full = decode.receiver.reserve(source.blocks.len(), Some(deadline)).unwrap();
    let before = sent();
    prefill_node.sender.send(&peer, full.grant(), source.clone(), source.ids()).await.unwrap();
    let full_bytes = sent() - before;
    let landed = full.finished().await.unwrap();
    decode.take_blocks(&landed).unwrap();

    // By the window: every local layer skips the blocks wholly before the window of the
    // row at the start of the prompt's last block.
    let res = decode.reserve_tail(0, source.blocks.len(), n, deadline).unwrap();
    let skipped_blocks = ((n / bt * bt + 1) - window) / bt;
    let expected = (local_layers * skipped_blocks * layout.bytes_per_block_layer()) as u64;
    assert_eq!(res.grant().skipped_bytes(), expected);
    let before = sent();
    prefill_node.sender.send(&peer, res.grant(), source.clone(), source.ids()).await.unwrap();
    let windowed_bytes = sent() - before;
    let saved = full_bytes - windowed_bytes;
    // Exactly the skipped block-layers, give or take a few frame headers.
    assert!(saved >= expected && saved < expected + 4096, "saved {saved} bytes, expected {expected}");
    eprintln!(
        "{n}-token prompt: {full_bytes} bytes shipped without the window, {windowed_bytes} with it ({saved} saved, {:.0}%)",
        100.0 * saved as f64 / full_bytes as f64
    );
    let landed = res.finished().await.unwrap();
    let bytes = decode.take_blocks(&landed).unwrap();
    assert_eq!(decode.staging_used(), 0);
    let import = KvImport { start_block: 0, blocks: bytes, first_token: Some(first) };
    let (remote, _) = run(&decoder, request(prompt.clone(), 12), Some(import)).await;
    assert_eq!(remote, local, "remote prefill with out-of-window blocks left out vs local");

    // A prompt sharing only the first 300 tokens: a row there reads blocks whose local
    // layers never arrived, so the decoder may not use them and computes the prompt.
    let mut early = prompt[..300].to_vec();
    early.extend(decoder.tokenizer.encode(" And then the miller sings a song about the", false).unwrap());
    let alice = OwnerId::parse("alice").unwrap();
    assert_eq!(decoder.cached_prefix_tokens(&early, &alice, 0).unwrap(), 0);
    let (want, _) = run(&reference, request(early.clone(), 8), None).await;
    let (got, cached) = run(&decoder, request(early, 8), None).await;
    assert_eq!(cached, 0, "the match over blocks lacking their local layers must be cut");
    assert_eq!(got, want, "a prompt diverging inside the shipped prefix");

    // The conversation's next turn starts past the window of every skipped block: it hits.
    let mut next = prompt.clone();
    next.extend(&local);
    next.extend(decoder.tokenizer.encode(" Then he counts the", false).unwrap());
    let (want, _) = run(&reference, request(next.clone(), 8), None).await;
    let (got, cached) = run(&decoder, request(next, 8), None).await;
    assert!(cached >= n / bt * bt, "the next turn matched only {cached} of {n} prompt tokens");
    assert_eq!(got, want, "the next turn over blocks lacking their local layers");
}
