//! The Baton model engine: weights loading, the paged KV block pool and owner-scoped
//! prefix cache, and the batch scheduler. Kernels live in `baton-kernels`; the GGUF
//! reader, tokenizer, chat template and sampling live in `baton-text`; this crate
//! decides what to run.

pub mod engine;
pub mod error;
pub mod kv;
pub mod model;

pub use error::{Error, Result};
pub use engine::{
    DeviceBlockHolder, DeviceBlocks, Engine, EngineConfig, EngineError, EngineInfo, EngineStats, Event, ImportBlocks, ImportUse, ImportedToken, KvExport, KvImport, PreemptionMode, Request,
    StepCost,
    RequestStream, SubmitOptions, Submission, LayerChunk, LayerExport, LayerExportEvent,
};
