//! The CUDA backend against the CPU backend, operation by operation, on one
//! GPU. Without a GPU every test says loudly that it was skipped (and fails
//! when `BATON_REQUIRE_GPU=1`, as bench/gpu/run.sh sets).
//!
//! Tolerances, as relative error (max |gpu - cpu| / max |cpu|):
//! - f32 element-wise operations and attention with every KV dtype: 1e-5 (exp
//!   and sqrt differ by an ulp or two between libm and the GPU, and sums run in
//!   another order; both backends write the same KV bytes, checked first, so
//!   the KV dtype adds no difference);
//! - matrix products: 1e-2 (bf16 weights and activations, f32 accumulation),
//!   against the CPU's f32 weights.
//!   KV bytes written by the GPU must equal the CPU's bit for bit (both round
//!   to nearest even), and a row's result must not depend on its batch.
//! - The fused operations (fused.cu) against the GPU's own unfused sequences:
//!   the same bits.
#![cfg(feature = "cuda")]

use std::io::Write;

use baton_kernels::{AttnRow, Backend, CpuBackend, CudaBackend, GreedyRow, KvBytes, KvDtype, KvLayout, QkNorm, RopeTable};
use support::{random_bytes, rel_err, scattered_tables, sequence_kv, values};

mod support;

fn gpu() -> Option<CudaBackend> {
    match CudaBackend::new(0) {
        Ok(b) => {
            println!("{}", b.describe());
            Some(b)
        }
        Err(e) if std::env::var("BATON_REQUIRE_GPU").as_deref() == Ok("1") => panic!("BATON_REQUIRE_GPU=1 but {e}"),
        Err(e) => {
            // Straight to the terminal: libtest captures eprintln! of passing tests.
            let _ = writeln!(std::io::stderr(), "\n!!!!! SKIPPED: {e}; the CUDA backend is NOT tested !!!!!\n");
            None
        }
    }
}

fn down(g: &CudaBackend, t: &<CudaBackend as Backend>::Tensor, n: usize) -> Vec<f32> {
    let mut out = vec![0f32; n];
    g.download(t, &mut out);
    out
}

#[test]
fn elementwise_operations_match_the_cpu() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new(2).unwrap();
    let (rows, dim) = (7, 576);
    let x = values(rows * dim, 1);
    let w = values(dim, 2);

    let (mut oc, mut og) = (c.tensor(0), g.tensor(1));
    c.rmsnorm(&x, &w, 1e-5, rows, dim, &mut oc);
    g.rmsnorm(&g.upload(&x), &g.upload(&w), 1e-5, rows, dim, &mut og);
    let e = rel_err(&down(&g, &og, rows * dim), &oc[..rows * dim]);
    assert!(e <= 1e-5, "rmsnorm: {e}");

    let y = values(rows * dim, 3);
    let (mut oc, mut og) = (c.tensor(0), g.tensor(1));
    c.silu_mul(&x, &y, rows * dim, &mut oc);
    g.silu_mul(&g.upload(&x), &g.upload(&y), rows * dim, &mut og);
    let e = rel_err(&down(&g, &og, rows * dim), &oc[..rows * dim]);
    assert!(e <= 1e-5, "silu_mul: {e}");

    let mut xc = x.clone();
    let mut xg = g.upload(&x);
    c.add(&mut xc, &y, rows * dim);
    g.add(&mut xg, &g.upload(&y), rows * dim);
    assert_eq!(down(&g, &xg, rows * dim), xc, "add is exact");

    let (mut oc, mut og) = (c.tensor(0), g.tensor(1));
    c.gather_rows(&x, dim, &[5, 0, 5], &mut oc);
    g.gather_rows(&g.upload(&x), dim, &[5, 0, 5], &mut og);
    assert_eq!(down(&g, &og, 3 * dim), oc[..3 * dim].to_vec(), "gather is exact");

    let (heads, hd) = (9, 64);
    let q = values(rows * heads * hd, 4);
    let positions: Vec<u32> = vec![0, 1, 2, 100, 1000, 4095, 17];
    let (rc, rg) = (c.rope(RopeTable::new(hd, 10_000.0, 4096)), g.rope(RopeTable::new(hd, 10_000.0, 4096)));
    let mut qc = q.clone();
    let mut qg = g.upload(&q);
    c.apply_rope(&rc, &mut qc, &positions, heads);
    g.apply_rope(&rg, &mut qg, &positions, heads);
    let e = rel_err(&down(&g, &qg, q.len()), &qc);
    assert!(e <= 1e-5, "rope: {e}");

    // Greedy sampling picks the same token, ties to the lowest index.
    let mut logits = values(3 * 49_152, 5);
    logits[49_152 + 7] = 5.0;
    logits[49_152 + 9] = 5.0;
    let picked = g.argmax_rows(&g.upload(&logits), 3, 49_152);
    let want: Vec<GreedyRow> = logits.chunks(49_152).map(|r| GreedyRow::Token(baton_kernels::ops::argmax(r) as u32)).collect();
    assert_eq!(picked, want);
    assert_eq!(picked[1], GreedyRow::Token(7));
    // The sampler's failures: the first NaN or +inf, and a row of only -inf.
    let n = 1000;
    let mut bad = vec![0.5f32; 3 * n];
    bad[10] = f32::INFINITY;
    bad[700] = f32::NAN;
    bad[n + 999] = f32::NAN;
    bad[2 * n..].fill(f32::NEG_INFINITY);
    let picked = g.argmax_rows(&g.upload(&bad), 3, n);
    assert_eq!(picked, [GreedyRow::NonFinite(10), GreedyRow::NonFinite(999), GreedyRow::AllMasked]);
}

#[test]
fn matrix_products_match_the_cpu_and_do_not_depend_on_the_batch() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new(2).unwrap();
    for &(n, k) in &[(576, 576), (1536, 576), (576, 1536), (49_152, 576)] {
        let w = values(n * k, n as u64 ^ k as u64);
        let (wc, wg) = (c.matrix_from_f32(n, k, w.clone()).unwrap(), g.matrix_from_f32(n, k, w).unwrap());
        let rows = 33;
        let x = values(rows * k, 7);
        let (mut oc, mut og) = (c.tensor(0), g.tensor(1));
        c.matmul(&x, rows, &mut [(&wc, &mut oc)]);
        g.matmul(&g.upload(&x), rows, &mut [(&wg, &mut og)]);
        let batched = down(&g, &og, rows * n);
        let e = rel_err(&batched, &oc[..rows * n]);
        assert!(e <= 1e-2, "matmul {n}x{k}: {e}");
        // Row 5 alone gives the same bits as row 5 in the batch of 33.
        let mut alone = g.tensor(1);
        g.matmul(&g.upload(&x[5 * k..6 * k]), 1, &mut [(&wg, &mut alone)]);
        assert_eq!(down(&g, &alone, n), batched[5 * n..6 * n].to_vec(), "matmul {n}x{k}: row 5 alone differs from row 5 in a batch");
    }
}

/// The quantized GGUF formats load on the GPU (expanded to bf16 at load by
/// the CPU's decoder) and their products match the CPU's integer kernels.
/// The CPU quantizes activations to 8 bits where the GPU rounds weights and
/// activations to bf16: against a bf16 product computed on the CPU the
/// CPU's kernels differ by 0.4-0.5% on these shapes, hence 2e-2.
#[test]
fn quantized_formats_load_and_match_the_cpu() {
    use baton_kernels::quant::{quantize_row_q4_0, quantize_row_q4_1, quantize_row_q8_0};
    use baton_kernels::{blocks, WeightFormat};
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new(2).unwrap();
    let (n, k, rows) = (576, 1536, 33);
    type Quantizer = fn(&[f32], &mut Vec<u8>);
    let formats: [(WeightFormat, Quantizer); 8] = [
        (WeightFormat::Q4_0, quantize_row_q4_0),
        (WeightFormat::Q4_1, quantize_row_q4_1),
        (WeightFormat::Q8_0, quantize_row_q8_0),
        (WeightFormat::Q5_0, blocks::quantize_row_q5_0),
        (WeightFormat::Q5_1, blocks::quantize_row_q5_1),
        (WeightFormat::Q4_K, blocks::quantize_row_q4_k),
        (WeightFormat::Q5_K, blocks::quantize_row_q5_k),
        (WeightFormat::Q6_K, blocks::quantize_row_q6_k),
    ];
    let x = values(rows * k, 7);
    for (format, quantize) in formats {
        let mut bytes = Vec::new();
        for row in values(n * k, 5).chunks(k) {
            quantize(row, &mut bytes);
        }
        let (wc, wg) = (c.matrix(format, n, k, &bytes).unwrap(), g.matrix(format, n, k, &bytes).unwrap());
        let (mut oc, mut og) = (c.tensor(0), g.tensor(1));
        c.matmul(&x, rows, &mut [(&wc, &mut oc)]);
        g.matmul(&g.upload(&x), rows, &mut [(&wg, &mut og)]);
        let e = rel_err(&down(&g, &og, rows * n), &oc[..rows * n]);
        assert!(e <= 2e-2, "{} matmul {n}x{k}: {e}", format.name());
    }
}

