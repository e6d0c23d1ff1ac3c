//! The CUDA backend: the same [`Backend`] operations on an NVIDIA GPU.
//!
//! - Weights live on the device in bf16 (quantized GGUF tensors are expanded
//!   once at load); matrix products go through cuBLAS (bf16 inputs, f32
//!   accumulation and output) in calls of a fixed number of rows
//!   ([`GEMM_ROWS`]), so a row's result does not depend on its batch.
//!   Activations stay f32 between kernels and are converted to bf16 only as
//!   the input of a product.
//! - Everything else is a kernel of `kernels/cuda/*.cu`, compiled by NVRTC for
//!   the device's architecture on first use and cached (`compile`).
//! - The KV arena is one device allocation with the CPU backend's block layout,
//!   so blocks packed here unpack on a CPU node and the other way round.
//!   Blocks leave and enter it in groups through page-locked host buffers
//!   (`staging`), one DMA per group. A pipelined export's layer leaves during the
//!   forward pass on a side stream, behind the layer's write and beside the compute
//!   that follows (`layer_out`), or stays in device memory for a transport that sends
//!   it from there (GPUDirect RDMA). The block ids a pack or unpack reads, and the index
//!   arrays a forward pass repeats at every layer, reach the device through page-locked
//!   slots into reused device buffers (`id_upload`).
//!
//! - A pure-decode step may run as a CUDA graph captured per batch bucket and
//!   replayed, its inputs in fixed device buffers (`graph`, `step_inputs`).
//!
//! - The `Backend` impl below delegates each launch to a module of its kind:
//!   `attention` (partials and combine), `elementwise` (embedding, norms, RoPE,
//!   gates, adds, gathers), `kv_ops` (KV writes, one layer's export, installs from
//!   device addresses), `fused`.
//!
//! Construction checks for the driver, a GPU, NVRTC and cuBLAS before cudarc
//! is touched (`runtime`), so a machine without them gets an error, not a panic.
//! Device failures after that (a launch error, an ECC fault) panic with the
//! operation's name: the trait's operations cannot fail on the CPU, and a GPU
//! in that state cannot go on serving.

mod args;
mod attention;
pub mod dmabuf;
mod elementwise;
mod kv_ops;
pub mod blas;
pub mod compile;
pub mod graph;
mod fused;
mod id_upload;
mod layer_out;
pub mod nvrtc;
pub mod plan;
pub mod roofline;
mod picks;
mod products;
pub mod runtime;
mod staging;
pub mod step_inputs;

use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig};

use crate::attention::AttnRow;
use crate::backend::{Backend, GreedyRow, KernelError, OptionalOp};
use crate::fused::{Glu, QkNorm};
use crate::kv::{KvDtype, KvLayout};
use crate::matmul::QMatrix;
use crate::ops::RopeTable;
use crate::quant::WeightFormat;
use crate::run_ahead::PendingPicks;
use crate::step::{CaptureGuard, StepInput};
use id_upload::ReusedUpload;

/// Rows of every cuBLAS call: a batch runs as whole calls of this many rows,
/// the last one padded, so cuBLAS chooses the same kernel for every call with
/// a given weight matrix and a row's result has the same bits alone as in any
/// batch (the CPU backend's determinism contract). 128 rows of bf16 make about
/// 128 FLOP per weight byte, under the H100/H200 balance point, so a decode
/// step still costs one read of the weights up to 128 sequences.
pub const GEMM_ROWS: usize = 128;

pub use plan::ATTN_PART;
use plan::{AttentionPlan, AttnKernel, Geometry, ROW_THREADS, TOKEN_THREADS};

fn cuda_error(op: &str, e: impl std::fmt::Debug) -> KernelError {
    KernelError::BackendUnavailable { backend: "cuda", reason: format!("{op}: {e:?}") }
}

/// A device failure in an infallible trait operation (see the module comment).
#[track_caller]
fn fail(op: &str, e: impl std::fmt::Debug) -> ! {
    // Kernels run asynchronously: a fault shows at the next call, which may not be its cause.
    panic!("CUDA backend: {op} failed: {e:?} (an earlier kernel's fault surfaces at the next call; CUDA_LAUNCH_BLOCKING=1 names the kernel)")
}

/// A weight matrix: `n` rows of `k` bf16 values, row-major, on the device.
pub struct CudaMatrix {
    pub n: usize,
    pub k: usize,
    w: CudaSlice<u16>,
}

/// The paged KV arena on the device.
pub struct CudaKv {
    pub layout: KvLayout,
    pub blocks: usize,
    arena: CudaSlice<u8>,
}

/// Rotary cos/sin tables on the device (the CPU backend's angles).
pub struct CudaRope {
    half: usize,
    max_pos: usize,
    cos: CudaSlice<f32>,
    sin: CudaSlice<f32>,
}

/// The kernels of one device, by name.
struct Kernels {
    rmsnorm: CudaFunction,
    rope: CudaFunction,
    silu_mul: CudaFunction,
    gelu_mul: CudaFunction,
    add_inplace: CudaFunction,
    add_rows: CudaFunction,
    scale_inplace: CudaFunction,
    to_bf16: CudaFunction,
    gather_rows: CudaFunction,
    embed_bf16: CudaFunction,
    fill_uniform_bf16: CudaFunction,
    /// Indexed by [`kv_code`].
    kv_write: [CudaFunction; 4],
    kv_pack: CudaFunction,
    kv_unpack: CudaFunction,
    /// `kv_unpack` from sources anywhere on the device ([`Backend::kv_blocks_in_device`]).
    kv_unpack_from: CudaFunction,
    attn_partial: [CudaFunction; 4],
    attn_partial_tiled: [CudaFunction; 4],
    /// The tensor-core kernels (sm_80 on), indexed by [`mma_index`]; `None` before sm_80.
    attn_mma: Option<Vec<CudaFunction>>,
    attn_combine: CudaFunction,
    attn_combine_bf16: CudaFunction,
    argmax_rows: CudaFunction,
    softmax_rows: CudaFunction,
    fused: fused::FusedKernels,
}

