//! Every CUDA kernel assembled to SASS (the GPU's own instructions) for Hopper
//! (sm_90) and Ampere (sm_80), and checked for what would otherwise take a GPU
//! run to see: no kernel spills registers to local memory or keeps a stack
//! frame; the tensor-core attention kernels (`attn_mma_*`) really run on the
//! tensor cores (HMMA, or HGMMA on sm_90); and each kernel's registers and
//! shared memory allow the blocks per SM its design counts on
//! (`cuda::roofline::DESIGNS`). The PTX comes from the backend's own compile
//! path (NVRTC, `cuda::compile`); ptxas and cuobjdump come from PyPI
//! (`scripts/fetch-cuda-tools.sh`). No GPU needed.
//!
//! Without the tools the tests print SKIPPED; `BATON_REQUIRE_SASS=1` (set by
//! scripts/test.sh) makes that a failure. `BATON_EXPECT_MMA=1` makes it a
//! failure when attention.cu has no `attn_mma_` kernel.
#![cfg(feature = "cuda")]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use baton_kernels::cuda::compile::{compile, SOURCES};
use baton_kernels::cuda::roofline::{design, occupancy, Gpu, DEFAULT_SMEM_PER_BLOCK, DESIGNS, SM80, SM90};
use baton_kernels::cuda::runtime::load_nvrtc;

/// Kernels whose name starts with this must use the tensor cores.
const MMA_PREFIX: &str = "attn_mma_";

/// ptxas, and cuobjdump with the nvdisasm it runs (found beside it).
struct Tools {
    ptxas: PathBuf,
    cuobjdump: PathBuf,
    dir: PathBuf,
}

/// The folder that holds the three tools: `BATON_CUDA_TOOLS_DIR`, the cache of
/// scripts/fetch-cuda-tools.sh, or a folder on PATH.
fn find_tools() -> Result<Tools, String> {
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .map(|c| c.join("baton/cuda-tools/bin"));
    let mut dirs: Vec<PathBuf> = std::env::var_os("BATON_CUDA_TOOLS_DIR").map(PathBuf::from).into_iter().collect();
    dirs.extend(cache);
    dirs.extend(std::env::var_os("PATH").map(|p| std::env::split_paths(&p).collect::<Vec<_>>()).unwrap_or_default());
    dirs.iter()
        .find(|d| ["ptxas", "cuobjdump", "nvdisasm"].iter().all(|t| d.join(t).is_file()))
        .map(|d| Tools { ptxas: d.join("ptxas"), cuobjdump: d.join("cuobjdump"), dir: d.clone() })
        .ok_or_else(|| "no folder with ptxas, cuobjdump and nvdisasm (run scripts/fetch-cuda-tools.sh, or set BATON_CUDA_TOOLS_DIR)".to_string())
}

/// The tools and NVRTC, or None after saying loudly that the test did not run
/// (a failure when `BATON_REQUIRE_SASS=1`).
fn tools() -> Option<Tools> {
    let found = find_tools().and_then(|t| load_nvrtc().map(|_| t).map_err(|e| e.to_string()));
    match found {
        Ok(t) => Some(t),
        Err(e) if std::env::var("BATON_REQUIRE_SASS").as_deref() == Ok("1") => panic!("BATON_REQUIRE_SASS=1 but {e}"),
        Err(e) => {
            // Straight to the terminal: libtest captures the output of passing tests.
            let _ = writeln!(std::io::stderr(), "\n!!!!! SKIPPED: {e}; the kernels' SASS is NOT checked !!!!!\n");
            None
        }
    }
}

/// What ptxas and the disassembly say of one function.
#[derive(Clone, Debug, Default, PartialEq)]
struct Sass {
    name: String,
    entry: bool,
    regs: u32,
    /// Static shared memory (the dynamic part is the launch's: see `DESIGNS`).
    smem: u32,
    stack: u32,
    spill_stores: u32,
    spill_loads: u32,
    /// HMMA / HGMMA instructions in the disassembly.
    tensor: u32,
    /// LDL / STL instructions: local memory however it came about.
    local: u32,
}

