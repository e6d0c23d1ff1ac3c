// The glue between matrix products: the SiLU- and GELU-gated MLPs' activations,
// residual and bias adds, scaling, row gathers, embedding lookups, and the
// f32 -> bf16 conversion of activations that cuBLAS multiplies.

// out = silu(gate) * up
extern "C" __global__ void silu_mul(const float* gate, const float* up, float* out, u64 n) {
    FOR_EACH(i, n) out[i] = silu_gate(gate[i], up[i]);
}

// out = gelu_tanh(gate) * up (GeGLU, Gemma), with the CPU backend's arithmetic
// (ops::gelu_mul): 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) written as
// g / (1 + e^(-2y)), the logistic form of the same function. Far negative gates
// overflow e^(-2y) to infinity and give -0 where the CPU's clamped exponential
// gives a value below 1e-36: the same to any tolerance.
extern "C" __global__ void gelu_mul(const float* gate, const float* up, float* out, u64 n) {
    FOR_EACH(i, n) out[i] = gelu_gate(gate[i], up[i]);
}

// x += y
extern "C" __global__ void add_inplace(float* x, const float* y, u64 n) {
    FOR_EACH(i, n) x[i] += y[i];
}

// x[r][j] += bias[j] over rows of `width` (the Q, K and V biases of Qwen2); n = rows x width.
extern "C" __global__ void add_rows(float* x, const float* bias, u64 n, int width) {
    FOR_EACH(i, n) x[i] += bias[i % (u64)width];
}

// x *= s (Gemma's embedding scale, sqrt(hidden)).
extern "C" __global__ void scale_inplace(float* x, float s, u64 n) {
    FOR_EACH(i, n) x[i] *= s;
}

extern "C" __global__ void to_bf16(const float* x, u16* out, u64 n) {
    FOR_EACH(i, n) out[i] = f32_to_bf16(x[i]);
}

// out row i = x row rows[i]; one thread block per output row.
extern "C" __global__ void gather_rows(const float* x, const u32* rows, int width, float* out) {
    const float* src = x + (u64)rows[blockIdx.x] * width;
    float* dst = out + (u64)blockIdx.x * width;
    for (int j = threadIdx.x; j < width; j += blockDim.x) dst[j] = src[j];
}

// out row i = row tokens[i] of a bf16 embedding table; one thread block per token.
extern "C" __global__ void embed_bf16(const u16* table, const u32* tokens, int width, float* out) {
    const u16* src = table + (u64)tokens[blockIdx.x] * width;
    float* dst = out + (u64)blockIdx.x * width;
    for (int j = threadIdx.x; j < width; j += blockDim.x) dst[j] = bf16_to_f32(src[j]);
}

// Uniform values in [-scale, scale) from a counter hash (for benchmarks with
// random weights: filling 16 GB on the host and uploading it would dominate).
extern "C" __global__ void fill_uniform_bf16(u16* out, u64 n, u32 seed, float scale) {
    FOR_EACH(i, n) {
        u32 h = (u32)i * 0x9e3779b1u ^ (u32)(i >> 32) * 0x85ebca77u ^ seed;
        h ^= h >> 16; h *= 0x7feb352du; h ^= h >> 15; h *= 0x846ca68bu; h ^= h >> 16;
        out[i] = f32_to_bf16(((float)(h >> 8) * (1.f / 16777216.f) * 2.f - 1.f) * scale);
    }
}
