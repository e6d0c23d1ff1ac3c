//! Finding the CUDA libraries before anything calls into them.
//!
//! cudarc (used for the driver API alone) loads the driver by file name on
//! first use and panics when it is missing; NVRTC and cuBLAS are bound by
//! this crate itself (`nvrtc`, `blas`), for CUDA 12 or 13, whichever the
//! driver can run. So the backend looks for each library here first and fails
//! with an error that names what is missing and where it looked.
//!
//! A library found outside the loader's path (the NVRTC wheel that
//! `scripts/fetch-nvrtc.sh` unpacks, a pip-installed cuBLAS, the toolkit's
//! lib64) is opened by its full path and kept open with `RTLD_GLOBAL`, so the
//! libraries that need it (cuBLAS needs cuBLASLt, NVRTC its builtins) find
//! the copy already in memory.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};

use crate::backend::KernelError;

/// The oldest driver whose API covers every symbol of cudarc's CUDA 12.4 bindings.
pub const MIN_DRIVER_VERSION: i32 = 12040;

fn unavailable(reason: String) -> KernelError {
    KernelError::BackendUnavailable { backend: "cuda", reason }
}

/// The reason alone, for errors kept in a `OnceLock` and wrapped again on the way out.
fn reason(e: KernelError) -> String {
    match e {
        KernelError::BackendUnavailable { reason, .. } => reason,
        other => other.to_string(),
    }
}

/// Folders searched for CUDA libraries, in order: `BATON_CUDA_LIB_DIRS`
/// (colon-separated), the NVRTC cache of `scripts/fetch-nvrtc.sh`, the
/// toolkit, and pip's `nvidia-*` wheels.
fn search_dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::env::var("BATON_CUDA_LIB_DIRS")
        .map(|v| v.split(':').filter(|s| !s.is_empty()).map(PathBuf::from).collect())
        .unwrap_or_default();
    if let Some(cache) = std::env::var_os("XDG_CACHE_HOME").map(PathBuf::from).or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache"))) {
        dirs.push(cache.join("baton/nvrtc/lib"));
    }
    for d in ["/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib", "/usr/lib/x86_64-linux-gnu"] {
        dirs.push(PathBuf::from(d));
    }
    // pip wheels: <site-packages>/nvidia/<component>/lib
    let mut site = Vec::new();
    for root in ["/usr/local/lib", "/usr/lib", "/opt/conda/lib"] {
        if let Ok(entries) = std::fs::read_dir(root) {
            for e in entries.flatten() {
                if e.file_name().to_string_lossy().starts_with("python3") {
                    site.push(e.path().join("site-packages"));
                    site.push(e.path().join("dist-packages"));
                }
            }
        }
    }
    site.push(PathBuf::from("/usr/lib/python3/dist-packages"));
    for s in site {
        if let Ok(entries) = std::fs::read_dir(s.join("nvidia")) {
            let mut libs: Vec<PathBuf> = entries.flatten().map(|e| e.path().join("lib")).filter(|p| p.is_dir()).collect();
            libs.sort();
            dirs.extend(libs);
        }
    }
    dirs
}

/// Libraries opened by full path, kept open for the life of the process.
fn kept() -> &'static Mutex<Vec<Library>> {
    static KEPT: OnceLock<Mutex<Vec<Library>>> = OnceLock::new();
    KEPT.get_or_init(|| Mutex::new(Vec::new()))
}

/// A binding opened once per process (`nvrtc`, `blas`); a failure is kept and
/// returned again to every caller.
pub(crate) fn open_once<T>(cell: &'static OnceLock<Result<T, String>>, open: impl FnOnce() -> Result<T, KernelError>) -> Result<&'static T, KernelError> {
    cell.get_or_init(|| open().map_err(reason)).as_ref().map_err(|r| unavailable(r.clone()))
}

/// CUDA major versions whose NVRTC and cuBLAS the backend binds itself
/// (`nvrtc`, `blas`), newest first: their C APIs are the same for what Baton calls.
const LIBRARY_MAJORS: &[i32] = &[13, 12];

/// Opens the first of `sonames` found, first in the search folders (by full
/// path) then on the loader's path, keeping it open with `RTLD_GLOBAL` so the
/// libraries it needs resolve against it. Returns the library and where it was.
fn open_first(sonames: &[String], what: &str) -> Result<(Library, String), KernelError> {
    let dirs = search_dirs();
    for soname in sonames {
        for dir in &dirs {
            let path = dir.join(soname);
            if path.is_file() {
                // SAFETY: a CUDA library's initialisers have no preconditions.
                return match unsafe { Library::open(Some(&path), RTLD_NOW | RTLD_GLOBAL) } {
                    Ok(lib) => Ok((lib, path.display().to_string())),
                    Err(e) => Err(unavailable(format!("{what} ({}) exists but does not load: {e}", path.display()))),
                };
            }
        }
    }
    let mut errors = Vec::new();
    for soname in sonames {
        // SAFETY: as above.
        match unsafe { Library::open(Some(soname.as_str()), RTLD_NOW | RTLD_GLOBAL) } {
            Ok(lib) => return Ok((lib, format!("{soname} on the loader path"))),
            Err(e) => errors.push(e.to_string()),
        }
    }
    Err(unavailable(format!(
        "{what} ({}) not found: {}; searched the loader path and {}. Set BATON_CUDA_LIB_DIRS to the folder that holds it{}",
        sonames.join(" or "),
        errors.join("; "),
        dirs.iter().map(|d| d.display().to_string()).collect::<Vec<_>>().join(", "),
        if what == "NVRTC" { ", or run scripts/fetch-nvrtc.sh" } else { "" }
    )))
}

/// `lib{name}.so.{major}` for each major the driver can run (all of them
/// when no driver is present: PTX compiles without one).
fn versioned(name: &str) -> Vec<String> {
    let driver_major = driver_version().ok().map(|v| v / 1000);
    LIBRARY_MAJORS.iter().filter(|&&m| driver_major.is_none_or(|d| m <= d)).map(|m| format!("lib{name}.so.{m}")).collect()
}

/// Opens NVRTC (and its builtins, which it opens itself by name). Enough to
/// compile kernels to PTX: no driver or GPU is needed. Returns the library
/// and where it was found.
pub(crate) fn open_nvrtc() -> Result<(Library, String), KernelError> {
    let (lib, found) = open_first(&versioned("nvrtc"), "NVRTC")?;
    // The builtins library sits beside libnvrtc; open it too so NVRTC finds it by name.
    if let Some(dir) = Path::new(&found).parent().filter(|d| d.is_dir()) {
        if let Ok(entries) = std::fs::read_dir(dir) {
            for e in entries.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if name.starts_with("libnvrtc-builtins.so") && !name.contains(".alt.") {
                    // SAFETY: as in `open_first`.
                    if let Ok(lib) = unsafe { Library::open(Some(e.path()), RTLD_NOW | RTLD_GLOBAL) } {
                        kept().lock().unwrap_or_else(|p| p.into_inner()).push(lib);
                    }
                }
            }
        }
    }
    Ok((lib, found))
}

