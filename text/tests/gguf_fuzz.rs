//! Property-based fuzzing of the GGUF reader (issue #21). Small valid files from the test writer are
//! mutated (random bytes flipped or overwritten, truncation at random offsets, and the structural fields
//! — tensor and metadata counts, string and array lengths, array element types, tensor dims, n_dims,
//! types and offsets — set to huge or odd values), then opened with both readers, and every metadata
//! value and every tensor's bytes are read back through the checked accessors.
//!
//! Properties: nothing panics, every error has a non-empty message, and opening plus reading allocates
//! at most a bound proportional to the file's size (a huge declared length must be refused before
//! anything is allocated for it; the counting allocator below measures that per thread).
//!
//! 256 cases per property by default (a few seconds in debug); `BATON_FUZZ_CASES=100000` runs longer.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::path::Path;

use baton_text::gguf::writer::{to_bytes, TensorSpec};
use baton_text::gguf::{GgmlType, GgufError, GgufFile, MetaValue};
use proptest::collection::vec;
use proptest::prelude::*;

/// Counts the bytes each thread has live, and the peak since the last reset, so a property can bound
/// what one open allocates while other tests run on other threads.
struct CountingAlloc;

thread_local! {
    static LIVE: Cell<usize> = const { Cell::new(0) };
    static PEAK: Cell<usize> = const { Cell::new(0) };
}

fn note_alloc(n: usize) {
    let _ = LIVE.try_with(|live| {
        let now = live.get().saturating_add(n);
        live.set(now);
        let _ = PEAK.try_with(|peak| peak.set(peak.get().max(now)));
    });
}

fn note_free(n: usize) {
    let _ = LIVE.try_with(|live| live.set(live.get().saturating_sub(n)));
}

// SAFETY: every call is forwarded to the system allocator unchanged; only counters are updated.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            note_alloc(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        note_free(layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            note_free(layout.size());
            note_alloc(new_size);
        }
        p
    }
}

#[global_allocator]
static ALLOCATOR: CountingAlloc = CountingAlloc;

/// Runs `f` and returns its result with the most heap (bytes) this thread had live above the start.
fn peak_during<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let base = LIVE.with(Cell::get);
    PEAK.with(|p| p.set(base));
    let out = f();
    (out, PEAK.with(Cell::get).saturating_sub(base))
}

/// Heap allowed per byte of file: a decoded array element (a `MetaValue`, 32 bytes) can come from one
/// byte of file, and nested arrays hold one partly read level each; tensor entries cost a few hundred
/// bytes for 24 bytes of file. A length that is not checked before allocating costs gigabytes instead.
const HEAP_PER_FILE_BYTE: usize = 64;
/// Heap allowed regardless of size: the path, error messages, small maps.
const HEAP_SLACK: usize = 64 * 1024;

fn cases() -> u32 {
    std::env::var("BATON_FUZZ_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(256)
}

// GGUF metadata value type ids.
const T_STRING: u32 = 8;
const T_ARRAY: u32 = 9;

/// Offsets of the structural fields of a valid file: where a mutation does the most damage.
#[derive(Default, Debug)]
struct Fields {
    /// Counts, lengths, dims, tensor offsets.
    u64s: Vec<usize>,
    /// Value and element types, n_dims, tensor types.
    u32s: Vec<usize>,
}

/// Walks a file the writer produced (so it trusts it) and records its structural fields.
struct Walk<'a> {
    bytes: &'a [u8],
    pos: usize,
    fields: Fields,
}