/// Device buffers reused across calls (one forward pass runs at a time).
#[derive(Default)]
struct Scratch {
    acts_bf16: Option<CudaSlice<u16>>,
    part_acc: Option<CudaSlice<f32>>,
    part_ml: Option<CudaSlice<f32>>,
    /// Index arrays of the last call of each kind: the layers of a forward pass
    /// repeat them (`AttentionPlan::index_words`, rope's positions, kv_write's slots).
    attn_index: ReusedUpload,
    rope_positions: ReusedUpload,
    kv_slots: ReusedUpload,
    /// Each captured step shape's inputs (`graph`), and the step under way.
    step_words: std::collections::HashMap<graph::GraphKey, CudaSlice<u32>>,
    active: Option<graph::ActiveStep>,
}

impl Scratch {
    /// The step under way's inputs, where a kernel reads them instead of the host's slices.
    fn step(&self) -> Option<(&graph::ActiveStep, &CudaSlice<u32>)> {
        self.active.as_ref().map(|a| (a, &self.step_words[&a.key]))
    }
}

/// Where the tensor-core kernel for a KV type and head size sits in
/// `Kernels::attn_mma` (`attn_mma_{f16,bf16,e4m3}_d{32,64,128}`); `None` for
/// f32 KV, which keeps the CUDA-core kernels' full precision.
fn mma_index(dtype: KvDtype, head_dim: usize) -> Option<usize> {
    let d = match dtype {
        KvDtype::F16 => 0,
        KvDtype::BF16 => 1,
        KvDtype::F8E4M3 => 2,
        KvDtype::F32 => return None,
    };
    Some(d * plan::MMA_HEAD_DIMS.len() + plan::MMA_HEAD_DIMS.iter().position(|&h| h == head_dim)?)
}

/// The number the kernels use for a KV element type (`KV_*` in common.cuh).
fn kv_code(dtype: KvDtype) -> usize {
    match dtype {
        KvDtype::F32 => 0,
        KvDtype::F16 => 1,
        KvDtype::BF16 => 2,
        KvDtype::F8E4M3 => 3,
    }
}

pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// cuBLAS handles: the main stream's and the side streams' (`products`).
    products: Mutex<products::Products>,
    k: Kernels,
    scratch: Mutex<Scratch>,
    /// Page-locked host buffers for KV blocks that leave or enter the arena.
    staging: Mutex<staging::Staging>,
    /// Index lists (block ids, an eager step's tokens and rows) on their way to the device.
    ids: Mutex<id_upload::PinnedIds>,
    /// Captured decode steps (`graph`), and the guard that keeps allocations out of a capture.
    graphs: Mutex<graph::Graphs>,
    capture: CaptureGuard,
    /// Whether the main stream can be captured (not the legacy default stream).
    capturable: bool,
    /// Whether [`Backend::greedy_rows`] samples here (`BATON_DEVICE_SAMPLING`).
    device_sampling: bool,
    /// Whether greedy picks may feed the next step on the device (`BATON_RUN_AHEAD`;
    /// with graphs and device sampling only).
    run_ahead: bool,
    /// The latest greedy picks and their way to the host.
    picks: Mutex<picks::Picks>,
    /// The side stream and buffers of pipelined layer exports.
    layer_out: Arc<layer_out::LayerOut>,
    name: String,
    arch: &'static str,
    driver: runtime::DriverInfo,
}

fn grow<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(stream: &Arc<CudaStream>, guard: &CaptureGuard, buf: &mut Option<CudaSlice<T>>, len: usize, op: &'static str) {
    // Refused during a capture: the capture is thrown away and the step rerun eagerly, which grows it.
    if buf.as_ref().is_none_or(|b| b.len() < len) && guard.alloc(op) {
        *buf = None; // free before allocating the larger one
        *buf = Some(stream.alloc_zeros::<T>(len.max(1)).unwrap_or_else(|e| fail(op, e)));
    }
}

/// The launch configuration of a plan's geometry.
fn config(g: Geometry) -> LaunchConfig {
    LaunchConfig { grid_dim: g.grid, block_dim: (g.block, 1, 1), shared_mem_bytes: g.shared_bytes }
}

/// Consecutive index ranges of `n` items of `span` bytes, as many per range as
/// fit `capacity`, and at most 65,535 (a group is one launch's grid y).
fn staging_groups(n: usize, span: usize, capacity: usize) -> Vec<std::ops::Range<usize>> {
    let per = (capacity / span).clamp(1, 65_535);
    (0..n).step_by(per).map(|s| s..(s + per).min(n)).collect()
}

impl CudaBackend {
    /// At least `bytes` of this GPU's memory exported as a dma-buf, for a NIC to register
    /// (GPUDirect RDMA); fails naming the reason where the GPU or driver cannot export.
    pub fn dmabuf(&self, bytes: usize) -> Result<dmabuf::DmaBuf, KernelError> {
        dmabuf::DmaBuf::new(&self.ctx, bytes)
    }

