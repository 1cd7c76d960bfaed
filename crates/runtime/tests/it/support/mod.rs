//! What the engine core's test modules share, and `infer`'s integration tests too (its
//! `tests/it/support/mod.rs` includes these files by path):
//!
//! - [`runtime`]: the host kernel harness and collective groups of threads, in this process.
//! - [`synthetic`]: small synthetic models in real formats (Hugging Face, GGUF).

pub mod runtime;
#[allow(
    dead_code,
    reason = "shared with infer's tests/it, which write the model files these tests do not"
)]
pub mod synthetic;