/// Opens cuBLASLt, then cuBLAS (which needs it) of the same major version.
pub(crate) fn open_cublas() -> Result<(Library, String), KernelError> {
    let (lt, _) = open_first(&versioned("cublasLt"), "cuBLASLt")?;
    kept().lock().unwrap_or_else(|p| p.into_inner()).push(lt);
    open_first(&versioned("cublas"), "cuBLAS")
}

/// Where NVRTC was found; an error naming what is missing otherwise.
pub fn load_nvrtc() -> Result<String, KernelError> {
    super::nvrtc::Nvrtc::get().map(|n| n.found.clone())
}

/// The driver's CUDA version (12040 for 12.4), read once; no GPU needed
/// (`cuDriverGetVersion` needs no `cuInit`).
fn driver_version() -> Result<i32, String> {
    static VERSION: OnceLock<Result<i32, String>> = OnceLock::new();
    VERSION
        .get_or_init(|| {
            type GetVersion = unsafe extern "C" fn(*mut i32) -> i32;
            // SAFETY: the driver API's signature.
            unsafe {
                let (lib, _) = open_first(&["libcuda.so.1".to_string()], "the NVIDIA driver").map_err(reason)?;
                let get_version =
                    lib.get::<GetVersion>(b"cuDriverGetVersion\0").map_err(|e| format!("libcuda.so.1 lacks cuDriverGetVersion: {e}"))?;
                let mut version = 0;
                let rc = get_version(&mut version);
                kept().lock().unwrap_or_else(|p| p.into_inner()).push(lib);
                if rc != 0 {
                    return Err(format!("cuDriverGetVersion failed (CUresult {rc})"));
                }
                Ok(version)
            }
        })
        .clone()
}

/// What the driver reports, read through our own handle before cudarc loads it.
#[derive(Clone, Debug)]
pub struct DriverInfo {
    pub version: i32,
    pub devices: i32,
}

/// Checks for the driver, its version and at least one device; then for
/// NVRTC and cuBLAS. Only after this succeeds may cudarc be used.
pub fn check_cuda() -> Result<DriverInfo, KernelError> {
    static CHECK: OnceLock<Result<DriverInfo, String>> = OnceLock::new();
    CHECK
        .get_or_init(|| {
            let info = driver_info().map_err(reason)?;
            super::nvrtc::Nvrtc::get().map_err(reason)?;
            super::blas::Cublas::get().map_err(reason)?;
            Ok(info)
        })
        .clone()
        .map_err(unavailable)
}

fn driver_info() -> Result<DriverInfo, KernelError> {
    let version = driver_version().map_err(unavailable)?;
    if version < MIN_DRIVER_VERSION {
        return Err(unavailable(format!(
            "the driver supports CUDA {}.{}; Baton's CUDA backend needs {}.{} or later",
            version / 1000,
            version % 1000 / 10,
            MIN_DRIVER_VERSION / 1000,
            MIN_DRIVER_VERSION % 1000 / 10
        )));
    }
    type Init = unsafe extern "C" fn(u32) -> i32;
    type GetCount = unsafe extern "C" fn(*mut i32) -> i32;
    // SAFETY: these signatures are the driver API's.
    unsafe {
        let (lib, _) = open_first(&["libcuda.so.1".to_string()], "the NVIDIA driver")?;
        let init = lib.get::<Init>(b"cuInit\0").map_err(|e| unavailable(format!("libcuda.so.1 lacks cuInit: {e}")))?;
        let get_count = lib.get::<GetCount>(b"cuDeviceGetCount\0").map_err(|e| unavailable(format!("libcuda.so.1 lacks cuDeviceGetCount: {e}")))?;
        let rc = init(0);
        if rc != 0 {
            // 100 = CUDA_ERROR_NO_DEVICE: a driver without a GPU (or hidden by CUDA_VISIBLE_DEVICES).
            return Err(unavailable(if rc == 100 { "the driver sees no GPU".to_string() } else { format!("cuInit failed (CUresult {rc})") }));
        }
        let mut devices = 0;
        let rc = get_count(&mut devices);
        if rc != 0 || devices == 0 {
            return Err(unavailable("the driver sees no GPU".to_string()));
        }
        kept().lock().unwrap_or_else(|p| p.into_inner()).push(lib);
        Ok(DriverInfo { version, devices })
    }
}
