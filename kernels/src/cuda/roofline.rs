//! What each kernel's design counts on, and what that lets one expect of it,
//! worked out without a GPU:
//!
//! - [`DESIGNS`]: per kernel, its launch at a reference shape (threads, dynamic
//!   shared memory, from the plans in `plan.rs`), the blocks per SM it counts
//!   on for sm_90 and sm_80, and the memory parallelism of its loads.
//!   `tests/cuda_sass.rs` checks the registers and shared memory ptxas gives
//!   every kernel against it, so a design that stops fitting fails CI.
//! - [`occupancy`]: blocks per SM from threads, registers and shared memory, as
//!   the hardware allocates them (checked against Nsight Compute's numbers).
//! - [`estimate`]: a kernel's roofline time (bytes over the measured copy
//!   bandwidth, FLOPs over the measured tensor-core throughput) and the time its
//!   design can be expected to take: the bandwidth its resident warps can draw
//!   (Little's law over the DRAM latency), the FLOP rate of the pipe it uses on
//!   the SMs it covers, and the idle SMs of a last partial wave. The GPU bench
//!   (`benches/gpu.rs`) prints the expected fraction of the roofline beside the
//!   measured one, so a miss says whether the design or its code falls short.

use crate::attention::AttnRow;

use super::plan::{self, AttentionPlan, AttnKernel, Geometry, ROW_THREADS, TOKEN_THREADS};

/// The resources of one GPU generation that bound occupancy (CUDA C
/// Programming Guide, "Compute Capabilities", table of technical specifications).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Gpu {
    pub arch: &'static str,
    pub sms: u32,
    /// 32-bit registers per SM, in four sub-partitions that each hold whole warps.
    pub regs_per_sm: u32,
    pub max_warps_per_sm: u32,
    pub max_blocks_per_sm: u32,
    /// Shared memory per SM at the largest carveout, and the most one block may
    /// use (beyond 48 KiB only after `cuFuncSetAttribute` opts in).
    pub smem_per_sm: u32,
    pub smem_per_block: u32,
    /// Shared memory the driver keeps per resident block (Nsight's "Driver Shared Memory Per Block").
    pub smem_reserved_per_block: u32,
    /// Boost clock: with 128 FP32 lanes an SM, the CUDA cores' peak.
    pub clock_hz: f64,
}

/// H100 SXM and H200 (132 SMs).
pub const SM90: Gpu = Gpu {
    arch: "sm_90",
    sms: 132,
    regs_per_sm: 65_536,
    max_warps_per_sm: 64,
    max_blocks_per_sm: 32,
    smem_per_sm: 228 * 1024,
    smem_per_block: 227 * 1024,
    smem_reserved_per_block: 1024,
    clock_hz: 1.98e9,
};

/// A100 (108 SMs).
pub const SM80: Gpu = Gpu {
    arch: "sm_80",
    sms: 108,
    regs_per_sm: 65_536,
    max_warps_per_sm: 64,
    max_blocks_per_sm: 32,
    smem_per_sm: 164 * 1024,
    smem_per_block: 163 * 1024,
    smem_reserved_per_block: 1024,
    clock_hz: 1.41e9,
};

/// The generation an architecture name ("sm_90") stands for; None for the ones not described.
pub fn gpu_for(arch: &str) -> Option<Gpu> {
    [SM90, SM80].into_iter().find(|g| g.arch == arch)
}

/// Shared memory a block may use without opting in.
pub const DEFAULT_SMEM_PER_BLOCK: u32 = 48 * 1024;

/// What bounds a kernel's blocks per SM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Limiter {
    Blocks,
    Warps,
    Registers,
    SharedMemory,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Occupancy {
    pub blocks_per_sm: u32,
    pub limiter: Limiter,
}

impl Occupancy {
    /// Resident warps over the SM's maximum.
    pub fn fraction(&self, gpu: &Gpu, threads: u32) -> f64 {
        (self.blocks_per_sm * threads.div_ceil(32)) as f64 / gpu.max_warps_per_sm as f64
    }
}

