//! SentencePiece tokenizer from GGUF metadata (`tokenizer.ggml.model =
//! "llama"`: Llama 1/2, Mistral, Gemma, Phi-3), token for token as llama.cpp's
//! `llm_tokenizer_spm` (src/llama-vocab.cpp), written independently.
//!
//! Owns: the SPM half of [`crate::tokenizer::Tokenizer`]: text -> IDs, and the
//! bytes each ID decodes to. The public API stays the `Tokenizer`'s.
//!
//! How llama.cpp encodes, and so how this does:
//! 1. special-token partition: every control, unknown and user-defined token
//!    text is cut out of the input, longest token first over the whole text
//!    (not leftmost-longest), each one leftmost and non-overlapping inside the
//!    pieces the longer ones left; control/unknown only with `parse_special`,
//!    user-defined always;
//! 2. each remaining text piece gets a space in front when `add_space_prefix`
//!    and the piece before was a token (or it is the first), spaces become
//!    `▁`, and the piece is split into UTF-8 characters;
//! 3. adjacent symbols whose concatenation is in the vocabulary are merged,
//!    highest score first, leftmost first on ties;
//! 4. a final symbol that is not a token is emitted as byte tokens `<0xHH>`
//!    (or the single-byte token when the vocabulary has no `<0xHH>`).
//!
//! Decoding: normal tokens turn `▁` back into spaces, byte tokens are their
//! byte, control/unknown/user-defined tokens are their text, unused ones are
//! empty.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use aho_corasick::{AhoCorasick, AhoCorasickKind};

use crate::gguf::GgufFile;
use crate::tokenizer::{special_token_id, TokenizerError};

/// llama.cpp token types (`tokenizer.ggml.token_type`).
const TYPE_NORMAL: i32 = 1;
const TYPE_UNKNOWN: i32 = 2;
const TYPE_CONTROL: i32 = 3;
const TYPE_USER_DEFINED: i32 = 4;
const TYPE_BYTE: i32 = 6;

/// Token texts llama.cpp always treats as control (end-of-generation) tokens,
/// whatever type the file gives them.
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];

/// The SentencePiece space marker.
const SPACE_MARK: &str = "\u{2581}";

/// Errors that only SentencePiece vocabularies have.
#[derive(Debug, thiserror::Error)]
pub enum SpmError {
    #[error("token {id} has the byte type but its text {text:?} is not <0xHH>")]
    BadByteToken { id: u32, text: String },
    #[error("token text {text:?} appears twice (IDs {first} and {second})")]
    DuplicateToken {
        text: String,
        first: u32,
        second: u32,
    },
    #[error("the text needs byte 0x{byte:02X}, which has no token (neither <0x{byte:02X}> nor the byte itself)")]
    NoByteToken { byte: u8 },
    #[error("cannot build the special-token matcher: {reason}")]
    Matcher { reason: String },
    #[error("a SentencePiece vocabulary cannot be exported as a byte-level BPE tokenizer.json")]
    NoTokenizerJson,
}

impl SpmError {
    /// A stable, short name of the variant, for metric labels and API errors.
    pub fn label(&self) -> &'static str {
        match self {
            SpmError::BadByteToken { .. } => "bad_byte_token",
            SpmError::DuplicateToken { .. } => "duplicate_token",
            SpmError::NoByteToken { .. } => "no_byte_token",
            SpmError::Matcher { .. } => "special_matcher",
            SpmError::NoTokenizerJson => "no_tokenizer_json",
        }
    }
}

/// Token text -> ID: open addressing over one byte arena, so that building it
/// for a 262k vocabulary allocates three vectors, not one box per token.
struct TokenIndex {
    arena: Vec<u8>,
    /// Token `i` is `arena[offsets[i]..offsets[i + 1]]`.
    offsets: Vec<u32>,
    /// `hash << 32 | (ID + 1)`, 0 for an empty slot; the hash half skips
    /// most text comparisons. At most half full; a power of two long.
    slots: Vec<u64>,
    shift: u32,
}

