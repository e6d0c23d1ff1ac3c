//! A [`Backend`] whose element-wise, row and rotary operations are the CUDA
//! backend's kernels run in the emulator (feature `emu`), launched with the
//! geometry [`crate::cuda::plan`] gives the GPU, so that a whole model's forward
//! pass (any family: GeGLU, biases, QK-norm, embedding scale, per-layer rotary
//! tables) runs the CUDA kernels on machines without a GPU and is compared with
//! the CPU backend (`engine/tests/cuda_emulated_engine.rs`).
//!
//! What the emulator cannot stand for is the CPU backend's here: matrix products
//! (cuBLAS is not emulated; the GPU suite compares them), and the KV arena and
//! attention (their kernels are compared operation by operation in
//! `tests/cuda_emulated.rs`). The embedding is looked up, as on the GPU, from
//! the table expanded to bf16.
//!
//! Products take their input as the GPU gives it to cuBLAS: rounded to bf16 by
//! the `to_bf16` kernel, or written as bf16 by a fused kernel (`fused.cu`);
//! [`EmuBackend::f32_products`] instead gives the CPU's products the f32 values
//! (and runs no fused kernel), so that what is compared with the CPU backend
//! is the kernels' arithmetic alone, not the GPU's bf16 inputs as well.
//! The KV writes run the `kv_write` / `rope_kv_write` kernels on a scratch
//! arena and copy each token's bytes into its slot of the CPU's arena.
//!
//! The fused operations run the fused kernels, or with [`EmuBackend::unfused`]
//! the unfused sequences ([`crate::fused`]) of the plain kernels, so a test can
//! check that a whole forward pass gives the same bits either way. The backend
//! counts the launches the CUDA backend would make for what it ran
//! ([`EmuBackend::launches`]): each emulated kernel, and for the products and
//! attention that the CPU stands in for, the cuBLAS calls (one per [`GEMM_ROWS`]
//! rows of each weight matrix) and the attention plan's two launches (with
//! `attention_matmul`, the combine writes the products' bf16 input itself: no
//! `to_bf16` launch is counted).
//!
//! For tests only: every kernel runs on the calling thread, one fiber per
//! GPU thread.
//!
//! Made with [`EmuBackend::with_decode_steps`], it also runs decode steps the
//! way the CUDA backend captures and replays them (`emu_steps`).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

use crate::attention::AttnRow;
use crate::backend::{Backend, CpuBackend, GreedyRow, KernelError, OptionalOp};
use crate::run_ahead::{fed_runs, PendingPicks, PickQueue};
use crate::cuda::plan::{self, ROW_THREADS, TOKEN_THREADS};
use crate::cuda::GEMM_ROWS;
use crate::emu::{self, Launch};
use crate::emu_steps::{self, EmuStepStats, EmuSteps};
use crate::fused::{self, Glu, QkNorm};
use crate::kv::{KvDtype, KvGroups, KvLayout, KvStorage};
use crate::matmul::QMatrix;
use crate::ops::RopeTable;
use crate::quant::WeightFormat;
use crate::step::{CaptureGuard, StepInput};

/// The CUDA kernels on the CPU; see the module docs.
pub struct EmuBackend {
    cpu: CpuBackend,
    /// Replayable decode steps, when made with them.
    steps: Option<Mutex<EmuSteps>>,
    capture: CaptureGuard,
    /// Whether the fused operations run the fused kernels (else their unfused sequences).
    fuse: bool,
    /// Whether products read their input rounded to bf16, as cuBLAS does on the GPU.
    bf16_products: bool,
    launches: AtomicUsize,
    /// Whether [`Backend::greedy_rows`] runs the sampling kernel (else the caller samples on the host).
    device_sampling: bool,
    /// Whether greedy picks may stay "on the device" for the next step (run-ahead
    /// decoding; with decode steps and device sampling only, as on the GPU).
    run_ahead: bool,
    picks: Mutex<EmuPicks>,
}

/// Picks in flight: the latest picks' tokens (what the GPU keeps in device memory)
/// and each ticket's rows (its host half).
#[derive(Default)]
struct EmuPicks {
    queue: PickQueue,
    halves: [Vec<GreedyRow>; 2],
    latest: Vec<u32>,
}

impl EmuBackend {
    /// `threads`: the CPU backend's, for the products and attention.
    pub fn new(threads: usize) -> Result<Self, KernelError> {
        Ok(EmuBackend { cpu: CpuBackend::new(threads)?, steps: None, capture: CaptureGuard::default(), fuse: true, bf16_products: true, launches: AtomicUsize::new(0), device_sampling: true, run_ahead: true, picks: Mutex::default() })
    }

    /// The backend with the CUDA backend's replayable decode steps (`emu_steps`):
    /// decode-shaped steps padded to buckets, their inputs read from staged words.
    pub fn with_decode_steps(threads: usize) -> Result<Self, KernelError> {
        Ok(EmuBackend { steps: Some(Mutex::default()), ..EmuBackend::new(threads)? })
    }

