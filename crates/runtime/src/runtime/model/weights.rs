//! Weight matrices in their file encoding and the matrix product the forward pass is made
//! of: `out = x · Wᵀ` for a batch of activation rows, split over threads by output rows.

use crate::runtime::formats::ggml::GgmlType;
use std::sync::{Arc, OnceLock};

use anyhow::{Result, bail};
use rayon::prelude::*;

use crate::runtime::cpu::packed::{GROUP_ROWS, GroupState, Packed};
use crate::runtime::cpu::quant::{
    BlockQ8, DotState, Numerics, dequantize_row, dot_f32, has_q8_kernel, quantize_row_q8,
};
use crate::runtime::cpu::simd::has_avx2;
use crate::runtime::cpu::team;
use crate::runtime::formats::gguf::GgufFile;

/// Tokens whose dot products with one packed group of rows are computed together (each
/// unpacked weight block reused `TILE` times; see [`Packed::continue_group`]).
const TILE: usize = crate::runtime::cpu::packed::MAX_TOKENS;

/// Where a matrix's bytes live.
#[derive(Clone)]
enum Storage {
    /// A slice of a memory-mapped GGUF file (`offset..offset + len`).
    Mapped {
        file: Arc<GgufFile>,
        offset: usize,
        len: usize,
    },
    /// Bytes owned by the process (converted or re-sharded weights).
    Owned(Arc<Vec<u8>>),
}

/// A row-major matrix `(n_rows, n_cols)` in a ggml encoding: row `r` holds output feature
/// `r`'s weights over the `n_cols` inputs (GGUF's `ne0 = n_cols`, `ne1 = n_rows`).
#[derive(Clone)]
pub struct Weight {
    pub ty: GgmlType,
    pub n_rows: usize,
    pub n_cols: usize,
    row_bytes: usize,
    storage: Storage,
    /// The rows repacked for the integer kernels ([`Packed`]), built on first use (or by
    /// [`Weight::pack`]) when the type has one and the CPU has AVX2; shared by clones.
    packed: Arc<OnceLock<Option<Packed>>>,
    /// How the integer kernels round this matrix's products ([`Numerics::Exact`] unless
    /// [`Weight::set_numerics`] says otherwise; kept by [`Weight::rows`] and
    /// [`Weight::cols`]).
    numerics: Numerics,
}

impl std::fmt::Debug for Weight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Weight({:?}, {}×{})", self.ty, self.n_rows, self.n_cols)
    }
}

impl Weight {
    /// Bytes of the matrix in its encoding.
    pub fn size_bytes(&self) -> usize {
        self.n_rows * self.row_bytes
    }

    /// The 2-D tensor `name` of `file`. Errors: missing tensor, unsupported type (named), not 2-D.
    pub fn from_gguf(file: &Arc<GgufFile>, name: &str) -> Result<Weight> {
        let (info, range) = file.tensor_range(name)?;
        let ty = GgmlType::from_id(info.type_id, name)?;
        let (n_cols, n_rows) = match info.dims.as_slice() {
            [cols, rows] => (*cols as usize, *rows as usize),
            [cols] => (*cols as usize, 1),
            // Stacked matrices (MoE experts): `n` matrices of `rows` rows, one after another.
            [cols, rows, n] => (*cols as usize, (*rows * *n) as usize),
            other => bail!("tensor `{name}` has shape {other:?}; a matrix was expected"),
        };
        let row_bytes = ty.row_bytes(n_cols)?;
        if range.len() != row_bytes * n_rows {
            bail!(
                "tensor `{name}`: {} bytes for {n_rows}×{n_cols} {ty:?}",
                range.len()
            );
        }
        Ok(Weight {
            ty,
            n_rows,
            n_cols,
            row_bytes,
            storage: Storage::Mapped {
                file: Arc::clone(file),
                offset: range.start,
                len: range.len(),
            },
            packed: Arc::default(),
            numerics: Numerics::default(),
        })
    }

    /// A matrix from owned bytes. Errors: a length that does not match the shape.
    pub fn from_bytes(
        ty: GgmlType,
        n_rows: usize,
        n_cols: usize,
        bytes: Vec<u8>,
    ) -> Result<Weight> {
        ty.check_matrix_bytes(n_rows, n_cols, bytes.len())?;
        let row_bytes = ty.row_bytes(n_cols)?;
        Ok(Weight {
            ty,
            n_rows,
            n_cols,
            row_bytes,
            storage: Storage::Owned(Arc::new(bytes)),
            packed: Arc::default(),
            numerics: Numerics::default(),
        })
    }