/// A product of 300 rows runs as three 128-row cuBLAS calls spread over the
/// side streams: it matches the CPU, row 200 alone has the same bits as in the
/// batch, and one stream gives the same bits as several.
#[test]
fn a_product_over_several_calls_and_streams_keeps_every_row_s_bits() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new(2).unwrap();
    let (n, k, rows) = (1536, 576, 300);
    let w = values(n * k, 21);
    let (wc, wg) = (c.matrix_from_f32(n, k, w.clone()).unwrap(), g.matrix_from_f32(n, k, w).unwrap());
    let x = values(rows * k, 22);
    let mut oc = c.tensor(0);
    c.matmul(&x, rows, &mut [(&wc, &mut oc)]);
    let run = |streams: usize| {
        let used = g.set_gemm_streams(streams);
        let mut og = g.tensor(1);
        g.matmul(&g.upload(&x), rows, &mut [(&wg, &mut og)]);
        (used, down(&g, &og, rows * n))
    };
    let (lanes, spread) = run(4);
    let e = rel_err(&spread, &oc[..rows * n]);
    assert!(e <= 1e-2, "matmul over {lanes} streams: {e}");
    let (_, one) = run(1);
    assert_eq!(one, spread, "one stream and {lanes} streams give different bits");
    let mut alone = g.tensor(1);
    g.matmul(&g.upload(&x[200 * k..201 * k]), 1, &mut [(&wg, &mut alone)]);
    assert_eq!(down(&g, &alone, n), spread[200 * n..201 * n].to_vec(), "row 200 alone differs from row 200 in a batch of {rows}");
    g.set_gemm_streams(4);
}

/// Writes the same tokens into a CPU and a GPU arena and checks the bytes,
/// then attention for a decode batch of different lengths (up to 3,000 keys:
/// 12 partitions) and for a prefill chunk.
#[test]
fn kv_and_attention_match_the_cpu_for_every_dtype() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new(2).unwrap();
    for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::BF16, KvDtype::F8E4M3] {
        // On the tensor cores (sm_80 on) queries and probabilities are rounded to the
        // mma's 16-bit inputs: bf16 keeps 8 bits, f16 (for f16 and e4m3 KV) 11; the
        // emulated kernels' errors against the CPU are 2e-3 and 3e-4 (tests/emulated).
        let tol = match (g.attention_on_tensor_cores(dtype, 64), dtype) {
            (false, _) => 1e-5f32,
            (true, KvDtype::BF16) => 6e-3,
            (true, _) => 1e-3,
        };
        let layout = KvLayout { layers: 2, block_tokens: 16, kv_heads: 3, head_dim: 64, dtype };
        let (n_heads, layer) = (9, 1);
        let blocks = 400;
        let (mut kc, mut kg) = (c.kv(layout, blocks).unwrap(), g.kv(layout, blocks).unwrap());
        // Three sequences: 3,000, 700 and 1 tokens, blocks scattered over the arena.
        let lens = [3000usize, 700, 1];
        // A fixed permutation of the arena (7 is coprime to 400), split between the sequences.
        let tables = scattered_tables(&lens, blocks, 7);
        let all: Vec<u32> = tables.iter().flatten().copied().collect();
        let te = layout.token_elems();
        for (s, (&len, table)) in lens.iter().zip(&tables).enumerate() {
            let (k, v, slots) = sequence_kv(s, len, table, te);
            c.kv_write(&mut kc, layer, &k, &v, &slots);
            g.kv_write(&mut kg, layer, &g.upload(&k), &g.upload(&v), &slots);
        }
        let bb = layout.block_bytes();
        for &b in &all {
            let (mut bc, mut bg) = (vec![0u8; bb], vec![0u8; bb]);
            c.kv_copy_block_out(&kc, b as usize, &mut bc);
            g.kv_copy_block_out(&kg, b as usize, &mut bg);
            assert!(bc == bg, "{dtype:?}: block {b} bytes differ between the backends");
        }

        // Decode: the last position of each sequence.
        let rows: Vec<AttnRow> = lens.iter().zip(&tables).map(|(&len, t)| AttnRow { block_table: t, pos: len - 1 }).collect();
        let q = values(rows.len() * n_heads * 64, 9);
        let scale = 1.0 / 8.0;
        let (mut oc, mut og) = (c.tensor(0), g.tensor(1));
        c.attention(&kc, layer, &q, &rows, n_heads, scale, None, &mut oc);
        g.attention(&kg, layer, &g.upload(&q), &rows, n_heads, scale, None, &mut og);
        let batch = down(&g, &og, q.len());
        let e = rel_err(&batch, &oc[..q.len()]);
        assert!(e <= tol, "{dtype:?} decode attention: {e}");
        // The 3,000-token row alone: the same bits as in the batch.
        let mut alone = g.tensor(1);
        g.attention(&kg, layer, &g.upload(&q[..n_heads * 64]), &rows[..1], n_heads, scale, None, &mut alone);
        assert_eq!(down(&g, &alone, n_heads * 64), batch[..n_heads * 64].to_vec(), "{dtype:?}: attention depends on the batch");

        // Prefill: positions 600..700 of the second sequence as one chunk (causal).
        let chunk: Vec<AttnRow> = (600..700).map(|p| AttnRow { block_table: &tables[1], pos: p }).collect();
        let q = values(chunk.len() * n_heads * 64, 10);
        let (mut oc, mut og) = (c.tensor(0), g.tensor(1));
        c.attention(&kc, layer, &q, &chunk, n_heads, scale, None, &mut oc);
        g.attention(&kg, layer, &g.upload(&q), &chunk, n_heads, scale, None, &mut og);
        let chunk_out = down(&g, &og, q.len());
        let e = rel_err(&chunk_out, &oc[..q.len()]);
        assert!(e <= tol, "{dtype:?} prefill attention: {e}");
        // A chunk row (tiled kernel) equals the same position computed alone (per-row kernel).
        for &i in &[0usize, 37, 99] {
            let mut alone = g.tensor(1);
            g.attention(&kg, layer, &g.upload(&q[i * n_heads * 64..(i + 1) * n_heads * 64]), &chunk[i..i + 1], n_heads, scale, None, &mut alone);
            assert_eq!(down(&g, &alone, n_heads * 64), chunk_out[i * n_heads * 64..(i + 1) * n_heads * 64].to_vec(), "{dtype:?}: prefill row {i} depends on its chunk");
        }

        // A sliding window of 512 keys (Gemma 3's): the chunk and a decode row past it.
        let window = Some(512);
        let (mut oc, mut og) = (c.tensor(0), g.tensor(1));
        c.attention(&kc, layer, &q, &chunk, n_heads, scale, window, &mut oc);
        g.attention(&kg, layer, &g.upload(&q), &chunk, n_heads, scale, window, &mut og);
        let e = rel_err(&down(&g, &og, q.len()), &oc[..q.len()]);
        assert!(e <= tol, "{dtype:?} windowed prefill attention: {e}");
        let q = values(n_heads * 64, 12);
        let (mut oc, mut og) = (c.tensor(0), g.tensor(1));
        c.attention(&kc, layer, &q, &rows[..1], n_heads, scale, window, &mut oc);
        g.attention(&kg, layer, &g.upload(&q), &rows[..1], n_heads, scale, window, &mut og);
        let e = rel_err(&down(&g, &og, q.len()), &oc[..q.len()]);
        assert!(e <= tol, "{dtype:?} windowed decode attention: {e}");
    }
}

/// Blocks move between backends: packed on the CPU, installed on the GPU
/// layer by layer, packed again on the GPU: the same bytes.
#[test]
fn blocks_move_between_the_cpu_and_the_gpu_unchanged() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new(1).unwrap();
    let layout = KvLayout { layers: 30, block_tokens: 16, kv_heads: 3, head_dim: 64, dtype: KvDtype::BF16 };
    let (mut kc, mut kg) = (c.kv(layout, 4).unwrap(), g.kv(layout, 4).unwrap());
    let te = layout.token_elems();
    for layer in 0..layout.layers {
        let (k, v) = (values(16 * te, layer as u64), values(16 * te, 1000 + layer as u64));
        let slots: Vec<(u32, u32)> = (0..16).map(|s| (2, s)).collect();
        c.kv_write(&mut kc, layer, &k, &v, &slots);
    }
    let mut block = vec![0u8; layout.block_bytes()];
    c.kv_copy_block_out(&kc, 2, &mut block);
    let lb = layout.block_layer_bytes();
    for layer in 0..layout.layers {
        g.kv_block_layer_in(&mut kg, 3, layer, &block[layer * lb..(layer + 1) * lb]);
    }
    let mut back = vec![0u8; layout.block_bytes()];
    g.kv_copy_block_out(&kg, 3, &mut back);
    assert!(back == block);
    let mut one = vec![0u8; lb];
    g.kv_block_layer_out(&kg, 3, 7, &mut one);
    assert!(one[..] == block[7 * lb..8 * lb]);
}

