//! The backend trait: every tensor operation of a decoder forward pass,
//! over tensors, weight matrices and a KV arena that the backend owns (host
//! memory for the CPU backend, device memory for an accelerator backend).
//!
//! The engine drives a forward pass only through this trait, so a backend
//! swaps in without touching the model code. Contract for every backend:
//! row results must not depend on how many rows are batched together.

use crate::attention::{attention, AttnRow};
use crate::fused::{self, Glu, QkNorm};
use crate::kv::{KvGroups, KvLayout, KvStorage};
pub use crate::error::Error as KernelError;
use crate::matmul::{matmul_many, Acts, QMatrix};
use crate::ops::{self, RopeTable};
use crate::pool::Pool;
use crate::quant::{QuantizedActs, WeightFormat};
use crate::step::StepInput;

/// Operations that only some architectures use, which a backend may lack;
/// a model needing one the backend lacks is refused at load
/// ([`Backend::supports`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OptionalOp {
    /// [`Backend::gelu_mul`] (GeGLU feed-forward).
    GeluMul,
    /// [`Backend::add_rows`] (attention projection biases).
    BiasAdd,
    /// [`Backend::scale`] (scaled embeddings).
    Scale,
    /// [`Backend::rmsnorm`] over each head of a row (QK-norm).
    HeadNorm,
    /// A `window` in [`Backend::attention`] (sliding-window layers).
    SlidingWindow,
    /// [`Backend::kv_grouped`] and [`Backend::kv_map`]: a KV arena whose layer groups
    /// are mapped to memory block by block (the sliding-window layers' memory of blocks
    /// out of every window serves other blocks).
    GroupedKv,
}

impl OptionalOp {
    pub fn name(self) -> &'static str {
        match self {
            OptionalOp::GeluMul => "GELU-gated feed-forward",
            OptionalOp::BiasAdd => "attention bias",
            OptionalOp::Scale => "embedding scale",
            OptionalOp::HeadNorm => "per-head RMSNorm (QK-norm)",
            OptionalOp::SlidingWindow => "sliding-window attention",
            OptionalOp::GroupedKv => "grouped KV arena",
        }
    }
}

/// Which backend to run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    Cpu,
    Cuda,
}

/// A row's greedy token as the device sampled it (`argmax_rows` in sampling.cu),
/// by the CPU sampler's rules: the largest logit, ties to the lowest index; a row with a
/// NaN or `+inf` fails at the first such index; a row of only `-inf` fails as masked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GreedyRow {
    Token(u32),
    /// The index of the row's first NaN or `+inf`.
    NonFinite(u32),
    AllMasked,
}

impl GreedyRow {
    /// Decodes the kernel's `(token, status)` words (status 0: a token, 1: non-finite
    /// at `token`, 2: all masked).
    pub fn from_kernel(token: u32, status: u32) -> GreedyRow {
        match status {
            0 => GreedyRow::Token(token),
            1 => GreedyRow::NonFinite(token),
            _ => GreedyRow::AllMasked,
        }
    }
}

/// Whether `BATON_DEVICE_SAMPLING` leaves greedy sampling on the device on (unset, `1`,
/// `on`, `true`); `0` makes a device backend's [`Backend::greedy_rows`] decline.
pub fn device_sampling_enabled() -> Result<bool, String> {
    match std::env::var("BATON_DEVICE_SAMPLING").as_deref() {
        Err(_) | Ok("1") | Ok("on") | Ok("true") => Ok(true),
        Ok("0") | Ok("off") | Ok("false") => Ok(false),
        Ok(other) => Err(format!("BATON_DEVICE_SAMPLING={other}: expected 1 or 0 (on or off)")),
    }
}

/// The operations of a forward pass. Tensors are flat row-major f32 arrays
/// from the caller's point of view; their storage is the backend's.
pub trait Backend: Send + Sync {
    type Tensor: Send + Sync;
    type Matrix: Send + Sync;
    type Kv: Send + Sync;
    type Rope: Send + Sync;

    /// A human-readable name ("cpu (avx512-vnni, 2 threads)").
    fn describe(&self) -> String;
    /// Runs `f` with the backend's threads available to it.
    fn run<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R;

