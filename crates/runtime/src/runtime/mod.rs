//! The engine core that rank processes run, by part:
//!
//! - [`formats`]: model files (GGUF, safetensors);
//! - [`model`]: the Llama family (dense and MoE), its weights, tokenizer, chat template and
//!   sampling;
//! - [`backend`]: the op set a forward pass runs on (the `Backend` trait) and its CPU
//!   implementation;
//! - [`cpu`]: the quantized CPU kernels and their thread team;
//! - [`cuda`]: the CUDA backend (its kernels over a GPU or the host harness), NVRTC, the
//!   driver probe;
//! - [`collectives`]: all-reduce and friends over TCP and shared memory;
//! - [`exec`]: running a model: the one-process engine, the executor of steps, rank
//!   workers, the paged KV cache, the forward pass over any backend.
//!
//! It knows nothing of clap, TOML or SSH: it receives a model path, its settings and its
//! rank, shard and peers.

pub mod backend;
pub mod collectives;
pub mod cpu;
pub mod cuda;
pub mod exec;
pub mod formats;
pub mod libraries;
pub mod model;
