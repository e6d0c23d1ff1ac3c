//! How each kernel is launched, worked out on the host without touching a
//! GPU: grid and block sizes, dynamic shared memory, and for attention the
//! index arrays the kernels read. The CUDA backend launches from these, and
//! the CPU emulation tests (`tests/cuda_emulated.rs`) run the same kernels
//! from the same plans, so what they check is what the GPU runs.

use crate::attention::AttnRow;

/// Keys per attention partition; must equal `ATTN_PART` in attention.cu.
pub const ATTN_PART: usize = 256;
/// Threads of an attention partial block (`ATTN_THREADS` in attention.cu).
pub const ATTN_THREADS: u32 = 128;
/// Rows of one sequence per block of the tiled kernel, and keys it stages at a
/// time (`ATTN_TILE_ROWS`, `ATTN_KEY_CHUNK` in attention.cu).
pub const ATTN_TILE_ROWS: usize = 16;
pub const ATTN_KEY_CHUNK: usize = 32;
/// The tiled kernel's shared memory fits the default 48 KiB up to this head size.
pub const ATTN_TILED_MAX_HEAD_DIM: usize = 128;
/// Query heads of one KV head per block of `attn_partial` (`ATTN_GROUP` in attention.cu).
pub const ATTN_GROUP: usize = 8;
/// The tensor-core kernel (`attn_mma_*`, sm_80 on): keys per tile, query rows
/// ((row, head) pairs) per block and threads per block (`MMA_KEYS`, `MMA_ROWS`,
/// `MMA_THREADS` in attention.cu), and the head sizes it is built for.
pub const MMA_KEYS: usize = 64;
pub const MMA_ROWS: usize = 64;
pub const MMA_THREADS: u32 = 128;
pub const MMA_HEAD_DIMS: [usize; 3] = [32, 64, 128];
/// Threads per row of the row-wise kernels (`SAMPLING_THREADS` in sampling.cu for argmax;
/// `NORM_ROW_THREADS` in fused.cu, whose per-head norms sum as rmsnorm's block does).
pub const ROW_THREADS: u32 = 256;
/// Threads per token of rope and kv_write.
pub const TOKEN_THREADS: u32 = 128;

/// Grid, threads per block (one dimension) and dynamic shared memory of a launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    pub grid: (u32, u32, u32),
    pub block: u32,
    pub shared_bytes: u32,
}

/// A grid-stride launch over `n` elements (silu_mul, add_inplace, to_bf16, fill).
pub fn elementwise(n: usize) -> Geometry {
    let blocks = n.div_ceil(256).clamp(1, 65_535) as u32;
    Geometry { grid: (blocks, 1, 1), block: 256, shared_bytes: 0 }
}

/// One block of `threads` per row (rmsnorm, embed, gather, softmax, argmax, rope, kv_write).
pub fn per_row(rows: usize, threads: u32) -> Geometry {
    Geometry { grid: (rows as u32, 1, 1), block: threads, shared_bytes: 0 }
}

/// kv_pack / kv_unpack of `blocks` blocks, `span_bytes` each: grid y walks the blocks.
pub fn kv_copy(span_bytes: usize, blocks: usize) -> Geometry {
    let mut g = elementwise(span_bytes / 4);
    g.grid.0 = g.grid.0.min(1024);
    g.grid.1 = blocks as u32;
    g
}

/// Threads of a CRC-32 block (`CRC_THREADS` in crc.cu).
pub const CRC_THREADS: u32 = 256;
/// Most blocks of `crc32_chunks`: the length of its partials buffer.
pub const CRC_MAX_BLOCKS: usize = 1024;
/// Fewest bytes a thread of `crc32_chunks` takes: below this, shifting its CRC past the
/// chunks after it costs more than the bytes themselves.
pub const CRC_MIN_CHUNK: usize = 64;

/// The two launches of a CRC-32 over `len` bytes (crc.cu).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CrcPlan {
    /// `crc32_chunks`: a partial CRC per block into the partials buffer.
    pub chunks: Geometry,
    /// Bytes per thread: `chunks.grid.0 * CRC_THREADS * chunk >= len`.
    pub chunk: u64,
    /// `crc32_finish`: one block combining `chunks.grid.0` partials.
    pub finish: Geometry,
}

/// `len` bytes cut into chunks of at least [`CRC_MIN_CHUNK`] over at most
/// [`CRC_MAX_BLOCKS`] blocks (any `len` up to 2^58; frames are up to 64 MiB).
pub fn crc32(len: usize) -> CrcPlan {
    let threads = CRC_THREADS as usize;
    let chunk = len.div_ceil(threads * CRC_MAX_BLOCKS).max(CRC_MIN_CHUNK);
    let blocks = len.div_ceil(threads * chunk).max(1);
    CrcPlan { chunks: per_row(blocks, CRC_THREADS), chunk: chunk as u64, finish: per_row(1, CRC_THREADS) }
}