/// Writes every layer of every token of `blocks` (values from `seed` on) on both backends,
/// queueing the GPU's export of each layer right behind its write, as a forward pass does;
/// the exports, which must still be in flight when the call returns.
fn write_and_export_layers(c: &CpuBackend, g: &CudaBackend, kc: &mut <CpuBackend as Backend>::Kv, kg: &mut <CudaBackend as Backend>::Kv, layout: KvLayout, blocks: &[usize], seed: u64) -> Vec<KvBytes> {
    let te = layout.token_elems();
    let bt = layout.block_tokens as u32;
    let slots: Vec<(u32, u32)> = blocks.iter().flat_map(|&b| (0..bt).map(move |s| (b as u32, s))).collect();
    (0..layout.layers)
        .map(|layer| {
            let (k, v) = (values(slots.len() * te, seed + layer as u64), values(slots.len() * te, seed + 5000 + layer as u64));
            c.kv_write(kc, layer, &k, &v, &slots);
            g.kv_write(kg, layer, &g.upload(&k), &g.upload(&v), &slots);
            let copy = g.kv_blocks_layer_out(kg, blocks, layer, layout.block_layer_bytes());
            assert!(!copy.is_ready(), "layer {layer}: the GPU's export is queued, not done in the call");
            copy
        })
        .collect()
}

/// A pipelined export's layer copies (side stream, page-locked slots): queued after each
/// layer's write while the compute stream goes on writing later layers, each arrives equal
/// to the CPU backend's, whichever order they are waited in, and a copy dropped unwaited
/// gives its slot back for the next one.
#[test]
fn layer_copies_leave_beside_the_compute_and_equal_the_cpus() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new(1).unwrap();
    let layout = KvLayout { layers: 30, block_tokens: 16, kv_heads: 3, head_dim: 64, dtype: KvDtype::BF16 };
    let (mut kc, mut kg) = (c.kv(layout, 9).unwrap(), g.kv(layout, 9).unwrap());
    let blocks = [5usize, 1, 7];
    let lb = layout.block_layer_bytes();
    let pending = write_and_export_layers(&c, &g, &mut kc, &mut kg, layout, &blocks, 50);
    // Waited last first: each copy owns its buffers.
    for (layer, copy) in pending.into_iter().enumerate().rev() {
        let got = copy.wait();
        let want = c.kv_blocks_layer_out(&kc, &blocks, layer, lb).wait();
        assert!(got == want, "layer {layer} differs from the CPU's");
    }
    drop(g.kv_blocks_layer_out(&kg, &blocks, 0, lb));
    let again = g.kv_blocks_layer_out(&kg, &blocks, 29, lb).wait();
    assert!(again == c.kv_blocks_layer_out(&kc, &blocks, 29, lb).wait());
}

/// GPUDirect RDMA sending: a pipelined export's layer kept in device memory
/// (`into_device`), whether or not its DMA to the host was queued
/// (`keep_layer_exports_on_device`), reads back as the CPU backend's bytes, whole and in
/// part, and refuses a read past its end; a device-to-device copy from its address into a
/// dma-buf (what the transport's send ring is) carries the same bytes. With exports kept on
/// the device `wait` still gives them, and a kept layer dropped gives its slot to the next
/// export, which then holds that layer's bytes, not the earlier one's.
#[test]
fn layer_exports_kept_on_the_device_equal_the_cpus() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new(1).unwrap();
    let layout = KvLayout { layers: 6, block_tokens: 16, kv_heads: 3, head_dim: 64, dtype: KvDtype::BF16 };
    let (mut kc, mut kg) = (c.kv(layout, 9).unwrap(), g.kv(layout, 9).unwrap());
    let blocks = [5usize, 1, 7];
    let lb = layout.block_layer_bytes();
    let ring = dmabuf_or_skip(&g, blocks.len() * lb);
    if ring.is_none() {
        println!("no dma-buf on this GPU: the device address is checked only through read()");
    }
    for keep in [false, true] {
        g.keep_layer_exports_on_device(keep);
        // Other values in each round.
        let exports = write_and_export_layers(&c, &g, &mut kc, &mut kg, layout, &blocks, 60 + 700 * keep as u64);
        let want: Vec<Vec<u8>> = (0..layout.layers).map(|layer| c.kv_blocks_layer_out(&kc, &blocks, layer, lb).wait()).collect();
        // All kept at once: each holds its own device buffer.
        let kept: Vec<_> = exports.into_iter().map(|e| e.into_device().expect("the CUDA backend's export stays on the device")).collect();
        let mut addrs: Vec<u64> = kept.iter().map(|d| d.device_addr()).collect();
        addrs.sort_unstable();
        addrs.dedup();
        assert_eq!(addrs.len(), layout.layers, "keep = {keep}: two kept layers share a device buffer");
        for (layer, dev) in kept.iter().enumerate() {
            let want = &want[layer];
            assert_eq!(dev.len(), want.len());
            assert!(!dev.is_empty());
            let mut all = vec![0u8; dev.len()];
            dev.read(0, &mut all).unwrap();
            assert!(all == *want, "keep = {keep}: layer {layer} kept on the device differs from the CPU's");
            let mut part = vec![0u8; lb];
            dev.read(lb + 3, &mut part[..lb - 5]).unwrap();
            assert!(part[..lb - 5] == want[lb + 3..2 * lb - 2], "keep = {keep}: layer {layer} read in part");
            dev.read(dev.len(), &mut []).unwrap();
            assert!(dev.read(dev.len() - 3, &mut [0u8; 4]).is_err(), "a read past the end is refused");
            assert!(dev.read(usize::MAX, &mut [0u8; 1]).is_err(), "an offset that overflows is refused");
            if let Some(ring) = &ring {
                ring.copy_from_device(0, dev.device_addr(), dev.len()).unwrap();
                let mut back = vec![0u8; dev.len()];
                ring.read(0, &mut back).unwrap();
                assert!(back == *want, "keep = {keep}: layer {layer} copied device to device from its address differs");
            }
        }
        drop(kept);

        // The host path from the same exports.
        for layer in (0..layout.layers).rev() {
            assert!(g.kv_blocks_layer_out(&kg, &blocks, layer, lb).wait() == want[layer], "keep = {keep}: layer {layer} waited on differs");
        }

        // A kept layer dropped: its slot goes back to the free list, and an export that takes
        // it (exports held until one does: which free slot comes first is the pool's choice)
        // holds its own layer's bytes, not the dropped one's.
        let first = g.kv_blocks_layer_out(&kg, &blocks, 2, lb).into_device().expect("kept on the device");
        let addr = first.device_addr();
        drop(first);
        let mut held = Vec::new();
        for i in 0..64 {
            let layer = [4, 0, 5, 1, 3][i % 5];
            let dev = g.kv_blocks_layer_out(&kg, &blocks, layer, lb).into_device().expect("kept on the device");
            let mut all = vec![0u8; dev.len()];
            dev.read(0, &mut all).unwrap();
            assert!(all == want[layer], "keep = {keep}: export {i} (layer {layer}) differs from the CPU's");
            let reused = dev.device_addr() == addr;
            held.push(dev);
            if reused {
                break;
            }
        }
        assert_eq!(held.last().map(|d| d.device_addr()), Some(addr), "keep = {keep}: the dropped layer's slot never came back");
        println!("keep = {keep}: the dropped layer's slot was reused by export {}", held.len() - 1);
    }
    g.keep_layer_exports_on_device(false);
    assert!(g.kv_blocks_layer_out(&kg, &blocks, 5, lb).wait() == c.kv_blocks_layer_out(&kc, &blocks, 5, lb).wait());
    assert!(g.kv_blocks_layer_out(&kg, &[], 0, lb).into_device().is_err(), "nothing to keep: an empty export is on the host");
}