fn hash_bytes(b: &[u8]) -> u64 {
    const K: u64 = 0x517c_c1b7_2722_0a95;
    let mut h = (b.len() as u64).wrapping_mul(K);
    let mut chunks = b.chunks_exact(8);
    for c in &mut chunks {
        let w = u64::from_le_bytes(c.try_into().expect("8 bytes"));
        h = (h.rotate_left(5) ^ w).wrapping_mul(K);
    }
    let mut tail = 0u64;
    for (i, &x) in chunks.remainder().iter().enumerate() {
        tail |= u64::from(x) << (8 * i);
    }
    (h.rotate_left(5) ^ tail).wrapping_mul(K)
}

impl TokenIndex {
    fn new(texts: &[String]) -> Result<Self, SpmError> {
        let total: usize = texts.iter().map(String::len).sum();
        let mut arena = Vec::with_capacity(total);
        let mut offsets = Vec::with_capacity(texts.len() + 1);
        offsets.push(0);
        for t in texts {
            arena.extend_from_slice(t.as_bytes());
            offsets.push(arena.len() as u32);
        }
        let cap = (texts.len() * 2).next_power_of_two().max(16);
        let mut idx = TokenIndex {
            arena,
            offsets,
            slots: vec![0; cap],
            shift: 64 - cap.trailing_zeros(),
        };
        let mask = cap - 1;
        for id in 0..texts.len() as u32 {
            let h = hash_bytes(idx.text(id));
            let tag = h & 0xffff_ffff_0000_0000;
            let mut s = (h >> idx.shift) as usize;
            while idx.slots[s] != 0 {
                let other = (idx.slots[s] as u32).wrapping_sub(1);
                if idx.slots[s] & 0xffff_ffff_0000_0000 == tag && idx.text(other) == idx.text(id) {
                    // llama.cpp refuses such a vocabulary too (an assertion).
                    return Err(SpmError::DuplicateToken {
                        text: texts[id as usize].clone(),
                        first: other,
                        second: id,
                    });
                }
                s = (s + 1) & mask;
            }
            idx.slots[s] = tag | u64::from(id + 1);
        }
        Ok(idx)
    }

    fn text(&self, id: u32) -> &[u8] {
        let i = id as usize;
        &self.arena[self.offsets[i] as usize..self.offsets[i + 1] as usize]
    }

    fn get(&self, key: &[u8]) -> Option<u32> {
        let h = hash_bytes(key);
        let tag = h & 0xffff_ffff_0000_0000;
        let mask = self.slots.len() - 1;
        let mut s = (h >> self.shift) as usize;
        loop {
            let v = self.slots[s];
            if v == 0 {
                return None;
            }
            let id = (v as u32).wrapping_sub(1);
            if v & 0xffff_ffff_0000_0000 == tag && self.text(id) == key {
                return Some(id);
            }
            s = (s + 1) & mask;
        }
    }
}

/// The tokens cut out of the text before the SPM merges.
struct Specials {
    /// All control/unknown/user-defined texts; `None` when there are none.
    matcher: Option<AhoCorasick>,
    /// Per pattern, in llama.cpp's processing order (longest first): token
    /// ID, whether it is matched only with `parse_special`, whether it eats
    /// the whitespace after it.
    id: Vec<u32>,
    needs_parse_special: Vec<bool>,
    rstrip: Vec<bool>,
}

/// One piece of the partitioned input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fragment {
    Text { start: usize, end: usize },
    Token(u32),
}

/// What [`crate::tokenizer::Tokenizer`] needs of an SPM vocabulary.
pub(crate) struct SpmParts {
    pub vocab: SpmVocab,
    pub tokens: Vec<String>,
    pub pieces: Vec<Vec<u8>>,
    pub special: Vec<bool>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    /// End-of-generation IDs (llama.cpp's EOG set: EOS, EOT/EOM and the
    /// end-of-turn tokens it knows by name, e.g. Gemma's `<end_of_turn>`).
    pub eog: Vec<u32>,
    pub add_bos: bool,
}

/// The encoder of an SPM vocabulary.
pub(crate) struct SpmVocab {
    index: TokenIndex,
    scores: Vec<f32>,
    max_token_len: usize,
    byte_ids: [Option<u32>; 256],
    specials: Specials,
    add_space_prefix: bool,
}

