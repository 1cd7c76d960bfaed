//! A Llama-family model's forward pass over any [`Backend`]: the weights uploaded once, the
//! keys and values in a paged f16 cache on the device (vLLM's layout, blocks of
//! [`KV_BLOCK_TOKENS`]), each step a batch of sequences with their new tokens (prompts and
//! decode steps mixed), the logits of each sequence's last token back on the host or
//! sampled greedily on the device. What `--device cuda` runs on a GPU, and what the tests
//! run through the host harness's kernels against the CPU engine.
//!
//! A device holds the whole model or one shard of it: a tensor-parallel shard sums its
//! row-parallel outputs over the TP group's collectives through host memory (the fallback
//! when NCCL is absent); a pipeline stage takes the previous stage's hidden states and hands
//! its own to the next (host memory again), the last stage giving the logits.

use crate::runtime::formats::ggml::GgmlType;
use std::collections::HashMap;
use std::sync::Arc;

use anyhow::{Context, Result, bail};

use crate::runtime::backend::{
    AttentionShape, Backend, KV_BLOCK_TOKENS, bytes_of, f32s_of, i32s_of, kv_cache_offset, nmse,
};
use crate::runtime::collectives::Comm;
use crate::runtime::exec::executor::{Executor, Sampled, StepEntry, first_step_cache, sample};
use crate::runtime::model::config::LlamaConfig;
use crate::runtime::model::kv::{KvCache, KvPool, KvTransfer};
use crate::runtime::model::llama::{Layer, Llama, gather_vocab, head_rows};
use crate::runtime::model::moe::top_k_experts;
use crate::runtime::model::sampling::Sampler;
use crate::runtime::model::tokenizer::Tokenizer;
use crate::runtime::model::weights::Weight;

/// One decoder layer on the device.
struct DeviceLayer<B: Backend> {
    attn_norm: B::Buffer,
    /// Q/K/V biases (Qwen2) and per-head Q/K RMSNorm weights `(head_dim)` (Qwen3).
    bias_q: Option<B::Buffer>,
    bias_k: Option<B::Buffer>,
    bias_v: Option<B::Buffer>,
    q_norm: Option<B::Buffer>,
    k_norm: Option<B::Buffer>,
    wq: B::Matrix,
    wk: B::Matrix,
    wv: B::Matrix,
    wo: B::Matrix,
    ffn_norm: B::Buffer,
    ffn: DeviceFfn<B>,
}

/// The MLP of a layer: dense SwiGLU, or a router over experts.
/// One expert's `(gate, up, down)` on the device.
type DeviceExpert<B> = (
    <B as Backend>::Matrix,
    <B as Backend>::Matrix,
    <B as Backend>::Matrix,
);

enum DeviceFfn<B: Backend> {
    Dense {
        gate: B::Matrix,
        up: B::Matrix,
        down: B::Matrix,
    },
    Moe {
        router: B::Matrix,
        /// `(gate, up, down)` of each expert; `None`: another rank of the TP group holds it
        /// (expert parallelism), and the group sums the experts' outputs.
        experts: Vec<Option<DeviceExpert<B>>>,
        top_k: usize,
        /// Each expert's intermediate width.
        width: usize,
    },
}

/// What a pipeline stage's step gives ([`BackendModel::step_stage`]).
pub enum StageOut<B: Backend> {
    /// The last stage: the logits buffer `(n_rows, vocab_size)`, one row per sequence.
    Logits(B::Buffer, usize),
    /// An earlier stage: every new token's hidden state `(n_tokens, hidden_size)` f32 on the
    /// device, for the next stage, and `n_tokens`.
    Hidden(B::Buffer, usize),
}

/// One sequence's place in the device cache: its blocks in position order and the
/// positions already cached.
#[derive(Debug, Default)]
pub struct DeviceSequence {
    blocks: Vec<usize>,
    /// Positions whose keys and values are cached.
    pub n_tokens: usize,
}

/// A model resident on a backend, with its KV cache.
pub struct BackendModel<B: Backend> {
    backend: B,
    config: LlamaConfig,
    /// The token embedding (first pipeline stage only).
    embedding: Option<B::Matrix>,
    layers: Vec<DeviceLayer<B>>,
    /// The final norm and LM head (last pipeline stage only).
    output_norm: Option<B::Buffer>,
    output: Option<B::Matrix>,
    inv_freqs: B::Buffer,
    /// Per layer, `(n_blocks, n_kv_heads, 16, head_dim)` f16.
    k_cache: Vec<B::Buffer>,
    v_cache: Vec<B::Buffer>,
    n_blocks: usize,
    free_blocks: Vec<usize>,
    /// Tensor-parallel position and degree of the shard (`(0, 1)`: the whole model).
    tp_rank: usize,
    tp: usize,
    /// The steps' activation buffers, once a step has run (taken out during a step).
    workspace: Option<Workspace<B>>,
    /// Seconds spent in [`BackendModel::step_stage`] so far: issuing work, for a device
    /// that runs it asynchronously.
    issue_secs: f64,
}

/// Sums `buffer` (`n` f32 values) across the TP group — on the device through its own
/// communicator (NCCL) when it has one, in place, else through host memory with the fallback
/// collectives (TCP, shared memory), into a new buffer — and returns the new buffer, `None`
/// when the sum is in `buffer` (summed in place, or no group).
fn all_reduce<B: Backend>(
    backend: &B,
    tp: &mut Option<&mut dyn Comm>,
    buffer: &B::Buffer,
    n: usize,
) -> Result<Option<B::Buffer>> {
    let Some(comm) = tp else {
        return Ok(None);
    };
    if backend.all_reduce_sum_in_place(buffer, n)? {
        return Ok(None);
    }
    let mut values = f32s_of(&backend.download(buffer, n * 4)?);
    comm.all_reduce_sum(&mut values)?;
    Ok(Some(backend.upload(&bytes_of(&values))?))
}

/// `x += w · input` (`x (n_tokens, hidden)`, the residual stream; `w (hidden, _)`): without a TP group, as
/// one [`Backend::matmul_add`]; a TP shard's partial product goes to `projected` first and is
/// summed across the group ([`all_reduce`]) before it is added.
///
/// Errors: the backend's or the group's.
#[allow(clippy::too_many_arguments)]
fn project_into_residual<B: Backend>(
    be: &B,
    tp: &mut Option<&mut dyn Comm>,
    x: &B::Buffer,
    projected: &B::Buffer,
    w: &B::Matrix,
    input: &B::Buffer,
    n_tokens: usize,
    hidden: usize,
) -> Result<()> {
    if tp.is_none() {
        return be.matmul_add(x, projected, w, input, n_tokens);
    }
    be.matmul(projected, w, input, n_tokens)?;
    let n = n_tokens * hidden;
    let summed = all_reduce(be, tp, projected, n)?;
    be.add(x, summed.as_ref().unwrap_or(projected), n)
}

/// The activation buffers of a step, reused by every step whose batch fits: one set per
/// model, grown to the largest batch seen (never shrunk), so that a decode step allocates
/// nothing per layer. Shapes for `tokens` rows of `(hidden)`, `(q_dim)`, `(kv_dim)` or
/// `(intermediate)` f32.
struct Workspace<B: Backend> {
    /// Rows (tokens) every buffer holds.
    tokens: usize,
    normed: B::Buffer,
    q: B::Buffer,
    k: B::Buffer,
    v: B::Buffer,
    /// The per-head Q/K norms' outputs (Qwen3), swapped with `q`/`k` after each.
    q_normed: B::Buffer,
    k_normed: B::Buffer,
    attention: B::Buffer,
    projected: B::Buffer,
    gate: B::Buffer,
    up: B::Buffer,
    activated: B::Buffer,
}

