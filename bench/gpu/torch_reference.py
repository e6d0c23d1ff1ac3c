"""PyTorch on the same GPU and the same shapes as Baton's roofline bench
(kernels/benches/gpu.rs), measured in the same run by bench/gpu/run.sh so the two
stand side by side.

Llama-3-8B with random bf16 weights: decode steps at batch 1, 64 and 256 with
3,000-token contexts (eager, and captured in a CUDA graph and replayed), the
attention of those steps alone (32 layers of scaled_dot_product_attention), a
2,048-token prefill, a bf16 GEMM of 8192^3 and a device copy's bandwidth. The
products are cuBLAS; attention is PyTorch's SDPA (flash kernels) on contiguous KV
(Baton's is paged), so it is the reference a paged kernel must come close to.

Prints a table, and one `torch KEY VALUE` line per number for run.sh to join
with Baton's. Without torch or a GPU it prints SKIPPED and exits 0.
"""
import sys
import time

try:
    import torch
    import torch.nn.functional as F
except ImportError as e:
    print(f"SKIPPED: no PyTorch ({e})")
    sys.exit(0)
if not torch.cuda.is_available():
    print("SKIPPED: PyTorch sees no CUDA device")
    sys.exit(0)

DEV, DT = "cuda", torch.bfloat16
LAYERS, DIM, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 32, 4096, 32, 8, 128, 14336, 128256
CONTEXT, PROMPT = 3000, 2048
BATCHES = (1, 64, 256)


def timed(fn, reps=10):
    """Mean seconds of `reps` runs after 3 warm-ups, the GPU synchronised around them."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps


def report(key, value, unit):
    print(f"torch {key} {value:.4f} {unit}", flush=True)


def weight(rows, cols):
    return torch.randn(rows, cols, device=DEV, dtype=DT) * (cols ** -0.5)


def rmsnorm(x):
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5).to(x.dtype)


def block(x, w, kv, causal):
    """One transformer layer; `kv` is the (keys, values) to attend to, or None for the layer's own."""
    b, t, _ = x.shape
    qkv = rmsnorm(x) @ w["qkv"].T
    q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], -1)
    q = q.view(b, t, HEADS, HEAD_DIM).transpose(1, 2)
    if kv is None:
        kv = (k.view(b, t, KV_HEADS, HEAD_DIM).transpose(1, 2), v.view(b, t, KV_HEADS, HEAD_DIM).transpose(1, 2))
    a = F.scaled_dot_product_attention(q, kv[0], kv[1], is_causal=causal, enable_gqa=True)
    x = x + a.transpose(1, 2).reshape(b, t, HEADS * HEAD_DIM) @ w["o"].T
    gate, up = (rmsnorm(x) @ w["gate_up"].T).chunk(2, -1)
    return x + (F.silu(gate) * up) @ w["down"].T


def main():
    torch.manual_seed(0)
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}")
    n = 1 << 30
    src, dst = torch.empty(n, device=DEV, dtype=torch.float32), torch.empty(n, device=DEV, dtype=torch.float32)
    copy = 2 * n * 4 / timed(lambda: dst.copy_(src), 5) / 1e9
    del src, dst
    a, b = torch.randn(8192, 8192, device=DEV, dtype=DT), torch.randn(8192, 8192, device=DEV, dtype=DT)
    gemm = 2 * 8192 ** 3 / timed(lambda: a @ b) / 1e12
    del a, b
    report("copy_gb_s", copy, "GB/s")
    report("gemm_tflop_s", gemm, "TFLOP/s")

    layers = [
        dict(qkv=weight((HEADS + 2 * KV_HEADS) * HEAD_DIM, DIM), o=weight(DIM, HEADS * HEAD_DIM),
             gate_up=weight(2 * FFN, DIM), down=weight(DIM, FFN))
        for _ in range(LAYERS)
    ]
    head = weight(VOCAB, DIM)
    print("| batch | step ms (eager) | step ms (CUDA graph) | attention ms (32 layers) |")
    print("| ---: | ---: | ---: | ---: |")
    for batch in BATCHES:
        # Every layer its own KV where memory allows (batch 256: 8 sets reused; the
        # bytes each step reads are the same, only which addresses repeat).
        sets = LAYERS if batch <= 64 else 8
        kvs = [(torch.randn(batch, KV_HEADS, CONTEXT, HEAD_DIM, device=DEV, dtype=DT),
                torch.randn(batch, KV_HEADS, CONTEXT, HEAD_DIM, device=DEV, dtype=DT)) for _ in range(sets)]
        x0 = torch.randn(batch, 1, DIM, device=DEV, dtype=DT)

        def step():
            x = x0
            for i, w in enumerate(layers):
                x = block(x, w, kvs[i % sets], False)
            return rmsnorm(x[:, -1]) @ head.T

        eager = timed(step)
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    step()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            replay = timed(graph.replay)
            del graph
        except Exception as e:  # a failed capture leaves the eager number standing
            print(f"CUDA graph capture failed: {e}")
            replay = float("nan")
        q = torch.randn(batch, HEADS, 1, HEAD_DIM, device=DEV, dtype=DT)

        def attention():
            for i in range(LAYERS):
                F.scaled_dot_product_attention(q, *kvs[i % sets], enable_gqa=True)

        attn = timed(attention)
        print(f"| {batch} | {eager * 1e3:.2f} | {replay * 1e3:.2f} | {attn * 1e3:.2f} |", flush=True)
        report(f"decode_eager_ms_b{batch}", eager * 1e3, "ms")
        report(f"decode_graph_ms_b{batch}", replay * 1e3, "ms")
        report(f"attention_ms_b{batch}", attn * 1e3, "ms")
        del kvs
        torch.cuda.empty_cache()

    x0 = torch.randn(1, PROMPT, DIM, device=DEV, dtype=DT)

    def prefill():
        x = x0
        for w in layers:
            x = block(x, w, None, True)
        return rmsnorm(x[:, -1]) @ head.T

    secs = timed(prefill, 5)
    matrix = (HEADS + 2 * KV_HEADS) * HEAD_DIM * DIM + DIM * HEADS * HEAD_DIM + 3 * FFN * DIM
    flops = 2 * PROMPT * LAYERS * matrix + 2 * VOCAB * DIM + LAYERS * 4 * HEADS * HEAD_DIM * PROMPT * (PROMPT + 1) / 2
    print(f"prefill {PROMPT} tokens: {secs * 1e3:.1f} ms = {PROMPT / secs:.0f} tok/s, {flops / secs / 1e12:.0f} TFLOP/s")
    report("prefill_tok_s", PROMPT / secs, "tok/s")
    report("prefill_tflop_s", flops / secs / 1e12, "TFLOP/s")


if __name__ == "__main__":
    main()
