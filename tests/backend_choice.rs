//! `--backend` on a machine without a usable GPU: `cuda` is an error that says
//! what is missing (cudarc alone would panic), `auto` runs on the CPU and logs
//! why, and both report the backend that runs. On a GPU host the same
//! commands must run on the GPU instead.

mod cluster_support;

use std::path::Path;
use std::process::Command;

fn generate(model: &Path, backend: &str) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_baton"))
        .args(["generate", "--backend", backend, "--threads", "1", "--prompt", "The capital of France is", "--max-tokens", "2"])
        .env("BATON_MODEL", model)
        .env("BATON_LOG", "info")
        .output()
        .unwrap()
}

#[test]
fn without_a_gpu_cuda_is_a_clear_error_and_auto_runs_on_the_cpu() {
    let Some(model) = cluster_support::model_path() else { return };
    if Path::new("/proc/driver/nvidia").exists() {
        let out = generate(&model, "cuda");
        let log = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "a GPU host: --backend cuda must run\n{log}");
        assert!(log.contains("backend=cuda ("), "{log}");
        return;
    }
    let out = generate(&model, "cuda");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("backend cuda is unavailable") && err.contains("libcuda.so.1"), "{err}");
    assert!(!err.contains("panicked"), "{err}");

    let out = generate(&model, "auto");
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{log}");
    assert!(log.contains("CUDA backend unavailable; using the CPU backend"), "{log}");
    assert!(log.contains("backend=cpu ("), "{log}");
    assert!(!String::from_utf8_lossy(&out.stdout).trim().is_empty());
}
