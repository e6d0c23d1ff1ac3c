//! GPU roofline benchmark: a Llama-shaped forward pass with random weights,
//! built from the backend's own operations, timed against what the GPU can do
//! at best (measured in the same run):
//!
//! - decode step time at batch 1, 64 and 256 with 3,000-token contexts (the step
//!   as the engine runs it, with the fused operations; beside it, in a table of
//!   its own, the step op by op and each one's launches per step), against
//!   the bandwidth roofline: (bytes of weights + KV read per step) / measured
//!   device copy bandwidth; beside it the step's matrix products alone and its
//!   attention alone, each with the bandwidth it reached (weights, KV), so a
//!   miss names its cause;
//! - prefill tokens/s against the matrix-unit roofline: model FLOPs per token /
//!   measured cuBLAS bf16 GEMM throughput;
//! - the same decode steps as CUDA graphs (`cuda::graph`: captured once per
//!   shape, replayed) beside the eager steps, and whether their logits are the
//!   same bits;
//! - KV blocks to and from host memory through the staging buffers;
//! - the analytic model (`cuda::roofline`): per timed part, its roofline, the
//!   time its kernels' designs lead one to expect (occupancy, loads in flight,
//!   waves, the pipe they compute on) as a fraction of the roofline, beside the
//!   measured fraction, so a miss says whether the design or its code falls short.
//!
//! Shapes: Llama-3-8B, and one GPU's slice of Llama-3-70B under tensor
//! parallelism 8 (heads, KV heads, FFN and vocabulary divided by 8; the
//! all-reduces between GPUs are not modelled).
//!
//! `cargo bench -p baton-kernels --features cuda --bench gpu` (bench/gpu/run.sh runs it).
//! Without a GPU it says so and exits 0.

use std::time::Instant;

use baton_kernels::cuda::plan::AttentionPlan;
use baton_kernels::cuda::roofline::{self, AttentionShape, Estimate, Gpu, Peaks};
use baton_kernels::cuda::{CudaBackend, CudaMatrix, GEMM_ROWS};
use baton_kernels::{AttnRow, Backend, Glu, KvDtype, KvLayout, StepInput};

#[derive(Clone, Copy)]
struct Shape {
    name: &'static str,
    layers: usize,
    dim: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    ffn: usize,
    vocab: usize,
}

const LLAMA_8B: Shape = Shape { name: "llama-3-8b", layers: 32, dim: 4096, heads: 32, kv_heads: 8, head_dim: 128, ffn: 14336, vocab: 128_256 };
const LLAMA_70B_TP8: Shape =
    Shape { name: "llama-3-70b tp=8 slice", layers: 80, dim: 8192, heads: 8, kv_heads: 1, head_dim: 128, ffn: 3584, vocab: 16_032 };

const CONTEXT: usize = 3000;
const BLOCK_TOKENS: usize = 16;

struct LayerWeights {
    wq: CudaMatrix,
    wk: CudaMatrix,
    wv: CudaMatrix,
    wo: CudaMatrix,
    gate: CudaMatrix,
    up: CudaMatrix,
    down: CudaMatrix,
}

struct Model {
    s: Shape,
    layers: Vec<LayerWeights>,
    head: CudaMatrix,
    norm: <CudaBackend as Backend>::Tensor,
    rope: <CudaBackend as Backend>::Rope,
}

impl Shape {
    fn matrix_params(&self) -> usize {
        let q = self.heads * self.head_dim;
        let kv = self.kv_heads * self.head_dim;
        self.layers * (self.dim * (q + 2 * kv) + q * self.dim + 3 * self.dim * self.ffn) + self.vocab * self.dim
    }
    fn kv_bytes_per_token(&self) -> usize {
        2 * self.layers * self.kv_heads * self.head_dim * 2
    }
}

fn build(g: &CudaBackend, s: Shape) -> Model {
    let (q, kv) = (s.heads * s.head_dim, s.kv_heads * s.head_dim);
    let mut seed = 1u32;
    let mut m = |n: usize, k: usize| {
        seed += 1;
        g.random_matrix(n, k, seed, 1.0 / (k as f32).sqrt()).expect("weights")
    };
    let layers = (0..s.layers)
        .map(|_| LayerWeights { wq: m(q, s.dim), wk: m(kv, s.dim), wv: m(kv, s.dim), wo: m(s.dim, q), gate: m(s.ffn, s.dim), up: m(s.ffn, s.dim), down: m(s.dim, s.ffn) })
        .collect();
    let head = m(s.vocab, s.dim);
    Model { s, layers, head, norm: g.upload(&vec![1.0; s.dim]), rope: g.rope(baton_kernels::RopeTable::new(s.head_dim, 500_000.0, CONTEXT + 4096)) }
}