impl<B: Backend> Workspace<B> {
    /// Zeroed buffers for `tokens` rows of `config`'s widths.
    ///
    /// Errors: the backend's allocation.
    fn new(backend: &B, config: &LlamaConfig, tokens: usize) -> Result<Workspace<B>> {
        let q_dim = config.n_heads * config.head_dim;
        let kv_dim = config.n_kv_heads * config.head_dim;
        let f32s = |width: usize| backend.zeros(tokens * width * 4);
        Ok(Workspace {
            tokens,
            normed: f32s(config.hidden_size)?,
            q: f32s(q_dim)?,
            k: f32s(kv_dim)?,
            v: f32s(kv_dim)?,
            q_normed: f32s(q_dim)?,
            k_normed: f32s(kv_dim)?,
            attention: f32s(q_dim)?,
            projected: f32s(config.hidden_size)?,
            gate: f32s(config.intermediate_size)?,
            up: f32s(config.intermediate_size)?,
            activated: f32s(config.intermediate_size)?,
        })
    }
}

fn upload_weight<B: Backend>(backend: &B, weight: &Weight) -> Result<B::Matrix> {
    backend.upload_matrix(weight.ty, weight.n_rows, weight.n_cols, weight.bytes())
}

fn upload_f32s<B: Backend>(backend: &B, values: &[f32]) -> Result<B::Buffer> {
    backend.upload(&bytes_of(values))
}

/// Decoder layer `index` on the device: its norms, biases and matrices, and its MLP (dense,
/// or an MoE router with the experts this shard holds).
///
/// Errors: the backend's uploads; an MoE layer that holds none of its experts.
fn upload_layer<B: Backend>(backend: &B, index: usize, layer: &Layer) -> Result<DeviceLayer<B>> {
    let optional = |values: &Option<Vec<f32>>| -> Result<Option<B::Buffer>> {
        values
            .as_deref()
            .map(|v| upload_f32s(backend, v))
            .transpose()
    };
    let (bias_q, bias_k, bias_v) = (
        optional(&layer.bias_q)?,
        optional(&layer.bias_k)?,
        optional(&layer.bias_v)?,
    );
    let (q_norm, k_norm) = (optional(&layer.q_norm)?, optional(&layer.k_norm)?);
    let ffn = match &layer.moe {
        None => DeviceFfn::Dense {
            gate: upload_weight(backend, &layer.w_gate)?,
            up: upload_weight(backend, &layer.w_up)?,
            down: upload_weight(backend, &layer.w_down)?,
        },
        Some(moe) => {
            let mut experts = Vec::with_capacity(moe.experts.len());
            let mut width = 0;
            for expert in &moe.experts {
                let Some(expert) = expert else {
                    experts.push(None);
                    continue;
                };
                width = expert.gate.n_rows;
                experts.push(Some((
                    upload_weight(backend, &expert.gate)?,
                    upload_weight(backend, &expert.up)?,
                    upload_weight(backend, &expert.down)?,
                )));
            }
            if experts.iter().all(Option::is_none) {
                bail!("layer {index} holds none of its experts");
            }
            DeviceFfn::Moe {
                router: upload_weight(backend, &moe.router)?,
                experts,
                top_k: moe.top_k,
                width,
            }
        }
    };
    Ok(DeviceLayer {
        attn_norm: upload_f32s(backend, &layer.attn_norm)?,
        bias_q,
        bias_k,
        bias_v,
        q_norm,
        k_norm,
        wq: upload_weight(backend, &layer.wq)?,
        wk: upload_weight(backend, &layer.wk)?,
        wv: upload_weight(backend, &layer.wv)?,
        wo: upload_weight(backend, &layer.wo)?,
        ffn_norm: upload_f32s(backend, &layer.ffn_norm)?,
        ffn,
    })
}

impl<B: Backend> BackendModel<B> {
    /// Uploads `model` to `backend` with a KV cache of `kv_cache_tokens` positions (whole
    /// blocks of 16, rounded down; at least one). An embedding table in a type other than F32 or Q8_0 is uploaded
    /// dequantized to F32 (the lookup kernels read those two).
    ///
    /// Errors: a layer that holds none of its experts, a type the backend has no kernel for
    /// (named), a failed upload (the device's error).
    pub fn new(backend: B, model: &Llama, kv_cache_tokens: usize) -> Result<BackendModel<B>> {
        let shard = &model.shard;
        let config = model.config.clone();
        let table = &model.token_embedding;
        let embedding = if !shard.is_first {
            None
        } else if matches!(table.ty, GgmlType::F32 | GgmlType::Q8_0) {
            Some(upload_weight(&backend, table)?)
        } else {
            let values = table.to_f32();
            Some(backend.upload_matrix(
                GgmlType::F32,
                table.n_rows,
                table.n_cols,
                &bytes_of(&values),
            )?)
        };
        let layers = model
            .layers
            .iter()
            .enumerate()
            .map(|(index, layer)| upload_layer(&backend, index, layer))
            .collect::<Result<Vec<DeviceLayer<B>>>>()?;
        let n_blocks = (kv_cache_tokens / KV_BLOCK_TOKENS).max(1);
        let layer_cache_bytes =
            n_blocks * config.n_kv_heads * KV_BLOCK_TOKENS * config.head_dim * 2;
        let mut k_cache = Vec::with_capacity(layers.len());
        let mut v_cache = Vec::with_capacity(layers.len());
        for _ in 0..layers.len() {
            k_cache.push(backend.zeros(layer_cache_bytes)?);
            v_cache.push(backend.zeros(layer_cache_bytes)?);
        }
        Ok(BackendModel {
            output_norm: shard
                .is_last
                .then(|| upload_f32s(&backend, &model.output_norm))
                .transpose()?,
            output: shard
                .is_last
                .then(|| upload_weight(&backend, &model.output))
                .transpose()?,
            inv_freqs: upload_f32s(&backend, model.inv_freqs())?,
            embedding,
            layers,
            k_cache,
            v_cache,
            n_blocks,
            free_blocks: (0..n_blocks).rev().collect(),
            tp_rank: shard.tp_rank,
            tp: shard.tp,
            workspace: None,
            issue_secs: 0.0,
            config,
            backend,
        })
    }

    /// The backend the model runs on.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The model's shape.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// Blocks of the device cache no sequence holds.
    pub fn free_blocks(&self) -> usize {
        self.free_blocks.len()
    }

    /// Gives `sequence`'s blocks back to the pool (the sequence is empty after).
    pub fn release(&mut self, sequence: &mut DeviceSequence) {
        self.free_blocks.append(&mut sequence.blocks);
        sequence.n_tokens = 0;
    }

    /// Runs one step and returns each sequence's last-token logits `(vocab_size)`.
    ///
    /// Errors: those of [`BackendModel::step`].
    pub fn forward(
        &mut self,
        batch: &mut [(&mut DeviceSequence, &[u32])],
    ) -> Result<Vec<Vec<f32>>> {
        self.forward_tp(batch, None)
    }

    /// [`BackendModel::forward`] of a tensor-parallel shard: every member of `tp` (this
    /// shard's group, its rank the shard's) runs the same batch.
    ///
    /// Errors: those of [`BackendModel::step`].
    pub fn forward_tp(
        &mut self,
        batch: &mut [(&mut DeviceSequence, &[u32])],
        tp: Option<&mut dyn Comm>,
    ) -> Result<Vec<Vec<f32>>> {
        let (logits, n_rows) = self.step(batch, tp)?;
        self.download_logits(&logits, n_rows)
    }

    /// `logits` [n_rows, vocab] from the device, one row per vector.
    ///
    /// Errors: the device's.
    fn download_logits(&self, logits: &B::Buffer, n_rows: usize) -> Result<Vec<Vec<f32>>> {
        let vocab = self.config.vocab_size;
        let values = f32s_of(&self.backend.download(logits, n_rows * vocab * 4)?);
        Ok(values.chunks_exact(vocab).map(<[f32]>::to_vec).collect())
    }

