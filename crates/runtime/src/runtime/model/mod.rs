//! The Llama-family model: layers and MoE blocks, weights, tokenizer, chat template, sampling.

pub mod chat;
pub mod config;
pub mod dummy;
pub mod export;
pub mod kv;
pub mod llama;
pub mod moe;
pub mod safetensors;
pub mod sampling;
pub mod source;
pub mod tokenizer;
pub mod weights;
