//! Writes a copy of a GGUF model (any architecture Baton reads) with only its first N
//! layers: the same tokenizer, embedding, output head and per-layer tensors, bit for
//! bit, and `<arch>.block_count` set to N. A small real model for checks on machines a
//! full model cannot reach (bench/gpu/prepare.sh carries cut models to the GPU host,
//! under its 64 MiB).
//!
//!   cargo run --release -p baton-engine --example gguf_first_layers -- IN.gguf OUT.gguf 4
//!
//! Options for a model whose embedding alone is over the limit (Gemma 3 270M: 262,144
//! tokens x 640):
//! - `--vocab V`: keeps the first V rows of the embedding (and of an untied output
//!   head) and the first V entries of the tokenizer's arrays. A BPE vocabulary
//!   (SmolLM2's) keeps only the merges whose two parts and result are all kept, in
//!   their order, so the cut tokenizer still loads and still merges what it can.
//! - `--sliding-window W`, `--sliding-window-pattern P`: rewrites the window and the
//!   local/global period, so that a cut of a few layers still has a global layer and a
//!   short prompt still reaches past the window (a parity check then covers both kinds
//!   of layer).

use std::path::Path;

use baton_text::gguf::writer::{write_gguf, TensorSpec};
use baton_text::gguf::{GgufFile, MetaValue};

type Error = Box<dyn std::error::Error>;

/// The merges of a BPE vocabulary cut to its first `vocab` tokens: those whose two
/// parts and whose result are all still tokens (a merge naming a dropped token would
/// make the tokenizer refuse the file), in their original order (the order is the rank).
fn kept_merges(f: &GgufFile, merges: &[MetaValue], vocab: usize) -> Result<Vec<MetaValue>, Error> {
    let Some(MetaValue::Array(tokens)) = f.get("tokenizer.ggml.tokens") else {
        return Err("tokenizer.ggml.tokens is not an array".into());
    };
    let kept: std::collections::HashSet<&str> =
        tokens[..vocab].iter().map(|t| if let MetaValue::String(s) = t { Ok(s.as_str()) } else { Err("a token is not a string") }).collect::<Result<_, _>>()?;
    let mut out = Vec::new();
    for m in merges {
        let MetaValue::String(m) = m else { return Err("a merge is not a string".into()) };
        let (a, b) = m.split_once(' ').ok_or_else(|| format!("merge {m:?} is not two tokens"))?;
        if kept.contains(a) && kept.contains(b) && kept.contains(format!("{a}{b}").as_str()) {
            out.push(MetaValue::String(m.clone()));
        }
    }
    Ok(out)
}

/// The command line: positional arguments and the options above.
struct Args {
    input: String,
    output: String,
    layers: u32,
    vocab: Option<u32>,
    window: Option<u32>,
    pattern: Option<u32>,
}

fn parse() -> Result<Args, Error> {
    const USAGE: &str = "usage: gguf_first_layers IN.gguf OUT.gguf N_LAYERS [--vocab V] [--sliding-window W] [--sliding-window-pattern P]";
    let mut positional = Vec::new();
    let (mut vocab, mut window, mut pattern) = (None, None, None);
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let slot = match a.as_str() {
            "--vocab" => &mut vocab,
            "--sliding-window" => &mut window,
            "--sliding-window-pattern" => &mut pattern,
            flag if flag.starts_with("--") => return Err(format!("unknown option {flag}; {USAGE}").into()),
            _ => {
                positional.push(a);
                continue;
            }
        };
        let v = it.next().ok_or_else(|| format!("{a} needs a value; {USAGE}"))?;
        *slot = Some(v.parse::<u32>().map_err(|_| format!("{a}: not a number: {v}"))?);
    }
    let [input, output, layers] = <[String; 3]>::try_from(positional).map_err(|_| USAGE)?;
    let layers = layers.parse().map_err(|_| format!("N_LAYERS: not a number: {layers}"))?;
    Ok(Args { input, output, layers, vocab, window, pattern })
}

fn main() -> Result<(), Error> {
    let a = parse()?;
    let f = GgufFile::open(Path::new(&a.input))?;
    let arch = f.get_str("general.architecture")?.to_string();
    let key = |k: &str| format!("{arch}.{k}");
    let total = f.get_u32(&key("block_count"))?;
    if a.layers == 0 || a.layers > total {
        return Err(format!("N_LAYERS must be 1..={total}").into());
    }
    let n_vocab = f.opt_array_len("tokenizer.ggml.tokens").ok_or("the file has no tokenizer.ggml.tokens")?;
    let vocab = match a.vocab {
        Some(v) if v == 0 || v as u64 > n_vocab => return Err(format!("--vocab must be 1..={n_vocab}").into()),
        Some(v) => v as u64,
        None => n_vocab,
    };
    let mut metadata = Vec::new();
    for (k, v) in &f.metadata {
        // A special token the cut vocabulary no longer has would load as a bad id.
        if let Some(id) = v.as_i128().filter(|&id| k.starts_with("tokenizer.ggml.") && k.ends_with("_token_id") && id >= vocab as i128) {
            return Err(format!("{k} = {id} is past the cut vocabulary of {vocab}").into());
        }
        let v = match v {
            _ if *k == key("block_count") => MetaValue::U32(a.layers),
            _ if *k == key("vocab_size") => MetaValue::U32(vocab as u32),
            MetaValue::Array(items) if k.starts_with("tokenizer.ggml.") && items.len() as u64 == n_vocab => MetaValue::Array(items[..vocab as usize].to_vec()),
            MetaValue::Array(merges) if k == "tokenizer.ggml.merges" && vocab < n_vocab => MetaValue::Array(kept_merges(&f, merges, vocab as usize)?),
            other => other.clone(),
        };
        metadata.push((k.clone(), v));
    }
    for (name, v) in [("attention.sliding_window", a.window), ("attention.sliding_window_pattern", a.pattern)] {
        if let Some(v) = v {
            metadata.retain(|(k, _)| *k != key(name));
            metadata.push((key(name), MetaValue::U32(v)));
        }
    }
    let layer_of = |name: &str| name.strip_prefix("blk.").and_then(|r| r.split('.').next()).and_then(|i| i.parse::<u32>().ok());
    let mut tensors = Vec::new();
    for t in f.tensors.iter().filter(|t| layer_of(&t.name).is_none_or(|i| i < a.layers)) {
        let mut data = f.tensor_data_checked(t)?.to_vec();
        let mut dims = t.dims.clone();
        // A matrix with a row per token (ggml order: dims[1] is the row count).
        if vocab < n_vocab && dims.len() == 2 && dims[1] == n_vocab {
            data.truncate((data.len() as u64 / n_vocab * vocab) as usize);
            dims[1] = vocab;
        }
        tensors.push(TensorSpec::new(t.name.clone(), &dims, t.ggml_type, data));
    }
    write_gguf(Path::new(&a.output), &metadata, &tensors)?;
    let bytes = std::fs::metadata(&a.output)?.len();
    println!("{}: {} of {total} layers, {vocab} of {n_vocab} tokens, {} tensors, {:.1} MiB", a.output, a.layers, tensors.len(), bytes as f64 / (1 << 20) as f64);
    Ok(())
}
