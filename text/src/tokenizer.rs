//! Byte-level BPE tokenizer, built from GGUF metadata or a Hugging Face
//! `tokenizer.json`, with llama.cpp-compatible pre-tokenization; GGUF
//! SentencePiece vocabularies (`tokenizer.ggml.model = "llama"`) are encoded
//! by [`crate::spm_tokenizer`] behind the same [`Tokenizer`].
//!
//! Owns: text -> token IDs (via the `tokenizers` crate for BPE), token IDs ->
//! bytes and text (own tables), and incremental decoding for streaming.
//!
//! Invariants:
//! - the pre-tokenizer is chosen from `tokenizer.ggml.pre` by name and must
//!   split text exactly as llama.cpp does for that name; an unknown name is
//!   an error ([`TokenizerError::UnsupportedPreTokenizer`]), never a default.
//!   For `smollm` llama.cpp runs the regexes `\p{N}` then the GPT-2 regex;
//!   this is HF's `Digits(individual_digits) + ByteLevel`, which is what the
//!   SmolLM2 `tokenizer.json` declares as well;
//! - control (and unknown-type) tokens are special added tokens: their text
//!   in a prompt maps to their single ID only when `parse_special` is true;
//!   user-defined tokens are always matched (both as in llama.cpp);
//! - `encode` never adds BOS/EOS; callers consult [`Tokenizer::add_bos`];
//! - decoding is by bytes: each ID maps to fixed bytes, so concatenating the
//!   pieces of any ID sequence and decoding lossily equals what
//!   [`IncrementalDecoder`] emits piece by piece.

use std::borrow::Cow;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::processors::PostProcessorWrapper;
use tokenizers::{AddedToken, DecoderWrapper, ModelWrapper, SplitDelimiterBehavior};

use crate::gguf::{GgufError, GgufFile};
// --- SentencePiece hook (the encoder lives in spm_tokenizer.rs) ---
use crate::spm_tokenizer::{self, SpmError, SpmVocab};

/// llama.cpp token types (`tokenizer.ggml.token_type`).
const TYPE_UNKNOWN: i32 = 2;
const TYPE_CONTROL: i32 = 3;
const TYPE_USER_DEFINED: i32 = 4;

/// llama.cpp's GPT-2 split regex (it emulates the trailing `|\s+` in code).
const GPT2_REGEX: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// Errors of tokenizer construction and encoding.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("tokenizer model {model:?} is not supported (only \"gpt2\", byte-level BPE, and \"llama\", SentencePiece)")]
    UnsupportedModel { model: String },
    #[error("pre-tokenizer {pre:?} is not supported (supported: smollm, gpt-2, default and their llama.cpp aliases)")]
    UnsupportedPreTokenizer { pre: String },
    #[error("{what} has {found} entries, expected {expected}")]
    LengthMismatch {
        what: &'static str,
        expected: usize,
        found: usize,
    },
    #[error("merge #{index} {merge:?} is not two tokens separated by a space")]
    BadMerge { index: usize, merge: String },
    #[error("{what} token ID {id} is outside the vocabulary of {vocab_size}")]
    TokenIdOutOfRange {
        what: &'static str,
        id: u32,
        vocab_size: usize,
    },
    #[error("cannot build the tokenizer: {source}")]
    Build {
        #[source]
        source: tokenizers::Error,
    },
    #[error("cannot encode text: {source}")]
    Encode {
        #[source]
        source: tokenizers::Error,
    },
    #[error("{path}: cannot read: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: cannot load tokenizer: {source}")]
    Load {
        path: PathBuf,
        #[source]
        source: tokenizers::Error,
    },
    #[error("{path}: invalid JSON: {source}")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("{path}: {reason}")]
    UnsupportedJson { path: PathBuf, reason: String },
    #[error(transparent)]
    Spm(#[from] SpmError),
}