/// A pair of adjacent symbols whose concatenation is a token.
#[derive(Debug, Clone, Copy)]
struct Bigram {
    left: i32,
    right: i32,
    score: f32,
    size: usize,
}

impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Bigram {}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Bigram {
    /// The heap's top is the highest score, then the leftmost (llama.cpp's
    /// comparator; `-0.0 == 0.0` as with C++ `<`).
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .partial_cmp(&other.score)
            .unwrap_or(Ordering::Equal)
            .then_with(|| other.left.cmp(&self.left))
    }
}

/// A run of input bytes in the merge chain; `n == 0` once merged away.
#[derive(Debug, Clone, Copy)]
struct Symbol {
    start: usize,
    n: usize,
    prev: i32,
    next: i32,
}

/// Buffers of the merge step, reused across the text pieces of one encode.
#[derive(Default)]
struct Scratch {
    symbols: Vec<Symbol>,
    heap: BinaryHeap<Bigram>,
}

/// Bytes of a UTF-8 sequence by its first byte (llama.cpp's `unicode_len_utf8`).
fn utf8_len(first: u8) -> usize {
    match first >> 4 {
        0xc | 0xd => 2,
        0xe => 3,
        0xf => 4,
        _ => 1,
    }
}

/// C `isspace` in the "C" locale.
fn c_isspace(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | 0x0b | 0x0c | b'\r')
}

/// `<0xHH>` -> the byte.
fn parse_byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

/// Builds the SPM tokenizer parts from `tokenizer.ggml.*` metadata, with
/// llama.cpp's defaults for what is absent (BOS 1, EOS 2, `add_bos_token`
/// and `add_space_prefix` true).
pub(crate) fn from_gguf(f: &GgufFile) -> Result<SpmParts, TokenizerError> {
    let raw = f.get_str_array("tokenizer.ggml.tokens")?;
    let n = raw.len();
    // llama.cpp renames empty tokens so that each text names one token.
    let tokens: Vec<String> = raw
        .iter()
        .enumerate()
        .map(|(i, t)| {
            if t.is_empty() {
                format!("[EMPTY_{i}]")
            } else {
                t.to_string()
            }
        })
        .collect();
    let scores = match f.get("tokenizer.ggml.scores") {
        None => vec![0.0; n],
        Some(_) => match f.get_f32_array("tokenizer.ggml.scores") {
            Ok(s) => s,
            // llama.cpp also accepts integer scores.
            Err(_) => f
                .get_i32_array("tokenizer.ggml.scores")?
                .into_iter()
                .map(|s| s as f32)
                .collect(),
        },
    };
    let mut types = match f.get("tokenizer.ggml.token_type") {
        Some(_) => f.get_i32_array("tokenizer.ggml.token_type")?,
        None => vec![TYPE_NORMAL; n],
    };
    for (what, len) in [
        ("tokenizer.ggml.scores", scores.len()),
        ("tokenizer.ggml.token_type", types.len()),
    ] {
        if len != n {
            return Err(TokenizerError::LengthMismatch {
                what,
                expected: n,
                found: len,
            });
        }
    }
    let mut control: Vec<bool> = types.iter().map(|&t| t == TYPE_CONTROL).collect();
    for (i, t) in tokens.iter().enumerate() {
        if EOG_TEXTS.contains(&t.as_str()) {
            control[i] = true;
        }
    }
    let bos = special_token_id(f, "tokenizer.ggml.bos_token_id", n, Some(1))?;
    let eos = special_token_id(f, "tokenizer.ggml.eos_token_id", n, Some(2))?;
    let mut eog: Vec<u32> = (0..n as u32)
        .filter(|&i| EOG_TEXTS.contains(&tokens[i as usize].as_str()))
        .collect();
    for key in ["tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"] {
        eog.extend(special_token_id(f, key, n, None)?);
    }
    eog.extend(eos);
    eog.sort_unstable();
    eog.dedup();
    let flag = |key: &str, default: bool| -> Result<bool, TokenizerError> {
        match f.get(key) {
            Some(_) => Ok(f.get_bool(key)?),
            None => Ok(default),
        }
    };
    let add_bos = flag("tokenizer.ggml.add_bos_token", true)?;
    let add_space_prefix = flag("tokenizer.ggml.add_space_prefix", true)?;
    // Phi-3's special tokens eat the whitespace after them (llama.cpp
    // decides this by the model name).
    let name = f.opt_str("general.name").unwrap_or("").to_lowercase();
    let phi3 = name.contains("phi-3") || name.contains("phi3");

    let index = TokenIndex::new(&tokens)?;
    let mut byte_ids = [None; 256];
    for (b, slot) in byte_ids.iter_mut().enumerate() {
        *slot = index
            .get(format!("<0x{b:02X}>").as_bytes())
            .or_else(|| index.get(&[b as u8]));
    }
    let mut pieces = Vec::with_capacity(n);
    for (i, t) in tokens.iter().enumerate() {
        let is_special = control[i] || types[i] == TYPE_UNKNOWN;
        pieces.push(match types[i] {
            _ if is_special || types[i] == TYPE_USER_DEFINED => t.as_bytes().to_vec(),
            TYPE_NORMAL => t.replace(SPACE_MARK, " ").into_bytes(),
            TYPE_BYTE => match parse_byte_token(t) {
                Some(b) => vec![b],
                None => {
                    return Err(SpmError::BadByteToken {
                        id: i as u32,
                        text: t.clone(),
                    }
                    .into())
                }
            },
            // Unused and undefined types decode to nothing.
            _ => Vec::new(),
        });
    }
    // A token both user-defined and made control by its name behaves as control.
    for (i, t) in types.iter_mut().enumerate() {
        if control[i] {
            *t = TYPE_CONTROL;
        }
    }
    let specials = build_specials(&tokens, &types, phi3)?;
    let special = (0..n)
        .map(|i| types[i] == TYPE_CONTROL || types[i] == TYPE_UNKNOWN)
        .collect();
    let max_token_len = tokens.iter().map(String::len).max().unwrap_or(0);
    Ok(SpmParts {
        vocab: SpmVocab {
            index,
            scores,
            max_token_len,
            byte_ids,
            specials,
            add_space_prefix,
        },
        tokens,
        pieces,
        special,
        bos,
        eos,
        eog,
        add_bos,
    })
}