/// Blocks of `threads` threads, `regs` registers a thread and `smem` bytes of
/// shared memory (static + dynamic) that one SM holds at once; an error when
/// such a block cannot launch at all.
pub fn occupancy(gpu: &Gpu, threads: u32, regs: u32, smem: u32) -> Result<Occupancy, String> {
    if threads == 0 || threads > 1024 {
        return Err(format!("{threads} threads per block (1 to 1024)"));
    }
    if regs > 255 {
        return Err(format!("{regs} registers per thread (255 at most)"));
    }
    if smem > gpu.smem_per_block {
        return Err(format!("{smem} bytes of shared memory per block ({} at most on {})", gpu.smem_per_block, gpu.arch));
    }
    let warps = threads.div_ceil(32);
    // Registers go to warps in units of 256, and a warp's registers lie in one of
    // the four sub-partitions, so each sub-partition holds a whole number of warps.
    let regs_per_warp = (regs.max(1) * 32).next_multiple_of(256);
    let warps_by_regs = 4 * ((gpu.regs_per_sm / 4) / regs_per_warp);
    let by_smem = if smem == 0 { u32::MAX } else { gpu.smem_per_sm / (smem + gpu.smem_reserved_per_block) };
    let limits = [
        (gpu.max_blocks_per_sm, Limiter::Blocks),
        (gpu.max_warps_per_sm / warps, Limiter::Warps),
        (warps_by_regs / warps, Limiter::Registers),
        (by_smem, Limiter::SharedMemory),
    ];
    let (blocks_per_sm, limiter) = limits.into_iter().min_by_key(|&(b, _)| b).unwrap();
    Ok(Occupancy { blocks_per_sm, limiter })
}

/// A kernel's design, as far as occupancy and memory parallelism go.
#[derive(Clone, Copy, Debug)]
pub struct Design {
    /// The kernel's name, or a prefix ending in `_` for its per-dtype variants
    /// (the longest matching row applies).
    pub kernel: &'static str,
    /// Its launch at the reference shape ([`reference_decode`], [`reference_prefill`]).
    pub launch: fn() -> Geometry,
    /// Blocks per SM the design counts on, on sm_90 and on sm_80.
    pub blocks_per_sm: (u32, u32),
    /// Bytes a warp has asked memory for and not yet received at a time:
    /// lanes x bytes per load x independent loads in flight (32 x 2 for one
    /// scalar bf16 load per lane; 32 x 16 x stages for 16-byte `cp.async` stages).
    pub bytes_in_flight_per_warp: u32,
    /// Useful FLOPs over the peak of the pipe the kernel computes on, where it
    /// is compute-bound (the rest goes to shuffles, exponentials, index math).
    pub flop_efficiency: f64,
    /// Whether its FLOPs run on the tensor cores (else the FP32 pipe).
    pub tensor_cores: bool,
    /// Whether its launch opts in to more than 48 KiB of shared memory a block
    /// (`cuFuncSetAttribute`); without it such a launch fails.
    pub smem_opt_in: bool,
}

/// Query heads, KV heads and head size of the reference shape (Llama-3-8B).
pub const REFERENCE_HEADS: (usize, usize, usize) = (32, 8, 128);
/// Context of the reference decode row, and tokens of the reference prefill chunk.
pub const REFERENCE_CONTEXT: usize = 3000;
pub const REFERENCE_PROMPT: usize = 2048;
const BLOCK_TOKENS: usize = 16;

/// The plan of one decode row at [`REFERENCE_CONTEXT`] (Llama-3-8B heads), on
/// the tensor-core kernel or the CUDA-core ones.
pub fn reference_decode(tensor_cores: bool) -> AttentionPlan {
    let table: Vec<u32> = (0..(REFERENCE_CONTEXT / BLOCK_TOKENS + 1) as u32).collect();
    let (h, kv, d) = REFERENCE_HEADS;
    AttentionPlan::for_gpu(&[AttnRow { block_table: &table, pos: REFERENCE_CONTEXT }], BLOCK_TOKENS, d, h, kv, tensor_cores)
}

/// The plan of a [`REFERENCE_PROMPT`]-token prefill chunk (Llama-3-8B heads).
pub fn reference_prefill(tensor_cores: bool) -> AttentionPlan {
    let table: Vec<u32> = (0..(REFERENCE_PROMPT / BLOCK_TOKENS) as u32).collect();
    let rows: Vec<AttnRow> = (0..REFERENCE_PROMPT).map(|pos| AttnRow { block_table: &table, pos }).collect();
    let (h, kv, d) = REFERENCE_HEADS;
    AttentionPlan::for_gpu(&rows, BLOCK_TOKENS, d, h, kv, tensor_cores)
}

/// Scalar loads, one per lane in flight: the element-wise and row kernels.
const SCALAR_F32: u32 = 32 * 4;
const SCALAR_BF16: u32 = 32 * 2;