    /// An f32 matrix from values (`n_rows × n_cols`, row-major).
    pub fn from_f32(n_rows: usize, n_cols: usize, values: &[f32]) -> Result<Weight> {
        Weight::from_bytes(
            GgmlType::F32,
            n_rows,
            n_cols,
            values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        )
    }

    /// Every row's encoded bytes, `n_rows × row_bytes`.
    pub fn bytes(&self) -> &[u8] {
        match &self.storage {
            Storage::Mapped { file, offset, len } => &file.data()[*offset..*offset + *len],
            Storage::Owned(bytes) => bytes,
        }
    }

    /// The encoded bytes of row `r`.
    pub fn row(&self, r: usize) -> &[u8] {
        &self.bytes()[r * self.row_bytes..(r + 1) * self.row_bytes]
    }

    /// Row `r` as f32 values into `out` (length `n_cols`).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        dequantize_row(self.ty, self.row(r), out);
    }

    /// Every value as f32, row-major (small matrices: norms, biases, tests).
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.n_rows * self.n_cols];
        for (r, chunk) in out.chunks_exact_mut(self.n_cols).enumerate() {
            self.dequantize_row(r, chunk);
        }
        out
    }

    /// Rows `first..first + n` as a new matrix (column-parallel sharding: whole rows).
    pub fn rows(&self, first: usize, n: usize) -> Result<Weight> {
        let mut rows = Weight::from_bytes(
            self.ty,
            n,
            self.n_cols,
            self.bytes()[first * self.row_bytes..(first + n) * self.row_bytes].to_vec(),
        )?;
        rows.numerics = self.numerics;
        Ok(rows)
    }

    /// Columns `first..first + n` of every row as a new matrix (row-parallel sharding: a
    /// slice of each row's inputs). Errors: a slice that does not start and end on a
    /// quantization-block boundary.
    pub fn cols(&self, first: usize, n: usize) -> Result<Weight> {
        let (block_elements, block_bytes) = self.ty.block();
        if !first.is_multiple_of(block_elements)
            || !n.is_multiple_of(block_elements)
            || first + n > self.n_cols
        {
            bail!(
                "cannot shard a {:?} matrix of {} columns at {first}..{}: shards must align to {block_elements}-element blocks",
                self.ty,
                self.n_cols,
                first + n
            );
        }
        let (start, len) = (
            first / block_elements * block_bytes,
            n / block_elements * block_bytes,
        );
        let mut bytes = Vec::with_capacity(len * self.n_rows);
        for r in 0..self.n_rows {
            bytes.extend_from_slice(&self.row(r)[start..start + len]);
        }
        let mut cols = Weight::from_bytes(self.ty, self.n_rows, n, bytes)?;
        cols.numerics = self.numerics;
        Ok(cols)
    }

    /// Sets how the integer kernels round this matrix's products (the packed rows are the
    /// same for every order).
    pub fn set_numerics(&mut self, numerics: Numerics) {
        self.numerics = numerics;
    }

    /// The packed rows, packing them on first use; `None` for types without an integer
    /// kernel or on CPUs without AVX2 (the portable one-row kernel runs instead).
    fn packed(&self) -> Option<&Packed> {
        if !has_q8_kernel(self.ty) || !has_avx2() {
            return None;
        }
        self.packed
            .get_or_init(|| Packed::new(self.ty, self.n_rows, self.n_cols / 32, |r| self.row(r)))
            .as_ref()
    }

    /// Packs the rows for the integer kernels now rather than on the first product (model
    /// loading calls it so the first request does not pay for it); a no-op otherwise.
    pub fn pack(&self) {
        let _ = self.packed();
    }

    /// `out = x · Wᵀ`.
    /// * `x`: `(n_tokens, n_cols)` row-major; `out`: `(n_tokens, n_rows)` row-major.
    ///
    /// Runs on the current rayon pool, each task taking a contiguous range of output rows.
    /// `Q4_0`, `Q4_1` and `Q8_0` give, for every row and token, exactly the bits of
    /// [`crate::runtime::cpu::quant::dot_q8`] (in the order [`Weight::set_numerics`] chose) whatever `n_tokens` is.
    pub fn matmul(&self, x: &[f32], n_tokens: usize, out: &mut [f32]) {
        matmul_many(&[self], x, n_tokens, &mut [out]);
    }

    /// [`matmul`](Weight::matmul) with one output vector per token (`outs[t]`: `n_rows`
    /// values for token `t` of `x`, `(outs.len(), n_cols)`): the LM head's logits go
    /// straight to the per-sequence vectors the samplers take.
    ///
    /// Panics (a bug, not input): mis-sized `x` or outputs.
    pub fn matmul_per_token(&self, x: &[f32], outs: &mut [Vec<f32>]) {
        assert_eq!(x.len(), outs.len() * self.n_cols);
        assert!(outs.iter().all(|o| o.len() == self.n_rows));
        match self.packed() {
            Some(packed) => {
                let quantized = quantize_tokens(x, self.n_cols);
                let mut rows = vec![outs.iter_mut().map(|o| &mut o[..]).collect()];
                run_groups_into(&[packed], &quantized, &mut rows, self.numerics);
            }
            None => {
                let mut flat = vec![0f32; outs.len() * self.n_rows];
                self.matmul(x, outs.len(), &mut flat);
                for (out, row) in outs.iter_mut().zip(flat.chunks_exact(self.n_rows)) {
                    out.copy_from_slice(row);
                }
            }
        }
    }

    /// [`matmul`](Weight::matmul) without packed rows: `(n_rows, n_tokens)` so each task
    /// writes a contiguous range, then transposed.
    fn matmul_unpacked(&self, x: &[f32], n_tokens: usize, out: &mut [f32]) {
        let mut transposed = vec![0f32; self.n_rows * n_tokens];
        self.matmul_rows_major(x, n_tokens, &mut transposed);
        if n_tokens == 1 {
            out.copy_from_slice(&transposed);
            return;
        }
        for (r, per_token) in transposed.chunks_exact(n_tokens).enumerate() {
            for (t, value) in per_token.iter().enumerate() {
                out[t * self.n_rows + r] = *value;
            }
        }
    }

    /// Continues dot products split over ranks at block boundaries (the row-parallel half of
    /// tensor parallelism, see [`crate::runtime::cpu::quant::DotState`]): `states[r * n_tokens + t]`
    /// (`(n_rows, n_tokens)`) continues with `W[r] · x[t]` over this shard's columns.
    ///
    /// Errors: a type without an integer kernel (`Q4_0`, `Q4_1`, `Q8_0` have one).
    ///
    /// The chain itself keeps its states grouped ([`Weight::matmul_continue_grouped`]); this
    /// row-major form is the tests' reference for it.
    #[cfg(test)]
    fn matmul_continue(
        &self,
        x: &[f32],
        n_tokens: usize,
        states: &mut [DotState],
    ) -> anyhow::Result<()> {
        let mut grouped = group_states(states, self.n_rows, n_tokens);
        self.matmul_continue_grouped(x, n_tokens, &mut grouped)?;
        ungroup_states(&grouped, self.n_rows, n_tokens, states);
        Ok(())
    }

    /// Continues dot products split over ranks at block boundaries (the row-parallel half of
    /// tensor parallelism, see [`crate::runtime::cpu::quant::DotState`]) on states kept in row
    /// groups, as the packed kernels hold them: `states[g * n_tokens + t][k][r]`
    /// (`(n_groups, n_tokens)` of `[lane k][row r of the group]`,
    /// `n_groups = ⌈n_rows / GROUP_ROWS⌉`, rows past `n_rows` zero), so that a chain of ranks
    /// passes them on without regrouping ([`finish_grouped`] ends them).
    ///
    /// Errors: a type without an integer kernel; `states` of another length.
    pub fn matmul_continue_grouped(
        &self,
        x: &[f32],
        n_tokens: usize,
        states: &mut [GroupState],
    ) -> anyhow::Result<()> {
        if !has_q8_kernel(self.ty) {
            anyhow::bail!("{:?} has no integer kernel to continue", self.ty);
        }
        if states.len() != self.n_rows.div_ceil(GROUP_ROWS) * n_tokens {
            anyhow::bail!(
                "{} grouped states for {} rows and {n_tokens} tokens",
                states.len(),
                self.n_rows
            );
        }
        let quantized = quantize_tokens(x, self.n_cols);
        let numerics = self.numerics;
        if let Some(packed) = self.packed() {
            continue_groups(packed, &quantized, states, numerics);
            return Ok(());
        }
        let mut rows = vec![[0f32; 9]; self.n_rows * n_tokens];
        ungroup_states(states, self.n_rows, n_tokens, &mut rows);
        let chunk_rows = self.chunk_rows();
        rows.par_chunks_mut(chunk_rows * n_tokens)
            .enumerate()
            .for_each(|(chunk, values)| {
                for (i, per_token) in values.chunks_exact_mut(n_tokens).enumerate() {
                    let row = self.row(chunk * chunk_rows + i);
                    for (state, xq) in per_token.iter_mut().zip(&quantized) {
                        crate::runtime::cpu::quant::dot_q8_continue(
                            self.ty, row, xq, state, numerics,
                        );
                    }
                }
            });
        states.copy_from_slice(&group_states(&rows, self.n_rows, n_tokens));
        Ok(())
    }

    /// Output rows per rayon task: about four tasks per thread, 16 to 512 rows.
    fn chunk_rows(&self) -> usize {
        (self.n_rows / (rayon::current_num_threads() * 4)).clamp(16, 512)
    }

    /// `target[r * n_tokens + t] = W[r] · x[t]`, without packed rows: the portable one-row
    /// integer kernel, or rows dequantized to f32 for the other types.
    fn matmul_rows_major(&self, x: &[f32], n_tokens: usize, target: &mut [f32]) {
        let chunk_rows = self.chunk_rows();
        if has_q8_kernel(self.ty) {
            let quantized = quantize_tokens(x, self.n_cols);
            target
                .par_chunks_mut(chunk_rows * n_tokens)
                .enumerate()
                .for_each(|(chunk, values)| {
                    for (i, per_token) in values.chunks_exact_mut(n_tokens).enumerate() {
                        let row = self.row(chunk * chunk_rows + i);
                        for (value, xq) in per_token.iter_mut().zip(&quantized) {
                            *value =
                                crate::runtime::cpu::quant::dot_q8(self.ty, row, xq, self.numerics);
                        }
                    }
                });
        } else {
            target
                .par_chunks_mut(chunk_rows * n_tokens)
                .enumerate()
                .for_each_init(
                    || vec![0f32; self.n_cols],
                    |row_f32, (chunk, values)| {
                        for (i, per_token) in values.chunks_exact_mut(n_tokens).enumerate() {
                            self.dequantize_row(chunk * chunk_rows + i, row_f32);
                            for (value, token) in
                                per_token.iter_mut().zip(x.chunks_exact(self.n_cols))
                            {
                                *value = dot_f32(row_f32, token);
                            }
                        }
                    },
                );
        }
    }
}