/// An export of many blocks in one call crosses several staging groups (a
/// 16 MiB buffer holds 45 blocks of this layout: groups of 45, 45, 45 and 2).
/// Every block's bytes arrive whole and in order, equal to the CPU arena's,
/// and blocks installed on the GPU in one call read back the same one by one.
#[test]
fn many_blocks_move_in_staged_groups() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new(1).unwrap();
    let layout = KvLayout { layers: 30, block_tokens: 16, kv_heads: 3, head_dim: 64, dtype: KvDtype::BF16 };
    let n = 137;
    let (mut kc, mut kg) = (c.kv(layout, n + 3).unwrap(), g.kv(layout, n + 3).unwrap());
    let bb = layout.block_bytes();
    // Distinct bytes per block; arena blocks in a scattered order (11 is coprime to n + 3).
    let data: Vec<Vec<u8>> = (0..n).map(|i| values(bb / 4, 7000 + i as u64).iter().flat_map(|v| v.to_bits().to_le_bytes()).collect()).collect();
    let ids: Vec<usize> = (0..n).map(|i| (i * 11) % (n + 3)).collect();
    let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
    c.kv_blocks_in(&mut kc, &ids, &refs);
    g.kv_blocks_in(&mut kg, &ids, &refs);
    let (mut from_cpu, mut from_gpu) = (vec![vec![0u8; bb]; n], vec![vec![0u8; bb]; n]);
    c.kv_blocks_out(&kc, &ids, &mut from_cpu.iter_mut().map(Vec::as_mut_slice).collect::<Vec<_>>());
    g.kv_blocks_out(&kg, &ids, &mut from_gpu.iter_mut().map(Vec::as_mut_slice).collect::<Vec<_>>());
    for i in 0..n {
        assert!(from_cpu[i] == data[i], "CPU block {i} (arena {}) changed in the round trip", ids[i]);
        assert!(from_gpu[i] == data[i], "GPU block {i} (arena {}) changed in the staged round trip", ids[i]);
        let mut one = vec![0u8; bb];
        g.kv_copy_block_out(&kg, ids[i], &mut one);
        assert!(one == data[i], "GPU block {i} read alone differs");
    }
}

/// Block ids reach the pack and unpack kernels through a ring of page-locked slots and one
/// reused device buffer (`cuda/id_upload.rs`). Imports and exports layer by layer, over more
/// layers than the ring has slots, with lists of varying lengths (one past the buffer's first
/// size, so it grows), the same list at consecutive layers (copied once) and other index
/// uploads in between (which overwrite the buffer, after the kernels queued before them), land
/// and leave the CPU backend's bytes, all exports queued before any is waited on.
#[test]
fn block_ids_through_the_pinned_ring_move_layer_by_layer_unchanged() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new(1).unwrap();
    let layout = KvLayout { layers: 20, block_tokens: 4, kv_heads: 1, head_dim: 32, dtype: KvDtype::F32 };
    let n = 2100;
    let (mut kc, mut kg) = (c.kv(layout, n).unwrap(), g.kv(layout, n).unwrap());
    let (bb, lb) = (layout.block_bytes(), layout.block_layer_bytes());
    let data: Vec<Vec<u8>> = (0..n).map(|i| values(bb / 4, 90_000 + i as u64).iter().flat_map(|v| v.to_bits().to_le_bytes()).collect()).collect();
    // Arena blocks in a scattered order (13 is coprime to n).
    let ids: Vec<usize> = (0..n).map(|i| (i * 13) % n).collect();
    c.kv_blocks_in(&mut kc, &ids, &data.iter().map(Vec::as_slice).collect::<Vec<_>>());

    // Imported as frames arrive: each layer in runs of lengths cycling through `lens`
    // (1,500 ids pass the buffer's first 1,024 words), from another start at each layer.
    let lens = [1usize, 7, 1500, 3, 64, 525];
    let mut runs = 0;
    for layer in 0..layout.layers {
        let (mut at, mut k) = (0, layer);
        while at < n {
            let run = at..(at + lens[k % lens.len()]).min(n);
            let blocks: Vec<u32> = ids[run.clone()].iter().map(|&b| b as u32).collect();
            let frames: Vec<&[u8]> = data[run.clone()].iter().map(|d| &d[layer * lb..(layer + 1) * lb]).collect();
            g.kv_unpack(&mut kg, &blocks, layer..layer + 1, &frames);
            (at, k, runs) = (run.end, k + 1, runs + 1);
        }
    }
    assert_eq!(runs, 120, "six lists a layer: the ring's 8 slots go round 15 times");
    let mut back = vec![vec![0u8; bb]; n];
    g.kv_blocks_out(&kg, &ids, &mut back.iter_mut().map(Vec::as_mut_slice).collect::<Vec<_>>());
    for i in 0..n {
        assert!(back[i] == data[i], "block {i} (arena {}) installed layer by layer differs", ids[i]);
    }

    // Exported layer by layer as a forward pass does: mostly the same blocks, sometimes
    // others, and now and then another index list (gather_rows') through the same buffer.
    let width = 16;
    let x = values(8 * width, 5);
    let (xg, mut gathered) = (g.upload(&x), g.tensor(1));
    let rows = [7usize, 0, 3];
    let mut pending = Vec::new();
    for layer in 0..layout.layers {
        let blocks: Vec<usize> = match layer % 5 {
            3 => ids[..1200].to_vec(),
            4 => ids[layer..layer + 9].to_vec(),
            _ => ids[100..400].to_vec(),
        };
        if layer % 7 == 6 {
            g.gather_rows(&xg, width, &rows, &mut gathered);
        }
        let copy = g.kv_blocks_layer_out(&kg, &blocks, layer, lb);
        pending.push((layer, blocks, copy));
    }
    for (layer, blocks, copy) in pending {
        assert!(copy.wait() == c.kv_blocks_layer_out(&kc, &blocks, layer, lb).wait(), "layer {layer}'s export differs from the CPU's");
    }
    let want: Vec<f32> = rows.iter().flat_map(|&r| x[r * width..(r + 1) * width].iter().copied()).collect();
    assert!(down(&g, &gathered, rows.len() * width) == want, "rows gathered between exports");
}

/// The index arrays a forward pass reuses across its layers (rope's positions here;
/// kv_write's slots and attention's arrays go the same way) are rewritten in place, through
/// page-locked slots, when they change. Calls queued back to back and waited on only at the
/// end each read their own positions (a later copy into the buffer runs after the kernels
/// queued before it), across the buffer's growth past 1,024 words and a list repeated (not
/// copied again).
#[test]
fn reused_index_arrays_are_rewritten_after_the_kernels_that_read_them() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new(1).unwrap();
    let (heads, hd) = (2, 64);
    let (rc, rg) = (c.rope(RopeTable::new(hd, 10_000.0, 4096)), g.rope(RopeTable::new(hd, 10_000.0, 4096)));
    let repeated = vec![4095, 3, 17, 2000, 9];
    let lists: Vec<Vec<u32>> = vec![(0..5).collect(), (0..1500).map(|i| i * 7 % 4096).collect(), repeated.clone(), repeated, (4000..4040).collect()];
    let xs: Vec<Vec<f32>> = lists.iter().enumerate().map(|(i, p)| values(p.len() * heads * hd, 300 + i as u64)).collect();
    let mut on_gpu: Vec<_> = xs.iter().map(|x| g.upload(x)).collect();
    for (x, p) in on_gpu.iter_mut().zip(&lists) {
        g.apply_rope(&rg, x, p, heads);
    }
    for ((x, xg), p) in xs.iter().zip(&on_gpu).zip(&lists) {
        let mut want = x.clone();
        c.apply_rope(&rc, &mut want, p, heads);
        let e = rel_err(&down(&g, xg, x.len()), &want);
        assert!(e <= 1e-5, "rope over {} positions: {e}", p.len());
    }
}

#[test]
fn an_embedding_lookup_matches_the_cpu() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new(1).unwrap();
    let (vocab, dim) = (1000, 576);
    let table = values(vocab * dim, 11);
    let (tc, tg) = (c.matrix_from_f32(vocab, dim, table.clone()).unwrap(), g.matrix_from_f32(vocab, dim, table).unwrap());
    let tokens = [0u32, 999, 17, 17];
    let (mut oc, mut og) = (c.tensor(0), g.tensor(1));
    c.embed(&tc, &tokens, &mut oc);
    g.embed(&tg, &tokens, &mut og);
    let e = rel_err(&down(&g, &og, tokens.len() * dim), &oc[..tokens.len() * dim]);
    assert!(e <= 4e-3, "embed (bf16 table): {e}");
}

