// Device helpers shared by every kernel file. NVRTC has no file system, so
// `cuda::compile` prepends this text to each .cu file instead of an #include.
//
// Conversions are written out with bit operations and PTX `cvt` rather than
// cuda_fp16.h / cuda_bf16.h, so the sources compile with NVRTC alone (no
// toolkit headers) and round exactly like the CPU backend's `half` crate
// (round to nearest, ties to even).

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define NEG_INF __int_as_float(0xff800000)

// KV element types, the template argument of kv_load / kv_store; the numbers
// are the ones `KvDtype` uses on the Rust side.
#define KV_F32 0
#define KV_F16 1
#define KV_BF16 2
#define KV_E4M3 3

__device__ __forceinline__ float bf16_to_f32(u16 b) { return __uint_as_float(((u32)b) << 16); }

__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x40u);  // NaN stays a (quiet) NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return (u16)(u >> 16);
}

#ifdef BATON_CUDA_EMULATION  // the CPU run of the kernels in tests (kernels/emu)
__device__ __forceinline__ float f16_to_f32(u16 h) { return emu::f16_to_f32(h); }
__device__ __forceinline__ u16 f32_to_f16(float f) { return emu::f32_to_f16(f); }
#else
__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 f32_to_f16(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
#endif

// OCP FP8 E4M3 ("e4m3fn"): bias 7, no infinities, 0x7f/0xff are NaN, largest
// finite 448. Values beyond it saturate, as KV caches want.
__device__ __forceinline__ float e4m3_to_f32(u8 b) {
    u32 e = (b >> 3) & 0xfu, m = b & 7u;
    float sign = (b & 0x80u) ? -1.f : 1.f;
    if ((b & 0x7fu) == 0x7fu) return __int_as_float(0x7fc00000);
    if (e == 0) return sign * (float)m * 0.001953125f;  // m * 2^-9
    return sign * __uint_as_float(((e + 120u) << 23) | (m << 20));
}

__device__ __forceinline__ u8 f32_to_e4m3(float f) {
    u32 bits = __float_as_uint(f);
    u32 sign = (bits >> 24) & 0x80u;
    float a = fabsf(f);
    if (a != a) return (u8)(sign | 0x7fu);
    if (a >= 448.f) return (u8)(sign | 0x7eu);
    if (a < 0.015625f) {  // below 2^-6: subnormal, m * 2^-9 (m = 8 is the smallest normal)
        return (u8)(sign | __float2uint_rn(a * 512.f));
    }
    u32 ab = __float_as_uint(a);
    u32 exp = ((ab >> 23) & 0xffu) - 120u;  // rebias 127 -> 7
    u32 mant = ab & 0x7fffffu;
    u32 r = mant >> 20, rest = mant & 0xfffffu;
    if (rest > 0x80000u || (rest == 0x80000u && (r & 1u))) r++;
    u32 out = (exp << 3) + r;  // a mantissa carry moves into the exponent
    if (out > 0x7eu) out = 0x7eu;
    return (u8)(sign | out);
}

template <int D> __device__ __forceinline__ float kv_load(const void* arena, u64 i) {
    if (D == KV_F32) return ((const float*)arena)[i];
    if (D == KV_F16) return f16_to_f32(((const u16*)arena)[i]);
    if (D == KV_BF16) return bf16_to_f32(((const u16*)arena)[i]);
    return e4m3_to_f32(((const u8*)arena)[i]);
}

template <int D> __device__ __forceinline__ void kv_store(void* arena, u64 i, float v) {
    if (D == KV_F32) ((float*)arena)[i] = v;
    else if (D == KV_F16) ((u16*)arena)[i] = f32_to_f16(v);
    else if (D == KV_BF16) ((u16*)arena)[i] = f32_to_bf16(v);
    else ((u8*)arena)[i] = f32_to_e4m3(v);
}

// Element index of (block, layer, keys or values, slot) in the paged arena; the
// layout is the CPU backend's `KvStorage` (per block, per layer: all keys of
// the block's slots, then all values).
__device__ __forceinline__ u64 kv_index(u32 block, int layer, int layers, int which, int slot, int block_tokens, int token_elems) {
    return ((((u64)block * layers + layer) * 2 + which) * block_tokens + slot) * (u64)token_elems;
}

// Reductions in a fixed order: the same inputs give the same bits whatever
// else is running, which the determinism contract relies on.
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Over the whole thread block (blockDim.x a multiple of 32); every thread gets
// the result. `scratch` holds 32 floats of shared memory.
__device__ float block_sum(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();  // a previous reduction may still be reading scratch
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    return warp_sum(lane < warps ? scratch[lane] : 0.f);
}

__device__ float block_max(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    return warp_max(lane < warps ? scratch[lane] : NEG_INF);
}

// The arithmetic that a kernel and its fused variant (fused.cu) share. Each
// fused kernel must give exactly the bits of the kernels it replaces; the same
// inlined expression gets the same FMA contraction from the compiler in both,
// where two hand-written copies might not.

// One element's term of RMSNorm's sum of squares.
__device__ __forceinline__ float sum_squares_step(float ss, float v) { return ss + v * v; }

// RMSNorm's factor from a row's block-summed squares.
__device__ __forceinline__ float rms_factor(float ss, int dim, float eps) { return 1.f / sqrtf(ss / (float)dim + eps); }

// A normed element: x * factor * weight.
__device__ __forceinline__ float rms_apply(float x, float factor, float w) { return x * factor * w; }

// silu(g) * u
__device__ __forceinline__ float silu_gate(float g, float u) { return g / (1.f + expf(-g)) * u; }

// gelu_tanh(g) * u in the logistic form (see gelu_mul in elementwise.cu).
__device__ __forceinline__ float gelu_gate(float g, float u) {
    float y = -1.595769f * g * (1.f + 0.044715f * g * g);
    return g / (1.f + expf(y)) * u;
}

// One rotary pair (a, b) turned by the angle whose cosine and sine are c and s.
__device__ __forceinline__ void rope_pair(float a, float b, float c, float s, float* r0, float* r1) {
    *r0 = a * c - b * s;
    *r1 = a * s + b * c;
}

// Grid-stride loop over n elements.
#define FOR_EACH(i, n) for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (u64)(n); i += (u64)gridDim.x * blockDim.x)
