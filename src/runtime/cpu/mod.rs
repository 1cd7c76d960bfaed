//! The CPU backend: quantized dot products, packed rows, f16 attention, math functions,
//! the thread team.

pub mod attention;
pub mod mathfn;
pub mod packed;
pub mod quant;
pub mod simd;
pub mod team;
