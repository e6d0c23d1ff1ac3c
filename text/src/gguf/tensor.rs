//! Tensor element types and the tensor table's entries.

/// A ggml tensor element type. Only the types Baton's kernels handle have
/// their own variant; any other id is kept as `Unsupported(id)`.
#[allow(non_camel_case_types)] // ggml's names
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_K,
    IQ4_NL,
    IQ4_XS,
    BF16,
    Unsupported(u32),
}

impl GgmlType {
    /// The type for a ggml type id.
    pub fn from_id(id: u32) -> GgmlType {
        match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            6 => GgmlType::Q5_0,
            7 => GgmlType::Q5_1,
            8 => GgmlType::Q8_0,
            10 => GgmlType::Q2_K,
            11 => GgmlType::Q3_K,
            12 => GgmlType::Q4_K,
            13 => GgmlType::Q5_K,
            14 => GgmlType::Q6_K,
            15 => GgmlType::Q8_K,
            20 => GgmlType::IQ4_NL,
            23 => GgmlType::IQ4_XS,
            30 => GgmlType::BF16,
            other => GgmlType::Unsupported(other),
        }
    }

    /// The ggml type id.
    pub fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q4_1 => 3,
            GgmlType::Q5_0 => 6,
            GgmlType::Q5_1 => 7,
            GgmlType::Q8_0 => 8,
            GgmlType::Q2_K => 10,
            GgmlType::Q3_K => 11,
            GgmlType::Q4_K => 12,
            GgmlType::Q5_K => 13,
            GgmlType::Q6_K => 14,
            GgmlType::Q8_K => 15,
            GgmlType::IQ4_NL => 20,
            GgmlType::IQ4_XS => 23,
            GgmlType::BF16 => 30,
            GgmlType::Unsupported(id) => id,
        }
    }

    /// ggml's name of the type (`"Q4_K"` for id 12), or `"unknown"`.
    pub fn name(self) -> &'static str {
        match self.id() {
            0 => "F32",
            1 => "F16",
            2 => "Q4_0",
            3 => "Q4_1",
            4 => "Q4_2",
            5 => "Q4_3",
            6 => "Q5_0",
            7 => "Q5_1",
            8 => "Q8_0",
            9 => "Q8_1",
            10 => "Q2_K",
            11 => "Q3_K",
            12 => "Q4_K",
            13 => "Q5_K",
            14 => "Q6_K",
            15 => "Q8_K",
            16 => "IQ2_XXS",
            17 => "IQ2_XS",
            18 => "IQ3_XXS",
            19 => "IQ1_S",
            20 => "IQ4_NL",
            21 => "IQ3_S",
            22 => "IQ2_S",
            23 => "IQ4_XS",
            24 => "I8",
            25 => "I16",
            26 => "I32",
            27 => "I64",
            28 => "F64",
            29 => "IQ1_M",
            30 => "BF16",
            34 => "TQ1_0",
            35 => "TQ2_0",
            39 => "MXFP4",
            _ => "unknown",
        }
    }

    /// Whether Baton can use tensors of this type.
    pub fn is_supported(self) -> bool {
        !matches!(self, GgmlType::Unsupported(_))
    }

    /// Elements per block and bytes per block, as ggml-common.h defines them
    /// (`None` for unsupported types). The engine checks this table against its
    /// kernels' formats in one place.
    fn block(self) -> Option<(u64, u64)> {
        Some(match self {
            GgmlType::F32 => (1, 4),
            GgmlType::F16 | GgmlType::BF16 => (1, 2),
            GgmlType::Q4_0 => (32, 18),
            GgmlType::Q4_1 => (32, 20),
            GgmlType::Q5_0 => (32, 22),
            GgmlType::Q5_1 => (32, 24),
            GgmlType::Q8_0 => (32, 34),
            GgmlType::IQ4_NL => (32, 18),
            GgmlType::Q2_K => (256, 84),
            GgmlType::Q3_K => (256, 110),
            GgmlType::Q4_K => (256, 144),
            GgmlType::Q5_K => (256, 176),
            GgmlType::Q6_K => (256, 210),
            GgmlType::Q8_K => (256, 292),
            GgmlType::IQ4_XS => (256, 136),
            GgmlType::Unsupported(_) => return None,
        })
    }

    /// Elements per block (`None` for unsupported types).
    pub fn block_len(self) -> Option<u64> {
        self.block().map(|(len, _)| len)
    }

    /// Bytes per block (`None` for unsupported types).
    pub fn block_bytes(self) -> Option<u64> {
        self.block().map(|(_, bytes)| bytes)
    }

    /// Bytes taken by `n_elements` elements, `None` if the type is
    /// unsupported, `n_elements` is not a whole number of blocks, or on overflow.
    pub fn bytes_for(self, n_elements: u64) -> Option<u64> {
        let (len, bytes) = (self.block_len()?, self.block_bytes()?);
        // (`is_multiple_of` would need Rust 1.87; the workspace targets 1.85.)
        let partial = n_elements % len;
        if partial != 0 {
            return None;
        }
        (n_elements / len).checked_mul(bytes)
    }
}

/// One entry of the tensor table.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// ggml order: `dims[0]` is the innermost (row length).
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// Absolute offset of the tensor's first byte in the file.
    pub offset: u64,
    /// Size of the tensor's data; `None` when the type is unsupported (its
    /// size is then unknown and its bounds were not checked).
    pub n_bytes: Option<u64>,
}

impl TensorInfo {
    /// Number of elements (product of `dims`; checked not to overflow at open).
    pub fn n_elements(&self) -> u64 {
        self.dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .unwrap_or(u64::MAX)
    }

    /// Elements per row (`dims[0]`, 1 for a scalar).
    pub fn row_len(&self) -> u64 {
        self.dims.first().copied().unwrap_or(1)
    }

    /// Number of rows (`n_elements / row_len`).
    pub fn n_rows(&self) -> u64 {
        self.dims
            .iter()
            .skip(1)
            .fold(1u64, |acc, &d| acc.saturating_mul(d))
    }
}
