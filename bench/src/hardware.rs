//! Built-in accelerator profiles from NVIDIA datasheets (per GPU; dense, i.e. without the
//! 2:4 sparsity factor the datasheets headline) and element types.

use clap::ValueEnum;
use serde::Serialize;

/// Which GPU a node is built from (8 per node by default).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Gpu {
    /// H100 SXM: 80 GB HBM3, 3.35 TB/s, 1,979 dense FP8 TFLOP/s, 989.5 dense BF16.
    H100,
    /// H200 SXM: 141 GB HBM3e, 4.8 TB/s, same tensor cores as H100 SXM.
    H200,
}

/// Datasheet figures for one GPU.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct GpuProfile {
    pub name: &'static str,
    pub hbm_bytes: f64,
    pub hbm_bytes_per_s: f64,
    pub fp8_dense_flops: f64,
    pub bf16_dense_flops: f64,
}

impl Gpu {
    pub fn profile(self) -> GpuProfile {
        match self {
            Gpu::H100 => GpuProfile {
                name: "H100 SXM",
                hbm_bytes: 80e9,
                hbm_bytes_per_s: 3.35e12,
                fp8_dense_flops: 1979e12,
                bf16_dense_flops: 989.5e12,
            },
            Gpu::H200 => GpuProfile {
                name: "H200 SXM",
                hbm_bytes: 141e9,
                hbm_bytes_per_s: 4.8e12,
                fp8_dense_flops: 1979e12,
                bf16_dense_flops: 989.5e12,
            },
        }
    }
}

/// Element type of weights or KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    Fp8,
    Bf16,
}

impl Dtype {
    pub fn bytes(self) -> u64 {
        match self {
            Dtype::Fp8 => 1,
            Dtype::Bf16 => 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Dtype::Fp8 => "FP8",
            Dtype::Bf16 => "BF16",
        }
    }

    /// Dense tensor-core FLOP/s of `gpu` when computing in this type.
    pub fn dense_flops(self, gpu: &GpuProfile) -> f64 {
        match self {
            Dtype::Fp8 => gpu.fp8_dense_flops,
            Dtype::Bf16 => gpu.bf16_dense_flops,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn profiles_match_datasheets() {
        let h100 = Gpu::H100.profile();
        assert_eq!((h100.hbm_bytes, h100.hbm_bytes_per_s), (80e9, 3.35e12));
        assert_eq!(Dtype::Fp8.dense_flops(&h100), 1979e12);
        let h200 = Gpu::H200.profile();
        assert_eq!((h200.hbm_bytes, h200.hbm_bytes_per_s), (141e9, 4.8e12));
        assert_eq!(Dtype::Bf16.dense_flops(&h200), 989.5e12);
        assert_eq!(Dtype::Bf16.bytes(), 2);
    }
}
