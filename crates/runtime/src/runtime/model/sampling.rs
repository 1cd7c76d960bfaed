//! Choosing the next token from logits: greedy, or temperature with min-p, top-k and top-p,
//! from a seeded generator (same seed, same tokens), after vLLM's logits processing: tokens
//! barred until `min_tokens`, `logit_bias`, and the repetition, frequency and presence
//! penalties.
//!
//! The order and the penalties' definitions are vLLM's (`vllm/v1/sample/sampler.py` and
//! `apply_penalties` in `vllm/model_executor/layers/utils.py`): the repetition penalty
//! `r` divides a positive logit by `r` and multiplies a negative one by `r` (CTRL,
//! Keskar et al. 2019, arXiv:1909.05858) for every token of the prompt *or* the output;
//! the frequency penalty subtracts `f × count` and the presence penalty `p` once, for the
//! tokens of the output only (OpenAI's definition). llama.cpp differs: its penalties look
//! at the last `penalty_last_n` tokens, prompt included. Log-probabilities are those of the
//! model's raw logits, before any of this (vLLM's default `logprobs_mode`).

use std::collections::{HashMap, HashSet};

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
    /// Subtracted once from the logit of every token the output holds already (OpenAI's
    /// and vLLM's `presence_penalty`, -2 to 2; 0 is off).
    #[serde(default)]
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per time the output holds it
    /// (`frequency_penalty`, -2 to 2; 0 is off).
    #[serde(default)]
    pub frequency_penalty: f32,
    /// vLLM's `repetition_penalty` (> 0; 1 is off): a positive logit of a token in the
    /// prompt or the output is divided by it, a negative one multiplied.
    #[serde(default = "one")]
    pub repetition_penalty: f32,
    /// vLLM's `min_p` (0 to 1; 0 is off): after temperature, drop the tokens less likely
    /// than `min_p` times the most likely one.
    #[serde(default)]
    pub min_p: f32,
    /// Added to the logits of these token ids before anything else (`logit_bias`, each
    /// -100 to 100).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub logit_bias: Vec<(u32, f32)>,
    /// vLLM's `min_tokens`: the tokens of `min_tokens_barred` cannot be sampled, and no
    /// stop condition but the length ends the generation, before this many tokens.
    #[serde(default)]
    pub min_tokens: usize,
    /// The tokens barred until `min_tokens` (the end-of-sequence ids unless `ignore_eos`,
    /// and `stop_token_ids`), filled by whoever knows the tokenizer.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub min_tokens_barred: Vec<u32>,
    /// vLLM's `ignore_eos`: an end-of-sequence token does not end the generation (it is
    /// generated like any other token; only `max_tokens` or a stop condition ends it).
    #[serde(default)]
    pub ignore_eos: bool,
    /// vLLM's `stop_token_ids`: sampling one of these ends the generation (reason `stop`;
    /// the token is not in the output).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stop_token_ids: Vec<u32>,
    /// vLLM's `include_stop_str_in_output`: the output keeps the stop string that ended it.
    #[serde(default)]
    pub include_stop_str_in_output: bool,
    /// vLLM's `skip_special_tokens` (default true): special tokens are left out of the
    /// output text.
    #[serde(default = "yes")]
    pub skip_special_tokens: bool,
}

/// `1.0`, the neutral repetition penalty (a serde default).
fn one() -> f32 {
    1.0
}

/// `true` (a serde default).
fn yes() -> bool {
    true
}

impl SamplingParams {
    /// Whether any penalty is on: the sampler then needs the sequence's tokens
    /// ([`Sampler::observe_history`]).
    pub fn penalized(&self) -> bool {
        self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
            || self.repetition_penalty != 1.0
    }

    /// Whether sampling `token` as output token number `index` (from 0) ends the
    /// generation: an end-of-sequence id of `eos_ids` (unless `ignore_eos`) or one of
    /// `stop_token_ids`, once `min_tokens` tokens precede it.
    pub fn is_stop_token(&self, token: u32, eos_ids: &[u32], index: usize) -> bool {
        index >= self.min_tokens
            && ((!self.ignore_eos && eos_ids.contains(&token))
                || self.stop_token_ids.contains(&token))
    }

    /// Whether stop strings are looked for once the output has `generated` tokens: from
    /// the first token past `min_tokens` (vLLM's detokenizer).
    pub fn checks_stop_strings(&self, generated: usize) -> bool {
        generated > self.min_tokens
    }

    /// Whether the logits are used as the model gives them after `sampled` tokens (no
    /// bias, no penalty, no token barred now): greedy output is then bit for bit that of
    /// plain argmax, and no copy of the vocabulary's logits is made.
    fn logits_untouched(&self, sampled: usize) -> bool {
        !self.penalized()
            && self.logit_bias.is_empty()
            && (sampled >= self.min_tokens || self.min_tokens_barred.is_empty())
    }
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
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            min_p: 0.0,
            logit_bias: Vec::new(),
            min_tokens: 0,
            min_tokens_barred: Vec::new(),
            ignore_eos: false,
            stop_token_ids: Vec::new(),
            include_stop_str_in_output: false,
            skip_special_tokens: true,
        }
    }
}