impl TokenizerError {
    /// A stable, short name of the variant, for metric labels and API errors.
    pub fn label(&self) -> &'static str {
        match self {
            TokenizerError::Gguf(e) => e.label(),
            TokenizerError::UnsupportedModel { .. } => "unsupported_tokenizer_model",
            TokenizerError::UnsupportedPreTokenizer { .. } => "unsupported_pre_tokenizer",
            TokenizerError::LengthMismatch { .. } => "length_mismatch",
            TokenizerError::BadMerge { .. } => "bad_merge",
            TokenizerError::TokenIdOutOfRange { .. } => "token_id_out_of_range",
            TokenizerError::Build { .. } => "tokenizer_build",
            TokenizerError::Encode { .. } => "encode",
            TokenizerError::Io { .. } => "io",
            TokenizerError::Load { .. } => "tokenizer_load",
            TokenizerError::Json { .. } => "json",
            TokenizerError::UnsupportedJson { .. } => "unsupported_tokenizer_json",
            TokenizerError::Spm(e) => e.label(),
        }
    }
}

/// Text -> IDs for one kind of vocabulary.
// One per loaded model: the variants' size difference costs nothing.
#[allow(clippy::large_enum_variant)]
enum Encoder {
    Bpe {
        /// Matches special tokens in the input.
        with_special: tokenizers::Tokenizer,
        /// Treats special tokens' text as plain text.
        plain: tokenizers::Tokenizer,
    },
    Spm(SpmVocab),
}

/// What every vocabulary kind gives the [`Tokenizer`], whichever file it came from:
/// per-ID spelling, bytes and special flag, and the BOS/EOS settings.
struct Vocabulary {
    /// Vocabulary spelling per ID ("" for IDs with no token).
    tokens: Vec<String>,
    /// Bytes each ID decodes to.
    pieces: Vec<Vec<u8>>,
    special: Vec<bool>,
    bos: Option<u32>,
    eos: Option<u32>,
    add_bos: bool,
}

/// A byte-level BPE or SentencePiece tokenizer. Cheap to share behind an
/// `Arc`; all methods take `&self`.
pub struct Tokenizer {
    encoder: Encoder,
    vocab: Vocabulary,
    pre: String,
    /// Tokens that end a generation (sorted): EOS, and for SentencePiece
    /// vocabularies also llama.cpp's other end-of-generation tokens.
    eog: Vec<u32>,
    /// SentencePiece with `add_space_prefix`: decoding drops the space the
    /// encoder put in front (llama.cpp's detokenize does).
    strip_first_space: bool,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab.tokens.len())
            .field("pre", &self.pre)
            .field("bos", &self.vocab.bos)
            .field("eos", &self.vocab.eos)
            .field("add_bos", &self.vocab.add_bos)
            .field("model", &self.model())
            .finish()
    }
}

/// GPT-2's byte -> char table (printable bytes map to themselves, the others
/// to U+0100 and up), as a char -> byte lookup for decoding.
fn char_to_byte(c: char) -> Option<u8> {
    let u = c as u32;
    let direct = |b: u32| {
        (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b)
    };
    if u < 0x100 {
        return if direct(u) { Some(u as u8) } else { None };
    }
    // The n-th byte (in order) that is not direct maps to U+0100 + n.
    let n = u - 0x100;
    (0u32..=255)
        .filter(|&b| !direct(b))
        .nth(n as usize)
        .map(|b| b as u8)
}

fn byte_table() -> [Option<u8>; 324] {
    // U+0000..U+0143 covers every char of the byte-level alphabet.
    let mut t = [None; 324];
    for (i, slot) in t.iter_mut().enumerate() {
        *slot = char::from_u32(i as u32).and_then(char_to_byte);
    }
    t
}

/// Bytes of a normal token's byte-level spelling; a token with a char outside
/// the alphabet is taken as raw UTF-8 (what HF's ByteLevel decoder does).
fn byte_level_bytes(table: &[Option<u8>; 324], token: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(token.len());
    for c in token.chars() {
        match table.get(c as usize).copied().flatten() {
            Some(b) => out.push(b),
            None => return token.as_bytes().to_vec(),
        }
    }
    out
}

