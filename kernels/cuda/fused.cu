// Fused glue: each kernel here does in one launch what a sequence of the
// other files' kernels does in several, and gives exactly the same bits:
//
// - rmsnorm_bf16 = rmsnorm (norm.cu), then to_bf16 (elementwise.cu): the norm
//   written straight as the bf16 input of the products that follow it.
// - add_rmsnorm_bf16 = add_inplace, then rmsnorm_bf16: a block's residual add
//   and the next block's norm, one read of the row instead of three.
// - norm_add_rmsnorm_bf16 = rmsnorm of a block's output by its post norm
//   (Gemma), then add_rmsnorm_bf16.
// - silu_mul_bf16 / gelu_mul_bf16 = silu_mul / gelu_mul, then to_bf16: the
//   gated activation as the down projection's bf16 input.
// - rope_kv_write_* = rope of the queries, rope of the keys, then kv_write:
//   the keys rotated on their way into the arena (they are not written back).
// - qk_norm_rope_kv_write_* = rmsnorm of each query head and each key head by
//   its norm (QK-norm: Qwen3, Gemma 3), then rope_kv_write_*.
//
// The arithmetic is common.cuh's helpers, the ones the unfused kernels use,
// with the same launch geometry (cuda::plan), so sums run in the same order;
// tests/cuda_emulated.rs checks the bits against the unfused sequence.

// out (bf16) = rmsnorm(x) * w, a thread block of ROW_THREADS per row.
extern "C" __global__ void rmsnorm_bf16(const float* x, const float* w, float eps, int dim, u16* out) {
    __shared__ float scratch[32];
    const float* xr = x + (u64)blockIdx.x * dim;
    u16* o = out + (u64)blockIdx.x * dim;
    float ss = 0.f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) ss = sum_squares_step(ss, xr[i]);
    ss = block_sum(ss, scratch);
    float scale = rms_factor(ss, dim, eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) o[i] = f32_to_bf16(rms_apply(xr[i], scale, w[i]));
}

// x += y; out (bf16) = rmsnorm(x) * w. Each thread reads back only the
// elements it wrote, so no barrier is needed between the add and the norm.
extern "C" __global__ void add_rmsnorm_bf16(float* x, const float* y, const float* w, float eps, int dim, u16* out) {
    __shared__ float scratch[32];
    float* xr = x + (u64)blockIdx.x * dim;
    const float* yr = y + (u64)blockIdx.x * dim;
    u16* o = out + (u64)blockIdx.x * dim;
    float ss = 0.f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        float v = xr[i] + yr[i];
        xr[i] = v;
        ss = sum_squares_step(ss, v);
    }
    ss = block_sum(ss, scratch);
    float scale = rms_factor(ss, dim, eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) o[i] = f32_to_bf16(rms_apply(xr[i], scale, w[i]));
}

// x += rmsnorm(y) * wy; out (bf16) = rmsnorm(x) * w: a block's post-normed output
// added to the residual stream and the next block's norm. The add is __fadd_rn:
// the unfused sequence stores the normed y before adding it, so the multiply
// into it must not be contracted into an FMA with the add here either.
extern "C" __global__ void norm_add_rmsnorm_bf16(float* x, const float* y, const float* wy, const float* w, float eps, int dim, u16* out) {
    __shared__ float scratch[32];
    float* xr = x + (u64)blockIdx.x * dim;
    const float* yr = y + (u64)blockIdx.x * dim;
    u16* o = out + (u64)blockIdx.x * dim;
    float ssy = 0.f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) ssy = sum_squares_step(ssy, yr[i]);
    ssy = block_sum(ssy, scratch);
    float fy = rms_factor(ssy, dim, eps);
    float ss = 0.f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        float v = __fadd_rn(xr[i], rms_apply(yr[i], fy, wy[i]));
        xr[i] = v;
        ss = sum_squares_step(ss, v);
    }
    ss = block_sum(ss, scratch);  // its first barrier keeps the first sum's readers ahead of its writes
    float scale = rms_factor(ss, dim, eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) o[i] = f32_to_bf16(rms_apply(xr[i], scale, w[i]));
}

// out (bf16) = silu(gate) * up
extern "C" __global__ void silu_mul_bf16(const float* gate, const float* up, u16* out, u64 n) {
    FOR_EACH(i, n) out[i] = f32_to_bf16(silu_gate(gate[i], up[i]));
}

// out (bf16) = gelu_tanh(gate) * up
extern "C" __global__ void gelu_mul_bf16(const float* gate, const float* up, u16* out, u64 n) {
    FOR_EACH(i, n) out[i] = f32_to_bf16(gelu_gate(gate[i], up[i]));
}