/// The number before `what` in a ptxas line ("40 registers" -> 40).
fn number_before(line: &str, what: &str) -> u32 {
    let at = match line.find(what) {
        Some(at) => at,
        None => return 0,
    };
    line[..at].split_whitespace().last().and_then(|n| n.parse().ok()).unwrap_or(0)
}

/// The functions of `ptxas -v`'s report, in its order.
fn parse_ptxas(report: &str) -> Vec<Sass> {
    let mut out: Vec<Sass> = Vec::new();
    let mut entry: Option<usize> = None; // the entry being compiled (ptxas's "Used ..." line is its)
    let mut props: Option<usize> = None; // whose "Function properties" come next
    let index = |out: &mut Vec<Sass>, name: &str| match out.iter().position(|s| s.name == name) {
        Some(i) => i,
        None => {
            out.push(Sass { name: name.to_string(), ..Sass::default() });
            out.len() - 1
        }
    };
    for line in report.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let name = rest.split('\'').next().unwrap_or_default();
            let i = index(&mut out, name);
            out[i].entry = true;
            entry = Some(i);
        } else if let Some(rest) = line.split("Function properties for ").nth(1) {
            props = Some(index(&mut out, rest.trim()));
        } else if line.contains("bytes stack frame") {
            if let Some(i) = props.take() {
                out[i].stack = number_before(line, "bytes stack frame");
                out[i].spill_stores = number_before(line, "bytes spill stores");
                out[i].spill_loads = number_before(line, "bytes spill loads");
            }
        } else if line.contains("Used ") && line.contains("registers") {
            if let Some(i) = entry {
                out[i].regs = number_before(line, "registers");
                out[i].smem = number_before(line, "bytes smem");
            }
        }
    }
    out
}