const fn row(kernel: &'static str, launch: fn() -> Geometry, blocks_per_sm: (u32, u32), bytes_in_flight_per_warp: u32) -> Design {
    Design { kernel, launch, blocks_per_sm, bytes_in_flight_per_warp, flop_efficiency: 1.0, tensor_cores: false, smem_opt_in: false }
}

/// Every kernel's design. A kernel without a row fails `tests/cuda_sass.rs`:
/// add the occupancy its design counts on with it.
pub const DESIGNS: &[Design] = &[
    row("rmsnorm", || plan::per_row(1, ROW_THREADS), (8, 8), SCALAR_F32),
    row("rope", || plan::per_row(1, TOKEN_THREADS), (16, 16), SCALAR_F32),
    row("silu_mul", || plan::elementwise(1 << 20), (8, 8), SCALAR_F32),
    row("add_inplace", || plan::elementwise(1 << 20), (8, 8), SCALAR_F32),
    row("gelu_mul", || plan::elementwise(1 << 20), (8, 8), SCALAR_F32),
    row("add_rows", || plan::elementwise(1 << 20), (8, 8), SCALAR_F32),
    row("scale_inplace", || plan::elementwise(1 << 20), (8, 8), SCALAR_F32),
    row("to_bf16", || plan::elementwise(1 << 20), (8, 8), SCALAR_F32),
    row("gather_rows", || plan::per_row(1, ROW_THREADS), (8, 8), SCALAR_F32),
    row("embed_bf16", || plan::per_row(1, ROW_THREADS), (8, 8), SCALAR_BF16),
    row("fill_uniform_bf16", || plan::elementwise(1 << 20), (8, 8), SCALAR_BF16),
    row("kv_write_", || plan::per_row(1, TOKEN_THREADS), (16, 16), SCALAR_F32),
    row("kv_pack", || plan::kv_copy(1 << 16, 1), (8, 8), SCALAR_F32),
    row("kv_unpack", || plan::kv_copy(1 << 16, 1), (8, 8), SCALAR_F32),
    // The same copy from sources anywhere on the device (GPUDirect RDMA rings).
    row("kv_unpack_from", || plan::kv_copy(1 << 16, 1), (8, 8), SCALAR_F32),
    // A frame's CRC-32 (crc.cu): 8 KiB of tables and sums in shared memory a block;
    // one 4-byte load per lane in flight, each lane on its own chunk.
    row("crc32_chunks", || plan::crc32(1 << 20).chunks, (8, 8), SCALAR_F32),
    row("crc32_finish", || plan::crc32(1 << 20).finish, (8, 8), SCALAR_F32),
    row("argmax_rows", || plan::per_row(1, ROW_THREADS), (8, 8), SCALAR_F32),
    row("softmax_rows", || plan::per_row(1, ROW_THREADS), (8, 8), SCALAR_F32),
    // The fused glue (fused.cu): the launches of the kernels they replace
    // (rmsnorm, silu_mul / gelu_mul, rope and kv_write), and the same occupancy
    // (ptxas 12.8: 18-24 registers; rope_kv_write_* 32, just inside 16 blocks).
    row("rmsnorm_bf16", || plan::per_row(1, ROW_THREADS), (8, 8), SCALAR_F32),
    row("add_rmsnorm_bf16", || plan::per_row(1, ROW_THREADS), (8, 8), SCALAR_F32),
    row("norm_add_rmsnorm_bf16", || plan::per_row(1, ROW_THREADS), (8, 8), SCALAR_F32),
    row("silu_mul_bf16", || plan::elementwise(1 << 20), (8, 8), SCALAR_F32),
    row("gelu_mul_bf16", || plan::elementwise(1 << 20), (8, 8), SCALAR_F32),
    row("rope_kv_write_", || plan::per_row(1, TOKEN_THREADS), (16, 16), SCALAR_F32),
    // QK-norm's per-head norms in the same launch (a warp per head), before the
    // rotation: ptxas 12.8 gives 40 registers, so 12 blocks; a block per token
    // (a decode step has a few) is far from filling an SM either way.
    row("qk_norm_rope_kv_write_", || plan::per_row(1, TOKEN_THREADS), (12, 12), SCALAR_F32),
    // Decode: a warp per (key, head) dot product, one scalar KV load per lane at
    // a time. Registers allow 9 blocks (Nsight: 52 registers, 56% occupancy).
    row("attn_partial_", || reference_decode(false).partial, (9, 9), SCALAR_BF16),
    // Prefill on CUDA cores: 41 KiB of shared memory a block allows 5 (Nsight:
    // 31% occupancy). Its useful FLOP rate is the Nsight run's: 1.9 TFLOP/s of
    // the H200's 67 FP32 TFLOP/s (warp shuffles and exponentials between FMAs).
    Design {
        kernel: "attn_partial_tiled_",
        launch: || reference_prefill(false).partial,
        blocks_per_sm: (5, 3),
        bytes_in_flight_per_warp: SCALAR_BF16,
        flop_efficiency: 0.03,
        tensor_cores: false,
        smem_opt_in: false,
    },
    row("attn_combine", || reference_decode(false).combine, (16, 16), SCALAR_F32),
    // The same combine writing the output projection's bf16 input (attention_matmul).
    row("attn_combine_bf16", || reference_decode(false).combine, (16, 16), SCALAR_F32),
    // Tensor cores (sm_80 on), decode and prefill alike: 212 registers a thread at
    // head size 128 (ptxas 12.8, sm_90) and 68 KiB of shared memory (two 64-key
    // buffers of keys and values, opted in) allow 2 blocks; smaller heads allow
    // more. Each lane keeps a tile's 16 cp.async copies of 16 bytes in flight. Its
    // FLOP efficiency is a guess until a GPU run measures it: mma.sync reaches
    // about half of Hopper's wgmma peak, less the online softmax between products.
    Design {
        kernel: "attn_mma_",
        launch: || reference_prefill(true).partial,
        blocks_per_sm: (2, 2),
        bytes_in_flight_per_warp: 32 * 16 * 16,
        flop_efficiency: 0.35,
        tensor_cores: true,
        smem_opt_in: true,
    },
];