/// The operations of the families beyond Llama (what `supports` reports): the
/// GELU-tanh gate (Gemma), Q/K/V bias rows (Qwen2), the embedding scale (Gemma),
/// the row norm over each head (QK-norm: Qwen3, Gemma 3) and rotary tables with
/// other bases and scalings (Gemma 3's local and global layers, Llama 3's factors).
#[test]
fn family_operations_match_the_cpu() {
    use baton_kernels::OptionalOp;
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new(2).unwrap();
    for op in [OptionalOp::GeluMul, OptionalOp::BiasAdd, OptionalOp::Scale, OptionalOp::HeadNorm] {
        assert!(g.supports(op), "{}", op.name());
    }
    let (rows, ffn) = (5, 2048);
    let n = rows * ffn;
    let mut gate: Vec<f32> = values(n, 31).iter().map(|v| v * 8.0).collect();
    gate[..2401].iter_mut().enumerate().for_each(|(i, g)| *g = -120.0 + i as f32 * 0.1);
    let up = values(n, 32);
    let (mut oc, mut og) = (c.tensor(0), g.tensor(1));
    c.gelu_mul(&gate, &up, n, &mut oc);
    g.gelu_mul(&g.upload(&gate), &g.upload(&up), n, &mut og);
    let got = down(&g, &og, n);
    let e = rel_err(&got, &oc[..n]);
    assert!(e <= 1e-5, "gelu_mul: {e}");
    for ((x, w), o) in gate.iter().zip(&oc).zip(&got) {
        assert!((w - o).abs() <= 1e-5 * w.abs() + 1e-30, "gelu_mul({x}): {o} vs the CPU's {w}");
    }

    for width in [896usize, 128] {
        let rows = 9;
        let x = values(rows * width, 33);
        let bias = values(width, 34);
        let mut xc = x.clone();
        let mut xg = g.upload(&x);
        c.add_rows(&mut xc, &bias, rows, width);
        g.add_rows(&mut xg, &g.upload(&bias), rows, width);
        assert_eq!(down(&g, &xg, rows * width), xc, "add_rows of width {width} is exact");
    }

    let hidden = 640;
    let x = values(rows * hidden, 35);
    let s = (hidden as f32).sqrt();
    let mut xc = x.clone();
    let mut xg = g.upload(&x);
    c.scale(&mut xc, s, rows * hidden);
    g.scale(&mut xg, s, rows * hidden);
    assert_eq!(down(&g, &xg, rows * hidden), xc, "scale is exact");

    for (heads, hd) in [(16usize, 128usize), (4, 256), (1, 256)] {
        let x = values(rows * heads * hd, 36 + hd as u64);
        let w = values(hd, 37);
        let n_rows = rows * heads;
        let (mut oc, mut og) = (c.tensor(0), g.tensor(1));
        c.rmsnorm(&x, &w, 1e-6, n_rows, hd, &mut oc);
        g.rmsnorm(&g.upload(&x), &g.upload(&w), 1e-6, n_rows, hd, &mut og);
        let e = rel_err(&down(&g, &og, n_rows * hd), &oc[..n_rows * hd]);
        assert!(e <= 1e-5, "head norm ({heads} heads of {hd}): {e}");
    }

    let positions: Vec<u32> = vec![0, 1, 511, 4095, 77];
    let factors: Vec<f32> = (0..64).map(|i| 1.0 + i as f32 * 0.125).collect();
    // (what, head size, base, linear scale, frequency factors)
    type Rope<'a> = (&'a str, usize, f32, f32, Option<&'a [f32]>);
    let tables: [Rope; 3] =
        [("Gemma 3 local", 256, 10_000.0, 1.0, None), ("Gemma 3 global", 256, 1_000_000.0, 0.125, None), ("Llama 3 factors", 128, 500_000.0, 1.0, Some(&factors))];
    for (what, hd, base, freq_scale, f) in tables {
        let heads = 4;
        let q = values(positions.len() * heads * hd, 38);
        let (rc, rg) = (c.rope(RopeTable::scaled(hd, base, 4096, freq_scale, f)), g.rope(RopeTable::scaled(hd, base, 4096, freq_scale, f)));
        let mut qc = q.clone();
        let mut qg = g.upload(&q);
        c.apply_rope(&rc, &mut qc, &positions, heads);
        g.apply_rope(&rg, &mut qg, &positions, heads);
        let e = rel_err(&down(&g, &qg, q.len()), &qc);
        assert!(e <= 1e-5, "rope ({what}): {e}");
    }
}

/// Buffers and weights of `mini_step`: a two-layer decoder's decode step.
struct Mini {
    embed: <CudaBackend as Backend>::Matrix,
    wq: <CudaBackend as Backend>::Matrix,
    wk: <CudaBackend as Backend>::Matrix,
    wv: <CudaBackend as Backend>::Matrix,
    wo: <CudaBackend as Backend>::Matrix,
    head: <CudaBackend as Backend>::Matrix,
    norm: <CudaBackend as Backend>::Tensor,
    rope: <CudaBackend as Backend>::Rope,
    t: [<CudaBackend as Backend>::Tensor; 9],
}

const MINI: (usize, usize, usize, usize, usize) = (256, 8, 2, 64, 512); // hidden, heads, KV heads, head size, vocab

/// Every operation a decode step reads its step's inputs in: the embedding,
/// rope, KV writes, attention and the gather for logits, between products.
fn mini_step(g: &CudaBackend, m: &mut Mini, kv: &mut <CudaBackend as Backend>::Kv, s: &baton_kernels::StepInput) {
    let (hid, heads, kvh, hd, _) = MINI;
    let rows = s.tokens.len();
    let [x, h, q, k, v, att, o, last, logits] = &mut m.t;
    g.embed(&m.embed, s.tokens, x);
    for layer in 0..2 {
        g.rmsnorm(x, &m.norm, 1e-5, rows, hid, h);
        g.matmul(h, rows, &mut [(&m.wq, &mut *q), (&m.wk, &mut *k), (&m.wv, &mut *v)]);
        g.apply_rope(&m.rope, q, s.positions, heads);
        g.apply_rope(&m.rope, k, s.positions, kvh);
        g.kv_write(kv, layer, k, v, s.slots);
        g.attention(kv, layer, q, s.attn, heads, 1.0 / (hd as f32).sqrt(), None, att);
        g.matmul(att, rows, &mut [(&m.wo, &mut *o)]);
        g.add(x, o, rows * hid);
    }
    g.gather_rows(x, hid, s.logit_rows, last);
    g.matmul(last, s.logit_rows.len(), &mut [(&m.head, &mut *logits)]);
}

/// `Mini`'s weights, and an arena holding five sequences of `MINI_LENS` tokens, sequence
/// `s` in blocks `64 s .. 64 (s + 1)` (its table).
fn mini_with_sequences(g: &CudaBackend) -> (Mini, <CudaBackend as Backend>::Kv, Vec<Vec<u32>>, [usize; 5]) {
    let (hid, heads, kvh, hd, vocab) = MINI;
    let mat = |n: usize, k: usize, seed: u64| g.matrix_from_f32(n, k, values(n * k, seed).iter().map(|v| v / (k as f32).sqrt()).collect()).unwrap();
    let m = Mini {
        embed: mat(vocab, hid, 1),
        wq: mat(heads * hd, hid, 2),
        wk: mat(kvh * hd, hid, 3),
        wv: mat(kvh * hd, hid, 4),
        wo: mat(hid, heads * hd, 5),
        head: mat(vocab, hid, 6),
        norm: g.upload(&vec![1.0; hid]),
        rope: g.rope(RopeTable::new(hd, 10_000.0, 4096)),
        t: std::array::from_fn(|_| g.tensor(1)),
    };
    let layout = KvLayout { layers: 2, block_tokens: 16, kv_heads: kvh, head_dim: hd, dtype: KvDtype::BF16 };
    let lens = [600usize, 150, 1, 290, 20];
    let mut kv = g.kv(layout, 64 * lens.len()).unwrap();
    let tables: Vec<Vec<u32>> = (0..lens.len()).map(|s| ((s * 64) as u32..((s + 1) * 64) as u32).collect()).collect();
    for (s, (&len, table)) in lens.iter().zip(&tables).enumerate() {
        let (k, v, slots) = sequence_kv(s, len, table, layout.token_elems());
        for layer in 0..2 {
            g.kv_write(&mut kv, layer, &g.upload(&k), &g.upload(&v), &slots);
        }
    }
    (m, kv, tables, lens)
}

/// A decode step of `Mini` over sequences `seqs`: one row each, at `pos[s]` with token `next[s]`.
struct DecodeRows<'a> {
    tokens: Vec<u32>,
    positions: Vec<u32>,
    slots: Vec<(u32, u32)>,
    attn: Vec<AttnRow<'a>>,
    logit_rows: Vec<usize>,
}

impl<'a> DecodeRows<'a> {
    fn new(seqs: &[usize], pos: &[usize], next: &[u32], tables: &'a [Vec<u32>]) -> Self {
        DecodeRows {
            tokens: seqs.iter().map(|&s| next[s]).collect(),
            positions: seqs.iter().map(|&s| pos[s] as u32).collect(),
            slots: seqs.iter().map(|&s| (tables[s][pos[s] / 16], (pos[s] % 16) as u32)).collect(),
            attn: seqs.iter().map(|&s| AttnRow { block_table: &tables[s], pos: pos[s] }).collect(),
            logit_rows: (0..seqs.len()).collect(),
        }
    }

    fn input(&self) -> baton_kernels::StepInput<'_> {
        baton_kernels::StepInput { tokens: &self.tokens, positions: &self.positions, slots: &self.slots, attn: &self.attn, logit_rows: &self.logit_rows }
    }

    /// The step's logits run eagerly and unpadded, graphs off (the reference).
    fn eager_logits(&self, g: &CudaBackend, m: &mut Mini, kv: &mut <CudaBackend as Backend>::Kv) -> Vec<f32> {
        g.set_graphs(false);
        mini_step(g, m, kv, &self.input());
        g.set_graphs(true);
        down(g, &m.t[8], self.tokens.len() * MINI.4)
    }
}