/// The opcode of a disassembly line ("/*0080*/  @P0 HMMA.16816.F32.BF16 R4, ..." -> "HMMA").
fn opcode(line: &str) -> Option<&str> {
    let rest = line.trim_start().strip_prefix("/*")?.split_once("*/")?.1.trim_start();
    let mut words = rest.split_whitespace();
    let mut word = words.next()?;
    if word.starts_with('@') {
        word = words.next()?;
    }
    word.split('.').next().filter(|w| !w.is_empty() && w.chars().all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_'))
}

/// Per function of `cuobjdump -sass`: (tensor-core instructions, local-memory instructions).
fn parse_sass(listing: &str) -> Vec<(String, u32, u32)> {
    let mut out: Vec<(String, u32, u32)> = Vec::new();
    for line in listing.lines() {
        if let Some(name) = line.trim().strip_prefix("Function : ") {
            out.push((name.trim().to_string(), 0, 0));
        } else if let (Some(op), Some(f)) = (opcode(line), out.last_mut()) {
            match op {
                "HMMA" | "HGMMA" => f.1 += 1,
                "LDL" | "STL" => f.2 += 1,
                _ => {}
            }
        }
    }
    out
}

/// `ptx` assembled for `arch` (extra ptxas flags in `flags`) and disassembled.
fn assemble(tools: &Tools, name: &str, ptx: &str, arch: &str, flags: &[&str]) -> Vec<Sass> {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("cuda_sass");
    std::fs::create_dir_all(&dir).unwrap();
    let (ptx_file, cubin) = (dir.join(format!("{name}-{arch}.ptx")), dir.join(format!("{name}-{arch}.cubin")));
    std::fs::write(&ptx_file, ptx).unwrap();
    let run = |cmd: &mut Command, what: &str| {
        let out = cmd.output().unwrap_or_else(|e| panic!("{what}: {e}"));
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(
            out.status.success(),
            "{what} failed on {name}.cu for {arch} ({}): {text}\n(ptxas of CUDA 12.8 takes the PTX of NVRTC 12.8 or older: scripts/fetch-nvrtc.sh)",
            out.status
        );
        text
    };
    let report = run(Command::new(&tools.ptxas).arg("-v").args(["--gpu-name", arch]).args(flags).arg("-o").arg(&cubin).arg(&ptx_file), "ptxas");
    let listing = run(Command::new(&tools.cuobjdump).env("NVDISASM_PATH", &tools.dir).arg("-sass").arg(&cubin), "cuobjdump -sass");
    let mut functions = parse_ptxas(&report);
    let sass = parse_sass(&listing);
    for f in &mut functions {
        if let Some((_, tensor, local)) = sass.iter().find(|(n, _, _)| *n == f.name) {
            (f.tensor, f.local) = (*tensor, *local);
        } else if f.entry {
            panic!("{name}.cu: {} is not in cuobjdump's listing for {arch}:\n{listing}", f.name);
        }
    }
    functions
}

/// Compiled through the backend's path, then assembled.
fn kernel_file(tools: &Tools, name: &str, source: &str, arch: &'static str, flags: &[&str]) -> Vec<Sass> {
    let ptx = compile(name, source, arch).unwrap_or_else(|e| panic!("{e}")).to_src();
    assemble(tools, name, &ptx, arch, flags)
}

/// A warp's bf16 m16n8k16 product with its fragments loaded by ldmatrix, the
/// instructions the tensor-core attention kernels use.
const MMA_PROBE: &str = r#"
extern "C" __global__ void mma_probe(const u16* a, const u16* b, float* out) {
    __shared__ __align__(16) u16 tile[16 * 16];
    for (int i = threadIdx.x; i < 256; i += 32) tile[i] = a[i];
    __syncthreads();
    u32 fa[4], fb[2];
    u32 addr = (u32)__cvta_generic_to_shared(&tile[(threadIdx.x % 16) * 16 + (threadIdx.x / 16) * 8]);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(fa[0]), "=r"(fa[1]), "=r"(fa[2]), "=r"(fa[3]) : "r"(addr));
    fb[0] = ((const u32*)b)[threadIdx.x];
    fb[1] = ((const u32*)b)[threadIdx.x + 32];
    float c[4] = {0.f, 0.f, 0.f, 0.f};
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(fa[0]), "r"(fa[1]), "r"(fa[2]), "r"(fa[3]), "r"(fb[0]), "r"(fb[1]));
    for (int i = 0; i < 4; i++) out[threadIdx.x * 4 + i] = c[i];
}
"#;

/// 64 sums live across a loop: more than `-maxrregcount=24` holds, so ptxas spills.
const SPILL_PROBE: &str = r#"
extern "C" __global__ void spill_probe(const float* x, float* out, int n) {
    float acc[64];
#pragma unroll
    for (int i = 0; i < 64; i++) acc[i] = 0.f;
    for (int j = 0; j < n; j++) {
        float s = x[j];
#pragma unroll
        for (int i = 0; i < 64; i++) acc[i] += x[(u64)j * 64 + i + threadIdx.x] * s;
    }
#pragma unroll
    for (int i = 0; i < 64; i++) out[i * blockDim.x + threadIdx.x] = acc[i];
}
"#;

