//! Choosing the next token from logits: greedy, or temperature with top-k and top-p, from a
//! seeded generator (same seed, same tokens).

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

/// How to pick tokens and when to stop.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SamplingParams {
    /// 0 is greedy (argmax); otherwise logits are divided by it before softmax.
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; 0 keeps all.
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p`; 1 keeps all.
    pub top_p: f32,
    /// Seed of the generator; `None` draws one from the OS.
    pub seed: Option<u64>,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Generation stops when the text contains any of these; the text is cut before it.
    pub stop: Vec<String>,
    /// Report each sampled token's log-probability (a softmax over the whole vocabulary per
    /// token, so only when asked).
    #[serde(default)]
    pub logprobs: bool,
    /// With `logprobs`: also report this many most likely tokens at each step, with their
    /// log-probabilities (OpenAI's `top_logprobs`, 0 to 20).
    #[serde(default)]
    pub top_logprobs: usize,
}

impl Default for SamplingParams {
    fn default() -> SamplingParams {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: None,
            max_tokens: 64,
            stop: Vec::new(),
            logprobs: false,
            top_logprobs: 0,
        }
    }
}

/// A sampler with its own random state.
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
}

impl Sampler {
    /// A sampler for `params`.
    pub fn new(params: &SamplingParams) -> Sampler {
        let rng = match params.seed {
            Some(seed) => StdRng::seed_from_u64(seed),
            None => StdRng::seed_from_u64(rand::random()),
        };
        Sampler {
            params: params.clone(),
            rng,
        }
    }

    /// The parameters it samples with.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Advances the generator past `n` samples (each non-greedy sample takes one draw), as
    /// a sequence resumed after preemption must.
    pub fn skip(&mut self, n: usize) {
        if self.params.temperature > 0.0 {
            for _ in 0..n {
                let _: f64 = self.rng.random();
            }
        }
    }

    /// The next token for `logits` (`(vocab_size)`).
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.params.temperature <= 0.0 {
            return argmax(logits);
        }
        let mut candidates: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, l / self.params.temperature))
            .collect();
        candidates.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if self.params.top_k > 0 {
            candidates.truncate(self.params.top_k);
        }
        let max = candidates[0].1;
        let mut total = 0f64;
        let mut probabilities: Vec<f64> = candidates
            .iter()
            .map(|(_, l)| {
                let p = ((l - max) as f64).exp();
                total += p;
                p
            })
            .collect();
        for p in probabilities.iter_mut() {
            *p /= total;
        }
        if self.params.top_p < 1.0 {
            let mut cumulative = 0f64;
            let mut keep = probabilities.len();
            for (i, p) in probabilities.iter().enumerate() {
                cumulative += p;
                if cumulative >= self.params.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
            probabilities.truncate(keep);
            let kept: f64 = probabilities.iter().sum();
            for p in probabilities.iter_mut() {
                *p /= kept;
            }
        }
        let mut draw: f64 = self.rng.random();
        for (i, p) in probabilities.iter().enumerate() {
            if draw < *p {
                return candidates[i].0;
            }
            draw -= p;
        }
        candidates[probabilities.len() - 1].0
    }
}

/// Index of the largest logit (the lowest index among equals).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// `log softmax(logits)[token]`: the token's log-probability, in nats. The exponentials
/// use the vectorised [`crate::runtime::cpu::mathfn::expf`] (≤ 2 ulp) summed in 8 f32 lanes:
/// this runs for every generated token over the whole vocabulary.
pub fn logprob(logits: &[f32], token: u32) -> f32 {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &l| m.max(l));
    (logits[token as usize] - max) - sum_exp_shifted(logits, max).ln()
}

/// The `k` most likely tokens of `logits` with their log-probabilities (nats), most likely
/// first (ties: the lower id first), as OpenAI's `top_logprobs` lists them.
pub fn top_logprobs(logits: &[f32], k: usize) -> Vec<(u32, f32)> {
    let k = k.min(logits.len());
    if k == 0 {
        return Vec::new();
    }
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &l| m.max(l));
    let log_sum = sum_exp_shifted(logits, max).ln();
    let order = |a: &u32, b: &u32| {
        logits[*b as usize]
            .total_cmp(&logits[*a as usize])
            .then(a.cmp(b))
    };
    let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
    ids.select_nth_unstable_by(k - 1, order);
    ids.truncate(k);
    ids.sort_by(order);
    ids.into_iter()
        .map(|id| (id, (logits[id as usize] - max) - log_sum))
        .collect()
}

crate::runtime::cpu::mathfn::multiversion! {
    /// `Σ e^(l − shift)` over `logits`, in 8 lanes.
    fn sum_exp_shifted(logits: &[f32], shift: f32) -> f32 {
        let mut lanes = [0f32; 8];
        let mut chunks = logits.chunks_exact(8);
        for chunk in &mut chunks {
            for (lane, &l) in lanes.iter_mut().zip(chunk) {
                *lane += crate::runtime::cpu::mathfn::expf(l - shift);
            }
        }
        let tail: f32 = chunks
            .remainder()
            .iter()
            .map(|&l| crate::runtime::cpu::mathfn::expf(l - shift))
            .sum();
        lanes.iter().sum::<f32>() + tail
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_first_maximum() {
        assert_eq!(argmax(&[0.1, 3.0, -1.0, 3.0]), 1);
        let mut sampler = Sampler::new(&SamplingParams::default());
        assert_eq!(sampler.sample(&[0.1, 3.0, -1.0]), 1);
    }

    #[test]
    fn same_seed_same_tokens_and_top_k_one_is_greedy() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let params = SamplingParams {
            temperature: 1.0,
            seed: Some(7),
            ..SamplingParams::default()
        };
        let draw = |params: &SamplingParams| {
            let mut sampler = Sampler::new(params);
            (0..20).map(|_| sampler.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(draw(&params), draw(&params));
        assert_ne!(
            draw(&params),
            draw(&SamplingParams {
                seed: Some(8),
                ..params.clone()
            }),
            "other seeds differ"
        );
        let top1 = SamplingParams {
            top_k: 1,
            ..params.clone()
        };
        assert!(draw(&top1).iter().all(|&t| t == argmax(&logits)));
    }

    #[test]
    fn top_p_keeps_only_the_nucleus() {
        // Token 0 holds ~88% of the mass; with top_p 0.5 nothing else may be drawn.
        let logits = [4.0, 2.0, 0.0, -1.0];
        let params = SamplingParams {
            temperature: 1.0,
            top_p: 0.5,
            seed: Some(1),
            ..SamplingParams::default()
        };
        let mut sampler = Sampler::new(&params);
        assert!((0..200).all(|_| sampler.sample(&logits) == 0));
        let mut sampler = Sampler::new(&SamplingParams {
            top_p: 1.0,
            ..params
        });
        assert!(
            (0..400).any(|_| sampler.sample(&logits) != 0),
            "without top-p others appear"
        );
    }

    #[test]
    fn logprobs_normalise() {
        let logits = [1.0f32, 2.0, 3.0];
        let total: f32 = (0..3).map(|t| logprob(&logits, t).exp()).sum();
        assert!((total - 1.0).abs() < 1e-5);
    }
}