/// The index of each row's largest logit (ties to the lowest), as `argmax_rows` picks.
fn host_argmax(logits: &[f32], vocab: usize) -> Vec<u32> {
    logits.chunks(vocab).map(|row| row.iter().enumerate().fold((0, f32::MIN), |b, (j, &x)| if x > b.1 { (j, x) } else { b }).0 as u32).collect()
}

/// Decode steps replayed as CUDA graphs (`cuda::graph`) against the same steps
/// run eagerly and unpadded: the same logits bit for bit at batches of 5 and 2
/// (buckets 8 and 2), through the first step of each shape (eager, from the
/// staged inputs), its capture and its replays, while the contexts grow; one
/// capture per shape and no eager fallback.
#[test]
fn decode_steps_replayed_as_cuda_graphs_give_the_eager_bits() {
    use baton_kernels::step::{decode_rows, pad_tables, PaddedStep};
    let Some(g) = gpu() else { return };
    if !g.set_graphs(true) {
        println!("CUDA graphs are off (BATON_CUDA_GRAPHS=0): not tested");
        return;
    }
    let vocab = MINI.4;
    let (mut m, mut kv, tables, lens) = mini_with_sequences(&g);
    let (mut pos, mut next) = (lens.to_vec(), vec![7u32; lens.len()]);
    let schedule: Vec<Vec<usize>> = [vec![vec![0, 1, 2, 3, 4]; 5], vec![vec![3, 1]; 4]].concat();
    for (i, seqs) in schedule.iter().enumerate() {
        let n = seqs.len();
        let step_rows = DecodeRows::new(seqs, &pos, &next, &tables);
        let input = step_rows.input();
        let eager = step_rows.eager_logits(&g, &mut m, &mut kv);
        let rows = g.decode_step_rows(&input).expect("a decode-shaped step is bucketed");
        assert_eq!((rows, decode_rows(&input)), (n.next_power_of_two(), Some(rows)));
        let pads = pad_tables(rows - n);
        let padded = PaddedStep::new(&input, rows, &pads);
        let step = padded.input();
        let program = &m as *const Mini as usize;
        g.decode_step(&mut kv, &step, program, &mut |kv| mini_step(&g, &mut m, kv, &step));
        let graph = down(&g, &m.t[8], n * vocab);
        assert!(eager.iter().zip(&graph).all(|(a, b)| a.to_bits() == b.to_bits()), "step {i} ({n} rows, bucket {rows}): the graph's logits are not the eager step's bits");
        for (&s, t) in seqs.iter().zip(host_argmax(&eager, vocab)) {
            next[s] = t;
            pos[s] += 1;
        }
    }
    let st = g.graph_stats();
    println!("{st:?}");
    // Shapes (8 rows, 4 partitions) and (2, 2): eager, captured, then replayed.
    assert_eq!((st.captures, st.replays, st.fallbacks), (2, 3 + 2, 0), "{st:?}");
}

/// Run-ahead decoding (`baton_kernels::run_ahead`): each step's tokens are the last
/// step's greedy picks, copied on the device over its staged inputs before the host
/// has read them (`Backend::decode_step_fed`; the host's tokens are zeros). Every
/// step's logits are the bits of the same step run eagerly with the tokens the host
/// picked, through eager, captured and replayed graphs and a batch that drops three
/// streams and reorders the rest; the picks read back later are the host's argmax.
#[test]
fn fed_decode_steps_take_the_last_steps_picks_on_the_device() {
    use baton_kernels::step::{pad_tables, PaddedStep};
    use baton_kernels::PendingPicks;
    let Some(g) = gpu() else { return };
    let g = g.with_run_ahead(true);
    if !g.set_graphs(true) {
        println!("CUDA graphs are off (BATON_CUDA_GRAPHS=0): not tested");
        return;
    }
    let vocab = MINI.4;
    let (mut m, mut kv, tables, lens) = mini_with_sequences(&g);
    let (mut pos, mut next) = (lens.to_vec(), vec![7u32; lens.len()]);
    let schedule: Vec<Vec<usize>> = [vec![vec![0, 1, 2, 3, 4]; 4], vec![vec![3, 1]; 4]].concat();
    // The last step's picks in flight, its sequences and the tokens the host picked for them.
    let mut in_flight: Option<(PendingPicks, Vec<usize>, Vec<u32>)> = None;
    for (i, seqs) in schedule.iter().enumerate() {
        let n = seqs.len();
        let step_rows = DecodeRows::new(seqs, &pos, &next, &tables);
        let input = step_rows.input();
        let eager = step_rows.eager_logits(&g, &mut m, &mut kv);
        let zeros = vec![0u32; n];
        let unknown = baton_kernels::StepInput { tokens: &zeros, ..input };
        let rows = g.decode_step_rows(&unknown).expect("a decode-shaped step is bucketed");
        let pads = pad_tables(rows - n);
        let padded = PaddedStep::new(if in_flight.is_some() { &unknown } else { &input }, rows, &pads);
        let step = padded.input();
        let program = &m as *const Mini as usize;
        match &in_flight {
            None => g.decode_step(&mut kv, &step, program, &mut |kv| mini_step(&g, &mut m, kv, &step)),
            Some((picks, last, _)) => {
                let from: Vec<u32> = seqs.iter().map(|s| last.iter().position(|l| l == s).expect("a stream of the last step") as u32).collect();
                let ran = g.decode_step_fed(&mut kv, &step, program, picks, &from, &mut |kv| mini_step(&g, &mut m, kv, &step));
                assert!(ran, "step {i}: the fed step did not run");
            }
        }
        let fed = down(&g, &m.t[8], n * vocab);
        assert!(eager.iter().zip(&fed).all(|(a, b)| a.to_bits() == b.to_bits()), "step {i} ({n} rows): the fed step's logits are not the bits of the step with the host's tokens");
        let Some(picks) = g.greedy_rows_start(&m.t[8], n, vocab) else {
            println!("run-ahead is off (BATON_RUN_AHEAD=0 or BATON_DEVICE_SAMPLING=0): not tested");
            return;
        };
        let picked = host_argmax(&eager, vocab);
        if let Some((last_picks, _, want)) = in_flight.take() {
            let got = g.greedy_rows_finish(last_picks);
            assert_eq!(got, want.iter().map(|&t| GreedyRow::Token(t)).collect::<Vec<_>>(), "step {i}: the last step's picks read back");
        }
        for (&s, &t) in seqs.iter().zip(&picked) {
            next[s] = t;
            pos[s] += 1;
        }
        in_flight = Some((picks, seqs.clone(), picked));
    }
    let (picks, _, want) = in_flight.expect("the last step's picks");
    assert_eq!(g.greedy_rows_finish(picks), want.iter().map(|&t| GreedyRow::Token(t)).collect::<Vec<_>>());
    let st = g.graph_stats();
    println!("{st:?}");
    assert_eq!((st.fed, st.fallbacks), (schedule.len() as u64 - 1, 0), "{st:?}");
}

