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
//!
//! A decode-shaped step (every row its own sequence) on a backend that replays
//! captured steps (CUDA graphs) is padded to the backend's batch bucket and run
//! through [`Backend::decode_step`]; the padding rows' logits are never returned.

pub mod arch;
mod config;
mod format;
mod load;

pub use arch::{Activation, Family, LayerSpec, RopeSpec, FAMILIES};
pub use config::{ConfigError, HfConfig, ModelConfig};
pub use format::weight_format;
pub use load::{config_from_gguf, export_hf, load_gguf, load_gguf_weights, load_hf_dir, LoadedModel, ModelError};

use baton_kernels::step::{pad_tables, PaddedStep};
use baton_kernels::{Backend, Glu, GreedyRow, PendingPicks, QkNorm};
pub use baton_kernels::StepInput;

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
        self.step(backend, kv, input, s);
        self.logits(backend, s, input.logit_rows.len())
    }

    /// Runs one step, its logits (of `input.logit_rows`) left on the backend in `s`
    /// for [`Model::logits`] or [`Model::greedy`]. Must run inside `backend.run`.
    pub fn step(&self, backend: &B, kv: &mut B::Kv, input: &StepInput, s: &mut Scratch<B>) {
        match backend.decode_step_rows(input) {
            Some(rows) => {
                let pads = pad_tables(rows - input.tokens.len());
                let padded = PaddedStep::new(input, rows, &pads);
                let step = padded.input();
                // The program is this scratch: the buffers a captured step writes.
                let program = s as *const Scratch<B> as usize;
                backend.decode_step(kv, &step, program, &mut |kv| self.compute(backend, kv, &step, s, &mut |_, _, _| {}));
            }
            None => self.compute(backend, kv, input, s, &mut |_, _, _| {}),
        }
    }

    /// [`Model::step`] of a decode step whose first `from.len()` rows take as their token
    /// the pick `from[i]` of `picks`, the last step's greedy picks still on the backend
    /// (run-ahead decoding, [`Backend::decode_step_fed`]); `input.tokens` of those rows
    /// are placeholders. False, having queued nothing, when the backend cannot run it so.
    pub fn step_fed(&self, backend: &B, kv: &mut B::Kv, input: &StepInput, s: &mut Scratch<B>, picks: &PendingPicks, from: &[u32]) -> bool {
        let Some(rows) = backend.decode_step_rows(input) else { return false };
        let pads = pad_tables(rows - input.tokens.len());
        let padded = PaddedStep::new(input, rows, &pads);
        let step = padded.input();
        let program = s as *const Scratch<B> as usize;
        backend.decode_step_fed(kv, &step, program, picks, from, &mut |kv| self.compute(backend, kv, &step, s, &mut |_, _, _| {}))
    }

    /// [`Model::step`], calling `on_layer(backend, kv, layer)` right after each
    /// layer's keys and values are in `kv` (and before its attention): a pipelined
    /// export copies the layer out there while later layers compute. Always eager:
    /// a replayed capture (`Backend::decode_step`) would not call `on_layer`.
    pub fn step_with(&self, backend: &B, kv: &mut B::Kv, input: &StepInput, s: &mut Scratch<B>, on_layer: &mut dyn FnMut(&B, &B::Kv, usize)) {
        self.compute(backend, kv, input, s, on_layer);
    }

    /// The `n` rows of logits the last step left in `s`, on the host.
    pub fn logits(&self, backend: &B, s: &Scratch<B>, n: usize) -> Vec<f32> {
        if n == 0 {
            return Vec::new();
        }
        let mut out = vec![0f32; n * self.config.vocab];
        backend.download(&s.logits, &mut out);
        if let Some(cap) = self.config.logit_softcap {
            // On the host: element-wise, so no backend needs a kernel for it.
            baton_kernels::ops::softcap(&mut out, cap);
        }
        out
    }

    /// The greedy token of each of the `n` rows of logits the last step left in `s`,
    /// picked on the backend ([`Backend::greedy_rows`]) without downloading the rows;
    /// `None` when the backend does not, or the model soft-caps its logits (on the
    /// host, after which `+inf` is finite and close logits may tie).
    pub fn greedy(&self, backend: &B, s: &Scratch<B>, n: usize) -> Option<Vec<GreedyRow>> {
        if self.config.logit_softcap.is_some() {
            return None;
        }
        backend.greedy_rows(&s.logits, n, self.config.vocab)
    }

    /// [`Model::greedy`] left on the backend for the next step to take as its tokens
    /// ([`Model::step_fed`]) and read later ([`Backend::greedy_rows_finish`]); `None`
    /// when the backend does not run ahead or the model soft-caps its logits.
    pub fn greedy_start(&self, backend: &B, s: &Scratch<B>, n: usize) -> Option<PendingPicks> {
        if self.config.logit_softcap.is_some() {
            return None;
        }
        backend.greedy_rows_start(&s.logits, n, self.config.vocab)
    }

    /// Queues one step on the backend, its logits (for `input.logit_rows`) left in `s.logits`.
    fn compute(&self, backend: &B, kv: &mut B::Kv, input: &StepInput, s: &mut Scratch<B>, on_layer: &mut dyn FnMut(&B, &B::Kv, usize)) {
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
        // The output of the last block (attention or feed-forward) waits in `o` to be
        // added to `x` by the next norm's fused operation, `Some(post norm)` when
        // it is normed first (Gemma); `None` before the first block.
        let mut pending: Option<Option<&B::Tensor>> = None;
        for (li, layer) in self.layers.iter().enumerate() {
            let qkv = &mut [(&layer.wq, &mut s.q), (&layer.wk, &mut s.k), (&layer.wv, &mut s.v)];
            match pending {
                Some(post) => backend.add_norm_matmul(&mut s.x, &s.o, post, &layer.attn_norm, c.rms_eps, rows, hid, &mut s.h, qkv),
                None => backend.norm_matmul(&s.x, &layer.attn_norm, c.rms_eps, rows, hid, &mut s.h, qkv),
            }
            if let Some([bq, bk, bv]) = &layer.qkv_bias {
                backend.add_rows(&mut s.q, bq, rows, qw);
                backend.add_rows(&mut s.k, bk, rows, kvw);
                backend.add_rows(&mut s.v, bv, rows, kvw);
            }
            let rope = &self.ropes[self.layer_rope[li]];
            match &layer.qk_norm {
                Some([nq, nk]) => {
                    let norm = QkNorm { q: nq, k: nk, eps: c.rms_eps, head_dim: hd };
                    #[rustfmt::skip]
                    backend.qk_norm_rope_kv_write(kv, li, rope, norm, &mut s.q, c.n_heads, &mut s.k, c.n_kv_heads, &s.v, &mut s.t, input.positions, input.slots);
                }
                None => backend.rope_kv_write(kv, li, rope, &mut s.q, c.n_heads, &mut s.k, c.n_kv_heads, &s.v, input.positions, input.slots),
            }
            on_layer(backend, kv, li);
            #[rustfmt::skip]
            backend.attention_matmul(kv, li, &s.q, input.attn, c.n_heads, c.attn_scale, c.layers[li].window, &mut s.attn, &mut [(&layer.wo, &mut s.o)]);
            let post = layer.post_norms.as_ref().map(|n| &n[0]);
            let gate_up = &mut [(&layer.w_gate, &mut s.gate), (&layer.w_up, &mut s.up)];
            backend.add_norm_matmul(&mut s.x, &s.o, post, &layer.ffn_norm, c.rms_eps, rows, hid, &mut s.h, gate_up);
            let glu = match c.family.activation {
                Activation::SiluGlu => Glu::Silu,
                Activation::GeluTanhGlu => Glu::GeluTanh,
            };
            backend.glu_matmul(glu, &s.gate, &s.up, rows, ffn, &mut s.act, &mut [(&layer.w_down, &mut s.o)]);
            pending = Some(layer.post_norms.as_ref().map(|n| &n[1]));
        }
        match pending {
            Some(Some(w)) => {
                backend.rmsnorm(&s.o, w, c.rms_eps, rows, hid, &mut s.h);
                backend.add(&mut s.x, &s.h, rows * hid);
            }
            Some(None) => backend.add(&mut s.x, &s.o, rows * hid),
            None => {}
        }
        let n = input.logit_rows.len();
        if n == 0 {
            return;
        }
        backend.gather_rows(&s.x, hid, input.logit_rows, &mut s.last);
        backend.rmsnorm(&s.last, &self.out_norm, c.rms_eps, n, hid, &mut s.h);
        let head = self.output.as_ref().unwrap_or(&self.embed);
        backend.matmul(&s.h, n, &mut [(head, &mut s.logits)]);
    }
}
