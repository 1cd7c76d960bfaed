//! What the test modules share. No test module imports another: a helper that two of them
//! need lives here, once, in the file of its concept.
//!
//! - [`process`]: running the `infer` binary, its output and manifest, pids, signals, waits.
//! - [`server`]: `infer up` as a running [`server::Server`], its metrics, and the references
//!   serving is compared with.
//! - [`model`]: facts of the real model and the prompts several tests ask of it.
//! - [`synthetic`]: small synthetic models in real formats (Hugging Face, GGUF).
//! - [`runtime`]: the host kernel harness and collective groups of threads, in this process.
//!
//! The last two live beside the engine core's own tests (`crates/runtime/tests/it/support/`),
//! which need them without `infer`; they are included here by path.
//! - [`cluster`]: the SSH test cluster of network namespaces.
//! - [`cache`]: tools built or downloaded once into the test cache.
//! - [`llamacpp`]: llama.cpp built once, and `infer up --engine llamacpp` running on it.
//! - [`fixtures`]: the shared fixtures and fake sysfs trees.

pub mod cache;
pub mod cluster;
pub mod fixtures;
pub mod llamacpp;
pub mod model;
pub mod process;
#[path = "../../../crates/runtime/tests/it/support/runtime.rs"]
#[allow(
    dead_code,
    reason = "shared with the engine core's tests, which use the transports these do not"
)]
pub mod runtime;
pub mod server;
#[path = "../../../crates/runtime/tests/it/support/synthetic.rs"]
pub mod synthetic;
