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
// chunked: the determinism contract of the CPU backend.

#define ATTN_PART 256
#define ATTN_THREADS 128

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
                                  int max_parts, float* part_acc, float* part_ml) {
    extern __shared__ float shared[];
    int row = blockIdx.x, p = blockIdx.z;
    int group = n_heads / kv_heads, chunks = (group + ATTN_GROUP - 1) / ATTN_GROUP;
    int kvh = blockIdx.y / chunks;
    int h0 = kvh * group + (blockIdx.y % chunks) * ATTN_GROUP;  // this block's first query head
    int nh = min(ATTN_GROUP, kvh * group + group - h0);          // and how many
    int stride = min(group, ATTN_GROUP);
    int n_keys = (int)pos[row] + 1;
    int k0 = p * ATTN_PART;
    if (k0 >= n_keys) return;  // past this row's keys: attn_combine never reads it
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
        if (lane == 0) scores[h * ATTN_PART + j] = s * scale;
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
        for (int j = 0; j < n; j++) {
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
                                    int n_heads, float scale, int max_parts, float* part_acc, float* part_ml) {       \
        attn_partial_impl<D>(arena, q, tables, table_off, pos, layer, layers, block_tokens, kv_heads, head_dim,       \
                             n_heads, scale, max_parts, part_acc, part_ml);                                           \
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
                                        int kv_heads, int head_dim, int n_heads, float scale, int max_parts, float* part_acc,
                                        float* part_ml) {
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
        if (k0 > row_pos) continue;  // uniform across the block
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
        int last[ATTN_TILE_ROWS];  // each row's last key, -1 past the run
#pragma unroll
        for (int i = 0; i < ATTN_TILE_ROWS; i++) {
            int r = r0 + i * split;
            acc[i] = 0.f;
            last[i] = r < rows ? (int)pos[first + r] : -1;
        }
        for (int j = k0; j < k_end; j++) {
            float v = kv_load<D>(arena, kv_index(table[j / block_tokens], layer, layers, 1, j % block_tokens, block_tokens, te) + (u64)kvh * head_dim + d);
#pragma unroll
            for (int i = 0; i < ATTN_TILE_ROWS; i++) {
                if (j <= last[i]) acc[i] += scores[(r0 + i * split) * ATTN_PART + (j - k0)] * v;
            }
        }
#pragma unroll
        for (int i = 0; i < ATTN_TILE_ROWS; i++) {
            int r = r0 + i * split;
            if (k0 > last[i]) continue;  // past the run, or a row with no keys in this partition
            u64 slot = ((u64)(first + r) * n_heads + h) * max_parts + p;
            part_acc[slot * head_dim + d] = acc[i];
        }
    }
}

#define ATTN_PARTIAL_TILED(name, D)                                                                                    \
    extern "C" __global__ void name(const void* arena, const float* q, const u32* tables, const u32* table_off,         \
                                    const u32* pos, const u32* run_start, const u32* run_len, int layer, int layers,    \
                                    int block_tokens, int kv_heads, int head_dim, int n_heads, float scale,            \
                                    int max_parts, float* part_acc, float* part_ml) {                                  \
        attn_partial_tiled_impl<D>(arena, q, tables, table_off, pos, run_start, run_len, layer, layers, block_tokens,   \
                                   kv_heads, head_dim, n_heads, scale, max_parts, part_acc, part_ml);                  \
    }
ATTN_PARTIAL_TILED(attn_partial_tiled_f32, KV_F32)
ATTN_PARTIAL_TILED(attn_partial_tiled_f16, KV_F16)
ATTN_PARTIAL_TILED(attn_partial_tiled_bf16, KV_BF16)
ATTN_PARTIAL_TILED(attn_partial_tiled_e4m3, KV_E4M3)

// Merges a row's partitions, in partition order. Grid: (rows, n_heads).
extern "C" __global__ void attn_combine(const float* part_acc, const float* part_ml, const u32* pos, int n_heads, int head_dim,
                                        int max_parts, float* out) {
    int row = blockIdx.x, h = blockIdx.y;
    int parts = ((int)pos[row] + ATTN_PART) / ATTN_PART;
    u64 base = ((u64)row * n_heads + h) * max_parts;
    float m = NEG_INF;
    for (int p = 0; p < parts; p++) m = fmaxf(m, part_ml[(base + p) * 2]);
    float l = 0.f;
    for (int p = 0; p < parts; p++) l += expf(part_ml[(base + p) * 2] - m) * part_ml[(base + p) * 2 + 1];
    float inv = 1.f / l;
    float* o = out + ((u64)row * n_heads + h) * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float acc = 0.f;
        for (int p = 0; p < parts; p++) acc += expf(part_ml[(base + p) * 2] - m) * part_acc[(base + p) * head_dim + d];
        o[d] = acc * inv;
    }
}