    /// Runs one step and picks each sequence's next token greedily on the device (only the
    /// token ids come back).
    ///
    /// Errors: those of [`BackendModel::step`].
    pub(crate) fn forward_greedy(
        &mut self,
        batch: &mut [(&mut DeviceSequence, &[u32])],
    ) -> Result<Vec<u32>> {
        let (logits, n_rows) = self.step(batch, None)?;
        let ids = self.backend.zeros(n_rows * 4)?;
        self.backend
            .argmax(&ids, &logits, n_rows, self.config.vocab_size)?;
        Ok(i32s_of(&self.backend.download(&ids, n_rows * 4)?)
            .into_iter()
            .map(|id| id as u32)
            .collect())
    }

    /// Greedy generation of `max_tokens` after `prompt` in a fresh sequence (its blocks
    /// released after).
    ///
    /// Errors: an empty prompt, those of [`BackendModel::step`].
    pub fn generate_greedy(&mut self, prompt: &[u32], max_tokens: usize) -> Result<Vec<u32>> {
        let mut sequence = DeviceSequence::default();
        let result = self.generate_in(&mut sequence, prompt, max_tokens);
        self.release(&mut sequence);
        result
    }

    fn generate_in(
        &mut self,
        sequence: &mut DeviceSequence,
        prompt: &[u32],
        max_tokens: usize,
    ) -> Result<Vec<u32>> {
        if prompt.is_empty() {
            bail!("the prompt has no tokens");
        }
        let mut tokens = Vec::with_capacity(max_tokens);
        let mut input = prompt.to_vec();
        while tokens.len() < max_tokens {
            let next = self.forward_greedy(&mut [(&mut *sequence, &input)])?[0];
            tokens.push(next);
            input = vec![next];
        }
        Ok(tokens)
    }

    /// Bytes of one block of one layer's keys (or values): `(n_kv_heads, 16, head_dim)` f16.
    fn kv_block_bytes(&self) -> usize {
        self.config.n_kv_heads * KV_BLOCK_TOKENS * self.config.head_dim * 2
    }

    /// The keys and values `sequence` stored at `positions`, every layer of the model (or
    /// shard), as f16 bits in the hand-off's layout `(n_layers, 2, n_kv_heads,
    /// n_positions, head_dim)` (keys before values;
    /// [`crate::runtime::model::kv::KvTransfer`]): for each layer's keys and values, the
    /// blocks that hold the positions are copied out whole on the device into one buffer
    /// and downloaded, and the positions picked on the host.
    ///
    /// Errors: positions not stored, the backend's.
    pub(crate) fn read_kv(
        &self,
        sequence: &DeviceSequence,
        positions: std::ops::Range<usize>,
    ) -> Result<Vec<u16>> {
        if positions.start > positions.end || positions.end > sequence.n_tokens {
            bail!(
                "positions {}..{} are not all stored ({} are)",
                positions.start,
                positions.end,
                sequence.n_tokens
            );
        }
        let (n_kv_heads, head_dim) = (self.config.n_kv_heads, self.config.head_dim);
        let n = positions.len();
        let mut values = Vec::with_capacity(self.layers.len() * 2 * n_kv_heads * n * head_dim);
        if n == 0 {
            return Ok(values);
        }
        let first_block = positions.start / KV_BLOCK_TOKENS;
        let held = &sequence.blocks[first_block..positions.end.div_ceil(KV_BLOCK_TOKENS)];
        let ids: Vec<i32> = held.iter().map(|&b| b as i32).collect();
        let ids_buffer = self.backend.upload(&bytes_of(&ids))?;
        let block_bytes = self.kv_block_bytes();
        let out = self.backend.zeros(held.len() * block_bytes)?;
        for layer in 0..self.layers.len() {
            for cache in [&self.k_cache[layer], &self.v_cache[layer]] {
                self.backend
                    .read_kv_blocks(&out, cache, &ids_buffer, held.len(), block_bytes)?;
                let bytes = self.backend.download(&out, held.len() * block_bytes)?;
                // `(n_held, n_kv_heads, 16, head_dim)` to `(n_kv_heads, n_positions, head_dim)`.
                for head in 0..n_kv_heads {
                    for position in positions.clone() {
                        let (block, slot) = (
                            position / KV_BLOCK_TOKENS - first_block,
                            position % KV_BLOCK_TOKENS,
                        );
                        let at = kv_cache_offset(block, head, slot, n_kv_heads, head_dim);
                        values.extend(
                            bytes[2 * at..2 * (at + head_dim)]
                                .chunks_exact(2)
                                .map(|b| u16::from_ne_bytes([b[0], b[1]])),
                        );
                    }
                }
            }
        }
        Ok(values)
    }

    /// Writes `values` (f16 bits in [`BackendModel::read_kv`]'s layout, positions
    /// `0..n_positions`, every layer) into `sequence`'s blocks, which hold nothing yet, and
    /// counts the positions as stored: a sequence whose prompt another replica computed.
    /// Whole blocks are written (the last one's tail zeroed): one upload and one copy kernel
    /// for each layer's keys and for its values.
    ///
    /// Errors: a sequence with positions stored already, or without the blocks for
    /// `n_positions`; `values` of another length; the backend's.
    pub(crate) fn write_kv(
        &mut self,
        sequence: &mut DeviceSequence,
        n_positions: usize,
        values: &[u16],
    ) -> Result<()> {
        let (n_kv_heads, head_dim) = (self.config.n_kv_heads, self.config.head_dim);
        let n_blocks = n_positions.div_ceil(KV_BLOCK_TOKENS);
        if sequence.n_tokens != 0 || sequence.blocks.len() < n_blocks {
            bail!(
                "KV of {n_positions} positions goes into a sequence with none stored and {n_blocks} blocks (it has {} stored, {} blocks)",
                sequence.n_tokens,
                sequence.blocks.len()
            );
        }
        let layer_values = 2 * n_kv_heads * n_positions * head_dim;
        if values.len() != self.layers.len() * layer_values {
            bail!(
                "{} KV values for {} layers of {n_positions} positions (expected {})",
                values.len(),
                self.layers.len(),
                self.layers.len() * layer_values
            );
        }
        if n_positions == 0 {
            return Ok(());
        }
        let ids: Vec<i32> = sequence.blocks[..n_blocks]
            .iter()
            .map(|&b| b as i32)
            .collect();
        let ids_buffer = self.backend.upload(&bytes_of(&ids))?;
        let block_bytes = self.kv_block_bytes();
        let mut rows = vec![0u8; n_blocks * block_bytes];
        for layer in 0..self.layers.len() {
            let layer_at = layer * layer_values;
            for (half, cache) in [&self.k_cache[layer], &self.v_cache[layer]]
                .into_iter()
                .enumerate()
            {
                let half_values = &values[layer_at + half * layer_values / 2..][..layer_values / 2];
                // `(n_kv_heads, n_positions, head_dim)` to `(n_blocks, n_kv_heads, 16, head_dim)`.
                rows.fill(0);
                for (row, chunk) in half_values.chunks_exact(head_dim).enumerate() {
                    let (head, position) = (row / n_positions, row % n_positions);
                    let (block, slot) = (position / KV_BLOCK_TOKENS, position % KV_BLOCK_TOKENS);
                    let at = kv_cache_offset(block, head, slot, n_kv_heads, head_dim);
                    for (d, bits) in chunk.iter().enumerate() {
                        rows[2 * (at + d)..2 * (at + d) + 2].copy_from_slice(&bits.to_ne_bytes());
                    }
                }
                let upload = self.backend.upload(&rows)?;
                self.backend
                    .write_kv_blocks(cache, &upload, &ids_buffer, n_blocks, block_bytes)?;
            }
        }
        sequence.n_tokens = n_positions;
        Ok(())
    }