    /// The backend with greedy rows sampled on the host, as without `greedy_rows`
    /// (`BATON_DEVICE_SAMPLING=0` on the GPU): for comparisons.
    pub fn with_host_sampling(self) -> Self {
        EmuBackend { device_sampling: false, ..self }
    }

    /// The backend that waits for each step's tokens before the next step is queued
    /// (`BATON_RUN_AHEAD=0` on the GPU): for comparisons.
    pub fn without_run_ahead(self) -> Self {
        EmuBackend { run_ahead: false, ..self }
    }

    /// What the decode steps did so far (all zero without them).
    pub fn step_stats(&self) -> EmuStepStats {
        self.steps.as_ref().map(|s| s.lock().unwrap_or_else(|p| p.into_inner()).stats.clone()).unwrap_or_default()
    }

    /// Runs `f` on the staged words of the step under way, if there is one;
    /// otherwise records the upload from host memory the CUDA backend would make
    /// (refused during a capture) and returns `None`.
    fn staged<R>(&self, f: impl FnOnce(&emu_steps::Staged) -> R) -> Option<R> {
        let st = self.steps.as_ref().map(|s| s.lock().unwrap_or_else(|p| p.into_inner()));
        match st.as_ref().and_then(|s| s.active.as_ref()) {
            Some(staged) => Some(f(staged)),
            None => {
                self.capture.allow("index upload");
                None
            }
        }
    }

    /// The same backend with the fused operations run as their unfused
    /// sequences of kernels ([`crate::fused`]), as a backend without fused kernels runs them.
    pub fn unfused(threads: usize) -> Result<Self, KernelError> {
        Ok(EmuBackend { fuse: false, ..Self::new(threads)? })
    }

    /// Unfused, and the products computed by the CPU backend from their f32
    /// input (what the GPU rounds to bf16 first): the kernels' arithmetic against
    /// the CPU's with nothing else between them.
    pub fn f32_products(threads: usize) -> Result<Self, KernelError> {
        Ok(EmuBackend { fuse: false, bf16_products: false, ..Self::new(threads)? })
    }

    /// Launches the CUDA backend would have made for the operations run so far
    /// (see the module docs).
    pub fn launches(&self) -> usize {
        self.launches.load(Ordering::Relaxed)
    }

    fn count(&self, launches: usize) {
        self.launches.fetch_add(launches, Ordering::Relaxed);
    }

    /// The products of `outs` over `rows` rows of bf16 input `xb` (what cuBLAS
    /// reads on the GPU), computed by the CPU backend from those values.
    fn products(&self, xb: &[u16], rows: usize, outs: &mut [(&EmuMatrix, &mut Vec<f32>)]) {
        if rows == 0 || outs.is_empty() {
            return;
        }
        let x: Vec<f32> = xb.iter().map(|&b| half::bf16::from_bits(b).to_f32()).collect();
        let mut cpu: Vec<(&QMatrix, &mut Vec<f32>)> = outs.iter_mut().map(|(m, o)| (&m.q, &mut **o)).collect();
        self.cpu.matmul(&x, rows, &mut cpu);
        self.count(outs.len() * rows.div_ceil(GEMM_ROWS));
    }

    /// Runs `kernel` (a KV-writing kernel) on a scratch arena of one single-layer
    /// block per row, row `i` going to slot `slots[i].1` of scratch block `i`, then
    /// copies each row's keys and values into slot `slots[i]` of `layer` of `kv`.
    /// `kernel(arena, flat slots, layout)` launches with layer 0 of `layout`.
    fn write_kv(&self, kv: &mut KvStorage, layer: usize, slots: &[(u32, u32)], kernel: impl FnOnce(*mut u8, &[u32], KvLayout)) {
        let l = kv.layout;
        assert!(slots.iter().all(|&(b, s)| (b as usize) < kv.num_blocks && (s as usize) < l.block_tokens), "kv_write: slot out of range");
        let one = KvLayout { layers: 1, ..l };
        let lb = one.block_layer_bytes();
        // Words, so that the kernel's f32 and 16-bit stores are aligned.
        let mut arena = vec![0u32; (slots.len() * lb).div_ceil(4)];
        let flat: Vec<u32> = slots.iter().enumerate().flat_map(|(i, &(_, s))| [i as u32, s]).collect();
        kernel(arena.as_mut_ptr().cast(), &flat, one);
        self.count(1);
        // SAFETY: the words' bytes, as the kernel wrote them.
        let bytes = unsafe { std::slice::from_raw_parts(arena.as_ptr().cast::<u8>(), slots.len() * lb) };
        let tb = l.token_elems() * l.dtype.bytes();
        for (i, &(b, s)) in slots.iter().enumerate() {
            let mut layer_bytes = kv.block_layer_bytes(b as usize, layer).to_vec();
            let from = &bytes[i * lb..(i + 1) * lb];
            for at in [s as usize * tb, (l.block_tokens + s as usize) * tb] {
                layer_bytes[at..at + tb].copy_from_slice(&from[at..at + tb]);
            }
            kv.set_block_layer_bytes(b as usize, layer, &layer_bytes);
        }
    }
}

