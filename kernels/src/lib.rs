//! Compute kernels for a Llama-family forward pass behind one backend trait.
//!
//! The CPU backend (always built) runs quantized matrix products with 8-bit
//! activations, RMSNorm, rotary embeddings, the SiLU-gated MLP and attention
//! over a paged KV arena. Reduction orders are fixed per output element, so
//! results are bit-identical whether a row runs alone or in a batch, in one
//! prefill chunk or many, and on any x86-64 or portable code path.

// The portable kernels index several arrays by the same lane or column (`acc[c]`,
// `isum[c]`, `w[q]`) so that they read like the SIMD code they must equal bit for bit.
#![allow(clippy::needless_range_loop)]
pub mod attention;
pub mod backend;
pub mod blocks;
pub mod error;
pub mod exp;
pub mod fp8;
pub mod fused;
#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(feature = "emu")]
pub mod emu;
#[cfg(feature = "emu")]
pub mod emu_backend;
#[cfg(feature = "emu")]
mod emu_steps;
pub mod kv;
pub mod matmul;
pub mod ops;
pub mod pool;
pub mod quant;
pub mod run_ahead;
pub mod step;

pub use attention::AttnRow;
pub use backend::{cuda_unavailable, Backend, BackendKind, CpuBackend, DeviceKvBytes, GreedyRow, KernelError, KvBytes, OptionalOp, PendingKvBytes};
pub use error::{Error, Result};
pub use fused::{Glu, QkNorm};
#[cfg(feature = "cuda")]
pub use cuda::CudaBackend;
#[cfg(feature = "emu")]
pub use emu_backend::EmuBackend;
#[cfg(feature = "emu")]
pub use emu_steps::EmuStepStats;
pub use kv::{KvDtype, KvGroups, KvLayout, KvStorage, UNMAPPED};
pub use matmul::QMatrix;
pub use ops::RopeTable;
pub use quant::WeightFormat;
pub use run_ahead::PendingPicks;
pub use step::StepInput;