/// Which partial kernel an attention call launches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttnKernel {
    /// `attn_partial`: a block per (row, query heads of a KV head, partition), CUDA cores.
    Rows,
    /// `attn_partial_tiled`: runs of up to [`ATTN_TILE_ROWS`] rows of one table per block, CUDA cores.
    Tiled,
    /// `attn_mma_*`: runs of (row, head) pairs on the tensor cores, decode rows and prefill chunks alike.
    Mma,
}

/// Shared memory of an `attn_mma_*` block: two buffers of [`MMA_KEYS`] keys and
/// as many values, `head_dim + 8` 16-bit elements each (attention.cu).
pub fn mma_shared_bytes(head_dim: usize) -> u32 {
    (2 * 2 * MMA_KEYS * (head_dim + 8) * 2) as u32
}

/// Whether the tensor-core kernel serves this shape, given a GPU and KV type
/// that have it (`tensor_cores`: sm_80 or later, 16-bit or FP8 KV).
pub fn mma_serves(tensor_cores: bool, head_dim: usize, n_heads: usize, kv_heads: usize) -> bool {
    tensor_cores && MMA_HEAD_DIMS.contains(&head_dim) && kv_heads > 0 && n_heads / kv_heads <= MMA_ROWS
}

/// What one attention call uploads and launches.
#[derive(Debug)]
pub struct AttentionPlan {
    /// Each distinct block table once (a prefill chunk's rows share one).
    pub tables: Vec<u32>,
    /// Per row: where its table starts in `tables`, and its position.
    pub offsets: Vec<u32>,
    pub positions: Vec<u32>,
    /// Runs of consecutive rows on one table (at most [`ATTN_TILE_ROWS`] for the
    /// tiled kernel; for the tensor-core kernel as many as fill [`MMA_ROWS`] with
    /// their query heads of one KV head).
    pub run_start: Vec<u32>,
    pub run_len: Vec<u32>,
    /// Partitions of the longest row: the partial buffers hold rows x heads x this.
    pub max_parts: usize,
    pub kernel: AttnKernel,
    pub partial: Geometry,
    pub combine: Geometry,
}

impl AttentionPlan {
    /// The CUDA-core kernels' plan (f32 KV, GPUs before sm_80).
    pub fn new(rows: &[AttnRow], block_tokens: usize, head_dim: usize, n_heads: usize, kv_heads: usize) -> AttentionPlan {
        AttentionPlan::for_gpu(rows, block_tokens, head_dim, n_heads, kv_heads, false)
    }

    /// The plan on a GPU and KV type with (`tensor_cores`) or without tensor
    /// cores for attention: the tensor-core kernel wherever it serves the shape
    /// ([`mma_serves`]), for decode rows and prefill chunks alike, so a position
    /// gets the same bits from either. Panics if a row's block table is shorter
    /// than its position needs, or if `n_heads` is not a multiple of `kv_heads`.
    pub fn for_gpu(rows: &[AttnRow], block_tokens: usize, head_dim: usize, n_heads: usize, kv_heads: usize, tensor_cores: bool) -> AttentionPlan {
        assert!(kv_heads > 0 && n_heads.is_multiple_of(kv_heads), "attention: {n_heads} query heads over {kv_heads} KV heads");
        let group = n_heads / kv_heads;
        let mma = mma_serves(tensor_cores, head_dim, n_heads, kv_heads);
        let max_run = if mma { (MMA_ROWS / group).clamp(1, MMA_ROWS) } else { ATTN_TILE_ROWS };
        let (mut tables, mut offsets, mut positions) = (Vec::new(), Vec::with_capacity(rows.len()), Vec::with_capacity(rows.len()));
        let (mut run_start, mut run_len): (Vec<u32>, Vec<u32>) = (Vec::new(), Vec::new());
        let mut last: Option<(*const u32, usize)> = None;
        for (i, r) in rows.iter().enumerate() {
            let same_table = last.is_some_and(|(p, _)| std::ptr::eq(p, r.block_table.as_ptr()));
            match run_len.last_mut() {
                Some(n) if same_table && (*n as usize) < max_run => *n += 1,
                _ => {
                    run_start.push(i as u32);
                    run_len.push(1);
                }
            }
            let needed = r.pos / block_tokens + 1;
            assert!(r.block_table.len() >= needed, "attention: a row at position {} has {} blocks", r.pos, r.block_table.len());
            let start = match last {
                Some((p, start)) if std::ptr::eq(p, r.block_table.as_ptr()) => start,
                _ => {
                    let start = tables.len();
                    tables.extend_from_slice(r.block_table);
                    last = Some((r.block_table.as_ptr(), start));
                    start
                }
            };
            offsets.push(start as u32);
            positions.push(r.pos as u32);
        }
        let max_parts = rows.iter().map(|r| r.pos / ATTN_PART + 1).max().unwrap_or(1);
        let kernel = if mma {
            AttnKernel::Mma
        } else if run_start.len() < rows.len() && head_dim <= ATTN_TILED_MAX_HEAD_DIM {
            AttnKernel::Tiled
        } else {
            AttnKernel::Rows
        };
        let partial = if kernel == AttnKernel::Mma {
            Geometry { grid: (run_start.len() as u32, kv_heads as u32, max_parts as u32), block: MMA_THREADS, shared_bytes: mma_shared_bytes(head_dim) }
        } else if kernel == AttnKernel::Tiled {
            Geometry {
                grid: (run_start.len() as u32, n_heads as u32, max_parts as u32),
                block: ATTN_THREADS,
                shared_bytes: ((ATTN_TILE_ROWS * head_dim + ATTN_TILE_ROWS * ATTN_PART + ATTN_KEY_CHUNK * head_dim + 32) * 4) as u32,
            }
        } else {
            // A block per (row, up to ATTN_GROUP query heads of one KV head, partition).
            let per_block = group.min(ATTN_GROUP);
            Geometry {
                grid: (rows.len() as u32, (kv_heads * group.div_ceil(ATTN_GROUP)) as u32, max_parts as u32),
                block: ATTN_THREADS,
                shared_bytes: ((per_block * head_dim + per_block * ATTN_PART + 32) * 4) as u32,
            }
        };
        let combine = Geometry { grid: (rows.len() as u32, n_heads as u32, 1), block: head_dim.next_multiple_of(32).min(256) as u32, shared_bytes: 0 };
        AttentionPlan { tables, offsets, positions, run_start, run_len, max_parts, kernel, partial, combine }
    }

