//! The ggml tensor types: one table of every `GGML_TYPE_*` id a GGUF header may name (block
//! sizes from llama.cpp's `ggml-common.h`), and [`GgmlType`], the subset the engine computes
//! with. Below both the file parsers (`gguf`, `safetensors`) and the kernels (`cpu::quant`).

use anyhow::{Result, bail};

/// Elements per block of the 32-element types (`QK4_0`, `QK8_0` in `ggml-common.h`).
pub const QK: usize = 32;
/// Elements per K-quant super-block (`QK_K` in `ggml-common.h`).
pub const QK_K: usize = 256;

/// `(elements per block, bytes per block, name)` of a ggml type, from `ggml-common.h`.
pub fn type_info(type_id: u32) -> Option<(u64, u64, &'static str)> {
    Some(match type_id {
        0 => (1, 4, "F32"),
        1 => (1, 2, "F16"),
        2 => (32, 18, "Q4_0"),
        3 => (32, 20, "Q4_1"),
        6 => (32, 22, "Q5_0"),
        7 => (32, 24, "Q5_1"),
        8 => (32, 34, "Q8_0"),
        9 => (32, 36, "Q8_1"),
        10 => (256, 84, "Q2_K"),
        11 => (256, 110, "Q3_K"),
        12 => (256, 144, "Q4_K"),
        13 => (256, 176, "Q5_K"),
        14 => (256, 210, "Q6_K"),
        15 => (256, 292, "Q8_K"),
        30 => (1, 2, "BF16"),
        _ => return None,
    })
}

/// The ggml tensor types the engine reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgmlType {
    F32,
    F16,
    Bf16,
    Q4_0,
    Q4_1,
    Q8_0,
    Q4K,
    Q5K,
    Q6K,
}

impl GgmlType {
    /// Every type the engine computes with.
    pub const ALL: [GgmlType; 9] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Bf16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q8_0,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
    ];

    /// The type of ggml type id `id`, or an error naming `tensor` and the type.
    pub fn from_id(id: u32, tensor: &str) -> Result<GgmlType> {
        if let Some(ty) = GgmlType::ALL.into_iter().find(|ty| ty.id() == id) {
            return Ok(ty);
        }
        let name = type_info(id).map_or(format!("type id {id}"), |(_, _, n)| n.to_string());
        bail!(
            "tensor `{tensor}` has type {name}, which the engine does not support (F32, F16, BF16, Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K)"
        )
    }

    /// The type's ggml id (`GGML_TYPE_*`), the key of [`type_info`].
    pub fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Bf16 => 30,
            GgmlType::Q4_0 => 2,
            GgmlType::Q4_1 => 3,
            GgmlType::Q8_0 => 8,
            GgmlType::Q4K => 12,
            GgmlType::Q5K => 13,
            GgmlType::Q6K => 14,
        }
    }

    /// `(elements per block, bytes per block)`.
    pub fn block(self) -> (usize, usize) {
        match self {
            GgmlType::F32 => (1, 4),
            GgmlType::F16 | GgmlType::Bf16 => (1, 2),
            GgmlType::Q4_0 => (QK, 18),
            GgmlType::Q4_1 => (QK, 20),
            GgmlType::Q8_0 => (QK, 34),
            GgmlType::Q4K => (QK_K, 144),
            GgmlType::Q5K => (QK_K, 176),
            GgmlType::Q6K => (QK_K, 210),
        }
    }

    /// Checks that `len_bytes` encode an `(n_rows, n_cols)` matrix of this type.
    ///
    /// Errors: `n_cols` not a whole number of blocks, or another length (both named).
    pub fn check_matrix_bytes(self, n_rows: usize, n_cols: usize, len_bytes: usize) -> Result<()> {
        let row_bytes = self.row_bytes(n_cols)?;
        if len_bytes != row_bytes * n_rows {
            bail!(
                "a {self:?} matrix of {n_rows}×{n_cols} needs {} bytes, got {len_bytes}",
                row_bytes * n_rows
            );
        }
        Ok(())
    }

    /// Bytes of a row of `n_cols` elements. Errors: `n_cols` not a whole number of blocks.
    pub fn row_bytes(self, n_cols: usize) -> Result<usize> {
        let (elements, bytes) = self.block();
        if !n_cols.is_multiple_of(elements) {
            bail!(
                "a {self:?} row of {n_cols} elements is not a whole number of {elements}-element blocks"
            );
        }
        Ok(n_cols / elements * bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The engine's block sizes are the table's, and every id maps back to its type.
    #[test]
    fn the_engine_types_agree_with_the_table() {
        for ty in GgmlType::ALL {
            let (elements, bytes, _) =
                type_info(ty.id()).expect("every engine type is in the table");
            assert_eq!(ty.block(), (elements as usize, bytes as usize), "{ty:?}");
            assert_eq!(GgmlType::from_id(ty.id(), "t").expect("supported"), ty);
        }
        let error = GgmlType::from_id(6, "blk.0.attn_q.weight").expect_err("Q5_0 is not computed");
        assert!(error.to_string().contains("Q5_0"), "{error}");
    }
}