    /// Takes the blocks every sequence of the batch needs, all or none.
    fn reserve(&mut self, batch: &mut [(&mut DeviceSequence, &[u32])]) -> Result<()> {
        let needed: usize = batch
            .iter()
            .map(|(s, new)| {
                (s.n_tokens + new.len())
                    .div_ceil(KV_BLOCK_TOKENS)
                    .saturating_sub(s.blocks.len())
            })
            .sum();
        if needed > self.free_blocks.len() {
            bail!(
                "the device KV cache is full ({} blocks of {KV_BLOCK_TOKENS} tokens, {} free, {needed} needed); raise --kv-cache-tokens",
                self.n_blocks,
                self.free_blocks.len()
            );
        }
        for (sequence, new) in batch.iter_mut() {
            while sequence.blocks.len() * KV_BLOCK_TOKENS < sequence.n_tokens + new.len() {
                let block = self.free_blocks.pop().context("the free list ran dry")?;
                sequence.blocks.push(block);
            }
        }
        Ok(())
    }

    /// Runs the batch through every layer: returns the logits buffer `(n_sequences,
    /// vocab_size)` of each sequence's last new token. A tensor-parallel shard sums its
    /// output and down projections over `tp` (Megatron-LM's two all-reduces per layer).
    ///
    /// Errors: a sequence without new tokens, past the model's context or with a token
    /// outside the vocabulary; a full cache (nothing is taken then); a shard without its
    /// group (or a group of another size or rank); the backend's or the group's errors.
    pub fn step(
        &mut self,
        batch: &mut [(&mut DeviceSequence, &[u32])],
        tp: Option<&mut dyn Comm>,
    ) -> Result<(B::Buffer, usize)> {
        match self.step_stage(batch, tp, None)? {
            StageOut::Logits(logits, n_rows) => Ok((logits, n_rows)),
            StageOut::Hidden(..) => bail!(
                "this device model is a pipeline stage before the last: it gives hidden states, not logits"
            ),
        }
    }

    /// [`BackendModel::step`] of a pipeline stage: the first stage embeds the batch's tokens,
    /// a later one starts from `hidden_in`: a device buffer of `(n_tokens, hidden_size)` f32
    /// and its `n_tokens`, the previous stage's [`StageOut::Hidden`] (received on this
    /// device, or uploaded), which the stage adds its layers' outputs to in place; the last
    /// gives the logits, the others their hidden states.
    ///
    /// Errors: those of [`BackendModel::step`]; hidden states given to the first stage, or
    /// missing (or for another number of tokens) on a later one.
    pub fn step_stage(
        &mut self,
        batch: &mut [(&mut DeviceSequence, &[u32])],
        tp: Option<&mut dyn Comm>,
        hidden_in: Option<(B::Buffer, usize)>,
    ) -> Result<StageOut<B>> {
        let start = std::time::Instant::now();
        let out = self.issue_step(batch, tp, hidden_in);
        self.issue_secs += start.elapsed().as_secs_f64();
        out
    }

    /// [`BackendModel::step_stage`], untimed: checks the batch, reserves its KV blocks,
    /// uploads its inputs, runs every layer of the stage and, on the last stage, the head.
    fn issue_step(
        &mut self,
        batch: &mut [(&mut DeviceSequence, &[u32])],
        mut tp: Option<&mut dyn Comm>,
        hidden_in: Option<(B::Buffer, usize)>,
    ) -> Result<StageOut<B>> {
        self.check_batch(batch, tp.as_ref().map(|comm| (comm.rank(), comm.size())))?;
        if self.tp == 1 {
            tp = None;
        }
        self.reserve(batch)?;
        let inputs = self.upload_inputs(batch)?;
        let x = self.stage_input(&inputs, hidden_in)?;
        let n = inputs.n_tokens;
        let c = &self.config;
        let mut ws = match self.workspace.take() {
            Some(ws) if ws.tokens >= n => ws,
            _ => Workspace::new(&self.backend, c, n)?,
        };
        let shape = AttentionShape {
            n_queries: n,
            n_heads: c.n_heads,
            n_kv_heads: c.n_kv_heads,
            head_dim: c.head_dim,
            max_blocks: inputs.max_blocks,
            scale: 1.0 / (c.head_dim as f32).sqrt(),
        };
        for l in 0..self.layers.len() {
            self.attention_block(l, &mut ws, &x, &inputs, &shape, &mut tp)?;
            self.ffn_block(&self.layers[l], &ws, &x, n, &mut tp)?;
        }
        self.workspace = Some(ws);
        for (sequence, new) in batch.iter_mut() {
            sequence.n_tokens += new.len();
        }
        match self.head_logits(&x, &inputs.last_rows, batch.len(), &mut tp)? {
            Some(logits) => Ok(StageOut::Logits(logits, batch.len())),
            None => Ok(StageOut::Hidden(x, n)),
        }
    }

    /// Checks a step's batch before anything is reserved: the TP group matches the shard
    /// (`group`: its rank and size), and every sequence brings new tokens, in the vocabulary,
    /// that fit the context.
    ///
    /// Errors: the first of those that fails, naming the sequence or token.
    fn check_batch(
        &self,
        batch: &[(&mut DeviceSequence, &[u32])],
        group: Option<(usize, usize)>,
    ) -> Result<()> {
        if self.tp > 1 && group != Some((self.tp_rank, self.tp)) {
            bail!(
                "shard {} of a TP {} model needs its TP group (rank {} of {}), given {group:?}",
                self.tp_rank,
                self.tp,
                self.tp_rank,
                self.tp
            );
        }
        let c = &self.config;
        if batch.is_empty() {
            bail!("an empty batch");
        }
        for (index, (sequence, new)) in batch.iter().enumerate() {
            if new.is_empty() {
                bail!("sequence {index} of the batch has no new tokens");
            }
            if sequence.n_tokens + new.len() > c.max_context_tokens {
                bail!(
                    "sequence {index} would reach {} tokens; the model's context is {}",
                    sequence.n_tokens + new.len(),
                    c.max_context_tokens
                );
            }
            if let Some(bad) = new.iter().find(|&&t| t as usize >= c.vocab_size) {
                bail!(
                    "token id {bad} is outside the vocabulary of {}",
                    c.vocab_size
                );
            }
        }
        Ok(())
    }

    /// The batch's token ids, positions, KV slots, block tables and rows on the device
    /// (sequences' blocks already reserved).
    ///
    /// Errors: the backend's uploads.
    fn upload_inputs(&self, batch: &[(&mut DeviceSequence, &[u32])]) -> Result<StepInputs<B>> {
        let max_blocks = batch.iter().map(|(s, _)| s.blocks.len()).max().unwrap_or(1);
        let (mut ids, mut positions, mut slots, mut rows, mut lens, mut last) =
            (vec![], vec![], vec![], vec![], vec![], vec![]);
        let mut tables = vec![0i32; batch.len() * max_blocks];
        for (index, (sequence, new)) in batch.iter().enumerate() {
            for (b, &block) in sequence.blocks.iter().enumerate() {
                tables[index * max_blocks + b] = block as i32;
            }
            for (i, &token) in new.iter().enumerate() {
                let position = sequence.n_tokens + i;
                ids.push(token as i32);
                positions.push(position as i32);
                let block = sequence.blocks[position / KV_BLOCK_TOKENS];
                slots.push((block * KV_BLOCK_TOKENS + position % KV_BLOCK_TOKENS) as i32);
                rows.push(index as i32);
                lens.push(position as i32 + 1);
            }
            last.push(ids.len() as i32 - 1);
        }
        let upload = |values: &[i32]| self.backend.upload(&bytes_of(values));
        Ok(StepInputs {
            n_tokens: ids.len(),
            max_blocks,
            ids: upload(&ids)?,
            positions: upload(&positions)?,
            slots: upload(&slots)?,
            tables: upload(&tables)?,
            rows: upload(&rows)?,
            lens: upload(&lens)?,
            last_rows: upload(&last)?,
        })
    }

