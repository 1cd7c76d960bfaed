//! The op set a model's forward pass runs on, whatever holds its buffers: the CPU
//! ([`cpu::CpuBackend`]) or the CUDA kernels (`crate::runtime::cuda::backend::KernelBackend`, on a
//! GPU or on the host harness). [`crate::runtime::exec::forward::BackendModel`] runs a
//! Llama-family model over any of them.
//!
//! Buffers are opaque and written through shared references, as device memory is: the
//! outputs of one call must not alias its inputs. Shapes are named in each op's doc; every
//! activation is f32, row-major, one row per token. Errors are the backend's (a launch
//! that fails, a type it has no kernel for, named).

use crate::runtime::formats::ggml::GgmlType;
use anyhow::Result;

use crate::runtime::model::config::RopeStyle;

pub mod cpu;

/// Tokens per KV-cache block: 16, as vLLM's default and the CPU cache's
/// (`model::kv::BLOCK_TOKENS`); the CUDA kernels are written for it.
pub const KV_BLOCK_TOKENS: usize = 16;

/// Where the `head_dim` values of `head` at `slot` (`0..KV_BLOCK_TOKENS`) of block `block`
/// start in one layer's paged keys or values, laid out `(n_blocks, n_kv_heads,
/// KV_BLOCK_TOKENS, head_dim)` f16 (what `store_kv` writes and `attention` reads), counted
/// in f16 elements.
pub fn kv_cache_offset(
    block: usize,
    head: usize,
    slot: usize,
    n_kv_heads: usize,
    head_dim: usize,
) -> usize {
    ((block * n_kv_heads + head) * KV_BLOCK_TOKENS + slot) * head_dim
}

/// The shapes of one [`Backend::attention`] call.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionShape {
    /// Query rows (tokens) in `q`.
    pub n_queries: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Columns of the block table (the longest sequence's blocks).
    pub max_blocks: usize,
    /// Softmax scale, `1 / √head_dim` for Llama.
    pub scale: f32,
}

/// What a forward pass needs from a device.
pub trait Backend {
    /// Memory on the device (bytes).
    type Buffer;
    /// A weight matrix `(n_rows, n_cols)` in a GGML encoding, resident on the device.
    type Matrix;

    /// Where the ops run, for messages ("cuda:0 (NVIDIA H100 80GB HBM3)", "cpu").
    fn name(&self) -> String;
    /// Kernels launched (and library calls such as GEMMs enqueued) since the backend was
    /// made, when it counts them; `None` where ops are not launches (the CPU backend).
    fn launches(&self) -> Option<u64> {
        None
    }
    /// A buffer holding `bytes`.
    fn upload(&self, bytes: &[u8]) -> Result<Self::Buffer>;
    /// A zeroed buffer of `len_bytes`.
    fn zeros(&self, len_bytes: usize) -> Result<Self::Buffer>;
    /// The first `len_bytes` of `buffer`.
    fn download(&self, buffer: &Self::Buffer, len_bytes: usize) -> Result<Vec<u8>>;
    /// A matrix of `ty` from its encoded rows. Errors: a length that does not match.
    fn upload_matrix(
        &self,
        ty: GgmlType,
        n_rows: usize,
        n_cols: usize,
        bytes: &[u8],
    ) -> Result<Self::Matrix>;

