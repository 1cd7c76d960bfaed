//! Random weights of a chosen shape and type, generated on the fly: vLLM's `--load-format
//! dummy`. What it is for: measuring a real-size model's decode bandwidth with nothing to
//! carry (Llama-3.1-8B on a GPU), and exercising layouts a small real model cannot (TP 2/4/8
//! over 8 KV heads) on CPU ranks.
//!
//! Every tensor is drawn from SplitMix64 (Steele, Lea, Flood, "Fast splittable pseudorandom
//! number generators", OOPSLA 2014) seeded by the model's seed, the tensor's name and the
//! row, so the same model comes out on every rank and every thread count: a TP×PP gang's
//! shards are the shards of one process's model. Values are uniform with a standard
//! deviation of `1/sqrt(n_cols)` (norm weights are 1), so activations stay O(1) through any
//! depth. The token embedding is Q8_0 whatever the type (the lookup reads `n_tokens` rows,
//! never the whole table, and the CUDA backend looks up F32 or Q8_0 tables); every projection
//! and the (untied) LM head have the chosen type. The tokenizer maps the 256 bytes to the
//! first 256 ids (GPT-2's byte-level alphabet, no merges) and names the rest
//! `<|dummy_N|>`; it has no end-of-sequence token, so a generation runs to `max_tokens`.

use crate::runtime::formats::ggml::GgmlType;
use anyhow::{Result, bail};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::runtime::model::config::{LlamaConfig, RopeStyle};
use crate::runtime::model::llama::{Layer, Llama};
use crate::runtime::model::tokenizer::Tokenizer;
use crate::runtime::model::weights::Weight;

/// The weight types dummy weights come in (`--dtype`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DummyDtype {
    Q4_0,
    Q8_0,
    Q4K,
    F16,
    Bf16,
}

impl DummyDtype {
    /// The ggml encoding of the projections.
    pub fn ggml(self) -> GgmlType {
        match self {
            DummyDtype::Q4_0 => GgmlType::Q4_0,
            DummyDtype::Q8_0 => GgmlType::Q8_0,
            DummyDtype::Q4K => GgmlType::Q4K,
            DummyDtype::F16 => GgmlType::F16,
            DummyDtype::Bf16 => GgmlType::Bf16,
        }
    }

    /// The name users write (`q4_0`, `q4_k`, `bf16`).
    pub fn name(self) -> &'static str {
        match self {
            DummyDtype::Q4_0 => "q4_0",
            DummyDtype::Q8_0 => "q8_0",
            DummyDtype::Q4K => "q4_k",
            DummyDtype::F16 => "f16",
            DummyDtype::Bf16 => "bf16",
        }
    }
}

/// A dense Llama-family model with random weights: its shape, weight type and seed.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DummyModel {
    /// Where the shape came from (`llama-3.1-8b`, a `config.json` directory).
    pub name: String,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    /// Longest context, tokens.
    pub max_context_tokens: usize,
    pub dtype: DummyDtype,
    pub seed: u64,
}

/// SplitMix64's output function (Steele et al. 2014): a well-mixed 64-bit value of `state`.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A SplitMix64 stream.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix(self.0)
    }

    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    fn fill(&mut self, bytes: &mut [u8]) {
        for chunk in bytes.chunks_mut(8) {
            let word = self.next().to_le_bytes();
            chunk.copy_from_slice(&word[..chunk.len()]);
        }
    }
}

