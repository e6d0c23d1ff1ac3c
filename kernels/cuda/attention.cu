// Paged attention for prefill and decode alike. Row r of the batch is a query
// at position pos[r] that attends to keys 0..=pos[r] of its sequence, found
// through its block table (tables[table_off[r]..]). A prefill chunk is rows
// that share a table, causal because each row stops at its own position; the
// cached prefix is just the lower positions of that table.
//
// Keys are split into partitions of ATTN_PART (flash-decoding): one thread
// block computes one (row, heads of a KV head, partition) and writes its max, sum of
// exponentials and unnormalised output; attn_combine merges the partitions of
// a row in order. The partition size is fixed, so a row's result depends only
// on its own keys, never on what else is in the batch or how a prompt was
// chunked: the determinism contract of the CPU backend. A sliding window
// masks the keys before a row's window (first_key).

#define ATTN_PART 256
#define ATTN_THREADS 128

// The first key a row at `pos` attends to: 0, or with a sliding window of
// `window` keys (0: none) the start of its window. Partitions wholly before it
// are neither computed nor combined.
__device__ __forceinline__ int first_key(int pos, int window) { return window > 0 ? max(0, pos + 1 - window) : 0; }

// One row's scores in one partition, in place: they become exp(s - max), and
// the max and the sum of the exponentials come back. The whole block takes
// part. Both partial kernels call it, so their arithmetic cannot drift apart;
// block_sum's barriers also publish the exponentials.
__device__ void softmax_partition(float* scores, int n, float* scratch, float* max_out, float* sum_out) {
    float m = NEG_INF;
    for (int j = threadIdx.x; j < n; j += blockDim.x) m = fmaxf(m, scores[j]);
    m = block_max(m, scratch);
    float l = 0.f;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        float e = expf(scores[j] - m);
        scores[j] = e;
        l += e;
    }
    *max_out = m;
    *sum_out = block_sum(l, scratch);
}

// Query heads per block of attn_partial: the heads that share one KV head (a
// grouped-query group), at most ATTN_GROUP of them, so each key and value is
// read from memory once for all of them. Each head's arithmetic is the one
// the tiled kernel below does for a row, so a position's bits do not depend on
// which kernel computed it or on how many heads shared the block.
#define ATTN_GROUP 8

