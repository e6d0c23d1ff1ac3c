//! cuBLAS, bound by hand: a handle and `cublasGemmEx`, for CUDA 12 or 13
//! (cudarc's generated bindings fix one version; see `nvrtc` for why that
//! breaks). The enum values below are the C headers', unchanged since CUDA 11.
//!
//! Every handle has a workspace of its own, [`WORKSPACE_BYTES`], set with
//! `cublasSetWorkspace`: cuBLAS then never allocates while a product is queued,
//! which a CUDA graph capture requires (`graph.rs`), and every handle chooses
//! its kernels with the same workspace, so a product's bits do not depend on
//! the handle that ran it.

use std::ffi::{c_int, c_void};
use std::sync::OnceLock;

use libloading::os::unix::{Library, Symbol};

use crate::backend::KernelError;

type Handle = *mut c_void;
type Status = c_int;
const SUCCESS: Status = 0;

pub const OP_N: c_int = 0;
pub const OP_T: c_int = 1;
/// `cudaDataType_t`
pub const R_32F: c_int = 0;
pub const R_16BF: c_int = 14;
/// `cublasComputeType_t::CUBLAS_COMPUTE_32F`
pub const COMPUTE_32F: c_int = 68;
/// `cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT`
pub const GEMM_DEFAULT: c_int = -1;

#[rustfmt::skip]
type GemmEx = unsafe extern "C" fn(
    Handle, c_int, c_int,          // handle, transa, transb
    c_int, c_int, c_int,           // m, n, k
    *const c_void,                 // alpha
    *const c_void, c_int, c_int,   // A, its type, lda
    *const c_void, c_int, c_int,   // B, its type, ldb
    *const c_void,                 // beta
    *mut c_void, c_int, c_int,     // C, its type, ldc
    c_int, c_int,                  // compute type, algorithm
) -> Status;

/// The loaded library and the entry points Baton uses.
pub struct Cublas {
    pub found: String,
    create: Symbol<unsafe extern "C" fn(*mut Handle) -> Status>,
    destroy: Symbol<unsafe extern "C" fn(Handle) -> Status>,
    set_stream: Symbol<unsafe extern "C" fn(Handle, *mut c_void) -> Status>,
    set_workspace: Symbol<unsafe extern "C" fn(Handle, *mut c_void, usize) -> Status>,
    gemm_ex: Symbol<GemmEx>,
    _lib: Library,
}

impl Cublas {
    /// The process's cuBLAS, opened on first use (`runtime::open_cublas`).
    pub fn get() -> Result<&'static Cublas, KernelError> {
        static CUBLAS: OnceLock<Result<Cublas, String>> = OnceLock::new();
        super::runtime::open_once(&CUBLAS, Self::open)
    }

    fn open() -> Result<Cublas, KernelError> {
        let (lib, found) = super::runtime::open_cublas()?;
        let missing = |name: &str, e: libloading::Error| KernelError::BackendUnavailable { backend: "cuda", reason: format!("cuBLAS ({found}) lacks {name}: {e}") };
        // SAFETY: each type is the C signature cuBLAS's header gives that name.
        unsafe {
            Ok(Cublas {
                create: lib.get(b"cublasCreate_v2\0").map_err(|e| missing("cublasCreate_v2", e))?,
                destroy: lib.get(b"cublasDestroy_v2\0").map_err(|e| missing("cublasDestroy_v2", e))?,
                set_stream: lib.get(b"cublasSetStream_v2\0").map_err(|e| missing("cublasSetStream_v2", e))?,
                set_workspace: lib.get(b"cublasSetWorkspace_v2\0").map_err(|e| missing("cublasSetWorkspace_v2", e))?,
                gemm_ex: lib.get(b"cublasGemmEx\0").map_err(|e| missing("cublasGemmEx", e))?,
                found: found.clone(),
                _lib: lib,
            })
        }
    }
}

/// Bytes of each handle's workspace: what cuBLAS takes by default on Hopper
/// (and recommends giving it there), more than it needs on older GPUs.
pub const WORKSPACE_BYTES: usize = 32 << 20;