/// The pre-tokenizer llama.cpp uses for `tokenizer.ggml.pre` = `pre`.
fn pre_tokenizer_for(pre: &str) -> Result<PreTokenizerWrapper, TokenizerError> {
    let byte_level =
        |use_regex| PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, use_regex));
    let split = |re: &str| -> Result<PreTokenizerWrapper, TokenizerError> {
        Split::new(
            SplitPattern::Regex(re.to_string()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map(PreTokenizerWrapper::Split)
        .map_err(|source| TokenizerError::Build { source })
    };
    Ok(match pre {
        // llama.cpp: {"\p{N}", GPT-2 regex}. Digits(true) isolates each char
        // with `char::is_numeric`, i.e. \p{N} (Nd, Nl, No).
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva-7b" => {
            PreTokenizerWrapper::Sequence(Sequence::new(vec![
                PreTokenizerWrapper::Digits(Digits::new(true)),
                byte_level(true),
            ]))
        }
        // llama.cpp: {GPT-2 regex}.
        "gpt2" | "gpt-2" | "phi-2" | "mpt" | "olmo" | "jais" | "roberta-bpe" => byte_level(true),
        // llama.cpp LLAMA_VOCAB_PRE_TYPE_DEFAULT for BPE vocabularies.
        "default" => PreTokenizerWrapper::Sequence(Sequence::new(vec![
            split(r"[\p{P}\$\+<=>\^~\|]+")?,
            split(GPT2_REGEX)?,
            split(r"\p{N}+")?,
            split(r"[0-9][0-9][0-9]")?,
            byte_level(false),
        ])),
        other => {
            return Err(TokenizerError::UnsupportedPreTokenizer {
                pre: other.to_string(),
            })
        }
    })
}

/// The token ID stored under `key` (BOS, EOS, ...), checked against the vocabulary's
/// `vocab_size`; when the key is absent, `default` if it is inside the vocabulary (as
/// llama.cpp drops a default outside it). Both vocabulary kinds read their IDs here.
pub(crate) fn special_token_id(
    f: &GgufFile,
    key: &'static str,
    vocab_size: usize,
    default: Option<u32>,
) -> Result<Option<u32>, TokenizerError> {
    if f.get(key).is_none() {
        return Ok(default.filter(|&d| (d as usize) < vocab_size));
    }
    let id = f.get_u32(key)?;
    if id as usize >= vocab_size {
        return Err(TokenizerError::TokenIdOutOfRange { what: key, id, vocab_size });
    }
    Ok(Some(id))
}