/// Each token of `x` (`(n_tokens, n_cols)`) quantized to 8-bit blocks; tokens in parallel
/// when there are several (each token's blocks are the same either way).
fn quantize_tokens(x: &[f32], n_cols: usize) -> Vec<Vec<BlockQ8>> {
    let quantize = |token: &[f32]| {
        let mut blocks = Vec::new();
        quantize_row_q8(token, &mut blocks);
        blocks
    };
    if x.len() > n_cols {
        let mut tokens = vec![Vec::new(); x.len() / n_cols];
        team::for_each_mut(&mut tokens, |t, blocks| {
            quantize_row_q8(&x[t * n_cols..(t + 1) * n_cols], blocks)
        });
        tokens
    } else {
        x.chunks_exact(n_cols).map(quantize).collect()
    }
}

/// `outs[i] = x · weights[i]ᵀ` for matrices over the same inputs (Q, K and V; gate and up):
/// `x` is `(n_tokens, n_cols)`, `outs[i]` is `(n_tokens, weights[i].n_rows)`, row-major.
/// The activations are quantized once and one parallel region covers every matrix's rows.
/// Each result is exactly what [`Weight::matmul`] alone gives (the same per-row kernel).
///
/// Panics (a bug, not input): matrices with different `n_cols` or [`Numerics`], or
/// mis-sized buffers.
pub fn matmul_many(weights: &[&Weight], x: &[f32], n_tokens: usize, outs: &mut [&mut [f32]]) {
    assert_eq!(weights.len(), outs.len());
    let Some(n_cols) = weights.first().map(|w| w.n_cols) else {
        return;
    };
    assert!(weights.iter().all(|w| w.n_cols == n_cols));
    let numerics = weights[0].numerics;
    assert!(weights.iter().all(|w| w.numerics == numerics));
    assert_eq!(x.len(), n_tokens * n_cols);
    let packed: Option<Vec<&Packed>> = weights.iter().map(|w| w.packed()).collect();
    let Some(packed) = packed else {
        for (weight, out) in weights.iter().zip(outs.iter_mut()) {
            weight.matmul_unpacked(x, n_tokens, out);
        }
        return;
    };
    let quantized = quantize_tokens(x, n_cols);
    let mut token_rows: Vec<Vec<&mut [f32]>> = outs
        .iter_mut()
        .zip(weights)
        .map(|(out, weight)| {
            assert_eq!(out.len(), n_tokens * weight.n_rows);
            out.chunks_mut(weight.n_rows).collect()
        })
        .collect();
    run_groups_into(&packed, &quantized, &mut token_rows, numerics);
}