fn build_specials(tokens: &[String], types: &[i32], phi3: bool) -> Result<Specials, SpmError> {
    let mut ids: Vec<u32> = (0..tokens.len() as u32)
        .filter(|&i| {
            matches!(
                types[i as usize],
                TYPE_CONTROL | TYPE_UNKNOWN | TYPE_USER_DEFINED
            )
        })
        .collect();
    // llama.cpp's order: longer texts first. It sorts with an unstable sort,
    // so equal lengths are in no defined order; that matters only for two
    // equal-length tokens overlapping in the text (none in Gemma 3's
    // vocabulary), and here ties go to the lower ID.
    ids.sort_by_key(|&i| (std::cmp::Reverse(tokens[i as usize].len()), i));
    let id = ids;
    if id.len() >= 1 << 24 {
        return Err(SpmError::Matcher {
            reason: format!("{} special tokens (at most 2^24)", id.len()),
        });
    }
    let needs_parse_special = id
        .iter()
        .map(|&i| matches!(types[i as usize], TYPE_CONTROL | TYPE_UNKNOWN))
        .collect();
    let rstrip = id
        .iter()
        .map(|&i| {
            let t = tokens[i as usize].as_str();
            phi3 && (t == "</s>" || !matches!(t, "<unk>" | "<s>" | "<|endoftext|>"))
        })
        .collect();
    let matcher = if id.is_empty() {
        None
    } else {
        let patterns = id.iter().map(|&i| tokens[i as usize].as_bytes());
        // A contiguous NFA builds in milliseconds for thousands of patterns.
        let ac = AhoCorasick::builder()
            .kind(Some(AhoCorasickKind::ContiguousNFA))
            .build(patterns)
            .map_err(|e| SpmError::Matcher {
                reason: e.to_string(),
            })?;
        Some(ac)
    };
    Ok(Specials {
        matcher,
        id,
        needs_parse_special,
        rstrip,
    })
}

