//! `baton capacity`: size a chat fleet from a model, a GPU profile and a workload.
//!
//! Reproduces the seed's part-1 arithmetic from its inputs (the defaults are the seed's),
//! and takes the model from flags, an HF `config.json` or a GGUF header, the GPU from a
//! built-in datasheet profile, and optionally measured per-node prefill and decode rates
//! (flags or a `--from-bench` JSON) in place of the roofline estimates.
//!
//! Precedence for each model field: explicit flag, then the file, then the seed default.

#[cfg(test)]
pub(crate) mod fixture;
pub mod model;
pub mod plan;

use std::path::{Path, PathBuf};

use serde::Deserialize;

pub use model::ModelShape;
pub use plan::{plan, render, Inputs, Plan};

use crate::error::{invalid, BenchError};
use crate::hardware::{Dtype, Gpu};

/// Flags of `baton capacity`. Defaults are the seed's inputs.
#[derive(Debug, Clone, clap::Args)]
pub struct CapacityArgs {
    /// Read the model shape from a Hugging Face config.json.
    #[arg(long, env = "BATON_CAPACITY_CONFIG", conflicts_with = "gguf")]
    pub config: Option<PathBuf>,
    /// Read the model shape and exact parameter count from a GGUF file's header.
    #[arg(long, env = "BATON_CAPACITY_GGUF")]
    pub gguf: Option<PathBuf>,
    /// Transformer layers [default: 80, or from the model file].
    #[arg(long, env = "BATON_CAPACITY_LAYERS")]
    pub layers: Option<u64>,
    /// KV heads per layer [default: 8, or from the model file].
    #[arg(long, env = "BATON_CAPACITY_KV_HEADS")]
    pub kv_heads: Option<u64>,
    /// Head dimension [default: 128, or from the model file].
    #[arg(long, env = "BATON_CAPACITY_HEAD_DIM")]
    pub head_dim: Option<u64>,
    /// Parameter count, e.g. 70.6e9 [default: 70.6e9, or from the model file].
    #[arg(long, env = "BATON_CAPACITY_PARAMS")]
    pub params: Option<f64>,
    /// GPU datasheet profile.
    #[arg(long, env = "BATON_CAPACITY_GPU", value_enum, default_value_t = Gpu::H100)]
    pub gpu: Gpu,
    /// GPUs per node (tensor parallel degree).
    #[arg(long, env = "BATON_CAPACITY_GPUS_PER_NODE", default_value_t = 8)]
    pub gpus_per_node: u64,
    /// Element type of the weights (also picks the tensor-core rate for prefill).
    #[arg(long, env = "BATON_CAPACITY_WEIGHT_DTYPE", value_enum, default_value_t = Dtype::Fp8)]
    pub weight_dtype: Dtype,
    /// Element type of the KV cache.
    #[arg(long, env = "BATON_CAPACITY_KV_DTYPE", value_enum, default_value_t = Dtype::Fp8)]
    pub kv_dtype: Dtype,
    /// GB per GPU reserved for activations, CUDA graphs and runtime.
    #[arg(long, env = "BATON_CAPACITY_RESERVED_GB", default_value_t = 8.0)]
    pub reserved_gb: f64,
    /// Assumed fraction of peak HBM bandwidth achieved by decode.
    #[arg(long, env = "BATON_CAPACITY_DECODE_EFFICIENCY", default_value_t = 0.6)]
    pub decode_efficiency: f64,
    /// Assumed fraction of peak FLOP/s achieved by prefill.
    #[arg(long, env = "BATON_CAPACITY_PREFILL_MFU", default_value_t = 0.4)]
    pub prefill_mfu: f64,
    /// Open conversations at peak.
    #[arg(
        long,
        env = "BATON_CAPACITY_OPEN_CONVERSATIONS",
        default_value_t = 20_000.0
    )]
    pub open_conversations: f64,
    /// Seconds between a conversation's turns.
    #[arg(long, env = "BATON_CAPACITY_TURN_GAP_S", default_value_t = 60.0)]
    pub turn_gap_s: f64,
    /// Mean prompt tokens per turn (system prompt, history, new message).
    #[arg(long, env = "BATON_CAPACITY_PROMPT_TOKENS", default_value_t = 3_000.0)]
    pub prompt_tokens: f64,
    /// Mean reply tokens per turn.
    #[arg(long, env = "BATON_CAPACITY_OUTPUT_TOKENS", default_value_t = 400.0)]
    pub output_tokens: f64,
    /// Share of prompt tokens served from the prefix cache (0..1).
    #[arg(long, env = "BATON_CAPACITY_CACHED_SHARE", default_value_t = 0.8)]
    pub cached_share: f64,
    /// Largest decode batch per node that meets the ITL target.
    #[arg(long, env = "BATON_CAPACITY_MAX_BATCH", default_value_t = 256)]
    pub max_batch: u64,
    /// Target utilization of busy time.
    #[arg(long, env = "BATON_CAPACITY_TARGET_UTILIZATION", default_value_t = 0.6)]
    pub target_utilization: f64,
    /// Spare nodes on top of the utilization target.
    #[arg(long, env = "BATON_CAPACITY_SPARE_NODES", default_value_t = 1)]
    pub spare_nodes: u64,
    /// Measured prefill tokens/s per node (replaces the compute roofline).
    #[arg(long, env = "BATON_CAPACITY_MEASURED_PREFILL_TOKENS_PER_S")]
    pub measured_prefill_tokens_per_s: Option<f64>,
    /// Measured decode tokens/s per node at the max batch (replaces the bandwidth roofline).
    #[arg(long, env = "BATON_CAPACITY_MEASURED_DECODE_TOKENS_PER_S")]
    pub measured_decode_tokens_per_s: Option<f64>,
    /// JSON with `prefill_tokens_per_s` and `decode_tokens_per_s` (or the same keys with a
    /// `measured_` prefix), e.g. from `baton bench`. Explicit measured flags win.
    #[arg(long, env = "BATON_CAPACITY_FROM_BENCH")]
    pub from_bench: Option<PathBuf>,
    /// Print the plan as JSON instead of the table.
    #[arg(long, env = "BATON_CAPACITY_JSON")]
    pub json: bool,
}