/// The fused operations (fused.cu) give exactly the bits of the unfused
/// sequences they replace: the products read the same bf16 input, the residual
/// stream, the rotated queries and the arena get the same values. The emulator
/// checks the same on the CPU (tests/emulated/fused.rs); here the GPU's compiler
/// has its say too (its FMA contraction of the helpers both share).
#[test]
fn fused_operations_give_the_unfused_bits() {
    let Some(g) = gpu() else { return };
    let (rows, dim, n) = (5, 576, 192);
    let bits = |a: &[f32], b: &[f32]| a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
    let (x, y, w) = (values(rows * dim, 60), values(rows * dim, 61), values(dim, 62));
    let m = g.matrix_from_f32(n, dim, values(n * dim, 63)).unwrap();
    let (xg, yg, wg) = (g.upload(&x), g.upload(&y), g.upload(&w));
    let (mut h, mut want, mut got) = (g.tensor(1), g.tensor(1), g.tensor(1));

    g.rmsnorm(&xg, &wg, 1e-5, rows, dim, &mut h);
    g.matmul(&h, rows, &mut [(&m, &mut want)]);
    g.norm_matmul(&xg, &wg, 1e-5, rows, dim, &mut h, &mut [(&m, &mut got)]);
    assert!(bits(&down(&g, &got, rows * n), &down(&g, &want, rows * n)), "norm_matmul");

    let (mut x1, mut x2) = (g.upload(&x), g.upload(&x));
    g.add(&mut x1, &yg, rows * dim);
    g.rmsnorm(&x1, &wg, 1e-5, rows, dim, &mut h);
    g.matmul(&h, rows, &mut [(&m, &mut want)]);
    g.add_norm_matmul(&mut x2, &yg, None, &wg, 1e-5, rows, dim, &mut h, &mut [(&m, &mut got)]);
    assert!(bits(&down(&g, &x2, rows * dim), &down(&g, &x1, rows * dim)), "add_norm_matmul: the residual stream");
    assert!(bits(&down(&g, &got, rows * n), &down(&g, &want, rows * n)), "add_norm_matmul: the products");

    // With a post norm of y (Gemma): x += rmsnorm(y) * wy, then the norm of x.
    let wy = g.upload(&values(dim, 67));
    let (mut x1, mut x2, mut t) = (g.upload(&x), g.upload(&x), g.tensor(1));
    g.rmsnorm(&yg, &wy, 1e-5, rows, dim, &mut t);
    g.add(&mut x1, &t, rows * dim);
    g.rmsnorm(&x1, &wg, 1e-5, rows, dim, &mut h);
    g.matmul(&h, rows, &mut [(&m, &mut want)]);
    g.add_norm_matmul(&mut x2, &yg, Some(&wy), &wg, 1e-5, rows, dim, &mut h, &mut [(&m, &mut got)]);
    assert!(bits(&down(&g, &x2, rows * dim), &down(&g, &x1, rows * dim)), "add_norm_matmul with a post norm: the residual stream");
    assert!(bits(&down(&g, &got, rows * n), &down(&g, &want, rows * n)), "add_norm_matmul with a post norm: the products");

    // The gate over the activations' range (x scaled), the up projection y.
    let gate = g.upload(&x.iter().map(|v| v * 8.0).collect::<Vec<_>>());
    for glu in [baton_kernels::Glu::Silu, baton_kernels::Glu::GeluTanh] {
        match glu {
            baton_kernels::Glu::Silu => g.silu_mul(&gate, &yg, rows * dim, &mut h),
            baton_kernels::Glu::GeluTanh => g.gelu_mul(&gate, &yg, rows * dim, &mut h),
        }
        g.matmul(&h, rows, &mut [(&m, &mut want)]);
        g.glu_matmul(glu, &gate, &yg, rows, dim, &mut h, &mut [(&m, &mut got)]);
        assert!(bits(&down(&g, &got, rows * n), &down(&g, &want, rows * n)), "glu_matmul {glu:?}");
    }

    let (q_heads, kv_heads, hd) = (9, 3, 64);
    let positions: Vec<u32> = vec![0, 1, 17, 511, 4095];
    let slots: Vec<(u32, u32)> = vec![(3, 0), (3, 1), (0, 15), (2, 7), (1, 9)];
    let q = values(rows * q_heads * hd, 64);
    let k: Vec<f32> = values(rows * kv_heads * hd, 65).iter().map(|v| v * 600.0).collect();
    let v = values(rows * kv_heads * hd, 66);
    let rope = g.rope(RopeTable::new(hd, 100_000.0, 4096));
    for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::BF16, KvDtype::F8E4M3] {
        let layout = KvLayout { layers: 2, block_tokens: 16, kv_heads, head_dim: hd, dtype };
        let (mut kv1, mut kv2) = (g.kv(layout, 4).unwrap(), g.kv(layout, 4).unwrap());
        let (mut q1, mut k1, mut q2, mut k2, vg) = (g.upload(&q), g.upload(&k), g.upload(&q), g.upload(&k), g.upload(&v));
        g.apply_rope(&rope, &mut q1, &positions, q_heads);
        g.apply_rope(&rope, &mut k1, &positions, kv_heads);
        g.kv_write(&mut kv1, 1, &k1, &vg, &slots);
        g.rope_kv_write(&mut kv2, 1, &rope, &mut q2, q_heads, &mut k2, kv_heads, &vg, &positions, &slots);
        assert!(bits(&down(&g, &q2, q.len()), &down(&g, &q1, q.len())), "rope_kv_write {dtype:?}: the rotated queries");
        for block in 0..4 {
            let (mut a, mut b) = (vec![0u8; layout.block_bytes()], vec![0u8; layout.block_bytes()]);
            g.kv_copy_block_out(&kv1, block, &mut a);
            g.kv_copy_block_out(&kv2, block, &mut b);
            assert!(a == b, "rope_kv_write {dtype:?}: block {block}'s bytes");
        }

        // QK-norm's per-head norms in the same launch (Qwen3, Gemma 3), against the
        // trait's sequence (rmsnorm of each head, then the unfused rope and kv_write).
        let (nq, nk) = (g.upload(&values(hd, 68)), g.upload(&values(hd, 69).iter().map(|v| v * 900.0).collect::<Vec<_>>()));
        let norm = || QkNorm { q: &nq, k: &nk, eps: 1e-6, head_dim: hd };
        let (mut kv3, mut kv4) = (g.kv(layout, 4).unwrap(), g.kv(layout, 4).unwrap());
        let (mut q3, mut k3, mut q4, mut k4, mut t) = (g.upload(&q), g.upload(&k), g.upload(&q), g.upload(&k), g.tensor(1));
        #[rustfmt::skip]
        baton_kernels::fused::qk_norm_rope_kv_write(&g, &mut kv3, 1, &rope, norm(), &mut q3, q_heads, &mut k3, kv_heads, &vg, &mut t, &positions, &slots);
        g.qk_norm_rope_kv_write(&mut kv4, 1, &rope, norm(), &mut q4, q_heads, &mut k4, kv_heads, &vg, &mut t, &positions, &slots);
        assert!(bits(&down(&g, &q4, q.len()), &down(&g, &q3, q.len())), "qk_norm_rope_kv_write {dtype:?}: the normed, rotated queries");
        for block in 0..4 {
            let (mut a, mut b) = (vec![0u8; layout.block_bytes()], vec![0u8; layout.block_bytes()]);
            g.kv_copy_block_out(&kv3, block, &mut a);
            g.kv_copy_block_out(&kv4, block, &mut b);
            assert!(a == b, "qk_norm_rope_kv_write {dtype:?}: block {block}'s bytes");
        }

        // Attention's combine writing the output projection's bf16 input, against
        // attention's f32 output then matmul's to_bf16: every slot of the arena written.
        let tokens = 4 * layout.block_tokens;
        let (ka, va) = (values(tokens * kv_heads * hd, 70), values(tokens * kv_heads * hd, 71));
        let all: Vec<(u32, u32)> = (0..tokens as u32).map(|i| (i / 16, i % 16)).collect();
        g.kv_write(&mut kv1, 0, &g.upload(&ka), &g.upload(&va), &all);
        let table = [2u32, 0, 3, 1];
        let attn: Vec<AttnRow> = [3, 17, 40, 63].map(|pos| AttnRow { block_table: &table, pos }).to_vec();
        let qa = g.upload(&values(attn.len() * q_heads * hd, 72));
        let om = g.matrix_from_f32(n, q_heads * hd, values(n * q_heads * hd, 73)).unwrap();
        let scale = 1.0 / (hd as f32).sqrt();
        g.attention(&kv1, 0, &qa, &attn, q_heads, scale, None, &mut h);
        g.matmul(&h, attn.len(), &mut [(&om, &mut want)]);
        g.attention_matmul(&kv1, 0, &qa, &attn, q_heads, scale, None, &mut h, &mut [(&om, &mut got)]);
        let len = attn.len() * n;
        assert!(down(&g, &want, len).iter().all(|v| v.is_finite()), "attention_matmul {dtype:?}: the unfused output is not finite");
        assert!(bits(&down(&g, &got, len), &down(&g, &want, len)), "attention_matmul {dtype:?}");
    }
}

/// GPU memory exported as a dma-buf for a NIC (GPUDirect RDMA receive rings): the fd is a
/// dma-buf, closed with the buffer; copies in and out (through the flush where the GPU
/// needs it) round-trip; fresh memory is zeroed; out-of-range copies are refused. A GPU
/// that cannot export dma-bufs, or cannot order a NIC's writes, must say so through its
/// attributes, which the error names.
#[test]
fn device_memory_exports_as_a_dma_buf() {
    use baton_kernels::cuda::dmabuf::EXPORT_ALIGN;
    let Some(g) = gpu() else { return };
    let buf = match g.dmabuf(3000) {
        Ok(b) => b,
        Err(e) => {
            let msg = e.to_string();
            assert!(msg.contains("DMA_BUF_SUPPORTED is 0") || msg.contains("nor can flush them"), "export failed on a GPU that claims support: {msg}");
            let _ = writeln!(std::io::stderr(), "\n!!!!! this GPU cannot export dma-bufs ({msg}); GPUDirect RDMA rings fall back to host memory !!!!!\n");
            return;
        }
    };
    println!("dma-buf fd {}, NIC writes become visible: {:?}", buf.fd(), buf.rdma_visibility());
    let link = format!("/proc/self/fd/{}", buf.fd());
    let target = std::fs::read_link(&link).unwrap();
    assert!(target.to_string_lossy().contains("dmabuf"), "{link} -> {target:?}");
    assert_eq!(buf.len(), EXPORT_ALIGN);
    assert_eq!(buf.device_addr() % EXPORT_ALIGN as u64, 0);
    let data: Vec<u8> = (0..=255).cycle().take(5000).collect();
    buf.write(100, &data).unwrap();
    let mut back = vec![0u8; 5000];
    buf.read(100, &mut back).unwrap();
    assert_eq!(back, data);
    let mut head = [1u8; 100];
    buf.read(0, &mut head).unwrap();
    assert_eq!(head, [0u8; 100], "fresh dma-buf memory is zeroed");
    assert!(buf.write(EXPORT_ALIGN - 1, &[0, 0]).is_err());
    assert!(buf.read(usize::MAX, &mut [0]).is_err());
    drop(buf);
    // Closed with the buffer (run.sh runs one test at a time, so nothing reused the number).
    assert!(std::fs::read_link(&link).map_or(true, |t| !t.to_string_lossy().contains("dmabuf")), "the dma-buf fd outlived its buffer");
}

