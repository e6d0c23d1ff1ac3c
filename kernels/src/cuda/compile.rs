//! The kernel sources (`kernels/cuda/*.cu`, embedded in the binary) and their
//! compilation to PTX by NVRTC, once per GPU architecture.
//!
//! Compiled PTX is cached in memory per architecture and on disk under
//! `~/.cache/baton/ptx/`, keyed by a hash of the source, the architecture and
//! the NVRTC version, so a node restart does not pay for NVRTC again.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};

use cudarc::nvrtc::Ptx;

use super::nvrtc::Nvrtc;

use crate::backend::KernelError;

/// Prepended to every kernel file (NVRTC has no file system for `#include`).
pub const COMMON: &str = include_str!("../../cuda/common.cuh");

/// Every kernel file: (module name, source).
pub const SOURCES: &[(&str, &str)] = &[
    ("norm", include_str!("../../cuda/norm.cu")),
    ("rope", include_str!("../../cuda/rope.cu")),
    ("elementwise", include_str!("../../cuda/elementwise.cu")),
    ("kv", include_str!("../../cuda/kv.cu")),
    ("attention", include_str!("../../cuda/attention.cu")),
    ("sampling", include_str!("../../cuda/sampling.cu")),
    ("fused", include_str!("../../cuda/fused.cu")),
    ("crc", include_str!("../../cuda/crc.cu")),
];

/// The architecture name NVRTC takes for compute capability `major.minor`.
pub fn arch_for(major: i32, minor: i32) -> Result<&'static str, KernelError> {
    // CompileOptions wants a &'static str; the set of real architectures is small.
    const ARCHS: &[(i32, i32, &str)] = &[
        (7, 0, "sm_70"),
        (7, 5, "sm_75"),
        (8, 0, "sm_80"),
        (8, 6, "sm_86"),
        (8, 7, "sm_87"),
        (8, 9, "sm_89"),
        (9, 0, "sm_90"),
        (10, 0, "sm_100"),
        (12, 0, "sm_120"),
    ];
    ARCHS
        .iter()
        .find(|&&(ma, mi, _)| ma == major && mi == minor)
        .map(|&(_, _, a)| a)
        .ok_or_else(|| KernelError::BackendUnavailable { backend: "cuda", reason: format!("no kernels for compute capability {major}.{minor}") })
}

/// The full text NVRTC compiles for one kernel file.
pub fn full_source(name: &str, source: &str) -> String {
    format!("{COMMON}\n#line 1 \"{name}.cu\"\n{source}")
}

/// Compiles one kernel file for `arch` ("sm_90"). A compile error carries NVRTC's log.
pub fn compile(name: &str, source: &str, arch: &'static str) -> Result<Ptx, KernelError> {
    let options = [format!("--gpu-architecture={arch}"), "--std=c++17".to_string()];
    let file = format!("{name}.cu");
    Nvrtc::get()?.compile_ptx(&full_source(name, source), &file, &options).map(Ptx::from_src).map_err(|e| match e {
        KernelError::Compile { log, .. } => KernelError::Compile { file, arch, log },
        other => KernelError::Compile { file, arch, log: other.to_string() },
    })
}

/// PTX text of every module, per architecture.
type PtxByArch = HashMap<&'static str, Vec<(&'static str, String)>>;

/// Every kernel file compiled for `arch`, from the caches when possible.
pub fn compile_all(arch: &'static str) -> Result<Vec<(&'static str, Ptx)>, KernelError> {
    let memory = memory_cache();
    if let Some(done) = memory.lock().unwrap_or_else(|p| p.into_inner()).get(arch) {
        return Ok(done.iter().map(|(n, p)| (*n, Ptx::from_src(p.clone()))).collect());
    }
    let version = nvrtc_version()?;
    let mut out = Vec::new();
    let mut texts = Vec::new();
    for &(name, source) in SOURCES {
        let text = compile_cached(name, source, arch, version)?;
        out.push((name, Ptx::from_src(text.clone())));
        texts.push((name, text));
    }
    memory.lock().unwrap_or_else(|p| p.into_inner()).insert(arch, texts);
    Ok(out)
}

/// One kernel file of [`SOURCES`] compiled for `arch`, from the caches when possible: for
/// an owner of a few kernels (a `DmaBuf`'s checksum) that holds no backend.
pub fn compile_one(name: &str, arch: &'static str) -> Result<Ptx, KernelError> {
    let &(name, source) = SOURCES.iter().find(|(n, _)| *n == name).ok_or_else(|| KernelError::Compile {
        file: format!("{name}.cu"),
        arch,
        log: "no such kernel file in cuda::compile::SOURCES".into(),
    })?;
    if let Some(done) = memory_cache().lock().unwrap_or_else(|p| p.into_inner()).get(arch) {
        if let Some((_, text)) = done.iter().find(|(n, _)| *n == name) {
            return Ok(Ptx::from_src(text.clone()));
        }
    }
    Ok(Ptx::from_src(compile_cached(name, source, arch, nvrtc_version()?)?))
}

/// The PTX text of every module compiled in this process, per architecture.
fn memory_cache() -> &'static Mutex<PtxByArch> {
    static MEMORY: OnceLock<Mutex<PtxByArch>> = OnceLock::new();
    MEMORY.get_or_init(|| Mutex::new(HashMap::new()))
}

/// One file's PTX text from the disk cache, else compiled and stored there.
fn compile_cached(name: &str, source: &str, arch: &'static str, version: (i32, i32)) -> Result<String, KernelError> {
    let cached = disk_cache_path(name, source, arch, version);
    if let Some(text) = cached.as_ref().and_then(|p| std::fs::read_to_string(p).ok()) {
        return Ok(text);
    }
    let text = compile(name, source, arch)?.to_src();
    if let Some(p) = &cached {
        // Best effort: a read-only cache only costs a recompile next time.
        let _ = p.parent().map(std::fs::create_dir_all);
        let tmp = p.with_extension("tmp");
        if std::fs::write(&tmp, &text).is_ok() {
            let _ = std::fs::rename(&tmp, p);
        }
    }
    Ok(text)
}

/// NVRTC's (major, minor) version.
pub fn nvrtc_version() -> Result<(i32, i32), KernelError> {
    Ok(Nvrtc::get()?.version)
}

fn disk_cache_path(name: &str, source: &str, arch: &str, nvrtc: (i32, i32)) -> Option<PathBuf> {
    let base = std::env::var_os("BATON_PTX_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("XDG_CACHE_HOME").map(|c| PathBuf::from(c).join("baton/ptx")))
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/baton/ptx")))?;
    let key = fnv1a(&[COMMON.as_bytes(), source.as_bytes(), arch.as_bytes(), format!("{}.{}", nvrtc.0, nvrtc.1).as_bytes()]);
    Some(base.join(format!("{name}-{arch}-{key:016x}.ptx")))
}

/// FNV-1a over the parts: stable across Rust versions, unlike `DefaultHasher`.
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for &b in *part {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        h ^= 0xff; // separator, so ("ab", "c") and ("a", "bc") differ
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}
