// Rotary embeddings in GGML's "normal" mode: pairs (2i, 2i + 1) of every head
// rotate by the angle of the row's position. The cos/sin tables are the CPU
// backend's (`RopeTable`), uploaded once, so both backends use the same angles.
// One thread block per row.

extern "C" __global__ void rope(float* x, const float* cos_t, const float* sin_t, const u32* positions, int heads, int half) {
    u64 p = positions[blockIdx.x];
    float* xr = x + (u64)blockIdx.x * heads * half * 2;
    const float* c = cos_t + p * half;
    const float* s = sin_t + p * half;
    for (int t = threadIdx.x; t < heads * half; t += blockDim.x) {
        int h = t / half, i = t - h * half;
        float* e = xr + h * half * 2 + 2 * i;
        rope_pair(e[0], e[1], c[i], s[i], &e[0], &e[1]);
    }
}
