// RMSNorm: one thread block per row. out = x / sqrt(mean(x^2) + eps) * w.

extern "C" __global__ void rmsnorm(const float* x, const float* w, float eps, int dim, float* out) {
    __shared__ float scratch[32];
    const float* xr = x + (u64)blockIdx.x * dim;
    float* o = out + (u64)blockIdx.x * dim;
    float ss = 0.f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) ss = sum_squares_step(ss, xr[i]);
    ss = block_sum(ss, scratch);
    float scale = rms_factor(ss, dim, eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) o[i] = rms_apply(xr[i], scale, w[i]);
}