impl Tokenizer {
    /// Builds the tokenizer from `tokenizer.ggml.*` metadata.
    pub fn from_gguf(f: &GgufFile) -> Result<Self, TokenizerError> {
        let model = f.get_str("tokenizer.ggml.model")?;
        if model == "llama" {
            return Ok(Self::from_spm(spm_tokenizer::from_gguf(f)?));
        }
        if model != "gpt2" {
            return Err(TokenizerError::UnsupportedModel {
                model: model.to_string(),
            });
        }
        // llama.cpp treats a missing pre type as "default" (with a warning).
        let pre = match f.get("tokenizer.ggml.pre") {
            Some(_) => f.get_str("tokenizer.ggml.pre")?,
            None => "default",
        };
        let pre_tok = pre_tokenizer_for(pre)?;
        let tokens = f.get_str_array("tokenizer.ggml.tokens")?;
        let n = tokens.len();
        let types = match f.get("tokenizer.ggml.token_type") {
            Some(_) => f.get_i32_array("tokenizer.ggml.token_type")?,
            None => vec![1; n],
        };
        if types.len() != n {
            return Err(TokenizerError::LengthMismatch {
                what: "tokenizer.ggml.token_type",
                expected: n,
                found: types.len(),
            });
        }
        let merges = f
            .get_str_array("tokenizer.ggml.merges")?
            .into_iter()
            .enumerate()
            .map(|(index, m)| match m.split_once(' ') {
                Some((a, b)) if !a.is_empty() && !b.is_empty() => {
                    Ok((a.to_string(), b.to_string()))
                }
                _ => Err(TokenizerError::BadMerge {
                    index,
                    merge: m.to_string(),
                }),
            })
            .collect::<Result<Vec<_>, _>>()?;
        let bos = special_token_id(f, "tokenizer.ggml.bos_token_id", n, None)?;
        let eos = special_token_id(f, "tokenizer.ggml.eos_token_id", n, None)?;
        let add_bos = match f.get("tokenizer.ggml.add_bos_token") {
            Some(_) => f.get_bool("tokenizer.ggml.add_bos_token")?,
            None => false,
        };

        let vocab: Vocab = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.to_string(), i as u32))
            .collect();
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(|source| TokenizerError::Build { source })?;
        let mut inner = tokenizers::Tokenizer::new(bpe);
        inner.with_pre_tokenizer(Some(pre_tok));
        inner.with_decoder(Some(DecoderWrapper::ByteLevel(ByteLevel::default())));
        inner.with_post_processor(Some(PostProcessorWrapper::ByteLevel(ByteLevel::new(
            false, false, true,
        ))));
        let is_special = |t: i32| t == TYPE_CONTROL || t == TYPE_UNKNOWN;
        let specials: Vec<AddedToken> = (0..n)
            .filter(|&i| is_special(types[i]) && !tokens[i].is_empty())
            .map(|i| AddedToken::from(tokens[i], true))
            .collect();
        let user: Vec<AddedToken> = (0..n)
            .filter(|&i| types[i] == TYPE_USER_DEFINED && !tokens[i].is_empty())
            .map(|i| AddedToken::from(tokens[i], false).normalized(false))
            .collect();
        inner
            .add_special_tokens(specials)
            .map_err(|source| TokenizerError::Build { source })?;
        inner
            .add_tokens(user)
            .map_err(|source| TokenizerError::Build { source })?;

        let table = byte_table();
        let pieces = (0..n)
            .map(|i| match types[i] {
                // llama.cpp emits the text of these as is, not byte-level decoded.
                t if is_special(t) || t == TYPE_USER_DEFINED => tokens[i].as_bytes().to_vec(),
                _ => byte_level_bytes(&table, tokens[i]),
            })
            .collect();
        let special = types.iter().map(|&t| is_special(t)).collect();
        let tokens = tokens.into_iter().map(str::to_string).collect();
        let vocab = Vocabulary { tokens, pieces, special, bos, eos, add_bos };
        Ok(Self::assemble(inner, vocab, pre.to_string()))
    }

    fn assemble(inner: tokenizers::Tokenizer, vocab: Vocabulary, pre: String) -> Self {
        let mut plain = inner.clone();
        plain.set_encode_special_tokens(true);
        let mut with_special = inner;
        with_special.set_encode_special_tokens(false);
        Tokenizer {
            encoder: Encoder::Bpe {
                with_special,
                plain,
            },
            eog: vocab.eos.into_iter().collect(),
            vocab,
            pre,
            strip_first_space: false,
        }
    }

    fn from_spm(p: spm_tokenizer::SpmParts) -> Self {
        Tokenizer {
            strip_first_space: p.vocab.add_space_prefix(),
            encoder: Encoder::Spm(p.vocab),
            vocab: Vocabulary {
                tokens: p.tokens,
                pieces: p.pieces,
                special: p.special,
                bos: p.bos,
                eos: p.eos,
                add_bos: p.add_bos,
            },
            eog: p.eog,
            // llama.cpp ignores `tokenizer.ggml.pre` for SentencePiece.
            pre: "spm".into(),
        }
    }

    /// Loads a Hugging Face `tokenizer.json` (a file, or a folder holding
    /// one). BOS/EOS and `add_bos_token` come from a `tokenizer_config.json`
    /// next to it when there is one.
    pub fn from_tokenizer_json(path: &Path) -> Result<Self, TokenizerError> {
        let file = if path.is_dir() {
            path.join("tokenizer.json")
        } else {
            path.to_path_buf()
        };
        let inner =
            tokenizers::Tokenizer::from_file(&file).map_err(|source| TokenizerError::Load {
                path: file.clone(),
                source,
            })?;
        if !matches!(inner.get_model(), ModelWrapper::BPE(_)) {
            return Err(TokenizerError::UnsupportedJson {
                path: file,
                reason: "only BPE models are supported".into(),
            });
        }
        let vocab = inner.get_vocab(true);
        let n = vocab.values().map(|&id| id as usize + 1).max().unwrap_or(0);
        // IDs index dense tables; a sparse, huge ID would allocate for every gap.
        if n > 2 * vocab.len() + 1024 {
            return Err(TokenizerError::UnsupportedJson {
                path: file,
                reason: format!(
                    "token IDs are sparse: {} tokens, highest ID {}",
                    vocab.len(),
                    n - 1
                ),
            });
        }
        let mut tokens = vec![String::new(); n];
        for (t, &id) in &vocab {
            tokens[id as usize] = t.clone();
        }
        let added = inner.get_added_tokens_decoder();
        let table = byte_table();
        let mut special = vec![false; n];
        let mut pieces = Vec::with_capacity(n);
        for (i, t) in tokens.iter().enumerate() {
            match added.get(&(i as u32)) {
                Some(a) => {
                    special[i] = a.special;
                    pieces.push(a.content.as_bytes().to_vec());
                }
                None => pieces.push(byte_level_bytes(&table, t)),
            }
        }

        let config_path = file.with_file_name("tokenizer_config.json");
        let (mut bos, mut eos, mut add_bos) = (None, None, false);
        if config_path.is_file() {
            let text =
                std::fs::read_to_string(&config_path).map_err(|source| TokenizerError::Io {
                    path: config_path.clone(),
                    source,
                })?;
            let cfg: serde_json::Value =
                serde_json::from_str(&text).map_err(|source| TokenizerError::Json {
                    path: config_path.clone(),
                    source,
                })?;
            let token_of = |key: &str| {
                let v = cfg.get(key)?;
                let s = v
                    .as_str()
                    .or_else(|| v.get("content").and_then(|c| c.as_str()))?;
                inner.token_to_id(s)
            };
            bos = token_of("bos_token");
            eos = token_of("eos_token");
            add_bos = cfg
                .get("add_bos_token")
                .and_then(|v| v.as_bool())
                .unwrap_or(false);
        }
        let vocab = Vocabulary { tokens, pieces, special, bos, eos, add_bos };
        Ok(Self::assemble(inner, vocab, "tokenizer.json".into()))
    }

    /// The tokenizer as a Hugging Face `tokenizer.json` document.
    pub fn to_tokenizer_json(&self) -> Result<String, TokenizerError> {
        match &self.encoder {
            Encoder::Bpe { with_special, .. } => with_special
                .to_string(true)
                .map_err(|source| TokenizerError::Build { source }),
            Encoder::Spm(_) => Err(SpmError::NoTokenizerJson.into()),
        }
    }

    /// Token IDs of `text`. With `parse_special`, the text of a special token
    /// (e.g. `<|im_start|>`) becomes its ID; without, it is tokenized as text.
    /// Never adds BOS/EOS.
    pub fn encode(&self, text: &str, parse_special: bool) -> Result<Vec<u32>, TokenizerError> {
        let tok = match &self.encoder {
            Encoder::Spm(v) => return Ok(v.encode(text, parse_special)?),
            Encoder::Bpe { with_special, .. } if parse_special => with_special,
            Encoder::Bpe { plain, .. } => plain,
        };
        let enc = tok
            .encode_fast(text, false)
            .map_err(|source| TokenizerError::Encode { source })?;
        Ok(enc.get_ids().to_vec())
    }

    /// Token IDs of a raw prompt (no chat template): `text` with special-token
    /// text parsed, behind BOS when the model asks for it ([`Tokenizer::add_bos`]:
    /// `tokenizer.ggml.add_bos_token`, or llama.cpp's default when absent, true for
    /// SentencePiece and false for BPE). `baton generate --prompt` and
    /// `/v1/completions` both call this, so one prompt text is the same IDs everywhere.
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let mut ids = Vec::with_capacity(text.len() / 3 + 2);
        if let (true, Some(bos)) = (self.vocab.add_bos, self.vocab.bos) {
            ids.push(bos);
        }
        ids.extend(self.encode(text, true)?);
        Ok(ids)
    }

    /// Text of `ids`, skipping special tokens; invalid UTF-8 becomes U+FFFD.
    /// Unknown IDs are skipped.
    pub fn decode(&self, ids: &[u32]) -> String {
        self.decode_with_special(ids, false)
    }

    /// Text of `ids`; special tokens are rendered as their text (e.g.
    /// `<|im_end|>`) when `with_special`, skipped otherwise.
    pub fn decode_with_special(&self, ids: &[u32], with_special: bool) -> String {
        let mut bytes = Vec::new();
        for (i, &id) in ids.iter().enumerate() {
            if let Some(p) = self.piece(id, with_special) {
                bytes.extend_from_slice(self.strip_leading_space(p, i == 0));
            }
        }
        match String::from_utf8(bytes) {
            Ok(s) => s,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        }
    }

    /// The first token's piece without the space the SPM encoder prefixed.
    fn strip_leading_space<'a>(&self, piece: &'a [u8], first: bool) -> &'a [u8] {
        match piece {
            [b' ', rest @ ..] if first && self.strip_first_space => rest,
            p => p,
        }
    }

    fn piece(&self, id: u32, with_special: bool) -> Option<&[u8]> {
        let i = id as usize;
        if !with_special && self.vocab.special.get(i).copied().unwrap_or(false) {
            return None;
        }
        self.vocab.pieces.get(i).map(Vec::as_slice)
    }

    /// The bytes `id` decodes to (a special token's text), `None` if out of range.
    pub fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
        self.token_piece(id).map(<[u8]>::to_vec)
    }

    /// Borrowed form of [`Self::token_bytes`].
    pub fn token_piece(&self, id: u32) -> Option<&[u8]> {
        self.vocab.pieces.get(id as usize).map(Vec::as_slice)
    }

    /// The vocabulary's spelling of `id` (byte-level, e.g. `"Ġthe"`, or a
    /// special token's text), `None` if out of range.
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.vocab.tokens.get(id as usize).map(String::as_str)
    }

    /// The ID whose vocabulary spelling is `token` (e.g. `"<|im_end|>"`, `"Ġthe"`).
    pub fn token_id(&self, token: &str) -> Option<u32> {
        match &self.encoder {
            Encoder::Bpe { with_special, .. } => with_special.token_to_id(token),
            Encoder::Spm(v) => v.token_id(token),
        }
    }

    /// The vocabulary kind, as `tokenizer.ggml.model` names it: `"gpt2"`
    /// (byte-level BPE) or `"llama"` (SentencePiece).
    pub fn model(&self) -> &'static str {
        match self.encoder {
            Encoder::Bpe { .. } => "gpt2",
            Encoder::Spm(_) => "llama",
        }
    }

    /// Number of token IDs (including special tokens).
    pub fn vocab_size(&self) -> usize {
        self.vocab.tokens.len()
    }

    /// Beginning-of-sequence token, if the model has one.
    pub fn bos_id(&self) -> Option<u32> {
        self.vocab.bos
    }

    /// End-of-sequence token, if the model has one.
    pub fn eos_id(&self) -> Option<u32> {
        self.vocab.eos
    }

    /// Whether generating `id` ends the reply: EOS, or (SentencePiece) any
    /// of llama.cpp's end-of-generation tokens, e.g. Gemma's `<end_of_turn>`.
    pub fn is_end_of_generation(&self, id: u32) -> bool {
        self.eog.binary_search(&id).is_ok()
    }

    /// Whether prompts should start with BOS (`tokenizer.ggml.add_bos_token`).
    pub fn add_bos(&self) -> bool {
        self.vocab.add_bos
    }

    /// Whether `id` is a special (control) token, skipped in chat output.
    pub fn is_special(&self, id: u32) -> bool {
        self.vocab.special.get(id as usize).copied().unwrap_or(false)
    }

    /// The pre-tokenizer name this tokenizer was built for (`"spm"` for a
    /// SentencePiece vocabulary, which has none).
    pub fn pre_tokenizer(&self) -> &str {
        &self.pre
    }
}

