//! CPU matrix-product benchmark: every format with an integer kernel on
//! the default model's shapes (SmolLM2-135M: width 576, FFN 1,536) and one
//! Llama-8B-sized matrix (4,096 x 4,096, past the caches), at decode
//! batch 1 and a 32-row batch, through `CpuBackend::matmul` (activation
//! quantization included, as the forward pass runs it).
//!
//! GFLOP/s counts `2 n k` per row; GB/s is the file's bytes of the weights
//! read per call (what a decode step moves at batch 1). Q4_0, Q4_1 and
//! Q8_0 are the baselines of the same run.
//!
//! On a shared machine other processes take the cores away at random, so
//! beside the wall time on the pool's threads the table gives the on-CPU
//! time of the same call on one thread (`/proc/thread-self/schedstat`,
//! Linux): time spent preempted does not count there.
//!
//! `cargo bench -p baton-kernels --bench cpu` (`BATON_BENCH_THREADS`,
//! default 2; `BATON_BENCH_ROUNDS`, default 7; `BATON_KERNELS_SCALAR=1` for
//! the portable path).

use std::time::{Duration, Instant};

use baton_kernels::blocks;
use baton_kernels::quant::{quantize_row_q4_0, quantize_row_q4_1, quantize_row_q8_0};
use baton_kernels::{Backend, CpuBackend, WeightFormat};

fn values(len: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..len)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        })
        .collect()
}

/// Random bytes in the format's blocks with sane f16 factors (Q2_K, Q3_K,
/// IQ4_NL have no quantizer here; speed does not depend on the values).
fn random_blocks(format: WeightFormat, n: usize, k: usize, fields: &[usize]) -> Vec<u8> {
    let bb = format.block_bytes();
    let mut bytes: Vec<u8> = values(n * k / format.block_len() * bb, 5).iter().map(|v| (v.to_bits() >> 7) as u8).collect();
    for blk in bytes.chunks_exact_mut(bb) {
        for &at in fields {
            blk[at..at + 2].copy_from_slice(&half::f16::from_f32(0.01).to_bits().to_le_bytes());
        }
    }
    bytes
}

fn weights(format: WeightFormat, n: usize, k: usize) -> Vec<u8> {
    let quantize: fn(&[f32], &mut Vec<u8>) = match format {
        WeightFormat::Q4_0 => quantize_row_q4_0,
        WeightFormat::Q4_1 => quantize_row_q4_1,
        WeightFormat::Q8_0 => quantize_row_q8_0,
        WeightFormat::Q5_0 => blocks::quantize_row_q5_0,
        WeightFormat::Q5_1 => blocks::quantize_row_q5_1,
        WeightFormat::Q4_K => blocks::quantize_row_q4_k,
        WeightFormat::Q5_K => blocks::quantize_row_q5_k,
        WeightFormat::Q6_K => blocks::quantize_row_q6_k,
        WeightFormat::Q2_K => return random_blocks(format, n, k, &[80, 82]),
        WeightFormat::Q3_K => return random_blocks(format, n, k, &[108]),
        WeightFormat::IQ4_NL => return random_blocks(format, n, k, &[0]),
        other => panic!("{other:?} has no kernel to time"),
    };
    let mut out = Vec::new();
    for row in values(n * k, 9).chunks(k) {
        quantize(row, &mut out);
    }
    out
}

/// Calls that fill about 30 ms.
fn calibrate(f: &mut dyn FnMut()) -> u32 {
    f();
    let start = Instant::now();
    let mut calls = 0u32;
    while start.elapsed() < Duration::from_millis(30) {
        f();
        calls += 1;
    }
    calls
}

/// Nanoseconds this thread has spent on a CPU (Linux), else `None`.
fn thread_cpu_ns() -> Option<u64> {
    std::fs::read_to_string("/proc/thread-self/schedstat").ok()?.split_whitespace().next()?.parse().ok()
}

/// A clock: wall time, or this thread's on-CPU time.
#[derive(Clone, Copy)]
enum Clock {
    Wall,
    ThreadCpu,
}

impl Clock {
    fn now(self, start: Instant) -> f64 {
        match self {
            Clock::Wall => start.elapsed().as_secs_f64(),
            Clock::ThreadCpu => thread_cpu_ns().unwrap_or(0) as f64 * 1e-9,
        }
    }
}