    /// Every index array the kernels read, end to end in one buffer (tables,
    /// offsets, positions, run starts, run lengths), and where each sits: one
    /// upload per call, and none when a call's rows repeat the previous call's,
    /// as every layer of a forward pass after the first does (the backend
    /// keeps the last buffer on the device). An upload from ordinary memory
    /// waits for the GPU's queue to drain, so this is what lets the host queue
    /// a step's layers ahead of the GPU.
    pub fn index_words(&self) -> (Vec<u32>, [std::ops::Range<usize>; 5]) {
        let parts = [&self.tables, &self.offsets, &self.positions, &self.run_start, &self.run_len];
        let mut words = Vec::with_capacity(parts.iter().map(|p| p.len()).sum());
        let ranges = parts.map(|p| {
            let start = words.len();
            words.extend_from_slice(p);
            start..words.len()
        });
        (words, ranges)
    }

    /// Entries of the partial buffers: `part_acc` holds this many x head_dim floats, `part_ml` x 2.
    pub fn partial_slots(&self, n_heads: usize) -> usize {
        self.positions.len() * n_heads * self.max_parts
    }

    /// The same launch sized for `parts` partitions a row (at least `max_parts`):
    /// a captured step's geometry, fixed while its rows' contexts grow. A block
    /// past its row's keys exits without writing and `attn_combine` reads each
    /// row's own partitions, so the output has the same bits as the exact grid's.
    pub fn with_capacity(mut self, parts: usize) -> AttentionPlan {
        assert!(parts >= self.max_parts, "a capacity of {parts} partitions for rows that need {}", self.max_parts);
        self.max_parts = parts;
        self.partial.grid.2 = parts as u32;
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every length a frame may have gets a grid that covers it (the kernel's padding in
    /// front is `blocks * CRC_THREADS * chunk - len`, never negative), within the partials
    /// buffer and the powers crc.cu keeps (2^20 chunks), threads never much emptier than
    /// they must be.
    #[test]
    fn crc_plans_cover_every_length_within_their_buffers() {
        let threads = CRC_THREADS as usize;
        for len in [0, 1, 3, 255, 4096, 4097, (1 << 20) + 44, 16 << 20, (64 << 20) + 64, 1 << 40] {
            let p = crc32(len);
            let (blocks, chunk) = (p.chunks.grid.0 as usize, p.chunk as usize);
            assert!(blocks * threads * chunk >= len, "{len}: {blocks} blocks of {chunk}-byte chunks");
            assert!((1..=CRC_MAX_BLOCKS).contains(&blocks) && chunk >= CRC_MIN_CHUNK, "{len}: {p:?}");
            assert!(blocks * threads <= 1 << 20, "{len}: more chunks than crc.cu keeps powers for");
            assert!(blocks == 1 || (blocks - 1) * threads * chunk < len, "{len}: a whole block of nothing");
            assert_eq!((p.chunks.block, p.finish.block, p.finish.grid), (CRC_THREADS, CRC_THREADS, (1, 1, 1)));
        }
        assert_eq!(crc32((1 << 20) + 44).chunks.grid.0, 65, "a 1 MiB frame spreads over 65 blocks");
    }

    #[test]
    fn attention_plans_share_tables_and_group_heads() {
        let (a, b): (Vec<u32>, Vec<u32>) = ((0..40).collect(), (40..60).collect());
        // A prefill chunk of 20 rows on one table, then a decode row on another.
        let mut rows: Vec<AttnRow> = (300..320).map(|pos| AttnRow { block_table: &a, pos }).collect();
        rows.push(AttnRow { block_table: &b, pos: 5 });
        let p = AttentionPlan::new(&rows, 16, 64, 10, 1);
        assert_eq!(p.tables.len(), 60, "each table once");
        assert_eq!((p.offsets[0], p.offsets[19], p.offsets[20]), (0, 0, 40));
        assert_eq!((p.run_start, p.run_len), (vec![0, 16, 20], vec![16, 4, 1]));
        assert_eq!(p.max_parts, 2);
        assert_eq!(p.kernel, AttnKernel::Tiled);
        assert_eq!(p.partial.grid, (3, 10, 2), "tiled: a block per (run, query head, partition)");

        // Decode rows: a block per (row, up to ATTN_GROUP heads of a KV head, partition).
        let decode = [AttnRow { block_table: &a, pos: 600 }, AttnRow { block_table: &b, pos: 0 }];
        let p = AttentionPlan::new(&decode, 16, 64, 10, 1);
        assert_eq!(p.kernel, AttnKernel::Rows);
        assert_eq!(p.partial.grid, (2, 2, 3), "10 heads of one KV head: blocks of 8 and 2");
        assert_eq!(p.partial.shared_bytes, ((8 * 64 + 8 * ATTN_PART + 32) * 4) as u32);
        let p = AttentionPlan::new(&decode, 16, 128, 32, 8);
        assert_eq!(p.partial.grid, (2, 8, 3), "groups of 4");
        assert_eq!(p.partial.shared_bytes, ((4 * 128 + 4 * ATTN_PART + 32) * 4) as u32);
        assert_eq!(p.combine.grid, (2, 32, 1));
        assert_eq!(p.partial_slots(32), 2 * 32 * 3);

        let (words, ranges) = p.index_words();
        assert_eq!(ranges.clone().map(|r| words[r].to_vec()), [p.tables.clone(), p.offsets.clone(), p.positions.clone(), p.run_start.clone(), p.run_len.clone()]);
        assert_eq!(ranges[4].end, words.len());
        // The next layer of the same step asks the same: the same words, so no upload.
        assert_eq!(AttentionPlan::new(&decode, 16, 128, 32, 8).index_words().0, words);
        let next_step = [AttnRow { block_table: &a, pos: 601 }, AttnRow { block_table: &b, pos: 1 }];
        assert_ne!(AttentionPlan::new(&next_step, 16, 128, 32, 8).index_words().0, words);
    }

    #[test]
    fn tensor_core_plans_fill_a_block_with_query_heads() {
        let (a, b): (Vec<u32>, Vec<u32>) = ((0..200).collect(), (200..260).collect());
        // A 40-row chunk of Llama-3-8B's shape (4 query heads per KV head): runs of 16 rows.
        let mut rows: Vec<AttnRow> = (3000..3040).map(|pos| AttnRow { block_table: &a, pos }).collect();
        rows.push(AttnRow { block_table: &b, pos: 900 });
        let p = AttentionPlan::for_gpu(&rows, 16, 128, 32, 8, true);
        assert_eq!(p.kernel, AttnKernel::Mma);
        assert_eq!((p.run_start, p.run_len), (vec![0, 16, 32, 40], vec![16, 16, 8, 1]));
        assert_eq!(p.partial.grid, (4, 8, 12), "a block per (run, KV head, partition)");
        assert_eq!((p.partial.block, p.partial.shared_bytes), (MMA_THREADS, 69_632));
        // SmolLM2's 3 query heads per KV head: 21 rows fill 63 of a block's 64 query rows.
        let p = AttentionPlan::for_gpu(&rows[..30], 16, 64, 9, 3, true);
        assert_eq!(p.run_len, vec![21, 9]);
        assert_eq!(p.partial.shared_bytes, 36_864);
        // Shapes it does not serve fall back to the CUDA-core kernels.
        assert_eq!(AttentionPlan::for_gpu(&rows, 16, 256, 8, 1, true).kernel, AttnKernel::Rows, "head size 256");
        assert_eq!(AttentionPlan::for_gpu(&rows[40..], 16, 64, 130, 2, true).kernel, AttnKernel::Rows, "65 heads a group");
        assert_eq!(AttentionPlan::for_gpu(&rows, 16, 128, 32, 8, false).kernel, AttnKernel::Tiled, "no tensor cores");
    }
}
