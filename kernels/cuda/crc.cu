// CRC-32 of a device buffer (a KV frame in a GPU-memory RDMA ring), the one
// zlib and the crc32fast crate compute: IEEE polynomial, reflected (0xEDB88320),
// register started at 0xFFFFFFFF, result inverted.
//
// The math. Bits are reflected: bit 31 of a word is the coefficient of x^0,
// bit 0 that of x^31. With the register started at zero, a message M leaves
// r(M) = M(x) * x^32 mod P over GF(2). That is linear in M, so for M = A then B
//     r(AB) = r(A) * x^(8|B|) mod P  xor  r(B),
// and zero bytes in front of a message leave r unchanged. Starting the
// register at S instead adds S * x^(8|M|) mod P, and the final inversion
// 0xFFFFFFFF.
//
// crc32_chunks cuts the message into gridDim.x * CRC_THREADS chunks of `chunk`
// bytes, the first ones short (as if the message had zero bytes in front,
// which change nothing). Each thread computes r of its chunk with tables in
// shared memory, four bytes a step, and shifts it past the chunks after it in
// its block; the block XORs these, shifts the sum past the blocks after it
// and writes it to partials[blockIdx.x] (block 0 adds the start value's and
// the inversion's terms). crc32_finish XORs the partials into the CRC.
// Launches: cuda::plan::crc32, blocks of CRC_THREADS threads.

#define CRC_POLY 0xEDB88320u
// x^0 in the reflected representation.
#define CRC_ONE 0x80000000u
// Threads of a block (`CRC_THREADS` in cuda/plan.rs): a power of two.
#define CRC_THREADS 256
// Powers x^(8 * chunk * 2^k) kept per block: enough for 2^CRC_POW_BITS chunks
// (the plan's 1,024 blocks of 256 need 18).
#define CRC_POW_BITS 20

// a * b mod P: the sum over the terms x^i of a of x^i * b.
__device__ __forceinline__ u32 gf2_mul(u32 a, u32 b) {
    u32 p = 0;
#pragma unroll
    for (int i = 0; i < 32; i++) {
        p ^= b & (0u - ((a >> (31 - i)) & 1u));  // a has x^i: add b * x^i
        b = (b >> 1) ^ (CRC_POLY & (0u - (b & 1u)));  // b *= x; x^32 = P - x^32
    }
    return p;
}

// x^(8n) mod P, by squaring: x^(8n) is the product of x^(8 * 2^k) over the bits k of n.
__device__ u32 x_pow_8n(u64 n) {
    u32 result = CRC_ONE, base = CRC_ONE >> 8;  // x^0, x^8
    for (; n; n >>= 1) {
        if (n & 1) result = gf2_mul(result, base);
        base = gf2_mul(base, base);
    }
    return result;
}

// a * x^(8 * chunk * m) mod P from the powers pw[k] = x^(8 * chunk * 2^k).
__device__ __forceinline__ u32 crc_shift(u32 a, u64 m, const u32* pw) {
    for (int k = 0; m && a; k++, m >>= 1) {
        if (m & 1) a = gf2_mul(a, pw[k]);
    }
    return a;
}

extern "C" __global__ void crc32_chunks(const u8* data, u64 len, u64 chunk, u32* partials) {
    // table[s][i]: r of byte i followed by s zero bytes (slicing by four).
    __shared__ u32 table[4][256];
    __shared__ u32 pw[CRC_POW_BITS];
    __shared__ u32 sums[CRC_THREADS];
    __shared__ u32 start_term;
    int tid = threadIdx.x;
    for (int i = tid; i < 256; i += CRC_THREADS) {
        u32 c = (u32)i;
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (CRC_POLY & (0u - (c & 1u)));
        table[0][i] = c;
    }
    if (tid == 0) {
        pw[0] = x_pow_8n(chunk);
        for (int k = 1; k < CRC_POW_BITS; k++) pw[k] = gf2_mul(pw[k - 1], pw[k - 1]);
    }
    // The start value's and the inversion's terms, beside the others' work.
    if (blockIdx.x == 0 && tid == CRC_THREADS - 1) start_term = gf2_mul(0xFFFFFFFFu, x_pow_8n(len)) ^ 0xFFFFFFFFu;
    __syncthreads();
    for (int s = 1; s < 4; s++) {
        for (int i = tid; i < 256; i += CRC_THREADS) {
            u32 c = table[s - 1][i];
            table[s][i] = (c >> 8) ^ table[0][c & 0xffu];
        }
        __syncthreads();
    }

    // This thread's chunk of the message with the zero bytes in front: [t * chunk, (t + 1) * chunk).
    u64 threads = (u64)gridDim.x * CRC_THREADS;
    u64 pad = threads * chunk - len;  // the plan makes threads * chunk >= len
    u64 t = (u64)blockIdx.x * CRC_THREADS + tid;
    u64 vs = t * chunk, ve = vs + chunk;
    const u8* p = data + (vs > pad ? vs - pad : 0);
    const u8* end = data + (ve > pad ? ve - pad : 0);
    u32 r = 0;
    while (p < end && ((u64)p & 3u)) r = (r >> 8) ^ table[0][(r ^ *p++) & 0xffu];
    for (; end - p >= 4; p += 4) {
        r ^= *(const u32*)p;  // little-endian: the first byte is the low one
        r = table[3][r & 0xffu] ^ table[2][(r >> 8) & 0xffu] ^ table[1][(r >> 16) & 0xffu] ^ table[0][r >> 24];
    }
    while (p < end) r = (r >> 8) ^ table[0][(r ^ *p++) & 0xffu];

    sums[tid] = crc_shift(r, (u64)(CRC_THREADS - 1 - tid), pw);
    __syncthreads();
    for (int half = CRC_THREADS / 2; half > 0; half >>= 1) {
        if (tid < half) sums[tid] ^= sums[tid + half];
        __syncthreads();
    }
    if (tid == 0) {
        // Past the blocks after this one: CRC_THREADS = 2^8 chunks each.
        u32 v = crc_shift(sums[0], (u64)(gridDim.x - 1 - blockIdx.x), pw + 8);
        partials[blockIdx.x] = blockIdx.x == 0 ? v ^ start_term : v;
    }
}

// out[0] = the XOR of partials[0..n): one block of CRC_THREADS.
extern "C" __global__ void crc32_finish(const u32* partials, int n, u32* out) {
    __shared__ u32 sums[CRC_THREADS];
    int tid = threadIdx.x;
    u32 v = 0;
    for (int i = tid; i < n; i += CRC_THREADS) v ^= partials[i];
    sums[tid] = v;
    __syncthreads();
    for (int half = CRC_THREADS / 2; half > 0; half >>= 1) {
        if (tid < half) sums[tid] ^= sums[tid + half];
        __syncthreads();
    }
    if (tid == 0) out[0] = sums[0];
}