/// The detectors themselves: a tensor-core product shows as HMMA on both
/// architectures (and a kernel without one shows none), a register-starved
/// kernel shows its spills, so the checks below cannot pass for want of looking.
#[test]
fn the_detectors_see_tensor_core_products_and_spills() {
    let Some(tools) = tools() else { return };
    for arch in ["sm_90", "sm_80"] {
        let probe = kernel_file(&tools, "mma_probe", MMA_PROBE, arch, &[]);
        let k = probe.iter().find(|f| f.name == "mma_probe").expect("mma_probe in ptxas's report");
        assert!(k.tensor >= 1, "{arch}: no HMMA for an mma.sync: {k:?}");
        assert!(k.smem >= 512, "{arch}: the probe's static tile is not in ptxas's report: {k:?}");
        let norm = kernel_file(&tools, "norm", SOURCES.iter().find(|(n, _)| *n == "norm").unwrap().1, arch, &[]);
        assert_eq!(norm.iter().find(|f| f.name == "rmsnorm").map(|f| f.tensor), Some(0), "{arch}: rmsnorm has no product");

        let spills = kernel_file(&tools, "spill_probe", SPILL_PROBE, arch, &["-maxrregcount=24"]);
        let k = spills.iter().find(|f| f.name == "spill_probe").unwrap();
        assert!(k.spill_stores > 0 && k.spill_loads > 0 && k.local > 0, "{arch}: spills not seen: {k:?}");
        assert!(k.regs <= 24, "{k:?}");
        let roomy = kernel_file(&tools, "spill_probe", SPILL_PROBE, arch, &[]);
        let k = roomy.iter().find(|f| f.name == "spill_probe").unwrap();
        assert_eq!((k.spill_stores, k.spill_loads, k.local), (0, 0, 0), "{arch}: with registers to spare: {k:?}");
        println!("{arch}: mma_probe {} HMMA; spill_probe at 24 registers {} bytes spilled", probe[0].tensor, spills[0].spill_stores);
    }
}