/// FNV-1a of a tensor name, to seed each tensor apart.
fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// One row of `ty` with `n_cols` values of standard deviation about `sigma`, from `rng`.
/// The layouts are ggml's blocks (ggml-common.h): Q4_0 `{f16 d; u8 qs[16]}` (value
/// `d·(q−8)`), Q8_0 `{f16 d; i8 qs[32]}`, Q4_K `{f16 d, dmin; u8 scales[12]; u8 qs[128]}`.
fn fill_row(ty: GgmlType, row: &mut [u8], sigma: f32, rng: &mut SplitMix) {
    let f16 = |v: f32| half::f16::from_f32(v).to_le_bytes();
    // A uniform value on [-a, a] has standard deviation a/√3.
    let spread = sigma * 3f32.sqrt();
    match ty {
        GgmlType::Q4_0 => {
            // q − 8 is uniform on −8..=7: standard deviation ≈ 4.6.
            for block in row.chunks_mut(18) {
                block[..2].copy_from_slice(&f16(sigma / 4.6));
                rng.fill(&mut block[2..]);
            }
        }
        GgmlType::Q8_0 => {
            // i8 uniform on −128..=127: standard deviation ≈ 73.9.
            for block in row.chunks_mut(34) {
                block[..2].copy_from_slice(&f16(sigma / 73.9));
                rng.fill(&mut block[2..]);
            }
        }
        GgmlType::Q4K => {
            // value = d·sc·q − dmin·m with 6-bit sc, m and 4-bit q: with sc and m random the
            // spread is about d·31·7; dmin = 7.5·d/2 centres it roughly.
            let d = sigma / 150.0;
            for block in row.chunks_mut(144) {
                block[..2].copy_from_slice(&f16(d));
                block[2..4].copy_from_slice(&f16(d * 3.75));
                rng.fill(&mut block[4..]);
            }
        }
        GgmlType::F16 => {
            for value in row.chunks_mut(2) {
                value.copy_from_slice(&f16(rng.unit() * spread));
            }
        }
        GgmlType::Bf16 => {
            for value in row.chunks_mut(2) {
                value.copy_from_slice(&half::bf16::from_f32(rng.unit() * spread).to_le_bytes());
            }
        }
        _ => {
            for value in row.chunks_mut(4) {
                value.copy_from_slice(&(rng.unit() * spread).to_le_bytes());
            }
        }
    }
}

impl DummyModel {
    /// The engine's configuration of this shape (RoPE θ 500 000, Llama 3's; ε 1e-5).
    pub fn config(&self) -> LlamaConfig {
        LlamaConfig {
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            n_layers: self.n_layers,
            n_heads: self.n_heads,
            n_kv_heads: self.n_kv_heads,
            head_dim: self.head_dim,
            vocab_size: self.vocab_size,
            rms_norm_eps: 1e-5,
            rope_theta: 500_000.0,
            rope_style: RopeStyle::Interleaved,
            rope_scaling: None,
            max_context_tokens: self.max_context_tokens,
            n_experts: 0,
            n_experts_used: 0,
        }
    }

    /// The matrix `name` `(n_rows, n_cols)` of type `ty`, rows generated in parallel on the
    /// current rayon pool.
    ///
    /// Errors: a row length that is not a whole number of `ty`'s blocks (named).
    fn matrix(&self, name: &str, ty: GgmlType, n_rows: usize, n_cols: usize) -> Result<Weight> {
        let row_bytes = ty
            .row_bytes(n_cols)
            .map_err(|e| anyhow::anyhow!("dummy `{name}` of {}: {e}", self.name))?;
        let seed = mix(self.seed ^ name_hash(name));
        let sigma = 1.0 / (n_cols as f32).sqrt();
        let mut bytes = vec![0u8; row_bytes * n_rows];
        bytes
            .par_chunks_mut(row_bytes.max(1))
            .enumerate()
            .for_each(|(row, out)| {
                let mut rng = SplitMix(mix(seed ^ (row as u64).wrapping_mul(0x9e37_79b9)));
                fill_row(ty, out, sigma, &mut rng);
            });
        Weight::from_bytes(ty, n_rows, n_cols, bytes)
    }