/// One cuBLAS handle, bound to one stream, with its own workspace. The CUDA
/// context it was made in must be current on the thread that uses it.
pub struct BlasHandle {
    lib: &'static Cublas,
    handle: Handle,
    /// Device memory of [`WORKSPACE_BYTES`] (0 until set), freed after the handle.
    workspace: u64,
}

// SAFETY: a cuBLAS handle may move between threads; the backend uses it under a mutex.
unsafe impl Send for BlasHandle {}

impl BlasHandle {
    /// A handle in the current context that queues its work on `stream`.
    pub fn new(stream: *mut c_void) -> Result<Self, KernelError> {
        let lib = Cublas::get()?;
        let mut handle: Handle = std::ptr::null_mut();
        let fail = |call: &str, rc: Status| KernelError::BackendUnavailable { backend: "cuda", reason: format!("{call} failed (cublasStatus {rc})") };
        // SAFETY: a valid out pointer.
        let rc = unsafe { (lib.create)(&mut handle) };
        if rc != SUCCESS {
            return Err(fail("cublasCreate", rc));
        }
        let mut h = BlasHandle { lib, handle, workspace: 0 };
        // SAFETY: a live handle; the stream belongs to the current context.
        let rc = unsafe { (lib.set_stream)(h.handle, stream) };
        if rc != SUCCESS {
            return Err(fail("cublasSetStream", rc));
        }
        // After cublasSetStream, which resets the workspace to cuBLAS's own pool.
        // SAFETY: a plain allocation in the current context.
        h.workspace = unsafe { cudarc::driver::result::malloc_sync(WORKSPACE_BYTES) }
            .map_err(|e| KernelError::BackendUnavailable { backend: "cuda", reason: format!("allocating a {} MiB cuBLAS workspace: {e:?}", WORKSPACE_BYTES >> 20) })?;
        // SAFETY: a live handle and a live allocation of that many bytes, freed only after the handle.
        let rc = unsafe { (lib.set_workspace)(h.handle, h.workspace as *mut c_void, WORKSPACE_BYTES) };
        if rc != SUCCESS {
            return Err(fail("cublasSetWorkspace", rc));
        }
        Ok(h)
    }

    /// `C = alpha · op(A) · op(B) + beta · C`, column-major, as `cublasGemmEx`.
    ///
    /// # Safety
    /// The pointers must be live device allocations of the sizes the
    /// dimensions and leading dimensions name, in the handle's context.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gemm_ex(
        &self,
        (trans_a, trans_b): (c_int, c_int),
        (m, n, k): (usize, usize, usize),
        alpha: f32,
        (a, a_type, lda): (*const c_void, c_int, usize),
        (b, b_type, ldb): (*const c_void, c_int, usize),
        beta: f32,
        (c, c_type, ldc): (*mut c_void, c_int, usize),
    ) -> Result<(), Status> {
        let int = |v: usize| c_int::try_from(v).expect("gemm dimension over i32");
        let rc = (self.lib.gemm_ex)(
            self.handle,
            trans_a,
            trans_b,
            int(m),
            int(n),
            int(k),
            &alpha as *const f32 as *const c_void,
            a,
            a_type,
            int(lda),
            b,
            b_type,
            int(ldb),
            &beta as *const f32 as *const c_void,
            c,
            c_type,
            int(ldc),
            COMPUTE_32F,
            GEMM_DEFAULT,
        );
        if rc == SUCCESS {
            Ok(())
        } else {
            Err(rc)
        }
    }
}

impl Drop for BlasHandle {
    fn drop(&mut self) {
        // SAFETY: the handle is live and destroyed once.
        unsafe { (self.lib.destroy)(self.handle) };
        if self.workspace != 0 {
            // SAFETY: allocated by cuMemAlloc in `new`, freed once, after the handle; cuMemFree
            // waits for the work queued on the device, the handle's products included.
            let _ = unsafe { cudarc::driver::result::free_sync(self.workspace) };
        }
    }
}