// Grid: (rows, kv_heads x ceil(group / ATTN_GROUP), partitions), group =
// n_heads / kv_heads. Shared memory: min(group, ATTN_GROUP) x head_dim query
// floats, as many x ATTN_PART scores, 32 for reductions.
template <int D>
__device__ void attn_partial_impl(const void* arena, const float* q, const u32* tables, const u32* table_off, const u32* pos,
                                  int layer, int layers, int block_tokens, int kv_heads, int head_dim, int n_heads, float scale,
                                  int window, int max_parts, float* part_acc, float* part_ml) {
    extern __shared__ float shared[];
    int row = blockIdx.x, p = blockIdx.z;
    int group = n_heads / kv_heads, chunks = (group + ATTN_GROUP - 1) / ATTN_GROUP;
    int kvh = blockIdx.y / chunks;
    int h0 = kvh * group + (blockIdx.y % chunks) * ATTN_GROUP;  // this block's first query head
    int nh = min(ATTN_GROUP, kvh * group + group - h0);          // and how many
    int stride = min(group, ATTN_GROUP);
    int n_keys = (int)pos[row] + 1, lo = first_key((int)pos[row], window);
    int k0 = p * ATTN_PART;
    if (k0 >= n_keys || k0 + ATTN_PART <= lo) return;  // none of this row's keys: attn_combine never reads it
    int k1 = min(k0 + ATTN_PART, n_keys), n = k1 - k0;
    float* qs = shared;                        // [nh][head_dim]
    float* scores = qs + stride * head_dim;    // [nh][ATTN_PART]
    float* scratch = scores + stride * ATTN_PART;
    int te = kv_heads * head_dim;
    const u32* table = tables + table_off[row];
    for (int i = threadIdx.x; i < nh * head_dim; i += blockDim.x) qs[i] = q[((u64)row * n_heads + h0) * head_dim + i];
    __syncthreads();

    // Scores: one warp per (key, head) pair, lanes across the head, summed in
    // warp_sum's fixed order; a key's heads go to neighbouring warps.
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (int pair = warp; pair < n * nh; pair += warps) {
        int j = pair / nh, h = pair - j * nh;
        int key = k0 + j;
        u64 base = kv_index(table[key / block_tokens], layer, layers, 0, key % block_tokens, block_tokens, te) + (u64)kvh * head_dim;
        float s = 0.f;
        for (int d = lane; d < head_dim; d += 32) s += qs[h * head_dim + d] * kv_load<D>(arena, base + d);
        s = warp_sum(s);
        if (lane == 0) scores[h * ATTN_PART + j] = key < lo ? NEG_INF : s * scale;
    }
    __syncthreads();
    for (int h = 0; h < nh; h++) {
        float m, l;
        softmax_partition(scores + h * ATTN_PART, n, scratch, &m, &l);
        if (threadIdx.x == 0) {
            u64 slot = ((u64)row * n_heads + h0 + h) * max_parts + p;
            part_ml[slot * 2] = m;
            part_ml[slot * 2 + 1] = l;
        }
    }

    // Values: a thread per (element, share of the heads), keys in order; each
    // value is read once and used for every head of the share.
    int split = max(1, min(nh, (int)blockDim.x / head_dim));
    for (int o = threadIdx.x; o < head_dim * split; o += blockDim.x) {
        int d = o % head_dim, first = o / head_dim;
        float acc[ATTN_GROUP];
        for (int i = 0; i < ATTN_GROUP; i++) acc[i] = 0.f;
        for (int j = max(0, lo - k0); j < n; j++) {  // keys before the window weigh 0
            int key = k0 + j;
            float v = kv_load<D>(arena, kv_index(table[key / block_tokens], layer, layers, 1, key % block_tokens, block_tokens, te) + (u64)kvh * head_dim + d);
#pragma unroll
            for (int i = 0; i < ATTN_GROUP; i++) {
                int h = first + i * split;
                if (h < nh) acc[i] += scores[h * ATTN_PART + j] * v;
            }
        }
#pragma unroll
        for (int i = 0; i < ATTN_GROUP; i++) {
            int h = first + i * split;
            if (h < nh) part_acc[(((u64)row * n_heads + h0 + h) * max_parts + p) * head_dim + d] = acc[i];
        }
    }
}

#define ATTN_PARTIAL(name, D)                                                                                         \
    extern "C" __global__ void name(const void* arena, const float* q, const u32* tables, const u32* table_off,        \
                                    const u32* pos, int layer, int layers, int block_tokens, int kv_heads, int head_dim, \
                                    int n_heads, float scale, int window, int max_parts, float* part_acc,             \
                                    float* part_ml) {                                                                 \
        attn_partial_impl<D>(arena, q, tables, table_off, pos, layer, layers, block_tokens, kv_heads, head_dim,       \
                             n_heads, scale, window, max_parts, part_acc, part_ml);                                   \
    }
ATTN_PARTIAL(attn_partial_f32, KV_F32)
ATTN_PARTIAL(attn_partial_f16, KV_F16)
ATTN_PARTIAL(attn_partial_bf16, KV_BF16)
ATTN_PARTIAL(attn_partial_e4m3, KV_E4M3)

// The same partials for a run of up to ATTN_TILE_ROWS rows that share one block
// table (a prefill chunk): each key and value is fetched from memory once for
// the whole run instead of once per row. Every row's arithmetic is the one of
// attn_partial_impl, operation for operation (lane-strided dot products summed
// by warp_sum, the block reductions, keys in order for the values), so a
// position gives the same bits whichever kernel computed it.
//
// Grid: (runs, n_heads, max_parts); run i is rows run_start[i] .. + run_len[i].
// Shared memory: ATTN_TILE_ROWS x head_dim query floats, ATTN_TILE_ROWS x
// ATTN_PART scores, ATTN_KEY_CHUNK x head_dim keys, 32 for reductions.
#define ATTN_TILE_ROWS 16
#define ATTN_KEY_CHUNK 32

