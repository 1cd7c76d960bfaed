//! The CUDA kernels: CUDA C sources in `kernels/` (header-free, one file per op family, each
//! compiled after the shared helpers of `kernels/common.cuh`),
//! embedded in the binary, and the launch description of every kernel — its parameters in
//! order and the block size its code assumes — which the tests check against what NVRTC
//! compiled (the PTX `.entry` parameter lists).

/// One kernel parameter as the launch passes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Param {
    /// A device pointer (PTX `.u64`).
    Ptr,
    /// `unsigned int` or `int` (PTX `.u32`).
    U32,
    /// `float` (PTX `.f32`).
    F32,
}

impl Param {
    /// The PTX type NVRTC gives a parameter of this kind.
    pub fn ptx_type(self) -> &'static str {
        match self {
            Param::Ptr => "u64",
            Param::U32 => "u32",
            Param::F32 => "f32",
        }
    }
}

/// How one kernel is launched.
#[derive(Clone, Copy, Debug)]
pub struct Kernel {
    /// The `extern "C" __global__` name.
    pub name: &'static str,
    pub params: &'static [Param],
    /// Threads per block the kernel is written for.
    pub block_threads: u32,
}

/// One source file and its kernels.
#[derive(Clone, Copy, Debug)]
pub struct Family {
    /// The file name under `src/runtime/cuda/kernels/`.
    pub file: &'static str,
    pub source: &'static str,
    pub kernels: &'static [Kernel],
}

impl Family {
    /// What is compiled: [`COMMON`] followed by the family's own source.
    pub fn full_source(&self) -> String {
        format!("{COMMON}\n{}", self.source)
    }
}

/// The device helpers every family shares (`kernels/common.cuh`: f16 bits to float,
/// unaligned loads), prepended to each family's source.
pub(crate) const COMMON: &str = include_str!("kernels/common.cuh");

use Param::{F32, Ptr, U32};

/// The parameters of every `mul_mat_vec_*` kernel: `(y, w, n_rows)` for up to three
/// matrices, then the activations, `n_cols`, `n_tokens` and the mode (`kernels/matvec.cu`).
const MUL_MAT_VEC: &[Param] = &[
    Ptr, Ptr, U32, Ptr, Ptr, U32, Ptr, Ptr, U32, Ptr, U32, U32, U32,
];

