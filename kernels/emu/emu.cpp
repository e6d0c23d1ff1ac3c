// The scheduler behind emu.hpp: thread blocks one at a time, their threads
// as ucontext fibers released together at barriers and, warp by warp, at
// warp-wide operations (shuffles, ldmatrix, mma); and cp.async's deferred copies.

#include "emu.hpp"

#include <ucontext.h>

#include <memory>
#include <string>
#include <vector>

namespace emu {

thread_local const dim3* current_thread_idx;
thread_local dim3 block_idx, block_dim, grid_dim;
thread_local unsigned char* dynamic_shared;

namespace {

enum class State { Ready, AtBarrier, AtWarpOp, Done };

// One fiber's pending cp.async copies, by commit group (oldest first).
struct AsyncCopy {
    void* dst;
    const void* src;
    size_t bytes;
};

struct Fiber {
    ucontext_t context;
    dim3 idx;
    State state;
    // At a warp-wide operation: what it is and this lane's operands (warp_op).
    WarpOp op;
    void* operands;
    std::vector<AsyncCopy> open_group;
    std::vector<std::vector<AsyncCopy>> committed;
};

struct Block {
    std::vector<Fiber> fibers;
    ucontext_t scheduler;
    Fiber* current;
    const std::function<void()>* kernel;
};

thread_local Block* active;
thread_local std::string error;

// Stack of one fiber: the kernels keep a few dozen locals at most.
constexpr size_t STACK_BYTES = 64 << 10;

void fiber_main() {
    (*active->kernel)();
    active->current->state = State::Done;  // returns to uc_link, the scheduler
}

void wait_as(State s) {
    Fiber* f = active->current;
    f->state = s;
    swapcontext(&f->context, &active->scheduler);
}

// Runs each warp as far as it can go (through its shuffles, up to the next
// barrier) before the next warp starts, in ascending warp order in one
// barrier phase and descending in the next. Real warps interleave in any
// order; running one far ahead of the others is the order most likely to
// expose a missing __syncthreads (a warp overwriting shared memory another
// has not read yet). False on a deadlock or a shuffle without a whole warp.
bool run_block(Block& b, std::vector<std::unique_ptr<char[]>>& stacks) {
    size_t n = b.fibers.size();
    for (size_t i = 0; i < n; i++) {
        Fiber& f = b.fibers[i];
        f.idx = dim3{(unsigned)(i % block_dim.x), (unsigned)(i / block_dim.x % block_dim.y), (unsigned)(i / (block_dim.x * block_dim.y))};
        f.state = State::Ready;
        f.open_group.clear();
        f.committed.clear();
        getcontext(&f.context);
        f.context.uc_stack.ss_sp = stacks[i].get();
        f.context.uc_stack.ss_size = STACK_BYTES;
        f.context.uc_link = &b.scheduler;
        makecontext(&f.context, fiber_main, 0);
    }
    size_t warps = (n + 31) / 32;
    for (size_t phase = 0;; phase++) {
        for (size_t k = 0; k < warps; k++) {
            size_t w = (phase % 2 == 0 ? k : warps - 1 - k) * 32, end = w + 32 < n ? w + 32 : n;
            for (;;) {
                for (size_t i = w; i < end; i++) {
                    Fiber& f = b.fibers[i];
                    if (f.state != State::Ready) continue;
                    b.current = &f;
                    current_thread_idx = &f.idx;
                    swapcontext(&b.scheduler, &f.context);
                }
                size_t at_op = 0, live = 0;
                for (size_t i = w; i < end; i++) {
                    at_op += b.fibers[i].state == State::AtWarpOp;
                    live += b.fibers[i].state != State::Done;
                }
                if (at_op == 0 || at_op != live) break;  // at the barrier, finished, or a deadlock (reported below)
                if (at_op != 32) {
                    error = std::string("a warp ") + b.fibers[w].op.name + " in a warp of " + std::to_string(at_op) +
                            " threads (the block size is not a multiple of 32, or lanes exited)";
                    return false;
                }
                void* lanes[32];
                for (size_t i = w; i < end; i++) {
                    if (b.fibers[i].op.apply != b.fibers[w].op.apply) {
                        error = std::string("lanes of one warp at different warp operations (") + b.fibers[w].op.name + " and " + b.fibers[i].op.name + ")";
                        return false;
                    }
                    lanes[i - w] = b.fibers[i].operands;
                }
                b.fibers[w].op.apply(lanes);
                for (size_t i = w; i < end; i++) b.fibers[i].state = State::Ready;
            }
        }
        size_t done = 0, at_barrier = 0;
        for (const Fiber& f : b.fibers) {
            done += f.state == State::Done;
            at_barrier += f.state == State::AtBarrier;
        }
        if (done == n) return true;
        if (at_barrier != n - done) {
            error = "deadlock in block (" + std::to_string(block_idx.x) + ", " + std::to_string(block_idx.y) + ", " + std::to_string(block_idx.z) +
                    "): " + std::to_string(at_barrier) + " threads at __syncthreads, " + std::to_string(n - done - at_barrier) +
                    " at a warp shuffle their warp never completes, " + std::to_string(done) + " finished";
            return false;
        }
        for (Fiber& f : b.fibers) {
            if (f.state == State::AtBarrier) f.state = State::Ready;
        }
    }
}

}  // namespace

void syncthreads() { wait_as(State::AtBarrier); }

void warp_op(WarpOp op, void* operands) {
    Fiber* f = active->current;
    f->op = op;
    f->operands = operands;
    wait_as(State::AtWarpOp);
}

namespace {

struct Shuffle {
    float in, out;
    int mask;
};

void apply_shuffle(void** lanes) {
    for (int i = 0; i < 32; i++) {
        Shuffle* s = (Shuffle*)lanes[i];
        s->out = ((Shuffle*)lanes[i ^ (s->mask & 31)])->in;
    }
}

}  // namespace

float shfl_xor(float v, int lane_mask) {
    Shuffle s{v, 0.f, lane_mask};
    warp_op(WarpOp{"shuffle", apply_shuffle}, &s);
    return s.out;
}

void cp_async(void* dst, const void* src, size_t bytes) { active->current->open_group.push_back(AsyncCopy{dst, src, bytes}); }

void cp_async_commit() {
    Fiber* f = active->current;
    f->committed.push_back(std::move(f->open_group));
    f->open_group.clear();
}

// Copies land only here, all but the newest `pending` groups: shared memory
// read before its wait (and the barrier after it) holds the previous data.
void cp_async_wait(int pending) {
    Fiber* f = active->current;
    while (f->committed.size() > (size_t)pending) {
        for (const AsyncCopy& c : f->committed.front()) memcpy(c.dst, c.src, c.bytes);
        f->committed.erase(f->committed.begin());
    }
}

int run(const Launch& l, const std::function<void()>& kernel) {
    size_t threads = (size_t)l.block[0] * l.block[1] * l.block[2];
    if (threads == 0 || threads > 1024 || l.grid[0] == 0 || l.grid[1] == 0 || l.grid[2] == 0) {
        error = "invalid launch geometry";
        return -1;
    }
    std::vector<std::unique_ptr<char[]>> stacks;
    for (size_t i = 0; i < threads; i++) stacks.emplace_back(new char[STACK_BYTES]);
    std::vector<unsigned char> shared(l.shared_bytes + 16);
    Block b;
    b.fibers.resize(threads);
    b.kernel = &kernel;
    Block* outer = active;
    active = &b;
    block_dim = dim3{l.block[0], l.block[1], l.block[2]};
    grid_dim = dim3{l.grid[0], l.grid[1], l.grid[2]};
    dynamic_shared = shared.data();
    int rc = 0;
    for (unsigned z = 0; z < l.grid[2] && rc == 0; z++) {
        for (unsigned y = 0; y < l.grid[1] && rc == 0; y++) {
            for (unsigned x = 0; x < l.grid[0] && rc == 0; x++) {
                block_idx = dim3{x, y, z};
                if (!run_block(b, stacks)) rc = -1;
            }
        }
    }
    active = outer;
    return rc;
}

float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0x1f) return bits_to_float(sign | 0x7f800000u | (m << 13));  // inf, NaN (payload kept)
    if (e != 0) return bits_to_float(sign | ((e + 112) << 23) | (m << 13));
    float v = (float)m * 5.9604644775390625e-8f;  // subnormal: m * 2^-24, exact in f32
    return sign ? -v : v;
}

uint16_t f32_to_f16(float f) {
    uint32_t u = float_to_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));  // NaN stays NaN (quiet)
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);  // rounds to or beyond 65520: infinity
    if (a >= 0x38800000u) {  // normal in f16 (>= 2^-14)
        uint32_t r = a - 0x38000000u;  // rebias exponent 127 -> 15
        uint32_t half = r >> 13, rest = r & 0x1fffu;
        if (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) half++;
        return (uint16_t)(sign | half);
    }
    // Subnormal or zero in f16: a multiple of 2^-24, rounded to nearest even.
    float q = nearbyintf(bits_to_float(a) * 16777216.0f);  // exact scaling by 2^24
    return (uint16_t)(sign | (uint16_t)q);
}

}  // namespace emu

extern "C" const char* baton_emu_last_error() { return emu::error.c_str(); }
