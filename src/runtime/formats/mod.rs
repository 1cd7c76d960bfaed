//! Model file formats.

pub mod gguf;
pub mod safetensors;
