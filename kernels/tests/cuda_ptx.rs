//! Every CUDA kernel file compiles through NVRTC, for Hopper (sm_90) and for
//! Ampere (sm_80). Needs NVRTC (`scripts/fetch-nvrtc.sh`), not a GPU, so a
//! kernel that does not compile fails CI on a machine without one.
#![cfg(feature = "cuda")]

use std::io::Write;

use baton_kernels::cuda::compile::{compile, compile_one, full_source, nvrtc_version, SOURCES};
use baton_kernels::cuda::runtime::load_nvrtc;
use baton_kernels::KernelError;

/// NVRTC, or None after saying loudly that the test did not run (an error
/// when `BATON_REQUIRE_NVRTC=1`, as under scripts/test.sh).
fn nvrtc() -> Option<String> {
    match load_nvrtc() {
        Ok(found) => Some(found),
        Err(e) if std::env::var("BATON_REQUIRE_NVRTC").as_deref() == Ok("1") => panic!("BATON_REQUIRE_NVRTC=1 but {e}"),
        Err(e) => {
            // Straight to the terminal: libtest captures eprintln! of passing tests.
            let _ = writeln!(std::io::stderr(), "\n!!!!! SKIPPED: {e}; the CUDA kernels are NOT compiled !!!!!\n");
            None
        }
    }
}

/// The `extern "C" __global__` kernels a source defines, including those a
/// macro stamps out (`NAME(kv_write_f32, ...)` lines after a `#define NAME`).
fn kernel_names(source: &str) -> Vec<String> {
    let source = source.replace("\\\n", " "); // join a macro's continued lines
    let mut names = Vec::new();
    let macros: Vec<&str> = source
        .lines()
        .filter_map(|l| l.strip_prefix("#define "))
        .filter(|l| l.contains("extern \"C\" __global__"))
        .filter_map(|l| l.split('(').next())
        .collect();
    for line in source.lines() {
        let line = line.trim();
        if let Some(rest) = line.strip_prefix("extern \"C\" __global__ void ") {
            names.push(rest.split('(').next().unwrap().trim().to_string());
        }
        for m in &macros {
            if let Some(rest) = line.strip_prefix(&format!("{m}(")) {
                names.push(rest.split(',').next().unwrap().trim().to_string());
            }
        }
    }
    names
}

#[test]
fn every_kernel_file_compiles_to_ptx_for_sm90_and_sm80() {
    let Some(found) = nvrtc() else { return };
    let (major, minor) = nvrtc_version().unwrap();
    println!("NVRTC {major}.{minor} from {found}");
    for arch in ["sm_90", "sm_80"] {
        for &(name, source) in SOURCES {
            let ptx = compile(name, source, arch).unwrap_or_else(|e| panic!("{e}")).to_src();
            assert!(ptx.contains(&format!(".target {arch}")), "{name}.cu: PTX for the wrong target");
            let kernels = kernel_names(source);
            assert!(!kernels.is_empty(), "{name}.cu defines no kernels");
            for k in &kernels {
                assert!(ptx.contains(&format!(".entry {k}(")), "{name}.cu: kernel {k} missing from the {arch} PTX");
            }
            println!("{name}.cu -> {arch}: {} kernels, {} bytes of PTX", kernels.len(), ptx.len());
        }
    }
}

/// No kernel keeps an array in local memory (off-chip, behind L1): per-row or
/// per-head sums must stay in registers, which needs loops over them unrolled
/// with constant indices. The tiled attention kernel once had 26 local loads
/// and stores in its value loop; this keeps that from coming back unseen.
#[test]
fn no_kernel_keeps_an_array_in_local_memory() {
    if nvrtc().is_none() {
        return;
    }
    for &(name, source) in SOURCES {
        let ptx = compile(name, source, "sm_90").unwrap_or_else(|e| panic!("{e}")).to_src();
        for entry in ptx.split(".entry ").skip(1) {
            let kernel = entry.split('(').next().unwrap();
            let body = entry.split("\n}").next().unwrap();
            let local = body.matches("ld.local").count() + body.matches("st.local").count();
            assert_eq!(local, 0, "{name}.cu: {kernel} has {local} local-memory loads/stores in its PTX");
        }
    }
}

#[test]
fn every_cu_file_in_the_folder_is_compiled_by_the_backend() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("cuda");
    let mut on_disk: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter_map(|n| n.strip_suffix(".cu").map(str::to_string))
        .collect();
    on_disk.sort();
    let mut listed: Vec<String> = SOURCES.iter().map(|(n, _)| n.to_string()).collect();
    listed.sort();
    assert_eq!(on_disk, listed, "kernels/cuda/*.cu and cuda::compile::SOURCES differ");
}

/// One file alone (what a `DmaBuf` compiles for its checksum) comes from the same caches
/// as the backend's modules and holds its kernels; a name that is no file is an error.
#[test]
fn one_kernel_file_compiles_alone() {
    if nvrtc().is_none() {
        return;
    }
    let ptx = compile_one("crc", "sm_90").unwrap_or_else(|e| panic!("{e}")).to_src();
    assert!(ptx.contains(".entry crc32_chunks(") && ptx.contains(".entry crc32_finish("), "crc.cu's kernels missing");
    let err = compile_one("no_such_file", "sm_90").unwrap_err();
    assert!(err.to_string().contains("no_such_file.cu"), "{err}");
}

#[test]
fn a_kernel_that_does_not_compile_is_an_error_with_nvrtcs_log() {
    if nvrtc().is_none() {
        return;
    }
    let err = compile("broken", "extern \"C\" __global__ void broken(float* x) { x[0] = undeclared_name; }", "sm_90").unwrap_err();
    match &err {
        KernelError::Compile { file, arch, log } => {
            assert_eq!((file.as_str(), *arch), ("broken.cu", "sm_90"));
            assert!(log.contains("undeclared_name"), "log: {log}");
        }
        other => panic!("expected a compile error, got {other}"),
    }
    // The line numbers of the log are the file's own, not shifted by common.cuh.
    assert!(err.to_string().contains("broken.cu(1)"), "{err}");
    assert!(full_source("x", "y").ends_with("#line 1 \"x.cu\"\ny"));
}

/// Without a driver, opening the CUDA backend is an error that names what is
/// missing (cudarc itself would panic), and the process goes on.
#[test]
fn without_a_driver_the_backend_is_an_error_that_says_why() {
    let has_driver = std::path::Path::new("/proc/driver/nvidia").exists();
    match baton_kernels::CudaBackend::new(0) {
        Err(e) if !has_driver => {
            let msg = e.to_string();
            assert!(msg.contains("libcuda.so.1") || msg.contains("no GPU"), "{msg}");
            assert_eq!(e.label(), "backend_unavailable");
        }
        Err(e) => println!("a driver is present but the backend is unavailable: {e}"),
        Ok(b) => println!("a GPU is present: {}", baton_kernels::Backend::describe(&b)),
    }
}
