//! Running a model: the one-process engine, the executor of batched steps, rank workers, the paged KV cache.

pub mod bench;
pub mod engine;
pub mod executor;
pub mod forward;
pub mod gpu_checks;
pub mod handoff;
pub mod kernel_executor;
pub mod rank_env;
pub mod worker;
