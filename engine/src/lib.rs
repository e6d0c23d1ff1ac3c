//! The Baton model engine: weights loading, tokenizer and chat template, the
//! paged KV block pool and owner-scoped prefix cache, the batch scheduler and
//! sampling. Kernels live in `baton-kernels`; this crate decides what to run.

pub mod chat_template;
pub mod gguf;
pub mod kv;
pub mod sampling;
pub mod tokenizer;