/// The packed kernel over every group of every matrix and every token, `TILE` tokens at a
/// time, in one parallel region, each task writing its rows straight into the outputs:
/// `outs[m][t]` is matrix `m`'s output row for token `t` (`n_rows` values), split between
/// the tasks by row ranges (so no task shares a value, and nothing is transposed after).
fn run_groups_into(
    packed: &[&Packed],
    quantized: &[Vec<BlockQ8>],
    outs: &mut [Vec<&mut [f32]>],
    numerics: Numerics,
) {
    let n_tokens = quantized.len();
    let total: usize = packed.iter().map(|p| p.n_groups()).sum();
    let groups_per_task = (total / (team::current_threads() * 4)).clamp(1, 64);
    let rows_per_task = groups_per_task * GROUP_ROWS;
    // (matrix, first group, the task's slice of every token's output row).
    let mut tasks: Vec<(usize, usize, Vec<&mut [f32]>)> = Vec::new();
    for (m, rows) in outs.iter_mut().enumerate() {
        let mut pieces: Vec<_> = rows
            .iter_mut()
            .map(|row| row.chunks_mut(rows_per_task))
            .collect();
        for task in 0..packed[m].n_groups().div_ceil(groups_per_task) {
            let slices: Vec<&mut [f32]> = pieces.iter_mut().filter_map(Iterator::next).collect();
            tasks.push((m, task * groups_per_task, slices));
        }
    }
    team::for_each_mut(&mut tasks, |_, (m, first_group, slices)| {
        let (m, first_group) = (*m, *first_group);
        let n_rows = slices.first().map_or(0, |s| s.len());
        let mut x = [&[][..]; TILE];
        let mut products = [[0f32; GROUP_ROWS]; TILE];
        for i in 0..n_rows.div_ceil(GROUP_ROWS) {
            let rows = i * GROUP_ROWS..((i + 1) * GROUP_ROWS).min(n_rows);
            for first in (0..n_tokens).step_by(TILE) {
                let n = TILE.min(n_tokens - first);
                for t in 0..n {
                    x[t] = &quantized[first + t][..];
                }
                let group = first_group + i;
                // The first tile brings the next group in while this one is computed.
                let ahead = (first == 0 && n_tokens > 2).then_some(group + 1);
                let out = &mut products[..n];
                packed[m].product_group(group, &x[..n], out, numerics, ahead);
                for (slice, &sums) in slices[first..first + n].iter_mut().zip(&products) {
                    // A whole group is one fixed-size store (a slice copy of run-time
                    // length is a `memmove` call: 6% of a batched step, measured).
                    match <&mut [f32; GROUP_ROWS]>::try_from(&mut slice[rows.clone()]) {
                        Ok(whole) => *whole = sums,
                        Err(_) => slice[rows.clone()].copy_from_slice(&sums[..rows.len()]),
                    }
                }
            }
        }
    });
}

