//! `infer-runtime`: the engine core that `infer`'s rank processes run, and the pieces every
//! layer of `infer` shares: the rendezvous of a run's processes and the keys and handshake
//! that seal it, the parallel degrees, the names of the environment variables.
//!
//! It depends on nothing of `infer` (Cargo enforces the bottom of the layer list in
//! ARCHITECTURE.md) and knows nothing of clap, TOML, SSH or HTTP. `infer` re-exports each
//! module at its own root, so `infer::runtime::…` and `crate::runtime::…` name the same items.

pub mod degrees;
pub mod envvars;
pub mod handshake;
pub mod keyring;
pub mod rendezvous;
pub mod runtime;
