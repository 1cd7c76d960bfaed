//! The CUDA backend's pieces that are built and checked without a GPU: finding NVIDIA's
//! libraries ([`libraries`]), the kernel sources and their launch descriptions
//! ([`kernels`]), and compiling them with NVRTC to CUBIN ([`nvrtc`]).
//!
//! cudarc is compiled in with `dynamic-loading`: nothing links against CUDA, and every
//! library is opened at run time, after [`libraries`] has found it (cudarc panics on a
//! missing library; we report it instead).

pub mod backend;
pub mod checks;
pub mod device;
pub mod executor;
pub mod gpu;
pub mod host;
pub mod kernels;
pub mod libraries;
pub mod nvrtc;
pub mod smoke;

/// The architectures the tests compile every kernel for (A100, A10/A40/RTX 30, L4/L40S/RTX
/// 40, H100/H200).
pub const TESTED_ARCHS: &[u32] = &[80, 86, 89, 90];