/// The design row for `kernel`: an exact name, else the longest matching prefix.
pub fn design(kernel: &str) -> Option<&'static Design> {
    DESIGNS.iter().filter(|d| d.kernel == kernel || (d.kernel.ends_with('_') && kernel.starts_with(d.kernel))).max_by_key(|d| d.kernel.len())
}

impl Design {
    /// Blocks per SM counted on for `gpu`.
    pub fn blocks_on(&self, gpu: &Gpu) -> u32 {
        if gpu.arch == SM80.arch {
            self.blocks_per_sm.1
        } else {
            self.blocks_per_sm.0
        }
    }
}

/// What the machine measured in the same run can do (or a data sheet, in tests).
#[derive(Clone, Copy, Debug)]
pub struct Peaks {
    /// Device copy bandwidth, bytes/s.
    pub bandwidth: f64,
    /// bf16 tensor-core FLOP/s (one large cuBLAS GEMM).
    pub tensor_flops: f64,
    /// FP32 FMA FLOP/s on CUDA cores (SMs x 128 lanes x 2 x clock).
    pub fp32_flops: f64,
    /// DRAM latency under load, seconds: with Little's law, how many bytes must be
    /// in flight to reach `bandwidth`.
    pub dram_latency: f64,
}

impl Peaks {
    /// Peaks from the copy bandwidth (GB/s) and bf16 GEMM rate (TFLOP/s) measured
    /// on `gpu`, its FP32 peak from its clock, and [`DRAM_LATENCY_S`].
    pub fn measured(gpu: &Gpu, copy_gb_s: f64, gemm_tflop_s: f64) -> Peaks {
        Peaks { bandwidth: copy_gb_s * 1e9, tensor_flops: gemm_tflop_s * 1e12, fp32_flops: gpu.sms as f64 * 128.0 * 2.0 * gpu.clock_hz, dram_latency: DRAM_LATENCY_S }
    }
}

/// HBM3 latency under load on H100/H200 (microbenchmarks give 480-700 ns; with
/// 600 the batch-1 decode kernel's Nsight run, 384 warps each with 64 bytes in
/// flight, comes out at 41 GB/s against 37.6 measured).
pub const DRAM_LATENCY_S: f64 = 600e-9;

/// One launch: its geometry, the work it does, and its design.
#[derive(Clone, Copy, Debug)]
pub struct Launch {
    pub blocks: u64,
    pub threads: u32,
    /// Bytes read and written in device memory.
    pub bytes: f64,
    pub flops: f64,
    pub design: &'static Design,
}

impl Launch {
    pub fn new(g: Geometry, bytes: f64, flops: f64, design: &'static Design) -> Launch {
        Launch { blocks: g.grid.0 as u64 * g.grid.1 as u64 * g.grid.2 as u64, threads: g.block, bytes, flops, design }
    }
}

