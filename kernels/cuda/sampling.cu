// Sampling helpers over rows of logits; one thread block of 256 threads per row.

#define SAMPLING_THREADS 256

// Index of each row's largest logit, ties to the lowest index (as the CPU's `argmax`).
extern "C" __global__ void argmax_rows(const float* logits, int n, u32* out) {
    __shared__ float best_v[SAMPLING_THREADS];
    __shared__ u32 best_i[SAMPLING_THREADS];
    const float* r = logits + (u64)blockIdx.x * n;
    int t = threadIdx.x;
    float v = NEG_INF;
    u32 idx = 0xffffffffu;
    for (int i = t; i < n; i += SAMPLING_THREADS) {
        if (idx == 0xffffffffu || r[i] > v) { v = r[i]; idx = (u32)i; }
    }
    best_v[t] = v;
    best_i[t] = idx;
    __syncthreads();
    for (int s = SAMPLING_THREADS / 2; s > 0; s >>= 1) {
        if (t < s) {
            float ov = best_v[t + s];
            u32 oi = best_i[t + s];
            if (oi != 0xffffffffu && (best_i[t] == 0xffffffffu || ov > best_v[t] || (ov == best_v[t] && oi < best_i[t]))) {
                best_v[t] = ov;
                best_i[t] = oi;
            }
        }
        __syncthreads();
    }
    if (t == 0) out[blockIdx.x] = best_i[0];
}

// out = softmax(logits * inv_temperature) per row, for sampling on the host from probabilities.
extern "C" __global__ void softmax_rows(const float* logits, int n, float inv_temperature, float* out) {
    __shared__ float scratch[32];
    const float* r = logits + (u64)blockIdx.x * n;
    float* o = out + (u64)blockIdx.x * n;
    float m = NEG_INF;
    for (int i = threadIdx.x; i < n; i += blockDim.x) m = fmaxf(m, r[i] * inv_temperature);
    m = block_max(m, scratch);
    float sum = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float e = expf(r[i] * inv_temperature - m);
        o[i] = e;
        sum += e;
    }
    sum = block_sum(sum, scratch);
    float inv = 1.f / sum;
    for (int i = threadIdx.x; i < n; i += blockDim.x) o[i] *= inv;
}