/// Streaming decoder: turns IDs into text as they are generated, emitting
/// only complete UTF-8 and holding back a multi-byte character (an emoji, a
/// CJK character) whose bytes are split across tokens.
///
/// The concatenation of every `push` and `finish` equals
/// `decode_with_special(ids, with_special)` of all IDs pushed.
pub struct IncrementalDecoder {
    tokenizer: Arc<Tokenizer>,
    with_special: bool,
    pending: Vec<u8>,
    /// No token pushed yet (the first one may lose its leading space).
    first: bool,
}

impl std::fmt::Debug for IncrementalDecoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IncrementalDecoder")
            .field("pending", &self.pending.len())
            .finish()
    }
}

impl IncrementalDecoder {
    /// A decoder that skips special tokens (chat output).
    pub fn new(tokenizer: Arc<Tokenizer>) -> Self {
        Self::with_special(tokenizer, false)
    }

    /// A decoder that renders special tokens as their text when `with_special`.
    pub fn with_special(tokenizer: Arc<Tokenizer>, with_special: bool) -> Self {
        IncrementalDecoder {
            tokenizer,
            with_special,
            pending: Vec::new(),
            first: true,
        }
    }

    /// Adds one token; returns the text that became complete (maybe empty).
    pub fn push(&mut self, id: u32) -> String {
        if let Some(p) = self.tokenizer.piece(id, self.with_special) {
            let p = self.tokenizer.strip_leading_space(p, self.first);
            self.pending.extend_from_slice(p);
        }
        self.first = false;
        self.drain(false)
    }