/// Buffers of one forward pass.
struct Acts {
    x: <CudaBackend as Backend>::Tensor,
    h: <CudaBackend as Backend>::Tensor,
    q: <CudaBackend as Backend>::Tensor,
    k: <CudaBackend as Backend>::Tensor,
    v: <CudaBackend as Backend>::Tensor,
    att: <CudaBackend as Backend>::Tensor,
    o: <CudaBackend as Backend>::Tensor,
    gate: <CudaBackend as Backend>::Tensor,
    up: <CudaBackend as Backend>::Tensor,
    act: <CudaBackend as Backend>::Tensor,
    logits: <CudaBackend as Backend>::Tensor,
}

/// One forward pass over `rows` tokens (their positions and block tables in `attn`):
/// with `fused`, through the backend's fused operations as the engine runs it
/// (fused.cu: the residual add in the next norm, norms and the SiLU gate written
/// as the products' bf16 input, RoPE inside the KV write, attention's output
/// written as the output projection's bf16 input), else op by op. Returns
/// its launches: kernels, and cuBLAS calls (one per GEMM_ROWS rows of a matrix),
/// counted per operation as the backend launches them.
#[allow(clippy::too_many_arguments)]
fn forward(g: &CudaBackend, m: &Model, kv: &mut <CudaBackend as Backend>::Kv, a: &mut Acts, attn: &[AttnRow], slots: &[(u32, u32)], positions: &[u32], logits_rows: &[usize], fused: bool) -> usize {
    let s = m.s;
    let rows = attn.len();
    let scale = 1.0 / (s.head_dim as f32).sqrt();
    // A matmul: to_bf16 (unless a fused kernel wrote its input), then its cuBLAS calls.
    let gemms = |matrices: usize, rows: usize| matrices * rows.div_ceil(GEMM_ROWS);
    let mut launches = 0;
    for (li, l) in m.layers.iter().enumerate() {
        if fused {
            let qkv = &mut [(&l.wq, &mut a.q), (&l.wk, &mut a.k), (&l.wv, &mut a.v)];
            if li == 0 {
                g.norm_matmul(&a.x, &m.norm, 1e-5, rows, s.dim, &mut a.h, qkv);
            } else {
                g.add_norm_matmul(&mut a.x, &a.o, None, &m.norm, 1e-5, rows, s.dim, &mut a.h, qkv);
            }
            g.rope_kv_write(kv, li, &m.rope, &mut a.q, s.heads, &mut a.k, s.kv_heads, &a.v, positions, slots);
            g.attention_matmul(kv, li, &a.q, attn, s.heads, scale, None, &mut a.att, &mut [(&l.wo, &mut a.o)]);
            g.add_norm_matmul(&mut a.x, &a.o, None, &m.norm, 1e-5, rows, s.dim, &mut a.h, &mut [(&l.gate, &mut a.gate), (&l.up, &mut a.up)]);
            g.glu_matmul(Glu::Silu, &a.gate, &a.up, rows, s.ffn, &mut a.act, &mut [(&l.down, &mut a.o)]);
            launches += 1 + gemms(3, rows) + 1 + 2 + gemms(1, rows) + 1 + gemms(2, rows) + 1 + gemms(1, rows);
        } else {
            g.rmsnorm(&a.x, &m.norm, 1e-5, rows, s.dim, &mut a.h);
            g.matmul(&a.h, rows, &mut [(&l.wq, &mut a.q), (&l.wk, &mut a.k), (&l.wv, &mut a.v)]);
            g.apply_rope(&m.rope, &mut a.q, positions, s.heads);
            g.apply_rope(&m.rope, &mut a.k, positions, s.kv_heads);
            g.kv_write(kv, li, &a.k, &a.v, slots);
            g.attention(kv, li, &a.q, attn, s.heads, scale, None, &mut a.att);
            g.matmul(&a.att, rows, &mut [(&l.wo, &mut a.o)]);
            g.add(&mut a.x, &a.o, rows * s.dim);
            g.rmsnorm(&a.x, &m.norm, 1e-5, rows, s.dim, &mut a.h);
            g.matmul(&a.h, rows, &mut [(&l.gate, &mut a.gate), (&l.up, &mut a.up)]);
            g.silu_mul(&a.gate, &a.up, rows * s.ffn, &mut a.act);
            g.matmul(&a.act, rows, &mut [(&l.down, &mut a.o)]);
            g.add(&mut a.x, &a.o, rows * s.dim);
            launches += 1 + 1 + gemms(3, rows) + 2 + 1 + 2 + 1 + gemms(1, rows) + 1 + 1 + 1 + gemms(2, rows) + 1 + 1 + gemms(1, rows) + 1;
        }
    }
    if fused && !m.layers.is_empty() {
        g.add(&mut a.x, &a.o, rows * s.dim);
        launches += 1;
    }
    g.gather_rows(&a.x, s.dim, logits_rows, &mut a.att);
    g.rmsnorm(&a.att, &m.norm, 1e-5, logits_rows.len(), s.dim, &mut a.h);
    g.matmul(&a.h, logits_rows.len(), &mut [(&m.head, &mut a.logits)]);
    launches + 3 + gemms(1, logits_rows.len())
}