    /// The stage's input hidden states, `(n_tokens, hidden_size)` f32: the first stage's
    /// embedding of the batch's tokens, or a later stage's `hidden_in`.
    ///
    /// Errors: hidden states given to the first stage, or missing (or for another number of
    /// tokens) on a later one; the backend's.
    fn stage_input(
        &self,
        inputs: &StepInputs<B>,
        hidden_in: Option<(B::Buffer, usize)>,
    ) -> Result<B::Buffer> {
        let n = inputs.n_tokens;
        Ok(match (&self.embedding, hidden_in) {
            (Some(embedding), None) => {
                let x = self.backend.zeros(n * self.config.hidden_size * 4)?;
                self.backend.get_rows(&x, embedding, &inputs.ids, n)?;
                x
            }
            (None, Some((hidden_in, n_in))) if n_in == n => hidden_in,
            (None, Some((_, n_in))) => bail!(
                "the previous pipeline stage sent hidden states of {n_in} tokens for a batch of {n}"
            ),
            (Some(_), Some(_)) => bail!("the first pipeline stage takes tokens, not hidden states"),
            (None, None) => {
                bail!("a pipeline stage after the first needs the previous stage's hidden states")
            }
        })
    }

    /// Layer `l`'s attention half: RMSNorm, Q/K/V (biases, per-head Q/K norms), RoPE and the
    /// KV store, paged attention, and the output projection added into the residual `x`
    /// (`(n_tokens, hidden_size)` f32), summed over the TP group.
    ///
    /// Errors: the backend's and the group's.
    fn attention_block(
        &self,
        l: usize,
        ws: &mut Workspace<B>,
        x: &B::Buffer,
        inputs: &StepInputs<B>,
        shape: &AttentionShape,
        tp: &mut Option<&mut dyn Comm>,
    ) -> Result<()> {
        let (be, c, layer) = (&self.backend, &self.config, &self.layers[l]);
        let (n, hidden, head_dim) = (inputs.n_tokens, c.hidden_size, c.head_dim);
        let (q_dim, kv_dim) = (c.n_heads * head_dim, c.n_kv_heads * head_dim);
        be.rms_norm(&ws.normed, x, &layer.attn_norm, n, hidden, c.rms_norm_eps)?;
        be.matmul_many(
            &[(&ws.q, &layer.wq), (&ws.k, &layer.wk), (&ws.v, &layer.wv)],
            &ws.normed,
            n,
        )?;
        for (x, bias, width) in [
            (&ws.q, &layer.bias_q, q_dim),
            (&ws.k, &layer.bias_k, kv_dim),
            (&ws.v, &layer.bias_v, kv_dim),
        ] {
            if let Some(bias) = bias {
                be.add_bias(x, bias, n, width)?;
            }
        }
        // Per-head RMSNorm of Q and K (Qwen3): each head a row of head_dim.
        if let Some(weight) = &layer.q_norm {
            be.rms_norm(
                &ws.q_normed,
                &ws.q,
                weight,
                n * c.n_heads,
                head_dim,
                c.rms_norm_eps,
            )?;
            std::mem::swap(&mut ws.q, &mut ws.q_normed);
        }
        if let Some(weight) = &layer.k_norm {
            be.rms_norm(
                &ws.k_normed,
                &ws.k,
                weight,
                n * c.n_kv_heads,
                head_dim,
                c.rms_norm_eps,
            )?;
            std::mem::swap(&mut ws.k, &mut ws.k_normed);
        }
        let (k_cache, v_cache) = (&self.k_cache[l], &self.v_cache[l]);
        be.rope_store_kv(
            (&ws.q, &ws.k, &ws.v),
            (k_cache, v_cache),
            &inputs.positions,
            &self.inv_freqs,
            &inputs.slots,
            shape,
            c.rope_style,
        )?;
        be.attention(
            &ws.attention,
            &ws.q,
            k_cache,
            v_cache,
            &inputs.tables,
            &inputs.rows,
            &inputs.lens,
            shape,
        )?;
        project_into_residual(
            be,
            tp,
            x,
            &ws.projected,
            &layer.wo,
            &ws.attention,
            n,
            hidden,
        )
    }

    /// A layer's feed-forward half: RMSNorm, then SwiGLU and the down projection added into
    /// the residual `x` (dense), or the MoE block ([`BackendModel::moe_block`]).
    ///
    /// Errors: the backend's and the group's.
    fn ffn_block(
        &self,
        layer: &DeviceLayer<B>,
        ws: &Workspace<B>,
        x: &B::Buffer,
        n: usize,
        tp: &mut Option<&mut dyn Comm>,
    ) -> Result<()> {
        let (be, c) = (&self.backend, &self.config);
        be.rms_norm(
            &ws.normed,
            x,
            &layer.ffn_norm,
            n,
            c.hidden_size,
            c.rms_norm_eps,
        )?;
        match &layer.ffn {
            DeviceFfn::Dense { gate, up, down } => {
                be.matmul_swiglu(&ws.activated, &ws.gate, &ws.up, gate, up, &ws.normed, n)?;
                project_into_residual(
                    be,
                    tp,
                    x,
                    &ws.projected,
                    down,
                    &ws.activated,
                    n,
                    c.hidden_size,
                )
            }
            DeviceFfn::Moe { .. } => self.moe_block(&layer.ffn, &ws.normed, x, n, tp),
        }
    }

    /// `ffn`'s MoE block over `normed` (`(n, hidden_size)` f32), added into `x`: the router's
    /// logits come to the host to pick each token's `top_k` experts; each expert (of
    /// `width` intermediate columns) then runs on its tokens' rows and adds them back
    /// weighted. With expert parallelism (experts held across the TP group, whose members
    /// all have the same rows) each member adds its own experts' outputs into zeros, and the
    /// group's all-reduce sums them.
    ///
    /// Errors: a dense `ffn`; a shard with only some experts and no TP group; the backend's
    /// and the group's.
    fn moe_block(
        &self,
        ffn: &DeviceFfn<B>,
        normed: &B::Buffer,
        x: &B::Buffer,
        n: usize,
        tp: &mut Option<&mut dyn Comm>,
    ) -> Result<()> {
        let DeviceFfn::Moe {
            router,
            experts,
            top_k,
            width,
        } = ffn
        else {
            bail!("a dense layer has no experts");
        };
        let (top_k, width) = (*top_k, *width);
        let be = &self.backend;
        let hidden = self.config.hidden_size;
        let f32_buffer = |values: usize| be.zeros(values * 4);
        let n_experts = experts.len();
        let sharded = experts.iter().any(Option::is_none);
        if sharded && tp.is_none() {
            bail!(
                "this shard holds only some experts (expert parallelism) but has no TP group to sum their outputs over"
            );
        }
        let partial = if sharded {
            Some(f32_buffer(n * hidden)?)
        } else {
            None
        };
        let target = partial.as_ref().unwrap_or(x);
        let logits = f32_buffer(n * n_experts)?;
        be.matmul(&logits, router, normed, n)?;
        let logits = f32s_of(&be.download(&logits, n * n_experts * 4)?);
        let mut routed: Vec<(Vec<i32>, Vec<f32>)> = vec![(vec![], vec![]); n_experts];
        for (t, row) in logits.chunks_exact(n_experts).enumerate() {
            for (e, weight) in top_k_experts(row, top_k) {
                routed[e].0.push(t as i32);
                routed[e].1.push(weight);
            }
        }
        for (expert, (tokens, weights)) in experts.iter().zip(&routed) {
            let m = tokens.len();
            let Some((gate, up, down)) = expert else {
                continue;
            };
            if m == 0 {
                continue;
            }
            let (token_ids, token_weights) = (
                be.upload(&bytes_of(tokens))?,
                be.upload(&bytes_of(weights))?,
            );
            let gathered = f32_buffer(m * hidden)?;
            be.gather_rows(&gathered, normed, &token_ids, m, hidden)?;
            let (g, u, a) = (
                f32_buffer(m * width)?,
                f32_buffer(m * width)?,
                f32_buffer(m * width)?,
            );
            be.matmul(&g, gate, &gathered, m)?;
            be.matmul(&u, up, &gathered, m)?;
            be.swiglu(&a, &g, &u, m * width)?;
            let out = f32_buffer(m * hidden)?;
            be.matmul(&out, down, &a, m)?;
            be.scale_add_rows(target, &out, &token_ids, &token_weights, m, hidden)?;
        }
        if let Some(partial) = partial {
            let summed = all_reduce(be, tp, &partial, n * hidden)?;
            be.add(x, summed.as_ref().unwrap_or(&partial), n * hidden)?;
        }
        Ok(())
    }

