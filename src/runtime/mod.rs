//! The engine core that rank processes run, by part:
//!
//! - [`formats`]: model files (GGUF, safetensors);
//! - [`model`]: the Llama family (dense and MoE), its weights, tokenizer, chat template and
//!   sampling;
//! - [`cpu`]: the quantized CPU kernels and their thread team;
//! - [`cuda`]: the CUDA backend's kernels, NVRTC, the driver probe and the host harness;
//! - [`collectives`]: all-reduce and friends over TCP and shared memory;
//! - [`exec`]: running a model: the one-process engine, the executor of steps, rank
//!   workers, the paged KV cache.
//!
//! It knows nothing of clap, TOML or SSH: it receives a model path, its settings and its
//! rank, shard and peers.

pub mod collectives;
pub mod cpu;
pub mod cuda;
pub mod exec;
pub mod formats;
pub mod model;
