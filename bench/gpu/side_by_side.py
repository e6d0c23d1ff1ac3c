"""Baton's roofline bench beside PyTorch's reference, measured in the same run,
and the targets of issue #37 checked against them.

    python3 bench/gpu/side_by_side.py BENCH_LOG TORCH_LOG

BENCH_LOG is the output of kernels/benches/gpu.rs, TORCH_LOG that of
bench/gpu/torch_reference.py (may say SKIPPED: the PyTorch columns are then
empty). Prints markdown; exits 0 (the numbers are the result, not a gate).
"""
import math
import re
import sys

SHAPE = "llama-3-8b"
BATCHES = (1, 64, 256)


def cells(line):
    return [c.strip() for c in line.strip().strip("|").split("|")]


def parse_baton(text):
    b = {}
    m = re.search(r"measured copy bandwidth (\d+) GB/s; bf16 GEMM 8192\^3: one cuBLAS call (\d+) TFLOP/s", text)
    if m:
        b["copy_gb_s"], b["gemm_tflop_s"] = float(m.group(1)), float(m.group(2))
    for line in text.splitlines():
        if not line.startswith(f"| {SHAPE} |"):
            continue
        c = cells(line)
        if len(c) == 8 and c[1].isdigit():  # decode: shape, batch, step, roofline, ratio, bytes, products, attention
            batch = int(c[1])
            b[f"step_ms_b{batch}"] = float(c[2])
            b[f"roofline_ms_b{batch}"] = float(c[3])
            att = re.match(r"([\d.]+) \((\d+)\)", c[7])
            if att:
                b[f"attention_ms_b{batch}"] = float(att.group(1))
                b[f"attention_gb_s_b{batch}"] = float(att.group(2))
        elif len(c) == 7 and c[1].isdigit() and c[5] in ("yes", "NO"):  # eager vs graph: shape, batch, eager, graph, speedup, same bits, counts
            batch = int(c[1])
            b[f"eager_ms_b{batch}"] = float(c[2])
            b[f"graph_ms_b{batch}"] = float(c[3])
            b[f"graph_same_b{batch}"] = c[5] == "yes"
        elif len(c) == 5 and c[1].isdigit():  # prefill: shape, tokens, tok/s, TFLOP/s, % of GEMM
            b["prefill_tok_s"] = float(c[2])
            b["prefill_tflop_s"] = float(c[3])
    return b


def parse_torch(text):
    t = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[0] == "torch":
            try:
                t[parts[1]] = float(parts[2])
            except ValueError:
                pass
    return t


def fmt(v, digits=2):
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:,.{digits}f}"


def times(ratio):
    return "-" if ratio is None else f"{ratio:.2f}x"


def main():
    bench, torch_log = (open(p, errors="replace").read() for p in sys.argv[1:3])
    b, t = parse_baton(bench), parse_torch(torch_log)
    if not b:
        print("no Baton numbers in the bench log (did the roofline bench run?)")
        return
    print(f"Side by side ({SHAPE}, 3,000-token contexts; PyTorch: cuBLAS + SDPA on contiguous KV)")
    print()
    print("| | Baton | PyTorch eager | PyTorch + CUDA graph | roofline | Baton / PyTorch graph |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for batch in BATCHES:
        step, graph = b.get(f"step_ms_b{batch}"), t.get(f"decode_graph_ms_b{batch}")
        ratio = step / graph if step and graph and not math.isnan(graph) else None
        print(f"| decode step, batch {batch} (ms) | {fmt(step)} | {fmt(t.get(f'decode_eager_ms_b{batch}'))} | {fmt(graph)} "
              f"| {fmt(b.get(f'roofline_ms_b{batch}'))} | {times(ratio)} |")
    for batch in BATCHES:
        mine, graph = b.get(f"graph_ms_b{batch}"), t.get(f"decode_graph_ms_b{batch}")
        if mine is None:
            continue
        ratio = mine / graph if graph and not math.isnan(graph) else None
        same = "same bits as eager" if b.get(f"graph_same_b{batch}") else "NOT the eager bits"
        print(f"| decode step as a CUDA graph, batch {batch} (ms; {same}; eager {fmt(b.get(f'eager_ms_b{batch}'))}) | {fmt(mine)} | | {fmt(graph)} "
              f"| {fmt(b.get(f'roofline_ms_b{batch}'))} | {times(ratio)} |")
    for batch in BATCHES:
        att, ref = b.get(f"attention_ms_b{batch}"), t.get(f"attention_ms_b{batch}")
        ratio = att / ref if att and ref else None
        print(f"| attention alone, 32 layers, batch {batch} (ms) | {fmt(att)} | {fmt(ref)} | | | {times(ratio)} |")
    print(f"| prefill, 2,048 tokens (tok/s) | {fmt(b.get('prefill_tok_s'), 0)} | {fmt(t.get('prefill_tok_s'), 0)} | | | |")
    print(f"| copy bandwidth (GB/s) | {fmt(b.get('copy_gb_s'), 0)} | {fmt(t.get('copy_gb_s'), 0)} | | | |")
    print(f"| bf16 GEMM 8192^3 (TFLOP/s) | {fmt(b.get('gemm_tflop_s'), 0)} | {fmt(t.get('gemm_tflop_s'), 0)} | | | |")
    print()
    print("Targets of #37:")

    def target(what, value, ok):
        print(f"- {'met' if ok else 'NOT met'}: {what} ({value})")

    def step(batch):
        # The faster of the eager step and the CUDA graph's (the backend replays graphs by default).
        return min(b[f"step_ms_b{batch}"], b.get(f"graph_ms_b{batch}", math.inf))

    def roof(batch):
        return step(batch) / b[f"roofline_ms_b{batch}"]

    try:
        target("decode step at batch 64 within 1.3x of the bandwidth roofline", f"{roof(64):.2f}x", roof(64) <= 1.3)
        target("decode step at batch 1 within 2x of the bandwidth roofline", f"{roof(1):.2f}x", roof(1) <= 2.0)
        graph = t.get("decode_graph_ms_b64")
        if graph and not math.isnan(graph):
            r = step(64) / graph
            target("decode step at batch 64 no slower than PyTorch with CUDA graphs", f"{r:.2f}x its time", r <= 1.0)
        for batch in (64, 256):
            share = b[f"attention_gb_s_b{batch}"] / b["copy_gb_s"]
            target(f"decode attention at batch {batch} reads KV at >= 70% of the copy bandwidth", f"{share:.0%}", share >= 0.7)
        share = b["prefill_tflop_s"] / b["gemm_tflop_s"]
        target("prefill of 2,048 tokens at >= 40% of the measured bf16 GEMM throughput", f"{share:.0%}", share >= 0.4)
    except KeyError as e:
        print(f"- not judged: the bench log lacks {e}")


if __name__ == "__main__":
    main()