template <int D>
__device__ void attn_partial_tiled_impl(const void* arena, const float* q, const u32* tables, const u32* table_off, const u32* pos,
                                        const u32* run_start, const u32* run_len, int layer, int layers, int block_tokens,
                                        int kv_heads, int head_dim, int n_heads, float scale, int window, int max_parts,
                                        float* part_acc, float* part_ml) {
    extern __shared__ float shared[];
    int first = (int)run_start[blockIdx.x], rows = (int)run_len[blockIdx.x];
    int h = blockIdx.y, p = blockIdx.z;
    int k0 = p * ATTN_PART;
    int last_pos = 0;
    for (int r = 0; r < rows; r++) last_pos = max(last_pos, (int)pos[first + r]);
    if (k0 > last_pos) return;
    int k_end = min(k0 + ATTN_PART, last_pos + 1);
    float* qs = shared;                                   // [rows][head_dim]
    float* scores = qs + ATTN_TILE_ROWS * head_dim;       // [rows][ATTN_PART]
    float* keys = scores + ATTN_TILE_ROWS * ATTN_PART;    // [ATTN_KEY_CHUNK][head_dim]
    float* scratch = keys + ATTN_KEY_CHUNK * head_dim;    // [32]
    int kvh = h / (n_heads / kv_heads);
    int te = kv_heads * head_dim;
    const u32* table = tables + table_off[first];
    for (int i = threadIdx.x; i < rows * head_dim; i += blockDim.x) {
        int r = i / head_dim, d = i - r * head_dim;
        qs[i] = q[((u64)(first + r) * n_heads + h) * head_dim + d];
    }

    // Scores, a chunk of keys at a time: one warp per (row, key) pair.
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (int c0 = k0; c0 < k_end; c0 += ATTN_KEY_CHUNK) {
        int n = min(ATTN_KEY_CHUNK, k_end - c0);
        __syncthreads();  // the previous chunk's keys are no longer read
        for (int i = threadIdx.x; i < n * head_dim; i += blockDim.x) {
            int j = i / head_dim, d = i - j * head_dim;
            int key = c0 + j;
            u64 base = kv_index(table[key / block_tokens], layer, layers, 0, key % block_tokens, block_tokens, te) + (u64)kvh * head_dim;
            keys[i] = kv_load<D>(arena, base + d);
        }
        __syncthreads();
        for (int pair = warp; pair < rows * n; pair += warps) {
            int r = pair / n, j = pair - r * n;
            if (c0 + j > (int)pos[first + r]) continue;  // past this row's position (uniform per warp)
            if (c0 + j < first_key((int)pos[first + r], window)) {  // before its window: weighs 0
                if (lane == 0) scores[r * ATTN_PART + (c0 + j - k0)] = NEG_INF;
                continue;
            }
            float s = 0.f;
            for (int d = lane; d < head_dim; d += 32) s += qs[r * head_dim + d] * keys[j * head_dim + d];
            s = warp_sum(s);
            if (lane == 0) scores[r * ATTN_PART + (c0 + j - k0)] = s * scale;
        }
    }
    __syncthreads();

    // Per row, the softmax statistics with the whole block, as attn_partial_impl does.
    for (int r = 0; r < rows; r++) {
        int row_pos = (int)pos[first + r];
        if (k0 > row_pos || k0 + ATTN_PART <= first_key(row_pos, window)) continue;  // uniform across the block
        int k1 = min(k0 + ATTN_PART, row_pos + 1);
        float m, l;
        softmax_partition(scores + r * ATTN_PART, k1 - k0, scratch, &m, &l);
        if (threadIdx.x == 0) {
            u64 slot = ((u64)(first + r) * n_heads + h) * max_parts + p;
            part_ml[slot * 2] = m;
            part_ml[slot * 2 + 1] = l;
        }
    }
    __syncthreads();

    // Values: a thread per (element, share of the rows), keys in order; each
    // value is read once per thread and used for every row of its share that
    // reaches it. Unrolled over the rows so the sums stay in registers.
    int split = max(1, min(rows, (int)blockDim.x / head_dim));
    for (int o = threadIdx.x; o < head_dim * split; o += blockDim.x) {
        int d = o % head_dim, r0 = o / head_dim;
        float acc[ATTN_TILE_ROWS];
        int last[ATTN_TILE_ROWS], lo[ATTN_TILE_ROWS];  // each row's last and first key, -1 and 0 past the run
#pragma unroll
        for (int i = 0; i < ATTN_TILE_ROWS; i++) {
            int r = r0 + i * split;
            acc[i] = 0.f;
            last[i] = r < rows ? (int)pos[first + r] : -1;
            lo[i] = r < rows ? first_key(last[i], window) : 0;
        }
        for (int j = k0; j < k_end; j++) {
            float v = kv_load<D>(arena, kv_index(table[j / block_tokens], layer, layers, 1, j % block_tokens, block_tokens, te) + (u64)kvh * head_dim + d);
#pragma unroll
            for (int i = 0; i < ATTN_TILE_ROWS; i++) {
                if (j <= last[i] && j >= lo[i]) acc[i] += scores[(r0 + i * split) * ATTN_PART + (j - k0)] * v;
            }
        }
#pragma unroll
        for (int i = 0; i < ATTN_TILE_ROWS; i++) {
            int r = r0 + i * split;
            if (k0 > last[i] || k0 + ATTN_PART <= lo[i]) continue;  // past the run, or no keys of the row here
            u64 slot = ((u64)(first + r) * n_heads + h) * max_parts + p;
            part_acc[slot * head_dim + d] = acc[i];
        }
    }
}