    /// The last stage's head: each sequence's last row of `x` (`last_rows`, `(n_rows)` i32)
    /// normed and projected to `(n_rows, vocab_size)` f32 logits; `None` on an earlier stage.
    /// A TP shard's head holds its rows of the vocabulary
    /// ([`crate::runtime::model::llama::head_rows`]); the group all-gathers them through
    /// host memory.
    ///
    /// Errors: the backend's, a failed all-gather.
    fn head_logits(
        &self,
        x: &B::Buffer,
        last_rows: &B::Buffer,
        n_rows: usize,
        tp: &mut Option<&mut dyn Comm>,
    ) -> Result<Option<B::Buffer>> {
        let (Some(output_norm), Some(output)) = (&self.output_norm, &self.output) else {
            return Ok(None);
        };
        let (be, c) = (&self.backend, &self.config);
        let hidden = c.hidden_size;
        let selected = be.zeros(n_rows * hidden * 4)?;
        be.gather_rows(&selected, x, last_rows, n_rows, hidden)?;
        let final_normed = be.zeros(n_rows * hidden * 4)?;
        be.rms_norm(
            &final_normed,
            &selected,
            output_norm,
            n_rows,
            hidden,
            c.rms_norm_eps,
        )?;
        let Some(comm) = tp else {
            let logits = be.zeros(n_rows * c.vocab_size * 4)?;
            be.matmul(&logits, output, &final_normed, n_rows)?;
            return Ok(Some(logits));
        };
        let slice = head_rows(self.tp_rank, self.tp, c.vocab_size).len();
        let local = be.zeros(n_rows * slice * 4)?;
        be.matmul(&local, output, &final_normed, n_rows)?;
        let rows: Vec<Vec<f32>> = f32s_of(&be.download(&local, n_rows * slice * 4)?)
            .chunks_exact(slice.max(1))
            .map(<[f32]>::to_vec)
            .collect();
        let whole = gather_vocab(*comm, &rows, c.vocab_size)?;
        Ok(Some(be.upload(&bytes_of(&whole.concat()))?))
    }
}

/// The device buffers of one step's batch, every one i32: what each layer reads.
struct StepInputs<B: Backend> {
    /// Tokens in the batch (`n_tokens`), over every sequence.
    n_tokens: usize,
    /// Blocks of the longest block table (the tables' row width).
    max_blocks: usize,
    /// `(n_tokens)`: token ids, positions, KV-cache slots (`block · 16 + offset`), each
    /// token's sequence (its row of `tables`), and its attention length (position + 1).
    ids: B::Buffer,
    positions: B::Buffer,
    slots: B::Buffer,
    rows: B::Buffer,
    lens: B::Buffer,
    /// `(n_sequences, max_blocks)`: each sequence's block table, zero-padded.
    tables: B::Buffer,
    /// `(n_sequences)`: each sequence's last token's row.
    last_rows: B::Buffer,
}

/// A running sequence of a [`BackendExecutor`]: its device block table, its ledger cache
/// (which allocates the device blocks), its sampler.
type SequenceState = (DeviceSequence, KvCache, Sampler);

/// An [`Executor`] over a [`BackendModel`]: what `--device cuda` generates and serves with.
/// Logits come to the host and are sampled there (greedy, top-k, top-p, seeds, log-probs:
/// the CPU engine's sampler).
///
/// The device cache's blocks are allocated by a ledger [`KvPool`] of the same capacity
/// (a few bytes a block, no KV of its own): each ledger block stands for one device block
/// slot ([`KvCache::block_ids`] mapped once to a slot), so the scheduler's block counts,
/// preemption and prefix cache (content-addressed full blocks, adopted instead of
/// computed, evicted LRU) are the device cache's, exactly as on the CPU engine.
pub struct BackendExecutor<B: Backend> {
    model: BackendModel<B>,
    tokenizer: Tokenizer,
    ledger: Arc<KvPool>,
    /// Device block slot of each ledger block identity.
    slots: HashMap<usize, usize>,
    sequences: HashMap<u64, SequenceState>,
    /// The TP group of a tensor-parallel shard ([`BackendExecutor::with_tp_group`]).
    tp: Option<Box<dyn Comm>>,
    /// The pipeline of a stage ([`BackendExecutor::with_pp_group`]): hidden states come from
    /// the member before and go to the member after.
    pp: Option<Box<dyn Comm>>,
}

impl<B: Backend> BackendExecutor<B> {
    /// An executor with no sequences; `tokenizer` is the model's. Its prefix cache is off
    /// until `kv_pool().set_prefix_cache(true)`.
    pub fn new(model: BackendModel<B>, tokenizer: Tokenizer) -> BackendExecutor<B> {
        // One layer, one head of one dimension: a block is 32 f16 of bookkeeping.
        let ledger = KvPool::new(1, 1, 1, Some(model.n_blocks * KV_BLOCK_TOKENS));
        BackendExecutor {
            model,
            tokenizer,
            ledger,
            slots: HashMap::new(),
            sequences: HashMap::new(),
            tp: None,
            pp: None,
        }
    }

    /// The executor of a pipeline stage: member `stage` of `pp` (the stages in order, each
    /// running the same steps). A stage before the last sends its hidden states on and
    /// samples nothing ([`Executor::step`] gives no tokens there); the last samples.
    pub fn with_pp_group(mut self, pp: Box<dyn Comm>) -> BackendExecutor<B> {
        self.pp = Some(pp);
        self
    }

    /// The executor of a tensor-parallel shard: every step's row-parallel outputs are summed
    /// over `tp` (this shard's group, its rank the shard's), whose members run the same
    /// steps in the same order (a replica's ranks follow their driver).
    pub fn with_tp_group(mut self, tp: Box<dyn Comm>) -> BackendExecutor<B> {
        self.tp = Some(tp);
        self
    }

    /// The device block slots of `cache`'s blocks (a new ledger block gets the next slot).
    ///
    /// Errors: more ledger blocks than device slots (the ledger's capacity is the device
    /// cache's, so never).
    fn device_blocks(&mut self, cache: &KvCache) -> Result<Vec<usize>> {
        let n_blocks = self.model.n_blocks;
        cache
            .block_ids()
            .into_iter()
            .map(|id| {
                let next = self.slots.len();
                let slot = *self.slots.entry(id).or_insert(next);
                if slot >= n_blocks {
                    bail!("the KV ledger has more blocks than the device cache ({n_blocks})");
                }
                Ok(slot)
            })
            .collect()
    }

