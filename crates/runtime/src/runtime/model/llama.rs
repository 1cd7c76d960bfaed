//! The Llama-family decoder (Llama, Mistral, Qwen2 with QKV bias, Qwen3 with QK norm):
//! token embedding, RMSNorm, RoPE, grouped-query attention over a per-sequence KV cache,
//! SwiGLU MLP, tied or untied LM head.
//!
//! [`Llama::forward`] takes a batch of sequences, each with its own new tokens, starting
//! position and cache, so a scheduler can mix prefill and decode in one step.

use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use half::f16;
use rayon::prelude::*;

use crate::runtime::collectives::Comm;
use crate::runtime::cpu::attention::{
    attention_scores, attention_scores_decode, prefetch_rows, round_through_f16,
    weighted_sum_f16_heads, weighted_sum_f16_heads_decode,
};
use crate::runtime::cpu::mathfn::{multiversion, softmax, swiglu};
use crate::runtime::cpu::packed::{GROUP_ROWS, GroupState};
use crate::runtime::cpu::quant::Numerics;
use crate::runtime::cpu::team;
use crate::runtime::formats::gguf::{GgufFile, Value};
pub use crate::runtime::model::config::{Llama3Scaling, LlamaConfig, RopeStyle};
use crate::runtime::model::kv::KvCache;
use crate::runtime::model::kv::KvPool;
pub use crate::runtime::model::moe::{Expert, MoeFfn};
use crate::runtime::model::weights::{Weight, finish_grouped, matmul_many};

/// The sizes a parallel layout must divide, read from a GGUF header alone (no weights).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayoutLimits {
    /// What messages call the model (its file name).
    pub name: String,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    /// The MLP width (`feed_forward_length`).
    pub intermediate_size: usize,
    pub n_layers: usize,
    /// Routed experts per MoE layer (0: dense).
    pub n_experts: usize,
}

impl LayoutLimits {
    /// Reads the limits from a GGUF header; messages call the model `name`.
    ///
    /// Errors: a header without the architecture's head, layer or MLP sizes.
    pub fn from_header(
        header: &crate::runtime::formats::gguf::Header,
        name: &str,
    ) -> Result<LayoutLimits> {
        let arch = header.str("general.architecture")?;
        let int = |name: &str| header.u64(&format!("{arch}.{name}")).map(|v| v as usize);
        let n_heads = int("attention.head_count")?;
        Ok(LayoutLimits {
            name: name.to_string(),
            n_heads,
            n_kv_heads: int("attention.head_count_kv").unwrap_or(n_heads),
            intermediate_size: int("feed_forward_length")?,
            n_layers: int("block_count")?,
            n_experts: int("expert_count").unwrap_or(0),
        })
    }

    /// Whether `tp` ranks can split the model: `tp` divides the heads and the MLP width, and
    /// either divides the KV heads or is a multiple of them (each KV head then replicated on
    /// `tp / n_kv_heads` ranks, as vLLM does).
    pub(crate) fn tp_fits(&self, tp: usize) -> bool {
        tp > 0
            && self.n_heads.is_multiple_of(tp)
            && self.intermediate_size.is_multiple_of(tp)
            && (self.n_kv_heads.is_multiple_of(tp) || tp.is_multiple_of(self.n_kv_heads.max(1)))
    }

    /// Checks a `tp × pp` layout with expert parallelism `ep` before any rank starts.
    ///
    /// Errors: a TP degree that does not split the heads/MLP (the message lists every degree
    /// that does), more stages than layers, `ep` other than 1 or `tp`, experts that `ep`
    /// does not divide.
    pub fn check(&self, tp: usize, pp: usize, ep: usize) -> Result<()> {
        if !self.tp_fits(tp) {
            let valid: Vec<String> = (1..=self.n_heads)
                .filter(|&t| self.tp_fits(t))
                .map(|t| t.to_string())
                .collect();
            bail!(
                "{} has {} attention heads, {} KV heads and an MLP width of {}: tp {tp} does not split them; tp must be one of {}",
                self.name,
                self.n_heads,
                self.n_kv_heads,
                self.intermediate_size,
                valid.join(", ")
            );
        }
        if pp == 0 || pp > self.n_layers {
            bail!(
                "{} has {} layers: pp must be 1 to {} (one layer per stage at least), not {pp}",
                self.name,
                self.n_layers,
                self.n_layers
            );
        }
        if ep != 1 && ep != tp {
            bail!("ep {ep} must be 1 or equal tp ({tp}): experts are sharded over the TP group");
        }
        if ep > 1 && (self.n_experts == 0 || !self.n_experts.is_multiple_of(ep)) {
            bail!(
                "{} has {} experts per layer: ep {ep} must divide them",
                self.name,
                self.n_experts
            );
        }
        Ok(())
    }
}

impl LlamaConfig {
    /// Inverse frequency of each rotary pair (`head_dim / 2` of them), with Llama 3 scaling
    /// applied (Meta's `apply_scaling` in `llama/model.py`) or, for GGUF, `rope_freqs` factors.
    pub fn inv_freqs(&self, freq_factors: Option<&[f32]>) -> Vec<f32> {
        let d = self.head_dim as f32;
        (0..self.head_dim / 2)
            .map(|i| {
                let mut inv = 1.0 / self.rope_theta.powf(2.0 * i as f32 / d);
                if let Some(factors) = freq_factors {
                    inv /= factors[i];
                } else if let Some(s) = self.rope_scaling {
                    let wavelen = 2.0 * std::f32::consts::PI / inv;
                    let low_wavelen = s.original_max_position_embeddings / s.low_freq_factor;
                    let high_wavelen = s.original_max_position_embeddings / s.high_freq_factor;
                    if wavelen > low_wavelen {
                        inv /= s.factor;
                    } else if wavelen >= high_wavelen {
                        let smooth = (s.original_max_position_embeddings / wavelen
                            - s.low_freq_factor)
                            / (s.high_freq_factor - s.low_freq_factor);
                        inv = (1.0 - smooth) * inv / s.factor + smooth * inv;
                    }
                }
                inv
            })
            .collect()
    }
}

/// One decoder layer's weights.
#[derive(Clone, Debug)]
pub struct Layer {
    pub attn_norm: Vec<f32>,
    pub wq: Weight,
    pub wk: Weight,
    pub wv: Weight,
    pub wo: Weight,
    /// Q/K/V biases (Qwen2).
    pub bias_q: Option<Vec<f32>>,
    pub bias_k: Option<Vec<f32>>,
    pub bias_v: Option<Vec<f32>>,
    /// Per-head RMSNorm weights of Q and K, length `head_dim` (Qwen3).
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    pub ffn_norm: Vec<f32>,
    pub w_gate: Weight,
    pub w_up: Weight,
    pub w_down: Weight,
    /// The MoE block replacing the dense MLP (then `w_gate`/`w_up`/`w_down` are empty).
    pub moe: Option<MoeFfn>,
}

