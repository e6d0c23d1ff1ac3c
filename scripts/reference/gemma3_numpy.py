"""An independent Gemma 3 forward pass in numpy (float32, weights
dequantized by the `gguf` package), written from llama.cpp's
src/models/gemma3.cpp and the Hugging Face reference: it checks Baton's
forward pass on a model no one here converted.

usage: gemma3_numpy.py MODEL.gguf TOKENS_JSON OUT_JSON
TOKENS_JSON holds {"tokens": [...], "positions": [...]}: for each listed
position, OUT_JSON gets the top 5 (token, logit) pairs.

Needs numpy and gguf (pip install numpy gguf into a venv of your own).
"""
import json
import sys

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


def main(model, tokens_path, out_path):
    r = GGUFReader(model)
    meta = {k: f.contents() for k, f in r.fields.items() if not k.startswith("tokenizer.")}
    a = meta["general.architecture"]
    assert a == "gemma3", a
    t = {x.name: x for x in r.tensors}

    def w(name):
        x = t[name]
        v = dequantize(x.data, x.tensor_type).astype(np.float32)
        return v.reshape([int(d) for d in reversed(x.shape.tolist())])

    n_layers = meta[f"{a}.block_count"]
    hidden = meta[f"{a}.embedding_length"]
    n_heads = meta[f"{a}.attention.head_count"]
    n_kv = meta[f"{a}.attention.head_count_kv"]
    hd = meta[f"{a}.attention.key_length"]
    eps = meta[f"{a}.attention.layer_norm_rms_epsilon"]
    window = meta[f"{a}.attention.sliding_window"]
    base_global = meta[f"{a}.rope.freq_base"]
    base_local = 10000.0
    period = 6

    spec = json.load(open(tokens_path))
    tokens = spec["tokens"]
    n = len(tokens)

    def rms(x, g):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * g

    def rope(x, base):
        # neox: pairs (i, i + hd/2), angle p * base^(-2i/hd)
        half = hd // 2
        inv = base ** (-np.arange(half, dtype=np.float64) * 2 / hd)
        ang = np.arange(n)[:, None] * inv[None, :]
        c, s = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
        x1, x2 = x[..., :half], x[..., half:]
        c, s = c[:, None, :], s[:, None, :]
        return np.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1)

    def gelu(x):
        return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))

    emb = w("token_embd.weight")
    x = emb[tokens] * np.float32(np.sqrt(hidden))
    pos = np.arange(n)
    causal = pos[None, :] <= pos[:, None]
    local_mask = causal & (pos[:, None] - pos[None, :] < window)
    for i in range(n_layers):
        p = f"blk.{i}."
        is_local = i % period < period - 1
        h = rms(x, w(p + "attn_norm.weight"))
        q = (h @ w(p + "attn_q.weight").T).reshape(n, n_heads, hd)
        k = (h @ w(p + "attn_k.weight").T).reshape(n, n_kv, hd)
        v = (h @ w(p + "attn_v.weight").T).reshape(n, n_kv, hd)
        q = rms(q, w(p + "attn_q_norm.weight"))
        k = rms(k, w(p + "attn_k_norm.weight"))
        base = base_local if is_local else base_global
        q, k = rope(q, base), rope(k, base)
        mask = local_mask if is_local else causal
        group = n_heads // n_kv
        out = np.zeros((n, n_heads, hd), np.float32)
        for hh in range(n_heads):
            kh = hh // group
            s = (q[:, hh, :] @ k[:, kh, :].T) / np.sqrt(hd)
            s = np.where(mask, s, -np.inf)
            s = np.exp(s - s.max(axis=1, keepdims=True))
            s /= s.sum(axis=1, keepdims=True)
            out[:, hh, :] = s @ v[:, kh, :]
        o = out.reshape(n, n_heads * hd) @ w(p + "attn_output.weight").T
        x = x + rms(o, w(p + "post_attention_norm.weight"))
        h = rms(x, w(p + "ffn_norm.weight"))
        f = gelu(h @ w(p + "ffn_gate.weight").T) * (h @ w(p + "ffn_up.weight").T)
        x = x + rms(f @ w(p + "ffn_down.weight").T, w(p + "post_ffw_norm.weight"))
    x = rms(x, w("output_norm.weight"))
    out = {}
    for p in spec["positions"]:
        logits = emb @ x[p]
        top = np.argsort(-logits)[:5]
        out[str(p)] = [[int(j), float(logits[j])] for j in top]
    json.dump({"model": model.split("/")[-1], "tokens": tokens, "top5": out}, open(out_path, "w"), indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:4])