/// Every kernel, both architectures: no spills, no stack, no local memory; the
/// blocks per SM of its design row; tensor-core instructions in `attn_mma_*`.
#[test]
fn every_kernel_fits_its_design_in_sass_for_sm90_and_sm80() {
    let Some(tools) = tools() else { return };
    let mut failures = Vec::new();
    let mut mma_kernels = 0;
    println!("| kernel | arch | regs | smem static + dynamic | spill st/ld | stack | tensor-core instrs | blocks/SM (design) | limited by |");
    println!("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |");
    for (gpu, arch) in [(SM90, "sm_90"), (SM80, "sm_80")] {
        for &(file, source) in SOURCES {
            for f in kernel_file(&tools, file, source, arch, &[]) {
                if f.spill_stores + f.spill_loads + f.stack + f.local > 0 {
                    failures.push(format!(
                        "{arch} {}: {} bytes spill stores, {} spill loads, {} stack, {} LDL/STL",
                        f.name, f.spill_stores, f.spill_loads, f.stack, f.local
                    ));
                }
                if !f.entry {
                    continue;
                }
                if f.name.starts_with(MMA_PREFIX) {
                    mma_kernels += 1;
                    if f.tensor == 0 {
                        failures.push(format!("{arch} {}: no HMMA/HGMMA instruction: not on the tensor cores", f.name));
                    }
                }
                check_design(&gpu, &f, &mut failures);
            }
        }
    }
    let expect_mma = std::env::var("BATON_EXPECT_MMA").as_deref() == Ok("1");
    if mma_kernels == 0 {
        let msg = format!("attention.cu has no {MMA_PREFIX} kernel: the tensor-core check covered none");
        if expect_mma {
            failures.push(format!("{msg} (BATON_EXPECT_MMA=1)"));
        } else {
            let _ = writeln!(std::io::stderr(), "\n!!!!! NOTE: {msg} (BATON_EXPECT_MMA=1 makes this a failure) !!!!!\n");
        }
    } else {
        println!("{mma_kernels} {MMA_PREFIX} kernel builds (both architectures) checked for tensor-core instructions");
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The kernel's design row, and whether its registers and shared memory allow it.
fn check_design(gpu: &Gpu, f: &Sass, failures: &mut Vec<String>) {
    let Some(d) = design(&f.name) else {
        failures.push(format!("{}: no row in cuda::roofline::DESIGNS: add the blocks per SM its design counts on", f.name));
        return;
    };
    let g = (d.launch)();
    let smem = f.smem + g.shared_bytes;
    let counted_on = d.blocks_on(gpu);
    let row = |blocks: String, limiter: String| {
        println!(
            "| {} | {} | {} | {} + {} | {}/{} | {} | {} | {} ({counted_on}) | {limiter} |",
            f.name, gpu.arch, f.regs, f.smem, g.shared_bytes, f.spill_stores, f.spill_loads, f.stack, f.tensor, blocks
        )
    };
    if smem > DEFAULT_SMEM_PER_BLOCK && !d.smem_opt_in {
        failures.push(format!("{} on {}: {smem} bytes of shared memory a block, over the 48 KiB a launch gets without opting in", f.name, gpu.arch));
    }
    match occupancy(gpu, g.block, f.regs, smem) {
        Ok(o) => {
            row(o.blocks_per_sm.to_string(), format!("{:?}", o.limiter));
            if o.blocks_per_sm < counted_on {
                failures.push(format!(
                    "{} on {}: {} registers and {smem} bytes of shared memory allow {} blocks of {} threads per SM ({:?}); its design counts on {counted_on}",
                    f.name, gpu.arch, f.regs, o.blocks_per_sm, g.block, o.limiter
                ));
            }
        }
        Err(e) => {
            row("-".into(), e.clone());
            failures.push(format!("{} on {}: cannot launch: {e}", f.name, gpu.arch));
        }
    }
}

/// Each design row names a kernel that exists (a row left behind by a rename
/// would otherwise count on nothing).
#[test]
fn every_design_row_names_a_kernel() {
    let sources: String = SOURCES.iter().map(|(_, s)| *s).collect();
    for d in DESIGNS {
        let name = d.kernel.trim_end_matches('_');
        assert!(sources.contains(name), "cuda::roofline::DESIGNS has a row for {}, which no kernel file defines", d.kernel);
    }
}

#[test]
fn ptxas_and_cuobjdump_reports_parse() {
    let report = "ptxas info    : 0 bytes gmem\n\
        ptxas info    : Compiling entry function 'attn_x' for 'sm_90'\n\
        ptxas info    : Function properties for helper\n    \
        8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\n\
        ptxas info    : Function properties for attn_x\n    \
        0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
        ptxas info    : Used 96 registers, used 1 barriers, 33280 bytes smem, 400 bytes cmem[0]\n\
        ptxas info    : Compiling entry function 'tiny' for 'sm_90'\n\
        ptxas info    : Function properties for tiny\n    \
        0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
        ptxas info    : Used 8 registers, used 0 barriers, 360 bytes cmem[0]\n";
    let f = parse_ptxas(report);
    assert_eq!(f.len(), 3);
    assert_eq!((f[0].name.as_str(), f[0].entry, f[0].regs, f[0].smem), ("attn_x", true, 96, 33280));
    assert_eq!((f[1].name.as_str(), f[1].entry, f[1].stack, f[1].spill_stores, f[1].spill_loads), ("helper", false, 8, 4, 4));
    assert_eq!((f[2].name.as_str(), f[2].regs, f[2].smem), ("tiny", 8, 0));

    let listing = "\t\tFunction : attn_x\n\
        \t.headerflags\t@\"EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)\"\n\
        /*0080*/                   HMMA.16816.F32.BF16 R4, R4, R2, RZ ;  /* 0x000000020404723c */\n\
        /*0090*/              @!P0 HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ ;\n\
        /*00a0*/                   STL [R1], R4 ;\n\
        /*00b0*/                   LDL R4, [R1] ;\n\
        /*00c0*/                   FFMA R4, R4, R2, R3 ;\n\
        \t\tFunction : tiny\n\
        /*0000*/                   EXIT ;\n";
    assert_eq!(parse_sass(listing), vec![("attn_x".to_string(), 2, 2), ("tiny".to_string(), 0, 0)]);
    assert_eq!(opcode("        /*0010*/  @P1 LDL.64 R2, [R1+0x8] ;"), Some("LDL"));
    assert_eq!(opcode("\t.headerflags\t@\"EF_CUDA_SM90\""), None);
}