/// A dma-buf of at least `bytes` on `g`'s GPU, or `None` after saying why this GPU cannot
/// export one (as `device_memory_exports_as_a_dma_buf` accepts).
fn dmabuf_or_skip(g: &CudaBackend, bytes: usize) -> Option<baton_kernels::cuda::dmabuf::DmaBuf> {
    match g.dmabuf(bytes) {
        Ok(b) => Some(b),
        Err(e) => {
            let msg = e.to_string();
            assert!(msg.contains("DMA_BUF_SUPPORTED is 0") || msg.contains("nor can flush them"), "export failed on a GPU that claims support: {msg}");
            let _ = writeln!(std::io::stderr(), "\n!!!!! SKIPPED: this GPU cannot export dma-bufs ({msg}) !!!!!\n");
            None
        }
    }
}

/// A frame's CRC-32 computed on the GPU where the NIC left it equals the transport's
/// host checksum (crc32fast) of the same bytes: every alignment, empty to past 1 MiB, the
/// range's last byte included; a range past the end is refused, not read.
#[test]
fn dma_buf_checksum_on_the_gpu_equals_crc32fast() {
    let Some(g) = gpu() else { return };
    let Some(buf) = dmabuf_or_skip(&g, (1 << 20) + 4096) else { return };
    let data = random_bytes(buf.len(), 11);
    buf.write(0, &data).unwrap();
    let cases = [(0, 0), (5, 0), (0, 1), (1, 3), (3, 255), (44, 4096), (7, 4097), (2, 16_385), (44, (1 << 20) + 44), (0, buf.len()), (buf.len() - 3, 3)];
    for (offset, len) in cases {
        let want = crc32fast::hash(&data[offset..offset + len]);
        assert_eq!(buf.checksum(offset, len).unwrap(), want, "{len} bytes at offset {offset}");
    }
    assert_eq!(buf.checksum(0, 9).unwrap(), crc32fast::hash(&data[..9]), "a second call reuses the compiled kernels");
    assert!(buf.checksum(buf.len() - 3, 4).is_err());
    assert!(buf.checksum(usize::MAX, 1).is_err());
    // What checking a 1 MiB frame where it landed costs, beside the host path it replaced
    // (the frame copied out, then crc32fast): printed for the GPU check's log.
    let frame = (1 << 20) + 44;
    let time = |f: &mut dyn FnMut()| {
        let t = std::time::Instant::now();
        for _ in 0..20 {
            f();
        }
        t.elapsed().as_secs_f64() * 1e6 / 20.0
    };
    let on_gpu = time(&mut || {
        buf.checksum(0, frame).unwrap();
    });
    let mut host = vec![0u8; frame];
    let via_host = time(&mut || {
        buf.read(0, &mut host).unwrap();
        std::hint::black_box(crc32fast::hash(&host));
    });
    println!("frame checksum, 1 MiB: on the GPU {on_gpu:.1} us; copied to the host + crc32fast {via_host:.1} us");
}

/// Bytes leave a dma-buf for other memory of the GPU and come back device to device,
/// unchanged, at unaligned offsets; out-of-range copies are refused.
#[test]
fn dma_buf_copies_to_and_from_device_memory_round_trip() {
    let Some(g) = gpu() else { return };
    let Some(buf) = dmabuf_or_skip(&g, 64 << 10) else { return };
    let data = random_bytes(10_000, 12);
    buf.write(3, &data).unwrap();
    let tensor = g.tensor(4000); // 16,000 bytes of other device memory
    let base = g.device_addr(&tensor);
    buf.copy_to_device(3, base + 1, data.len()).unwrap();
    let mut words = vec![0f32; 4000];
    g.download(&tensor, &mut words);
    let bytes: Vec<u8> = words.iter().flat_map(|v| v.to_bits().to_le_bytes()).collect();
    assert!(bytes[1..1 + data.len()] == data[..], "copy_to_device changed the bytes");
    buf.copy_from_device(20_001, base + 1, data.len()).unwrap();
    let mut back = vec![0u8; data.len()];
    buf.read(20_001, &mut back).unwrap();
    assert!(back == data, "copy_from_device changed the bytes");
    // Rows out to a pitch (a frame of consecutive blocks' layer into a pool's blocks).
    let (row, rows, pitch) = (1000, 5, 3000);
    buf.copy_rows_to_device(3, row, rows, base + 4, pitch).unwrap();
    g.download(&tensor, &mut words);
    let bytes: Vec<u8> = words.iter().flat_map(|v| v.to_bits().to_le_bytes()).collect();
    for i in 0..rows {
        assert!(bytes[4 + i * pitch..4 + i * pitch + row] == data[i * row..(i + 1) * row], "copy_rows_to_device: row {i}");
    }
    // Between the rows, what copy_to_device left (data shifted by one byte) is untouched.
    for i in 0..3 {
        let gap = 4 + i * pitch + row..4 + (i + 1) * pitch;
        assert!(bytes[gap.clone()] == data[gap.start - 1..gap.end - 1], "copy_rows_to_device wrote between rows {i} and {}", i + 1);
    }
    assert!(buf.copy_rows_to_device(buf.len() - 10, 5, 3, base, 5).is_err());
    assert!(buf.copy_rows_to_device(0, 8, 2, base, 4).is_err(), "rows that overlap");
    buf.copy_from_device(0, base, 0).unwrap();
    assert!(buf.copy_to_device(buf.len() - 1, base, 2).is_err());
    assert!(buf.copy_from_device(usize::MAX, base, 1).is_err());
}

/// Blocks installed from device addresses (frames left in GPU memory, scattered, in
/// another order than the blocks) read back exactly as the same blocks installed from the
/// host; a source that is not 4-byte aligned is declined and nothing changes.
#[test]
fn kv_blocks_in_device_installs_what_kv_blocks_in_does() {
    let Some(g) = gpu() else { return };
    let layout = KvLayout { layers: 6, block_tokens: 16, kv_heads: 2, head_dim: 64, dtype: KvDtype::BF16 };
    let (n, arena_blocks) = (9, 20);
    let bb = layout.block_bytes();
    let data: Vec<Vec<f32>> = (0..n).map(|i| values(bb / 4, 300 + i as u64)).collect();
    let ids: Vec<usize> = (0..n).map(|i| (i * 7 + 3) % arena_blocks).collect();
    // Block i's bytes at slot order[i] of device memory, 44 bytes (a frame header) into each slot.
    let slot_words = bb / 4 + 11;
    let order: Vec<usize> = (0..n).map(|i| (i * 4 + 1) % n).collect();
    let mut staged = values(n * slot_words, 400);
    for (i, &o) in order.iter().enumerate() {
        staged[o * slot_words + 11..(o + 1) * slot_words].copy_from_slice(&data[i]);
    }
    let staged = g.upload(&staged);
    let srcs: Vec<u64> = order.iter().map(|&o| g.device_addr(&staged) + ((o * slot_words + 11) * 4) as u64).collect();

    let bytes: Vec<Vec<u8>> = data.iter().map(|d| d.iter().flat_map(|v| v.to_bits().to_le_bytes()).collect()).collect();
    let (mut from_host, mut from_device) = (g.kv(layout, arena_blocks).unwrap(), g.kv(layout, arena_blocks).unwrap());
    g.kv_blocks_in(&mut from_host, &ids, &bytes.iter().map(Vec::as_slice).collect::<Vec<_>>());
    assert!(g.kv_blocks_in_device(&mut from_device, &ids, &srcs), "the CUDA backend installs from device memory");
    let all: Vec<usize> = (0..arena_blocks).collect();
    let read = |kv: &<CudaBackend as Backend>::Kv| {
        let mut out = vec![vec![0u8; bb]; arena_blocks];
        g.kv_blocks_out(kv, &all, &mut out.iter_mut().map(Vec::as_mut_slice).collect::<Vec<_>>());
        out
    };
    let (want, got) = (read(&from_host), read(&from_device));
    assert!(got == want, "the arenas differ");
    for (i, &b) in ids.iter().enumerate() {
        assert!(got[b] == bytes[i], "block {i} (arena {b}) differs from its source");
    }
    let mut unaligned = srcs.clone();
    unaligned[4] += 2;
    assert!(!g.kv_blocks_in_device(&mut from_device, &[ids[0]; 9], &unaligned), "a misaligned source is declined");
    assert!(read(&from_device) == want, "a declined install changed the arena");
    assert!(g.kv_blocks_in_device(&mut from_device, &[], &[]), "nothing to install");
}