    fn matrix(&self, format: WeightFormat, n: usize, k: usize, bytes: &[u8]) -> Result<Self::Matrix, KernelError>;
    fn matrix_from_f32(&self, n: usize, k: usize, w: Vec<f32>) -> Result<Self::Matrix, KernelError>;
    fn matrix_bytes(&self, m: &Self::Matrix) -> usize;
    fn kv(&self, layout: KvLayout, blocks: usize) -> Result<Self::Kv, KernelError>;
    /// A KV arena of `units` units of `groups.group_layers()` layers for blocks
    /// `0..blocks`, none mapped ([`OptionalOp::GroupedKv`]; see [`crate::kv`]).
    fn kv_grouped(&self, layout: KvLayout, blocks: usize, units: usize, groups: KvGroups) -> Result<Self::Kv, KernelError> {
        let _ = (layout, blocks, units, groups);
        Err(KernelError::BackendUnavailable { backend: "this backend", reason: "no grouped KV arena".into() })
    }
    /// Maps `block`'s layer groups to units (`units[g]`, or [`crate::kv::UNMAPPED`]) in
    /// an arena from [`Backend::kv_grouped`].
    fn kv_map(&self, kv: &mut Self::Kv, block: usize, units: &[u32]) {
        let _ = (kv, block, units);
    }
    /// Takes a rotary table computed on the host (one per distinct rope base
    /// and scaling of the model's layers).
    fn rope(&self, table: RopeTable) -> Self::Rope;
    /// Whether the backend implements `op`; every op of the trait not named
    /// in [`OptionalOp`] is mandatory.
    fn supports(&self, op: OptionalOp) -> bool {
        let _ = op;
        true
    }

    fn tensor(&self, len: usize) -> Self::Tensor;
    fn upload(&self, data: &[f32]) -> Self::Tensor;
    fn download(&self, t: &Self::Tensor, out: &mut [f32]);
    /// Grows `t` to at least `len` elements (contents unspecified).
    fn ensure_len(&self, t: &mut Self::Tensor, len: usize);