/// One decode step eager and as a CUDA graph (after a warm-up step and the
/// capture), from the same starting activations `x0`: the seconds of each
/// (mean of three), whether the graph's logits are the eager step's bits, and the
/// backend's graph counts.
#[allow(clippy::too_many_arguments)]
fn graph_step(g: &CudaBackend, m: &Model, kv: &mut <CudaBackend as Backend>::Kv, a: &mut Acts, x0: &<CudaBackend as Backend>::Tensor, attn: &[AttnRow], slots: &[(u32, u32)], positions: &[u32], logits_rows: &[usize]) -> (f64, f64, bool, String) {
    let tokens = vec![0u32; attn.len()];
    let step = StepInput { tokens: &tokens, positions, slots, attn, logit_rows: logits_rows };
    let program = a as *const Acts as usize;
    let logits = |a: &Acts| {
        let mut out = vec![0f32; logits_rows.len() * m.s.vocab];
        g.download(&a.logits, &mut out);
        out
    };
    let run = |a: &mut Acts, kv: &mut <CudaBackend as Backend>::Kv, graphs: bool| {
        g.set_graphs(graphs);
        g.copy(x0, &mut a.x);
        g.decode_step(kv, &step, program, &mut |kv| {
            forward(g, m, kv, a, attn, slots, positions, logits_rows, true);
        });
    };
    // Few steps: the check's time is bounded (bench/gpu/run.sh), and a step of batch 256 is long.
    let time = |a: &mut Acts, kv: &mut <CudaBackend as Backend>::Kv, graphs: bool| {
        for _ in 0..if graphs { 3 } else { 1 } {
            run(a, kv, graphs); // with graphs: the shape's eager step, its capture, a first replay
        }
        g.synchronize();
        let t = Instant::now();
        for _ in 0..3 {
            run(a, kv, graphs);
        }
        g.synchronize();
        t.elapsed().as_secs_f64() / 3.0
    };
    let eager = time(a, kv, false);
    let want = logits(a);
    let graph = time(a, kv, true);
    let same = logits(a).iter().zip(&want).all(|(x, y)| x.to_bits() == y.to_bits());
    let st = g.graph_stats();
    (eager, graph, same, format!("{} captured, {} replayed, {} eager fallbacks", st.captures, st.replays, st.fallbacks))
}

/// The matrix products of one forward pass alone (every layer, and the head for `logits_rows`).
fn products_only(g: &CudaBackend, m: &Model, a: &mut Acts, rows: usize, logits_rows: &[usize]) {
    for l in &m.layers {
        g.matmul(&a.h, rows, &mut [(&l.wq, &mut a.q), (&l.wk, &mut a.k), (&l.wv, &mut a.v)]);
        g.matmul(&a.att, rows, &mut [(&l.wo, &mut a.o)]);
        g.matmul(&a.h, rows, &mut [(&l.gate, &mut a.gate), (&l.up, &mut a.up)]);
        g.matmul(&a.act, rows, &mut [(&l.down, &mut a.o)]);
    }
    g.matmul(&a.h, logits_rows.len(), &mut [(&m.head, &mut a.logits)]);
}

