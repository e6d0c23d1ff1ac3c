// The CUDA kernels of kernels/cuda, run on the CPU: what the builtins,
// barriers and warp shuffles of CUDA C++ mean, for a test build on a machine
// without a GPU (feature `emu` of baton-kernels; kernels/build.rs compiles
// each .cu file with this header in front of it).
//
// A launch runs its thread blocks one after another. The threads of a block
// are fibers on the calling thread: each runs until it reaches
// __syncthreads() or a warp shuffle, and the scheduler resumes it when the
// whole block is at the barrier, or its whole warp at the shuffle (or
// another warp-wide operation: ldmatrix, mma). Between
// barriers one warp runs as far as it can before the next starts (warps in
// ascending order, then descending after the next barrier), so a missing
// barrier, a shuffle in a divergent warp or a barrier some threads never
// reach show up as wrong values or as a reported deadlock.
//
// It checks the kernels' logic (indexing, reductions, rounding, the order
// of sums), not what only a GPU has: its memory model, the precision of its
// math library and FMA contraction. The GPU suite (bench/gpu/run.sh) stays
// the judge of those.
#pragma once

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <functional>
#include <vector>

namespace emu {

struct dim3 {
    unsigned x, y, z;
};

// The geometry of one launch; `Launch` in kernels/src/emu.rs mirrors it.
struct Launch {
    unsigned grid[3];
    unsigned block[3];
    size_t shared_bytes;
};

extern thread_local const dim3* current_thread_idx;
extern thread_local dim3 block_idx, block_dim, grid_dim;
extern thread_local unsigned char* dynamic_shared;

void syncthreads();

// An operation the 32 lanes of a warp do together (a shuffle, ldmatrix, mma):
// each lane arrives with a pointer to its operands; when the whole warp is
// there, `apply` gets the 32 pointers in lane order and writes the results.
struct WarpOp {
    const char* name;
    void (*apply)(void** lanes);
};
void warp_op(WarpOp op, void* operands);
float shfl_xor(float v, int lane_mask);

// cp.async: `bytes` from global to shared memory, landing only when the
// thread waits for its group (cp_async_wait), so a read before the wait
// sees what was there before, as on a GPU that has not finished the copy.
void cp_async(void* dst, const void* src, size_t bytes);
void cp_async_commit();
void cp_async_wait(int pending);

// Warp-level matrix instructions, on the fragment layouts the PTX ISA gives
// (emu_mma.cpp): ldmatrix .m8n8 .x4 (.trans) of 16-bit elements, and
// mma.m16n8k16 with f32 accumulators and bf16 or f16 inputs.
void ldmatrix_x4(uint32_t out[4], const void* row, bool trans);
void mma_m16n8k16(float d[4], const uint32_t a[4], const uint32_t b[2], bool bf16);
// Runs `kernel` over every thread of every block; 0, or -1 with the reason in last_error().
int run(const Launch& launch, const std::function<void()>& kernel);

inline float bits_to_float(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

inline uint32_t float_to_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

// IEEE binary16 <-> binary32, round to nearest, ties to even (what PTX's
// cvt.rn.f16.f32 and cvt.f32.f16 do).
float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);

}  // namespace emu

#define __global__
// Each .cu file is its own translation unit with its own copy of common.cuh.
#define __device__ static
#define __forceinline__ inline
// One OS thread runs a block's fibers, one block at a time: a thread-local
// static is exactly a block's shared array.
#define __shared__ static thread_local
#define threadIdx (*emu::current_thread_idx)
#define blockIdx (emu::block_idx)
#define blockDim (emu::block_dim)
#define gridDim (emu::grid_dim)
#define __syncthreads() emu::syncthreads()

inline float __shfl_xor_sync(unsigned, float v, int lane_mask) { return emu::shfl_xor(v, lane_mask); }
inline float __int_as_float(int i) { return emu::bits_to_float((uint32_t)i); }
inline float __uint_as_float(unsigned u) { return emu::bits_to_float(u); }
inline unsigned __float_as_uint(float f) { return emu::float_to_bits(f); }
inline unsigned __float2uint_rn(float f) { return (unsigned)nearbyintf(f); }
// An f32 add the GPU compiler may not contract into an FMA; the CPU build has no FMA to contract to.
inline float __fadd_rn(float a, float b) { return a + b; }

template <class T> inline T min(T a, T b) { return b < a ? b : a; }
template <class T> inline T max(T a, T b) { return a < b ? b : a; }