/// Seconds per call of each case: rounds that run every case in turn, so
/// that load from other processes on a shared machine falls on all of
/// them alike; the best round counts.
fn time_interleaved(cases: &mut [Box<dyn FnMut() + '_>], rounds: usize, clock: Clock) -> Vec<f64> {
    let calls: Vec<u32> = cases.iter_mut().map(|f| calibrate(f.as_mut())).collect();
    let mut best = vec![f64::MAX; cases.len()];
    let origin = Instant::now();
    for _ in 0..rounds {
        for (i, f) in cases.iter_mut().enumerate() {
            let t = clock.now(origin);
            for _ in 0..calls[i] {
                f();
            }
            best[i] = best[i].min((clock.now(origin) - t) / calls[i] as f64);
        }
    }
    best
}

/// Seconds per call of `rows` rows of `x` by each matrix on `backend`.
#[allow(clippy::too_many_arguments)]
fn time_products(backend: &CpuBackend, formats: &[WeightFormat], files: &[Vec<u8>], n: usize, k: usize, rows: usize, rounds: usize, clock: Clock) -> Vec<f64> {
    let x = backend.upload(&values(rows * k, 3));
    let matrices: Vec<_> = formats.iter().zip(files).map(|(&f, b)| backend.matrix(f, n, k, b).expect("matrix")).collect();
    let mut outs: Vec<_> = matrices.iter().map(|_| backend.tensor(rows * n)).collect();
    let x = &x;
    let mut cases: Vec<Box<dyn FnMut() + '_>> = matrices
        .iter()
        .zip(outs.iter_mut())
        .map(|(m, out)| Box::new(move || backend.matmul(x, rows, &mut [(m, out)])) as Box<dyn FnMut()>)
        .collect();
    time_interleaved(&mut cases, rounds, clock)
}

fn main() {
    let threads = std::env::var("BATON_BENCH_THREADS").ok().and_then(|v| v.parse().ok()).unwrap_or(2);
    let rounds = std::env::var("BATON_BENCH_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(7);
    let backend = CpuBackend::new(threads).expect("threads");
    let single = CpuBackend::new(1).expect("a thread");
    let cpu_clock = thread_cpu_ns().is_some();
    println!("{}; on-CPU column: {}", backend.describe(), if cpu_clock { single.describe() } else { "unavailable".into() });
    let formats = WeightFormat::INTEGER_KERNEL;
    // (name, n outputs, k inputs): K formats need k a multiple of 256.
    let shapes = [("ffn_down 576x1536", 576, 1536), ("ffn_up 1536x576", 1536, 576), ("8B-sized 4096x4096", 4096, 4096)];
    println!(
        "{:<20} {:<7} {:>5} {:>5} {:>9} {:>8} {:>6} {:>13} {:>13}",
        "shape", "format", "bits", "rows", "us/call", "GFLOP/s", "GB/s", "1-thread CPU", "GFLOP/s/core"
    );
    for (name, n, k) in shapes {
        for rows in [1, 32] {
            let formats: Vec<WeightFormat> = formats.iter().copied().filter(|f| k % f.block_len() == 0).collect();
            let files: Vec<Vec<u8>> = formats.iter().map(|&f| weights(f, n, k)).collect();
            let wall = time_products(&backend, &formats, &files, n, k, rows, rounds, Clock::Wall);
            let cpu = if cpu_clock { time_products(&single, &formats, &files, n, k, rows, rounds, Clock::ThreadCpu) } else { vec![f64::NAN; formats.len()] };
            for (i, format) in formats.iter().enumerate() {
                let bits = format.block_bytes() as f64 * 8.0 / format.block_len() as f64;
                let flop = 2.0 * (n * k * rows) as f64;
                println!(
                    "{name:<20} {:<7} {bits:>5.2} {rows:>5} {:>9.1} {:>8.1} {:>6.2} {:>10.1} us {:>13.1}",
                    format.name(),
                    wall[i] * 1e6,
                    flop / wall[i] / 1e9,
                    files[i].len() as f64 / wall[i] / 1e9,
                    cpu[i] * 1e6,
                    flop / cpu[i] / 1e9
                );
            }
        }
    }
}