// For token t (one thread block of TOKEN_THREADS each): rotates row t of q in
// place (q_heads heads), and stores row t of k rotated and row t of v into slot
// (slots[2t], slots[2t+1]) = (block, slot) of `layer`. k and v rows hold
// token_elems = kv heads x 2 half values; the angles are position positions[t]'s.
template <int D>
__device__ void rope_kv_write_impl(void* arena, float* q, const float* k, const float* v, const float* cos_t, const float* sin_t,
                                   const u32* positions, const u32* slots, int q_heads, int half, int layer, int layers,
                                   int block_tokens, int token_elems) {
    u64 p = positions[blockIdx.x];
    const float* c = cos_t + p * half;
    const float* s = sin_t + p * half;
    float* qr = q + (u64)blockIdx.x * q_heads * half * 2;
    for (int t = threadIdx.x; t < q_heads * half; t += blockDim.x) {
        int h = t / half, i = t - h * half;
        float* e = qr + h * half * 2 + 2 * i;
        rope_pair(e[0], e[1], c[i], s[i], &e[0], &e[1]);
    }
    u32 block = slots[2 * blockIdx.x];
    int slot = (int)slots[2 * blockIdx.x + 1];
    u64 kb = kv_index(block, layer, layers, 0, slot, block_tokens, token_elems);
    u64 vb = kv_index(block, layer, layers, 1, slot, block_tokens, token_elems);
    const float* kr = k + (u64)blockIdx.x * token_elems;
    const float* vr = v + (u64)blockIdx.x * token_elems;
    for (int t = threadIdx.x; t < token_elems / 2; t += blockDim.x) {
        int h = t / half, i = t - h * half;
        int at = h * half * 2 + 2 * i;
        float r0, r1;
        rope_pair(kr[at], kr[at + 1], c[i], s[i], &r0, &r1);
        kv_store<D>(arena, kb + at, r0);
        kv_store<D>(arena, kb + at + 1, r1);
    }
    for (int i = threadIdx.x; i < token_elems; i += blockDim.x) kv_store<D>(arena, vb + i, vr[i]);
}

#define ROPE_KV_WRITE(name, D)                                                                                          \
    extern "C" __global__ void name(void* arena, float* q, const float* k, const float* v, const float* cos_t,           \
                                    const float* sin_t, const u32* positions, const u32* slots, int q_heads, int half, \
                                    int layer, int layers, int block_tokens, int token_elems) {                         \
        rope_kv_write_impl<D>(arena, q, k, v, cos_t, sin_t, positions, slots, q_heads, half, layer, layers, block_tokens, \
                              token_elems);                                                                             \
    }
ROPE_KV_WRITE(rope_kv_write_f32, KV_F32)
ROPE_KV_WRITE(rope_kv_write_f16, KV_F16)
ROPE_KV_WRITE(rope_kv_write_bf16, KV_BF16)
ROPE_KV_WRITE(rope_kv_write_e4m3, KV_E4M3)

// The block_sum of a row's squares that rmsnorm (norm.cu) takes in a block of
// NORM_ROW_THREADS threads, computed by one warp: lane l stands in for threads
// l, l + 32, ..., each summing its elements in the same order, and the warps'
// sums are combined as block_sum combines them, so the factor is rmsnorm's to
// the bit. Every lane gets it.
#define NORM_ROW_THREADS 256  // cuda::plan::ROW_THREADS, rmsnorm's launch
__device__ float warp_sum_squares_as_block(const float* xr, int dim) {
    int lane = threadIdx.x & 31;
    float mine = 0.f;
    for (int w = 0; w < NORM_ROW_THREADS / 32; w++) {
        float ss = 0.f;
        for (int i = w * 32 + lane; i < dim; i += NORM_ROW_THREADS) ss = sum_squares_step(ss, xr[i]);
        ss = warp_sum(ss);
        if (lane == w) mine = ss;
    }
    return warp_sum(mine);
}

// rmsnorm of `heads` rows of head_dim at x by w, in place, a warp per head
// (warp-uniform loop: the shuffles see whole warps). A lane reads and writes
// only elements lane + 32j, so no barrier is needed between sum and writes.
__device__ void head_norms_in_place(float* x, int heads, int head_dim, const float* w, float eps) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (int h = warp; h < heads; h += warps) {
        float* xr = x + (u64)h * head_dim;
        float scale = rms_factor(warp_sum_squares_as_block(xr, head_dim), head_dim, eps);
        for (int i = lane; i < head_dim; i += 32) xr[i] = rms_apply(xr[i], scale, w[i]);
    }
}

// rope_kv_write_* of the per-head normed queries and keys: row t of q and of k
// (token_elems / head_dim heads) normed in place by q_norm and k_norm, then
// rotated and stored as rope_kv_write_impl does (k is left normed, not rotated).
#define QK_NORM_ROPE_KV_WRITE(name, D)                                                                                 \
    extern "C" __global__ void name(void* arena, float* q, float* k, const float* v, const float* q_norm,              \
                                    const float* k_norm, float eps, const float* cos_t, const float* sin_t,            \
                                    const u32* positions, const u32* slots, int q_heads, int half, int layer,          \
                                    int layers, int block_tokens, int token_elems) {                                   \
        int hd = half * 2;                                                                                             \
        head_norms_in_place(q + (u64)blockIdx.x * q_heads * hd, q_heads, hd, q_norm, eps);                             \
        head_norms_in_place(k + (u64)blockIdx.x * token_elems, token_elems / hd, hd, k_norm, eps);                     \
        __syncthreads();                                                                                               \
        rope_kv_write_impl<D>(arena, q, k, v, cos_t, sin_t, positions, slots, q_heads, half, layer, layers,            \
                              block_tokens, token_elems);                                                              \
    }
QK_NORM_ROPE_KV_WRITE(qk_norm_rope_kv_write_f32, KV_F32)
QK_NORM_ROPE_KV_WRITE(qk_norm_rope_kv_write_f16, KV_F16)
QK_NORM_ROPE_KV_WRITE(qk_norm_rope_kv_write_bf16, KV_BF16)
QK_NORM_ROPE_KV_WRITE(qk_norm_rope_kv_write_e4m3, KV_E4M3)
