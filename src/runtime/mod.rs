//! The engine core that rank processes run: model formats, quantized CPU kernels, the
//! Llama-family forward pass, tokenizer, chat template and sampling.
//!
//! It knows nothing of clap, TOML or SSH: it receives a model path, its settings and (later)
//! its rank, shard and peers.

pub mod chat;
pub mod comm;
pub mod cuda;
pub mod engine;
pub mod executor;
pub mod gguf;
pub mod kv;
pub mod llama;
pub mod mathfn;
pub mod moe;
pub mod packed;
pub mod quant;
pub mod safetensors;
pub mod sampling;
pub mod shm;
pub mod team;
pub mod tokenizer;
pub mod weights;
pub mod worker;