    /// Opens GPU `ordinal`, compiling (or loading cached) kernels for its architecture.
    pub fn new(ordinal: usize) -> Result<Self, KernelError> {
        let driver = runtime::check_cuda()?;
        if ordinal >= driver.devices as usize {
            return Err(cuda_error("opening the GPU", format!("GPU {ordinal} requested; the driver sees {}", driver.devices)));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| cuda_error("creating a context", e))?;
        // One main stream, ordered by hand with the side streams (`products`): cudarc's
        // per-buffer events would add waits on events recorded outside a graph capture.
        // SAFETY: before any buffer of this context exists.
        unsafe { ctx.disable_event_tracking() };
        let graphs_on = graph::graphs_enabled().map_err(|e| cuda_error("reading BATON_CUDA_GRAPHS", e))?;
        let device_sampling = crate::backend::device_sampling_enabled().map_err(|e| cuda_error("reading BATON_DEVICE_SAMPLING", e))?;
        let run_ahead = crate::run_ahead::run_ahead_enabled().map_err(|e| cuda_error("reading BATON_RUN_AHEAD", e))? && graphs_on && device_sampling;
        let (major, minor) = ctx.compute_capability().map_err(|e| cuda_error("reading the compute capability", e))?;
        let arch = compile::arch_for(major, minor)?;
        let name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        let mut modules = std::collections::HashMap::new();
        for (module, ptx) in compile::compile_all(arch)? {
            modules.insert(module, ctx.load_module(ptx).map_err(|e| cuda_error(&format!("loading {module}.cu"), e))?);
        }
        let get = |module: &str, f: &str| -> Result<CudaFunction, KernelError> {
            modules[module].load_function(f).map_err(|e| cuda_error(&format!("finding {f} in {module}.cu"), e))
        };
        let k = Kernels {
            rmsnorm: get("norm", "rmsnorm")?,
            rope: get("rope", "rope")?,
            silu_mul: get("elementwise", "silu_mul")?,
            gelu_mul: get("elementwise", "gelu_mul")?,
            add_inplace: get("elementwise", "add_inplace")?,
            add_rows: get("elementwise", "add_rows")?,
            scale_inplace: get("elementwise", "scale_inplace")?,
            to_bf16: get("elementwise", "to_bf16")?,
            gather_rows: get("elementwise", "gather_rows")?,
            embed_bf16: get("elementwise", "embed_bf16")?,
            fill_uniform_bf16: get("elementwise", "fill_uniform_bf16")?,
            kv_write: [get("kv", "kv_write_f32")?, get("kv", "kv_write_f16")?, get("kv", "kv_write_bf16")?, get("kv", "kv_write_e4m3")?],
            kv_pack: get("kv", "kv_pack")?,
            kv_unpack: get("kv", "kv_unpack")?,
            kv_unpack_from: get("kv", "kv_unpack_from")?,
            attn_partial: [
                get("attention", "attn_partial_f32")?,
                get("attention", "attn_partial_f16")?,
                get("attention", "attn_partial_bf16")?,
                get("attention", "attn_partial_e4m3")?,
            ],
            attn_partial_tiled: [
                get("attention", "attn_partial_tiled_f32")?,
                get("attention", "attn_partial_tiled_f16")?,
                get("attention", "attn_partial_tiled_bf16")?,
                get("attention", "attn_partial_tiled_e4m3")?,
            ],
            attn_mma: if major >= 8 {
                let mut fs = Vec::new();
                for dtype in ["f16", "bf16", "e4m3"] {
                    for hd in plan::MMA_HEAD_DIMS {
                        let f = get("attention", &format!("attn_mma_{dtype}_d{hd}"))?;
                        // Two buffers of keys and values pass the default 48 KiB of shared memory at head size 128.
                        let bytes = plan::mma_shared_bytes(hd) as i32;
                        f.set_attribute(cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes)
                            .map_err(|e| cuda_error(&format!("allowing attn_mma_{dtype}_d{hd} {bytes} bytes of shared memory"), e))?;
                        fs.push(f);
                    }
                }
                Some(fs)
            } else {
                None
            },
            attn_combine: get("attention", "attn_combine")?,
            attn_combine_bf16: get("attention", "attn_combine_bf16")?,
            argmax_rows: get("sampling", "argmax_rows")?,
            softmax_rows: get("sampling", "softmax_rows")?,
            fused: fused::FusedKernels::load(&get)?,
        };
        // A capture needs a stream of its own; with graphs off, the legacy default stream as before.
        let stream = if graphs_on { ctx.new_stream().map_err(|e| cuda_error("creating a stream", e))? } else { ctx.default_stream() };
        ctx.bind_to_thread().map_err(|e| cuda_error("binding the context", e))?;
        let streams = std::env::var("BATON_CUDA_GEMM_STREAMS").ok().and_then(|v| v.parse::<usize>().ok()).unwrap_or(products::DEFAULT_STREAMS).max(1);
        let products = products::Products::new(&ctx, stream.cu_stream(), streams)?;
        let staging = staging::Staging::new(&ctx, &stream, staging::STAGING_BYTES).map_err(|e| cuda_error("allocating KV staging", e))?;
        let graphs = graph::Graphs::new(&ctx, graphs_on).map_err(|e| cuda_error("allocating step staging", e))?;
        let layer_out = Arc::new(layer_out::LayerOut::new(&ctx).map_err(|e| cuda_error("creating the KV export stream", e))?);
        let picks = Mutex::new(picks::Picks::new(&ctx, &stream).map_err(|e| cuda_error("allocating greedy picks", e))?);
        #[rustfmt::skip]
        let backend = CudaBackend { ctx, stream, products: Mutex::new(products), k, scratch: Mutex::new(Scratch::default()), staging: Mutex::new(staging),
            ids: Mutex::new(id_upload::PinnedIds::new(id_upload::SLOTS)), graphs: Mutex::new(graphs), capture: CaptureGuard::default(), capturable: graphs_on, device_sampling, run_ahead, picks, layer_out, name, arch, driver };
        Ok(backend)
    }

    /// The backend with run-ahead decoding on or off whatever `BATON_RUN_AHEAD` said (on
    /// only with graphs and device sampling): A/B comparisons in one process.
    pub fn with_run_ahead(self, on: bool) -> Self {
        let run_ahead = on && self.capturable && self.device_sampling;
        CudaBackend { run_ahead, ..self }
    }

    /// Whether attention over `dtype` KV of heads of `head_dim` runs on the tensor
    /// cores here (sm_80 or later; 16-bit or FP8 KV; a head size they are built
    /// for): its query and probabilities are then rounded to 16 bits.
    pub fn attention_on_tensor_cores(&self, dtype: KvDtype, head_dim: usize) -> bool {
        self.k.attn_mma.is_some() && mma_index(dtype, head_dim).is_some()
    }

    /// Waits for every queued operation (benchmarks time with this).
    pub fn synchronize(&self) {
        self.stream.synchronize().unwrap_or_else(|e| fail("synchronize", e));
    }

    /// `dst[..src.len()] = src` on the device (benchmarks measure bandwidth with it).
    pub fn copy(&self, src: &CudaSlice<f32>, dst: &mut CudaSlice<f32>) {
        assert!(dst.len() >= src.len(), "copy: destination too small");
        self.stream.memcpy_dtod(src, &mut dst.slice_mut(..src.len())).unwrap_or_else(|e| fail("memcpy_dtod", e));
    }

    /// The device address of a tensor's first element, for the operations that take raw
    /// addresses on this GPU ([`Backend::kv_blocks_in_device`], `DmaBuf`'s device copies);
    /// valid while the tensor lives.
    pub fn device_addr(&self, t: &CudaSlice<f32>) -> u64 {
        t.device_ptr(&self.stream).0
    }

    /// The GPU's free and total memory in bytes.
    pub fn memory(&self) -> (usize, usize) {
        self.ctx.bind_to_thread().unwrap_or_else(|e| fail("binding the context", e));
        cudarc::driver::result::mem_get_info().unwrap_or_else(|e| fail("cuMemGetInfo", e))
    }