#define ATTN_PARTIAL_TILED(name, D)                                                                                    \
    extern "C" __global__ void name(const void* arena, const float* q, const u32* tables, const u32* table_off,         \
                                    const u32* pos, const u32* run_start, const u32* run_len, int layer, int layers,    \
                                    int block_tokens, int kv_heads, int head_dim, int n_heads, float scale,            \
                                    int window, int max_parts, float* part_acc, float* part_ml) {                      \
        attn_partial_tiled_impl<D>(arena, q, tables, table_off, pos, run_start, run_len, layer, layers, block_tokens,   \
                                   kv_heads, head_dim, n_heads, scale, window, max_parts, part_acc, part_ml);          \
    }
ATTN_PARTIAL_TILED(attn_partial_tiled_f32, KV_F32)
ATTN_PARTIAL_TILED(attn_partial_tiled_f16, KV_F16)
ATTN_PARTIAL_TILED(attn_partial_tiled_bf16, KV_BF16)
ATTN_PARTIAL_TILED(attn_partial_tiled_e4m3, KV_E4M3)

// Merges a row's partitions (those holding its keys), in partition order.
// Grid: (rows, n_heads). Writes f32 (attn_combine), or bf16 (attn_combine_bf16:
// the output projection's input, the bits to_bf16 gives the f32 output).
template <bool BF16>
__device__ void attn_combine_impl(const float* part_acc, const float* part_ml, const u32* pos, int n_heads, int head_dim, int window,
                                  int max_parts, void* out) {
    int row = blockIdx.x, h = blockIdx.y;
    int p0 = first_key((int)pos[row], window) / ATTN_PART, parts = ((int)pos[row] + ATTN_PART) / ATTN_PART;
    u64 base = ((u64)row * n_heads + h) * max_parts;
    float m = NEG_INF;
    for (int p = p0; p < parts; p++) m = fmaxf(m, part_ml[(base + p) * 2]);
    float l = 0.f;
    for (int p = p0; p < parts; p++) l += expf(part_ml[(base + p) * 2] - m) * part_ml[(base + p) * 2 + 1];
    float inv = 1.f / l;
    u64 o = ((u64)row * n_heads + h) * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float acc = 0.f;
        for (int p = p0; p < parts; p++) acc += expf(part_ml[(base + p) * 2] - m) * part_acc[(base + p) * head_dim + d];
        float r = acc * inv;
        if (BF16) ((u16*)out)[o + d] = f32_to_bf16(r);
        else ((float*)out)[o + d] = r;
    }
}

