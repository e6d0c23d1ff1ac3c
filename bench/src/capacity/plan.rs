//! The capacity arithmetic of the seed's part 1, as a pure function from [`Inputs`] to a
//! [`Plan`]; [`render`] prints it with the seed's wording and precision, so the seed's
//! inputs print the seed's lines verbatim.
//!
//! Decode is a roofline on memory bandwidth (weights plus every sequence's KV read once
//! per step, at an assumed fraction of peak); prefill is a roofline on compute (2 FLOP per
//! parameter per token, at an assumed utilization). Measured per-node rates, when given,
//! replace the roofline figures; the decode step time then follows as batch / rate.

use serde::Serialize;

use super::model::ModelShape;
use crate::error::{invalid, BenchError};
use crate::hardware::{Dtype, GpuProfile};

/// Everything the plan depends on.
#[derive(Debug, Clone, Serialize)]
pub struct Inputs {
    pub model: ModelShape,
    pub gpu: GpuProfile,
    pub weight_dtype: Dtype,
    pub kv_dtype: Dtype,
    pub gpus_per_node: u64,
    /// Bytes per GPU kept for activations, CUDA graphs, runtime.
    pub reserved_bytes_per_gpu: f64,
    /// Achieved fraction of peak HBM bandwidth during decode.
    pub decode_efficiency: f64,
    /// Achieved fraction of peak FLOP/s during prefill.
    pub prefill_mfu: f64,
    pub open_conversations: f64,
    pub turn_gap_s: f64,
    pub prompt_tokens: f64,
    pub output_tokens: f64,
    /// Share of prompt tokens served from the prefix cache.
    pub cached_share: f64,
    /// Largest decode batch per node that meets the ITL target.
    pub max_batch: u64,
    pub target_utilization: f64,
    pub spare_nodes: u64,
    pub measured_prefill_tokens_per_s: Option<f64>,
    pub measured_decode_tokens_per_s: Option<f64>,
}

impl Inputs {
    /// The seed's inputs: Llama 3.1 70B in FP8 on 8 x H100 SXM nodes, 20,000 open
    /// conversations at one turn a minute, 3,000-token prompts, 400-token replies.
    pub fn seed() -> Self {
        Self {
            model: ModelShape::seed(),
            gpu: crate::hardware::Gpu::H100.profile(),
            weight_dtype: Dtype::Fp8,
            kv_dtype: Dtype::Fp8,
            gpus_per_node: 8,
            reserved_bytes_per_gpu: 8e9,
            decode_efficiency: 0.6,
            prefill_mfu: 0.4,
            open_conversations: 20_000.0,
            turn_gap_s: 60.0,
            prompt_tokens: 3_000.0,
            output_tokens: 400.0,
            cached_share: 0.8,
            max_batch: 256,
            target_utilization: 0.6,
            spare_nodes: 1,
            measured_prefill_tokens_per_s: None,
            measured_decode_tokens_per_s: None,
        }
    }
}

/// Every figure the seed prints, and a few it implies.
#[derive(Debug, Clone, Serialize)]
pub struct Plan {
    pub kv_bytes_per_token: f64,
    pub kv_bytes_per_token_per_gpu: f64,
    pub weights_bytes_per_gpu: f64,
    pub kv_room_bytes_per_gpu: f64,
    pub kv_tokens_per_node: f64,
    pub requests_per_s: f64,
    pub output_tokens_per_s: f64,
    pub prompt_tokens_per_s: f64,
    pub uncached_prompt_tokens_per_s: f64,
    /// Mean context during decode: prompt plus half the reply.
    pub decode_context_tokens: f64,
    pub decode_step_s: f64,
    pub tokens_per_s_per_stream: f64,
    pub decode_tokens_per_s_per_node: f64,
    pub prefill_tokens_per_s_per_node: f64,
    /// `roofline` or `measured`.
    pub decode_rate_source: &'static str,
    pub prefill_rate_source: &'static str,
    pub decode_node_equivalents: f64,
    pub prefill_node_equivalents: f64,
    pub node_equivalents_busy: f64,
    pub prefill_share_of_busy: f64,
    pub nodes: u64,
    pub gpus: u64,
    pub decode_seconds_per_turn: f64,
    pub sequences_decoding: f64,
    pub batch_slots: u64,
    pub idle_history_tokens: f64,
    pub free_kv_tokens: f64,
}