    /// A matrix of uniform values in `[-scale, scale)` made on the device
    /// (benchmarks of large shapes: no host copy of the weights).
    pub fn random_matrix(&self, n: usize, k: usize, seed: u32, scale: f32) -> Result<CudaMatrix, KernelError> {
        let mut w = self.stream.alloc_zeros::<u16>(n * k).map_err(|e| cuda_error(&format!("allocating a {n} x {k} matrix"), e))?;
        let len = (n * k) as u64;
        let mut b = self.stream.launch_builder(&self.k.fill_uniform_bf16);
        args::fill_uniform_bf16(&mut b, &mut w, &len, &seed, &scale);
        unsafe { b.launch(config(plan::elementwise(n * k))) }.unwrap_or_else(|e| fail("fill_uniform_bf16", e));
        Ok(CudaMatrix { n, k, w })
    }

    /// `data` on the device for kernels queued while the result lives, through page-locked
    /// memory (`id_upload`); `None` during a capture (refused: the op skips its launch, the
    /// capture is thrown away).
    fn upload_u32(&self, data: &[u32]) -> Option<id_upload::Uploaded<'_>> {
        if !self.capture.allow("index upload") {
            return None;
        }
        let ids = self.ids.lock().unwrap_or_else(|p| p.into_inner());
        Some(id_upload::Uploaded::new(ids, &self.stream, data).unwrap_or_else(|e| fail("uploading indices", e)))
    }

    /// Each of the first `rows` rows' greedy token and status (`argmax_rows` in
    /// sampling.cu: the CPU sampler's rules), downloaded: 8 bytes a row instead of the row.
    pub fn argmax_rows(&self, logits: &CudaSlice<f32>, rows: usize, n: usize) -> Vec<GreedyRow> {
        if rows == 0 {
            return Vec::new();
        }
        let mut p = self.picks.lock().unwrap_or_else(|p| p.into_inner());
        self.launch_argmax(&mut p, logits, rows, n);
        let token = self.stream.memcpy_dtov(&p.token.slice(..rows)).unwrap_or_else(|e| fail("argmax_rows download", e));
        let status = self.stream.memcpy_dtov(&p.status.slice(..rows)).unwrap_or_else(|e| fail("argmax_rows download", e));
        self.synchronize();
        token.into_iter().zip(status).map(|(t, s)| GreedyRow::from_kernel(t, s)).collect()
    }

    /// Queues `argmax_rows` of the first `rows` rows into the picks' device buffers.
    fn launch_argmax(&self, p: &mut picks::Picks, logits: &CudaSlice<f32>, rows: usize, n: usize) {
        assert!(logits.len() >= rows * n, "argmax_rows: {rows} rows of {n} in {} logits", logits.len());
        p.reserve(&self.stream, rows).unwrap_or_else(|e| fail("allocating greedy picks", e));
        let n_i = n as i32;
        let mut b = self.stream.launch_builder(&self.k.argmax_rows);
        args::argmax_rows(&mut b, logits, &n_i, &mut p.token, &mut p.status);
        // SAFETY: logits holds rows x n values (checked), the picks a word a row each (reserved).
        unsafe { b.launch(config(plan::per_row(rows, ROW_THREADS))) }.unwrap_or_else(|e| fail("argmax_rows", e));
    }

    /// Row-wise `softmax(logits / temperature)`.
    pub fn softmax_rows(&self, logits: &CudaSlice<f32>, rows: usize, n: usize, temperature: f32, out: &mut CudaSlice<f32>) {
        if rows == 0 {
            return;
        }
        self.ensure_len(out, rows * n);
        let (n_i, inv_t) = (n as i32, 1.0 / temperature);
        let mut b = self.stream.launch_builder(&self.k.softmax_rows);
        args::softmax_rows(&mut b, logits, &n_i, &inv_t, out);
        unsafe { b.launch(config(plan::per_row(rows, ROW_THREADS))) }.unwrap_or_else(|e| fail("softmax_rows", e));
    }

    /// Layers `layers` of `blocks[i]` into `outs[i]` (host memory), through
    /// the page-locked staging buffers, a group of blocks per DMA (`staging`).
    pub fn kv_pack(&self, kv: &CudaKv, blocks: &[u32], layers: std::ops::Range<usize>, outs: &mut [&mut [u8]]) {
        let span = layers.len() * kv.layout.block_layer_bytes();
        assert_eq!(outs.len(), blocks.len(), "kv_pack: one output per block");
        assert!(outs.iter().all(|o| o.len() == span), "kv_pack: an output is not {span} bytes");
        assert!(blocks.iter().all(|&b| (b as usize) < kv.blocks) && layers.end <= kv.layout.layers, "kv_pack: block or layer out of range");
        if blocks.is_empty() || span == 0 {
            return;
        }
        let mut st = self.staging(span);
        let groups = staging_groups(blocks.len(), span, st.capacity());
        // Queue group g's pack and DMA into buffer g % 2, then copy group g - 1
        // out of the other buffer while the GPU works.
        self.pack_group(kv, &blocks[groups[0].clone()], &layers, &mut st, 0);
        for (g, range) in groups.iter().enumerate() {
            if let Some(next) = groups.get(g + 1) {
                self.pack_group(kv, &blocks[next.clone()], &layers, &mut st, (g + 1) % 2);
            }
            st.wait(g % 2).unwrap_or_else(|e| fail("kv_pack download", e));
            for (out, packed) in outs[range.clone()].iter_mut().zip(st.host(g % 2).chunks_exact(span)) {
                out.copy_from_slice(packed);
            }
        }
    }

    /// Packs `blocks` into the staging device buffer and queues its DMA into host buffer `half`.
    fn pack_group(&self, kv: &CudaKv, blocks: &[u32], layers: &std::ops::Range<usize>, st: &mut staging::Staging, half: usize) {
        let span = layers.len() * kv.layout.block_layer_bytes();
        self.pack_into(kv, blocks, layers, &mut st.device);
        st.download(&self.stream, half, blocks.len() * span).unwrap_or_else(|e| fail("kv_pack download", e));
    }

    /// Queues the pack of layers `layers` of `blocks` into `out` on the compute stream.
    fn pack_into(&self, kv: &CudaKv, blocks: &[u32], layers: &std::ops::Range<usize>, out: &mut CudaSlice<u32>) {
        let l = &kv.layout;
        let span = layers.len() * l.block_layer_bytes();
        let uploaded = self.upload_u32(blocks).unwrap_or_else(|| fail("kv_pack", "called inside a CUDA graph capture"));
        let ids = uploaded.view();
        let (wpbl, nl, l0, l1) = ((l.block_layer_bytes() / 4) as u64, l.layers as i32, layers.start as i32, layers.end as i32);
        let cfg = config(plan::kv_copy(span, blocks.len()));
        // SAFETY: the arena's bytes are viewed as words (block_layer_bytes % 4 == 0, checked in `kv`).
        let arena = unsafe { kv.arena.transmute::<u32>(kv.arena.len() / 4) }.expect("arena word view");
        let mut b = self.stream.launch_builder(&self.k.kv_pack);
        args::kv_pack(&mut b, &arena, &ids, &wpbl, &nl, &l0, &l1, out);
        unsafe { b.launch(cfg) }.unwrap_or_else(|e| fail("kv_pack", e));
    }

    /// Installs `data[i]` (laid out as [`Self::kv_pack`] writes it) into layers
    /// `layers` of `blocks[i]`, a group of blocks per DMA. `data` may be freed
    /// as soon as this returns.
    pub fn kv_unpack(&self, kv: &mut CudaKv, blocks: &[u32], layers: std::ops::Range<usize>, data: &[&[u8]]) {
        let l = kv.layout;
        let span = layers.len() * l.block_layer_bytes();
        assert_eq!(data.len(), blocks.len(), "kv_unpack: one input per block");
        assert!(data.iter().all(|d| d.len() == span), "kv_unpack: an input is not {span} bytes");
        assert!(blocks.iter().all(|&b| (b as usize) < kv.blocks) && layers.end <= l.layers, "kv_unpack: block or layer out of range");
        if blocks.is_empty() || span == 0 {
            return;
        }
        let mut st = self.staging(span);
        let (wpbl, nl, l0, l1) = ((l.block_layer_bytes() / 4) as u64, l.layers as i32, layers.start as i32, layers.end as i32);
        let n_words = kv.arena.len() / 4;
        for (g, range) in staging_groups(blocks.len(), span, st.capacity()).into_iter().enumerate() {
            // Refill buffer g % 2 once its previous DMA (group g - 2) is done;
            // the GPU meanwhile installs group g - 1.
            st.wait(g % 2).unwrap_or_else(|e| fail("kv_unpack upload", e));
            for (packed, d) in st.host_mut(g % 2).chunks_exact_mut(span).zip(&data[range.clone()]) {
                packed.copy_from_slice(d);
            }
            st.upload(&self.stream, g % 2, range.len() * span).unwrap_or_else(|e| fail("kv_unpack upload", e));
            let uploaded = self.upload_u32(&blocks[range.clone()]).unwrap_or_else(|| fail("kv_unpack", "called inside a CUDA graph capture"));
            let ids = uploaded.view();
            let cfg = config(plan::kv_copy(span, range.len()));
            // SAFETY: as in pack_group.
            let mut arena = unsafe { kv.arena.transmute_mut::<u32>(n_words) }.expect("arena word view");
            let mut b = self.stream.launch_builder(&self.k.kv_unpack);
            args::kv_unpack(&mut b, &mut arena, &ids, &wpbl, &nl, &l0, &l1, &st.device);
            unsafe { b.launch(cfg) }.unwrap_or_else(|e| fail("kv_unpack", e));
        }
    }

    /// The staging buffers, grown (once, for a model whose block is larger
    /// than [`staging::STAGING_BYTES`]) to hold at least one `span`.
    fn staging(&self, span: usize) -> std::sync::MutexGuard<'_, staging::Staging> {
        let mut st = self.staging.lock().unwrap_or_else(|p| p.into_inner());
        if st.capacity() < span {
            let bigger = staging::Staging::new(&self.ctx, &self.stream, span.next_multiple_of(4)).unwrap_or_else(|e| fail("allocating KV staging", e));
            *st = bigger;
        }
        st
    }

    /// `out[..rows][..n] = x[..rows] · wᵀ`, in calls of exactly [`GEMM_ROWS`]
    /// rows: `x` and `out` must hold `rows` rounded up to a multiple of it.
    fn gemm(&self, w: &CudaMatrix, x: &CudaSlice<u16>, rows: usize, out: &mut CudaSlice<f32>) {
        self.gemm_calls(w, x, rows.next_multiple_of(GEMM_ROWS), GEMM_ROWS, out);
    }

    /// `out = x · wᵀ` for the `x.n` rows of a bf16 `x`, in one cuBLAS call:
    /// the batch-dependent shape the backend avoids, for benchmarks that
    /// measure what the matrix units can do.
    pub fn gemm_one_call(&self, w: &CudaMatrix, x: &CudaMatrix, out: &mut CudaSlice<f32>) {
        assert_eq!(w.k, x.k, "gemm_one_call: inner dimensions differ");
        self.ensure_len(out, x.n * w.n);
        self.gemm_calls(w, &x.w, x.n, x.n, out);
    }

    /// `padded` rows (a multiple of `call_rows`) as cuBLAS calls of `call_rows` rows.
    fn gemm_calls(&self, w: &CudaMatrix, x: &CudaSlice<u16>, padded: usize, call_rows: usize, out: &mut CudaSlice<f32>) {
        assert!(padded.is_multiple_of(call_rows) && x.len() >= padded * w.k && out.len() >= padded * w.n, "gemm: buffers shorter than the padded batch");
        let products = self.products.lock().unwrap_or_else(|p| p.into_inner());
        self.ctx.bind_to_thread().unwrap_or_else(|e| fail("binding the context", e));
        let (a, _ra) = w.w.device_ptr(&self.stream);
        let (bx, _rb) = x.device_ptr(&self.stream);
        let (c, _rc) = out.device_ptr_mut(&self.stream);
        products
            .run(padded / call_rows, self.capture.armed(), |handle, chunk| {
                // Row-major out[rows][n] = x[rows][k] · w[n][k]ᵀ is, column-major,
                // out (n x rows) = wᵀ (n x k) · x (k x rows).
                let x_chunk = bx + (chunk * call_rows * w.k * 2) as u64;
                let out_chunk = c + (chunk * call_rows * w.n * 4) as u64;
                // SAFETY: the pointers are live device allocations holding the
                // chunk's rows (checked above), in the handle's context; `run`
                // orders the handle's stream after the main stream's work.
                unsafe {
                    handle.gemm_ex(
                        (blas::OP_T, blas::OP_N),
                        (w.n, call_rows, w.k),
                        1.0,
                        (a as *const c_void, blas::R_16BF, w.k),
                        (x_chunk as *const c_void, blas::R_16BF, w.k),
                        0.0,
                        (out_chunk as *mut c_void, blas::R_32F, w.n),
                    )
                }
                .map_err(|status| format!("cublasStatus {status}"))
            })
            .unwrap_or_else(|e| fail("cublasGemmEx", e));
    }

    /// How many streams a product of many rows may spread its calls over (1 =
    /// the main stream alone), up to the lanes made at start-up; returns the
    /// number set. Results do not depend on it (benchmarks compare).
    pub fn set_gemm_streams(&self, n: usize) -> usize {
        let mut p = self.products.lock().unwrap_or_else(|p| p.into_inner());
        p.streams = n.clamp(1, p.lanes());
        p.streams
    }

    fn upload_bf16(&self, n: usize, k: usize, bits: Vec<u16>) -> Result<CudaMatrix, KernelError> {
        if !self.capture.alloc("a matrix upload") {
            return Err(cuda_error("uploading a matrix", "inside a CUDA graph capture"));
        }
        let w = self.stream.memcpy_stod(&bits).map_err(|e| cuda_error(&format!("uploading a {n} x {k} matrix"), e))?;
        Ok(CudaMatrix { n, k, w })
    }
}