    /// `out[i] = row tokens[i] of the embedding table`.
    fn embed(&self, table: &Self::Matrix, tokens: &[u32], out: &mut Self::Tensor);
    /// Row by row; with `rows = tokens x heads` and `dim = head_dim` it is
    /// the per-head norm of QK-norm ([`OptionalOp::HeadNorm`]).
    fn rmsnorm(&self, x: &Self::Tensor, weight: &Self::Tensor, eps: f32, rows: usize, dim: usize, out: &mut Self::Tensor);
    /// For each `(w, out)`: `out = x · wᵀ` over `rows` rows of `x`.
    fn matmul(&self, x: &Self::Tensor, rows: usize, outs: &mut [(&Self::Matrix, &mut Self::Tensor)]);
    fn apply_rope(&self, rope: &Self::Rope, x: &mut Self::Tensor, positions: &[u32], heads: usize);
    fn silu_mul(&self, gate: &Self::Tensor, up: &Self::Tensor, len: usize, out: &mut Self::Tensor);
    /// `out = gelu_tanh(gate) * up` ([`OptionalOp::GeluMul`]).
    fn gelu_mul(&self, gate: &Self::Tensor, up: &Self::Tensor, len: usize, out: &mut Self::Tensor);
    /// `x[r] += bias` for `rows` rows of `bias`'s width ([`OptionalOp::BiasAdd`]).
    fn add_rows(&self, x: &mut Self::Tensor, bias: &Self::Tensor, rows: usize, width: usize);
    /// `x *= s` over `len` elements ([`OptionalOp::Scale`]).
    fn scale(&self, x: &mut Self::Tensor, s: f32, len: usize);
    fn add(&self, x: &mut Self::Tensor, y: &Self::Tensor, len: usize);
    /// `out[i] = x[rows[i]]` for rows of `width` elements.
    fn gather_rows(&self, x: &Self::Tensor, width: usize, rows: &[usize], out: &mut Self::Tensor);
    /// Stores row `i` of `k` and `v` into `(block, slot) = slots[i]` of `layer`.
    fn kv_write(&self, kv: &mut Self::Kv, layer: usize, k: &Self::Tensor, v: &Self::Tensor, slots: &[(u32, u32)]);
    /// Causal attention of each row over its sequence's positions `0..=pos`,
    /// or with `window: Some(w)` over the last `w` of them only
    /// ([`OptionalOp::SlidingWindow`]).
    #[allow(clippy::too_many_arguments)]
    fn attention(&self, kv: &Self::Kv, layer: usize, q: &Self::Tensor, rows: &[AttnRow], n_heads: usize, scale: f32, window: Option<usize>, out: &mut Self::Tensor);
    /// Bytes of one block (all layers), for the second tier and transport.
    fn kv_copy_block_out(&self, kv: &Self::Kv, block: usize, out: &mut [u8]);
    fn kv_copy_block_in(&self, kv: &mut Self::Kv, block: usize, data: &[u8]);
    /// `outs[i] =` the bytes of block `blocks[i]` (all layers). One call for a
    /// whole export, so that a device backend moves it in a few large copies.
    fn kv_blocks_out(&self, kv: &Self::Kv, blocks: &[usize], outs: &mut [&mut [u8]]) {
        assert_eq!(blocks.len(), outs.len(), "kv_blocks_out: one output per block");
        for (&block, out) in blocks.iter().zip(outs.iter_mut()) {
            self.kv_copy_block_out(kv, block, out);
        }
    }
    /// Installs `data[i]` (as [`Backend::kv_blocks_out`] writes it) into block `blocks[i]`.
    fn kv_blocks_in(&self, kv: &mut Self::Kv, blocks: &[usize], data: &[&[u8]]) {
        assert_eq!(blocks.len(), data.len(), "kv_blocks_in: one input per block");
        for (&block, d) in blocks.iter().zip(data) {
            self.kv_copy_block_in(kv, block, d);
        }
    }
    /// Installs the block that starts at device address `srcs[i]` of this backend's
    /// device (laid out as [`Backend::kv_blocks_out`] writes it) into block `blocks[i]`,
    /// copying on the device: a KV import that arrived in device memory (GPUDirect RDMA)
    /// never goes through the host. The sources may be reused once this returns. `false`,
    /// the default, when the backend has no device memory (the caller then copies the
    /// blocks to the host and calls [`Backend::kv_blocks_in`]).
    fn kv_blocks_in_device(&self, _kv: &mut Self::Kv, _blocks: &[usize], _srcs: &[u64]) -> bool {
        false
    }
    fn kv_block_layer_out(&self, kv: &Self::Kv, block: usize, layer: usize, out: &mut [u8]);
    fn kv_block_layer_in(&self, kv: &mut Self::Kv, block: usize, layer: usize, data: &[u8]);

    /// The greedy token of each of the first `rows` rows (of `n` logits) of `logits`,
    /// sampled where the logits are, so that a step whose every row is greedy downloads
    /// 8 bytes a row rather than the vocabulary; `None`, the default, when the backend
    /// does not (the caller then downloads the rows and samples on the host, by the
    /// same rules).
    fn greedy_rows(&self, logits: &Self::Tensor, rows: usize, n: usize) -> Option<Vec<GreedyRow>> {
        let _ = (logits, rows, n);
        None
    }

    /// Run-ahead decoding ([`crate::run_ahead`]): [`Backend::greedy_rows`] queued
    /// without waiting. The picks stay on the backend, where the next step may take
    /// them as its tokens ([`Backend::decode_step_fed`]), and reach the host at
    /// [`Backend::greedy_rows_finish`]. `None`, the default, when the backend does not
    /// run ahead (`BATON_RUN_AHEAD=0`, no device sampling, no replayable steps) or
    /// two picks are already in flight; nothing was queued then.
    fn greedy_rows_start(&self, logits: &Self::Tensor, rows: usize, n: usize) -> Option<crate::run_ahead::PendingPicks> {
        let _ = (logits, rows, n);
        None
    }

