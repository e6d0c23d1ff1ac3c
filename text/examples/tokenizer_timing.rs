//! Tokenizer load and encode cost on a real GGUF (either kind), printed.
//!
//!     cargo run --release -p baton-text --example tokenizer_timing -- MODEL.gguf [BYTES]
//!
//! Encodes the first BYTES (default 4096) of the tokenizer corpus joined by
//! spaces; prints the best and median of 200 encodes. Timings on a shared
//! machine are noisy: compare runs made side by side.

use std::time::{Duration, Instant};

use baton_text::gguf::GgufFile;
use baton_text::tokenizer::Tokenizer;

fn main() {
    let mut args = std::env::args().skip(1);
    let path = args
        .next()
        .expect("usage: tokenizer_timing MODEL.gguf [BYTES]");
    let bytes: usize = args.next().map_or(4096, |b| b.parse().expect("BYTES"));
    let t0 = Instant::now();
    let g = GgufFile::open(std::path::Path::new(&path)).expect("open GGUF");
    let t1 = Instant::now();
    let tok = Tokenizer::from_gguf(&g).expect("tokenizer");
    let t2 = Instant::now();
    println!(
        "{path}: {} ({} tokens): GGUF read {:?}, tokenizer built {:?}",
        tok.model(),
        tok.vocab_size(),
        t1 - t0,
        t2 - t1
    );
    let corpus: Vec<String> =
        serde_json::from_str(include_str!("../../engine/tests/golden/tokenizer_corpus.json"))
            .expect("corpus");
    let mut text = corpus.join(" ");
    while text.len() < bytes {
        text = format!("{text} {text}");
    }
    let mut cut = bytes.min(text.len());
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    let text = &text[..cut];
    for parse_special in [true, false] {
        let mut times: Vec<Duration> = Vec::new();
        let mut n = 0;
        for _ in 0..200 {
            let t = Instant::now();
            n = tok.encode(text, parse_special).expect("encode").len();
            times.push(t.elapsed());
        }
        times.sort();
        println!(
            "encode {} bytes -> {n} tokens (parse_special={parse_special}): best {:?}, median {:?}",
            text.len(),
            times[0],
            times[times.len() / 2]
        );
    }
}