impl Walk<'_> {
    fn u32(&mut self) -> u32 {
        self.fields.u32s.push(self.pos);
        let v = u32::from_le_bytes(self.bytes[self.pos..self.pos + 4].try_into().expect("4 bytes"));
        self.pos += 4;
        v
    }

    fn u64(&mut self) -> u64 {
        self.fields.u64s.push(self.pos);
        let v = u64::from_le_bytes(self.bytes[self.pos..self.pos + 8].try_into().expect("8 bytes"));
        self.pos += 8;
        v
    }

    fn string(&mut self) {
        let n = self.u64();
        self.pos += n as usize;
    }

    fn value(&mut self, type_id: u32) {
        match type_id {
            T_STRING => self.string(),
            T_ARRAY => {
                let elem = self.u32();
                let count = self.u64();
                for _ in 0..count {
                    self.value(elem);
                }
            }
            0 | 1 | 7 => self.pos += 1,
            2 | 3 => self.pos += 2,
            4..=6 => self.pos += 4,
            _ => self.pos += 8,
        }
    }

    fn fields_of(bytes: &[u8]) -> Fields {
        let mut w = Walk { bytes, pos: 8, fields: Fields::default() };
        let n_tensors = w.u64();
        let n_kv = w.u64();
        for _ in 0..n_kv {
            w.string();
            let t = w.u32();
            w.value(t);
        }
        for _ in 0..n_tensors {
            w.string();
            let n_dims = w.u32();
            for _ in 0..n_dims {
                w.u64();
            }
            w.u32();
            w.u64();
        }
        w.fields
    }
}

fn meta_value() -> impl Strategy<Value = MetaValue> {
    prop_oneof![
        any::<u8>().prop_map(MetaValue::U8),
        any::<i32>().prop_map(MetaValue::I32),
        any::<u32>().prop_map(MetaValue::U32),
        any::<u64>().prop_map(MetaValue::U64),
        any::<f32>().prop_map(MetaValue::F32),
        any::<bool>().prop_map(MetaValue::Bool),
        "[a-z ]{0,12}".prop_map(MetaValue::String),
        vec(any::<i32>(), 0..6).prop_map(|v| MetaValue::Array(v.into_iter().map(MetaValue::I32).collect())),
        vec("[a-z]{0,5}", 0..6).prop_map(|v| MetaValue::Array(v.into_iter().map(MetaValue::String).collect())),
        vec(vec(any::<u8>(), 0..4), 0..3).prop_map(|outer| {
            MetaValue::Array(outer.into_iter().map(|inner| MetaValue::Array(inner.into_iter().map(MetaValue::U8).collect())).collect())
        }),
    ]
}

/// One of a few small tensors of supported and unsupported types, with the right number of bytes.
fn tensor_spec(index: usize, kind: u8) -> TensorSpec {
    let name = format!("blk.{index}.weight");
    match kind % 6 {
        0 => TensorSpec::f32(name, &[3], &[1.0, 2.0, 3.0]),
        1 => TensorSpec::new(name, &[4, 2], GgmlType::F16, vec![1; 16]),
        2 => TensorSpec::new(name, &[32], GgmlType::Q4_0, vec![2; 18]),
        3 => TensorSpec::new(name, &[32, 2], GgmlType::Q8_0, vec![3; 68]),
        4 => TensorSpec::new(name, &[256], GgmlType::Unsupported(16), vec![4; 66]),
        _ => TensorSpec::new(name, &[256], GgmlType::Q4_K, vec![5; 144]),
    }
}

/// A small valid file: a few metadata values of every shape, maybe an alignment, a few tensors.
fn valid_file() -> impl Strategy<Value = Vec<u8>> {
    (vec(meta_value(), 0..6), prop_oneof![Just(None), Just(Some(16u32)), Just(Some(64u32))], vec(any::<u8>(), 0..4), 2u32..4)
        .prop_map(|(values, alignment, kinds, version)| {
            let mut meta: Vec<(String, MetaValue)> =
                values.into_iter().enumerate().map(|(i, v)| (format!("k.{i}"), v)).collect();
            if let Some(a) = alignment {
                meta.push(("general.alignment".into(), MetaValue::U32(a)));
            }
            let tensors: Vec<TensorSpec> = kinds.into_iter().enumerate().map(|(i, k)| tensor_spec(i, k)).collect();
            to_bytes(version, &meta, &tensors).expect("the writer takes every generated file")
        })
}

const HUGE_U64: [u64; 9] = [u64::MAX, u64::MAX - 7, u64::MAX / 2, 1 << 62, 1 << 40, 1 << 32, u32::MAX as u64, 1 << 20, 0];
const ODD_U32: [u32; 7] = [u32::MAX, 1 << 31, 99, 13, 5, 9, 0];