/// A launch's roofline and expected times.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Estimate {
    /// max(bytes / bandwidth, FLOPs / tensor-core peak): the GPU at its best.
    pub roofline_s: f64,
    /// What the design allows (see [`estimate`]).
    pub expected_s: f64,
    /// Blocks over the blocks the GPU holds at once.
    pub waves: f64,
    /// Whether memory (else compute) bounds the expected time.
    pub memory_bound: bool,
}

impl Estimate {
    pub fn fraction(&self) -> f64 {
        self.roofline_s / self.expected_s
    }

    /// Launches run one after another: their times add.
    pub fn then(self, next: Estimate) -> Estimate {
        Estimate {
            roofline_s: self.roofline_s + next.roofline_s,
            expected_s: self.expected_s + next.expected_s,
            waves: self.waves.max(next.waves),
            memory_bound: if self.expected_s >= next.expected_s { self.memory_bound } else { next.memory_bound },
        }
    }
}

/// The expected time of a launch on `gpu`:
/// - resident blocks = min(blocks, SMs x the design's blocks per SM);
/// - bandwidth it can draw = min(peak, resident warps x bytes in flight per warp / DRAM latency);
/// - FLOP rate = the pipe's peak x covered SMs / SMs x the design's FLOP efficiency;
/// - a last partial wave leaves SMs idle: both times scale by ceil(waves) / waves.
pub fn estimate(gpu: &Gpu, peaks: &Peaks, l: &Launch) -> Estimate {
    let slots = gpu.sms as u64 * l.design.blocks_on(gpu).max(1) as u64;
    let resident = l.blocks.min(slots) as f64;
    let waves = l.blocks as f64 / slots as f64;
    let tail = if waves > 1.0 { waves.ceil() / waves } else { 1.0 };
    let warps = resident * l.threads.div_ceil(32) as f64;
    let in_flight = warps * l.design.bytes_in_flight_per_warp as f64;
    let bandwidth = peaks.bandwidth.min(in_flight / peaks.dram_latency);
    let covered = (l.blocks as f64 / gpu.sms as f64).min(1.0);
    let pipe = if l.design.tensor_cores { peaks.tensor_flops } else { peaks.fp32_flops };
    let flop_rate = pipe * covered * l.design.flop_efficiency;
    let memory = l.bytes / bandwidth * tail;
    let compute = if l.flops > 0.0 { l.flops / flop_rate * tail } else { 0.0 };
    Estimate {
        roofline_s: (l.bytes / peaks.bandwidth).max(l.flops / peaks.tensor_flops),
        expected_s: memory.max(compute),
        waves,
        memory_bound: memory >= compute,
    }
}

/// The shape of an attention call the model prices.
#[derive(Clone, Copy, Debug)]
pub struct AttentionShape {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Bytes of one key or value element in the arena.
    pub kv_bytes: usize,
}

/// The launches of one attention call over rows at `positions` (each attends to
/// keys 0..=pos), planned by `p` (the plan the backend launches from), named by
/// `dtype` ("bf16"): the partial kernel, then the combine.
pub fn attention_launches(p: &AttentionPlan, s: &AttentionShape, dtype: &str) -> Vec<Launch> {
    let rows = p.positions.len() as f64;
    let keys: f64 = p.positions.iter().map(|&pos| pos as f64 + 1.0).sum();
    let (hd, h) = (s.head_dim as f64, s.heads as f64);
    // KV from DRAM: each sequence's keys and values once per KV head. Rows on one
    // table (a prefill chunk) share them, and the blocks that read them again
    // (one per query head and run of rows) find them in L2: a layer's KV of a
    // 2,048-token chunk is 8 MiB at Llama-3-8B's shape, against 50 MiB of L2.
    let mut longest = std::collections::HashMap::new();
    for (&off, &pos) in p.offsets.iter().zip(&p.positions) {
        let keys = longest.entry(off).or_insert(0u32);
        *keys = (*keys).max(pos + 1);
    }
    let kv_reads = longest.values().map(|&k| k as f64).sum::<f64>() * s.kv_heads as f64;
    let kv_bytes = kv_reads * 2.0 * hd * s.kv_bytes as f64;
    let q_bytes = rows * h * hd * 4.0;
    // Partial outputs: head_dim sums plus (max, sum) per (row, head, partition) used.
    let parts_used: f64 = p.positions.iter().map(|&pos| (pos as usize / plan::ATTN_PART + 1) as f64).sum::<f64>() * h;
    let partial_out = parts_used * (hd + 2.0) * 4.0;
    let flops = 4.0 * h * hd * keys; // QK and PV, a multiply and an add each
    let partial_kernel = match p.kernel {
        AttnKernel::Mma => format!("attn_mma_{dtype}_d{}", s.head_dim),
        AttnKernel::Tiled => format!("attn_partial_tiled_{dtype}"),
        AttnKernel::Rows => format!("attn_partial_{dtype}"),
    };
    let missing = |k: &str| panic!("no design row for {k}");
    let partial_design = design(&partial_kernel).unwrap_or_else(|| missing(&partial_kernel));
    let combine_design = design("attn_combine").unwrap_or_else(|| missing("attn_combine"));
    vec![
        Launch::new(p.partial, kv_bytes + q_bytes + partial_out, flops, partial_design),
        Launch::new(p.combine, partial_out + rows * h * hd * 4.0, 0.0, combine_design),
    ]
}