impl SpmVocab {
    /// Whether text after a token (or at the start) gets a `▁` in front.
    pub(crate) fn add_space_prefix(&self) -> bool {
        self.add_space_prefix
    }

    /// The ID whose vocabulary text is `token` (after `[EMPTY_i]` renaming).
    pub(crate) fn token_id(&self, token: &str) -> Option<u32> {
        self.index.get(token.as_bytes())
    }

    /// Token IDs of `text`, never with BOS/EOS (the `Tokenizer` contract).
    pub(crate) fn encode(&self, text: &str, parse_special: bool) -> Result<Vec<u32>, SpmError> {
        let mut out = Vec::with_capacity(text.len() / 3 + 4);
        let mut buf = String::new();
        let mut scratch = Scratch::default();
        let mut prev_was_token = true;
        for frag in self.partition(text, parse_special) {
            match frag {
                Fragment::Token(id) => {
                    out.push(id);
                    prev_was_token = true;
                }
                Fragment::Text { start, end } => {
                    buf.clear();
                    if self.add_space_prefix && prev_was_token {
                        buf.push_str(SPACE_MARK);
                    }
                    for c in text[start..end].chars() {
                        if c == ' ' {
                            buf.push_str(SPACE_MARK);
                        } else {
                            buf.push(c);
                        }
                    }
                    self.merge(buf.as_bytes(), &mut scratch, &mut out)?;
                    prev_was_token = false;
                }
            }
        }
        Ok(out)
    }

    /// Cuts special tokens out of `text` as llama.cpp's
    /// `tokenizer_st_partition` does: token by token in rank order, each
    /// taking its leftmost non-overlapping occurrences that lie wholly in
    /// text no earlier token took.
    fn partition(&self, text: &str, parse_special: bool) -> Vec<Fragment> {
        let whole = |text: &str| {
            if text.is_empty() {
                vec![]
            } else {
                vec![Fragment::Text {
                    start: 0,
                    end: text.len(),
                }]
            }
        };
        let sp = &self.specials;
        let Some(matcher) = &sp.matcher else {
            return whole(text);
        };
        // (pattern = rank, start) of every occurrence, overlapping ones included.
        // Packed as one u64 (pattern, start) so the sort is on plain integers:
        // 24 bits of pattern (checked at load), 40 of offset (a 1 TiB text).
        let mut occ: Vec<u64> = matcher
            .find_overlapping_iter(text)
            .map(|m| (m.pattern().as_usize(), m.start()))
            .filter(|&(p, _)| parse_special || !sp.needs_parse_special[p])
            .map(|(p, start)| (p as u64) << 40 | start as u64)
            .collect();
        if occ.is_empty() {
            return whole(text);
        }
        occ.sort_unstable();
        let bytes = text.as_bytes();
        let mut taken = vec![false; bytes.len()];
        let mut found: Vec<(usize, usize, u32)> = Vec::new();
        for &packed in &occ {
            let (p, start) = ((packed >> 40) as usize, (packed & ((1 << 40) - 1)) as usize);
            let id = sp.id[p];
            let end = start + self.index.text(id).len();
            if taken[start..end].iter().any(|&t| t) {
                continue;
            }
            taken[start..end].iter_mut().for_each(|t| *t = true);
            found.push((start, end, id));
            if sp.rstrip[p] {
                let mut k = end;
                while k < bytes.len() && !taken[k] && c_isspace(bytes[k]) {
                    taken[k] = true;
                    k += 1;
                }
            }
        }
        found.sort_unstable();
        let mut out = Vec::with_capacity(2 * found.len() + 1);
        let mut pos = 0;
        let push_text = |out: &mut Vec<Fragment>, mut a: usize, b: usize| {
            // Bytes taken but not in a token were stripped whitespace.
            while a < b && taken[a] {
                a += 1;
            }
            if a < b {
                out.push(Fragment::Text { start: a, end: b });
            }
        };
        for &(start, end, id) in &found {
            push_text(&mut out, pos, start);
            out.push(Fragment::Token(id));
            pos = end;
        }
        push_text(&mut out, pos, bytes.len());
        out
    }