    /// Waits for `picks` (the oldest in flight) and returns them, as
    /// [`Backend::greedy_rows`] would have.
    fn greedy_rows_finish(&self, picks: crate::run_ahead::PendingPicks) -> Vec<GreedyRow> {
        panic!("greedy_rows_finish: this backend started no picks ({picks:?})")
    }

    /// [`Backend::decode_step`] whose first `from.len()` rows take as their token the
    /// pick `from[i]` of `picks` (the latest started, maybe not yet computed: queued
    /// work runs in order) instead of `input.tokens[i]`. `false`, having queued
    /// nothing, when the step cannot run so (the default; a step that does not fit
    /// its capture): the caller then reads the picks and runs the step as usual.
    fn decode_step_fed(&self, kv: &mut Self::Kv, input: &StepInput, program: usize, picks: &crate::run_ahead::PendingPicks, from: &[u32], body: &mut dyn FnMut(&mut Self::Kv)) -> bool {
        let _ = (kv, input, program, picks, from, body);
        false
    }

    /// The rows a step of `input` runs as: `Some(bucket)` when the backend may
    /// replay it from a capture (a decode-shaped step, [`crate::step::decode_rows`]),
    /// in which case the caller pads it to that many rows
    /// ([`crate::step::PaddedStep`]) and runs it through [`Backend::decode_step`];
    /// `None`, the default, runs it as it is.
    fn decode_step_rows(&self, input: &StepInput) -> Option<usize> {
        let _ = input;
        None
    }

    /// Runs `body`, a forward pass over the padded decode step `input` that
    /// queues its operations on this backend, or replays what an earlier call of
    /// the same `program` (the caller's buffers: one body over the same tensors
    /// every time) and shape captured, in which case `body` is not called; the
    /// kernels read the step's inputs from where this call staged them. A row's
    /// results are the same bits either way. The default calls `body`.
    fn decode_step(&self, kv: &mut Self::Kv, input: &StepInput, program: usize, body: &mut dyn FnMut(&mut Self::Kv)) {
        let _ = (input, program);
        body(kv)
    }

    // Fused operations: each is the sequence of plain operations in `crate::fused`
    // unless a backend overrides it with fewer passes over memory. An override
    // gives the sequence's results (on the CUDA backend: the same bits); the
    // scratch tensor a sequence needs (`h`, `a`, `t`, `attn`) and the keys `k` hold whatever
    // the backend leaves there afterwards.

