//! Running a model: the one-process engine, the executor of batched steps, rank workers, the paged KV cache.

pub(crate) mod bench;
pub mod engine;
pub mod executor;
pub mod forward;
pub(crate) mod gpu_checks;
pub mod handoff;
pub(crate) mod kernel_executor;
pub(crate) mod rank_env;
pub mod worker;