impl Backend for CudaBackend {
    type Tensor = CudaSlice<f32>;
    type Matrix = CudaMatrix;
    type Kv = CudaKv;
    type Rope = CudaRope;

    fn describe(&self) -> String {
        let staging = match &self.staging.lock().unwrap_or_else(|p| p.into_inner()).pageable_because {
            None => "pinned KV staging".to_string(),
            Some(why) => format!("pageable KV staging: {why}"),
        };
        let staging = match &self.ids.lock().unwrap_or_else(|p| p.into_inner()).pageable_because {
            None => staging,
            Some(why) => format!("{staging}, pageable index uploads: {why}"),
        };
        let streams = self.products.lock().unwrap_or_else(|p| p.into_inner()).streams;
        let graphs = match &*self.graphs.lock().unwrap_or_else(|p| p.into_inner()) {
            g if !g.enabled => "decode steps eager".to_string(),
            g => format!("decode steps as CUDA graphs{}", g.pageable_because.as_ref().map_or(String::new(), |why| format!(" (pageable step staging: {why})"))),
        };
        let graphs = match (self.run_ahead, &self.picks.lock().unwrap_or_else(|p| p.into_inner()).pageable_because) {
            (false, _) => graphs,
            (true, None) => format!("{graphs}, run-ahead decoding"),
            (true, Some(why)) => format!("{graphs}, run-ahead decoding (pageable picks, no overlap: {why})"),
        };
        format!(
            "cuda ({}, {}, driver {}.{}, bf16 weights, cuBLAS on {streams} stream{}, {staging}, {graphs})",
            self.name,
            self.arch,
            self.driver.version / 1000,
            self.driver.version % 1000 / 10,
            if streams == 1 { "" } else { "s" },
        )
    }