extern "C" __global__ void attn_combine(const float* part_acc, const float* part_ml, const u32* pos, int n_heads, int head_dim,
                                        int window, int max_parts, float* out) {
    attn_combine_impl<false>(part_acc, part_ml, pos, n_heads, head_dim, window, max_parts, out);
}

extern "C" __global__ void attn_combine_bf16(const float* part_acc, const float* part_ml, const u32* pos, int n_heads, int head_dim,
                                             int window, int max_parts, u16* out) {
    attn_combine_impl<true>(part_acc, part_ml, pos, n_heads, head_dim, window, max_parts, out);
}

// ---------------------------------------------------------------------------
// Tensor-core attention (sm_80 and later): the same partials as above, for
// 16-bit and FP8 KV, with the products on mma.sync m16n8k16 (bf16 inputs for
// a bf16 arena, f16 for f16 and e4m3, which f16 holds exactly; f32 sums).
//
// A block takes a run of rows on one block table (a prefill chunk's rows, or
// one decode row), one KV head and one partition. Its "query rows" are the
// (row, query head) pairs of the run and that KV head's group, up to
// MMA_ROWS: four warps of sixteen, so every query head of a GQA group is
// served by one read of its keys and values, for a decode row as for a chunk.
// Keys come in tiles of MMA_KEYS at fixed positions (multiples of MMA_KEYS,
// ATTN_PART a multiple of it), staged in shared memory by cp.async, the next
// tile's copy in flight while the current one is used (two buffers).
//
// Per query row and tile, flash-attention's online softmax: the row's scores
// for the tile (Q K^T on the tensor cores, scaled, masked past its position
// and before its window), the running max and sum, and P V added to the
// running output. A tensor core computes each output element from its own
// row of A and column of B, so a query row's bits depend only on its own
// query, its keys and the fixed tile and partition boundaries: never on the
// other rows of its run, the batch, or how a prompt was chunked. A tile that
// holds none of a row's keys leaves its state exactly as it was (max
// unchanged, scale 1, products of zero), so a warp skips the tiles none of
// its rows reach.

#define MMA_KEYS 64
#define MMA_ROWS 64
#define MMA_THREADS 128

#ifdef BATON_CUDA_EMULATION
__device__ __forceinline__ void cp_async16(void* dst, const void* src) { emu::cp_async(dst, src, 16); }
__device__ __forceinline__ void cp_async_commit() { emu::cp_async_commit(); }
template <int N> __device__ __forceinline__ void cp_async_wait() { emu::cp_async_wait(N); }
__device__ __forceinline__ void ldmatrix_x4(u32 r[4], const u16* row) { emu::ldmatrix_x4(r, row, false); }
__device__ __forceinline__ void ldmatrix_x4_trans(u32 r[4], const u16* row) { emu::ldmatrix_x4(r, row, true); }
template <bool BF16> __device__ __forceinline__ void mma_16816(float d[4], const u32 a[4], const u32 b[2]) { emu::mma_m16n8k16(d, a, b, BF16); }
__device__ __forceinline__ float shfl_xor(float v, int mask) { return __shfl_xor_sync(0xffffffffu, v, mask); }
#else
__device__ __forceinline__ u32 shared_address(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(shared_address(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }
__device__ __forceinline__ void ldmatrix_x4(u32 r[4], const u16* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(row)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 r[4], const u16* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(row)));
}
template <bool BF16> __device__ __forceinline__ void mma_16816(float d[4], const u32 a[4], const u32 b[2]) {
    if (BF16) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    } else {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
}
__device__ __forceinline__ float shfl_xor(float v, int mask) { return __shfl_xor_sync(0xffffffffu, v, mask); }
#endif

// Two values as the mma's 16-bit inputs, the first in the low half (round to nearest even).
template <bool BF16> __device__ __forceinline__ u32 pack16(float lo, float hi) {
    return BF16 ? (u32)f32_to_bf16(lo) | ((u32)f32_to_bf16(hi) << 16) : (u32)f32_to_f16(lo) | ((u32)f32_to_f16(hi) << 16);
}

