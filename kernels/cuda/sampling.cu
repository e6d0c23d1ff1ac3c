// Sampling helpers over rows of logits; one thread block of 256 threads per row.

#define SAMPLING_THREADS 256

// Greedy sampling of each row, by the CPU sampler's rules (`scan` in text/src/sampling.rs):
// a NaN or +inf anywhere fails the row at the first such index (status 1, token = that
// index); a row of only -inf fails as all masked (status 2); otherwise the largest logit
// wins, ties to the lowest index (status 0). Per thread a running best, the first bad
// index and whether anything is above -inf, then one tree reduction.
#define GREEDY_NONE 0xffffffffu
extern "C" __global__ void argmax_rows(const float* logits, int n, u32* token, u32* status) {
    __shared__ float best_v[SAMPLING_THREADS];
    __shared__ u32 best_i[SAMPLING_THREADS];
    __shared__ u32 bad_i[SAMPLING_THREADS];
    const float* r = logits + (u64)blockIdx.x * n;
    int t = threadIdx.x;
    float v = NEG_INF;
    u32 idx = GREEDY_NONE;
    u32 bad = GREEDY_NONE;
    for (int i = t; i < n; i += SAMPLING_THREADS) {
        float x = r[i];
        if (x != x || x == -NEG_INF) {
            if (bad == GREEDY_NONE) bad = (u32)i;
        } else if (x > NEG_INF && (idx == GREEDY_NONE || x > v)) {
            v = x;
            idx = (u32)i;
        }
    }
    best_v[t] = v;
    best_i[t] = idx;
    bad_i[t] = bad;
    __syncthreads();
    for (int s = SAMPLING_THREADS / 2; s > 0; s >>= 1) {
        if (t < s) {
            float ov = best_v[t + s];
            u32 oi = best_i[t + s];
            if (oi != GREEDY_NONE && (best_i[t] == GREEDY_NONE || ov > best_v[t] || (ov == best_v[t] && oi < best_i[t]))) {
                best_v[t] = ov;
                best_i[t] = oi;
            }
            bad_i[t] = min(bad_i[t], bad_i[t + s]);
        }
        __syncthreads();
    }
    if (t == 0) {
        u32 b = bad_i[0], i = best_i[0];
        token[blockIdx.x] = b != GREEDY_NONE ? b : (i != GREEDY_NONE ? i : 0u);
        status[blockIdx.x] = b != GREEDY_NONE ? 1u : (i != GREEDY_NONE ? 0u : 2u);
    }
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