    /// Flushes held-back bytes (an incomplete character becomes U+FFFD).
    pub fn finish(&mut self) -> String {
        self.drain(true)
    }

    /// Bytes held back, waiting for the rest of a character.
    pub fn pending_bytes(&self) -> usize {
        self.pending.len()
    }

    fn drain(&mut self, flush: bool) -> String {
        let mut out = String::new();
        let mut start = 0;
        loop {
            let rest = &self.pending[start..];
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    out.push_str(s);
                    start = self.pending.len();
                    break;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // The prefix was just validated, so this is never lossy.
                    out.push_str(&String::from_utf8_lossy(&rest[..valid]));
                    match e.error_len() {
                        // Invalid bytes: replace exactly as from_utf8_lossy does.
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            start += valid + bad;
                        }
                        // An incomplete character at the end: wait for more bytes.
                        None => {
                            start += valid;
                            if flush {
                                out.push_str(&Cow::into_owned(String::from_utf8_lossy(
                                    &self.pending[start..],
                                )));
                                start = self.pending.len();
                            }
                            break;
                        }
                    }
                }
            }
        }
        self.pending.drain(..start);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_table_is_gpt2s() {
        let t = byte_table();
        assert_eq!(t['Ġ' as usize], Some(b' '));
        assert_eq!(t['Ċ' as usize], Some(b'\n'));
        assert_eq!(t['!' as usize], Some(b'!'));
        assert_eq!(t['Ā' as usize], Some(0));
        assert_eq!(t[' ' as usize], None);
        let mut seen: Vec<u8> = t.iter().flatten().copied().collect();
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(seen.len(), 256);
    }

    /// A SentencePiece vocabulary of BOS, EOS and the byte tokens, with `add_bos_token` as given.
    fn spm_with_add_bos(add_bos: Option<bool>) -> Tokenizer {
        use crate::gguf::writer::{byte_spm_vocab, write_gguf};
        use crate::gguf::MetaValue;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("spm.gguf");
        let mut meta = byte_spm_vocab();
        if let Some(b) = add_bos {
            meta.push(("tokenizer.ggml.add_bos_token", MetaValue::Bool(b)));
        }
        write_gguf(&path, &meta, &[]).unwrap();
        Tokenizer::from_gguf(&GgufFile::open(&path).unwrap()).unwrap()
    }

    /// llama.cpp's rule: BOS when the file says so, and for SentencePiece when it is silent.
    #[test]
    fn raw_prompts_start_with_bos_as_llama_cpp_decides() {
        for (flag, want_bos) in [(None, true), (Some(true), true), (Some(false), false)] {
            let t = spm_with_add_bos(flag);
            let ids = t.encode_prompt("hi").unwrap();
            let plain = t.encode("hi", true).unwrap();
            if want_bos {
                assert_eq!(ids[0], 1, "{flag:?}");
                assert_eq!(&ids[1..], plain.as_slice(), "{flag:?}");
            } else {
                assert_eq!(ids, plain, "{flag:?}");
            }
        }
    }

    #[test]
    fn unknown_pre_tokenizer_is_an_error() {
        assert!(matches!(
            pre_tokenizer_for("llama-bpe"),
            Err(TokenizerError::UnsupportedPreTokenizer { .. })
        ));
        for p in ["smollm", "gpt2", "gpt-2", "default"] {
            assert!(pre_tokenizer_for(p).is_ok(), "{p}");
        }
    }
}