    /// The model on its backend.
    pub fn model(&self) -> &BackendModel<B> {
        &self.model
    }

    /// Starts the entries' new sequences (a sampler, and a ledger cache that adopts the
    /// cached prefix) and checks that the others are known (an import's KV came in before
    /// the step, [`Executor::import_kv`]; a hand-off's goes out after it,
    /// [`Executor::export_kv`]).
    ///
    /// Errors: an import's sequence without its KV, an unknown sequence, a full ledger.
    fn admit(&mut self, entries: &[StepEntry]) -> Result<()> {
        for entry in entries {
            if entry.import.is_some() {
                if !self.sequences.contains_key(&entry.seq) {
                    bail!(
                        "sequence {}: its KV was not imported before its first step (prefill/decode disaggregation runs on rank processes: infer up --prefill N --decode M)",
                        entry.seq
                    );
                }
            } else if let Some(params) = &entry.params {
                let sampler = entry.new_sampler(params);
                self.sequences.remove(&entry.seq);
                // The cached prefix's blocks hold its keys and values already.
                let ledger = first_step_cache(&self.ledger, entry)?;
                let sequence = DeviceSequence {
                    blocks: Vec::new(),
                    n_tokens: ledger.n_tokens,
                };
                self.sequences
                    .insert(entry.seq, (sequence, ledger, sampler));
            } else if !self.sequences.contains_key(&entry.seq) {
                bail!("sequence {} is unknown to the engine", entry.seq);
            }
        }
        Ok(())
    }

    /// One step of `states` (each entry's sequence, ledger cache and sampler, in `entries`'
    /// order): device blocks for the new positions, the stage's forward pass between its
    /// pipeline neighbours, the ledger committed. Gives the logits on the last stage.
    ///
    /// Errors: a full ledger; the forward pass's; the pipeline's.
    fn run_states(
        &mut self,
        states: &mut [SequenceState],
        entries: &[StepEntry],
    ) -> Result<Option<Vec<Vec<f32>>>> {
        for ((sequence, ledger, _), entry) in states.iter_mut().zip(entries) {
            ledger.reserve(sequence.n_tokens + entry.tokens.len())?;
            sequence.blocks = self.device_blocks(ledger)?;
        }
        let n_tokens: usize = entries.iter().map(|e| e.tokens.len()).sum();
        let hidden_in = self.receive_hidden(n_tokens)?;
        let mut batch: Vec<(&mut DeviceSequence, &[u32])> = states
            .iter_mut()
            .zip(entries)
            .map(|((sequence, _, _), entry)| (sequence, entry.tokens.as_slice()))
            .collect();
        let tp = self.tp.as_deref_mut().map(|comm| comm as &mut dyn Comm);
        let logits = match self.model.step_stage(&mut batch, tp, hidden_in)? {
            StageOut::Logits(logits, n_rows) => Some(self.model.download_logits(&logits, n_rows)?),
            StageOut::Hidden(hidden, n) => {
                self.send_hidden(&hidden, n)?;
                None
            }
        };
        // Stored: full blocks go into the prefix cache (when it is on).
        for ((_, ledger, _), entry) in states.iter_mut().zip(entries) {
            ledger.commit(&entry.tokens);
        }
        Ok(logits)
    }

    /// A later stage's input: the previous stage's hidden states for `n_tokens` tokens, over
    /// the GPUs' pipeline communicator when they share one, else through host memory;
    /// `None` on the first stage.
    ///
    /// Errors: a message of another size; the pipeline's.
    fn receive_hidden(&mut self, n_tokens: usize) -> Result<Option<(B::Buffer, usize)>> {
        let Some(pp) = self.pp.as_deref_mut().filter(|pp| pp.rank() > 0) else {
            return Ok(None);
        };
        let values = n_tokens * self.model.config.hidden_size;
        let backend = &self.model.backend;
        let buffer = backend.zeros(values * 4)?;
        if backend.recv_from_stage(&buffer, values, pp.rank() - 1)? {
            return Ok(Some((buffer, n_tokens)));
        }
        let bytes = pp.recv(pp.rank() - 1)?;
        if bytes.len() != values * 4 {
            bail!(
                "the previous pipeline stage sent {} bytes of hidden states for {n_tokens} tokens of {}",
                bytes.len(),
                self.model.config.hidden_size
            );
        }
        Ok(Some((backend.upload(&bytes)?, n_tokens)))
    }

    /// Sends a stage's `(n, hidden_size)` hidden states to the next stage, device to device
    /// when the GPUs share a communicator, else through host memory.
    ///
    /// Errors: no next stage; the pipeline's.
    fn send_hidden(&mut self, hidden: &B::Buffer, n: usize) -> Result<()> {
        let pp = self
            .pp
            .as_deref_mut()
            .context("a pipeline stage before the last has no next stage to send to")?;
        let values = n * self.model.config.hidden_size;
        let backend = &self.model.backend;
        if !backend.send_to_stage(hidden, values, pp.rank() + 1)? {
            pp.send(pp.rank() + 1, &backend.download(hidden, values * 4)?)?;
        }
        Ok(())
    }
}

impl<B> Executor for BackendExecutor<B>
where
    B: Backend + Send,
    B::Buffer: Send,
    B::Matrix: Send,
{
    fn step(&mut self, entries: &[StepEntry], release: &[u64]) -> Result<Vec<Option<Sampled>>> {
        // A sequence's blocks go back to the ledger with its cache (full ones stay in the
        // prefix cache); the device slots are the ledger's to reuse.
        for seq in release {
            self.sequences.remove(seq);
        }
        if entries.is_empty() {
            return Ok(Vec::new());
        }
        self.admit(entries)?;
        // Take each entry's state out so the batch can borrow them all mutably.
        let mut states: Vec<SequenceState> = Vec::new();
        for entry in entries {
            let state = self
                .sequences
                .remove(&entry.seq)
                .with_context(|| format!("sequence {} appears twice in the step", entry.seq))?;
            states.push(state);
        }
        let result = self.run_states(&mut states, entries);
        let sampled = result.map(|logits: Option<Vec<Vec<f32>>>| match logits {
            // A stage before the last samples nothing.
            None => Vec::new(),
            Some(logits) => states
                .iter_mut()
                .zip(&logits)
                .zip(entries)
                .map(|(((_, _, sampler), logits), entry)| {
                    entry.sample.then(|| sample(sampler, logits))
                })
                .collect(),
        });
        for (entry, state) in entries.iter().zip(states) {
            self.sequences.insert(entry.seq, state);
        }
        sampled
    }

    fn import_kv(&mut self, entry: &StepEntry, parts: &[KvTransfer]) -> Result<()> {
        let params = entry
            .params
            .as_ref()
            .with_context(|| format!("sequence {}: an import needs its first step", entry.seq))?;
        let c = &self.model.config;
        let whole = KvTransfer::assemble(parts, self.model.layers.len(), c.n_kv_heads, c.head_dim)?;
        let n_positions = whole.tokens.len();
        let mut ledger = self.ledger.new_cache();
        ledger.prompt_tokens = Some(whole.prompt_tokens);
        ledger.reserve(n_positions)?;
        let mut sequence = DeviceSequence {
            blocks: self.device_blocks(&ledger)?,
            n_tokens: 0,
        };
        self.model
            .write_kv(&mut sequence, n_positions, &whole.values)?;
        // Stored: full blocks go into the prefix cache (when it is on).
        ledger.commit(&whole.tokens);
        let sampler = entry.new_sampler(params);
        self.sequences
            .insert(entry.seq, (sequence, ledger, sampler));
        Ok(())
    }

    fn export_kv(&mut self, seq: u64, from: usize) -> Result<Option<KvTransfer>> {
        let (sequence, ledger, _) = self
            .sequences
            .get(&seq)
            .with_context(|| format!("sequence {seq} is unknown to the engine"))?;
        if from >= ledger.n_tokens {
            return Ok(None);
        }
        let c = &self.model.config;
        Ok(Some(KvTransfer {
            tokens: ledger.tokens()[from..].to_vec(),
            first_position: from,
            prompt_tokens: ledger.prompt_tokens.unwrap_or(ledger.n_tokens),
            layers: 0..self.model.layers.len(),
            n_kv_heads: c.n_kv_heads,
            head_dim: c.head_dim,
            values: self.model.read_kv(sequence, from..ledger.n_tokens)?,
        }))
    }

    fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    fn max_context_tokens(&self) -> usize {
        self.model.config.max_context_tokens
    }

    fn kv_pool(&self) -> &Arc<KvPool> {
        &self.ledger
    }
}