/// A weight matrix: the CPU backend's, and its bf16 expansion (what the GPU
/// stores) once it is used as an embedding table.
pub struct EmuMatrix {
    q: QMatrix,
    bf16: OnceLock<Vec<u16>>,
}

impl EmuMatrix {
    fn new(q: QMatrix) -> Self {
        EmuMatrix { q, bf16: OnceLock::new() }
    }

    /// The rows as bf16 bits, expanded as `CudaBackend::matrix` does.
    fn bf16(&self) -> &[u16] {
        self.bf16.get_or_init(|| {
            let (n, k) = (self.q.n, self.q.k);
            let mut bits = vec![0u16; n * k];
            let mut row = vec![0f32; k];
            for (r, out) in bits.chunks_exact_mut(k).enumerate() {
                self.q.row_f32(r, &mut row);
                for (o, &v) in out.iter_mut().zip(&row) {
                    *o = half::bf16::from_f32(v).to_bits();
                }
            }
            bits
        })
    }
}

fn launch(g: plan::Geometry) -> Launch {
    Launch::new(g.grid, g.block, g.shared_bytes as usize)
}

impl Backend for EmuBackend {
    type Tensor = Vec<f32>;
    type Matrix = EmuMatrix;
    type Kv = KvStorage;
    type Rope = RopeTable;

    fn describe(&self) -> String {
        format!("cuda kernels emulated on the CPU (products, KV and attention: {})", self.cpu.describe())
    }

