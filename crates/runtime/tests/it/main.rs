//! The engine core's integration tests: one binary, one module per area, reaching the runtime
//! only through `infer_runtime`'s public API, so `cargo test -p infer-runtime` runs them
//! without building `infer`. What several modules need is in [`support`], which `infer`'s own
//! integration tests (`tests/it/`) share.

// A test binary has no API: its helpers are `pub` for the other test modules.
#![allow(unreachable_pub)]

mod backend;
mod collectives;
mod kernels;
mod support;
