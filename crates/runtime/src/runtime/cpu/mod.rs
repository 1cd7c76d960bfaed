//! The CPU backend: quantized dot products, packed rows, f16 attention, math functions,
//! the thread team.

pub(crate) mod attention;
pub(crate) mod mathfn;
pub(crate) mod packed;
pub mod quant;
pub(crate) mod simd;
pub(crate) mod team;