    /// llama.cpp's `llm_tokenizer_spm_session::tokenize` over escaped text.
    fn merge(
        &self,
        text: &[u8],
        scratch: &mut Scratch,
        out: &mut Vec<u32>,
    ) -> Result<(), SpmError> {
        if text.is_empty() {
            return Ok(());
        }
        let Scratch { symbols, heap } = scratch;
        symbols.clear();
        heap.clear();
        let mut offs = 0;
        while offs < text.len() {
            let n = utf8_len(text[offs]).min(text.len() - offs);
            let i = symbols.len() as i32;
            symbols.push(Symbol {
                start: offs,
                n,
                prev: i - 1,
                next: if offs + n == text.len() { -1 } else { i + 1 },
            });
            offs += n;
        }
        for i in 1..symbols.len() as i32 {
            self.try_add_bigram(text, symbols, i - 1, i, heap);
        }
        while let Some(b) = heap.pop() {
            let (l, r) = (symbols[b.left as usize], symbols[b.right as usize]);
            // Stale: one side was merged away or grew since this was queued.
            if l.n == 0 || r.n == 0 || l.n + r.n != b.size {
                continue;
            }
            symbols[b.left as usize].n += r.n;
            symbols[b.right as usize].n = 0;
            symbols[b.left as usize].next = r.next;
            if r.next >= 0 {
                symbols[r.next as usize].prev = b.left;
            }
            let left = symbols[b.left as usize];
            self.try_add_bigram(text, symbols, left.prev, b.left, heap);
            self.try_add_bigram(text, symbols, b.left, left.next, heap);
        }
        let mut i = 0i32;
        while i != -1 {
            let s = symbols[i as usize];
            let piece = &text[s.start..s.start + s.n];
            match self.index.get(piece) {
                Some(id) => out.push(id),
                None => {
                    for &byte in piece {
                        out.push(
                            self.byte_ids[byte as usize].ok_or(SpmError::NoByteToken { byte })?,
                        );
                    }
                }
            }
            i = s.next;
        }
        Ok(())
    }

    fn try_add_bigram(
        &self,
        text: &[u8],
        symbols: &[Symbol],
        left: i32,
        right: i32,
        heap: &mut BinaryHeap<Bigram>,
    ) {
        if left < 0 || right < 0 {
            return;
        }
        let (l, r) = (symbols[left as usize], symbols[right as usize]);
        let size = l.n + r.n;
        if size > self.max_token_len {
            return;
        }
        if let Some(id) = self.index.get(&text[l.start..l.start + size]) {
            heap.push(Bigram {
                left,
                right,
                score: self.scores[id as usize],
                size,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_tokens_parse() {
        assert_eq!(parse_byte_token("<0x0A>"), Some(10));
        assert_eq!(parse_byte_token("<0xff>"), Some(255));
        assert_eq!(parse_byte_token("<0x1>"), None);
        assert_eq!(parse_byte_token("<0x1FF>"), None);
        assert_eq!(parse_byte_token("0x0A"), None);
    }

    #[test]
    fn index_finds_every_token_and_refuses_duplicates() {
        let texts: Vec<String> = (0..5000).map(|i| format!("t{i}")).collect();
        let idx = TokenIndex::new(&texts).unwrap();
        for (i, t) in texts.iter().enumerate() {
            assert_eq!(idx.get(t.as_bytes()), Some(i as u32));
        }
        assert_eq!(idx.get(b"t5000"), None);
        assert_eq!(idx.get(b""), None);
        let dup = vec!["a".to_string(), "b".to_string(), "a".to_string()];
        assert!(matches!(
            TokenIndex::new(&dup),
            Err(SpmError::DuplicateToken {
                first: 0,
                second: 2,
                ..
            })
        ));
    }

    #[test]
    fn utf8_lengths() {
        assert_eq!(utf8_len(b'a'), 1);
        assert_eq!("é".as_bytes()[0], 0xc3);
        assert_eq!(utf8_len(0xc3), 2);
        assert_eq!(utf8_len("▁".as_bytes()[0]), 3);
        assert_eq!(utf8_len("😀".as_bytes()[0]), 4);
    }
}
