//! Compiles every `.proto` under `proto/` with protox (pure Rust, no system `protoc`)
//! and generates prost messages plus tonic clients and servers from the descriptor set.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = PathBuf::from("proto");
    println!("cargo:rerun-if-changed={}", dir.display());
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "proto"))
        .collect();
    files.sort();
    for f in &files {
        println!("cargo:rerun-if-changed={}", f.display());
    }
    let fds = protox::compile(&files, [&dir])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .include_file("baton_protos.rs")
        .compile_fds(fds)?;
    Ok(())
}
