//! NVRTC, bound by hand: the eight calls that compile a kernel file to PTX.
//!
//! cudarc's bindings are generated for one CUDA version and resolve every
//! symbol of that version when the library loads, so CUDA 12 bindings panic
//! on CUDA 13's NVRTC (which dropped `nvrtcGetNVVM`). These calls have had
//! the same signatures since CUDA 11, so one binding serves 12 and 13.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::OnceLock;

use libloading::os::unix::{Library, Symbol};

use crate::backend::KernelError;

type Program = *mut c_void;
type Status = c_int;
const SUCCESS: Status = 0;

/// The loaded library and the entry points Baton uses.
pub struct Nvrtc {
    /// Where the library was found (for logs and test output).
    pub found: String,
    pub version: (i32, i32),
    version_fn: Symbol<unsafe extern "C" fn(*mut c_int, *mut c_int) -> Status>,
    create: Symbol<unsafe extern "C" fn(*mut Program, *const c_char, *const c_char, c_int, *const *const c_char, *const *const c_char) -> Status>,
    compile: Symbol<unsafe extern "C" fn(Program, c_int, *const *const c_char) -> Status>,
    log_size: Symbol<unsafe extern "C" fn(Program, *mut usize) -> Status>,
    log: Symbol<unsafe extern "C" fn(Program, *mut c_char) -> Status>,
    ptx_size: Symbol<unsafe extern "C" fn(Program, *mut usize) -> Status>,
    ptx: Symbol<unsafe extern "C" fn(Program, *mut c_char) -> Status>,
    destroy: Symbol<unsafe extern "C" fn(*mut Program) -> Status>,
    error_string: Symbol<unsafe extern "C" fn(Status) -> *const c_char>,
    _lib: Library,
}

/// Deletes the program on every path out of `compile_ptx`.
struct ProgramGuard<'a>(&'a Nvrtc, Program);

impl Drop for ProgramGuard<'_> {
    fn drop(&mut self) {
        // SAFETY: the program was created by this library and is destroyed once.
        unsafe { (self.0.destroy)(&mut self.1) };
    }
}