// Grid: (runs, kv_heads, max_parts), MMA_THREADS threads. Run i is rows
// run_start[i] .. + run_len[i] on one table, run_len[i] x group <= MMA_ROWS.
// Shared memory: two buffers of MMA_KEYS keys and as many values, HD + 8
// 16-bit elements a row (the pad keeps ldmatrix's eight rows in distinct banks).
template <int D, int HD>
__device__ void attn_mma_impl(const void* arena, const float* q, const u32* tables, const u32* table_off, const u32* pos,
                              const u32* run_start, const u32* run_len, int layer, int layers, int block_tokens, int kv_heads,
                              int n_heads, float scale, int window, int max_parts, float* part_acc, float* part_ml) {
    constexpr bool BF16 = D == KV_BF16;
    constexpr int PITCH = HD + 8, CHUNKS = HD / 8, TILE = MMA_KEYS * PITCH;
    extern __shared__ float shared[];
    u16* keys = (u16*)shared;     // [2][MMA_KEYS][PITCH]
    u16* values = keys + 2 * TILE;  // [2][MMA_KEYS][PITCH]
    int first = (int)run_start[blockIdx.x], rows = (int)run_len[blockIdx.x];
    int kvh = blockIdx.y, p = blockIdx.z;
    int group = n_heads / kv_heads, query_rows = rows * group;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    int k0 = p * ATTN_PART;

    // The keys of this partition that some row of the run attends to.
    int run_hi = 0, run_lo = 1 << 30;
    for (int r = 0; r < rows; r++) {
        run_hi = max(run_hi, (int)pos[first + r]);
        run_lo = min(run_lo, first_key((int)pos[first + r], window));
    }
    int k_begin = max(k0, run_lo), k_end = min(k0 + ATTN_PART, run_hi + 1);
    if (k_begin >= k_end) return;  // uniform: attn_combine reads none of these rows' partials here
    int tile0 = k_begin / MMA_KEYS * MMA_KEYS, tiles = (k_end - tile0 + MMA_KEYS - 1) / MMA_KEYS;
    int te = kv_heads * HD;
    const u32* table = tables + table_off[first];

    // This lane's two query rows (g and g + 8 of its warp's sixteen): position and first key;
    // a padding row has no keys (position -1).
    int row_pos[2], row_lo[2];
    for (int h = 0; h < 2; h++) {
        int m = warp * 16 + g + 8 * h;
        row_pos[h] = m < query_rows ? (int)pos[first + m / group] : -1;
        row_lo[h] = m < query_rows ? first_key(row_pos[h], window) : 0;
    }
    // The warp's key range (the same in every lane): a tile outside it changes none of its rows.
    int warp_hi = -1, warp_lo = 1 << 30;
    for (int m = warp * 16; m < min(warp * 16 + 16, query_rows); m++) {
        int row_p = (int)pos[first + m / group];
        warp_hi = max(warp_hi, row_p);
        warp_lo = min(warp_lo, first_key(row_p, window));
    }

    // Q as A fragments, one per 16 elements of the head, rounded to the mma's input type.
    u32 qa[HD / 16][4];
    {
        const float* qr[2];
        for (int h = 0; h < 2; h++) {
            int m = warp * 16 + g + 8 * h;
            qr[h] = m < query_rows ? q + ((u64)(first + m / group) * n_heads + kvh * group + m % group) * HD : nullptr;
        }
#pragma unroll
        for (int s = 0; s < HD / 16; s++) {
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const float* src = qr[i & 1];
                int col = s * 16 + 2 * t + (i >> 1) * 8;
                qa[s][i] = src ? pack16<BF16>(src[col], src[col + 1]) : 0u;
            }
        }
    }

    // Stages keys and values tk .. tk + MMA_KEYS into buffer `buf`; keys outside
    // [k_begin, k_end) (none of the run's) are zeros, never read from the arena.
    auto stage = [&](int tk, int buf) {
        u16* kd = keys + buf * TILE;
        u16* vd = values + buf * TILE;
        for (int c = threadIdx.x; c < MMA_KEYS * CHUNKS; c += MMA_THREADS) {
            int j = c / CHUNKS, col = (c - j * CHUNKS) * 8, key = tk + j;
            u32* kdst = (u32*)(kd + j * PITCH + col);
            u32* vdst = (u32*)(vd + j * PITCH + col);
            if (key < k_begin || key >= k_end) {
                for (int i = 0; i < 4; i++) kdst[i] = vdst[i] = 0u;
                continue;
            }
            u32 block = table[key / block_tokens];
            int slot = key % block_tokens;
            u64 kb = kv_index(block, layer, layers, 0, slot, block_tokens, te) + (u64)kvh * HD + col;
            u64 vb = kv_index(block, layer, layers, 1, slot, block_tokens, te) + (u64)kvh * HD + col;
            if (D == KV_E4M3) {
                // FP8 widens to f16 exactly; the copy is synchronous (the barriers still order it).
                const u8* a8 = (const u8*)arena;
                for (int i = 0; i < 4; i++) {
                    kdst[i] = (u32)f32_to_f16(e4m3_to_f32(a8[kb + 2 * i])) | ((u32)f32_to_f16(e4m3_to_f32(a8[kb + 2 * i + 1])) << 16);
                    vdst[i] = (u32)f32_to_f16(e4m3_to_f32(a8[vb + 2 * i])) | ((u32)f32_to_f16(e4m3_to_f32(a8[vb + 2 * i + 1])) << 16);
                }
            } else {
                cp_async16(kdst, (const u16*)arena + kb);
                cp_async16(vdst, (const u16*)arena + vb);
            }
        }
    };

    float o[HD / 8][4];