fn acts(g: &CudaBackend, s: Shape, rows: usize) -> Acts {
    let t = |n: usize| g.tensor(n);
    Acts {
        x: t(rows * s.dim),
        h: t(rows * s.dim),
        q: t(rows * s.heads * s.head_dim),
        k: t(rows * s.kv_heads * s.head_dim),
        v: t(rows * s.kv_heads * s.head_dim),
        att: t(rows * (s.heads * s.head_dim).max(s.dim)),
        o: t(rows * s.dim),
        gate: t(rows * s.ffn),
        up: t(rows * s.ffn),
        act: t(rows * s.ffn),
        logits: t(rows.min(256) * s.vocab),
    }
}

/// Device copy bandwidth (GB/s): a 4 GiB device-to-device copy counts its bytes read and written.
fn copy_bandwidth(g: &CudaBackend) -> f64 {
    let n = 1usize << 30; // f32 elements = 4 GiB
    let src = g.tensor(n);
    let mut dst = g.tensor(n);
    let best = best_of_five(g, || g.copy(&src, &mut dst));
    2.0 * (n * 4) as f64 / best / 1e9
}

/// Seconds of the fastest of five runs of `f` (after one warm-up).
fn best_of_five(g: &CudaBackend, mut f: impl FnMut()) -> f64 {
    f();
    let mut best = f64::MAX;
    for _ in 0..5 {
        g.synchronize();
        let t = Instant::now();
        f();
        g.synchronize();
        best = best.min(t.elapsed().as_secs_f64());
    }
    best
}

/// bf16 GEMM throughput (TFLOP/s) at 8192 x 8192 x 8192: one cuBLAS call (the
/// matrix units' ceiling), and the backend's own product, which converts f32
/// activations and runs fixed 128-row calls for batch invariance, on the main
/// stream alone and spread over the side streams (the backend's default).
fn gemm_tflops(g: &CudaBackend) -> (f64, f64, f64, usize) {
    let n = 8192;
    let flops = 2.0 * (n as f64).powi(3);
    let w = g.random_matrix(n, n, 7, 0.01).expect("gemm weights");
    let xb = g.random_matrix(n, n, 8, 1.0).expect("gemm inputs");
    let mut out = g.tensor(n * n);
    let one_call = best_of_five(g, || g.gemm_one_call(&w, &xb, &mut out));
    let x = g.upload(&vec![0.5f32; n * n]);
    g.set_gemm_streams(1);
    let one_stream = best_of_five(g, || g.matmul(&x, n, &mut [(&w, &mut out)]));
    let streams = g.set_gemm_streams(usize::MAX);
    let spread = best_of_five(g, || g.matmul(&x, n, &mut [(&w, &mut out)]));
    (flops / one_call / 1e12, flops / one_stream / 1e12, flops / spread / 1e12, streams)
}

/// KV blocks leaving and entering the GPU arena (a prefill node's export, a
/// decode node's import): 1,000 blocks of llama-3-8b (2 MiB each, a
/// 16,000-token conversation) in one call through the staging buffers, against
/// the same blocks a call each, and against one device-to-host copy of the
/// same bytes into ordinary memory.
fn kv_staging(g: &CudaBackend) {
    let s = LLAMA_8B;
    let layout = KvLayout { layers: s.layers, block_tokens: BLOCK_TOKENS, kv_heads: s.kv_heads, head_dim: s.head_dim, dtype: KvDtype::BF16 };
    let n = 1000;
    let bb = layout.block_bytes();
    let mut kv = g.kv(layout, n + 24).expect("kv arena");
    let ids: Vec<usize> = (0..n).map(|i| (i * 7) % (n + 24)).collect();
    let mut host = vec![vec![0u8; bb]; n];
    let gb = (n * bb) as f64 / 1e9;
    let out_one_call = best_of_five(g, || g.kv_blocks_out(&kv, &ids, &mut host.iter_mut().map(Vec::as_mut_slice).collect::<Vec<_>>()));
    let out_per_block = best_of_five(g, || {
        for (&b, h) in ids.iter().zip(host.iter_mut()) {
            g.kv_copy_block_out(&kv, b, h);
        }
    });
    let refs: Vec<&[u8]> = host.iter().map(Vec::as_slice).collect();
    let in_one_call = best_of_five(g, || {
        g.kv_blocks_in(&mut kv, &ids, &refs);
        g.synchronize();
    });
    let flat = g.tensor(n * bb / 4);
    let mut pageable = vec![0f32; n * bb / 4];
    let raw = best_of_five(g, || g.download(&flat, &mut pageable));
    println!(
        "KV blocks, {n} x {} MiB (llama-3-8b, bf16): out in one call {:.1} GB/s, out a call per block {:.1} GB/s, in one call {:.1} GB/s; one {:.1} GB device-to-host copy into ordinary memory {:.1} GB/s",
        bb >> 20,
        gb / out_one_call,
        gb / out_per_block,
        gb / in_one_call,
        gb,
        gb / raw
    );
}