    fn run<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.cpu.run(f)
    }

    fn matrix(&self, format: WeightFormat, n: usize, k: usize, bytes: &[u8]) -> Result<EmuMatrix, KernelError> {
        // Counted as on the GPU, where a matrix is a new device buffer a graph may not hold.
        self.capture.alloc("a matrix upload");
        Ok(EmuMatrix::new(self.cpu.matrix(format, n, k, bytes)?))
    }

    fn matrix_from_f32(&self, n: usize, k: usize, w: Vec<f32>) -> Result<EmuMatrix, KernelError> {
        self.capture.alloc("a matrix upload");
        Ok(EmuMatrix::new(self.cpu.matrix_from_f32(n, k, w)?))
    }

    fn matrix_bytes(&self, m: &EmuMatrix) -> usize {
        self.cpu.matrix_bytes(&m.q)
    }

    fn kv(&self, layout: KvLayout, blocks: usize) -> Result<KvStorage, KernelError> {
        self.capture.alloc("the KV arena");
        // With decode steps, a spare block past the engine's for padding rows, as on the GPU.
        self.cpu.kv(layout, blocks + usize::from(self.steps.is_some()))
    }

    fn kv_grouped(&self, layout: KvLayout, blocks: usize, units: usize, groups: KvGroups) -> Result<KvStorage, KernelError> {
        if self.steps.is_some() {
            return Err(KernelError::BackendUnavailable { backend: "emulated cuda", reason: "decode steps over a grouped KV arena are not emulated (the CUDA backend has no grouped arena)".into() });
        }
        self.cpu.kv_grouped(layout, blocks, units, groups)
    }

    fn kv_map(&self, kv: &mut KvStorage, block: usize, units: &[u32]) {
        self.cpu.kv_map(kv, block, units);
    }

    fn rope(&self, table: RopeTable) -> RopeTable {
        // As on the GPU, where the tables are new device buffers.
        self.capture.alloc("rope tables");
        table
    }

    fn supports(&self, op: OptionalOp) -> bool {
        // Every op the kernels implement; attention and the arena are the CPU's. With decode
        // steps, a plain arena as on the GPU (a grouped one has no spare block for padding rows).
        !(op == OptionalOp::GroupedKv && self.steps.is_some())
    }

    fn tensor(&self, len: usize) -> Vec<f32> {
        self.capture.alloc("a tensor");
        vec![0.0; len]
    }

    fn upload(&self, data: &[f32]) -> Vec<f32> {
        self.capture.alloc("an uploaded tensor");
        data.to_vec()
    }

    fn download(&self, t: &Vec<f32>, out: &mut [f32]) {
        out.copy_from_slice(&t[..out.len()]);
    }

    fn ensure_len(&self, t: &mut Vec<f32>, len: usize) {
        if t.len() < len {
            self.capture.alloc("growing a tensor");
            t.resize(len, 0.0);
        }
    }

    fn embed(&self, table: &EmuMatrix, tokens: &[u32], out: &mut Vec<f32>) {
        if tokens.is_empty() {
            return;
        }
        assert!(tokens.iter().all(|&t| (t as usize) < table.q.n), "token beyond the embedding table ({})", table.q.n);
        let k = table.q.k;
        self.ensure_len(out, tokens.len() * k);
        let tokens = self.staged(|s| s.words(&s.layout.tokens).to_vec()).unwrap_or_else(|| tokens.to_vec());
        // SAFETY: the table holds n x k values, `out` tokens x k, every token < n (checked).
        unsafe { emu::embed_bf16(&launch(plan::per_row(tokens.len(), ROW_THREADS)), table.bf16().as_ptr(), tokens.as_ptr(), k as i32, out.as_mut_ptr()) };
        self.count(1);
    }

    fn rmsnorm(&self, x: &Vec<f32>, weight: &Vec<f32>, eps: f32, rows: usize, dim: usize, out: &mut Vec<f32>) {
        if rows == 0 {
            return;
        }
        assert!(x.len() >= rows * dim && weight.len() >= dim, "rmsnorm: {rows} rows of {dim} past the tensors");
        self.ensure_len(out, rows * dim);
        // SAFETY: x and out hold rows x dim values, the weight dim (checked above).
        unsafe { emu::rmsnorm(&launch(plan::per_row(rows, ROW_THREADS)), x.as_ptr(), weight.as_ptr(), eps, dim as i32, out.as_mut_ptr()) };
        self.count(1);
    }

    fn matmul(&self, x: &Vec<f32>, rows: usize, outs: &mut [(&EmuMatrix, &mut Vec<f32>)]) {
        let Some(k) = outs.first().map(|(w, _)| w.q.k) else { return };
        if rows == 0 {
            return;
        }
        for (m, out) in outs.iter_mut() {
            self.ensure_len(out, rows * m.q.n);
        }
        assert!(x.len() >= rows * k, "matmul: {rows} rows of {k} past the tensor");
        if !self.bf16_products {
            let mut cpu: Vec<(&QMatrix, &mut Vec<f32>)> = outs.iter_mut().map(|(m, o)| (&m.q, &mut **o)).collect();
            self.cpu.matmul(x, rows, &mut cpu);
            // The GPU's to_bf16 and cuBLAS calls.
            return self.count(1 + outs.len() * rows.div_ceil(GEMM_ROWS));
        }
        let mut xb = vec![0u16; rows * k];
        // SAFETY: x holds rows x k values, xb as many (checked above).
        unsafe { emu::to_bf16(&launch(plan::elementwise(rows * k)), x.as_ptr(), xb.as_mut_ptr(), (rows * k) as u64) };
        self.count(1);
        self.products(&xb, rows, outs);
    }

    fn apply_rope(&self, rope: &RopeTable, x: &mut Vec<f32>, positions: &[u32], heads: usize) {
        if positions.is_empty() {
            return;
        }
        if let Some(&p) = positions.iter().find(|&&p| p as usize >= rope.max_pos) {
            panic!("position {p} beyond the rope table ({})", rope.max_pos);
        }
        assert!(x.len() >= positions.len() * heads * rope.head_dim, "apply_rope: rows past the tensor");
        let positions = self.staged(|s| s.words(&s.layout.positions).to_vec()).unwrap_or_else(|| positions.to_vec());
        let (cos, sin) = rope.tables();
        // SAFETY: x holds a row of heads x head_dim per position, the tables max_pos rows (checked).
        #[rustfmt::skip]
        unsafe { emu::rope(&launch(plan::per_row(positions.len(), TOKEN_THREADS)), x.as_mut_ptr(), cos.as_ptr(), sin.as_ptr(), positions.as_ptr(), heads as i32, (rope.head_dim / 2) as i32) };
        self.count(1);
    }

    fn silu_mul(&self, gate: &Vec<f32>, up: &Vec<f32>, len: usize, out: &mut Vec<f32>) {
        if len == 0 {
            return;
        }
        assert!(gate.len() >= len && up.len() >= len, "silu_mul: {len} elements past the tensors");
        self.ensure_len(out, len);
        // SAFETY: every buffer holds len values (checked above).
        unsafe { emu::silu_mul(&launch(plan::elementwise(len)), gate.as_ptr(), up.as_ptr(), out.as_mut_ptr(), len as u64) };
        self.count(1);
    }

    fn gelu_mul(&self, gate: &Vec<f32>, up: &Vec<f32>, len: usize, out: &mut Vec<f32>) {
        if len == 0 {
            return;
        }
        assert!(gate.len() >= len && up.len() >= len, "gelu_mul: {len} elements past the tensors");
        self.ensure_len(out, len);
        // SAFETY: every buffer holds len values (checked above).
        unsafe { emu::gelu_mul(&launch(plan::elementwise(len)), gate.as_ptr(), up.as_ptr(), out.as_mut_ptr(), len as u64) };
        self.count(1);
    }

    fn add_rows(&self, x: &mut Vec<f32>, bias: &Vec<f32>, rows: usize, width: usize) {
        if rows == 0 || width == 0 {
            return;
        }
        assert!(x.len() >= rows * width && bias.len() >= width, "add_rows: {rows} rows of {width} past the tensors");
        // SAFETY: x holds rows x width values, the bias width (checked above).
        unsafe { emu::add_rows(&launch(plan::elementwise(rows * width)), x.as_mut_ptr(), bias.as_ptr(), (rows * width) as u64, width as i32) };
        self.count(1);
    }

    fn scale(&self, x: &mut Vec<f32>, s: f32, len: usize) {
        if len == 0 {
            return;
        }
        assert!(x.len() >= len, "scale: {len} elements past the tensor");
        // SAFETY: x holds len values (checked above).
        unsafe { emu::scale_inplace(&launch(plan::elementwise(len)), x.as_mut_ptr(), s, len as u64) };
        self.count(1);
    }

    fn add(&self, x: &mut Vec<f32>, y: &Vec<f32>, len: usize) {
        if len == 0 {
            return;
        }
        assert!(x.len() >= len && y.len() >= len, "add: {len} elements past the tensors");
        // SAFETY: both hold len values (checked above).
        unsafe { emu::add_inplace(&launch(plan::elementwise(len)), x.as_mut_ptr(), y.as_ptr(), len as u64) };
        self.count(1);
    }

    fn greedy_rows_start(&self, logits: &Vec<f32>, rows: usize, n: usize) -> Option<PendingPicks> {
        let mut p = self.picks.lock().unwrap_or_else(|p| p.into_inner());
        if !(self.run_ahead && self.steps.is_some() && p.queue.can_start()) {
            return None;
        }
        let picked = self.greedy_rows(logits, rows, n)?;
        let (pending, half) = p.queue.start(rows).expect("a free half (checked above)");
        // What stays on the device: the token words, whatever the status (`from_kernel`'s inverse).
        p.latest = picked.iter().map(|r| match *r {
            GreedyRow::Token(t) | GreedyRow::NonFinite(t) => t,
            GreedyRow::AllMasked => 0,
        }).collect();
        p.halves[half] = picked;
        Some(pending)
    }

    fn greedy_rows_finish(&self, picks: PendingPicks) -> Vec<GreedyRow> {
        let mut p = self.picks.lock().unwrap_or_else(|p| p.into_inner());
        let half = p.queue.finish(picks);
        std::mem::take(&mut p.halves[half])
    }

    fn decode_step_fed(&self, kv: &mut KvStorage, input: &StepInput, program: usize, picks: &PendingPicks, from: &[u32], body: &mut dyn FnMut(&mut KvStorage)) -> bool {
        let Some(steps) = &self.steps else { return false };
        let tokens = {
            let p = self.picks.lock().unwrap_or_else(|p| p.into_inner());
            assert!(p.queue.is_latest(picks), "decode_step_fed: {picks:?} are not the latest picks");
            let mut tokens = input.tokens.to_vec();
            for run in fed_runs(from) {
                tokens[run.dst..run.dst + run.len].copy_from_slice(&p.latest[run.src..run.src + run.len]);
            }
            tokens
        };
        emu_steps::decode_step(steps, &self.capture, kv, input, program, Some(&tokens), body)
    }

    fn greedy_rows(&self, logits: &Vec<f32>, rows: usize, n: usize) -> Option<Vec<GreedyRow>> {
        if !self.device_sampling {
            return None;
        }
        assert!(logits.len() >= rows * n, "greedy_rows: {rows} rows of {n} in {} logits", logits.len());
        let (mut token, mut status) = (vec![0u32; rows], vec![0u32; rows]);
        if rows > 0 {
            // SAFETY: logits holds rows x n values (checked); token and status one word a row.
            unsafe { emu::argmax_rows(&launch(plan::per_row(rows, ROW_THREADS)), logits.as_ptr(), n as i32, token.as_mut_ptr(), status.as_mut_ptr()) };
            self.count(1);
        }
        Some(token.into_iter().zip(status).map(|(t, s)| GreedyRow::from_kernel(t, s)).collect())
    }

    fn gather_rows(&self, x: &Vec<f32>, width: usize, rows: &[usize], out: &mut Vec<f32>) {
        if rows.is_empty() {
            return;
        }
        assert!(rows.iter().all(|&r| (r + 1) * width <= x.len()), "gather_rows: a row past the tensor");
        self.ensure_len(out, rows.len() * width);
        let ids = self.staged(|s| s.words(&s.layout.logit_rows).to_vec()).unwrap_or_else(|| rows.iter().map(|&r| r as u32).collect());
        // SAFETY: every picked row is within x (checked), out holds rows x width values.
        unsafe { emu::gather_rows(&launch(plan::per_row(rows.len(), ROW_THREADS)), x.as_ptr(), ids.as_ptr(), width as i32, out.as_mut_ptr()) };
        self.count(1);
    }

    fn kv_write(&self, kv: &mut KvStorage, layer: usize, k: &Vec<f32>, v: &Vec<f32>, slots: &[(u32, u32)]) {
        if slots.is_empty() {
            return;
        }
        // A replayable step's slots are the staged ones (padding rows' on the spare block).
        let slots = &self.staged(|s| s.slots()).unwrap_or_else(|| slots.to_vec())[..];
        let te = kv.layout.token_elems();
        assert!(k.len() >= slots.len() * te && v.len() >= slots.len() * te, "kv_write: rows past the tensors");
        self.write_kv(kv, layer, slots, |arena, flat, l| {
            let g = launch(plan::per_row(slots.len(), TOKEN_THREADS));
            let (k, v, s, bt, te) = (k.as_ptr(), v.as_ptr(), flat.as_ptr(), l.block_tokens as i32, te as i32);
            // SAFETY: the scratch arena holds one block per row, k and v a row each (checked above).
            unsafe {
                match l.dtype {
                    KvDtype::F32 => emu::kv_write_f32(&g, arena, k, v, s, 0, 1, bt, te),
                    KvDtype::F16 => emu::kv_write_f16(&g, arena, k, v, s, 0, 1, bt, te),
                    KvDtype::BF16 => emu::kv_write_bf16(&g, arena, k, v, s, 0, 1, bt, te),
                    KvDtype::F8E4M3 => emu::kv_write_e4m3(&g, arena, k, v, s, 0, 1, bt, te),
                }
            }
        });
    }

    fn attention(&self, kv: &KvStorage, layer: usize, q: &Vec<f32>, rows: &[AttnRow], n_heads: usize, scale: f32, window: Option<usize>, out: &mut Vec<f32>) {
        self.ensure_len(out, rows.len() * n_heads * kv.layout.head_dim);
        let staged = self.staged(|s| self.cpu.attention(kv, layer, q, &s.attn_rows(), n_heads, scale, window, out));
        if staged.is_none() {
            self.cpu.attention(kv, layer, q, rows, n_heads, scale, window, out);
        }
        if !rows.is_empty() {
            self.count(2); // the partial kernel and the combine, whatever the plan's kernel
        }
    }

    fn decode_step_rows(&self, input: &StepInput) -> Option<usize> {
        self.steps.as_ref().and_then(|_| crate::step::decode_rows(input))
    }

    fn decode_step(&self, kv: &mut KvStorage, input: &StepInput, program: usize, body: &mut dyn FnMut(&mut KvStorage)) {
        match &self.steps {
            Some(steps) => {
                emu_steps::decode_step(steps, &self.capture, kv, input, program, None, body);
            }
            None => body(kv),
        }
    }

    fn kv_copy_block_out(&self, kv: &KvStorage, block: usize, out: &mut [u8]) {
        self.cpu.kv_copy_block_out(kv, block, out);
    }

    fn kv_copy_block_in(&self, kv: &mut KvStorage, block: usize, data: &[u8]) {
        self.cpu.kv_copy_block_in(kv, block, data);
    }

    fn kv_block_layer_out(&self, kv: &KvStorage, block: usize, layer: usize, out: &mut [u8]) {
        self.cpu.kv_block_layer_out(kv, block, layer, out);
    }

    fn kv_block_layer_in(&self, kv: &mut KvStorage, block: usize, layer: usize, data: &[u8]) {
        self.cpu.kv_block_layer_in(kv, block, layer, data);
    }

    fn norm_matmul(&self, x: &Vec<f32>, weight: &Vec<f32>, eps: f32, rows: usize, dim: usize, h: &mut Vec<f32>, outs: &mut [(&EmuMatrix, &mut Vec<f32>)]) {
        if !self.fuse {
            return fused::norm_matmul(self, x, weight, eps, rows, dim, h, outs);
        }
        if rows == 0 || outs.is_empty() {
            return;
        }
        assert!(x.len() >= rows * dim && weight.len() >= dim, "norm_matmul: {rows} rows of {dim} past the tensors");
        let mut xb = vec![0u16; rows * dim];
        // SAFETY: x and xb hold rows x dim values, the weight dim (checked above).
        unsafe { emu::rmsnorm_bf16(&launch(plan::per_row(rows, ROW_THREADS)), x.as_ptr(), weight.as_ptr(), eps, dim as i32, xb.as_mut_ptr()) };
        self.count(1);
        self.products(&xb, rows, outs);
    }

    #[rustfmt::skip]
    fn add_norm_matmul(&self, x: &mut Vec<f32>, y: &Vec<f32>, y_norm: Option<&Vec<f32>>, weight: &Vec<f32>, eps: f32, rows: usize, dim: usize, h: &mut Vec<f32>, outs: &mut [(&EmuMatrix, &mut Vec<f32>)]) {
        if !self.fuse || outs.is_empty() {
            // Without products, the CUDA backend runs the sequence too (the norm has no reader).
            return fused::add_norm_matmul(self, x, y, y_norm, weight, eps, rows, dim, h, outs);
        }
        if rows == 0 {
            return;
        }
        assert!(x.len() >= rows * dim && y.len() >= rows * dim && weight.len() >= dim, "add_norm_matmul: {rows} rows of {dim} past the tensors");
        assert!(y_norm.is_none_or(|wy| wy.len() >= dim), "add_norm_matmul: a post norm shorter than {dim}");
        let mut xb = vec![0u16; rows * dim];
        let g = launch(plan::per_row(rows, ROW_THREADS));
        // SAFETY: x, y and xb hold rows x dim values, the weights dim (checked above).
        unsafe {
            match y_norm {
                None => emu::add_rmsnorm_bf16(&g, x.as_mut_ptr(), y.as_ptr(), weight.as_ptr(), eps, dim as i32, xb.as_mut_ptr()),
                Some(wy) => emu::norm_add_rmsnorm_bf16(&g, x.as_mut_ptr(), y.as_ptr(), wy.as_ptr(), weight.as_ptr(), eps, dim as i32, xb.as_mut_ptr()),
            }
        }
        self.count(1);
        self.products(&xb, rows, outs);
    }

    #[rustfmt::skip]
    fn glu_matmul(&self, glu: Glu, gate: &Vec<f32>, up: &Vec<f32>, rows: usize, width: usize, a: &mut Vec<f32>, outs: &mut [(&EmuMatrix, &mut Vec<f32>)]) {
        if !self.fuse {
            return fused::glu_matmul(self, glu, gate, up, rows, width, a, outs);
        }
        let len = rows * width;
        if len == 0 || outs.is_empty() {
            return;
        }
        assert!(gate.len() >= len && up.len() >= len, "glu_matmul: {len} elements past the tensors");
        let mut xb = vec![0u16; len];
        let g = launch(plan::elementwise(len));
        // SAFETY: gate, up and xb hold len values (checked above).
        unsafe {
            match glu {
                Glu::Silu => emu::silu_mul_bf16(&g, gate.as_ptr(), up.as_ptr(), xb.as_mut_ptr(), len as u64),
                Glu::GeluTanh => emu::gelu_mul_bf16(&g, gate.as_ptr(), up.as_ptr(), xb.as_mut_ptr(), len as u64),
            }
        }
        self.count(1);
        self.products(&xb, rows, outs);
    }

    #[rustfmt::skip]
    fn rope_kv_write(&self, kv: &mut KvStorage, layer: usize, rope: &RopeTable, q: &mut Vec<f32>, q_heads: usize, k: &mut Vec<f32>, kv_heads: usize, v: &Vec<f32>, positions: &[u32], slots: &[(u32, u32)]) {
        if !self.fuse {
            return fused::rope_kv_write(self, kv, layer, rope, q, q_heads, k, kv_heads, v, positions, slots);
        }
        self.fused_rope_kv_write(kv, layer, rope, None, q, q_heads, k, kv_heads, v, positions, slots);
    }

    #[rustfmt::skip]
    fn qk_norm_rope_kv_write(&self, kv: &mut KvStorage, layer: usize, rope: &RopeTable, norm: QkNorm<'_, Vec<f32>>, q: &mut Vec<f32>, q_heads: usize, k: &mut Vec<f32>, kv_heads: usize, v: &Vec<f32>, t: &mut Vec<f32>, positions: &[u32], slots: &[(u32, u32)]) {
        if !self.fuse {
            return fused::qk_norm_rope_kv_write(self, kv, layer, rope, norm, q, q_heads, k, kv_heads, v, t, positions, slots);
        }
        self.fused_rope_kv_write(kv, layer, rope, Some(norm), q, q_heads, k, kv_heads, v, positions, slots);
    }

    #[rustfmt::skip]
    fn attention_matmul(&self, kv: &KvStorage, layer: usize, q: &Vec<f32>, rows: &[AttnRow], n_heads: usize, scale: f32, window: Option<usize>, attn: &mut Vec<f32>, outs: &mut [(&EmuMatrix, &mut Vec<f32>)]) {
        if !self.fuse {
            return fused::attention_matmul(self, kv, layer, q, rows, n_heads, scale, window, attn, outs);
        }
        self.attention(kv, layer, q, rows, n_heads, scale, window, attn);
        if outs.is_empty() || rows.is_empty() {
            return;
        }
        // The CPU's attention stands in for the partial kernel and the combine; on the
        // GPU the combine writes bf16 itself (attn_combine_bf16), the bits to_bf16
        // gives its f32 output (tests/emulated/fused.rs): converted here, no launch counted.
        let len = rows.len() * n_heads * kv.layout.head_dim;
        let mut xb = vec![0u16; len];
        // SAFETY: attention wrote len values into attn, xb holds as many.
        unsafe { emu::to_bf16(&launch(plan::elementwise(len)), attn.as_ptr(), xb.as_mut_ptr(), len as u64) };
        self.products(&xb, rows.len(), outs);
    }
}