    /// Embedding lookup: `out (n_ids, n_cols)` = rows `ids (n_ids) i32` of `table`.
    fn get_rows(
        &self,
        out: &Self::Buffer,
        table: &Self::Matrix,
        ids: &Self::Buffer,
        n_ids: usize,
    ) -> Result<()>;
    /// Gathers rows of activations: `out (n_ids, dim)` = rows `ids (n_ids) i32` of `x`.
    fn gather_rows(
        &self,
        out: &Self::Buffer,
        x: &Self::Buffer,
        ids: &Self::Buffer,
        n_ids: usize,
        dim: usize,
    ) -> Result<()>;
    /// RMSNorm of each row: `y (n_rows, n_cols)` = `x / √(mean(x²) + eps) · weight (n_cols)`.
    fn rms_norm(
        &self,
        y: &Self::Buffer,
        x: &Self::Buffer,
        weight: &Self::Buffer,
        n_rows: usize,
        n_cols: usize,
        eps: f32,
    ) -> Result<()>;
    /// `y (n_tokens, w.n_rows)` = `x (n_tokens, w.n_cols)` · `wᵀ`.
    fn matmul(
        &self,
        y: &Self::Buffer,
        w: &Self::Matrix,
        x: &Self::Buffer,
        n_tokens: usize,
    ) -> Result<()>;
    /// `(n_rows, n_cols)` of a matrix.
    fn matrix_shape(&self, w: &Self::Matrix) -> (usize, usize);
    /// `ys[m] (n_tokens, ws[m].n_rows)` = `x (n_tokens, n_cols)` · `ws[m]ᵀ` for each
    /// `(ys[m], ws[m])` of `products`: several products of one input (Q, K and V), which a
    /// backend may run as one. By default, one [`Backend::matmul`] each.
    fn matmul_many(
        &self,
        products: &[(&Self::Buffer, &Self::Matrix)],
        x: &Self::Buffer,
        n_tokens: usize,
    ) -> Result<()> {
        for (y, w) in products {
            self.matmul(y, w, x, n_tokens)?;
        }
        Ok(())
    }
    /// `residual (n_tokens, w.n_rows) += x (n_tokens, w.n_cols) · wᵀ`: a projection added to
    /// the residual stream, which a backend may add as it computes it. `scratch` (as
    /// `residual`) may be overwritten. By default, [`Backend::matmul`] into `scratch`, then
    /// [`Backend::add`].
    fn matmul_add(
        &self,
        residual: &Self::Buffer,
        scratch: &Self::Buffer,
        w: &Self::Matrix,
        x: &Self::Buffer,
        n_tokens: usize,
    ) -> Result<()> {
        self.matmul(scratch, w, x, n_tokens)?;
        self.add(residual, scratch, n_tokens * self.matrix_shape(w).0)
    }
    /// `out (n_tokens, gate.n_rows)` = `silu(x · gateᵀ) · (x · upᵀ)`: the SwiGLU MLP's first
    /// half, which a backend may compute without writing the two products out.
    /// `gate_scratch` and `up_scratch` (as `out`) may be overwritten. By default, two
    /// [`Backend::matmul`]s and [`Backend::swiglu`].
    #[allow(clippy::too_many_arguments)]
    fn matmul_swiglu(
        &self,
        out: &Self::Buffer,
        gate_scratch: &Self::Buffer,
        up_scratch: &Self::Buffer,
        gate: &Self::Matrix,
        up: &Self::Matrix,
        x: &Self::Buffer,
        n_tokens: usize,
    ) -> Result<()> {
        self.matmul(gate_scratch, gate, x, n_tokens)?;
        self.matmul(up_scratch, up, x, n_tokens)?;
        self.swiglu(
            out,
            gate_scratch,
            up_scratch,
            n_tokens * self.matrix_shape(gate).0,
        )
    }
    /// Rotary embedding in place on `x (n_tokens, n_heads, head_dim)`: pair `i` of a head at
    /// `positions[t] (n_tokens) i32` turns by `positions[t] · inv_freqs[i] (head_dim / 2)`.
    #[allow(clippy::too_many_arguments)]
    fn rope(
        &self,
        x: &Self::Buffer,
        positions: &Self::Buffer,
        inv_freqs: &Self::Buffer,
        n_tokens: usize,
        n_heads: usize,
        head_dim: usize,
        style: RopeStyle,
    ) -> Result<()>;
    /// `out (n)` = `silu(gate) · up`.
    fn swiglu(
        &self,
        out: &Self::Buffer,
        gate: &Self::Buffer,
        up: &Self::Buffer,
        n: usize,
    ) -> Result<()>;
    /// `x (n) += y (n)`.
    fn add(&self, x: &Self::Buffer, y: &Self::Buffer, n: usize) -> Result<()>;
    /// `x (n_rows, n_cols) += bias (n_cols)`, row by row.
    fn add_bias(
        &self,
        x: &Self::Buffer,
        bias: &Self::Buffer,
        n_rows: usize,
        n_cols: usize,
    ) -> Result<()>;
    /// `x[ids[r], :] += weights[r] · rows[r, :]` for `rows (n_rows, dim)`, `ids (n_rows) i32`
    /// (distinct), `weights (n_rows) f32`: the MoE combine of one expert.
    fn scale_add_rows(
        &self,
        x: &Self::Buffer,
        rows: &Self::Buffer,
        ids: &Self::Buffer,
        weights: &Self::Buffer,
        n_rows: usize,
        dim: usize,
    ) -> Result<()>;
    /// Writes `k, v (n_tokens, n_kv_heads, head_dim)` as f16 into their `slots (n_tokens)
    /// i32` (`block · 16 + offset`) of one layer's caches `(n_blocks, n_kv_heads, 16,
    /// head_dim)`.
    #[allow(clippy::too_many_arguments)]
    fn store_kv(
        &self,
        k_cache: &Self::Buffer,
        v_cache: &Self::Buffer,
        k: &Self::Buffer,
        v: &Self::Buffer,
        slots: &Self::Buffer,
        n_tokens: usize,
        n_kv_heads: usize,
        head_dim: usize,
    ) -> Result<()>;
    /// [`Backend::rope`] on `q (n_queries, n_heads, head_dim)` and `k (n_queries, n_kv_heads,
    /// head_dim)`, then [`Backend::store_kv`] of `k` and `v` into `caches` (keys, values):
    /// a layer's new tokens made ready for attention. Devices that launch kernels do it in one.
    #[allow(clippy::too_many_arguments)]
    fn rope_store_kv(
        &self,
        (q, k, v): (&Self::Buffer, &Self::Buffer, &Self::Buffer),
        (k_cache, v_cache): (&Self::Buffer, &Self::Buffer),
        positions: &Self::Buffer,
        inv_freqs: &Self::Buffer,
        slots: &Self::Buffer,
        shape: &AttentionShape,
        style: RopeStyle,
    ) -> Result<()> {
        let (n, head_dim) = (shape.n_queries, shape.head_dim);
        self.rope(q, positions, inv_freqs, n, shape.n_heads, head_dim, style)?;
        self.rope(
            k,
            positions,
            inv_freqs,
            n,
            shape.n_kv_heads,
            head_dim,
            style,
        )?;
        self.store_kv(k_cache, v_cache, k, v, slots, n, shape.n_kv_heads, head_dim)
    }
    /// Copies whole blocks out of one layer's cache `(n_blocks, block_bytes)`, bit for bit:
    /// `out (n_ids, block_bytes)` = blocks `ids (n_ids) i32` (a sequence's keys or values
    /// handed to another replica). `block_bytes` is a multiple of 4 (a block is
    /// `n_kv_heads · 16 · head_dim` f16).
    ///
    /// Errors: a block outside the cache.
    fn read_kv_blocks(
        &self,
        out: &Self::Buffer,
        cache: &Self::Buffer,
        ids: &Self::Buffer,
        n_ids: usize,
        block_bytes: usize,
    ) -> Result<()>;
    /// Writes whole blocks into one layer's cache, bit for bit: blocks `ids (n_ids) i32`
    /// (distinct) of `cache (n_blocks, block_bytes)` = `rows (n_ids, block_bytes)` (a
    /// sequence's keys or values another replica computed). `block_bytes` as in
    /// [`Backend::read_kv_blocks`].
    ///
    /// Errors: a block outside the cache.
    fn write_kv_blocks(
        &self,
        cache: &Self::Buffer,
        rows: &Self::Buffer,
        ids: &Self::Buffer,
        n_ids: usize,
        block_bytes: usize,
    ) -> Result<()>;
    /// Attention of `q (n_queries, n_heads, head_dim)` over one layer's paged caches: query
    /// `t` reads the blocks of row `table_rows[t]` of `tables (n_rows, max_blocks) i32` and
    /// attends to its first `context_lens[t]` positions; GQA maps head `h` to KV head
    /// `h / (n_heads / n_kv_heads)`. `out` has `q`'s shape.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        out: &Self::Buffer,
        q: &Self::Buffer,
        k_cache: &Self::Buffer,
        v_cache: &Self::Buffer,
        tables: &Self::Buffer,
        table_rows: &Self::Buffer,
        context_lens: &Self::Buffer,
        shape: &AttentionShape,
    ) -> Result<()>;
    /// Sums `buffer`'s first `n` f32 across the device's own communicator (NCCL on a GPU that
    /// joined its TP group's), in place; `false`: the device has none, and the caller sums
    /// through host memory instead.
    ///
    /// Errors: the communicator's.
    fn all_reduce_sum_in_place(&self, buffer: &Self::Buffer, n: usize) -> Result<bool> {
        let _ = (buffer, n);
        Ok(false)
    }
    /// Sends `buffer`'s first `n` f32 (a pipeline stage's hidden states) to stage `stage`
    /// over the device's own pipeline communicator (NCCL on a GPU that joined its
    /// pipeline's); `false`: the device has none, and the caller sends through host memory.
    /// Every member of the pipeline takes the same way (they agreed when joining).
    ///
    /// Errors: the communicator's.
    fn send_to_stage(&self, buffer: &Self::Buffer, n: usize, stage: usize) -> Result<bool> {
        let _ = (buffer, n, stage);
        Ok(false)
    }
    /// Receives `n` f32 from stage `stage` into `buffer` over the device's own pipeline
    /// communicator, as [`Backend::send_to_stage`] sends them; `false`: it has none.
    ///
    /// Errors: the communicator's.
    fn recv_from_stage(&self, buffer: &Self::Buffer, n: usize, stage: usize) -> Result<bool> {
        let _ = (buffer, n, stage);
        Ok(false)
    }
    /// Greedy sampling: `out (n_rows) i32` = the index of each row's largest logit in
    /// `logits (n_rows, n_vocab)` (the lowest on ties).
    fn argmax(
        &self,
        out: &Self::Buffer,
        logits: &Self::Buffer,
        n_rows: usize,
        n_vocab: usize,
    ) -> Result<()>;
}

/// `values` as native-endian bytes (what [`Backend::upload`] takes for f32 and i32 data).
pub fn bytes_of<T: bytemuck::Pod>(values: &[T]) -> Vec<u8> {
    bytemuck::cast_slice(values).to_vec()
}

/// Native-endian f32 values of `bytes` (a whole number of 4-byte values, any alignment).
pub fn f32s_of(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(bytemuck::pod_read_unaligned)
        .collect()
}

/// Native-endian i32 values of `bytes` (any alignment).
pub fn i32s_of(bytes: &[u8]) -> Vec<i32> {
    bytes
        .chunks_exact(4)
        .map(bytemuck::pod_read_unaligned)
        .collect()
}

/// Normalized mean squared error, `Σ (a − b)² / Σ b²` (llama.cpp test-backend-ops'
/// measure); infinite when the lengths differ.
pub fn nmse(a: &[f32], b: &[f32]) -> f64 {
    if a.len() != b.len() {
        return f64::INFINITY;
    }
    let error: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - *y as f64).powi(2))
        .sum();
    let norm: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    error / norm.max(f64::MIN_POSITIVE)
}