/// Run the arithmetic. Fails if the weights and reserve leave no room for KV cache, or an
/// input is outside its domain.
pub fn plan(i: &Inputs) -> Result<Plan, BenchError> {
    let positive = |name, v: f64| {
        if v > 0.0 && v.is_finite() {
            Ok(())
        } else {
            Err(invalid(name, format!("{v} must be a positive number")))
        }
    };
    positive("params", i.model.params)?;
    positive("gpus_per_node", i.gpus_per_node as f64)?;
    positive("decode_efficiency", i.decode_efficiency)?;
    positive("prefill_mfu", i.prefill_mfu)?;
    positive("turn_gap_s", i.turn_gap_s)?;
    positive("max_batch", i.max_batch as f64)?;
    positive("target_utilization", i.target_utilization)?;
    if !(0.0..=1.0).contains(&i.cached_share) {
        return Err(invalid("cached_share", "must be between 0 and 1"));
    }
    for (name, v) in [
        (
            "measured_prefill_tokens_per_s",
            i.measured_prefill_tokens_per_s,
        ),
        (
            "measured_decode_tokens_per_s",
            i.measured_decode_tokens_per_s,
        ),
    ] {
        if let Some(v) = v {
            positive(name, v)?;
        }
    }

    let gpus = i.gpus_per_node as f64;
    let kv_token =
        (2 * i.model.layers * i.model.kv_heads * i.model.head_dim * i.kv_dtype.bytes()) as f64;
    let kv_token_gpu = kv_token / gpus;
    let weights_gpu = i.model.params * i.weight_dtype.bytes() as f64 / gpus;
    let kv_room_gpu = i.gpu.hbm_bytes - weights_gpu - i.reserved_bytes_per_gpu;
    if kv_room_gpu <= 0.0 {
        return Err(invalid(
            "model",
            format!(
                "weights ({:.1} GB per GPU) and reserve ({:.1} GB) exceed {} HBM ({:.0} GB)",
                weights_gpu / 1e9,
                i.reserved_bytes_per_gpu / 1e9,
                i.gpu.name,
                i.gpu.hbm_bytes / 1e9
            ),
        ));
    }
    let tokens_node = kv_room_gpu / kv_token_gpu;

    let req_s = i.open_conversations / i.turn_gap_s;
    let out_s = req_s * i.output_tokens;
    let in_s = req_s * i.prompt_tokens;
    let uncached_s = in_s * (1.0 - i.cached_share);

    let ctx = i.prompt_tokens + i.output_tokens / 2.0;
    let batch = i.max_batch as f64;
    let (step_s, decode_node, decode_src) = match i.measured_decode_tokens_per_s {
        Some(rate) => (batch / rate, rate, "measured"),
        None => {
            let step = (weights_gpu + batch * ctx * kv_token_gpu)
                / i.gpu.hbm_bytes_per_s
                / i.decode_efficiency;
            (step, batch / step, "roofline")
        }
    };
    let (prefill_node, prefill_src) = match i.measured_prefill_tokens_per_s {
        Some(rate) => (rate, "measured"),
        None => (
            gpus * i.weight_dtype.dense_flops(&i.gpu) * i.prefill_mfu / (2.0 * i.model.params),
            "roofline",
        ),
    };

    let decode_eq = out_s / decode_node;
    let prefill_eq = uncached_s / prefill_node;
    let busy = decode_eq + prefill_eq;
    let nodes = (busy / i.target_utilization).ceil() as u64 + i.spare_nodes;
    let decode_s_turn = i.output_tokens * step_s;
    let in_flight = req_s * decode_s_turn;
    let free = nodes as f64 * tokens_node - in_flight * ctx;
    let idle = (i.open_conversations - in_flight) * ctx;
    Ok(Plan {
        kv_bytes_per_token: kv_token,
        kv_bytes_per_token_per_gpu: kv_token_gpu,
        weights_bytes_per_gpu: weights_gpu,
        kv_room_bytes_per_gpu: kv_room_gpu,
        kv_tokens_per_node: tokens_node,
        requests_per_s: req_s,
        output_tokens_per_s: out_s,
        prompt_tokens_per_s: in_s,
        uncached_prompt_tokens_per_s: uncached_s,
        decode_context_tokens: ctx,
        decode_step_s: step_s,
        tokens_per_s_per_stream: 1.0 / step_s,
        decode_tokens_per_s_per_node: decode_node,
        prefill_tokens_per_s_per_node: prefill_node,
        decode_rate_source: decode_src,
        prefill_rate_source: prefill_src,
        decode_node_equivalents: decode_eq,
        prefill_node_equivalents: prefill_eq,
        node_equivalents_busy: busy,
        prefill_share_of_busy: prefill_eq / busy,
        nodes,
        gpus: nodes * i.gpus_per_node,
        decode_seconds_per_turn: decode_s_turn,
        sequences_decoding: in_flight,
        batch_slots: nodes.saturating_sub(i.spare_nodes) * i.max_batch,
        idle_history_tokens: idle,
        free_kv_tokens: free,
    })
}

