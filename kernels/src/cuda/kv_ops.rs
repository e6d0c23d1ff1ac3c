//! KV writes into the arena and the pipelined export of one layer's blocks.
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
}