/// A sampler with its own random state, and what the penalties need of its sequence.
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
    /// Tokens sampled so far (those skipped after a preemption included): `min_tokens`
    /// counts them.
    sampled: usize,
    /// The prompt's distinct tokens (kept only when a penalty is on).
    prompt_seen: HashSet<u32>,
    /// How often the output holds each token (kept only when a penalty is on).
    output_counts: HashMap<u32, u32>,
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
            sampled: 0,
            prompt_seen: HashSet::new(),
            output_counts: HashMap::new(),
        }
    }

    /// Records the sequence's tokens so far for the penalties: `history` (`(tokens)`), of
    /// which the first `prompt_tokens` are the prompt and the rest earlier output (a
    /// sequence resumed after preemption, or continued from another replica). Nothing is
    /// kept when no penalty is on.
    pub fn observe_history(&mut self, history: &[u32], prompt_tokens: usize) {
        if !self.params.penalized() {
            return;
        }
        let (prompt, output) = history.split_at(prompt_tokens.min(history.len()));
        self.prompt_seen.extend(prompt);
        for &token in output {
            *self.output_counts.entry(token).or_default() += 1;
        }
    }

    /// The parameters it samples with.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Advances the generator past `n` samples (each non-greedy sample takes one draw), as
    /// a sequence resumed after preemption must.
    pub fn skip(&mut self, n: usize) {
        self.sampled += n;
        if self.params.temperature > 0.0 {
            for _ in 0..n {
                let _: f64 = self.rng.random();
            }
        }
    }

    /// The next token for `logits` (`(vocab_size)`), after the logits processing the
    /// parameters ask for; recorded as output for the penalties.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let token = if self.params.logits_untouched(self.sampled) {
            self.draw(logits)
        } else {
            let processed = self.process(logits);
            self.draw(&processed)
        };
        self.sampled += 1;
        if self.params.penalized() {
            *self.output_counts.entry(token).or_default() += 1;
        }
        token
    }

    /// `logits` after vLLM's processing, in its order: tokens barred until `min_tokens`
    /// (−∞), `logit_bias` added, then the repetition, frequency and presence penalties.
    fn process(&self, logits: &[f32]) -> Vec<f32> {
        let params = &self.params;
        let mut logits = logits.to_vec();
        if self.sampled < params.min_tokens {
            for &token in &params.min_tokens_barred {
                if let Some(l) = logits.get_mut(token as usize) {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        for &(token, bias) in &params.logit_bias {
            if let Some(l) = logits.get_mut(token as usize) {
                *l += bias;
            }
        }
        if params.repetition_penalty != 1.0 {
            let r = params.repetition_penalty;
            let seen = self.prompt_seen.iter().chain(
                self.output_counts
                    .keys()
                    .filter(|t| !self.prompt_seen.contains(t)),
            );
            for &token in seen {
                if let Some(l) = logits.get_mut(token as usize) {
                    *l = if *l > 0.0 { *l / r } else { *l * r };
                }
            }
        }
        for (&token, &count) in &self.output_counts {
            if let Some(l) = logits.get_mut(token as usize) {
                *l -= params.frequency_penalty * count as f32 + params.presence_penalty;
            }
        }
        logits
    }

    /// Greedy, or a draw after temperature, min-p, top-k and top-p.
    fn draw(&mut self, logits: &[f32]) -> u32 {
        if self.params.temperature <= 0.0 {
            return argmax(logits);
        }
        let mut candidates: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, l / self.params.temperature))
            .collect();
        candidates.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let max = candidates[0].1;
        if self.params.min_p > 0.0 {
            // p / p_max = e^(l − l_max): no normalisation needed.
            let floor = max + self.params.min_p.ln();
            let keep = candidates.partition_point(|&(_, l)| l >= floor).max(1);
            candidates.truncate(keep);
        }
        if self.params.top_k > 0 {
            candidates.truncate(self.params.top_k);
        }
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

    /// Greedy draws of `params` over `steps` calls on the same logits, after `history`.
    fn greedy_run(
        params: SamplingParams,
        logits: &[f32],
        history: &[u32],
        prompt: usize,
        steps: usize,
    ) -> Vec<u32> {
        let mut sampler = Sampler::new(&params);
        sampler.observe_history(history, prompt);
        (0..steps).map(|_| sampler.sample(logits)).collect()
    }

    #[test]
    fn neutral_extensions_leave_greedy_and_seeded_draws_unchanged() {
        let logits: Vec<f32> = (0..64).map(|i| (i as f32 * 0.91).cos() * 3.0).collect();
        let neutral = SamplingParams {
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            min_p: 0.0,
            min_tokens_barred: vec![1, 2],
            stop_token_ids: vec![3],
            ..SamplingParams::default()
        };
        assert!(neutral.logits_untouched(0));
        // `min_tokens` bars its tokens only until reached.
        let barring = SamplingParams {
            min_tokens: 2,
            ..neutral.clone()
        };
        assert!(!barring.logits_untouched(1) && barring.logits_untouched(2));
        for temperature in [0.0, 0.8] {
            let plain = SamplingParams {
                temperature,
                seed: Some(5),
                ..SamplingParams::default()
            };
            let draw = |params: &SamplingParams| {
                let mut sampler = Sampler::new(params);
                sampler.observe_history(&[1, 2, 3], 2);
                (0..30).map(|_| sampler.sample(&logits)).collect::<Vec<_>>()
            };
            assert_eq!(
                draw(&plain),
                draw(&SamplingParams {
                    temperature,
                    seed: Some(5),
                    ..neutral.clone()
                })
            );
        }
    }

    #[test]
    fn penalties_follow_vllms_definitions() {
        // Token 0 leads (5.0), token 1 trails it by 0.5 and token 2 is negative.
        let logits = [5.0f32, 4.5, -1.0, 0.0];
        let greedy = SamplingParams::default();
        // Frequency: token 0 loses 0.3 per time it was generated, so after two it is
        // 4.4 < 4.5 and token 1 wins; the prompt does not count.
        let frequency = SamplingParams {
            frequency_penalty: 0.3,
            ..greedy.clone()
        };
        assert_eq!(
            greedy_run(frequency.clone(), &logits, &[0, 0, 0], 3, 3),
            vec![0, 0, 1]
        );
        assert_eq!(greedy_run(frequency, &logits, &[9, 0], 1, 1), vec![0]);
        // Presence: once, whatever the count.
        let presence = SamplingParams {
            presence_penalty: 0.6,
            ..greedy.clone()
        };
        assert_eq!(greedy_run(presence, &logits, &[], 0, 2), vec![0, 1]);
        // Repetition: prompt tokens count too; 5.0 / 1.2 < 4.5 (token 1 unseen).
        let repetition = SamplingParams {
            repetition_penalty: 1.2,
            ..greedy.clone()
        };
        assert_eq!(greedy_run(repetition.clone(), &logits, &[0], 1, 1), vec![1]);
        // A negative logit is multiplied: token 2 (−1.0 → −1.2) stays below token 3 (0.0),
        // which is unchanged (0 × r and 0 / r are both 0).
        let sampler = {
            let mut s = Sampler::new(&repetition);
            s.observe_history(&[2, 3], 2);
            s
        };
        assert_eq!(sampler.process(&logits), vec![5.0, 4.5, -1.2, 0.0]);
        // Frequency and presence add: 5 − (2 × 0.5 + 0.25) = 3.75.
        let both = SamplingParams {
            frequency_penalty: 0.5,
            presence_penalty: 0.25,
            ..greedy
        };
        let mut sampler = Sampler::new(&both);
        sampler.observe_history(&[7, 0, 0], 1);
        assert_eq!(sampler.process(&logits)[0], 3.75);
    }

    #[test]
    fn min_tokens_bars_its_tokens_until_reached_and_logit_bias_adds() {
        let logits = [1.0f32, 9.0, 2.0];
        let params = SamplingParams {
            min_tokens: 2,
            min_tokens_barred: vec![1],
            ..SamplingParams::default()
        };
        assert_eq!(
            greedy_run(params.clone(), &logits, &[], 0, 3),
            vec![2, 2, 1]
        );
        // Tokens sampled before a preemption count toward `min_tokens`.
        let mut resumed = Sampler::new(&params);
        resumed.skip(2);
        assert_eq!(resumed.sample(&logits), 1);
        let biased = SamplingParams {
            logit_bias: vec![(0, 100.0), (7, 5.0)],
            ..SamplingParams::default()
        };
        assert_eq!(greedy_run(biased, &logits, &[], 0, 1), vec![0]);
    }

    #[test]
    fn min_p_drops_the_unlikely_before_drawing() {
        // p1 / p0 = e^-3 ≈ 0.05 < 0.1: only token 0 survives min_p 0.1.
        let logits = [3.0f32, 0.0, -0.5];
        let params = SamplingParams {
            temperature: 1.0,
            min_p: 0.1,
            seed: Some(3),
            ..SamplingParams::default()
        };
        let mut sampler = Sampler::new(&params);
        assert!((0..300).all(|_| sampler.sample(&logits) == 0));
        let mut sampler = Sampler::new(&SamplingParams {
            min_p: 0.01,
            ..params
        });
        assert!((0..300).any(|_| sampler.sample(&logits) != 0));
    }

    #[test]
    fn logprobs_normalise() {
        let logits = [1.0f32, 2.0, 3.0];
        let total: f32 = (0..3).map(|t| logprob(&logits, t).exp()).sum();
        assert!((total - 1.0).abs() < 1e-5);
    }
}