#pragma unroll
    for (int n = 0; n < HD / 8; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float row_max[2] = {NEG_INF, NEG_INF}, row_sum[2] = {0.f, 0.f};
    int mi = lane >> 3, mr = lane & 7;  // the ldmatrix row this lane addresses: matrix mi, row mr

    stage(tile0, 0);
    cp_async_commit();
    for (int i = 0; i < tiles; i++) {
        int tk = tile0 + i * MMA_KEYS, buf = i & 1;
        if (i + 1 < tiles) {
            stage(tk + MMA_KEYS, buf ^ 1);  // buf ^ 1 was last read before the previous iteration's closing barrier
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        if (warp_hi >= tk && warp_lo < tk + MMA_KEYS) {  // uniform per warp
            const u16* kt = keys + buf * TILE;
            const u16* vt = values + buf * TILE;
            // Scores: S = Q K^T, sixteen query rows x MMA_KEYS keys, head elements in order.
            float s[MMA_KEYS / 8][4];
#pragma unroll
            for (int j = 0; j < MMA_KEYS / 8; j++) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
            for (int ks = 0; ks < HD / 16; ks++) {
#pragma unroll
                for (int j = 0; j < MMA_KEYS / 8; j += 2) {
                    u32 b[4];
                    ldmatrix_x4(b, kt + (j * 8 + (mi >> 1) * 8 + mr) * PITCH + ks * 16 + (mi & 1) * 8);
                    mma_16816<BF16>(s[j], qa[ks], b);
                    mma_16816<BF16>(s[j + 1], qa[ks], b + 2);
                }
            }
            // Online softmax of each row over this tile.
            float tile_max[2] = {NEG_INF, NEG_INF};
#pragma unroll
            for (int j = 0; j < MMA_KEYS / 8; j++) {
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    int h = e >> 1, key = tk + j * 8 + 2 * t + (e & 1);
                    float v = s[j][e] * scale;
                    if (key > row_pos[h] || key < row_lo[h]) v = NEG_INF;
                    s[j][e] = v;
                    tile_max[h] = fmaxf(tile_max[h], v);
                }
            }
            float alpha[2];
            for (int h = 0; h < 2; h++) {
                // The four lanes of a row hold its scores; xor 1 and 2 stay among them.
                tile_max[h] = fmaxf(tile_max[h], shfl_xor(tile_max[h], 1));
                tile_max[h] = fmaxf(tile_max[h], shfl_xor(tile_max[h], 2));
                float new_max = fmaxf(row_max[h], tile_max[h]);
                float base = new_max == NEG_INF ? 0.f : new_max;  // no key yet: every exponential is 0
                alpha[h] = expf(row_max[h] - base);
                row_max[h] = new_max;
                tile_max[h] = base;
            }
            float tile_sum[2] = {0.f, 0.f};
#pragma unroll
            for (int j = 0; j < MMA_KEYS / 8; j++) {
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    float pe = expf(s[j][e] - tile_max[e >> 1]);
                    s[j][e] = pe;
                    tile_sum[e >> 1] += pe;
                }
            }
            for (int h = 0; h < 2; h++) {
                tile_sum[h] += shfl_xor(tile_sum[h], 1);
                tile_sum[h] += shfl_xor(tile_sum[h], 2);
                row_sum[h] = row_sum[h] * alpha[h] + tile_sum[h];
            }
#pragma unroll
            for (int n = 0; n < HD / 8; n++) {
                o[n][0] *= alpha[0];
                o[n][1] *= alpha[0];
                o[n][2] *= alpha[1];
                o[n][3] *= alpha[1];
            }
            // O += P V: the scores' accumulator fragments are P's A fragments, sixteen keys a step.
#pragma unroll
            for (int kk = 0; kk < MMA_KEYS / 16; kk++) {
                u32 a[4] = {pack16<BF16>(s[2 * kk][0], s[2 * kk][1]), pack16<BF16>(s[2 * kk][2], s[2 * kk][3]),
                            pack16<BF16>(s[2 * kk + 1][0], s[2 * kk + 1][1]), pack16<BF16>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
                for (int dn = 0; dn < HD / 16; dn++) {
                    u32 b[4];
                    ldmatrix_x4_trans(b, vt + (kk * 16 + (mi & 1) * 8 + mr) * PITCH + dn * 16 + (mi >> 1) * 8);
                    mma_16816<BF16>(o[2 * dn], a, b);
                    mma_16816<BF16>(o[2 * dn + 1], a, b + 2);
                }
            }
        }
        __syncthreads();  // every warp is done with buffer `buf` before it is staged again
    }

    // The partials of each query row that has keys in this partition (attn_combine's range).
    for (int h = 0; h < 2; h++) {
        int m = warp * 16 + g + 8 * h;
        if (m >= query_rows || k0 > row_pos[h] || k0 + ATTN_PART <= row_lo[h]) continue;
        u64 slot = ((u64)(first + m / group) * n_heads + kvh * group + m % group) * max_parts + p;
        if (t == 0) {
            part_ml[slot * 2] = row_max[h];
            part_ml[slot * 2 + 1] = row_sum[h];
        }
        float* dst = part_acc + slot * HD + 2 * t;
#pragma unroll
        for (int n = 0; n < HD / 8; n++) {
            dst[n * 8] = o[n][2 * h];
            dst[n * 8 + 1] = o[n][2 * h + 1];
        }
    }
}