    /// `outs[i] = rmsnorm(x) · wᵢᵀ`, through the scratch `h`.
    #[allow(clippy::too_many_arguments)]
    fn norm_matmul(&self, x: &Self::Tensor, weight: &Self::Tensor, eps: f32, rows: usize, dim: usize, h: &mut Self::Tensor, outs: &mut [(&Self::Matrix, &mut Self::Tensor)]) {
        fused::norm_matmul(self, x, weight, eps, rows, dim, h, outs);
    }
    /// `x += y` (a block's output into the residual stream), or with `y_norm` (a
    /// post norm) `x += rmsnorm(y) * y_norm`; then [`Backend::norm_matmul`] of the
    /// new `x` (the next block's norm and products).
    #[allow(clippy::too_many_arguments)]
    fn add_norm_matmul(&self, x: &mut Self::Tensor, y: &Self::Tensor, y_norm: Option<&Self::Tensor>, weight: &Self::Tensor, eps: f32, rows: usize, dim: usize, h: &mut Self::Tensor, outs: &mut [(&Self::Matrix, &mut Self::Tensor)]) {
        fused::add_norm_matmul(self, x, y, y_norm, weight, eps, rows, dim, h, outs);
    }
    /// `outs[i] = (glu(gate) * up) · wᵢᵀ` over `rows` rows of `width`, through the scratch `a`.
    #[allow(clippy::too_many_arguments)]
    fn glu_matmul(&self, glu: Glu, gate: &Self::Tensor, up: &Self::Tensor, rows: usize, width: usize, a: &mut Self::Tensor, outs: &mut [(&Self::Matrix, &mut Self::Tensor)]) {
        fused::glu_matmul(self, glu, gate, up, rows, width, a, outs);
    }
    /// [`Backend::apply_rope`] of `q` and `k`, then [`Backend::kv_write`] of `k` and `v`.
    #[allow(clippy::too_many_arguments)]
    fn rope_kv_write(&self, kv: &mut Self::Kv, layer: usize, rope: &Self::Rope, q: &mut Self::Tensor, q_heads: usize, k: &mut Self::Tensor, kv_heads: usize, v: &Self::Tensor, positions: &[u32], slots: &[(u32, u32)]) {
        fused::rope_kv_write(self, kv, layer, rope, q, q_heads, k, kv_heads, v, positions, slots);
    }
    /// QK-norm, then [`Backend::rope_kv_write`]: each head of `q` and `k` normed by
    /// `norm` ([`Backend::rmsnorm`] over rows of one head, through the scratch `t`).
    /// `q` holds the normed, rotated queries afterwards.
    #[allow(clippy::too_many_arguments)]
    fn qk_norm_rope_kv_write(&self, kv: &mut Self::Kv, layer: usize, rope: &Self::Rope, norm: QkNorm<'_, Self::Tensor>, q: &mut Self::Tensor, q_heads: usize, k: &mut Self::Tensor, kv_heads: usize, v: &Self::Tensor, t: &mut Self::Tensor, positions: &[u32], slots: &[(u32, u32)]) {
        fused::qk_norm_rope_kv_write(self, kv, layer, rope, norm, q, q_heads, k, kv_heads, v, t, positions, slots);
    }
    /// [`Backend::attention`] into the scratch `attn`, then `outs[i] = attn · wᵢᵀ`
    /// (the output projection).
    #[allow(clippy::too_many_arguments)]
    fn attention_matmul(&self, kv: &Self::Kv, layer: usize, q: &Self::Tensor, rows: &[AttnRow], n_heads: usize, scale: f32, window: Option<usize>, attn: &mut Self::Tensor, outs: &mut [(&Self::Matrix, &mut Self::Tensor)]) {
        fused::attention_matmul(self, kv, layer, q, rows, n_heads, scale, window, attn, outs);
    }

    /// Layer `layer` of `blocks`, block after block (`block_layer_bytes` each, as
    /// [`Backend::kv_block_layer_out`] writes one), for a pipelined export: called in a
    /// forward pass right after the layer's [`Backend::kv_write`]. A device backend
    /// queues the copy behind that write without holding up the compute that follows
    /// and returns it [`KvBytes::Pending`]; whoever ships the bytes waits for them.
    fn kv_blocks_layer_out(&self, kv: &Self::Kv, blocks: &[usize], layer: usize, block_layer_bytes: usize) -> KvBytes {
        let mut out = vec![0u8; blocks.len() * block_layer_bytes];
        for (&block, o) in blocks.iter().zip(out.chunks_exact_mut(block_layer_bytes.max(1))) {
            self.kv_block_layer_out(kv, block, layer, o);
        }
        KvBytes::Ready(out)
    }

    /// Whether [`Backend::kv_blocks_layer_out`] leaves the packed layer in device memory
    /// only (no copy to the host queued behind it) because its consumer sends it from
    /// there ([`KvBytes::into_device`]); [`KvBytes::wait`] still works, copying on the
    /// consumer's thread. A host backend has nothing to keep.
    fn keep_layer_exports_on_device(&self, _keep: bool) {}
}

/// KV bytes leaving a backend's arena ([`Backend::kv_blocks_layer_out`]).
pub enum KvBytes {
    /// Copied already (host memory backends).
    Ready(Vec<u8>),
    /// Still being copied by the device; [`KvBytes::wait`] blocks until they are here.
    Pending(Box<dyn PendingKvBytes>),
}

/// A device-to-host copy in flight. Dropping it without waiting still waits for the
/// copy (its host buffer cannot be reused while the device writes it).
pub trait PendingKvBytes: Send {
    /// Blocks until the copy is done; the bytes.
    fn wait(self: Box<Self>) -> Vec<u8>;

    /// Blocks until the bytes are complete in device memory (the device finished writing
    /// them there) and returns them kept there, for a consumer that sends from the device;
    /// `Err(self)` where they cannot stay on a device.
    fn into_device(self: Box<Self>) -> Result<Box<dyn DeviceKvBytes>, Box<dyn PendingKvBytes>>;
}

