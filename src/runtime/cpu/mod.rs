//! The CPU backend: quantized dot products, packed rows, math functions, the thread team.

pub mod mathfn;
pub mod packed;
pub mod quant;
pub mod simd;
pub mod team;
