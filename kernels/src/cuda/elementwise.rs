//! The row and elementwise launches: embedding, RMSNorm, RoPE, the gated
//! activations, residual and bias adds, scaling and row gathers.

use super::*;

impl CudaBackend {
    pub(super) fn launch_embed(&self, table: &CudaMatrix, tokens: &[u32], out: &mut CudaSlice<f32>) {
        if tokens.is_empty() {
            return;
        }
        assert!(tokens.iter().all(|&t| (t as usize) < table.n), "token beyond the embedding table ({})", table.n);
        self.ensure_len(out, tokens.len() * table.k);
        let mut s = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(a) = s.active.as_mut() {
            a.limits.tokens(table.n);
        }
        let uploaded;
        let ids = match s.step() {
            Some((a, words)) => words.slice(a.layout.tokens.clone()),
            None => match self.upload_u32(tokens) {
                Some(ids) => {
                    uploaded = ids;
                    uploaded.view()
                }
                None => return,
            },
        };
        let width = table.k as i32;
        let mut b = self.stream.launch_builder(&self.k.embed_bf16);
        args::embed_bf16(&mut b, &table.w, &ids, &width, out);
        unsafe { b.launch(config(plan::per_row(tokens.len(), ROW_THREADS))) }.unwrap_or_else(|e| fail("embed_bf16", e));
    }

    pub(super) fn launch_rmsnorm(&self, x: &CudaSlice<f32>, weight: &CudaSlice<f32>, eps: f32, rows: usize, dim: usize, out: &mut CudaSlice<f32>) {
        if rows == 0 {
            return;
        }
        self.ensure_len(out, rows * dim);
        let dim_i = dim as i32;
        let mut b = self.stream.launch_builder(&self.k.rmsnorm);
        args::rmsnorm(&mut b, x, weight, &eps, &dim_i, out);
        unsafe { b.launch(config(plan::per_row(rows, ROW_THREADS))) }.unwrap_or_else(|e| fail("rmsnorm", e));
    }

    pub(super) fn launch_apply_rope(&self, rope: &CudaRope, x: &mut CudaSlice<f32>, positions: &[u32], heads: usize) {
        if positions.is_empty() {
            return;
        }
        if let Some(&p) = positions.iter().find(|&&p| p as usize >= rope.max_pos) {
            panic!("position {p} beyond the rope table ({})", rope.max_pos);
        }
        let mut s = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(a) = s.active.as_mut() {
            a.limits.positions(rope.max_pos);
        }
        let pos = match s.active.is_some() {
            true => s.step().map(|(a, words)| words.slice(a.layout.positions.clone())).expect("a step is active"),
            false => s.rope_positions.get(&self.stream, &self.capture, positions).slice(..),
        };
        let (heads_i, half_i) = (heads as i32, rope.half as i32);
        let mut b = self.stream.launch_builder(&self.k.rope);
        args::rope(&mut b, x, &rope.cos, &rope.sin, &pos, &heads_i, &half_i);
        unsafe { b.launch(config(plan::per_row(positions.len(), TOKEN_THREADS))) }.unwrap_or_else(|e| fail("rope", e));
    }

    pub(super) fn launch_silu_mul(&self, gate: &CudaSlice<f32>, up: &CudaSlice<f32>, len: usize, out: &mut CudaSlice<f32>) {
        if len == 0 {
            return;
        }
        self.ensure_len(out, len);
        let n = len as u64;
        let mut b = self.stream.launch_builder(&self.k.silu_mul);
        args::silu_mul(&mut b, gate, up, out, &n);
        unsafe { b.launch(config(plan::elementwise(len))) }.unwrap_or_else(|e| fail("silu_mul", e));
    }

    pub(super) fn launch_gelu_mul(&self, gate: &CudaSlice<f32>, up: &CudaSlice<f32>, len: usize, out: &mut CudaSlice<f32>) {
        if len == 0 {
            return;
        }
        self.ensure_len(out, len);
        let n = len as u64;
        let mut b = self.stream.launch_builder(&self.k.gelu_mul);
        args::gelu_mul(&mut b, gate, up, out, &n);
        unsafe { b.launch(config(plan::elementwise(len))) }.unwrap_or_else(|e| fail("gelu_mul", e));
    }

    pub(super) fn launch_add_rows(&self, x: &mut CudaSlice<f32>, bias: &CudaSlice<f32>, rows: usize, width: usize) {
        if rows == 0 || width == 0 {
            return;
        }
        assert!(x.len() >= rows * width && bias.len() >= width, "add_rows: {rows} rows of {width} past the tensors");
        let (n, width_i) = ((rows * width) as u64, width as i32);
        let mut b = self.stream.launch_builder(&self.k.add_rows);
        args::add_rows(&mut b, x, bias, &n, &width_i);
        unsafe { b.launch(config(plan::elementwise(rows * width))) }.unwrap_or_else(|e| fail("add_rows", e));
    }

    pub(super) fn launch_scale(&self, x: &mut CudaSlice<f32>, s: f32, len: usize) {
        if len == 0 {
            return;
        }
        assert!(x.len() >= len, "scale: {len} elements past the tensor");
        let n = len as u64;
        let mut b = self.stream.launch_builder(&self.k.scale_inplace);
        args::scale_inplace(&mut b, x, &s, &n);
        unsafe { b.launch(config(plan::elementwise(len))) }.unwrap_or_else(|e| fail("scale_inplace", e));
    }

    pub(super) fn launch_add(&self, x: &mut CudaSlice<f32>, y: &CudaSlice<f32>, len: usize) {
        if len == 0 {
            return;
        }
        let n = len as u64;
        let mut b = self.stream.launch_builder(&self.k.add_inplace);
        args::add_inplace(&mut b, x, y, &n);
        unsafe { b.launch(config(plan::elementwise(len))) }.unwrap_or_else(|e| fail("add_inplace", e));
    }

    pub(super) fn launch_gather_rows(&self, x: &CudaSlice<f32>, width: usize, rows: &[usize], out: &mut CudaSlice<f32>) {
        if rows.is_empty() {
            return;
        }
        self.ensure_len(out, rows.len() * width);
        let s = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
        let uploaded;
        let ids = match s.step() {
            Some((a, words)) => words.slice(a.layout.logit_rows.clone()),
            None => match self.upload_u32(&rows.iter().map(|&r| r as u32).collect::<Vec<_>>()) {
                Some(ids) => {
                    uploaded = ids;
                    uploaded.view()
                }
                None => return,
            },
        };
        let width_i = width as i32;
        let mut b = self.stream.launch_builder(&self.k.gather_rows);
        args::gather_rows(&mut b, x, &ids, &width_i, out);
        unsafe { b.launch(config(plan::per_row(rows.len(), ROW_THREADS))) }.unwrap_or_else(|e| fail("gather_rows", e));
    }
}
