//! KV writes into the arena, the pipelined export of one layer's blocks, and the install
//! of whole blocks from device addresses (GPUDirect RDMA imports).
//! (`kv_pack`/`kv_unpack` and their helpers stay in `mod.rs`.)

use super::*;

impl CudaBackend {
    pub(super) fn launch_kv_write(&self, kv: &mut CudaKv, layer: usize, k: &CudaSlice<f32>, v: &CudaSlice<f32>, slots: &[(u32, u32)]) {
        if slots.is_empty() {
            return;
        }
        let l = kv.layout;
        let mut s = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
        // A step's slots were checked when they were staged (padding rows' mapped to the spare block).
        let flat = match s.active.is_some() {
            true => s.step().map(|(a, words)| words.slice(a.layout.slots.clone())).expect("a step is active"),
            false => {
                assert!(slots.iter().all(|&(b, s)| (b as usize) < kv.blocks && (s as usize) < l.block_tokens), "kv_write: slot out of range");
                let flat: Vec<u32> = slots.iter().flat_map(|&(b, s)| [b, s]).collect();
                s.kv_slots.get(&self.stream, &self.capture, &flat).slice(..)
            }
        };
        let (layer_i, layers_i, bt, te) = (layer as i32, l.layers as i32, l.block_tokens as i32, l.token_elems() as i32);
        let mut b = self.stream.launch_builder(&self.k.kv_write[kv_code(l.dtype)]);
        args::kv_write(&mut b, &mut kv.arena, k, v, &flat, &layer_i, &layers_i, &bt, &te);
        unsafe { b.launch(config(plan::per_row(slots.len(), TOKEN_THREADS))) }.unwrap_or_else(|e| fail("kv_write", e));
    }

    pub(super) fn launch_kv_blocks_layer_out(&self, kv: &CudaKv, blocks: &[usize], layer: usize, block_layer_bytes: usize) -> crate::backend::KvBytes {
        use crate::backend::KvBytes;
        assert_eq!(block_layer_bytes, kv.layout.block_layer_bytes(), "kv_blocks_layer_out: block-layer size");
        assert!(blocks.len() <= 65_535 && blocks.iter().all(|&b| b < kv.blocks) && layer < kv.layout.layers, "kv_blocks_layer_out: block or layer out of range");
        if blocks.is_empty() || block_layer_bytes == 0 {
            return KvBytes::Ready(Vec::new());
        }
        let len = blocks.len() * block_layer_bytes;
        let mut slot = self.layer_out.take(&self.stream, len).unwrap_or_else(|e| fail("allocating a KV export slot", e));
        let ids: Vec<u32> = blocks.iter().map(|&b| b as u32).collect();
        self.pack_into(kv, &ids, &(layer..layer + 1), &mut slot.device);
        self.layer_out.queue_copy(&self.stream, &mut slot, len).unwrap_or_else(|e| fail("queueing a KV layer export", e));
        KvBytes::Pending(Box::new(layer_out::PendingLayer { slot: Some(slot), len, owner: self.layer_out.clone() }))
    }

    /// [`Backend::kv_blocks_in_device`](crate::Backend::kv_blocks_in_device): block
    /// `blocks[i]` from the whole block (every layer, as `kv_pack` lays it out) at device
    /// address `srcs[i]` of this GPU, by `kv_unpack_from`, waited for before returning
    /// (the caller frees the sources then). Declines (`false`, nothing copied) a source
    /// that is not 4-byte aligned: the kernel copies 32-bit words.
    pub(super) fn launch_kv_blocks_in_device(&self, kv: &mut CudaKv, blocks: &[usize], srcs: &[u64]) -> bool {
        assert_eq!(blocks.len(), srcs.len(), "kv_blocks_in_device: one source per block");
        assert!(blocks.iter().all(|&b| b < kv.blocks), "kv_blocks_in_device: block out of range");
        if srcs.iter().any(|&s| s % 4 != 0) {
            return false;
        }
        let l = kv.layout;
        let span = l.block_bytes();
        if blocks.is_empty() || span == 0 {
            return true;
        }
        let (wpbl, nl, l0, l1) = ((l.block_layer_bytes() / 4) as u64, l.layers as i32, 0i32, l.layers as i32);
        let n_words = kv.arena.len() / 4;
        // A launch's grid y walks its blocks: at most 65,535.
        for (ids, addrs) in blocks.chunks(65_535).zip(srcs.chunks(65_535)) {
            // One upload (the id ring holds one list at a time): the ids, then each address as (low, high) words.
            let words: Vec<u32> = ids.iter().map(|&b| b as u32).chain(addrs.iter().flat_map(|&a| [a as u32, (a >> 32) as u32])).collect();
            let uploaded = self.upload_u32(&words).unwrap_or_else(|| fail("kv_blocks_in_device", "called inside a CUDA graph capture"));
            let all = uploaded.view();
            let (id_view, src_view) = (all.slice(..ids.len()), all.slice(ids.len()..));
            // SAFETY: as in kv_unpack (block_layer_bytes % 4 == 0, checked in `kv`).
            let mut arena = unsafe { kv.arena.transmute_mut::<u32>(n_words) }.expect("arena word view");
            let mut b = self.stream.launch_builder(&self.k.kv_unpack_from);
            args::kv_unpack_from(&mut b, &mut arena, &id_view, &wpbl, &nl, &l0, &l1, &src_view);
            // SAFETY: the ids are in range (checked); each source holds a whole block of this
            // GPU's memory, 4-byte aligned, as the trait requires of the caller.
            unsafe { b.launch(config(plan::kv_copy(span, ids.len()))) }.unwrap_or_else(|e| fail("kv_unpack_from", e));
        }
        self.synchronize();
        true
    }
}