/// KV bytes kept in a device's memory (a packed layer the transport sends from there).
/// Dropping it gives the memory back to the backend: drop it only once every copy from
/// [`DeviceKvBytes::device_addr`] is done.
pub trait DeviceKvBytes: Send + Sync {
    /// Device address of the first byte, on the backend's GPU (for device-to-device copies
    /// in the same primary context).
    fn device_addr(&self) -> u64;
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Copies `dst.len()` bytes from `offset` to the host; returns once done. An
    /// out-of-range request is an error, never a panic.
    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), String>;
}

impl KvBytes {
    /// The bytes, waiting for the device if they are still on their way. Blocks: call it
    /// off an async runtime's worker threads when the bytes may be pending.
    pub fn wait(self) -> Vec<u8> {
        match self {
            KvBytes::Ready(v) => v,
            KvBytes::Pending(p) => p.wait(),
        }
    }

    /// The bytes kept in device memory ([`PendingKvBytes::into_device`]), or `Err(self)`
    /// where they are on the host already or cannot stay on the device (the caller then
    /// [`KvBytes::wait`]s). Blocks until the device wrote them: call it off an async
    /// runtime's worker threads.
    pub fn into_device(self) -> Result<Box<dyn DeviceKvBytes>, KvBytes> {
        match self {
            KvBytes::Ready(_) => Err(self),
            KvBytes::Pending(p) => p.into_device().map_err(KvBytes::Pending),
        }
    }

    /// Whether the bytes are here already.
    pub fn is_ready(&self) -> bool {
        matches!(self, KvBytes::Ready(_))
    }
}

impl std::fmt::Debug for KvBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KvBytes::Ready(v) => write!(f, "KvBytes::Ready({} bytes)", v.len()),
            KvBytes::Pending(_) => f.write_str("KvBytes::Pending"),
        }
    }
}

/// The CPU backend: host memory, a spinning fork-join pool, SIMD kernels chosen at run
/// time (AVX-512 VNNI, AVX2, or portable code, all bit-identical).
pub struct CpuBackend {
    pool: Pool,
    threads: usize,
    /// Quantized activations, reused across products (one forward pass
    /// runs at a time; the lock is never contended).
    acts: std::sync::Mutex<QuantizedActs>,
}

impl CpuBackend {
    pub fn new(threads: usize) -> Result<Self, KernelError> {
        let threads = threads.max(1);
        let pool = Pool::new(threads).map_err(|e| KernelError::Threads { threads, reason: e.to_string() })?;
        Ok(CpuBackend { pool, threads, acts: std::sync::Mutex::new(QuantizedActs::default()) })
    }
}

impl Backend for CpuBackend {
    type Tensor = Vec<f32>;
    type Matrix = QMatrix;
    type Kv = KvStorage;
    type Rope = RopeTable;

    fn describe(&self) -> String {
        let isa = match crate::matmul::isa() {
            crate::matmul::Isa::Avx512Vnni => "avx512-vnni",
            crate::matmul::Isa::Avx2 => "avx2",
            crate::matmul::Isa::Scalar => "portable",
        };
        format!("cpu ({isa}, {} threads)", self.threads)
    }

