//! The Baton model engine: weights loading, tokenizer and chat template, the
//! paged KV block pool and owner-scoped prefix cache, the batch scheduler and
//! sampling. Kernels live in `baton-kernels`; this crate decides what to run.

pub mod chat_template;
pub mod engine;
pub mod gguf;
pub mod kv;
pub mod model;
pub mod sampling;
pub mod spm_tokenizer;
pub mod tokenizer;

pub use engine::{
    Engine, EngineConfig, EngineError, EngineInfo, EngineStats, Event, FinishReason, ImportedToken, KvExport, KvImport, PreemptionMode, Request,
    RequestStream, SubmitOptions, Submission, TokenOut, Usage,
};
