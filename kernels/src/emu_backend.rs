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
//! For tests only: every kernel runs on the calling thread, one fiber per
//! GPU thread.
//!
//! Made with [`EmuBackend::with_decode_steps`], it also runs decode steps the
//! way the CUDA backend captures and replays them (`emu_steps`).

use std::sync::{Mutex, OnceLock};

use crate::attention::AttnRow;
use crate::backend::{Backend, CpuBackend, KernelError, OptionalOp};
use crate::cuda::plan::{self, ROW_THREADS, TOKEN_THREADS};
use crate::emu::{self, Launch};
use crate::emu_steps::{self, EmuStepStats, EmuSteps};
use crate::kv::{KvGroups, KvLayout, KvStorage};
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
}

impl EmuBackend {
    /// `threads`: the CPU backend's, for the products and attention.
    pub fn new(threads: usize) -> Result<Self, KernelError> {
        Ok(EmuBackend { cpu: CpuBackend::new(threads)?, steps: None, capture: CaptureGuard::default() })
    }

    /// The backend with the CUDA backend's replayable decode steps (`emu_steps`):
    /// decode-shaped steps padded to buckets, their inputs read from staged words.
    pub fn with_decode_steps(threads: usize) -> Result<Self, KernelError> {
        Ok(EmuBackend { steps: Some(Mutex::default()), ..EmuBackend::new(threads)? })
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
        Ok(EmuMatrix::new(self.cpu.matrix(format, n, k, bytes)?))
    }

    fn matrix_from_f32(&self, n: usize, k: usize, w: Vec<f32>) -> Result<EmuMatrix, KernelError> {
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
    }

    fn rmsnorm(&self, x: &Vec<f32>, weight: &Vec<f32>, eps: f32, rows: usize, dim: usize, out: &mut Vec<f32>) {
        if rows == 0 {
            return;
        }
        assert!(x.len() >= rows * dim && weight.len() >= dim, "rmsnorm: {rows} rows of {dim} past the tensors");
        self.ensure_len(out, rows * dim);
        // SAFETY: x and out hold rows x dim values, the weight dim (checked above).
        unsafe { emu::rmsnorm(&launch(plan::per_row(rows, ROW_THREADS)), x.as_ptr(), weight.as_ptr(), eps, dim as i32, out.as_mut_ptr()) };
    }

    fn matmul(&self, x: &Vec<f32>, rows: usize, outs: &mut [(&EmuMatrix, &mut Vec<f32>)]) {
        for (m, out) in outs.iter_mut() {
            self.ensure_len(out, rows * m.q.n);
        }
        let mut cpu: Vec<(&QMatrix, &mut Vec<f32>)> = outs.iter_mut().map(|(m, o)| (&m.q, &mut **o)).collect();
        self.cpu.matmul(x, rows, &mut cpu);
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
    }

    fn silu_mul(&self, gate: &Vec<f32>, up: &Vec<f32>, len: usize, out: &mut Vec<f32>) {
        if len == 0 {
            return;
        }
        assert!(gate.len() >= len && up.len() >= len, "silu_mul: {len} elements past the tensors");
        self.ensure_len(out, len);
        // SAFETY: every buffer holds len values (checked above).
        unsafe { emu::silu_mul(&launch(plan::elementwise(len)), gate.as_ptr(), up.as_ptr(), out.as_mut_ptr(), len as u64) };
    }

    fn gelu_mul(&self, gate: &Vec<f32>, up: &Vec<f32>, len: usize, out: &mut Vec<f32>) {
        if len == 0 {
            return;
        }
        assert!(gate.len() >= len && up.len() >= len, "gelu_mul: {len} elements past the tensors");
        self.ensure_len(out, len);
        // SAFETY: every buffer holds len values (checked above).
        unsafe { emu::gelu_mul(&launch(plan::elementwise(len)), gate.as_ptr(), up.as_ptr(), out.as_mut_ptr(), len as u64) };
    }

    fn add_rows(&self, x: &mut Vec<f32>, bias: &Vec<f32>, rows: usize, width: usize) {
        if rows == 0 || width == 0 {
            return;
        }
        assert!(x.len() >= rows * width && bias.len() >= width, "add_rows: {rows} rows of {width} past the tensors");
        // SAFETY: x holds rows x width values, the bias width (checked above).
        unsafe { emu::add_rows(&launch(plan::elementwise(rows * width)), x.as_mut_ptr(), bias.as_ptr(), (rows * width) as u64, width as i32) };
    }

    fn scale(&self, x: &mut Vec<f32>, s: f32, len: usize) {
        if len == 0 {
            return;
        }
        assert!(x.len() >= len, "scale: {len} elements past the tensor");
        // SAFETY: x holds len values (checked above).
        unsafe { emu::scale_inplace(&launch(plan::elementwise(len)), x.as_mut_ptr(), s, len as u64) };
    }

    fn add(&self, x: &mut Vec<f32>, y: &Vec<f32>, len: usize) {
        if len == 0 {
            return;
        }
        assert!(x.len() >= len && y.len() >= len, "add: {len} elements past the tensors");
        // SAFETY: both hold len values (checked above).
        unsafe { emu::add_inplace(&launch(plan::elementwise(len)), x.as_mut_ptr(), y.as_ptr(), len as u64) };
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
    }

    fn kv_write(&self, kv: &mut KvStorage, layer: usize, k: &Vec<f32>, v: &Vec<f32>, slots: &[(u32, u32)]) {
        let slots = self.staged(|s| s.slots()).unwrap_or_else(|| slots.to_vec());
        self.cpu.kv_write(kv, layer, k, v, &slots);
    }

    fn attention(&self, kv: &KvStorage, layer: usize, q: &Vec<f32>, rows: &[AttnRow], n_heads: usize, scale: f32, window: Option<usize>, out: &mut Vec<f32>) {
        self.ensure_len(out, rows.len() * n_heads * kv.layout.head_dim);
        let staged = self.staged(|s| self.cpu.attention(kv, layer, q, &s.attn_rows(), n_heads, scale, window, out));
        if staged.is_none() {
            self.cpu.attention(kv, layer, q, rows, n_heads, scale, window, out);
        }
    }

    fn decode_step_rows(&self, input: &StepInput) -> Option<usize> {
        self.steps.as_ref().and_then(|_| crate::step::decode_rows(input))
    }

    fn decode_step(&self, kv: &mut KvStorage, input: &StepInput, program: usize, body: &mut dyn FnMut(&mut KvStorage)) {
        match &self.steps {
            Some(steps) => emu_steps::decode_step(steps, &self.capture, kv, input, program, body),
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
}