    fn run<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        // Kernels fork onto the pool themselves; the caller's thread is one
        // of its threads.
        f()
    }

    fn matrix(&self, format: WeightFormat, n: usize, k: usize, bytes: &[u8]) -> Result<QMatrix, KernelError> {
        Ok(QMatrix::from_ggml(format, n, k, bytes)?)
    }

    fn matrix_from_f32(&self, n: usize, k: usize, w: Vec<f32>) -> Result<QMatrix, KernelError> {
        Ok(QMatrix::from_f32(n, k, w)?)
    }

    fn matrix_bytes(&self, m: &QMatrix) -> usize {
        m.size_bytes()
    }

    fn kv(&self, layout: KvLayout, blocks: usize) -> Result<KvStorage, KernelError> {
        Ok(KvStorage::new(layout, blocks))
    }

    fn kv_grouped(&self, layout: KvLayout, blocks: usize, units: usize, groups: KvGroups) -> Result<KvStorage, KernelError> {
        Ok(KvStorage::grouped(layout, blocks, units, groups))
    }

    fn kv_map(&self, kv: &mut KvStorage, block: usize, units: &[u32]) {
        kv.map(block, units);
    }

    fn rope(&self, table: RopeTable) -> RopeTable {
        table
    }

    fn tensor(&self, len: usize) -> Vec<f32> {
        vec![0.0; len]
    }

    fn upload(&self, data: &[f32]) -> Vec<f32> {
        data.to_vec()
    }

    fn download(&self, t: &Vec<f32>, out: &mut [f32]) {
        let n = out.len();
        out.copy_from_slice(&t[..n]);
    }

    fn ensure_len(&self, t: &mut Vec<f32>, len: usize) {
        if t.len() < len {
            t.resize(len, 0.0);
        }
    }

    fn embed(&self, table: &QMatrix, tokens: &[u32], out: &mut Vec<f32>) {
        let k = table.k;
        self.ensure_len(out, tokens.len() * k);
        for (i, &t) in tokens.iter().enumerate() {
            table.row_f32(t as usize, &mut out[i * k..(i + 1) * k]);
        }
    }

    fn rmsnorm(&self, x: &Vec<f32>, weight: &Vec<f32>, eps: f32, rows: usize, dim: usize, out: &mut Vec<f32>) {
        self.ensure_len(out, rows * dim);
        ops::rmsnorm(&x[..rows * dim], weight, eps, dim, &mut out[..rows * dim]);
    }

    fn matmul(&self, x: &Vec<f32>, rows: usize, outs: &mut [(&QMatrix, &mut Vec<f32>)]) {
        let mut xq = self.acts.lock().unwrap_or_else(|p| p.into_inner());
        let k = outs.first().map_or(0, |(w, _)| w.k);
        assert!(outs.iter().all(|(w, _)| w.k == k), "fused products must share one input width");
        if outs.iter().any(|(w, _)| w.acts() == Acts::Q8) {
            xq.quantize(&self.pool, x, rows, k);
        }
        if outs.iter().any(|(w, _)| w.acts() == Acts::Q8K) {
            xq.q8k.quantize(&self.pool, x, rows, k);
        }
        let mut views: Vec<(&QMatrix, &mut [f32])> = outs
            .iter_mut()
            .map(|(w, out)| {
                if out.len() < rows * w.n {
                    out.resize(rows * w.n, 0.0);
                }
                (*w, &mut out[..])
            })
            .collect();
        matmul_many(&self.pool, x, &xq, rows, &mut views);
    }

    fn apply_rope(&self, rope: &RopeTable, x: &mut Vec<f32>, positions: &[u32], heads: usize) {
        rope.apply(x, positions, heads);
    }

    fn silu_mul(&self, gate: &Vec<f32>, up: &Vec<f32>, len: usize, out: &mut Vec<f32>) {
        self.ensure_len(out, len);
        ops::silu_mul_parallel(&self.pool, &gate[..len], &up[..len], &mut out[..len]);
    }

    fn gelu_mul(&self, gate: &Vec<f32>, up: &Vec<f32>, len: usize, out: &mut Vec<f32>) {
        self.ensure_len(out, len);
        ops::gelu_mul_parallel(&self.pool, &gate[..len], &up[..len], &mut out[..len]);
    }

    fn add_rows(&self, x: &mut Vec<f32>, bias: &Vec<f32>, rows: usize, width: usize) {
        ops::add_rows(&mut x[..rows * width], &bias[..width]);
    }

    fn scale(&self, x: &mut Vec<f32>, s: f32, len: usize) {
        ops::scale_inplace(&mut x[..len], s);
    }

    fn add(&self, x: &mut Vec<f32>, y: &Vec<f32>, len: usize) {
        ops::add_inplace(&mut x[..len], &y[..len]);
    }

    fn gather_rows(&self, x: &Vec<f32>, width: usize, rows: &[usize], out: &mut Vec<f32>) {
        self.ensure_len(out, rows.len() * width);
        for (i, &r) in rows.iter().enumerate() {
            out[i * width..(i + 1) * width].copy_from_slice(&x[r * width..(r + 1) * width]);
        }
    }

    fn kv_write(&self, kv: &mut KvStorage, layer: usize, k: &Vec<f32>, v: &Vec<f32>, slots: &[(u32, u32)]) {
        let te = kv.layout.token_elems();
        for (i, &(block, slot)) in slots.iter().enumerate() {
            kv.write_token(layer, block as usize, slot as usize, &k[i * te..(i + 1) * te], &v[i * te..(i + 1) * te]);
        }
    }

    fn attention(&self, kv: &KvStorage, layer: usize, q: &Vec<f32>, rows: &[AttnRow], n_heads: usize, scale: f32, window: Option<usize>, out: &mut Vec<f32>) {
        self.ensure_len(out, rows.len() * n_heads * kv.layout.head_dim);
        attention(&self.pool, kv, layer, q, rows, n_heads, scale, window, out);
    }

    fn kv_copy_block_out(&self, kv: &KvStorage, block: usize, out: &mut [u8]) {
        kv.copy_block_out(block, out);
    }

    fn kv_copy_block_in(&self, kv: &mut KvStorage, block: usize, data: &[u8]) {
        kv.copy_block_in(block, data);
    }

    fn kv_block_layer_out(&self, kv: &KvStorage, block: usize, layer: usize, out: &mut [u8]) {
        out.copy_from_slice(kv.block_layer_bytes(block, layer));
    }

    fn kv_block_layer_in(&self, kv: &mut KvStorage, block: usize, layer: usize, data: &[u8]) {
        kv.set_block_layer_bytes(block, layer, data);
    }

    fn kv_blocks_layer_out(&self, kv: &KvStorage, blocks: &[usize], layer: usize, block_layer_bytes: usize) -> KvBytes {
        // One allocation, one memcpy per block: this runs on the engine's thread
        // between two layers of a forward pass.
        let mut out = Vec::with_capacity(blocks.len() * block_layer_bytes);
        for &block in blocks {
            out.extend_from_slice(kv.block_layer_bytes(block, layer));
        }
        KvBytes::Ready(out)
    }
}

