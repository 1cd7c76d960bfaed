//! Model file formats.

pub mod ggml;
pub mod gguf;