/// Every kernel family.
pub const FAMILIES: &[Family] = &[
    Family {
        file: "norm.cu",
        source: include_str!("kernels/norm.cu"),
        kernels: &[
            Kernel {
                name: "rms_norm_f32",
                params: &[Ptr, Ptr, Ptr, U32, F32],
                block_threads: 256,
            },
            Kernel {
                name: "rms_norm_q8_1_f32",
                params: &[Ptr, Ptr, Ptr, Ptr, U32, F32],
                block_threads: 256,
            },
        ],
    },
    Family {
        file: "activation.cu",
        source: include_str!("kernels/activation.cu"),
        kernels: &[
            Kernel {
                name: "swiglu_f32",
                params: &[Ptr, Ptr, Ptr, U32],
                block_threads: 256,
            },
            Kernel {
                name: "add_f32",
                params: &[Ptr, Ptr, U32],
                block_threads: 256,
            },
            Kernel {
                name: "add_bias_f32",
                params: &[Ptr, Ptr, U32, U32],
                block_threads: 256,
            },
            Kernel {
                name: "scale_add_rows_f32",
                params: &[Ptr, Ptr, Ptr, Ptr, U32],
                block_threads: 256,
            },
        ],
    },
    Family {
        file: "rope.cu",
        source: include_str!("kernels/rope.cu"),
        kernels: &[
            Kernel {
                name: "rope_interleaved_f32",
                params: &[Ptr, Ptr, Ptr, U32, U32, U32],
                block_threads: 256,
            },
            Kernel {
                name: "rope_neox_f32",
                params: &[Ptr, Ptr, Ptr, U32, U32, U32],
                block_threads: 256,
            },
        ],
    },
    Family {
        file: "embedding.cu",
        source: include_str!("kernels/embedding.cu"),
        kernels: &[
            Kernel {
                name: "get_rows_f32",
                params: &[Ptr, Ptr, Ptr, U32],
                block_threads: 256,
            },
            Kernel {
                name: "get_rows_q8_0",
                params: &[Ptr, Ptr, Ptr, U32, U32],
                block_threads: 256,
            },
        ],
    },
    Family {
        file: "matvec.cu",
        source: include_str!("kernels/matvec.cu"),
        kernels: &[
            Kernel {
                name: "quantize_q8_1",
                params: &[Ptr, Ptr, U32],
                block_threads: 32,
            },
            Kernel {
                name: "mul_mat_vec_q4_0_q8_1",
                params: MUL_MAT_VEC,
                block_threads: 128,
            },
            Kernel {
                name: "mul_mat_vec_q4_0_q8_1_x8",
                params: MUL_MAT_VEC,
                block_threads: 128,
            },
            Kernel {
                name: "mul_mat_vec_q4_1_q8_1",
                params: MUL_MAT_VEC,
                block_threads: 128,
            },
            Kernel {
                name: "mul_mat_vec_q4_1_q8_1_x8",
                params: MUL_MAT_VEC,
                block_threads: 128,
            },
            Kernel {
                name: "mul_mat_vec_q8_0_q8_1",
                params: MUL_MAT_VEC,
                block_threads: 128,
            },
            Kernel {
                name: "mul_mat_vec_q8_0_q8_1_x8",
                params: MUL_MAT_VEC,
                block_threads: 128,
            },
            Kernel {
                name: "mul_mat_vec_q4_k_q8_1",
                params: MUL_MAT_VEC,
                block_threads: 128,
            },
            Kernel {
                name: "mul_mat_vec_q4_k_q8_1_x8",
                params: MUL_MAT_VEC,
                block_threads: 128,
            },
            Kernel {
                name: "mul_mat_vec_q6_k_q8_1",
                params: MUL_MAT_VEC,
                block_threads: 128,
            },
            Kernel {
                name: "mul_mat_vec_q6_k_q8_1_x8",
                params: MUL_MAT_VEC,
                block_threads: 128,
            },
            Kernel {
                name: "mul_mat_vec_f32",
                params: MUL_MAT_VEC,
                block_threads: 128,
            },
            Kernel {
                name: "mul_mat_vec_f32_x8",
                params: MUL_MAT_VEC,
                block_threads: 128,
            },
            Kernel {
                name: "mul_mat_vec_f16",
                params: MUL_MAT_VEC,
                block_threads: 128,
            },
            Kernel {
                name: "mul_mat_vec_f16_x8",
                params: MUL_MAT_VEC,
                block_threads: 128,
            },
            Kernel {
                name: "mul_mat_vec_bf16",
                params: MUL_MAT_VEC,
                block_threads: 128,
            },
            Kernel {
                name: "mul_mat_vec_bf16_x8",
                params: MUL_MAT_VEC,
                block_threads: 128,
            },
        ],
    },
    Family {
        file: "dequantize.cu",
        source: include_str!("kernels/dequantize.cu"),
        kernels: &[
            Kernel {
                name: "dequantize_q4_0_f16",
                params: &[Ptr, Ptr, U32, U32],
                block_threads: 256,
            },
            Kernel {
                name: "dequantize_q4_1_f16",
                params: &[Ptr, Ptr, U32, U32],
                block_threads: 256,
            },
            Kernel {
                name: "dequantize_q8_0_f16",
                params: &[Ptr, Ptr, U32, U32],
                block_threads: 256,
            },
            Kernel {
                name: "dequantize_q4_k_f16",
                params: &[Ptr, Ptr, U32, U32],
                block_threads: 256,
            },
            Kernel {
                name: "dequantize_q6_k_f16",
                params: &[Ptr, Ptr, U32, U32],
                block_threads: 256,
            },
            Kernel {
                name: "convert_f32_f16",
                params: &[Ptr, Ptr, U32],
                block_threads: 256,
            },
            Kernel {
                name: "convert_f32_bf16",
                params: &[Ptr, Ptr, U32],
                block_threads: 256,
            },
        ],
    },
    Family {
        file: "attention.cu",
        source: include_str!("kernels/attention.cu"),
        kernels: &[
            Kernel {
                name: "paged_attention_f16kv",
                params: &[
                    Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, U32, U32, U32, U32, F32, Ptr, U32,
                ],
                block_threads: 256,
            },
            Kernel {
                name: "store_kv_f16",
                params: &[Ptr, Ptr, Ptr, Ptr, Ptr, U32, U32],
                block_threads: 256,
            },
            Kernel {
                name: "rope_store_kv_f16",
                params: &[Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, U32, U32, U32, U32],
                block_threads: 256,
            },
            Kernel {
                name: "read_kv_blocks",
                params: &[Ptr, Ptr, Ptr, U32],
                block_threads: 256,
            },
            Kernel {
                name: "write_kv_blocks",
                params: &[Ptr, Ptr, Ptr, U32],
                block_threads: 256,
            },
        ],
    },
    Family {
        file: "sampling.cu",
        source: include_str!("kernels/sampling.cu"),
        kernels: &[
            Kernel {
                name: "argmax_partial_f32",
                params: &[Ptr, Ptr, U32],
                block_threads: 256,
            },
            Kernel {
                name: "argmax_combine_f32",
                params: &[Ptr, Ptr],
                block_threads: 256,
            },
        ],
    },
];