/// A whole model (or, later, one rank's shard of it).
#[derive(Clone, Debug)]
pub struct Llama {
    pub config: LlamaConfig,
    pub token_embedding: Weight,
    pub layers: Vec<Layer>,
    pub output_norm: Vec<f32>,
    /// LM head `(vocab_size, hidden_size)`; the token embedding when tied.
    pub output: Weight,
    inv_freqs: Vec<f32>,
    /// `rope_theta^(−2/head_dim)`: the ratio between consecutive pairs' frequencies.
    theta_scale: f32,
    /// Whether `inv_freqs` carries per-pair factors (then angles are not a geometric series).
    has_freq_factors: bool,
    /// Which part of the model this is (the whole model unless [`Llama::shard`] made it).
    pub shard: ShardInfo,
    /// Where this model's sequences keep their keys and values (unbounded unless
    /// [`Llama::set_kv_capacity`] says otherwise).
    kv_pool: Arc<KvPool>,
}

/// The part of a model one rank holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShardInfo {
    /// Tensor-parallel position and degree.
    pub tp_rank: usize,
    pub tp: usize,
    /// First decoder layer held (global index); `layers.len()` layers are held.
    pub first_layer: usize,
    /// Whether this shard embeds tokens (first pipeline stage) and computes logits (last).
    pub is_first: bool,
    pub is_last: bool,
}

/// What a pipeline stage produces.
pub enum StageOutput {
    /// Hidden states `(n_tokens, hidden_size)` of every new token, for the next stage.
    Hidden(Vec<f32>),
    /// Logits per sequence (see [`Llama::forward`]).
    Logits(Vec<Vec<f32>>),
}

/// One sequence of a forward batch: new tokens appended after `cache.n_tokens` positions.
pub struct SequenceInput<'a> {
    pub tokens: &'a [u32],
    pub cache: &'a mut KvCache,
    /// Return logits for every new token instead of only the last.
    pub all_logits: bool,
}

impl Llama {
    /// RoPE's inverse frequency of each pair of a head, `(head_dim / 2)`: `θ^(−2i/head_dim)`
    /// with any Llama-3 scaling and per-pair factors applied.
    pub fn inv_freqs(&self) -> &[f32] {
        &self.inv_freqs
    }

    /// Loads a Llama-family GGUF file.
    ///
    /// Errors: an architecture other than llama/mistral/qwen2/qwen3 (named), a missing
    /// tensor or metadata key, an unsupported tensor type (naming the tensor), or a tensor
    /// whose shape disagrees with the metadata (naming both).
    pub fn from_gguf(file: &Arc<GgufFile>) -> Result<Llama> {
        let config = gguf_config(file)?;
        let c = &config;
        let token_embedding = gguf_matrix(file, "token_embd.weight", c.vocab_size, c.hidden_size)?;
        let layers = (0..c.n_layers)
            .map(|i| gguf_layer(file, c, i))
            .collect::<Result<Vec<Layer>>>()?;
        let output = if file.has_tensor("output.weight") {
            gguf_matrix(file, "output.weight", c.vocab_size, c.hidden_size)?
        } else {
            token_embedding.clone()
        };
        let freq_factors = if file.has_tensor("rope_freqs.weight") {
            Some(gguf_matrix(file, "rope_freqs.weight", 1, c.head_dim / 2)?.to_f32())
        } else {
            None
        };
        let output_norm = gguf_matrix(file, "output_norm.weight", 1, c.hidden_size)?.to_f32();
        Ok(Llama::new(
            config,
            token_embedding,
            layers,
            output_norm,
            output,
            freq_factors.as_deref(),
        ))
    }

    /// Opens a GGUF file and loads it. Errors: see [`GgufFile::open`] and [`Llama::from_gguf`].
    pub fn open_gguf(path: &Path) -> Result<Llama> {
        let file = Arc::new(GgufFile::open(path)?);
        Llama::from_gguf(&file).with_context(|| format!("failed to load `{}`", path.display()))
    }

    /// Assembles a model from its parts; `freq_factors` are GGUF's `rope_freqs` (Llama 3).
    pub fn new(
        config: LlamaConfig,
        token_embedding: Weight,
        layers: Vec<Layer>,
        output_norm: Vec<f32>,
        output: Weight,
        freq_factors: Option<&[f32]>,
    ) -> Llama {
        let inv_freqs = config.inv_freqs(freq_factors);
        let theta_scale = config.rope_theta.powf(-2.0 / config.head_dim as f32);
        Llama {
            token_embedding,
            layers,
            output_norm,
            output,
            inv_freqs,
            theta_scale,
            has_freq_factors: freq_factors.is_some(),
            shard: ShardInfo {
                tp_rank: 0,
                tp: 1,
                first_layer: 0,
                is_first: true,
                is_last: true,
            },
            kv_pool: KvPool::new(config.n_layers, config.n_kv_heads, config.head_dim, None),
            config,
        }
    }

    /// The shard a rank holds: layers `first_layer..first_layer + n_layers` and, with
    /// tensor parallelism, this rank's heads and MLP columns (Megatron-LM): Q/K/V and
    /// gate/up split by output rows, the output and down projections by input columns (then
    /// summed across the TP group); KV heads replicated when `tp` exceeds their number. The
    /// first stage keeps the embedding, the last the final norm and LM head.
    ///
    /// Errors: heads or KV heads that do not divide by `tp`, layers out of range, or a split
    /// that does not fall on quantization-block boundaries (named).
    pub fn shard(
        &self,
        tp_rank: usize,
        tp: usize,
        first_layer: usize,
        n_layers: usize,
    ) -> Result<Llama> {
        let c = &self.config;
        let limits = LayoutLimits {
            name: String::new(),
            n_heads: c.n_heads,
            n_kv_heads: c.n_kv_heads,
            intermediate_size: c.intermediate_size,
            n_layers: c.n_layers,
            n_experts: c.n_experts,
        };
        if tp_rank >= tp || !limits.tp_fits(tp) {
            bail!(
                "tp={tp} does not divide {} heads / {} KV heads / the MLP width {}",
                c.n_heads,
                c.n_kv_heads,
                c.intermediate_size
            );
        }
        if first_layer + n_layers > self.layers.len() || n_layers == 0 {
            bail!(
                "layers {first_layer}..{} are outside the model's {}",
                first_layer + n_layers,
                self.layers.len()
            );
        }
        let cut = TpCut::new(c, tp_rank, tp);
        let layers = self.layers[first_layer..first_layer + n_layers]
            .iter()
            .enumerate()
            .map(|(index, layer)| {
                cut.layer(layer).with_context(|| {
                    format!(
                        "sharding layer {} for tp rank {tp_rank} of {tp}",
                        first_layer + index
                    )
                })
            })
            .collect::<Result<Vec<Layer>>>()?;
        let (heads, kv_heads, width) = (cut.heads, cut.kv_heads, cut.width);
        let mut config = c.clone();
        config.n_heads = heads;
        config.n_kv_heads = kv_heads;
        config.intermediate_size = width;
        config.n_layers = n_layers;
        Ok(Llama {
            kv_pool: KvPool::new(n_layers, kv_heads, config.head_dim, None),
            config,
            token_embedding: self.token_embedding.clone(),
            layers,
            output_norm: self.output_norm.clone(),
            output: if tp > 1 && first_layer + n_layers == self.layers.len() {
                let rows = head_rows(tp_rank, tp, c.vocab_size);
                self.output.rows(rows.start, rows.len())?
            } else {
                self.output.clone()
            },
            inv_freqs: self.inv_freqs.clone(),
            theta_scale: self.theta_scale,
            has_freq_factors: self.has_freq_factors,
            shard: ShardInfo {
                tp_rank,
                tp,
                first_layer,
                is_first: first_layer == 0,
                is_last: first_layer + n_layers == self.layers.len(),
            },
        })
    }

