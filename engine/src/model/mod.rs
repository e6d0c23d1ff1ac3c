//! A decoder of any family in [`arch::FAMILIES`] on a [`Backend`]: its
//! weights and its batched forward pass over the paged KV arena. The
//! family's optional steps (QK-norm, biases, post norms, GeGLU, embedding
//! scale, windows) are skipped when absent, so a Llama model runs exactly
//! the operations it always did.
//!
//! One forward call runs a *step*: any mix of decode rows (one token of a
//! running sequence) and prefill rows (a chunk of a prompt), each row with its
//! own position, KV slot and block table. Logits are computed only for the
//! rows that need sampling, which is what makes long prefills cheap.

pub mod arch;
mod config;
mod format;
mod load;

pub use arch::{Activation, Family, LayerSpec, RopeSpec, FAMILIES};
pub use config::{ConfigError, HfConfig, ModelConfig};
pub use format::weight_format;
pub use load::{config_from_gguf, export_hf, load_gguf, load_gguf_weights, load_hf_dir, LoadedModel, ModelError};

use baton_kernels::{AttnRow, Backend};

/// Weights of one transformer layer. The `Option`s are present exactly when
/// the family has that part.
pub struct Layer<B: Backend> {
    pub attn_norm: B::Tensor,
    pub wq: B::Matrix,
    pub wk: B::Matrix,
    pub wv: B::Matrix,
    /// Query, key and value biases (Qwen2).
    pub qkv_bias: Option<[B::Tensor; 3]>,
    /// Per-head query and key norms (Qwen3, Gemma 3).
    pub qk_norm: Option<[B::Tensor; 2]>,
    pub wo: B::Matrix,
    /// Norms of the attention and feed-forward outputs (Gemma).
    pub post_norms: Option<[B::Tensor; 2]>,
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
    /// Distinct rotary tables; layer `i` uses `ropes[layer_rope[i]]`.
    pub ropes: Vec<B::Rope>,
    pub layer_rope: Vec<usize>,
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
    /// Second buffer for QK-norm's output.
    t: B::Tensor,
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
            t: backend.tensor(0),
        }
    }
}

impl<B: Backend> Model<B> {
    /// Runs one step and returns the logits of `input.logit_rows`
    /// (`logit_rows.len() x vocab`, row-major). Must run inside
    /// `backend.run`.
    pub fn forward(&self, backend: &B, kv: &mut B::Kv, input: &StepInput, s: &mut Scratch<B>) -> Vec<f32> {
        self.forward_with(backend, kv, input, s, &mut |_, _, _| {})
    }

    /// [`Model::forward`], calling `on_layer(backend, kv, layer)` right after each
    /// layer's keys and values are in `kv` (and before its attention): a pipelined
    /// export copies the layer out there while later layers compute.
    pub fn forward_with(&self, backend: &B, kv: &mut B::Kv, input: &StepInput, s: &mut Scratch<B>, on_layer: &mut dyn FnMut(&B, &B::Kv, usize)) -> Vec<f32> {
        let c = &self.config;
        let rows = input.tokens.len();
        debug_assert_eq!(rows, input.positions.len());
        debug_assert_eq!(rows, input.slots.len());
        debug_assert_eq!(rows, input.attn.len());
        let (hid, ffn, hd) = (c.hidden, c.ffn, c.head_dim);
        let (qw, kvw) = (c.n_heads * hd, c.n_kv_heads * hd);
        backend.embed(&self.embed, input.tokens, &mut s.x);
        if c.family.embed_scale {
            backend.scale(&mut s.x, (hid as f32).sqrt(), rows * hid);
        }
        for (li, layer) in self.layers.iter().enumerate() {
            backend.rmsnorm(&s.x, &layer.attn_norm, c.rms_eps, rows, hid, &mut s.h);
            backend.matmul(&s.h, rows, &mut [(&layer.wq, &mut s.q), (&layer.wk, &mut s.k), (&layer.wv, &mut s.v)]);
            if let Some([bq, bk, bv]) = &layer.qkv_bias {
                backend.add_rows(&mut s.q, bq, rows, qw);
                backend.add_rows(&mut s.k, bk, rows, kvw);
                backend.add_rows(&mut s.v, bv, rows, kvw);
            }
            if let Some([nq, nk]) = &layer.qk_norm {
                backend.rmsnorm(&s.q, nq, c.rms_eps, rows * c.n_heads, hd, &mut s.t);
                std::mem::swap(&mut s.q, &mut s.t);
                backend.rmsnorm(&s.k, nk, c.rms_eps, rows * c.n_kv_heads, hd, &mut s.t);
                std::mem::swap(&mut s.k, &mut s.t);
            }
            let rope = &self.ropes[self.layer_rope[li]];
            backend.apply_rope(rope, &mut s.q, input.positions, c.n_heads);
            backend.apply_rope(rope, &mut s.k, input.positions, c.n_kv_heads);
            backend.kv_write(kv, li, &s.k, &s.v, input.slots);
            on_layer(backend, kv, li);
            backend.attention(kv, li, &s.q, input.attn, c.n_heads, c.attn_scale, c.layers[li].window, &mut s.attn);
            backend.matmul(&s.attn, rows, &mut [(&layer.wo, &mut s.o)]);
            self.residual(backend, layer.post_norms.as_ref().map(|n| &n[0]), rows, s);
            backend.rmsnorm(&s.x, &layer.ffn_norm, c.rms_eps, rows, hid, &mut s.h);
            backend.matmul(&s.h, rows, &mut [(&layer.w_gate, &mut s.gate), (&layer.w_up, &mut s.up)]);
            match c.family.activation {
                Activation::SiluGlu => backend.silu_mul(&s.gate, &s.up, rows * ffn, &mut s.act),
                Activation::GeluTanhGlu => backend.gelu_mul(&s.gate, &s.up, rows * ffn, &mut s.act),
            }
            backend.matmul(&s.act, rows, &mut [(&layer.w_down, &mut s.o)]);
            self.residual(backend, layer.post_norms.as_ref().map(|n| &n[1]), rows, s);
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
        if let Some(cap) = c.logit_softcap {
            // On the host: element-wise, so no backend needs a kernel for it.
            baton_kernels::ops::softcap(&mut out, cap);
        }
        out
    }

    /// `x += o`, or `x += rmsnorm(o)` with a post norm.
    fn residual(&self, backend: &B, post_norm: Option<&B::Tensor>, rows: usize, s: &mut Scratch<B>) {
        let hid = self.config.hidden;
        match post_norm {
            Some(w) => {
                backend.rmsnorm(&s.o, w, self.config.rms_eps, rows, hid, &mut s.h);
                backend.add(&mut s.x, &s.h, rows * hid);
            }
            None => backend.add(&mut s.x, &s.o, rows * hid),
        }
    }
}