/// `x` with `decimals` decimals and thousands separators, like Python's `{:,.Nf}`.
pub fn thousands(x: f64, decimals: usize) -> String {
    let s = format!("{:.*}", decimals, x.abs());
    let (int, frac) = match s.find('.') {
        Some(p) => s.split_at(p),
        None => (s.as_str(), ""),
    };
    let mut out = String::with_capacity(s.len() + int.len() / 3 + 1);
    if x.is_sign_negative() && s.chars().any(|c| c.is_ascii_digit() && c != '0') {
        out.push('-');
    }
    for (n, ch) in int.chars().enumerate() {
        if n > 0 && (int.len() - n) % 3 == 0 {
            out.push(',');
        }
        out.push(ch);
    }
    out.push_str(frac);
    out
}

/// The seed's part-1 report for `p`, line for line, followed by the planner's extras.
pub fn render(i: &Inputs, p: &Plan) -> String {
    let tp = i.gpus_per_node;
    let mut lines = vec![
        "part 1: arithmetic".to_string(),
        format!(
            "  KV cache per token          {:.0} KiB ({:.0} KiB per GPU at TP={tp})",
            p.kv_bytes_per_token / 1024.0,
            p.kv_bytes_per_token_per_gpu / 1024.0
        ),
        format!(
            "  weights per GPU             {:.1} GB; KV room {:.1} GB",
            p.weights_bytes_per_gpu / 1e9,
            p.kv_room_bytes_per_gpu / 1e9
        ),
        format!("  KV capacity per node        {:.2} M tokens", p.kv_tokens_per_node / 1e6),
        format!("  requests/s                  {:.0}", p.requests_per_s),
        format!("  output tokens/s             {}", thousands(p.output_tokens_per_s, 0)),
        format!(
            "  prompt tokens/s             {} ({} uncached at {:.0}% hits)",
            thousands(p.prompt_tokens_per_s, 0),
            thousands(p.uncached_prompt_tokens_per_s, 0),
            i.cached_share * 100.0
        ),
        format!(
            "  decode step at batch {}   {:.1} ms -> {:.0} tok/s per stream",
            i.max_batch,
            p.decode_step_s * 1e3,
            p.tokens_per_s_per_stream
        ),
        format!(
            "  per node: decode {} tok/s, prefill {} tok/s",
            thousands(p.decode_tokens_per_s_per_node, 0),
            thousands(p.prefill_tokens_per_s_per_node, 0)
        ),
        format!(
            "  node-equivalents busy       {:.1}; at {:.0}% target + {} spare: {} nodes ({} GPUs)",
            p.node_equivalents_busy,
            i.target_utilization * 100.0,
            i.spare_nodes,
            p.nodes,
            p.gpus
        ),
        format!(
            "  sequences decoding at once  {} (Little's law: {:.0}/s x {:.1} s) vs {} slots",
            thousands(p.sequences_decoding, 0),
            p.requests_per_s,
            p.decode_seconds_per_turn,
            thousands(p.batch_slots as f64, 0)
        ),
        format!(
            "  idle history to keep warm   {:.1} M tokens vs {:.1} M free in HBM fleet-wide",
            p.idle_history_tokens / 1e6,
            p.free_kv_tokens / 1e6
        ),
        String::new(),
        "inputs and derived shares".to_string(),
        format!("  model                       {}", i.model.source),
        format!(
            "  shape                       {} layers, {} KV heads, head dim {}, {:.3} B params ({})",
            i.model.layers,
            i.model.kv_heads,
            i.model.head_dim,
            i.model.params / 1e9,
            i.model.params_source
        ),
        format!(
            "  hardware                    {} x {} per node, weights {}, KV {}",
            i.gpus_per_node,
            i.gpu.name,
            i.weight_dtype.name(),
            i.kv_dtype.name()
        ),
        format!(
            "  rates                       decode {}, prefill {}",
            p.decode_rate_source, p.prefill_rate_source
        ),
        format!(
            "  busy split                  decode {:.1} + prefill {:.1} node-equivalents (prefill {:.0}%)",
            p.decode_node_equivalents,
            p.prefill_node_equivalents,
            p.prefill_share_of_busy * 100.0
        ),
        format!(
            "  idle history fits in HBM    {}",
            if p.idle_history_tokens <= p.free_kv_tokens {
                "yes"
            } else {
                "no: needs host-memory offload or more nodes"
            }
        ),
    ];
    lines.push(String::new());
    lines.join("\n")
}
