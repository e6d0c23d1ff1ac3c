// The warp-level matrix instructions of the attention kernels, on the CPU:
// each lane's registers are gathered into whole matrices, multiplied, and
// scattered back, with the fragment layouts of the PTX ISA ("Matrix
// fragments for mma.m16n8k16 with floating point type", "ldmatrix"). With
// g = lane / 4 and t = lane % 4 (each register holds two 16-bit elements,
// the lower-numbered column in its low half):
//
//   A (16 x 16, row-major)  a[0]: row g,   columns 2t, 2t+1
//                           a[1]: row g+8, columns 2t, 2t+1
//                           a[2]: row g,   columns 2t+8, 2t+9
//                           a[3]: row g+8, columns 2t+8, 2t+9
//   B (16 x 8, column-major) b[0]: rows 2t, 2t+1 of column g
//                           b[1]: rows 2t+8, 2t+9 of column g
//   C, D (16 x 8, f32)      c[0], c[1]: row g,   columns 2t, 2t+1
//                           c[2], c[3]: row g+8, columns 2t, 2t+1
//
// ldmatrix .x4: lanes 8i..8i+7 give the addresses of the 8 rows (8
// elements, 16 bytes each) of matrix i; register i of lane L holds row L/4,
// columns 2(L%4) and 2(L%4)+1 of matrix i, or with .trans of its transpose.
//
// The products of 16-bit inputs are exact in f32; the emulator adds them to
// the accumulator one at a time in k order. A tensor core's internal order
// and precision differ (the GPU suite judges those), but any fragment or
// index mistake changes the result far beyond that.

#include "emu.hpp"

namespace emu {

namespace {

struct LdMatrix {
    const uint16_t* row;
    bool trans;
    uint32_t out[4];
};

void apply_ldmatrix(void** lanes) {
    uint16_t m[4][8][8];
    for (int i = 0; i < 4; i++) {
        for (int r = 0; r < 8; r++) memcpy(m[i][r], ((LdMatrix*)lanes[8 * i + r])->row, 16);
    }
    for (int lane = 0; lane < 32; lane++) {
        LdMatrix* l = (LdMatrix*)lanes[lane];
        int row = lane / 4, col = 2 * (lane % 4);
        for (int i = 0; i < 4; i++) {
            uint16_t lo = l->trans ? m[i][col][row] : m[i][row][col];
            uint16_t hi = l->trans ? m[i][col + 1][row] : m[i][row][col + 1];
            l->out[i] = (uint32_t)lo | ((uint32_t)hi << 16);
        }
    }
}

struct Mma {
    const uint32_t* a;
    const uint32_t* b;
    float* d;
    bool bf16;
};

float element(uint32_t reg, int half, bool bf16) {
    uint16_t bits = (uint16_t)(half ? reg >> 16 : reg);
    return bf16 ? bits_to_float((uint32_t)bits << 16) : f16_to_f32(bits);
}

void apply_mma(void** lanes) {
    float a[16][16], b[16][8], c[16][8];
    bool bf16 = ((Mma*)lanes[0])->bf16;  // one instruction: every lane's type is the same
    for (int lane = 0; lane < 32; lane++) {
        const Mma* l = (const Mma*)lanes[lane];
        int g = lane / 4, t = lane % 4;
        for (int h = 0; h < 2; h++) {
            a[g][2 * t + h] = element(l->a[0], h, bf16);
            a[g + 8][2 * t + h] = element(l->a[1], h, bf16);
            a[g][2 * t + 8 + h] = element(l->a[2], h, bf16);
            a[g + 8][2 * t + 8 + h] = element(l->a[3], h, bf16);
            b[2 * t + h][g] = element(l->b[0], h, bf16);
            b[2 * t + 8 + h][g] = element(l->b[1], h, bf16);
            c[g][2 * t + h] = l->d[h];
            c[g + 8][2 * t + h] = l->d[2 + h];
        }
    }
    for (int lane = 0; lane < 32; lane++) {
        Mma* l = (Mma*)lanes[lane];
        int g = lane / 4, t = lane % 4;
        for (int e = 0; e < 4; e++) {
            int row = g + (e >> 1) * 8, col = 2 * t + (e & 1);
            float acc = c[row][col];
            for (int k = 0; k < 16; k++) acc += a[row][k] * b[k][col];
            l->d[e] = acc;
        }
    }
}

}  // namespace

void ldmatrix_x4(uint32_t out[4], const void* row, bool trans) {
    LdMatrix l{(const uint16_t*)row, trans, {0, 0, 0, 0}};
    warp_op(WarpOp{trans ? "ldmatrix.trans" : "ldmatrix", apply_ldmatrix}, &l);
    memcpy(out, l.out, sizeof l.out);
}

void mma_m16n8k16(float d[4], const uint32_t a[4], const uint32_t b[2], bool bf16) {
    Mma m{a, b, d, bf16};
    warp_op(WarpOp{"mma", apply_mma}, &m);
}

}  // namespace emu