/// The model's estimate of one attention call, over every layer.
/// `tensor_cores`: whether the backend runs this call's attention on them (the plan it launches).
fn attention_model(gpu: &Gpu, peaks: &Peaks, s: Shape, attn: &[AttnRow], tensor_cores: bool) -> Estimate {
    let plan = AttentionPlan::for_gpu(attn, BLOCK_TOKENS, s.head_dim, s.heads, s.kv_heads, tensor_cores);
    let shape = AttentionShape { heads: s.heads, kv_heads: s.kv_heads, head_dim: s.head_dim, kv_bytes: 2 };
    let one = roofline::estimate_all(gpu, peaks, &roofline::attention_launches(&plan, &shape, "bf16"));
    Estimate { roofline_s: one.roofline_s * s.layers as f64, expected_s: one.expected_s * s.layers as f64, ..one }
}

/// A row of the model table: roofline, expected (model) and measured, in ms and as fractions of the roofline.
fn model_line(shape: &str, what: &str, e: Option<Estimate>, roofline_s: f64, measured_s: f64) -> String {
    let expected = match e {
        Some(e) => format!("{:.2} ({:.0}%) | {:.1} | {}", e.expected_s * 1e3, 100.0 * roofline_s / e.expected_s, e.waves, if e.memory_bound { "memory" } else { "compute" }),
        None => "- (cuBLAS: not modelled) | - | -".to_string(),
    };
    format!("| {shape} | {what} | {:.2} | {expected} | {:.2} ({:.0}%) |", roofline_s * 1e3, measured_s * 1e3, 100.0 * roofline_s / measured_s)
}