impl Nvrtc {
    /// The process's NVRTC, opened on first use (`runtime::open_nvrtc`).
    pub fn get() -> Result<&'static Nvrtc, KernelError> {
        static NVRTC: OnceLock<Result<Nvrtc, String>> = OnceLock::new();
        super::runtime::open_once(&NVRTC, Self::open)
    }

    fn open() -> Result<Nvrtc, KernelError> {
        let (lib, found) = super::runtime::open_nvrtc()?;
        let missing = |name: &str, e: libloading::Error| KernelError::BackendUnavailable { backend: "cuda", reason: format!("NVRTC ({found}) lacks {name}: {e}") };
        // SAFETY: each type is the C signature NVRTC's header gives that name.
        unsafe {
            let mut n = Nvrtc {
                version_fn: lib.get(b"nvrtcVersion\0").map_err(|e| missing("nvrtcVersion", e))?,
                create: lib.get(b"nvrtcCreateProgram\0").map_err(|e| missing("nvrtcCreateProgram", e))?,
                compile: lib.get(b"nvrtcCompileProgram\0").map_err(|e| missing("nvrtcCompileProgram", e))?,
                log_size: lib.get(b"nvrtcGetProgramLogSize\0").map_err(|e| missing("nvrtcGetProgramLogSize", e))?,
                log: lib.get(b"nvrtcGetProgramLog\0").map_err(|e| missing("nvrtcGetProgramLog", e))?,
                ptx_size: lib.get(b"nvrtcGetPTXSize\0").map_err(|e| missing("nvrtcGetPTXSize", e))?,
                ptx: lib.get(b"nvrtcGetPTX\0").map_err(|e| missing("nvrtcGetPTX", e))?,
                destroy: lib.get(b"nvrtcDestroyProgram\0").map_err(|e| missing("nvrtcDestroyProgram", e))?,
                error_string: lib.get(b"nvrtcGetErrorString\0").map_err(|e| missing("nvrtcGetErrorString", e))?,
                version: (0, 0),
                found: found.clone(),
                _lib: lib,
            };
            let (mut major, mut minor) = (0, 0);
            let rc = (n.version_fn)(&mut major, &mut minor);
            if rc != SUCCESS {
                return Err(KernelError::BackendUnavailable { backend: "cuda", reason: format!("nvrtcVersion failed: {}", n.describe(rc)) });
            }
            n.version = (major, minor);
            Ok(n)
        }
    }

    fn describe(&self, rc: Status) -> String {
        // SAFETY: NVRTC returns a static string for any status.
        let text = unsafe { (self.error_string)(rc) };
        if text.is_null() {
            format!("NVRTC status {rc}")
        } else {
            // SAFETY: non-null, NUL-terminated, static.
            format!("{} ({rc})", unsafe { CStr::from_ptr(text) }.to_string_lossy())
        }
    }

    fn check(&self, rc: Status, call: &'static str) -> Result<(), KernelError> {
        if rc == SUCCESS {
            Ok(())
        } else {
            Err(KernelError::Device { call, detail: self.describe(rc) })
        }
    }

    /// Compiles `source` (named `name` in diagnostics) with `options` to PTX
    /// text; a compile error ([`KernelError::Compile`], its `arch` left for the caller
    /// to name) carries NVRTC's log, any other error the call that failed.
    pub fn compile_ptx(&self, source: &str, name: &str, options: &[String]) -> Result<String, KernelError> {
        let nul = |s: &str| CString::new(s).map_err(|_| KernelError::Device { call: "nvrtcCreateProgram", detail: format!("a NUL byte in {s:?}") });
        let (src, name) = (nul(source)?, nul(name)?);
        let opts = options.iter().map(|o| nul(o)).collect::<Result<Vec<_>, _>>()?;
        let opt_ptrs: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();
        let mut prog: Program = std::ptr::null_mut();
        // SAFETY: valid NUL-terminated strings; no headers.
        self.check(unsafe { (self.create)(&mut prog, src.as_ptr(), name.as_ptr(), 0, std::ptr::null(), std::ptr::null()) }, "nvrtcCreateProgram")?;
        let guard = ProgramGuard(self, prog);
        // SAFETY: `opt_ptrs` holds `opts.len()` live strings.
        let rc = unsafe { (self.compile)(guard.1, opt_ptrs.len() as c_int, opt_ptrs.as_ptr()) };
        if rc != SUCCESS {
            return Err(match self.read(guard.1, &self.log_size, &self.log) {
                Ok(log) if !log.trim().is_empty() => KernelError::Compile { file: name.to_string_lossy().into_owned(), arch: "", log },
                _ => KernelError::Device { call: "nvrtcCompileProgram", detail: self.describe(rc) },
            });
        }
        self.read(guard.1, &self.ptx_size, &self.ptx)
    }

    /// Reads one of the program's strings (log or PTX) through its size and copy calls.
    #[allow(clippy::type_complexity)]
    fn read(
        &self,
        prog: Program,
        size: &Symbol<unsafe extern "C" fn(Program, *mut usize) -> Status>,
        copy: &Symbol<unsafe extern "C" fn(Program, *mut c_char) -> Status>,
    ) -> Result<String, KernelError> {
        let mut len = 0usize;
        // SAFETY: `prog` is live; `len` is a valid out pointer.
        self.check(unsafe { size(prog, &mut len) }, "reading a size")?;
        let mut buf = vec![0u8; len.max(1)];
        // SAFETY: `buf` holds the `len` bytes (terminating NUL included) NVRTC writes.
        self.check(unsafe { copy(prog, buf.as_mut_ptr() as *mut c_char) }, "reading a string")?;
        let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        buf.truncate(end);
        Ok(String::from_utf8_lossy(&buf).into_owned())
    }
}