#[derive(Debug, Clone)]
enum Mutation {
    FlipBit(prop::sample::Index, u8),
    Overwrite(prop::sample::Index, u8),
    Truncate(prop::sample::Index),
    /// A structural u64 field set to a huge value, or to the file length plus a little.
    InflateU64(prop::sample::Index, prop::sample::Index, u64),
    /// A structural u32 field (a type id, n_dims) set to an odd value.
    OddU32(prop::sample::Index, prop::sample::Index),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        1 => (any::<prop::sample::Index>(), 0u8..8).prop_map(|(i, bit)| Mutation::FlipBit(i, bit)),
        1 => (any::<prop::sample::Index>(), any::<u8>()).prop_map(|(i, b)| Mutation::Overwrite(i, b)),
        1 => any::<prop::sample::Index>().prop_map(Mutation::Truncate),
        3 => (any::<prop::sample::Index>(), any::<prop::sample::Index>(), 0u64..64).prop_map(|(f, v, extra)| Mutation::InflateU64(f, v, extra)),
        2 => (any::<prop::sample::Index>(), any::<prop::sample::Index>()).prop_map(|(f, v)| Mutation::OddU32(f, v)),
    ]
}

fn apply(bytes: &mut Vec<u8>, fields: &Fields, m: &Mutation) {
    if bytes.is_empty() {
        return;
    }
    match m {
        Mutation::FlipBit(at, bit) => {
            let i = at.index(bytes.len());
            bytes[i] ^= 1 << bit;
        }
        Mutation::Overwrite(at, b) => {
            let i = at.index(bytes.len());
            bytes[i] = *b;
        }
        Mutation::Truncate(at) => bytes.truncate(at.index(bytes.len() + 1)),
        Mutation::InflateU64(field, value, extra) => {
            if fields.u64s.is_empty() {
                return;
            }
            let at = fields.u64s[field.index(fields.u64s.len())];
            // Most values are huge, the last choice lands just past the end of the file.
            let choices = HUGE_U64.len() + 1;
            let v = match value.index(choices) {
                i if i < HUGE_U64.len() => HUGE_U64[i],
                _ => bytes.len() as u64 + extra,
            };
            if let Some(slot) = bytes.get_mut(at..at + 8) {
                slot.copy_from_slice(&v.to_le_bytes());
            }
        }
        Mutation::OddU32(field, value) => {
            if fields.u32s.is_empty() {
                return;
            }
            let at = fields.u32s[field.index(fields.u32s.len())];
            let v = ODD_U32[value.index(ODD_U32.len())];
            if let Some(slot) = bytes.get_mut(at..at + 4) {
                slot.copy_from_slice(&v.to_le_bytes());
            }
        }
    }
}

/// Reads every metadata value through every typed getter and every tensor through the checked
/// accessor; returns the messages of the errors met (each must be non-empty).
fn read_everything(g: &GgufFile) -> Vec<String> {
    let mut messages = Vec::new();
    let mut note = |r: Result<(), GgufError>| {
        if let Err(e) = r {
            messages.push(e.to_string());
        }
    };
    for key in g.metadata.keys() {
        assert!(g.get(key).is_some(), "key {key:?} listed but not found");
        note(g.get_u32(key).map(drop));
        note(g.get_u64(key).map(drop));
        note(g.get_f32(key).map(drop));
        note(g.get_str(key).map(drop));
        note(g.get_bool(key).map(drop));
        note(g.get_array(key).map(drop));
        note(g.get_array_len(key).map(drop));
        note(g.get_str_array(key).map(drop));
        note(g.get_i32_array(key).map(drop));
        note(g.get_f32_array(key).map(drop));
    }
    for t in &g.tensors {
        note(g.tensor_data_checked(t).map(|data| {
            assert_eq!(Some(data.len() as u64), t.n_bytes, "tensor {:?} of a supported type reads whole", t.name);
            assert!(t.offset + data.len() as u64 <= g.file_len);
        }));
        note(g.require_tensor(&t.name, &t.dims).map(drop));
        let _ = (t.n_elements(), t.row_len(), t.n_rows());
    }
    messages
}

