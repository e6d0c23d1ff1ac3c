//! Baton's text layer: everything about text and model files that is not compute.
//!
//! - [`gguf`]: the hardened GGUF reader (full, or header and shapes only) and a writer
//!   for fixtures;
//! - [`tokenizer`] and [`chat_template`]: text to token IDs and back, messages to a prompt;
//! - [`sampling`]: request sampling parameters and their validation, the seeded sampler
//!   over a logits slice, and the stop-string matcher;
//! - [`Error`]: the crate's one error type (each module's own enum is a variant's
//!   payload), with a `kind()` that protocols map to their status codes;
//! - [`output`]: what a finished or streaming generation reports (finish reason, usage,
//!   one token), shared by the engine, the nodes and the gateway.
//!
//! It depends on neither `baton-kernels` nor `baton-engine`, so the gateway and the
//! capacity planner use it without compiling the compute stack.

pub mod chat_template;
pub mod error;
pub mod gguf;
pub mod model_cache;
pub mod output;
pub mod rng;
pub mod sampling;
pub mod spm_tokenizer;
pub mod tokenizer;

pub use error::{Error, Result};
pub use output::{FinishReason, TokenOut, Usage};