    /// Keeps only the experts of expert-parallel rank `ep_rank` of `ep` (a contiguous range of
    /// `n_experts / ep`) in every MoE layer. Errors: experts that do not divide by `ep`.
    pub fn shard_experts(&mut self, ep_rank: usize, ep: usize) -> Result<()> {
        for layer in &mut self.layers {
            if let Some(moe) = &mut layer.moe {
                let n = moe.experts.len();
                if ep == 0 || n % ep != 0 || ep_rank >= ep {
                    bail!("ep={ep} does not divide {n} experts");
                }
                let (first, count) = (ep_rank * n / ep, n / ep);
                for (e, expert) in moe.experts.iter_mut().enumerate() {
                    if e < first || e >= first + count {
                        *expert = None;
                    }
                }
            }
        }
        Ok(())
    }

    /// Bytes of the matrices this shard uses, in their encodings: its layers' projections
    /// and experts, the embedding on the first stage, the LM head on the last (once when tied).
    pub fn weight_bytes(&self) -> usize {
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                let experts: usize = l.moe.as_ref().map_or(0, |m| {
                    m.router.size_bytes()
                        + m.experts
                            .iter()
                            .flatten()
                            .map(|e| e.gate.size_bytes() + e.up.size_bytes() + e.down.size_bytes())
                            .sum::<usize>()
                });
                [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down]
                    .iter()
                    .map(|w| w.size_bytes())
                    .sum::<usize>()
                    + experts
            })
            .sum();
        let embedding = if self.shard.is_first {
            self.token_embedding.size_bytes()
        } else {
            0
        };
        let tied = std::ptr::eq(
            self.output.row(0).as_ptr(),
            self.token_embedding.row(0).as_ptr(),
        );
        let head = if self.shard.is_last && !(tied && self.shard.is_first) {
            self.output.size_bytes()
        } else {
            0
        };
        layers + embedding + head
    }

    /// Packs every matrix the forward pass multiplies with ([`Weight::pack`]), in parallel
    /// on the current rayon pool, so the first request does not pay for it. The LM head is
    /// packed only on the last pipeline stage, which is the only one to use it.
    pub fn pack_weights(&self) {
        let mut weights: Vec<&Weight> = Vec::new();
        for layer in &self.layers {
            weights.extend([&layer.wq, &layer.wk, &layer.wv, &layer.wo]);
            weights.extend([&layer.w_gate, &layer.w_up, &layer.w_down]);
            if let Some(moe) = &layer.moe {
                weights.push(&moe.router);
                for expert in moe.experts.iter().flatten() {
                    weights.extend([&expert.gate, &expert.up, &expert.down]);
                }
            }
        }
        if self.shard.is_last {
            weights.push(&self.output);
        }
        weights.par_iter().for_each(|w| w.pack());
    }

    /// Sets how every matrix product of the forward pass rounds (see [`Numerics`]); every
    /// rank of a run must use the same, which the launcher sees to.
    pub fn set_numerics(&mut self, numerics: Numerics) {
        for layer in &mut self.layers {
            for w in [&mut layer.wq, &mut layer.wk, &mut layer.wv, &mut layer.wo] {
                w.set_numerics(numerics);
            }
            for w in [&mut layer.w_gate, &mut layer.w_up, &mut layer.w_down] {
                w.set_numerics(numerics);
            }
            if let Some(moe) = &mut layer.moe {
                moe.router.set_numerics(numerics);
                for expert in moe.experts.iter_mut().flatten() {
                    for w in [&mut expert.gate, &mut expert.up, &mut expert.down] {
                        w.set_numerics(numerics);
                    }
                }
            }
        }
        self.output.set_numerics(numerics);
    }

    /// Attention arithmetic one token of context adds to a decode step of one sequence in
    /// this shard: each query head's score against the cached key and its share of the
    /// weighted sum of values, `2 · head_dim` multiply-adds, in each layer (a shard's
    /// `config` holds its own heads) — `4 · n_heads · head_dim` flops per layer, the
    /// planner's count. Flops.
    pub fn attention_flops_per_token(&self) -> usize {
        4 * self.layers.len() * self.config.n_heads * self.config.head_dim
    }

    /// Weight bytes one decode step of one sequence reads: every layer's attention
    /// matrices, its dense MLP or its router and `top_k` of its experts (the ones held),
    /// and the LM head; the token embedding only looks up a row. Bytes.
    pub fn decode_weight_bytes(&self) -> usize {
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                let attention = [&l.wq, &l.wk, &l.wv, &l.wo]
                    .iter()
                    .map(|w| w.size_bytes())
                    .sum::<usize>();
                let ffn = match &l.moe {
                    Some(moe) => {
                        let held: Vec<usize> = moe
                            .experts
                            .iter()
                            .flatten()
                            .map(|e| e.gate.size_bytes() + e.up.size_bytes() + e.down.size_bytes())
                            .collect();
                        let per_expert = held.iter().sum::<usize>() / held.len().max(1);
                        moe.router.size_bytes() + per_expert * moe.top_k.min(held.len())
                    }
                    None => l.w_gate.size_bytes() + l.w_up.size_bytes() + l.w_down.size_bytes(),
                };
                attention + ffn
            })
            .sum();
        let head = if self.shard.is_last {
            self.output.size_bytes()
        } else {
            0
        };
        layers + head
    }

    /// A fresh cache for one sequence, drawing blocks from the model's pool.
    pub fn new_cache(&self) -> KvCache {
        self.kv_pool.new_cache()
    }

    /// The pool this model's caches draw from.
    pub fn kv_pool(&self) -> &Arc<KvPool> {
        &self.kv_pool
    }

    /// Gives the model a new pool holding at most `capacity_tokens` positions (`None`: no
    /// limit). Caches made before keep their old pool.
    pub fn set_kv_capacity(&mut self, capacity_tokens: Option<usize>) {
        self.kv_pool = KvPool::new(
            self.layers.len(),
            self.config.n_kv_heads,
            self.config.head_dim,
            capacity_tokens,
        );
    }

    /// Runs the new tokens of every sequence through the model, appending their keys and
    /// values to each sequence's cache, and returns logits `(vocab_size)` for the last new
    /// token of each sequence (or for all of them when `all_logits`), in batch order.
    ///
    /// Errors: an empty sequence, a token id outside the vocabulary, or a sequence that
    /// would exceed `max_context_tokens`.
    pub fn forward(&self, batch: &mut [SequenceInput<'_>]) -> Result<Vec<Vec<f32>>> {
        match self.forward_stage(None, batch, None, None)? {
            StageOutput::Logits(logits) => Ok(logits),
            StageOutput::Hidden(_) => {
                bail!("this shard is not the last pipeline stage; use `forward_stage`")
            }
        }
    }

    /// One pipeline stage of [`Llama::forward`] on this shard: the first stage embeds the
    /// batch's tokens, later ones take `hidden_in` (`(n_tokens, hidden_size)` from the
    /// previous stage); with `tp`, the output and down projections are summed across the TP
    /// group (every member of which must call this with the same batch); with `ep`, MoE
    /// layers exchange token rows with the experts' owners in the EP group. The last stage
    /// returns logits, others hidden states.
    ///
    /// Errors: those of [`Llama::forward`], a missing or mis-sized `hidden_in`, a failed
    /// collective.
    pub fn forward_stage(
        &self,
        hidden_in: Option<&[f32]>,
        batch: &mut [SequenceInput<'_>],
        tp: Option<&mut dyn Comm>,
        ep: Option<&mut dyn Comm>,
    ) -> Result<StageOutput> {
        self.forward_stage_observed(hidden_in, batch, tp, ep, &mut |_, _| {})
    }

    /// [`Llama::forward_stage`], calling `stored(layer, batch)` as soon as each layer (an
    /// index among this shard's layers) has stored the batch's new keys and values — at
    /// positions `cache.n_tokens..cache.n_tokens + tokens.len()` of each sequence, not yet
    /// committed ([`KvCache::export_pending`] reads them) — so that they can be sent on
    /// while the later layers compute (prefill/decode disaggregation).
    ///
    /// Errors: those of [`Llama::forward_stage`].
    pub fn forward_stage_observed(
        &self,
        hidden_in: Option<&[f32]>,
        batch: &mut [SequenceInput<'_>],
        mut tp: Option<&mut dyn Comm>,
        mut ep: Option<&mut dyn Comm>,
        stored: &mut dyn FnMut(usize, &[SequenceInput<'_>]),
    ) -> Result<StageOutput> {
        let positions = self.check_and_reserve(batch)?;
        let tokens: Vec<u32> = batch
            .iter()
            .flat_map(|s| s.tokens.iter().copied())
            .collect();
        let mut x = self.stage_input(hidden_in, &tokens)?;
        let mut scratch = Scratch::new(&self.config, tokens.len());
        for (layer_idx, layer) in self.layers.iter().enumerate() {
            self.store_layer_kv(layer_idx, &x, &positions, batch, &mut scratch)?;
            stored(layer_idx, batch);
            self.attend_layer(layer_idx, &mut x, batch, &mut scratch, &mut tp)?;
            self.ffn_layer(layer, &mut x, &mut scratch, &mut tp, &mut ep)?;
        }
        for sequence in batch.iter_mut() {
            sequence.cache.commit(sequence.tokens);
        }
        if !self.shard.is_last {
            return Ok(StageOutput::Hidden(x));
        }
        Ok(StageOutput::Logits(self.head_logits(&x, batch, &mut tp)?))
    }

    /// Checks that every sequence brings new tokens that fit the context, then takes every
    /// KV block the step needs before computing anything, so a full pool fails the step
    /// cleanly (the scheduler preempts and retries). Gives each new token's position.
    ///
    /// Errors: a sequence without new tokens or past the context (named); a full pool.
    fn check_and_reserve(&self, batch: &mut [SequenceInput<'_>]) -> Result<Vec<usize>> {
        let c = &self.config;
        let mut positions = Vec::new();
        for (index, sequence) in batch.iter().enumerate() {
            if sequence.tokens.is_empty() {
                bail!("sequence {index} of the batch has no new tokens");
            }
            if sequence.cache.n_tokens + sequence.tokens.len() > c.max_context_tokens {
                bail!(
                    "sequence {index} would reach {} tokens; the model's context is {}",
                    sequence.cache.n_tokens + sequence.tokens.len(),
                    c.max_context_tokens
                );
            }
            positions.extend((0..sequence.tokens.len()).map(|i| sequence.cache.n_tokens + i));
        }
        for sequence in batch.iter_mut() {
            let total = sequence.cache.n_tokens + sequence.tokens.len();
            sequence.cache.reserve(total)?;
        }
        Ok(positions)
    }

    /// The stage's input, `(n_tokens, hidden_size)`: the first stage's embedding of
    /// `tokens`, a later stage's copy of `hidden_in`.
    ///
    /// Errors: `hidden_in` missing or mis-sized on a later stage; a token outside the
    /// vocabulary.
    fn stage_input(&self, hidden_in: Option<&[f32]>, tokens: &[u32]) -> Result<Vec<f32>> {
        let (c, n) = (&self.config, tokens.len());
        let hidden = c.hidden_size;
        let mut x = vec![0f32; n * hidden];
        if !self.shard.is_first {
            let input = hidden_in
                .context("a later pipeline stage needs the previous stage's hidden states")?;
            if input.len() != x.len() {
                bail!(
                    "stage input has {} values, expected {} tokens × {hidden}",
                    input.len(),
                    n
                );
            }
            x.copy_from_slice(input);
        }
        for (row, &token) in x
            .chunks_exact_mut(hidden)
            .zip(tokens)
            .filter(|_| self.shard.is_first)
        {
            if token as usize >= c.vocab_size {
                bail!(
                    "token id {token} is outside the vocabulary of {}",
                    c.vocab_size
                );
            }
            self.token_embedding.dequantize_row(token as usize, row);
        }
        Ok(x)
    }

    /// Layer `layer_idx`'s attention inputs from the residual `x`: RMSNorm, Q/K/V (biases,
    /// per-head norms), RoPE at `positions`; the batch's new keys and values are stored in
    /// each sequence's cache (not yet committed), and Q stays in `s.q`.
    ///
    /// Errors: a KV store past the reserved blocks.
    fn store_layer_kv(
        &self,
        layer_idx: usize,
        x: &[f32],
        positions: &[usize],
        batch: &mut [SequenceInput<'_>],
        s: &mut Scratch,
    ) -> Result<()> {
        let (c, layer, n) = (&self.config, &self.layers[layer_idx], positions.len());
        let (q_dim, kv_dim) = (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
        rms_norm_tokens(x, &layer.attn_norm, c.rms_norm_eps, &mut s.normed);
        matmul_many(
            &[&layer.wq, &layer.wk, &layer.wv],
            &s.normed,
            n,
            &mut [&mut s.q, &mut s.k, &mut s.v],
        );
        add_bias(&mut s.q, layer.bias_q.as_deref());
        add_bias(&mut s.k, layer.bias_k.as_deref());
        add_bias(&mut s.v, layer.bias_v.as_deref());
        if let Some(weight) = &layer.q_norm {
            rms_norm(&s.q.clone(), weight, c.rms_norm_eps, &mut s.q);
        }
        if let Some(weight) = &layer.k_norm {
            rms_norm(&s.k.clone(), weight, c.rms_norm_eps, &mut s.k);
        }
        for (t, &position) in positions.iter().enumerate() {
            self.rope(&mut s.q[t * q_dim..(t + 1) * q_dim], position);
            self.rope(&mut s.k[t * kv_dim..(t + 1) * kv_dim], position);
        }
        // Append this layer's keys and values, then attend: one parallel region over
        // every (token, head) of the batch.
        let mut offset = 0;
        for sequence in batch.iter_mut() {
            let count = sequence.tokens.len();
            let cache = &mut *sequence.cache;
            cache.store(
                layer_idx,
                cache.n_tokens,
                &s.k[offset * kv_dim..(offset + count) * kv_dim],
                &s.v[offset * kv_dim..(offset + count) * kv_dim],
            )?;
            offset += count;
        }
        Ok(())
    }

    /// Layer `layer_idx`'s attention over each sequence's cache (its new positions stored
    /// by [`Llama::store_layer_kv`]) and the output projection (summed over `tp`) added into
    /// the residual `x`.
    ///
    /// Errors: a failed collective.
    fn attend_layer(
        &self,
        layer_idx: usize,
        x: &mut [f32],
        batch: &[SequenceInput<'_>],
        s: &mut Scratch,
        tp: &mut Option<&mut dyn Comm>,
    ) -> Result<()> {
        let layer = &self.layers[layer_idx];
        let n = x.len() / self.config.hidden_size;
        let spans: Vec<(usize, &KvCache, bool)> = batch
            .iter()
            .flat_map(|s| {
                let prompt = s.cache.prompt_tokens.unwrap_or(s.tokens.len());
                (0..s.tokens.len()).map(move |i| {
                    let position = s.cache.n_tokens + i;
                    (position, &*s.cache, prompt == 1 || position >= prompt)
                })
            })
            .collect();
        self.attend(&s.q, &spans, layer_idx, &mut s.attention);
        row_parallel(
            &layer.wo,
            &s.attention,
            n,
            &mut s.projected,
            tp.as_deref_mut(),
        )?;
        for (a, b) in x.iter_mut().zip(&s.projected) {
            *a += b;
        }
        Ok(())
    }

    /// A layer's feed-forward half on the residual `x`: RMSNorm, then SwiGLU and the down
    /// projection (summed over `tp`), or the MoE block (tokens exchanged over `ep`), added
    /// into `x`.
    ///
    /// Errors: a failed collective.
    fn ffn_layer(
        &self,
        layer: &Layer,
        x: &mut [f32],
        s: &mut Scratch,
        tp: &mut Option<&mut dyn Comm>,
        ep: &mut Option<&mut dyn Comm>,
    ) -> Result<()> {
        let c = &self.config;
        let n = x.len() / c.hidden_size;
        rms_norm_tokens(x, &layer.ffn_norm, c.rms_norm_eps, &mut s.normed);
        if let Some(moe) = &layer.moe {
            // Expert outputs are complete on every rank: no TP all-reduce here.
            let out = crate::runtime::model::moe::forward(moe, &s.normed, n, ep.as_deref_mut())?;
            for (a, b) in x.iter_mut().zip(&out) {
                *a += b;
            }
            return Ok(());
        }
        matmul_many(
            &[&layer.w_gate, &layer.w_up],
            &s.normed,
            n,
            &mut [&mut s.gate, &mut s.up],
        );
        let width = c.intermediate_size;
        if n > 1 {
            let up = &s.up;
            team::for_each_chunk_mut(&mut s.gate, width, |t, gate| {
                swiglu(gate, &up[t * width..(t + 1) * width])
            });
        } else {
            swiglu(&mut s.gate, &s.up);
        }
        row_parallel(
            &layer.w_down,
            &s.gate,
            n,
            &mut s.projected,
            tp.as_deref_mut(),
        )?;
        for (a, b) in x.iter_mut().zip(&s.projected) {
            *a += b;
        }
        Ok(())
    }

    /// The last stage's logits for the rows each sequence asks for (every new token's with
    /// `all_logits`, else its last): those rows of `x` normed and through the LM head, the
    /// largest matrix, so only them. With `tp`, the head is vocab-parallel (Megatron's
    /// parallel LM head): this shard computes its rows of the vocabulary ([`head_rows`]) and
    /// the TP group all-gathers them, so every member returns whole rows.
    ///
    /// Errors: a failed all-gather.
    fn head_logits(
        &self,
        x: &[f32],
        batch: &[SequenceInput<'_>],
        tp: &mut Option<&mut dyn Comm>,
    ) -> Result<Vec<Vec<f32>>> {
        let c = &self.config;
        let hidden = c.hidden_size;
        let mut rows = Vec::new();
        let mut offset = 0;
        for sequence in batch.iter() {
            let count = sequence.tokens.len();
            if sequence.all_logits {
                rows.extend(offset..offset + count);
            } else {
                rows.push(offset + count - 1);
            }
            offset += count;
        }
        let mut selected = vec![0f32; rows.len() * hidden];
        for (out, &row) in selected.chunks_exact_mut(hidden).zip(&rows) {
            out.copy_from_slice(&x[row * hidden..(row + 1) * hidden]);
        }
        let mut final_normed = vec![0f32; selected.len()];
        rms_norm(
            &selected,
            &self.output_norm,
            c.rms_norm_eps,
            &mut final_normed,
        );
        // (Not `vec![row; n]`, which would copy the first row into every other.)
        let mut logits: Vec<Vec<f32>> = rows
            .iter()
            .map(|_| vec![0f32; self.output.n_rows])
            .collect();
        self.output.matmul_per_token(&final_normed, &mut logits);
        match tp {
            Some(comm) if self.shard.tp > 1 => gather_vocab(*comm, &logits, c.vocab_size),
            None if self.shard.tp > 1 => bail!(
                "TP rank {} of {} holds rows {:?} of the LM head: its logits need its TP group",
                self.shard.tp_rank,
                self.shard.tp,
                head_rows(self.shard.tp_rank, self.shard.tp, c.vocab_size)
            ),
            _ => Ok(logits),
        }
    }

    /// Rotates every head of `x` (`(n_heads_in_x, head_dim)`) for `position`. Angles are
    /// `position · θ^i` built by repeated multiplication in f32, as ggml's rope cache does.
    fn rope(&self, x: &mut [f32], position: usize) {
        let head_dim = self.config.head_dim;
        let half = head_dim / 2;
        let mut angles = Vec::with_capacity(half);
        let mut theta = position as f32;
        for (i, inv) in self.inv_freqs.iter().enumerate() {
            if i == 0 || self.config.rope_scaling.is_some() || self.has_freq_factors {
                theta = position as f32 * inv;
            }
            angles.push(theta.sin_cos());
            theta *= self.theta_scale;
        }
        rotate_pairs(
            x,
            head_dim,
            &angles,
            self.config.rope_style == RopeStyle::Neox,
        );
    }

    /// Causal attention of `q` (`(n_tokens, n_heads · head_dim)`) over `layer` of the
    /// caches: token `t` sits at position `tokens[t].0` of cache `tokens[t].1` (paged) and
    /// attends to positions `0..=tokens[t].0`. One parallel region over every (token, KV
    /// head); the query heads sharing a KV head (GQA) read each cached row once.
    ///
    /// `tokens[t].2` says the token was (or is recomputed as) a decode step of one token:
    /// llama.cpp sums `kq` and `kqv` in another order then (`ggml_vec_dot_f16`, 32 lane
    /// classes; for a prompt of two or more tokens, tinyBLAS's 8). Each sequence follows the
    /// order llama.cpp uses for it alone ([`KvCache::prompt_tokens`]), so results never
    /// depend on what else is in the batch or on preemption.
    fn attend(&self, q: &[f32], tokens: &[(usize, &KvCache, bool)], layer: usize, out: &mut [f32]) {
        let c = &self.config;
        let (head_dim, q_dim) = (c.head_dim, c.n_heads * c.head_dim);
        let group = c.n_heads / c.n_kv_heads;
        let scale = 1.0 / (head_dim as f32).sqrt();
        thread_local! {
            /// Per-thread scratch: the rounded query and the scores.
            static SCRATCH: std::cell::RefCell<AttendScratch> = Default::default();
        }
        team::for_each_chunk_mut(out, group * head_dim, |index, out_heads| {
            SCRATCH.with_borrow_mut(|scratch| {
                let AttendScratch { query, scores } = scratch;
                let (t, kv_head) = (index / c.n_kv_heads, index % c.n_kv_heads);
                let (position, cache, single) = tokens[t];
                let n_positions = position + 1;
                // `kq`: Q rounded to f16 (the cache's type), dotted with each cached key.
                query.clear();
                query.extend_from_slice(
                    &q[t * q_dim + kv_head * group * head_dim..][..group * head_dim],
                );
                round_through_f16(query);
                let values: Vec<&[f16]> = (0..n_positions)
                    .map(|p| cache.value(layer, kv_head, p))
                    .collect();
                prefetch_rows(&values);
                let keys: Vec<&[f16]> = (0..n_positions)
                    .map(|p| cache.key(layer, kv_head, p))
                    .collect();
                scores.clear();
                scores.resize(group * n_positions, 0.0);
                if single {
                    attention_scores_decode(&keys, query, scale, scores);
                } else {
                    attention_scores(&keys, query, scale, scores);
                }
                for head_scores in scores.chunks_exact_mut(n_positions) {
                    softmax(head_scores);
                }
                // `kqv`: probabilities rounded to f16, weighted sum of the cached values.
                if single {
                    weighted_sum_f16_heads_decode(scores, &values, out_heads, group);
                } else {
                    weighted_sum_f16_heads(scores, &values, out_heads, group);
                }
            })
        });
    }
}

/// One attention task's buffers, kept per thread between tasks.
#[derive(Default)]
struct AttendScratch {
    query: Vec<f32>,
    scores: Vec<f32>,
}

/// The rows of the LM head (vocabulary entries) TP rank `tp_rank` of `tp` computes:
/// contiguous, sizes differing by at most one.
pub fn head_rows(tp_rank: usize, tp: usize, vocab_size: usize) -> std::ops::Range<usize> {
    crate::runtime::collectives::chunk(tp_rank, tp, vocab_size)
}

/// Whole logits rows `(n_rows, vocab_size)` from every TP member's vocabulary slice
/// (`local`: `(n_rows, head_rows(rank))`): one all-gather of the slices, each padded to the
/// largest. Errors: the collective's.
pub(crate) fn gather_vocab(
    comm: &mut dyn Comm,
    local: &[Vec<f32>],
    vocab_size: usize,
) -> Result<Vec<Vec<f32>>> {
    let size = comm.size();
    let widest = vocab_size.div_ceil(size);
    let mut send = vec![0f32; local.len() * widest];
    for (out, row) in send.chunks_exact_mut(widest).zip(local) {
        out[..row.len()].copy_from_slice(row);
    }
    let mut gathered = vec![0f32; size * send.len()];
    comm.all_gather(&send, &mut gathered)?;
    let mut logits = vec![vec![0f32; vocab_size]; local.len()];
    for (member, part) in gathered.chunks_exact(send.len()).enumerate() {
        let columns = head_rows(member, size, vocab_size);
        for (row, slice) in logits.iter_mut().zip(part.chunks_exact(widest)) {
            row[columns.clone()].copy_from_slice(&slice[..columns.len()]);
        }
    }
    Ok(logits)
}

/// A row-parallel projection `out = input · Wᵀ` (`input`: `(n_tokens, n_cols)` of this
/// shard's columns; `out`: `(n_tokens, n_rows)`), summed over the TP group.
///
/// With an integer kernel (`Q4_0`, `Q4_1`, `Q8_0`), the sum is exact-order: TP rank 0
/// starts every dot product, each next rank continues the accumulators it receives over
/// its own blocks, and the last finishes them and broadcasts the result. That is bit for
/// bit the single-process dot product (the shards split at block boundaries and quantize
/// their activations into the same blocks), so TP layouts generate exactly the tokens of one
/// process — at the price of running the row-parallel halves one rank after another. Other
/// types are summed with a ring all-reduce (a different rounding order, like every NCCL TP).
///
/// Errors: a failed collective.
fn row_parallel(
    weight: &Weight,
    input: &[f32],
    n_tokens: usize,
    out: &mut [f32],
    tp: Option<&mut (dyn Comm + '_)>,
) -> Result<()> {
    let Some(comm) = tp else {
        weight.matmul(input, n_tokens, out);
        return Ok(());
    };
    if !crate::runtime::cpu::quant::has_q8_kernel(weight.ty) {
        weight.matmul(input, n_tokens, out);
        return comm.all_reduce_sum(out);
    }
    let (rank, size) = (comm.rank(), comm.size());
    let count = weight.n_rows.div_ceil(GROUP_ROWS) * n_tokens;
    let mut states: Vec<GroupState> = vec![[[0.0; GROUP_ROWS]; 9]; count];
    if rank > 0 {
        comm.recv_into(rank - 1, bytemuck::cast_slice_mut(&mut states))
            .with_context(|| format!("tp rank {rank}: receiving the partial sums"))?;
    }
    weight.matmul_continue_grouped(input, n_tokens, &mut states)?;
    let last = size - 1;
    let mut result = Vec::new();
    if rank < last {
        comm.send(rank + 1, bytemuck::cast_slice(&states))?;
    } else {
        finish_grouped(&states, weight.n_rows, n_tokens, out);
        result = bytemuck::cast_slice(out).to_vec();
    }
    comm.broadcast(&mut result, last)?;
    if result.len() != out.len() * 4 {
        bail!(
            "tp rank {last}: broadcast {} bytes of sums, expected {}",
            result.len(),
            out.len() * 4
        );
    }
    for (o, b) in out.iter_mut().zip(result.chunks_exact(4)) {
        *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
    Ok(())
}

multiversion! {
    /// Rotates every `head_dim`-wide head of `x` by `angles` (`(head_dim / 2)` of
    /// `(sin, cos)`): pairs `(2i, 2i + 1)` (interleaved), or `(i, i + head_dim / 2)` (NeoX).
    fn rotate_pairs(x: &mut [f32], head_dim: usize, angles: &[(f32, f32)], neox: bool) {
        let half = head_dim / 2;
        for head in x.chunks_exact_mut(head_dim) {
            for (i, (sin, cos)) in angles.iter().enumerate() {
                let (a, b) = if neox { (i, i + half) } else { (2 * i, 2 * i + 1) };
                let (x0, x1) = (head[a], head[b]);
                // GCC contracts ggml's `x0*cos - x1*sin` into an FMA (`-ffp-contract=fast`).
                head[a] = x0.mul_add(*cos, -(x1 * sin));
                head[b] = x0.mul_add(*sin, x1 * cos);
            }
        }
    }
}

/// RMSNorm of each `weight.len()`-wide row of `x` into `out`: `x / √(mean(x²) + eps) · weight`.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let width = weight.len();
    for (row, out_row) in x.chunks_exact(width).zip(out.chunks_exact_mut(width)) {
        // ggml sums the squares in f64 (`ggml_float`).
        let mean_square = (row.iter().map(|&v| (v * v) as f64).sum::<f64>() / width as f64) as f32;
        let scale = 1.0 / (mean_square + eps).sqrt();
        for ((o, v), w) in out_row.iter_mut().zip(row).zip(weight) {
            *o = v * scale * w;
        }
    }
}

/// [`rms_norm`] with the tokens (rows) of a batch in parallel; the same bits.
fn rms_norm_tokens(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let width = weight.len();
    if x.len() > width {
        team::for_each_chunk_mut(out, width, |t, out| {
            rms_norm(&x[t * width..(t + 1) * width], weight, eps, out)
        });
    } else {
        rms_norm(x, weight, eps, out);
    }
}

fn add_bias(x: &mut [f32], bias: Option<&[f32]>) {
    if let Some(bias) = bias {
        for row in x.chunks_exact_mut(bias.len()) {
            for (v, b) in row.iter_mut().zip(bias) {
                *v += b;
            }
        }
    }
}
/// Where TP rank `tp_rank` of `tp` cuts a layer (Megatron): its query heads, its KV heads
/// (replicated when there are fewer than `tp`), its slice of the dense MLP.
struct TpCut {
    tp_rank: usize,
    head_dim: usize,
    /// Query heads per rank.
    heads: usize,
    /// This rank's first KV head and how many it holds.
    kv_first: usize,
    kv_heads: usize,
    /// The dense MLP's intermediate columns per rank.
    width: usize,
}

impl TpCut {
    /// The cut of `c` for `tp_rank` of `tp` (degrees already checked to divide).
    fn new(c: &LlamaConfig, tp_rank: usize, tp: usize) -> TpCut {
        let heads = c.n_heads / tp;
        let (kv_first, kv_heads) = if c.n_kv_heads >= tp {
            (tp_rank * c.n_kv_heads / tp, c.n_kv_heads / tp)
        } else {
            // Replicated: the one KV head this rank's query heads read.
            (tp_rank * heads / (c.n_heads / c.n_kv_heads), 1)
        };
        TpCut {
            tp_rank,
            head_dim: c.head_dim,
            heads,
            kv_first,
            kv_heads,
            width: c.intermediate_size / tp,
        }
    }

    /// `layer`'s shard: Q/K/V by rows and the output projection by columns at this rank's
    /// heads, the dense MLP's gate/up by rows and down by columns; MoE layers keep whole
    /// experts (expert parallelism splits them instead).
    ///
    /// Errors: a slice outside a matrix.
    fn layer(&self, layer: &Layer) -> Result<Layer> {
        let (hd, heads, kv_first, kv_heads) =
            (self.head_dim, self.heads, self.kv_first, self.kv_heads);
        let (q_first, width) = (self.tp_rank * heads * hd, self.width);
        let slice = |v: &Option<Vec<f32>>, first: usize, n: usize| {
            v.as_ref().map(|v| v[first..first + n].to_vec())
        };
        let mlp_shard = |weight: &Weight, by_rows: bool| -> Result<Weight> {
            if layer.moe.is_some() {
                Ok(weight.clone())
            } else if by_rows {
                weight.rows(self.tp_rank * width, width)
            } else {
                weight.cols(self.tp_rank * width, width)
            }
        };
        Ok(Layer {
            attn_norm: layer.attn_norm.clone(),
            wq: layer.wq.rows(q_first, heads * hd)?,
            wk: layer.wk.rows(kv_first * hd, kv_heads * hd)?,
            wv: layer.wv.rows(kv_first * hd, kv_heads * hd)?,
            wo: layer.wo.cols(q_first, heads * hd)?,
            bias_q: slice(&layer.bias_q, q_first, heads * hd),
            bias_k: slice(&layer.bias_k, kv_first * hd, kv_heads * hd),
            bias_v: slice(&layer.bias_v, kv_first * hd, kv_heads * hd),
            q_norm: layer.q_norm.clone(),
            k_norm: layer.k_norm.clone(),
            ffn_norm: layer.ffn_norm.clone(),
            w_gate: mlp_shard(&layer.w_gate, true)?,
            w_up: mlp_shard(&layer.w_up, true)?,
            w_down: mlp_shard(&layer.w_down, false)?,
            moe: layer.moe.clone(),
        })
    }
}

/// A GGUF file's [`LlamaConfig`] from its `{arch}.*` metadata and the embedding's shape.
///
/// Errors: an architecture other than llama/mistral/qwen2/qwen3 (named), a missing key.
fn gguf_config(file: &GgufFile) -> Result<LlamaConfig> {
    let header = &file.header;
    let arch = header.str("general.architecture")?;
    if !matches!(arch, "llama" | "mistral" | "qwen2" | "qwen3") {
        bail!(
            "unsupported architecture `{arch}`: the engine runs llama, mistral, qwen2 and qwen3 GGUF files"
        );
    }
    let key = |name: &str| format!("{arch}.{name}");
    let int = |name: &str| header.u64(&key(name)).map(|v| v as usize);
    let float = |name: &str, default: f32| match header.metadata.get(&key(name)) {
        Some(Value::F32(v)) => *v,
        Some(Value::F64(v)) => *v as f32,
        _ => default,
    };
    let hidden_size = int("embedding_length")?;
    let n_heads = int("attention.head_count")?;
    let n_kv_heads = int("attention.head_count_kv").unwrap_or(n_heads);
    let head_dim = int("attention.key_length").unwrap_or(hidden_size / n_heads.max(1));
    let (embedding_info, _) = file.tensor("token_embd.weight")?;
    Ok(LlamaConfig {
        hidden_size,
        intermediate_size: int("feed_forward_length")?,
        n_layers: int("block_count")?,
        n_heads,
        n_kv_heads,
        head_dim,
        vocab_size: embedding_info.dims.get(1).copied().unwrap_or(0) as usize,
        rms_norm_eps: float("attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta: float("rope.freq_base", 10_000.0),
        // llama.cpp's converter permutes Llama/Mistral Q/K for adjacent-pair RoPE; Qwen
        // checkpoints are converted unpermuted and use NeoX-style RoPE.
        rope_style: if matches!(arch, "qwen2" | "qwen3") {
            RopeStyle::Neox
        } else {
            RopeStyle::Interleaved
        },
        rope_scaling: None,
        max_context_tokens: int("context_length").unwrap_or(4096),
        n_experts: int("expert_count").unwrap_or(0),
        n_experts_used: int("expert_used_count").unwrap_or(0),
    })
}

/// Tensor `name` of `file` as a `rows × cols` [`Weight`] (a vector is one row).
///
/// Errors: a missing tensor, an unsupported type (naming the tensor), a shape that
/// disagrees with the metadata (naming both).
fn gguf_matrix(file: &Arc<GgufFile>, name: &str, rows: usize, cols: usize) -> Result<Weight> {
    let weight = Weight::from_gguf(file, name)?;
    if (weight.n_rows, weight.n_cols) != (rows, cols) {
        bail!(
            "tensor `{name}` is {}×{} but the metadata implies {rows}×{cols}",
            weight.n_rows,
            weight.n_cols
        );
    }
    Ok(weight)
}

/// Decoder layer `i` of a GGUF file (`blk.{i}.*`): norms, attention, the optional Q/K/V
/// biases and Q/K norms, and a dense MLP or an MoE block (when `ffn_gate_inp` is there).
///
/// Errors: those of [`gguf_matrix`] for a required tensor; the MoE block's.
fn gguf_layer(file: &Arc<GgufFile>, c: &LlamaConfig, i: usize) -> Result<Layer> {
    let (q_dim, kv_dim) = (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
    let name = |suffix: &str| format!("blk.{i}.{suffix}");
    let matrix =
        |suffix: &str, rows: usize, cols: usize| gguf_matrix(file, &name(suffix), rows, cols);
    let vector =
        |suffix: &str, len: usize| -> Result<Vec<f32>> { Ok(matrix(suffix, 1, len)?.to_f32()) };
    let optional = |suffix: &str, len: usize| -> Result<Option<Vec<f32>>> {
        if file.has_tensor(&name(suffix)) {
            vector(suffix, len).map(Some)
        } else {
            Ok(None)
        }
    };
    let moe = file.has_tensor(&name("ffn_gate_inp.weight"));
    let empty = Weight::from_f32(0, c.hidden_size, &[])?;
    Ok(Layer {
        attn_norm: vector("attn_norm.weight", c.hidden_size)?,
        wq: matrix("attn_q.weight", q_dim, c.hidden_size)?,
        wk: matrix("attn_k.weight", kv_dim, c.hidden_size)?,
        wv: matrix("attn_v.weight", kv_dim, c.hidden_size)?,
        wo: matrix("attn_output.weight", c.hidden_size, q_dim)?,
        bias_q: optional("attn_q.bias", q_dim)?,
        bias_k: optional("attn_k.bias", kv_dim)?,
        bias_v: optional("attn_v.bias", kv_dim)?,
        q_norm: optional("attn_q_norm.weight", c.head_dim)?,
        k_norm: optional("attn_k_norm.weight", c.head_dim)?,
        ffn_norm: vector("ffn_norm.weight", c.hidden_size)?,
        w_gate: if moe {
            empty.clone()
        } else {
            matrix("ffn_gate.weight", c.intermediate_size, c.hidden_size)?
        },
        w_up: if moe {
            empty.clone()
        } else {
            matrix("ffn_up.weight", c.intermediate_size, c.hidden_size)?
        },
        w_down: if moe {
            empty.clone()
        } else {
            matrix("ffn_down.weight", c.hidden_size, c.intermediate_size)?
        },
        moe: if moe {
            Some(crate::runtime::model::moe::load_gguf(file, i, c)?)
        } else {
            None
        },
    })
}

/// The forward pass's activations for one step of `n_tokens` rows, reused by every layer.
struct Scratch {
    /// `(n_tokens, hidden_size)`.
    normed: Vec<f32>,
    /// `(n_tokens, n_heads · head_dim)`.
    q: Vec<f32>,
    /// `(n_tokens, n_kv_heads · head_dim)`.
    k: Vec<f32>,
    v: Vec<f32>,
    /// `(n_tokens, n_heads · head_dim)`.
    attention: Vec<f32>,
    /// `(n_tokens, hidden_size)`.
    projected: Vec<f32>,
    /// `(n_tokens, intermediate_size)`.
    gate: Vec<f32>,
    up: Vec<f32>,
}

impl Scratch {
    /// Zeroed activations of `n` tokens for `c`'s widths.
    fn new(c: &LlamaConfig, n: usize) -> Scratch {
        let (q_dim, kv_dim) = (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
        Scratch {
            normed: vec![0f32; n * c.hidden_size],
            q: vec![0f32; n * q_dim],
            k: vec![0f32; n * kv_dim],
            v: vec![0f32; n * kv_dim],
            attention: vec![0f32; n * q_dim],
            projected: vec![0f32; n * c.hidden_size],
            gate: vec![0f32; n * c.intermediate_size],
            up: vec![0f32; n * c.intermediate_size],
        }
    }
}