fn main() {
    let g = match CudaBackend::new(0) {
        Ok(g) => g,
        Err(e) => {
            println!("SKIPPED: {e}");
            return;
        }
    };
    println!("backend  {}", g.describe());
    let bw = copy_bandwidth(&g);
    let (tflops, one_stream, spread, streams) = gemm_tflops(&g);
    println!(
        "measured copy bandwidth {bw:.0} GB/s; bf16 GEMM 8192^3: one cuBLAS call {tflops:.0} TFLOP/s, the backend's matmul (f32 input, {GEMM_ROWS}-row calls) {one_stream:.0} TFLOP/s on one stream, {spread:.0} on {streams}"
    );
    kv_staging(&g);
    let description = g.describe();
    let arch = description.split(|c: char| !c.is_ascii_alphanumeric() && c != '_').find(|w| w.starts_with("sm_")).unwrap_or("sm_90");
    let gpu = roofline::gpu_for(arch).unwrap_or(roofline::SM90);
    let peaks = Peaks::measured(&gpu, bw, tflops);
    let mut model_lines = Vec::new();
    println!();
    println!("| shape | batch | step ms | roofline ms | ratio | bytes read/step | products ms (weights GB/s) | attention ms (KV GB/s) |");
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    let mut prefill_lines = Vec::new();
    let mut graph_lines = Vec::new();
    let mut fusion_lines = Vec::new();
    for s in [LLAMA_8B, LLAMA_70B_TP8] {
        let m = build(&g, s);
        let weight_bytes = s.matrix_params() * 2;
        for batch in [1usize, 64, 256] {
            let tokens = batch * (CONTEXT + 1);
            let blocks = tokens.div_ceil(BLOCK_TOKENS) + batch;
            let layout = KvLayout { layers: s.layers, block_tokens: BLOCK_TOKENS, kv_heads: s.kv_heads, head_dim: s.head_dim, dtype: KvDtype::BF16 };
            let need = blocks * layout.block_bytes();
            let (free, _) = g.memory();
            if need + (2 << 30) > free {
                println!("| {} | {batch} | skipped: KV needs {} GiB, {} GiB free | | | | | |", s.name, need >> 30, free >> 30);
                continue;
            }
            let mut kv = g.kv(layout, blocks).expect("kv arena");
            let per_seq = (CONTEXT + 1).div_ceil(BLOCK_TOKENS);
            let tables: Vec<Vec<u32>> = (0..batch).map(|b| ((b * per_seq) as u32..((b + 1) * per_seq) as u32).collect()).collect();
            let attn: Vec<AttnRow> = tables.iter().map(|t| AttnRow { block_table: t, pos: CONTEXT }).collect();
            let slots: Vec<(u32, u32)> = tables.iter().map(|t| (t[CONTEXT / BLOCK_TOKENS], (CONTEXT % BLOCK_TOKENS) as u32)).collect();
            let positions = vec![CONTEXT as u32; batch];
            let logits_rows: Vec<usize> = (0..batch).collect();
            let mut a = acts(&g, s, batch);
            a.x = g.upload(&vec![0.01; batch * s.dim]);
            // The step as the engine runs it (fused), and op by op as the baseline.
            let mut timed = |fused: bool| {
                let launches = forward(&g, &m, &mut kv, &mut a, &attn, &slots, &positions, &logits_rows, fused);
                g.synchronize();
                let steps = 5;
                let t = Instant::now();
                for _ in 0..steps {
                    forward(&g, &m, &mut kv, &mut a, &attn, &slots, &positions, &logits_rows, fused);
                }
                g.synchronize();
                (t.elapsed().as_secs_f64() / steps as f64, launches)
            };
            let (unfused_step, unfused_launches) = timed(false);
            let (step, launches) = timed(true);
            fusion_lines.push(format!(
                "| {} | {batch} | {:.3} | {unfused_launches} | {:.3} | {launches} |",
                s.name,
                unfused_step * 1e3,
                step * 1e3
            ));
            if g.set_graphs(true) {
                let x0 = g.upload(&vec![0.01; batch * s.dim]);
                let (eager, graph, same, counts) = graph_step(&g, &m, &mut kv, &mut a, &x0, &attn, &slots, &positions, &logits_rows);
                let same = if same { "yes" } else { "NO" };
                graph_lines.push(format!("| {} | {batch} | {:.2} | {:.2} | {:.2}x | {same} | {counts} |", s.name, eager * 1e3, graph * 1e3, eager / graph));
            }
            let bytes = weight_bytes + batch * (CONTEXT + 1) * s.kv_bytes_per_token();
            let roof = bytes as f64 / (bw * 1e9);
            // Where the step goes: the same products alone, and attention over every layer alone.
            let products = best_of_five(&g, || products_only(&g, &m, &mut a, batch, &logits_rows));
            let scale = 1.0 / (s.head_dim as f32).sqrt();
            let attention = best_of_five(&g, || {
                for li in 0..s.layers {
                    g.attention(&kv, li, &a.q, &attn, s.heads, scale, None, &mut a.att);
                }
            });
            let kv_read = batch * (CONTEXT + 1) * s.kv_bytes_per_token();
            let a_model = attention_model(&gpu, &peaks, s, &attn, g.attention_on_tensor_cores(KvDtype::BF16, s.head_dim));
            model_lines.push(model_line(s.name, &format!("decode attention, batch {batch}"), Some(a_model), a_model.roofline_s, attention));
            let gemm_rows = batch.next_multiple_of(GEMM_ROWS) as f64;
            let products_roof = (weight_bytes as f64 / peaks.bandwidth).max(2.0 * s.matrix_params() as f64 * gemm_rows / peaks.tensor_flops);
            model_lines.push(model_line(s.name, &format!("decode products, batch {batch}"), None, products_roof, products));
            println!(
                "| {} | {batch} | {:.2} | {:.2} | {:.2}x | {:.1} GB | {:.2} ({:.0}) | {:.2} ({:.0}) |",
                s.name,
                step * 1e3,
                roof * 1e3,
                step / roof,
                bytes as f64 / 1e9,
                products * 1e3,
                weight_bytes as f64 / products / 1e9,
                attention * 1e3,
                kv_read as f64 / attention / 1e9
            );
        }

        // Prefill: one 2,048-token prompt in one step.
        let n = 2048;
        let layout = KvLayout { layers: s.layers, block_tokens: BLOCK_TOKENS, kv_heads: s.kv_heads, head_dim: s.head_dim, dtype: KvDtype::BF16 };
        let mut kv = g.kv(layout, n / BLOCK_TOKENS).expect("kv arena");
        let table: Vec<u32> = (0..(n / BLOCK_TOKENS) as u32).collect();
        let attn: Vec<AttnRow> = (0..n).map(|p| AttnRow { block_table: &table, pos: p }).collect();
        let slots: Vec<(u32, u32)> = (0..n).map(|p| (table[p / BLOCK_TOKENS], (p % BLOCK_TOKENS) as u32)).collect();
        let positions: Vec<u32> = (0..n as u32).collect();
        let mut a = acts(&g, s, n);
        a.x = g.upload(&vec![0.01; n * s.dim]);
        forward(&g, &m, &mut kv, &mut a, &attn, &slots, &positions, &[n - 1], true);
        g.synchronize();
        let t = Instant::now();
        let reps = 3;
        for _ in 0..reps {
            forward(&g, &m, &mut kv, &mut a, &attn, &slots, &positions, &[n - 1], true);
        }
        g.synchronize();
        let secs = t.elapsed().as_secs_f64() / reps as f64;
        let scale = 1.0 / (s.head_dim as f32).sqrt();
        let attention = best_of_five(&g, || {
            for li in 0..s.layers {
                g.attention(&kv, li, &a.q, &attn, s.heads, scale, None, &mut a.att);
            }
        });
        let a_model = attention_model(&gpu, &peaks, s, &attn, g.attention_on_tensor_cores(KvDtype::BF16, s.head_dim));
        model_lines.push(model_line(s.name, &format!("prefill attention, {n} tokens"), Some(a_model), a_model.roofline_s, attention));
        // Matrix FLOPs (the LM head runs for the last token only) + causal attention (QK and PV).
        let layer_params = s.matrix_params() - s.vocab * s.dim;
        let flops = 2.0 * layer_params as f64 * n as f64
            + 2.0 * (s.vocab * s.dim) as f64
            + 2.0 * 2.0 * s.layers as f64 * (s.heads * s.head_dim) as f64 * (n as f64 * (n as f64 + 1.0) / 2.0);
        let achieved = flops / secs / 1e12;
        prefill_lines.push(format!(
            "| {} | {n} | {:.0} | {:.0} | {:.0}% |",
            s.name,
            n as f64 / secs,
            achieved,
            100.0 * achieved / tflops
        ));
    }
    println!();
    println!("decode step op by op and with the fused operations (fused.cu), in the same run; launches = kernels + cuBLAS calls");
    println!("| shape | batch | unfused step ms | unfused launches | fused step ms | fused launches |");
    println!("| --- | ---: | ---: | ---: | ---: | ---: |");
    for l in fusion_lines {
        println!("{l}");
    }
    println!();
    if graph_lines.is_empty() {
        println!("decode steps as CUDA graphs: off (BATON_CUDA_GRAPHS=0)");
    } else {
        println!("decode step eager and as a CUDA graph (same inputs; logits compared bit for bit):");
        println!("| shape | batch | eager step ms | graph step ms | speedup | same bits | graphs |");
        println!("| --- | ---: | ---: | ---: | ---: | --- | --- |");
        for l in graph_lines {
            println!("{l}");
        }
    }
    println!();
    println!("| shape | prompt tokens | prefill tok/s | achieved TFLOP/s | of measured GEMM |");
    println!("| --- | ---: | ---: | ---: | ---: |");
    for l in prefill_lines {
        println!("{l}");
    }
    println!();
    println!(
        "model ({}, {} SMs; measured {bw:.0} GB/s, {tflops:.0} TFLOP/s; DRAM latency {:.0} ns): every layer; expected = what the kernels' designs allow (cuda::roofline)",
        gpu.arch,
        gpu.sms,
        peaks.dram_latency * 1e9
    );
    println!("| shape | part | roofline ms | expected ms (of roofline) | waves | bound | measured ms (of roofline) |");
    println!("| --- | --- | ---: | ---: | ---: | --- | ---: |");
    for l in model_lines {
        println!("{l}");
    }
}