    /// The model, every tensor generated (on the current rayon pool).
    ///
    /// Errors: a dimension that is zero or not a whole number of the type's blocks (named:
    /// Q4_0/Q8_0 rows are multiples of 32 values, Q4_K's of 256).
    pub fn build(&self) -> Result<Llama> {
        if self.hidden_size == 0
            || self.n_heads == 0
            || self.n_kv_heads == 0
            || self.head_dim == 0
            || self.n_layers == 0
            || self.vocab_size == 0
        {
            bail!("dummy `{}` has a zero dimension: {self:?}", self.name);
        }
        let ty = self.dtype.ggml();
        let (hidden, q_dim, kv_dim) = (
            self.hidden_size,
            self.n_heads * self.head_dim,
            self.n_kv_heads * self.head_dim,
        );
        let ones = |n: usize| vec![1.0f32; n];
        let mut layers = Vec::with_capacity(self.n_layers);
        for i in 0..self.n_layers {
            let m = |suffix: &str, rows: usize, cols: usize| {
                self.matrix(&format!("blk.{i}.{suffix}"), ty, rows, cols)
            };
            layers.push(Layer {
                attn_norm: ones(hidden),
                wq: m("attn_q", q_dim, hidden)?,
                wk: m("attn_k", kv_dim, hidden)?,
                wv: m("attn_v", kv_dim, hidden)?,
                wo: m("attn_output", hidden, q_dim)?,
                bias_q: None,
                bias_k: None,
                bias_v: None,
                q_norm: None,
                k_norm: None,
                ffn_norm: ones(hidden),
                w_gate: m("ffn_gate", self.intermediate_size, hidden)?,
                w_up: m("ffn_up", self.intermediate_size, hidden)?,
                w_down: m("ffn_down", hidden, self.intermediate_size)?,
                moe: None,
            });
        }
        let embedding = self.matrix("token_embd", GgmlType::Q8_0, self.vocab_size, hidden)?;
        let output = self.matrix("output", ty, self.vocab_size, hidden)?;
        Ok(Llama::new(
            self.config(),
            embedding,
            layers,
            ones(hidden),
            output,
            None,
        ))
    }

    /// The byte-level tokenizer of this vocabulary (module documentation).
    ///
    /// Errors: a vocabulary under 256 tokens.
    pub fn tokenizer(&self) -> Result<Tokenizer> {
        Tokenizer::byte_level(self.vocab_size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny(dtype: DummyDtype) -> DummyModel {
        DummyModel {
            name: "tiny".into(),
            hidden_size: 256,
            intermediate_size: 512,
            n_layers: 2,
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 64,
            vocab_size: 300,
            max_context_tokens: 128,
            dtype,
            seed: 7,
        }
    }

    #[test]
    fn every_type_builds_finite_values_of_the_intended_spread_and_repeats_exactly() {
        for dtype in [
            DummyDtype::Q4_0,
            DummyDtype::Q8_0,
            DummyDtype::Q4K,
            DummyDtype::F16,
            DummyDtype::Bf16,
        ] {
            let model = tiny(dtype).build().expect("builds");
            let again = tiny(dtype).build().expect("builds");
            assert_eq!(model.layers[1].wq.bytes(), again.layers[1].wq.bytes());
            assert_eq!(model.layers[0].wq.ty, dtype.ggml());
            let values = model.layers[0].w_down.to_f32();
            assert!(values.iter().all(|v| v.is_finite()), "{dtype:?}");
            let rms = (values.iter().map(|v| v * v).sum::<f32>() / values.len() as f32).sqrt();
            let sigma = 1.0 / (512f32).sqrt();
            assert!(
                rms > sigma / 4.0 && rms < sigma * 4.0,
                "{dtype:?}: rms {rms} vs {sigma}"
            );
            // Different tensors and different seeds differ.
            assert_ne!(model.layers[0].wq.bytes(), model.layers[1].wq.bytes());
            let other = DummyModel {
                seed: 8,
                ..tiny(dtype)
            }
            .build()
            .expect("builds");
            assert_ne!(model.layers[0].wq.bytes(), other.layers[0].wq.bytes());
        }
    }

    #[test]
    fn a_shape_that_does_not_fill_blocks_is_refused_by_name() {
        let mut model = tiny(DummyDtype::Q4K);
        model.hidden_size = 64 * 3;
        let error = model.build().expect_err("192 is not a multiple of 256");
        assert!(
            error.to_string().contains("dummy `blk.0.attn_q`"),
            "{error}"
        );
    }

    #[test]
    fn the_tokenizer_round_trips_bytes_and_names_every_other_id() {
        let tokenizer = tiny(DummyDtype::Q4_0).tokenizer().expect("tokenizer");
        assert_eq!(tokenizer.vocab_size(), 300);
        let ids = tokenizer.encode("Hi é", false).expect("encode");
        assert_eq!(ids.len(), "Hi é".len(), "one id per byte");
        assert_eq!(tokenizer.decode(&ids, false).expect("decode"), "Hi é");
        assert_eq!(
            tokenizer.decode(&[299], false).expect("decode"),
            "<|dummy_299|>"
        );
        assert!(tokenizer.eos_ids.is_empty());
    }
}