/// How a device model's greedy steps compare with the CPU engine's ([`compare_with_cpu`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Comparison {
    /// Steps compared (the prompt's step, then one per decode step).
    pub steps: usize,
    /// Steps whose CPU top-1 margin exceeds 0.1 (where the tokens must agree).
    pub decided: usize,
    /// Decided steps whose top tokens differ, with `(step, cpu token, device token)`.
    pub disagreements: Vec<(usize, u32, u32)>,
    /// The largest normalized MSE of the device's logits against the CPU's.
    pub worst_nmse: f64,
    /// Every step's device logits, bit for bit (to compare two runs).
    pub device_logits: Vec<Vec<u32>>,
}

/// Runs `prompt` and `steps` greedy decode steps on the CPU engine (`cpu`) and on `device`
/// side by side, each fed the CPU's greedy token (teacher forcing, so one close call does
/// not derail the rest): `infer smoke`'s "greedy tokens equal the CPU engine's where its
/// top-1 margin > 0.1". The device sequence is released after.
///
/// Errors: an empty prompt, either side's forward pass.
pub fn compare_with_cpu<B: Backend>(
    device: &mut BackendModel<B>,
    cpu: &Llama,
    prompt: &[u32],
    steps: usize,
) -> Result<Comparison> {
    compare_with_cpu_tp(device, cpu, prompt, steps, None)
}

/// [`compare_with_cpu`] for a tensor-parallel shard on `device` (every member of `tp` runs
/// it together); `cpu` is the whole model.
///
/// Errors: those of [`compare_with_cpu`], the group's.
pub fn compare_with_cpu_tp<B: Backend>(
    device: &mut BackendModel<B>,
    cpu: &Llama,
    prompt: &[u32],
    steps: usize,
    mut tp: Option<&mut dyn Comm>,
) -> Result<Comparison> {
    use crate::runtime::model::llama::SequenceInput;
    use crate::runtime::model::sampling::argmax;
    if prompt.is_empty() {
        bail!("the prompt has no tokens");
    }
    let mut cache = cpu.new_cache();
    let mut sequence = DeviceSequence::default();
    let mut input = prompt.to_vec();
    let mut comparison = Comparison {
        steps: 0,
        decided: 0,
        disagreements: Vec::new(),
        worst_nmse: 0.0,
        device_logits: Vec::new(),
    };
    let outcome = (|| -> Result<()> {
        for step in 0..=steps {
            let expected = cpu
                .forward(&mut [SequenceInput {
                    tokens: &input,
                    cache: &mut cache,
                    all_logits: false,
                }])?
                .remove(0);
            let got = device
                .forward_tp(
                    &mut [(&mut sequence, &input)],
                    tp.as_mut().map(|c| &mut **c as &mut dyn Comm),
                )?
                .remove(0);
            comparison.worst_nmse = comparison.worst_nmse.max(nmse(&got, &expected));
            comparison.steps += 1;
            let best = argmax(&expected);
            let second = expected
                .iter()
                .enumerate()
                .filter(|(i, _)| *i != best as usize)
                .fold(f32::MIN, |m, (_, v)| m.max(*v));
            if expected[best as usize] - second > 0.1 {
                comparison.decided += 1;
                if argmax(&got) != best {
                    comparison.disagreements.push((step, best, argmax(&got)));
                }
            }
            comparison
                .device_logits
                .push(got.iter().map(|v| v.to_bits()).collect());
            input = vec![best];
        }
        Ok(())
    })();
    device.release(&mut sequence);
    outcome.map(|()| comparison)
}

/// One timed run of [`bench_decode`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DecodeSpeed {
    /// Prompt tokens per second of one sequence's prefill.
    pub prefill_tokens_per_sec: f64,
    /// Tokens of all `batch` sequences per second of decode steps.
    pub decode_tokens_per_sec: f64,
    /// Seconds of one decode step of the whole batch.
    pub decode_step_secs: f64,
    /// Kernel launches (and GEMMs) per decode step, where the backend counts them.
    pub launches_per_step: Option<f64>,
    /// Seconds the host spends issuing one decode step's work (the forward pass up to its
    /// logits, before it waits for them): near `decode_step_secs`, the step is bound by the
    /// host's launches rather than the device.
    pub issue_step_secs: f64,
}

/// `infer bench decode` on a [`BackendModel`]: prefills `prompt` once timed (then again,
/// untimed, for each other sequence of the batch), then runs `decode_tokens` greedy decode
/// steps of `batch` sequences, each step's ids picked on the device (only they come back,
/// which also waits for the step). The sequences are released after.
///
/// Errors: an empty prompt or batch, a cache too small for `batch × (prompt +
/// decode_tokens)` positions, the backend's errors.
pub fn bench_decode<B: Backend>(
    model: &mut BackendModel<B>,
    prompt: &[u32],
    batch: usize,
    decode_tokens: usize,
) -> Result<DecodeSpeed> {
    use std::time::Instant;
    if prompt.is_empty() || batch == 0 {
        bail!("the benchmark needs a prompt and at least one sequence");
    }
    let mut sequences: Vec<DeviceSequence> =
        (0..batch).map(|_| DeviceSequence::default()).collect();
    let outcome = (|| -> Result<DecodeSpeed> {
        let start = Instant::now();
        let first = model.forward_greedy(&mut [(&mut sequences[0], prompt)])?[0];
        let prefill_secs = start.elapsed().as_secs_f64();
        for sequence in sequences.iter_mut().skip(1) {
            model.forward_greedy(&mut [(sequence, prompt)])?;
        }
        let mut next = vec![first; batch];
        let launches_before = model.backend().launches();
        let issued_before = model.issue_secs;
        let start = Instant::now();
        for _ in 0..decode_tokens {
            let inputs: Vec<[u32; 1]> = next.iter().map(|t| [*t]).collect();
            let mut step: Vec<(&mut DeviceSequence, &[u32])> = sequences
                .iter_mut()
                .zip(&inputs)
                .map(|(s, t)| (s, t.as_slice()))
                .collect();
            next = model.forward_greedy(&mut step)?;
        }
        let decode_secs = start.elapsed().as_secs_f64().max(1e-9);
        let launches_per_step = match (launches_before, model.backend().launches()) {
            (Some(before), Some(after)) => {
                Some(after.saturating_sub(before) as f64 / decode_tokens.max(1) as f64)
            }
            _ => None,
        };
        Ok(DecodeSpeed {
            prefill_tokens_per_sec: prompt.len() as f64 / prefill_secs.max(1e-9),
            decode_tokens_per_sec: (batch * decode_tokens) as f64 / decode_secs,
            decode_step_secs: decode_secs / decode_tokens.max(1) as f64,
            launches_per_step,
            issue_step_secs: (model.issue_secs - issued_before) / decode_tokens.max(1) as f64,
        })
    })();
    for sequence in &mut sequences {
        model.release(sequence);
    }
    outcome
}