/// Per-row states `(n_rows, n_tokens)` in row groups (`(n_groups, n_tokens)` of
/// `[lane][row of the group]`, rows past `n_rows` zero): the layout of
/// [`Weight::matmul_continue_grouped`].
fn group_states(rows: &[DotState], n_rows: usize, n_tokens: usize) -> Vec<GroupState> {
    let mut groups = vec![[[0f32; GROUP_ROWS]; 9]; n_rows.div_ceil(GROUP_ROWS) * n_tokens];
    for (row, per_token) in rows.chunks_exact(n_tokens).enumerate() {
        let (g, r) = (row / GROUP_ROWS, row % GROUP_ROWS);
        for (t, state) in per_token.iter().enumerate() {
            let group = &mut groups[g * n_tokens + t];
            for (k, lane) in state.iter().enumerate() {
                group[k][r] = *lane;
            }
        }
    }
    groups
}

/// The inverse of [`group_states`], into `rows` (`(n_rows, n_tokens)`).
fn ungroup_states(groups: &[GroupState], n_rows: usize, n_tokens: usize, rows: &mut [DotState]) {
    for (row, per_token) in rows.chunks_exact_mut(n_tokens).take(n_rows).enumerate() {
        let (g, r) = (row / GROUP_ROWS, row % GROUP_ROWS);
        for (t, state) in per_token.iter_mut().enumerate() {
            let group = &groups[g * n_tokens + t];
            *state = std::array::from_fn(|k| group[k][r]);
        }
    }
}

