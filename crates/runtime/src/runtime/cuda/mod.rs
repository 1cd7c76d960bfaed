//! The CUDA backend's pieces that are built and checked without a GPU: finding NVIDIA's
//! libraries ([`crate::runtime::libraries`]), the kernel sources and their launch descriptions
//! ([`kernels`]), compiling them with NVRTC to CUBIN ([`nvrtc`]) and cuBLAS ([`cublas`]).
//!
//! cudarc is compiled in with `dynamic-loading` for the driver API only: nothing links
//! against CUDA, and every library is opened at run time, after [`crate::runtime::libraries`] has found it.
//! NVRTC and cuBLAS are bound by our own code (CUDA 13 and 12 sonames; cudarc's loader
//! knows only CUDA 12's and panics on a missing library); cudarc's `nvrtc` feature is on
//! only for its `Ptx` type, which carries a CUBIN to `load_module`.

pub mod backend;
pub mod checks;
pub mod cublas;
pub mod device;
pub mod gpu;
pub mod host;
pub mod kernels;
pub mod nvrtc;

/// The architectures the tests compile every kernel for, with NVRTC 12.9 and 13.0 (A100,
/// A10/A40/RTX 30, L4/L40S/RTX 40, H100/H200, B200/GB200, RTX 50/RTX PRO 6000 Blackwell).
pub const TESTED_ARCHS: &[u32] = &[80, 86, 89, 90, 100, 120];
