use super::*;
use crate::blocks::QK_K;
use crate::quant::{quantize_row_q4_0, quantize_row_q4_1, quantize_row_q8_0};

fn lcg(seed: &mut u64) -> f32 {
    *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    ((*seed >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
}

fn byte(seed: &mut u64) -> u8 {
    *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (*seed >> 56) as u8
}

/// The formats with an integer kernel (every ISA path).
const KERNEL_FORMATS: [WeightFormat; 11] = WeightFormat::INTEGER_KERNEL;

/// Offsets of a block's f16 factors (`d`, then `dmin` or `m`) per format.
fn f16_fields(format: WeightFormat) -> &'static [usize] {
    match format {
        WeightFormat::Q5_0 | WeightFormat::IQ4_NL | WeightFormat::IQ4_XS => &[0],
        WeightFormat::Q5_1 | WeightFormat::Q4_K | WeightFormat::Q5_K => &[0, 2],
        WeightFormat::Q2_K => &[80, 82],
        WeightFormat::Q3_K => &[108],
        WeightFormat::Q6_K => &[208],
        _ => &[],
    }
}

/// `n` rows of `k` elements in GGML bytes: the legacy formats from random
/// weights through their quantizers, the others as random valid blocks
/// (every bit pattern of quants and packed scales is valid; only the f16
/// factors are set, to magnitudes that keep the values near 1).
fn ggml_bytes(format: WeightFormat, n: usize, k: usize, seed: &mut u64) -> Vec<u8> {
    let mut bytes = Vec::new();
    match format {
        WeightFormat::F32 | WeightFormat::F16 | WeightFormat::BF16 | WeightFormat::Q4_0 | WeightFormat::Q4_1 | WeightFormat::Q8_0 => {
            let w: Vec<f32> = (0..n * k).map(|_| lcg(seed)).collect();
            for row in w.chunks(k) {
                match format {
                    WeightFormat::Q4_1 => quantize_row_q4_1(row, &mut bytes),
                    WeightFormat::Q4_0 => quantize_row_q4_0(row, &mut bytes),
                    WeightFormat::Q8_0 => quantize_row_q8_0(row, &mut bytes),
                    WeightFormat::F32 => row.iter().for_each(|v| bytes.extend_from_slice(&v.to_le_bytes())),
                    WeightFormat::F16 => row.iter().for_each(|v| bytes.extend_from_slice(&f16::from_f32(*v).to_bits().to_le_bytes())),
                    _ => row.iter().for_each(|v| bytes.extend_from_slice(&half::bf16::from_f32(*v).to_bits().to_le_bytes())),
                }
            }
        }
        _ => {
            let bb = format.block_bytes();
            // Largest |scale x quant| of the format, to bring values near 1.
            let span = match format {
                WeightFormat::Q5_0 | WeightFormat::Q5_1 => 31.0,
                WeightFormat::IQ4_NL => 127.0,
                WeightFormat::Q2_K => 45.0,
                WeightFormat::Q3_K => 128.0,
                WeightFormat::Q4_K => 945.0,
                WeightFormat::Q5_K => 1953.0,
                WeightFormat::Q6_K => 4096.0,
                WeightFormat::Q8_K => 127.0,
                _ => 4000.0, // IQ4_XS
            };
            for _ in 0..n * (k / format.block_len()) {
                let mut blk: Vec<u8> = (0..bb).map(|_| byte(seed)).collect();
                for (i, &at) in f16_fields(format).iter().enumerate() {
                    // d of either sign; a positive dmin (as files hold), or
                    // a Q5_1 offset of either sign.
                    let v = (0.5 + lcg(seed).abs()) / span * if i == 0 || format == WeightFormat::Q5_1 { lcg(seed).signum() } else { 1.0 };
                    blk[at..at + 2].copy_from_slice(&f16::from_f32(v).to_bits().to_le_bytes());
                }
                if format == WeightFormat::Q8_K {
                    blk[..4].copy_from_slice(&(1.0f32 / span).to_le_bytes());
                }
                bytes.extend(blk);
            }
        }
    }
    bytes
}

/// A prepared matrix and its rows dequantized by GGML's arithmetic
/// (`dequantize_row`, independent of the prepared layout).
fn matrix(format: WeightFormat, n: usize, k: usize, seed: &mut u64) -> (QMatrix, Vec<f32>) {
    let bytes = ggml_bytes(format, n, k, seed);
    let m = QMatrix::from_ggml(format, n, k, &bytes).unwrap();
    let mut deq = vec![0f32; n * k];
    let rb = format.row_bytes(k).unwrap();
    for (row, out) in bytes.chunks_exact(rb).zip(deq.chunks_exact_mut(k)) {
        dequantize_row(format, row, out);
    }
    (m, deq)
}

fn quantized(x: &[f32], rows: usize, k: usize, acts: Acts) -> QuantizedActs {
    let pool = Pool::new(1).unwrap();
    let mut xq = QuantizedActs::default();
    match acts {
        Acts::Q8 => xq.quantize(&pool, x, rows, k),
        Acts::Q8K => xq.q8k.quantize(&pool, x, rows, k),
        Acts::F32 => {}
    }
    xq
}

fn run_on(isa: Isa, w: &QMatrix, x: &[f32], rows: usize) -> Vec<f32> {
    let pool = Pool::new(2).unwrap();
    let xq = quantized(x, rows, w.k, w.acts());
    // A sentinel shows a missing or stray store.
    let mut out = vec![f32::NAN; rows * w.n];
    matmul_many_on(isa, &pool, x, &xq, rows, &mut [(w, &mut out)]);
    out
}

fn run(w: &QMatrix, x: &[f32], rows: usize) -> Vec<f32> {
    run_on(isa(), w, x, rows)
}

/// The instruction sets this machine runs, the portable path first.
fn isas() -> Vec<Isa> {
    match isa() {
        Isa::Avx512Vnni => vec![Isa::Scalar, Isa::Avx2, Isa::Avx512Vnni],
        Isa::Avx2 => vec![Isa::Scalar, Isa::Avx2],
        Isa::Scalar => vec![Isa::Scalar],
    }
}

/// Every format's product against the dequantized weights in f32, within
/// what the activations' quantization allows: each activation moves by at
/// most half its block's step `dx = max|x| / 127` (32-wide blocks, or 256
/// for the K formats), so `|error| <= sum |w| dx / 2`; the offset formats
/// also round their block sums `dx * sum(q)` to f16 (relative 2^-11, bound
/// by `sum |m| sum |x|`); f32 rounding adds 1e-5 relative. The reference
/// uses GGML's dequantization, so a misread layout fails here.
#[test]
fn every_format_matches_dequantized_reference() {
    let mut seed = 7;
    for format in WeightFormat::ALL {
        let k = if format.is_super_block() { 512 } else { 96 };
        let (n, rows) = (37, 5);
        let (w, deq) = matrix(format, n, k, &mut seed);
        let x: Vec<f32> = (0..rows * k).map(|_| lcg(&mut seed) * if seed % 7 == 0 { 4.0 } else { 1.0 }).collect();
        let block = if w.acts() == Acts::Q8K { QK_K } else { QK };
        let out = run(&w, &x, rows);
        for t in 0..rows {
            let xr = &x[t * k..(t + 1) * k];
            let steps: Vec<f32> = xr.chunks(block).map(|b| b.iter().fold(0f32, |a, v| a.max(v.abs())) / 127.0).collect();
            for o in 0..n {
                let wr = &deq[o * k..(o + 1) * k];
                let r: f64 = wr.iter().zip(xr).map(|(a, b)| *a as f64 * *b as f64).sum();
                let mag: f64 = wr.iter().zip(xr).map(|(a, b)| (*a as f64 * *b as f64).abs()).sum();
                let mut tol = 1e-5 * (1.0 + mag);
                if w.acts() != Acts::F32 {
                    tol += wr.iter().enumerate().map(|(i, a)| a.abs() as f64 * steps[i / block] as f64 / 2.0).sum::<f64>();
                }
                if let Prepared::Q4 { m, .. } | Prepared::Q8 { m, .. } = &w.kind {
                    if format == WeightFormat::Q4_1 || format == WeightFormat::Q5_1 {
                        tol += (0..k / QK).map(|b| block_at(m, k / QK, o, b).abs() as f64 * xr[b * QK..(b + 1) * QK].iter().map(|v| v.abs() as f64).sum::<f64>()).sum::<f64>() / 2048.0;
                    }
                }
                let got = out[t * n + o] as f64;
                assert!((got - r).abs() <= tol, "{format:?} t={t} o={o}: {got} vs {r} (tolerance {tol})");
            }
        }
    }
}

/// The prepared layouts give back GGML's values bit for bit (embedding
/// lookups and the CUDA backend's bf16 upload read them through `row_f32`).
#[test]
fn prepared_rows_equal_ggml_dequantization() {
    let mut seed = 5;
    for format in WeightFormat::ALL {
        let k = if format.is_super_block() { 768 } else { 128 };
        let n = 19;
        let (w, deq) = matrix(format, n, k, &mut seed);
        let mut row = vec![0f32; k];
        for o in 0..n {
            w.row_f32(o, &mut row);
            let want = &deq[o * k..(o + 1) * k];
            for (e, (a, b)) in row.iter().zip(want).enumerate() {
                assert!(a.to_bits() == b.to_bits() || (*a == 0.0 && *b == 0.0), "{format:?} row {o} element {e}: {a} vs {b}");
            }
        }
    }
}

#[test]
fn rows_are_independent_of_batch_bit_for_bit() {
    let mut seed = 11;
    for format in [WeightFormat::F32, WeightFormat::Q4_1, WeightFormat::Q8_0, WeightFormat::Q4_0, WeightFormat::Q5_1, WeightFormat::Q4_K, WeightFormat::Q6_K] {
        let (n, k, rows) = (70, 256, 9);
        let (w, _) = matrix(format, n, k, &mut seed);
        let x: Vec<f32> = (0..rows * k).map(|_| lcg(&mut seed)).collect();
        let all = run(&w, &x, rows);
        for t in 0..rows {
            let one = run(&w, &x[t * k..(t + 1) * k], 1);
            assert_eq!(one, all[t * n..(t + 1) * n].to_vec(), "{format:?} row {t}");
        }
    }
}

/// Every ISA path of every integer format, over every column-group size
/// and ragged panels (n not a multiple of 16), equals the portable path
/// bit for bit.
#[test]
fn every_isa_equals_portable_bit_for_bit() {
    let isas = isas();
    if isas.len() == 1 {
        eprintln!("SKIPPED: only the portable path on this machine");
        return;
    }
    if !isas.contains(&Isa::Avx512Vnni) {
        eprintln!("SKIPPED: the AVX-512 tiles (no AVX-512 VNNI here)");
    }
    let mut seed = 3;
    for format in KERNEL_FORMATS {
        let shapes: &[(usize, usize)] = if format.is_super_block() { &[(5, 256), (37, 512), (70, 256)] } else { &[(5, 32), (37, 96), (9, 256), (70, 160)] };
        for &(n, k) in shapes {
            let (w, _) = matrix(format, n, k, &mut seed);
            for rows in [1, 2, 3, 4, 5, 7, 9, 17] {
                let x: Vec<f32> = (0..rows * k).map(|_| lcg(&mut seed) * 3.0).collect();
                let want: Vec<u32> = run_on(Isa::Scalar, &w, &x, rows).iter().map(|v| v.to_bits()).collect();
                for &isa in &isas[1..] {
                    let got: Vec<u32> = run_on(isa, &w, &x, rows).iter().map(|v| v.to_bits()).collect();
                    assert_eq!(got, want, "{format:?} n={n} k={k} rows={rows} {isa:?}");
                }
            }
        }
    }
    #[cfg(target_arch = "x86_64")]
    {
        let x: Vec<f32> = (0..256).map(|_| lcg(&mut seed)).collect();
        // SAFETY: AVX2 and FMA (more than the portable path is available).
        assert_eq!(scalar::dot_f32(&x, &x).to_bits(), unsafe { simd::dot_f32(&x, &x) }.to_bits());
    }
}

/// The K formats' extremes: the largest quants (63) and scales (127 and
/// -128 for Q6_K, 63 for Q4_K/Q5_K) against activations at +-127 hit the
/// 16-bit pair sums of the AVX2 path and the 32-bit sums at their bounds;
/// every path stays exact and equal.
#[test]
fn k_extremes_are_exact_on_every_path() {
    let (n, k) = (16, 512);
    let mut q6 = Vec::new();
    let mut q5 = Vec::new();
    for r in 0..n {
        for _ in 0..k / QK_K {
            let mut b = vec![0xffu8; 210]; // every quant 63
            for j in 0..16 {
                b[192 + j] = if (j + r) % 2 == 0 { 127 } else { 0x80 };
            }
            b[208..210].copy_from_slice(&f16::from_f32(1e-4).to_bits().to_le_bytes());
            q6.extend(b);
            let mut b = vec![0xffu8; 176]; // quants 31, scales and mins 63
            b[0..2].copy_from_slice(&f16::from_f32(1e-4).to_bits().to_le_bytes());
            b[2..4].copy_from_slice(&f16::from_f32(1e-3 * (r + 1) as f32).to_bits().to_le_bytes());
            q5.extend(b);
        }
    }
    let x: Vec<f32> = (0..3 * k).map(|i| if i % 3 == 0 { -1.0 } else { 1.0 }).collect();
    for (format, bytes) in [(WeightFormat::Q6_K, q6), (WeightFormat::Q5_K, q5)] {
        let w = QMatrix::from_ggml(format, n, k, &bytes).unwrap();
        let want = run_on(Isa::Scalar, &w, &x, 3);
        for isa in isas() {
            assert_eq!(run_on(isa, &w, &x, 3), want, "{format:?} {isa:?}");
        }
        let mut row = vec![0f32; k];
        for o in 0..n {
            w.row_f32(o, &mut row);
            for t in 0..3 {
                // x is exactly +-1, so its quantization is exact.
                let exact: f64 = row.iter().zip(&x[t * k..(t + 1) * k]).map(|(a, b)| *a as f64 * *b as f64).sum();
                let got = want[t * n + o] as f64;
                assert!((got - exact).abs() <= 1e-5 * exact.abs().max(1.0), "{format:?} o={o}: {got} vs {exact}");
            }
        }
    }
}

/// Q8_0 weights of -128 (outside GGML's own range, but a file may hold
/// them) and 127 against extreme activations: the offset and sign
/// tricks of the SIMD paths stay exact.
#[test]
fn q8_extremes_are_exact() {
    let (n, k) = (16, 64);
    let mut bytes = Vec::new();
    for r in 0..n {
        for b in 0..k / QK {
            bytes.extend_from_slice(&f16::from_f32(0.5 + r as f32 + b as f32).to_bits().to_le_bytes());
            bytes.extend((0..QK).map(|e| if (e + r) % 3 == 0 { 0x80u8 } else if e % 2 == 0 { 127 } else { 0 }));
        }
    }
    let w = QMatrix::from_ggml(WeightFormat::Q8_0, n, k, &bytes).unwrap();
    let x: Vec<f32> = (0..2 * k).map(|i| if i % 5 == 0 { -1.0 } else { 1.0 }).collect();
    let got = run(&w, &x, 2);
    let want = run_on(Isa::Scalar, &w, &x, 2);
    assert_eq!(got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
    for t in 0..2 {
        for o in 0..n {
            let mut row = vec![0f32; k];
            w.row_f32(o, &mut row);
            let exact: f32 = row.iter().zip(&x[t * k..(t + 1) * k]).map(|(a, b)| a * b).sum();
            let v = want[t * n + o];
            assert!((v - exact).abs() <= 1e-3 * exact.abs().max(1.0), "{v} vs {exact}");
        }
    }
}

#[test]
fn wrong_sizes_are_errors() {
    assert!(matches!(QMatrix::from_ggml(WeightFormat::Q4_1, 2, 64, &[0u8; 10]), Err(MatrixError::Size { .. })));
    assert_eq!(
        QMatrix::from_ggml(WeightFormat::Q4_1, 2, 40, &[0u8; 10]).err(),
        Some(MatrixError::RowLength { k: 40, block: 32, format: "Q4_1" })
    );
    // K formats need whole super-blocks: 576 (SmolLM2's width) is not.
    let err = QMatrix::from_ggml(WeightFormat::Q4_K, 2, 576, &[0u8; 10]).err().expect("must fail");
    assert_eq!(err, MatrixError::RowLength { k: 576, block: 256, format: "Q4_K" });
    assert!(err.to_string().contains("Q4_K"), "{err}");
    // A Q4_0 scale whose offset (-8 x scale) has no f16 value.
    let mut block = vec![0u8; 18];
    block[..2].copy_from_slice(&f16::from_f32(10000.0).to_bits().to_le_bytes());
    let err = QMatrix::from_ggml(WeightFormat::Q4_0, 1, 32, &block).err().expect("must fail");
    assert!(matches!(err, MatrixError::ScaleRange { row: 0, block: 0, .. }), "{err}");
}

/// Q5_0 and Q5_1 kept at 5 bits (the AVX2 tile) give the bits of the same
/// matrix widened to 8 bits, on every path, and dequantize to the same rows.
/// The 5-row matrices hold only the largest quant (31), against activations
/// all at +127 or all at -127: the tile's 16-bit sums at their bound.
#[test]
fn q5_at_five_bits_equals_widened_bit_for_bit() {
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let mut seed = 17;
    for format in [WeightFormat::Q5_0, WeightFormat::Q5_1] {
        for &(n, k) in &[(5, 64), (37, 96), (70, 160)] {
            let mut bytes = ggml_bytes(format, n, k, &mut seed);
            let extremes = n == 5;
            if extremes {
                // qh and qs, after the block's f16 factors.
                let factors = if format == WeightFormat::Q5_1 { 4 } else { 2 };
                bytes.chunks_exact_mut(format.block_bytes()).for_each(|blk| blk[factors..].fill(0xff));
            }
            let native = QMatrix::prepare(format, n, k, &bytes, true).unwrap();
            let widened = QMatrix::prepare(format, n, k, &bytes, false).unwrap();
            assert!(matches!(native.kind, Prepared::Q5 { .. }) && matches!(widened.kind, Prepared::Q8 { .. }));
            let (mut a, mut b) = (vec![0f32; k], vec![0f32; k]);
            for o in 0..n {
                native.row_f32(o, &mut a);
                widened.row_f32(o, &mut b);
                assert_eq!(bits(&a), bits(&b), "{format:?} row {o}");
            }
            for rows in [1, 2, 3, 4, 5, 9] {
                let x: Vec<f32> = (0..rows * k).map(|i| if extremes { if (i / k) % 2 == 0 { 1.0 } else { -1.0 } } else { lcg(&mut seed) * 3.0 }).collect();
                let want = bits(&run_on(Isa::Scalar, &widened, &x, rows));
                for isa in isas() {
                    assert_eq!(bits(&run_on(isa, &native, &x, rows)), want, "{format:?} n={n} k={k} rows={rows} {isa:?}");
                }
            }
        }
    }
}