/// Says why the CUDA backend cannot be used in a build without the `cuda` feature.
pub fn cuda_unavailable() -> KernelError {
    KernelError::BackendUnavailable {
        backend: "cuda",
        reason: "this binary was built without the `cuda` feature".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pending copy that cannot stay on a device (as a backend without device memory would
    /// make one): `into_device` hands it back, still pending, and it still waits.
    struct HostOnly(Vec<u8>);

    impl PendingKvBytes for HostOnly {
        fn wait(self: Box<Self>) -> Vec<u8> {
            self.0
        }
        fn into_device(self: Box<Self>) -> Result<Box<dyn DeviceKvBytes>, Box<dyn PendingKvBytes>> {
            Err(self)
        }
    }

    #[test]
    fn bytes_that_cannot_stay_on_a_device_come_back_unchanged() {
        let ready = KvBytes::Ready(vec![1, 2, 3]).into_device().err().expect("bytes on the host are not on a device");
        assert_eq!(ready.wait(), [1, 2, 3]);
        let pending = KvBytes::Pending(Box::new(HostOnly(vec![4, 5]))).into_device().err().expect("refused by the pending copy");
        assert!(!pending.is_ready(), "handed back still pending");
        assert_eq!(pending.wait(), [4, 5]);
        let cpu = CpuBackend::new(1).unwrap();
        cpu.keep_layer_exports_on_device(true);
        let layout = KvLayout { layers: 2, block_tokens: 4, kv_heads: 1, head_dim: 8, dtype: crate::kv::KvDtype::F32 };
        let kv = cpu.kv(layout, 3).unwrap();
        let lb = layout.block_layer_bytes();
        let out = cpu.kv_blocks_layer_out(&kv, &[2, 0], 1, lb);
        assert!(out.into_device().is_err_and(|b| b.wait().len() == 2 * lb), "a host backend's export stays on the host, whatever it was asked");
    }
}