/// Measured rates as written by a benchmark run.
#[derive(Debug, Deserialize)]
struct BenchRates {
    #[serde(alias = "measured_prefill_tokens_per_s")]
    prefill_tokens_per_s: Option<f64>,
    #[serde(alias = "measured_decode_tokens_per_s")]
    decode_tokens_per_s: Option<f64>,
}

fn read_bench(path: &Path) -> Result<BenchRates, BenchError> {
    let text = std::fs::read_to_string(path).map_err(|source| BenchError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let r: BenchRates = serde_json::from_str(&text).map_err(|source| BenchError::Json {
        path: path.to_path_buf(),
        source,
    })?;
    if r.prefill_tokens_per_s.is_none() && r.decode_tokens_per_s.is_none() {
        return Err(BenchError::MissingField {
            source_name: path.display().to_string(),
            field: "prefill_tokens_per_s or decode_tokens_per_s",
        });
    }
    Ok(r)
}

impl TryFrom<&CapacityArgs> for Inputs {
    type Error = BenchError;

    fn try_from(a: &CapacityArgs) -> Result<Self, BenchError> {
        let mut model = match (&a.config, &a.gguf) {
            (Some(p), _) => ModelShape::from_hf_config(p)?,
            (None, Some(p)) => ModelShape::from_gguf(p)?,
            (None, None) => ModelShape::seed(),
        };
        let from_file = a.config.is_some() || a.gguf.is_some();
        let mut overridden = false;
        for (flag, field) in [
            (a.layers, &mut model.layers),
            (a.kv_heads, &mut model.kv_heads),
            (a.head_dim, &mut model.head_dim),
        ] {
            if let Some(v) = flag {
                if v == 0 {
                    return Err(invalid(
                        "model shape",
                        "layers, heads and head dim must be > 0",
                    ));
                }
                *field = v;
                overridden = true;
            }
        }
        if let Some(p) = a.params {
            model.params = p;
            model.params_source = "given".into();
        } else if model.params <= 0.0 {
            return Err(BenchError::MissingField {
                source_name: model.source.clone(),
                field: "parameter count (pass --params)",
            });
        }
        if overridden {
            model.source = if from_file {
                format!("{} with flag overrides", model.source)
            } else {
                "flags".into()
            };
        }
        let bench = a.from_bench.as_deref().map(read_bench).transpose()?;
        let from_bench = |f: fn(&BenchRates) -> Option<f64>| bench.as_ref().and_then(f);
        Ok(Inputs {
            model,
            gpu: a.gpu.profile(),
            weight_dtype: a.weight_dtype,
            kv_dtype: a.kv_dtype,
            gpus_per_node: a.gpus_per_node,
            reserved_bytes_per_gpu: a.reserved_gb * 1e9,
            decode_efficiency: a.decode_efficiency,
            prefill_mfu: a.prefill_mfu,
            open_conversations: a.open_conversations,
            turn_gap_s: a.turn_gap_s,
            prompt_tokens: a.prompt_tokens,
            output_tokens: a.output_tokens,
            cached_share: a.cached_share,
            max_batch: a.max_batch,
            target_utilization: a.target_utilization,
            spare_nodes: a.spare_nodes,
            measured_prefill_tokens_per_s: a
                .measured_prefill_tokens_per_s
                .or_else(|| from_bench(|b| b.prefill_tokens_per_s)),
            measured_decode_tokens_per_s: a
                .measured_decode_tokens_per_s
                .or_else(|| from_bench(|b| b.decode_tokens_per_s)),
        })
    }
}

/// Entry point of `baton capacity`: prints the plan as a table, or JSON with `--json`.
pub fn run(args: CapacityArgs) -> anyhow::Result<()> {
    let inputs = Inputs::try_from(&args)?;
    let p = plan(&inputs)?;
    if args.json {
        let out = serde_json::json!({ "inputs": inputs, "plan": p });
        crate::emit(&(serde_json::to_string_pretty(&out)? + "\n"))
    } else {
        crate::emit(&render(&inputs, &p))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: CapacityArgs,
    }

    fn args(extra: &[&str]) -> CapacityArgs {
        let mut v = vec!["capacity"];
        v.extend_from_slice(extra);
        Cli::try_parse_from(v).unwrap().args
    }

    /// The seed's printed part-1 output (python3 chat_capacity.py).
    const SEED_PART1: &str = "\
part 1: arithmetic
  KV cache per token          160 KiB (20 KiB per GPU at TP=8)
  weights per GPU             8.8 GB; KV room 63.2 GB
  KV capacity per node        3.08 M tokens
  requests/s                  333
  output tokens/s             133,333
  prompt tokens/s             1,000,000 (200,000 uncached at 80% hits)
  decode step at batch 256   12.7 ms -> 79 tok/s per stream
  per node: decode 20,098 tok/s, prefill 44,850 tok/s
  node-equivalents busy       11.1; at 60% target + 1 spare: 20 nodes (160 GPUs)
  sequences decoding at once  1,698 (Little's law: 333/s x 5.1 s) vs 4,864 slots
  idle history to keep warm   58.6 M tokens vs 56.3 M free in HBM fleet-wide
";

    #[test]
    fn seed_inputs_give_each_seed_figure_at_its_printed_precision() {
        let p = plan(&Inputs::seed()).unwrap();
        let f = |x: f64, d: usize| format!("{:.*}", d, x);
        assert_eq!(f(p.kv_bytes_per_token / 1024.0, 0), "160");
        assert_eq!(f(p.kv_bytes_per_token_per_gpu / 1024.0, 0), "20");
        assert_eq!(f(p.weights_bytes_per_gpu / 1e9, 1), "8.8");
        assert_eq!(f(p.kv_room_bytes_per_gpu / 1e9, 1), "63.2");
        assert_eq!(f(p.kv_tokens_per_node / 1e6, 2), "3.08");
        assert_eq!(f(p.requests_per_s, 0), "333");
        assert_eq!(f(p.output_tokens_per_s, 0), "133333");
        assert_eq!(f(p.prompt_tokens_per_s, 0), "1000000");
        assert_eq!(f(p.uncached_prompt_tokens_per_s, 0), "200000");
        assert_eq!(f(p.decode_step_s * 1e3, 1), "12.7");
        assert_eq!(f(p.tokens_per_s_per_stream, 0), "79");
        assert_eq!(f(p.decode_tokens_per_s_per_node, 0), "20098");
        assert_eq!(f(p.prefill_tokens_per_s_per_node, 0), "44850");
        assert_eq!(f(p.node_equivalents_busy, 1), "11.1");
        assert_eq!((p.nodes, p.gpus), (20, 160));
        assert_eq!(f(p.sequences_decoding, 0), "1698");
        assert_eq!(f(p.decode_seconds_per_turn, 1), "5.1");
        assert_eq!(p.batch_slots, 4864);
        assert_eq!(f(p.idle_history_tokens / 1e6, 1), "58.6");
        assert_eq!(f(p.free_kv_tokens / 1e6, 1), "56.3");
        // The seed's prose: 6.6 + 4.5 node-equivalents; prefill 40% of busy time.
        assert_eq!(f(p.decode_node_equivalents, 1), "6.6");
        assert_eq!(f(p.prefill_node_equivalents, 1), "4.5");
        assert_eq!(f(p.prefill_share_of_busy * 100.0, 0), "40");
    }

    #[test]
    fn default_flags_print_the_seed_lines_verbatim() {
        let i = Inputs::try_from(&args(&[])).unwrap();
        let text = render(&i, &plan(&i).unwrap());
        assert!(text.starts_with(SEED_PART1), "got:\n{text}");
    }

    #[test]
    fn thousands_separators_like_python() {
        assert_eq!(plan::thousands(0.0, 0), "0");
        assert_eq!(plan::thousands(999.4, 0), "999");
        assert_eq!(plan::thousands(1000.0, 0), "1,000");
        assert_eq!(plan::thousands(1_234_567.891, 2), "1,234,567.89");
        assert_eq!(plan::thousands(-20_098.2, 0), "-20,098");
    }

    #[test]
    fn bf16_kv_doubles_bytes_and_halves_tokens_per_node() {
        let fp8 = plan(&Inputs::try_from(&args(&[])).unwrap()).unwrap();
        let bf16 = plan(&Inputs::try_from(&args(&["--kv-dtype", "bf16"])).unwrap()).unwrap();
        assert_eq!(bf16.kv_bytes_per_token, 2.0 * fp8.kv_bytes_per_token);
        assert!((bf16.kv_tokens_per_node * 2.0 - fp8.kv_tokens_per_node).abs() < 1.0);
        assert!(bf16.decode_step_s > fp8.decode_step_s);
    }

    #[test]
    fn h200_has_more_room_and_faster_decode() {
        let h100 = plan(&Inputs::try_from(&args(&[])).unwrap()).unwrap();
        let h200 = plan(&Inputs::try_from(&args(&["--gpu", "h200"])).unwrap()).unwrap();
        // 141 - 8.825 - 8 = 124.2 GB per GPU of KV room.
        assert_eq!(format!("{:.1}", h200.kv_room_bytes_per_gpu / 1e9), "124.2");
        assert!(h200.decode_step_s < h100.decode_step_s);
        assert!(h200.nodes <= h100.nodes);
        assert!(Cli::try_parse_from(["capacity", "--gpu", "a100"]).is_err());
    }

    #[test]
    fn measured_rates_replace_the_roofline() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("bench.json");
        std::fs::write(
            &p,
            r#"{"prefill_tokens_per_s": 20000, "decode_tokens_per_s": 10000}"#,
        )
        .unwrap();
        let a = args(&["--from-bench", p.to_str().unwrap()]);
        let pl = plan(&Inputs::try_from(&a).unwrap()).unwrap();
        assert_eq!(pl.decode_rate_source, "measured");
        assert_eq!(pl.prefill_tokens_per_s_per_node, 20_000.0);
        assert_eq!(pl.decode_step_s, 256.0 / 10_000.0);
        // 133,333 / 10,000 + 200,000 / 20,000 = 23.3 busy -> ceil(38.9) + 1 = 40 nodes.
        assert_eq!(pl.nodes, 40);
        // An explicit flag wins over the file; the prefixed key spelling is accepted.
        std::fs::write(&p, r#"{"measured_decode_tokens_per_s": 10000}"#).unwrap();
        let a = args(&[
            "--from-bench",
            p.to_str().unwrap(),
            "--measured-decode-tokens-per-s",
            "25600",
        ]);
        let pl = plan(&Inputs::try_from(&a).unwrap()).unwrap();
        assert_eq!(pl.decode_step_s, 0.01);
        assert_eq!(pl.prefill_rate_source, "roofline");
        std::fs::write(&p, r#"{"other": 1}"#).unwrap();
        let a = args(&["--from-bench", p.to_str().unwrap()]);
        assert_eq!(Inputs::try_from(&a).unwrap_err().label(), "missing_field");
    }

    #[test]
    fn model_files_and_flag_overrides() {
        let dir = tempfile::tempdir().unwrap();
        let g = fixture::write(dir.path(), "t.gguf", &fixture::tiny_llama());
        let i = Inputs::try_from(&args(&["--gguf", g.to_str().unwrap()])).unwrap();
        assert_eq!(i.model.layers, 2);
        let pl = plan(&i).unwrap();
        // 2 x 2 layers x 2 KV heads x 16 x 1 byte = 128 bytes per token.
        assert_eq!(pl.kv_bytes_per_token, 128.0);
        let i = Inputs::try_from(&args(&["--gguf", g.to_str().unwrap(), "--layers", "4"])).unwrap();
        assert_eq!(i.model.layers, 4);
        assert!(i.model.source.ends_with("with flag overrides"));

        let c = dir.path().join("config.json");
        std::fs::write(
            &c,
            r#"{"num_hidden_layers": 4, "num_attention_heads": 8, "hidden_size": 512}"#,
        )
        .unwrap();
        // Shapes incomplete for a parameter count: the planner asks for --params.
        let e = Inputs::try_from(&args(&["--config", c.to_str().unwrap()])).unwrap_err();
        assert_eq!(e.label(), "missing_field");
        let i =
            Inputs::try_from(&args(&["--config", c.to_str().unwrap(), "--params", "1e9"])).unwrap();
        assert_eq!(
            (i.model.kv_heads, i.model.head_dim, i.model.params),
            (8, 64, 1e9)
        );
        assert!(Cli::try_parse_from(["capacity", "--config", "a", "--gguf", "b"]).is_err());
    }

    #[test]
    fn impossible_inputs_are_errors() {
        // 600 B parameters in FP8 (75 GB per GPU) plus 8 GB reserved exceed 80 GB.
        let e = plan(&Inputs::try_from(&args(&["--params", "600e9"])).unwrap()).unwrap_err();
        assert_eq!(e.label(), "invalid_input");
        let e = plan(&Inputs::try_from(&args(&["--cached-share", "1.5"])).unwrap()).unwrap_err();
        assert_eq!(e.label(), "invalid_input");
    }

    #[test]
    fn json_output_has_every_figure() {
        let i = Inputs::seed();
        let v = serde_json::to_value(plan(&i).unwrap()).unwrap();
        assert_eq!(v["nodes"], 20);
        assert_eq!(v["kv_bytes_per_token"], 163_840.0);
        assert_eq!(v["decode_rate_source"], "roofline");
    }
}
