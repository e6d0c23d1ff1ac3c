//! The one mapping from the GGUF reader's tensor types (`baton-text`) to the
//! kernels' weight formats. The two enums describe the same ggml types from two
//! sides (file layout, arithmetic); this is the only place they meet.

use baton_kernels::WeightFormat;
use baton_text::gguf::GgmlType;

/// The kernels' format for a GGUF tensor type (`None` for types Baton does not read).
pub fn weight_format(t: GgmlType) -> Option<WeightFormat> {
    Some(match t {
        GgmlType::F32 => WeightFormat::F32,
        GgmlType::F16 => WeightFormat::F16,
        GgmlType::BF16 => WeightFormat::BF16,
        GgmlType::Q4_0 => WeightFormat::Q4_0,
        GgmlType::Q4_1 => WeightFormat::Q4_1,
        GgmlType::Q5_0 => WeightFormat::Q5_0,
        GgmlType::Q5_1 => WeightFormat::Q5_1,
        GgmlType::Q8_0 => WeightFormat::Q8_0,
        GgmlType::Q2_K => WeightFormat::Q2_K,
        GgmlType::Q3_K => WeightFormat::Q3_K,
        GgmlType::Q4_K => WeightFormat::Q4_K,
        GgmlType::Q5_K => WeightFormat::Q5_K,
        GgmlType::Q6_K => WeightFormat::Q6_K,
        GgmlType::Q8_K => WeightFormat::Q8_K,
        GgmlType::IQ4_NL => WeightFormat::IQ4_NL,
        GgmlType::IQ4_XS => WeightFormat::IQ4_XS,
        GgmlType::Unsupported(_) => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reader sizes tensors with its own block table; the kernels must agree on
    /// every type, or a tensor would be bounds-checked with one size and read with another.
    #[test]
    fn every_supported_type_maps_with_the_same_name_and_block_size() {
        for id in 0..64 {
            let t = GgmlType::from_id(id);
            match weight_format(t) {
                Some(f) => {
                    assert_eq!(f.name(), t.name(), "{t:?}");
                    assert_eq!(t.block_len(), Some(f.block_len() as u64), "{t:?}");
                    assert_eq!(t.block_bytes(), Some(f.block_bytes() as u64), "{t:?}");
                }
                None => assert!(!t.is_supported(), "{t:?} is supported but has no format"),
            }
        }
        for f in WeightFormat::ALL {
            assert!(
                (0..64).any(|id| weight_format(GgmlType::from_id(id)) == Some(f)),
                "{f:?} has no GGUF type"
            );
        }
    }
}