#if defined(BATON_CUDA_EMULATION) || __CUDA_ARCH__ >= 800
#define ATTN_MMA(name, D, HD)                                                                                          \
    extern "C" __global__ void name(const void* arena, const float* q, const u32* tables, const u32* table_off,         \
                                    const u32* pos, const u32* run_start, const u32* run_len, int layer, int layers,    \
                                    int block_tokens, int kv_heads, int n_heads, float scale, int window,              \
                                    int max_parts, float* part_acc, float* part_ml) {                                  \
        attn_mma_impl<D, HD>(arena, q, tables, table_off, pos, run_start, run_len, layer, layers, block_tokens,        \
                             kv_heads, n_heads, scale, window, max_parts, part_acc, part_ml);                          \
    }
ATTN_MMA(attn_mma_f16_d32, KV_F16, 32)
ATTN_MMA(attn_mma_f16_d64, KV_F16, 64)
ATTN_MMA(attn_mma_f16_d128, KV_F16, 128)
ATTN_MMA(attn_mma_bf16_d32, KV_BF16, 32)
ATTN_MMA(attn_mma_bf16_d64, KV_BF16, 64)
ATTN_MMA(attn_mma_bf16_d128, KV_BF16, 128)
ATTN_MMA(attn_mma_e4m3_d32, KV_E4M3, 32)
ATTN_MMA(attn_mma_e4m3_d64, KV_E4M3, 64)
ATTN_MMA(attn_mma_e4m3_d128, KV_E4M3, 128)
#endif