/// The expected time of `launches` in order, summed.
pub fn estimate_all(gpu: &Gpu, peaks: &Peaks, launches: &[Launch]) -> Estimate {
    launches.iter().map(|l| estimate(gpu, peaks, l)).reduce(Estimate::then).unwrap_or(Estimate {
        roofline_s: 0.0,
        expected_s: 0.0,
        waves: 0.0,
        memory_bound: true,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An H200 as the 2026-12-04 run measured it (4,277 GB/s copy, 777 TFLOP/s
    /// bf16 GEMM, 1.98 GHz).
    fn h200() -> Peaks {
        Peaks::measured(&SM90, 4277.0, 777.0)
    }

    #[test]
    fn occupancy_matches_nsight_computes_block_limits() {
        // attn_partial_bf16 on the H200: 52 registers, 6.27 KB dynamic shared memory:
        // Nsight's block limits were registers 9, warps 16, SM 32.
        let o = occupancy(&SM90, 128, 52, 6272).unwrap();
        assert_eq!(o, Occupancy { blocks_per_sm: 9, limiter: Limiter::Registers });
        assert_eq!(o.fraction(&SM90, 128), 0.5625, "Nsight: theoretical occupancy 56.25%");
        // attn_partial_tiled_bf16: 64 registers (limit 8), 41.09 KB (limit 5): 31.25%.
        let o = occupancy(&SM90, 128, 64, 41_088).unwrap();
        assert_eq!(o, Occupancy { blocks_per_sm: 5, limiter: Limiter::SharedMemory });
        assert_eq!(o.fraction(&SM90, 128), 0.3125);
        assert_eq!(occupancy(&SM90, 128, 64, 0).unwrap().blocks_per_sm, 8);
        // attn_combine: 32 registers, no shared memory: warps limit it to 16.
        assert_eq!(occupancy(&SM90, 128, 32, 0).unwrap(), Occupancy { blocks_per_sm: 16, limiter: Limiter::Warps });
        // Registers go per warp in units of 256 and per sub-partition: 72 a thread
        // is 2,304 a warp, 7 warps in each 16,384 (not 28.4 of the SM's 65,536).
        assert_eq!(occupancy(&SM90, 32, 72, 0).unwrap().blocks_per_sm, 28);
        assert_eq!(occupancy(&SM90, 256, 255, 0).unwrap(), Occupancy { blocks_per_sm: 1, limiter: Limiter::Registers });
        // Tiny blocks: the SM's 32-block limit.
        assert_eq!(occupancy(&SM80, 32, 16, 0).unwrap(), Occupancy { blocks_per_sm: 32, limiter: Limiter::Blocks });
        // A100 has less shared memory: 100 KiB blocks fit once, not twice as on H100.
        assert_eq!(occupancy(&SM80, 128, 32, 100 * 1024).unwrap().blocks_per_sm, 1);
        assert_eq!(occupancy(&SM90, 128, 32, 100 * 1024).unwrap().blocks_per_sm, 2);
        assert!(occupancy(&SM80, 128, 32, 200 * 1024).unwrap_err().contains("sm_80"));
        assert!(occupancy(&SM90, 2048, 32, 0).is_err());
        assert!(occupancy(&SM90, 128, 256, 0).is_err());
    }

    #[test]
    fn every_kernel_name_finds_its_own_design_row() {
        assert_eq!(design("attn_partial_tiled_bf16").unwrap().kernel, "attn_partial_tiled_");
        assert_eq!(design("attn_partial_e4m3").unwrap().kernel, "attn_partial_");
        assert_eq!(design("kv_write_f16").unwrap().kernel, "kv_write_");
        assert_eq!(design("rmsnorm").unwrap().kernel, "rmsnorm");
        assert!(design("rmsnorm_fused").is_none(), "an exact name is not a prefix");
        assert_eq!(design("attn_mma_bf16_d128").unwrap().kernel, "attn_mma_");
        assert!(design("attn_mmb_bf16").is_none());
        for d in DESIGNS {
            let g = (d.launch)();
            for gpu in [SM90, SM80] {
                let o = occupancy(&gpu, g.block, 32, g.shared_bytes).unwrap();
                assert!(d.blocks_on(&gpu) >= 1 && d.blocks_on(&gpu) <= gpu.max_blocks_per_sm, "{}", d.kernel);
                assert!(o.blocks_per_sm >= 1, "{} cannot launch on {}", d.kernel, gpu.arch);
            }
        }
    }

    #[test]
    fn decode_attention_at_batch_one_is_bound_by_its_loads_in_flight() {
        // Batch 1, Llama-3-8B, 3,000-token context: 96 blocks of 4 warps, each with
        // one 64-byte warp load in flight, draw 384 x 64 B / 600 ns = 41 GB/s
        // (Nsight measured 37.6; the bench 36 over the whole call).
        let p = reference_decode(false);
        assert_eq!(p.partial.grid, (1, 8, 12));
        let s = AttentionShape { heads: 32, kv_heads: 8, head_dim: 128, kv_bytes: 2 };
        let launches = attention_launches(&p, &s, "bf16");
        assert_eq!(launches.len(), 2);
        let kv = 3001.0 * 8.0 * 2.0 * 128.0 * 2.0;
        assert!(launches[0].bytes > kv && launches[0].bytes < kv * 1.05, "{}", launches[0].bytes);
        assert_eq!(launches[0].flops, 4.0 * 32.0 * 128.0 * 3001.0);
        let e = estimate(&SM90, &h200(), &launches[0]);
        assert!(e.memory_bound);
        let gbs = launches[0].bytes / e.expected_s / 1e9;
        assert!((40.0..42.0).contains(&gbs), "{gbs} GB/s");
        assert!(e.fraction() < 0.01, "1% of the roofline at best: {}", e.fraction());
        assert!(e.waves < 0.1);
    }

    #[test]
    fn wide_loads_and_enough_blocks_reach_the_bandwidth() {
        // The same call at batch 64: 6,144 blocks, 5.2 waves of 1,188.
        let table: Vec<u32> = (0..64 * 190).collect();
        let rows: Vec<AttnRow> = (0..64).map(|r| AttnRow { block_table: &table[r * 190..(r + 1) * 190], pos: 3000 }).collect();
        let p = AttentionPlan::new(&rows, 16, 128, 32, 8);
        let s = AttentionShape { heads: 32, kv_heads: 8, head_dim: 128, kv_bytes: 2 };
        let l = attention_launches(&p, &s, "bf16")[0];
        let scalar = estimate(&SM90, &h200(), &l);
        assert!((scalar.waves - 6144.0 / 1188.0).abs() < 1e-9);
        // 1,188 blocks x 4 warps x 64 B in flight: 507 GB/s, less the idle SMs of
        // the sixth wave (5.17 waves run as 6): 437 GB/s (the bench measured 356).
        let gbs = l.bytes / scalar.expected_s / 1e9;
        assert!((420.0..450.0).contains(&gbs), "{gbs}");
        // A design with four 16-byte loads a lane in flight reaches the copy bandwidth
        // but for the partial last wave.
        static WIDE: Design = Design {
            kernel: "wide_",
            launch: || reference_decode(false).partial,
            blocks_per_sm: (9, 9),
            bytes_in_flight_per_warp: 32 * 16 * 4,
            flop_efficiency: 1.0,
            tensor_cores: false,
            smem_opt_in: false,
        };
        let wide = estimate(&SM90, &h200(), &Launch { design: &WIDE, ..l });
        assert!((wide.fraction() - 6144.0 / 1188.0 / 6.0).abs() < 0.01, "{}", wide.fraction());
        assert!(wide.expected_s < scalar.expected_s / 4.0);
    }

    #[test]
    fn prefill_on_cuda_cores_is_compute_bound_and_tensor_cores_lift_it() {
        let p = reference_prefill(false);
        assert_eq!(p.kernel, AttnKernel::Tiled);
        let s = AttentionShape { heads: 32, kv_heads: 8, head_dim: 128, kv_bytes: 2 };
        let l = attention_launches(&p, &s, "bf16")[0];
        let causal_pairs = 2048.0 * 2049.0 / 2.0;
        assert_eq!(l.flops, 4.0 * 32.0 * 128.0 * causal_pairs);
        let e = estimate(&SM90, &h200(), &l);
        assert!(!e.memory_bound);
        // 34.4 GFLOP at 3% of 67 FP32 TFLOP/s: 17 ms (Nsight: 17.9 ms a layer).
        assert!((16e-3..18e-3).contains(&e.expected_s), "{}", e.expected_s);
        // A tensor-core design at 50% of the GEMM peak: 200x the FLOP rate. Its
        // roofline is then the bytes' (the partial sums written and combined,
        // 190 MB, just over the FLOPs' 44 us), so it comes out at 51% of it.
        static MMA: Design = Design {
            kernel: "mma_",
            launch: || reference_prefill(false).partial,
            blocks_per_sm: (5, 3),
            bytes_in_flight_per_warp: 32 * 16 * 4,
            flop_efficiency: 0.5,
            tensor_cores: true,
            smem_opt_in: false,
        };
        let mma = estimate(&SM90, &h200(), &Launch { design: &MMA, ..l });
        assert!((0.5..0.52).contains(&mma.fraction()), "{}", mma.fraction());
        assert!(!mma.memory_bound && mma.expected_s < e.expected_s / 150.0);
    }

    #[test]
    fn the_tensor_core_plan_reads_kv_at_the_bandwidth_from_batch_64() {
        // Decode at batch 64, Llama-3-8B, 3,000-token contexts, on attn_mma_: the same
        // 6,144 blocks as the CUDA-core kernel, each with a tile's 16 KiB of copies per
        // warp in flight: 2 blocks on each of 132 SMs keep 8.6 MB in flight, over the
        // 2.6 MB Little's law asks at 4.3 TB/s and 600 ns. Memory-bound at the copy
        // bandwidth but for the partial last of 23.3 waves.
        let table: Vec<u32> = (0..64 * 190).collect();
        let rows: Vec<AttnRow> = (0..64).map(|r| AttnRow { block_table: &table[r * 190..(r + 1) * 190], pos: 3000 }).collect();
        let p = AttentionPlan::for_gpu(&rows, 16, 128, 32, 8, true);
        assert_eq!((p.kernel, p.partial.grid), (AttnKernel::Mma, (64, 8, 12)));
        let s = AttentionShape { heads: 32, kv_heads: 8, head_dim: 128, kv_bytes: 2 };
        let l = attention_launches(&p, &s, "bf16")[0];
        assert_eq!(l.design.kernel, "attn_mma_");
        let e = estimate(&SM90, &h200(), &l);
        assert!(e.memory_bound && (e.waves - 6144.0 / 264.0).abs() < 1e-9);
        assert!((0.9..1.0).contains(&e.fraction()), "{}", e.fraction());
        // The prefill chunk on the tensor cores: compute-bound, far below the CUDA cores' 17 ms.
        let pre = attention_launches(&reference_prefill(true), &s, "bf16")[0];
        let e = estimate(&SM90, &h200(), &pre);
        assert!(!e.memory_bound && e.expected_s < 0.5e-3, "{}", e.expected_s);
    }

    #[test]
    fn a_last_partial_wave_costs_a_whole_wave() {
        let d = design("rmsnorm").unwrap();
        let slots = SM90.sms as u64 * d.blocks_on(&SM90) as u64;
        let peaks = h200();
        let at = |blocks: u64| estimate(&SM90, &peaks, &Launch { blocks, threads: 256, bytes: blocks as f64 * 1e6, flops: 0.0, design: d });
        let full = at(slots);
        let over = at(slots + 1);
        assert!((full.waves - 1.0).abs() < 1e-12);
        // One block more: two waves' time for 1 + 1/slots waves' bytes.
        let ratio = over.expected_s / full.expected_s;
        assert!((ratio - 2.0).abs() < 1e-9, "{ratio}");
        let sum = full.then(over);
        assert_eq!(sum.expected_s, full.expected_s + over.expected_s);
        assert_eq!(estimate_all(&SM90, &peaks, &[]).expected_s, 0.0);
    }
}