/// Opens `bytes` with both readers, reads everything, and checks the three properties.
fn exercise(dir: &Path, bytes: &[u8]) -> Result<(), TestCaseError> {
    let path = dir.join("fuzz.gguf");
    std::fs::write(&path, bytes).map_err(|e| TestCaseError::fail(format!("writing the case: {e}")))?;
    let bound = HEAP_PER_FILE_BYTE * bytes.len() + HEAP_SLACK;
    type Opener = fn(&Path) -> Result<GgufFile, GgufError>;
    let openers: [(&str, Opener); 2] = [("open", GgufFile::open), ("open_header", GgufFile::open_header)];
    for (name, open) in openers {
        let (messages, peak) = peak_during(|| match open(&path) {
            Ok(g) => read_everything(&g),
            Err(e) => vec![e.to_string()],
        });
        prop_assert!(peak <= bound, "{name} of a {}-byte file allocated {peak} bytes (bound {bound})", bytes.len());
        for m in messages {
            prop_assert!(!m.trim().is_empty(), "{name}: an error with an empty message");
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    /// Valid files open and read back whole, within the allocation bound.
    #[test]
    fn valid_files_open_within_the_bound(file in valid_file()) {
        let dir = tempfile::tempdir().map_err(|e| TestCaseError::fail(e.to_string()))?;
        let path = dir.path().join("valid.gguf");
        std::fs::write(&path, &file).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert!(GgufFile::open(&path).is_ok());
        prop_assert!(GgufFile::open_header(&path).is_ok());
        exercise(dir.path(), &file)?;
    }

    /// Mutated valid files (bytes, truncation, inflated counts, lengths, dims and offsets) never panic,
    /// never allocate past the bound, and fail with a message.
    #[test]
    fn mutated_files_never_panic_or_overallocate(file in valid_file(), mutations in vec(mutation(), 1..5)) {
        let dir = tempfile::tempdir().map_err(|e| TestCaseError::fail(e.to_string()))?;
        let fields = Walk::fields_of(&file);
        let mut bytes = file;
        for m in &mutations {
            apply(&mut bytes, &fields, m);
        }
        exercise(dir.path(), &bytes)?;
    }
}

/// Deterministic sweep: every structural field of one file set to every huge or odd value, one at a time.
#[test]
fn every_structural_field_set_to_every_huge_value() {
    let dir = tempfile::tempdir().expect("temp dir");
    let meta = vec![
        ("general.architecture", MetaValue::String("llama".into())),
        ("n", MetaValue::U32(3)),
        ("toks", MetaValue::Array(vec![MetaValue::String("ab".into()), MetaValue::String("c".into())])),
        ("nested", MetaValue::Array(vec![MetaValue::Array(vec![MetaValue::U8(1), MetaValue::U8(2)]), MetaValue::Array(vec![])])),
    ];
    let tensors: Vec<TensorSpec> = (0u8..6).map(|k| tensor_spec(k as usize, k)).collect();
    let file = to_bytes(3, &meta, &tensors).expect("valid file");
    let fields = Walk::fields_of(&file);
    assert!(fields.u64s.len() > 20 && fields.u32s.len() > 15, "{fields:?}");
    for &at in &fields.u64s {
        for v in HUGE_U64.into_iter().chain([file.len() as u64, file.len() as u64 + 1]) {
            let mut b = file.clone();
            b[at..at + 8].copy_from_slice(&v.to_le_bytes());
            exercise(dir.path(), &b).unwrap_or_else(|e| panic!("u64 at {at} = {v}: {e}"));
        }
    }
    for &at in &fields.u32s {
        for v in ODD_U32 {
            let mut b = file.clone();
            b[at..at + 4].copy_from_slice(&v.to_le_bytes());
            exercise(dir.path(), &b).unwrap_or_else(|e| panic!("u32 at {at} = {v}: {e}"));
        }
    }
}