    fn run<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.ctx.bind_to_thread().unwrap_or_else(|e| fail("binding the context", e));
        f()
    }

    fn matrix(&self, format: WeightFormat, n: usize, k: usize, bytes: &[u8]) -> Result<CudaMatrix, KernelError> {
        // Expand on the host through the CPU backend's decoder (the one
        // reference for every GGUF format), then store bf16 on the device.
        let q = QMatrix::from_ggml(format, n, k, bytes)?;
        let mut bits = vec![0u16; n * k];
        let mut row = vec![0f32; k];
        for r in 0..n {
            q.row_f32(r, &mut row);
            for (o, &v) in bits[r * k..(r + 1) * k].iter_mut().zip(&row) {
                *o = half::bf16::from_f32(v).to_bits();
            }
        }
        self.upload_bf16(n, k, bits)
    }

    fn matrix_from_f32(&self, n: usize, k: usize, w: Vec<f32>) -> Result<CudaMatrix, KernelError> {
        if w.len() != n * k {
            return Err(cuda_error("matrix_from_f32", format!("{} values for a {n} x {k} matrix", w.len())));
        }
        self.upload_bf16(n, k, w.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect())
    }

    fn matrix_bytes(&self, m: &CudaMatrix) -> usize {
        m.n * m.k * 2
    }

    fn kv(&self, layout: KvLayout, blocks: usize) -> Result<CudaKv, KernelError> {
        if !layout.block_layer_bytes().is_multiple_of(4) {
            return Err(cuda_error("allocating the KV arena", "a block's layer must be a whole number of 32-bit words"));
        }
        // One block more than asked: padding rows of captured steps write and read it (`graph`).
        let bytes = layout.block_bytes() * (blocks + 1);
        self.capture.alloc("the KV arena");
        let arena = self.stream.alloc_zeros::<u8>(bytes).map_err(|e| {
            let (free, _) = self.memory();
            cuda_error(&format!("allocating {} MiB of KV blocks ({} MiB free)", bytes >> 20, free >> 20), e)
        })?;
        Ok(CudaKv { layout, blocks, arena })
    }

    fn rope(&self, table: RopeTable) -> CudaRope {
        // A new buffer (and a pageable upload a capture cannot hold): a graph that
        // captured the old tables' addresses must be captured again.
        if !self.capture.alloc("rope tables") {
            fail("uploading rope tables", "inside a CUDA graph capture");
        }
        let (cos, sin) = table.tables();
        let cos = self.stream.memcpy_stod(cos).unwrap_or_else(|e| fail("uploading rope tables", e));
        let sin = self.stream.memcpy_stod(sin).unwrap_or_else(|e| fail("uploading rope tables", e));
        CudaRope { half: table.head_dim / 2, max_pos: table.max_pos, cos, sin }
    }

    fn tensor(&self, len: usize) -> CudaSlice<f32> {
        // A capture's buffers exist before it (`ensure_len` skips growing inside one).
        if !self.capture.alloc("a tensor") {
            fail("allocating a tensor", "inside a CUDA graph capture");
        }
        self.stream.alloc_zeros::<f32>(len.max(1)).unwrap_or_else(|e| fail("allocating a tensor", e))
    }

    fn upload(&self, data: &[f32]) -> CudaSlice<f32> {
        if data.is_empty() {
            return self.tensor(1);
        }
        // Counted like `tensor`: a new buffer, from pageable memory a capture cannot copy.
        if !self.capture.alloc("an upload") {
            fail("uploading a tensor", "inside a CUDA graph capture");
        }
        self.stream.memcpy_stod(data).unwrap_or_else(|e| fail("upload", e))
    }

    fn download(&self, t: &CudaSlice<f32>, out: &mut [f32]) {
        if out.is_empty() {
            return;
        }
        self.stream.memcpy_dtoh(&t.slice(..out.len()), out).unwrap_or_else(|e| fail("download", e));
        self.synchronize();
    }

    fn ensure_len(&self, t: &mut CudaSlice<f32>, len: usize) {
        // Refused during a capture: it is thrown away and the step rerun eagerly, which grows `t`.
        if t.len() < len && self.capture.allow("growing a tensor") {
            *t = self.tensor(len);
        }
    }

    fn embed(&self, table: &CudaMatrix, tokens: &[u32], out: &mut CudaSlice<f32>) {
        self.launch_embed(table, tokens, out)
    }

    fn rmsnorm(&self, x: &CudaSlice<f32>, weight: &CudaSlice<f32>, eps: f32, rows: usize, dim: usize, out: &mut CudaSlice<f32>) {
        self.launch_rmsnorm(x, weight, eps, rows, dim, out)
    }

    fn matmul(&self, x: &CudaSlice<f32>, rows: usize, outs: &mut [(&CudaMatrix, &mut CudaSlice<f32>)]) {
        let Some(k) = outs.first().map(|(w, _)| w.k) else { return };
        assert!(outs.iter().all(|(w, _)| w.k == k), "fused products must share one input width");
        if rows == 0 {
            return;
        }
        // The padding rows keep whatever finite values they held: a product's
        // output row depends on its own input row alone.
        let padded = rows.next_multiple_of(GEMM_ROWS);
        let mut s = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
        grow(&self.stream, &self.capture, &mut s.acts_bf16, padded * k, "bf16 activations");
        let Some(xb) = s.acts_bf16.as_mut().filter(|b| b.len() >= padded * k) else { return };
        let len = (rows * k) as u64;
        let mut b = self.stream.launch_builder(&self.k.to_bf16);
        args::to_bf16(&mut b, x, &mut *xb, &len);
        unsafe { b.launch(config(plan::elementwise(rows * k))) }.unwrap_or_else(|e| fail("to_bf16", e));
        for (w, out) in outs.iter_mut() {
            self.ensure_len(out, padded * w.n);
            self.gemm(w, xb, rows, out);
        }
    }

    fn apply_rope(&self, rope: &CudaRope, x: &mut CudaSlice<f32>, positions: &[u32], heads: usize) {
        self.launch_apply_rope(rope, x, positions, heads)
    }

    fn silu_mul(&self, gate: &CudaSlice<f32>, up: &CudaSlice<f32>, len: usize, out: &mut CudaSlice<f32>) {
        self.launch_silu_mul(gate, up, len, out)
    }

    fn supports(&self, op: OptionalOp) -> bool {
        match op {
            // QK-norm is `rmsnorm` over rows of one head (rows = tokens x heads,
            // dim = head_dim): the row kernel serves it unchanged.
            OptionalOp::GeluMul | OptionalOp::BiasAdd | OptionalOp::Scale | OptionalOp::HeadNorm => true,
            // Every attention kernel masks the keys before a row's window.
            OptionalOp::SlidingWindow => true,
            // Not yet here: an arena whose layer groups map to units (attention, the
            // KV writes and pack/unpack would read and write blocks through the unit map).
            OptionalOp::GroupedKv => false,
        }
    }

    fn gelu_mul(&self, gate: &CudaSlice<f32>, up: &CudaSlice<f32>, len: usize, out: &mut CudaSlice<f32>) {
        self.launch_gelu_mul(gate, up, len, out)
    }

    fn add_rows(&self, x: &mut CudaSlice<f32>, bias: &CudaSlice<f32>, rows: usize, width: usize) {
        self.launch_add_rows(x, bias, rows, width)
    }

    fn scale(&self, x: &mut CudaSlice<f32>, s: f32, len: usize) {
        self.launch_scale(x, s, len)
    }

    fn add(&self, x: &mut CudaSlice<f32>, y: &CudaSlice<f32>, len: usize) {
        self.launch_add(x, y, len)
    }

    fn gather_rows(&self, x: &CudaSlice<f32>, width: usize, rows: &[usize], out: &mut CudaSlice<f32>) {
        self.launch_gather_rows(x, width, rows, out)
    }

    fn kv_write(&self, kv: &mut CudaKv, layer: usize, k: &CudaSlice<f32>, v: &CudaSlice<f32>, slots: &[(u32, u32)]) {
        self.launch_kv_write(kv, layer, k, v, slots)
    }

    fn attention(&self, kv: &CudaKv, layer: usize, q: &CudaSlice<f32>, rows: &[AttnRow], n_heads: usize, scale: f32, window: Option<usize>, out: &mut CudaSlice<f32>) {
        self.launch_attention(kv, layer, q, rows, n_heads, scale, window, out)
    }

    fn kv_copy_block_out(&self, kv: &CudaKv, block: usize, out: &mut [u8]) {
        self.kv_pack(kv, &[block as u32], 0..kv.layout.layers, &mut [out]);
    }

    fn kv_copy_block_in(&self, kv: &mut CudaKv, block: usize, data: &[u8]) {
        let layers = kv.layout.layers;
        self.kv_unpack(kv, &[block as u32], 0..layers, &[data]);
    }

    fn kv_blocks_out(&self, kv: &CudaKv, blocks: &[usize], outs: &mut [&mut [u8]]) {
        let ids: Vec<u32> = blocks.iter().map(|&b| b as u32).collect();
        self.kv_pack(kv, &ids, 0..kv.layout.layers, outs);
    }

    fn kv_blocks_in(&self, kv: &mut CudaKv, blocks: &[usize], data: &[&[u8]]) {
        let ids: Vec<u32> = blocks.iter().map(|&b| b as u32).collect();
        let layers = kv.layout.layers;
        self.kv_unpack(kv, &ids, 0..layers, data);
    }

    fn kv_blocks_in_device(&self, kv: &mut CudaKv, blocks: &[usize], srcs: &[u64]) -> bool {
        self.launch_kv_blocks_in_device(kv, blocks, srcs)
    }

    fn kv_block_layer_out(&self, kv: &CudaKv, block: usize, layer: usize, out: &mut [u8]) {
        self.kv_pack(kv, &[block as u32], layer..layer + 1, &mut [out]);
    }

    fn kv_block_layer_in(&self, kv: &mut CudaKv, block: usize, layer: usize, data: &[u8]) {
        self.kv_unpack(kv, &[block as u32], layer..layer + 1, &[data]);
    }

    fn greedy_rows_start(&self, logits: &CudaSlice<f32>, rows: usize, n: usize) -> Option<PendingPicks> {
        let mut p = self.picks.lock().unwrap_or_else(|p| p.into_inner());
        if !self.run_ahead || rows == 0 || !p.can_start(rows) {
            return None;
        }
        self.launch_argmax(&mut p, logits, rows, n);
        p.start(&self.stream, rows).unwrap_or_else(|e| fail("queueing the picks' download", e))
    }

    fn greedy_rows_finish(&self, picks: PendingPicks) -> Vec<GreedyRow> {
        let mut p = self.picks.lock().unwrap_or_else(|p| p.into_inner());
        p.finish(picks).unwrap_or_else(|e| fail("waiting for greedy picks", e))
    }

    fn decode_step_fed(&self, kv: &mut CudaKv, input: &StepInput, program: usize, picks: &PendingPicks, from: &[u32], body: &mut dyn FnMut(&mut CudaKv)) -> bool {
        if !self.run_ahead {
            return false;
        }
        // Held through the step: nothing reallocates the picks while a copy out of them is queued.
        let p = self.picks.lock().unwrap_or_else(|p| p.into_inner());
        assert!(p.is_latest(picks), "decode_step_fed: {picks:?} are not the latest picks");
        let (src, _g) = p.token.device_ptr(&self.stream);
        self.run_decode_step(kv, input, program, Some(graph::Fed { src, from }), body)
    }

    fn greedy_rows(&self, logits: &CudaSlice<f32>, rows: usize, n: usize) -> Option<Vec<GreedyRow>> {
        self.device_sampling.then(|| self.argmax_rows(logits, rows, n))
    }

    fn decode_step_rows(&self, input: &StepInput) -> Option<usize> {
        let on = self.graphs.lock().unwrap_or_else(|p| p.into_inner()).enabled;
        on.then(|| crate::step::decode_rows(input)).flatten()
    }

    fn decode_step(&self, kv: &mut CudaKv, input: &StepInput, program: usize, body: &mut dyn FnMut(&mut CudaKv)) {
        self.run_decode_step(kv, input, program, None, body);
    }

    // The fused operations: kernels of fused.cu, in `fused` (the scratch `h`/`a` is not used).

    fn norm_matmul(&self, x: &CudaSlice<f32>, w: &CudaSlice<f32>, eps: f32, rows: usize, dim: usize, _h: &mut CudaSlice<f32>, outs: &mut [(&CudaMatrix, &mut CudaSlice<f32>)]) {
        self.fused_norm_matmul(x, w, eps, rows, dim, outs);
    }

    #[rustfmt::skip]
    fn add_norm_matmul(&self, x: &mut CudaSlice<f32>, y: &CudaSlice<f32>, y_norm: Option<&CudaSlice<f32>>, w: &CudaSlice<f32>, eps: f32, rows: usize, dim: usize, h: &mut CudaSlice<f32>, outs: &mut [(&CudaMatrix, &mut CudaSlice<f32>)]) {
        self.fused_add_norm_matmul(x, y, y_norm, w, eps, rows, dim, h, outs);
    }

    #[rustfmt::skip]
    fn glu_matmul(&self, glu: Glu, gate: &CudaSlice<f32>, up: &CudaSlice<f32>, rows: usize, width: usize, _a: &mut CudaSlice<f32>, outs: &mut [(&CudaMatrix, &mut CudaSlice<f32>)]) {
        self.fused_glu_matmul(glu, gate, up, rows, width, outs);
    }

    #[rustfmt::skip]
    fn rope_kv_write(&self, kv: &mut CudaKv, layer: usize, rope: &CudaRope, q: &mut CudaSlice<f32>, q_heads: usize, k: &mut CudaSlice<f32>, kv_heads: usize, v: &CudaSlice<f32>, positions: &[u32], slots: &[(u32, u32)]) {
        self.fused_rope_kv_write(kv, layer, rope, None, q, q_heads, k, kv_heads, v, positions, slots);
    }

    #[rustfmt::skip]
    fn qk_norm_rope_kv_write(&self, kv: &mut CudaKv, layer: usize, rope: &CudaRope, norm: QkNorm<'_, CudaSlice<f32>>, q: &mut CudaSlice<f32>, q_heads: usize, k: &mut CudaSlice<f32>, kv_heads: usize, v: &CudaSlice<f32>, _t: &mut CudaSlice<f32>, positions: &[u32], slots: &[(u32, u32)]) {
        // The norms run in place in the one launch: no scratch needed.
        self.fused_rope_kv_write(kv, layer, rope, Some(norm), q, q_heads, k, kv_heads, v, positions, slots);
    }

    #[rustfmt::skip]
    fn attention_matmul(&self, kv: &CudaKv, layer: usize, q: &CudaSlice<f32>, rows: &[AttnRow], n_heads: usize, scale: f32, window: Option<usize>, attn: &mut CudaSlice<f32>, outs: &mut [(&CudaMatrix, &mut CudaSlice<f32>)]) {
        self.fused_attention_matmul(kv, layer, q, rows, n_heads, scale, window, attn, outs);
    }

    fn kv_blocks_layer_out(&self, kv: &CudaKv, blocks: &[usize], layer: usize, block_layer_bytes: usize) -> crate::backend::KvBytes {
        self.launch_kv_blocks_layer_out(kv, blocks, layer, block_layer_bytes)
    }

    fn keep_layer_exports_on_device(&self, keep: bool) {
        self.layer_out.keep_on_device.store(keep, std::sync::atomic::Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::staging_groups;

    #[test]
    fn staging_groups_cover_every_block_once_in_order() {
        assert_eq!(staging_groups(137, 368_640, 16 << 20), vec![0..45, 45..90, 90..135, 135..137]);
        assert_eq!(staging_groups(3, 100, 1000), vec![0..3]);
        // A block larger than the buffer still moves (the caller grows the buffer first).
        assert_eq!(staging_groups(2, 2000, 1000), vec![0..1, 1..2]);
        assert!(staging_groups(0, 100, 1000).is_empty());
        assert_eq!(staging_groups(70_000, 4, 16 << 20), vec![0..65_535, 65_535..70_000]);
    }
}
