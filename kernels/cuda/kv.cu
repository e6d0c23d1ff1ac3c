// The paged KV arena: writing new tokens' keys and values into their slots,
// and packing / installing whole blocks for the second tier and the transport.

// Row t of k and v (token_elems each) goes to slot (slots[2t], slots[2t+1]) =
// (block, slot) of `layer`. One thread block per token.
template <int D>
__device__ void kv_write_impl(void* arena, const float* k, const float* v, const u32* slots, int layer, int layers, int block_tokens, int token_elems) {
    u32 block = slots[2 * blockIdx.x];
    int slot = (int)slots[2 * blockIdx.x + 1];
    u64 kb = kv_index(block, layer, layers, 0, slot, block_tokens, token_elems);
    u64 vb = kv_index(block, layer, layers, 1, slot, block_tokens, token_elems);
    const float* kr = k + (u64)blockIdx.x * token_elems;
    const float* vr = v + (u64)blockIdx.x * token_elems;
    for (int i = threadIdx.x; i < token_elems; i += blockDim.x) {
        kv_store<D>(arena, kb + i, kr[i]);
        kv_store<D>(arena, vb + i, vr[i]);
    }
}

#define KV_WRITE(name, D)                                                                                   \
    extern "C" __global__ void name(void* arena, const float* k, const float* v, const u32* slots, int layer, \
                                    int layers, int block_tokens, int token_elems) {                        \
        kv_write_impl<D>(arena, k, v, slots, layer, layers, block_tokens, token_elems);                     \
    }
KV_WRITE(kv_write_f32, KV_F32)
KV_WRITE(kv_write_f16, KV_F16)
KV_WRITE(kv_write_bf16, KV_BF16)
KV_WRITE(kv_write_e4m3, KV_E4M3)

// Gathers layers [l0, l1) of blocks[0..] into one contiguous buffer, block
// after block (a block's layers are contiguous in the arena). Sizes are in
// 32-bit words. Grid: (x: any, y: block index in the list).
extern "C" __global__ void kv_pack(const u32* arena, const u32* blocks, u64 words_per_block_layer, int layers, int l0, int l1, u32* out) {
    u64 span = (u64)(l1 - l0) * words_per_block_layer;
    const u32* src = arena + ((u64)blocks[blockIdx.y] * layers + l0) * words_per_block_layer;
    u32* dst = out + (u64)blockIdx.y * span;
    FOR_EACH(i, span) dst[i] = src[i];
}

// The inverse of kv_pack: installs received layers into reserved blocks.
extern "C" __global__ void kv_unpack(u32* arena, const u32* blocks, u64 words_per_block_layer, int layers, int l0, int l1, const u32* packed) {
    u64 span = (u64)(l1 - l0) * words_per_block_layer;
    u32* dst = arena + ((u64)blocks[blockIdx.y] * layers + l0) * words_per_block_layer;
    const u32* src = packed + (u64)blockIdx.y * span;
    FOR_EACH(i, span) dst[i] = src[i];
}

// kv_unpack with each block's packed layers anywhere on the device: block
// i's source starts at the address srcs[2i] | srcs[2i+1] << 32 (a frame in a
// GPU-memory RDMA ring, 4-byte aligned), not at packed + i * span.
extern "C" __global__ void kv_unpack_from(u32* arena, const u32* blocks, u64 words_per_block_layer, int layers, int l0, int l1, const u32* srcs) {
    u64 span = (u64)(l1 - l0) * words_per_block_layer;
    u32* dst = arena + ((u64)blocks[blockIdx.y] * layers + l0) * words_per_block_layer;
    const u32* src = (const u32*)((u64)srcs[2 * blockIdx.y] | (u64)srcs[2 * blockIdx.y + 1] << 32);
    FOR_EACH(i, span) dst[i] = src[i];
}
