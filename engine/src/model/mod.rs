//! A Llama-family decoder on a [`Backend`]: its weights and its batched
//! forward pass over the paged KV arena.
//!
//! One forward call runs a *step*: any mix of decode rows (one token of a
//! running sequence) and prefill rows (a chunk of a prompt), each row with its
//! own position, KV slot and block table. Logits are computed only for the
//! rows that need sampling, which is what makes long prefills cheap.

mod config;
mod format;
mod load;

pub use config::{HfConfig, ModelConfig};
pub use format::weight_format;
pub use load::{export_hf, load_gguf, load_hf_dir, LoadedModel, ModelError};

use baton_kernels::{AttnRow, Backend};

/// Weights of one transformer layer.
pub struct Layer<B: Backend> {
    pub attn_norm: B::Tensor,
    pub wq: B::Matrix,
    pub wk: B::Matrix,
    pub wv: B::Matrix,
    pub wo: B::Matrix,
    pub ffn_norm: B::Tensor,
    pub w_gate: B::Matrix,
    pub w_up: B::Matrix,
    pub w_down: B::Matrix,
}

/// A loaded model: configuration and weights on a backend.
pub struct Model<B: Backend> {
    pub config: ModelConfig,
    pub embed: B::Matrix,
    /// The output head; `None` when it is tied to the embedding.
    pub output: Option<B::Matrix>,
    pub out_norm: B::Tensor,
    pub layers: Vec<Layer<B>>,
    pub rope: B::Rope,
    /// Bytes of all weights as prepared on the backend.
    pub weight_bytes: usize,
}

/// What one forward step computes.
pub struct StepInput<'a> {
    /// Token of each row.
    pub tokens: &'a [u32],
    /// Position of each row in its sequence.
    pub positions: &'a [u32],
    /// `(block, slot)` that receives each row's keys and values.
    pub slots: &'a [(u32, u32)],
    /// Block table and position of each row, for attention.
    pub attn: &'a [AttnRow<'a>],
    /// Rows whose logits are wanted, in the order they are returned.
    pub logit_rows: &'a [usize],
}

/// Reusable activation buffers of a forward pass.
pub struct Scratch<B: Backend> {
    x: B::Tensor,
    h: B::Tensor,
    q: B::Tensor,
    k: B::Tensor,
    v: B::Tensor,
    attn: B::Tensor,
    o: B::Tensor,
    gate: B::Tensor,
    up: B::Tensor,
    act: B::Tensor,
    last: B::Tensor,
    logits: B::Tensor,
}

impl<B: Backend> Scratch<B> {
    pub fn new(backend: &B) -> Self {
        Scratch {
            x: backend.tensor(0),
            h: backend.tensor(0),
            q: backend.tensor(0),
            k: backend.tensor(0),
            v: backend.tensor(0),
            attn: backend.tensor(0),
            o: backend.tensor(0),
            gate: backend.tensor(0),
            up: backend.tensor(0),
            act: backend.tensor(0),
            last: backend.tensor(0),
            logits: backend.tensor(0),
        }
    }
}

impl<B: Backend> Model<B> {
    /// Runs one step and returns the logits of `input.logit_rows`
    /// (`logit_rows.len() x vocab`, row-major). Must run inside
    /// `backend.run`.
    pub fn forward(&self, backend: &B, kv: &mut B::Kv, input: &StepInput, s: &mut Scratch<B>) -> Vec<f32> {
        let c = &self.config;
        let rows = input.tokens.len();
        debug_assert_eq!(rows, input.positions.len());
        debug_assert_eq!(rows, input.slots.len());
        debug_assert_eq!(rows, input.attn.len());
        let (hid, ffn) = (c.hidden, c.ffn);
        let scale = 1.0 / (c.head_dim as f32).sqrt();
        backend.embed(&self.embed, input.tokens, &mut s.x);
        for (li, layer) in self.layers.iter().enumerate() {
            backend.rmsnorm(&s.x, &layer.attn_norm, c.rms_eps, rows, hid, &mut s.h);
            backend.matmul(&s.h, rows, &mut [(&layer.wq, &mut s.q), (&layer.wk, &mut s.k), (&layer.wv, &mut s.v)]);
            backend.apply_rope(&self.rope, &mut s.q, input.positions, c.n_heads);
            backend.apply_rope(&self.rope, &mut s.k, input.positions, c.n_kv_heads);
            backend.kv_write(kv, li, &s.k, &s.v, input.slots);
            backend.attention(kv, li, &s.q, input.attn, c.n_heads, scale, &mut s.attn);
            backend.matmul(&s.attn, rows, &mut [(&layer.wo, &mut s.o)]);
            backend.add(&mut s.x, &s.o, rows * hid);
            backend.rmsnorm(&s.x, &layer.ffn_norm, c.rms_eps, rows, hid, &mut s.h);
            backend.matmul(&s.h, rows, &mut [(&layer.w_gate, &mut s.gate), (&layer.w_up, &mut s.up)]);
            backend.silu_mul(&s.gate, &s.up, rows * ffn, &mut s.act);
            backend.matmul(&s.act, rows, &mut [(&layer.w_down, &mut s.o)]);
            backend.add(&mut s.x, &s.o, rows * hid);
        }
        let n = input.logit_rows.len();
        if n == 0 {
            return Vec::new();
        }
        backend.gather_rows(&s.x, hid, input.logit_rows, &mut s.last);
        backend.rmsnorm(&s.last, &self.out_norm, c.rms_eps, n, hid, &mut s.h);
        let head = self.output.as_ref().unwrap_or(&self.embed);
        backend.matmul(&s.h, n, &mut [(head, &mut s.logits)]);
        let mut out = vec![0f32; n * c.vocab];
        backend.download(&s.logits, &mut out);
        out
    }
}
