//! Writes a copy of a Llama GGUF with only its first N layers: the same tokenizer,
//! embedding, output head and per-layer tensors, bit for bit, and `llama.block_count`
//! set to N. A small real model for checks on machines a full model cannot reach
//! (bench/gpu/prepare.sh carries a 4-layer SmolLM2 to the GPU host, under its 64 MiB).
//!
//!   cargo run --release -p baton-engine --example gguf_first_layers -- IN.gguf OUT.gguf 4

use std::path::Path;

use baton_text::gguf::writer::{write_gguf, TensorSpec};
use baton_text::gguf::{GgufFile, MetaValue};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [input, output, layers] = args.as_slice() else {
        return Err("usage: gguf_first_layers IN.gguf OUT.gguf N_LAYERS".into());
    };
    let keep: u32 = layers.parse().map_err(|_| format!("N_LAYERS: not a number: {layers}"))?;
    let f = GgufFile::open(Path::new(input))?;
    let total = f.get_u32("llama.block_count")?;
    if keep == 0 || keep > total {
        return Err(format!("N_LAYERS must be 1..={total}").into());
    }
    let metadata: Vec<(String, MetaValue)> = f
        .metadata
        .iter()
        .map(|(k, v)| (k.clone(), if k == "llama.block_count" { MetaValue::U32(keep) } else { v.clone() }))
        .collect();
    let layer_of = |name: &str| name.strip_prefix("blk.").and_then(|r| r.split('.').next()).and_then(|i| i.parse::<u32>().ok());
    let mut tensors = Vec::new();
    for t in f.tensors.iter().filter(|t| layer_of(&t.name).is_none_or(|i| i < keep)) {
        tensors.push(TensorSpec::new(t.name.clone(), &t.dims, t.ggml_type, f.tensor_data_checked(t)?.to_vec()));
    }
    write_gguf(Path::new(output), &metadata, &tensors)?;
    let bytes = std::fs::metadata(output)?.len();
    println!("{output}: {keep} of {total} layers, {} tensors, {:.1} MiB", tensors.len(), bytes as f64 / (1 << 20) as f64);
    Ok(())
}