/// Finishes grouped states ([`Weight::matmul_continue_grouped`]) of a matrix of `n_rows`
/// rows into `out` (`(n_tokens, n_rows)`): each dot product as
/// [`crate::runtime::cpu::quant::dot_state_finish`] ends it.
pub fn finish_grouped(groups: &[GroupState], n_rows: usize, n_tokens: usize, out: &mut [f32]) {
    for (g, per_token) in groups.chunks_exact(n_tokens).enumerate() {
        let rows = g * GROUP_ROWS..((g + 1) * GROUP_ROWS).min(n_rows);
        for (t, group) in per_token.iter().enumerate() {
            for (r, row) in rows.clone().enumerate() {
                let state: DotState = std::array::from_fn(|k| group[k][r]);
                out[t * n_rows + row] = crate::runtime::cpu::quant::dot_state_finish(&state);
            }
        }
    }
}

/// Continues `states` (`(n_groups, n_tokens)`: each group's state for each token) with every
/// token of `quantized`, `TILE` tokens at a time, the groups split over one parallel region.
fn continue_groups(
    packed: &Packed,
    quantized: &[Vec<BlockQ8>],
    states: &mut [GroupState],
    numerics: Numerics,
) {
    let n_tokens = quantized.len();
    let groups_per_task = (packed.n_groups() / (team::current_threads() * 4)).clamp(1, 64);
    team::for_each_chunk_mut(states, groups_per_task * n_tokens, |task, slots| {
        let mut x = [&[][..]; TILE];
        for (i, per_token) in slots.chunks_exact_mut(n_tokens).enumerate() {
            let g = task * groups_per_task + i;
            for (tile, tile_states) in per_token.chunks_mut(TILE).enumerate() {
                let n = tile_states.len();
                for t in 0..n {
                    x[t] = &quantized[tile * TILE + t][..];
                }
                packed.continue_group(g, &x[..n], tile_states, numerics);
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::cpu::quant::{DotState, Numerics, dot_q8, dot_state_finish};

    /// A `Q4_1` matrix of random nibbles with varied scales and minimums.
    fn q4_1(n_rows: usize, n_cols: usize, seed: u64) -> Weight {
        let mut bytes = crate::runtime::cpu::quant::tests::bytes(n_rows * n_cols / 32 * 20, seed);
        for (i, block) in bytes.chunks_exact_mut(20).enumerate() {
            let d = half::f16::from_f32(0.01 + 0.001 * (i % 7) as f32);
            let m = half::f16::from_f32(-0.05 - 0.01 * (i % 3) as f32);
            block[..2].copy_from_slice(&d.to_le_bytes());
            block[2..4].copy_from_slice(&m.to_le_bytes());
        }
        Weight::from_bytes(GgmlType::Q4_1, n_rows, n_cols, bytes).expect("shape")
    }

    fn activations(n_tokens: usize, n_cols: usize) -> Vec<f32> {
        (0..n_tokens * n_cols)
            .map(|i| ((i * 7919) % 1013) as f32 / 500.0 - 1.0)
            .collect()
    }

    /// Several matrices in one region (row counts not multiples of 8, a matrix large enough
    /// for tasks of several groups with a shorter last one, token counts across the tiles)
    /// give each row and token exactly the one-row reference's bits; so does the per-token
    /// output form.
    #[test]
    fn fused_products_equal_the_one_row_reference() {
        for numerics in [Numerics::Exact, Numerics::Fast] {
            fused_case(numerics);
        }
    }

    fn fused_case(numerics: Numerics) {
        let n_cols = 96;
        let mut weights = [
            q4_1(13, n_cols, 3),
            q4_1(8, n_cols, 5),
            q4_1(21, n_cols, 7),
            q4_1(565, n_cols, 11),
        ];
        weights.iter_mut().for_each(|w| w.set_numerics(numerics));
        for n_tokens in [1, 3, 4, 6, 9, 16] {
            let x = activations(n_tokens, n_cols);
            let mut outs: Vec<Vec<f32>> = weights
                .iter()
                .map(|w| vec![f32::NAN; n_tokens * w.n_rows])
                .collect();
            let mut views: Vec<&mut [f32]> = outs.iter_mut().map(|o| &mut o[..]).collect();
            let refs: Vec<&Weight> = weights.iter().collect();
            matmul_many(&refs, &x, n_tokens, &mut views);
            let quantized = quantize_tokens(&x, n_cols);
            for (w, out) in weights.iter().zip(&outs) {
                for t in 0..n_tokens {
                    for r in 0..w.n_rows {
                        let reference = dot_q8(w.ty, w.row(r), &quantized[t], numerics);
                        assert_eq!(
                            out[t * w.n_rows + r].to_bits(),
                            reference.to_bits(),
                            "{numerics:?} {} rows, {n_tokens} tokens: token {t} row {r}",
                            w.n_rows
                        );
                    }
                }
                let mut per_token = vec![vec![f32::NAN; w.n_rows]; n_tokens];
                w.matmul_per_token(&x, &mut per_token);
                assert_eq!(per_token.concat(), *out, "{} rows, per token", w.n_rows);
            }
        }
    }

    /// Tensor-parallel row splits: continuing the states over column shards gives exactly
    /// the unsplit product, for one tile of tokens and for several (a partial last one).
    #[test]
    fn continued_products_over_column_shards_equal_the_whole() {
        for n_tokens in [5, 11] {
            for numerics in [Numerics::Exact, Numerics::Fast] {
                continued_case(n_tokens, numerics);
            }
        }
    }

    fn continued_case(n_tokens: usize, numerics: Numerics) {
        let (n_rows, n_cols) = (11, 128);
        let mut whole = q4_1(n_rows, n_cols, 9);
        whole.set_numerics(numerics);
        let x = activations(n_tokens, n_cols);
        let mut expected = vec![0f32; n_tokens * n_rows];
        whole.matmul(&x, n_tokens, &mut expected);
        // Three column shards at block boundaries, each with its slice of every token.
        let shards: Vec<(Weight, Vec<f32>)> = [(0, 32), (32, 64), (96, 32)]
            .into_iter()
            .map(|(first, width)| {
                let x_shard = x
                    .chunks_exact(n_cols)
                    .flat_map(|token| token[first..first + width].to_vec())
                    .collect();
                (whole.cols(first, width).expect("block aligned"), x_shard)
            })
            .collect();
        let mut states: Vec<DotState> = vec![[0.0; 9]; n_rows * n_tokens];
        for (shard, x_shard) in &shards {
            shard
                .matmul_continue(x_shard, n_tokens, &mut states)
                .expect("integer type");
        }
        for r in 0..n_rows {
            for t in 0..n_tokens {
                assert_eq!(
                    dot_state_finish(&states[r * n_tokens + t]).to_bits(),
                    expected[t * n_rows + r].to_bits(),
                    "{numerics:?} {n_tokens} tokens: row {r} token {t}"
                );
            }
        }
        // The same chain on grouped states (one partial group of 11 rows), finished into
        // `(n_tokens, n_rows)`.
        let mut grouped = vec![[[0f32; GROUP_ROWS]; 9]; n_tokens];
        for (shard, x_shard) in &shards {
            shard
                .matmul_continue_grouped(x_shard, n_tokens, &mut grouped)
                .expect("integer type");
        }
        let mut finished = vec![0f32; n_tokens * n_rows];
        finish_grouped(&grouped, n_rows, n_tokens, &mut finished);
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<u32>>();
        assert_eq!(
            bits(&finished),
            bits(&expected),
            "{numerics:?} {n_tokens} tokens"
        );
        let too_few = &mut grouped[..n_tokens - 1];
        assert!(
            whole
                .matmul_continue_grouped(&x, n_tokens, too_few)
                .is_err()
        );
    }
}