impl EmuBackend {
    /// `rope_kv_write_*` (or with `norm` `qk_norm_rope_kv_write_*`) of the rows of
    /// `q`, `k` and `v`, the CUDA backend's one launch.
    #[allow(clippy::too_many_arguments)]
    #[rustfmt::skip]
    fn fused_rope_kv_write(&self, kv: &mut KvStorage, layer: usize, rope: &RopeTable, norm: Option<QkNorm<'_, Vec<f32>>>, q: &mut Vec<f32>, q_heads: usize, k: &mut Vec<f32>, kv_heads: usize, v: &[f32], positions: &[u32], slots: &[(u32, u32)]) {
        if slots.is_empty() {
            return;
        }
        let l = kv.layout;
        assert_eq!(positions.len(), slots.len(), "rope_kv_write: one position per slot");
        assert_eq!(kv_heads, l.kv_heads, "rope_kv_write: keys of {kv_heads} heads for an arena of {}", l.kv_heads);
        assert_eq!(rope.head_dim, l.head_dim, "rope_kv_write: a rotary table of head size {} for heads of {}", rope.head_dim, l.head_dim);
        if let Some(&p) = positions.iter().find(|&&p| p as usize >= rope.max_pos) {
            panic!("position {p} beyond the rope table ({})", rope.max_pos);
        }
        let (rows, te) = (slots.len(), l.token_elems());
        assert!(q.len() >= rows * q_heads * l.head_dim && k.len() >= rows * te && v.len() >= rows * te, "rope_kv_write: rows past the tensors");
        if let Some(n) = &norm {
            assert!(n.head_dim == l.head_dim && n.q.len() >= l.head_dim && n.k.len() >= l.head_dim, "qk_norm_rope_kv_write: norms of {} for heads of {}", n.head_dim, l.head_dim);
        }
        // A replayable step's positions and slots are the staged ones, as rope's and kv_write's.
        let staged = self.staged(|s| (s.words(&s.layout.positions).to_vec(), s.slots()));
        let (positions, slots) = match &staged {
            Some((p, s)) => (&p[..], &s[..]),
            None => (positions, slots),
        };
        let (cos, sin) = rope.tables();
        self.write_kv(kv, layer, slots, |arena, flat, one| {
            let g = launch(plan::per_row(rows, TOKEN_THREADS));
            let (qp, kp, vp, c, s, p, f) = (q.as_mut_ptr(), k.as_mut_ptr(), v.as_ptr(), cos.as_ptr(), sin.as_ptr(), positions.as_ptr(), flat.as_ptr());
            let (qh, half, bt, te) = (q_heads as i32, (l.head_dim / 2) as i32, one.block_tokens as i32, te as i32);
            // SAFETY: the scratch arena holds one block per row; q, k and v a row each, the
            // tables max_pos rows, the norms a head's width (checked above).
            unsafe {
                match (one.dtype, norm) {
                    (KvDtype::F32, None) => emu::rope_kv_write_f32(&g, arena, qp, kp, vp, c, s, p, f, qh, half, 0, 1, bt, te),
                    (KvDtype::F16, None) => emu::rope_kv_write_f16(&g, arena, qp, kp, vp, c, s, p, f, qh, half, 0, 1, bt, te),
                    (KvDtype::BF16, None) => emu::rope_kv_write_bf16(&g, arena, qp, kp, vp, c, s, p, f, qh, half, 0, 1, bt, te),
                    (KvDtype::F8E4M3, None) => emu::rope_kv_write_e4m3(&g, arena, qp, kp, vp, c, s, p, f, qh, half, 0, 1, bt, te),
                    (dtype, Some(n)) => {
                        let kernel = match dtype {
                            KvDtype::F32 => emu::qk_norm_rope_kv_write_f32,
                            KvDtype::F16 => emu::qk_norm_rope_kv_write_f16,
                            KvDtype::BF16 => emu::qk_norm_rope_kv_write_bf16,
                            KvDtype::F8E4M3 => emu::qk_norm_rope_kv_write_e4m3,
                        };
                        kernel(&g, arena, qp, kp, vp, n.q.as_ptr(), n.k.as_ptr(), n.eps, c, s, p, f, qh, half, 0, 1, bt, te)
                    }
                }
            }
        });
    }
}
