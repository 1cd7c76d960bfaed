//! What the test modules share. No test module imports another: a helper that two of them
//! need lives here, once, in the file of its concept.
//!
//! - [`process`]: running the `infer` binary, its output and manifest, pids, signals, waits.
//! - [`server`]: `infer up` as a running [`server::Server`], its metrics, and the references
//!   serving is compared with.
//! - [`model`]: facts of the real model and the prompts several tests ask of it.
//! - [`synthetic`]: small synthetic models in real formats (Hugging Face, GGUF).
//! - [`runtime`]: the host kernel harness and collective groups of threads, in this process.
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
pub mod runtime;
pub mod server;
pub mod synthetic;
