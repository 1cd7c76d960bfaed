//! Serving a workload within latency targets: for every feasible layout and every batch per
//! replica up to what its KV cache holds, the time to first token, the time per output
//! token, tokens/s per user and per GPU (aggregated serving: prefill and decode share the
//! replica), which of them meet the `--ttft-ms`/`--tpot-ms` targets, and the Pareto
//! frontier of tokens/s per GPU against tokens/s per user. Pure.
//!
//! The model, per replica with `b` sequences of `isl` prompt and `osl` output tokens:
//! - a decode step `D(b)` = [`cost::decode_step_secs`] at the average context `isl + osl/2`;
//! - a prefill `P` = [`cost::prefill_secs`] of one `isl`-token prompt;
//! - in steady state each of the `b` slots turns over every `osl` steps, so a cycle of `osl`
//!   steps also runs `b` prefills: `cycle = osl · D(b) + b · P`;
//! - TPOT (what a user sees between tokens) = `(osl · D(b) + (b − 1) · P) / osl`: while one
//!   request decodes its `osl` tokens, the other `b − 1` slots each admit one prompt whose
//!   prefill stalls the step it joins; the request's own prefill came before its first token
//!   and is in its TTFT, not its TPOT (vLLM's benchmark defines TPOT as `(e2e − TTFT) /
//!   (osl − 1)`, which excludes it). Tokens/s per user = `1/TPOT`;
//! - tokens/s per replica = `b · osl / cycle` (all `b` prefills count against throughput);
//!   per GPU = that over `tp · pp`;
//! - TTFT = `P + D(b)`: the prompt's own prefill after the step in flight.
//!
//! These are the roofline's optimistic figures (peak HBM and tensor throughput). A PP
//! layout's decode step is the sum of its stages here (no micro-batch overlap, unlike the
//! plan's `estimate.tokens_per_sec`): a conservative figure for PP.

use serde::{Deserialize, Serialize};

use super::Objective;
use super::cluster::HardwareSpec;
use super::cost::{self, Links};
use super::memory::{MAX_NUM_SEQS, StageMemory};
use super::model::{Dtype, ModelSpec};
use crate::degrees::Degrees;

/// The traffic to plan for.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Workload {
    /// Prompt tokens per request (`--isl`).
    pub isl_tokens: u64,
    /// Output tokens per request (`--osl`).
    pub osl_tokens: u64,
    /// Time-to-first-token target, seconds (`--ttft-ms`).
    pub ttft_target_secs: Option<f64>,
    /// Time-per-output-token target, seconds (`--tpot-ms`).
    pub tpot_target_secs: Option<f64>,
    /// Requests per second to serve (`--rps`): sizes each point's GPUs.
    #[serde(default)]
    pub requests_per_sec: Option<f64>,
}

impl Default for Workload {
    /// 1024 prompt and 256 output tokens, no targets.
    fn default() -> Workload {
        Workload {
            isl_tokens: 1024,
            osl_tokens: 256,
            ttft_target_secs: None,
            tpot_target_secs: None,
            requests_per_sec: None,
        }
    }
}

impl Workload {
    /// Whether any target is set (a latency, or a request rate to serve).
    pub fn has_targets(&self) -> bool {
        self.ttft_target_secs.is_some()
            || self.tpot_target_secs.is_some()
            || self.requests_per_sec.is_some()
    }
}

/// One layout at one batch per replica. `--json` `pareto[]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ParetoPoint {
    pub parallel: Degrees,
    /// Sequences decoded together per replica.
    pub batch_per_replica: u64,
    pub ttft_secs: f64,
    /// Time per output token a user sees, seconds: the decode step plus the other `b − 1`
    /// requests' prefills spread over its `osl` steps (its own prefill is in `ttft_secs`).
    pub tpot_secs: f64,
    pub tokens_per_sec_per_user: f64,
    /// Output tokens/s of the whole layout over its GPUs.
    pub tokens_per_sec_per_gpu: f64,
    /// Requests of `isl + osl` tokens one replica's KV cache holds at once.
    pub kv_capacity_seqs: u64,
    /// Meets every target given (true when none is).
    pub meets_sla: bool,
    /// With `--rps R`: the GPUs that serve `R` requests/s at this point — `⌈R / (b /
    /// cycle)⌉` replicas (each of the `b` slots finishes a request per cycle) of `tp · pp`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpus_for_rps: Option<u64>,
}

/// The inputs [`points`] needs of one feasible layout.
pub struct LayoutCosts<'a> {
    pub parallel: Degrees,
    pub stages: &'a [StageMemory],
    pub links: &'a Links,
    /// The figures of each of its GPUs (or CPU ranks: their share of the host).
    pub hardware: &'a HardwareSpec,
    /// Most sequences a replica decodes together (the engine's `max_num_seqs`).
    pub max_batch: u64,
}

/// Batches tried per replica: powers of two up to `max`, and `max` itself.
fn batches(max: u64) -> Vec<u64> {
    let mut out: Vec<u64> = std::iter::successors(Some(1u64), |b| b.checked_mul(2))
        .take_while(|&b| b < max)
        .collect();
    out.push(max.max(1));
    out
}

/// Every (layout, batch) point of `layouts` for `workload`.
pub fn points(
    spec: &ModelSpec,
    layouts: &[LayoutCosts<'_>],
    dtype: Dtype,
    workload: &Workload,
) -> Vec<ParetoPoint> {
    let isl = workload.isl_tokens.max(1);
    let osl = workload.osl_tokens.max(1);
    let context = isl + osl / 2;
    let mut out = Vec::new();
    for layout in layouts {
        let hardware = layout.hardware;
        let kv_tokens = layout.stages.iter().map(|s| s.kv_tokens).min().unwrap_or(0);
        let capacity = kv_tokens / (isl + osl);
        if capacity == 0 {
            continue;
        }
        let prefill = cost::prefill_secs(
            spec,
            &layout.parallel,
            layout.stages,
            dtype,
            hardware,
            layout.links,
            isl,
        );
        let gpus_per_replica = (layout.parallel.tp * layout.parallel.pp) as f64;
        for batch in batches(capacity.min(layout.max_batch)) {
            let step = cost::decode_step_secs(
                spec,
                &layout.parallel,
                layout.stages,
                dtype,
                hardware,
                layout.links,
                batch,
                context,
            );
            let cycle = osl as f64 * step + batch as f64 * prefill;
            // The `b − 1` other requests' prefills interleave with this one's decode steps;
            // its own prefill is in its TTFT (module doc).
            let tpot = (osl as f64 * step + (batch - 1) as f64 * prefill) / osl as f64;
            let ttft = prefill + step;
            let replica_tokens_per_sec = (batch * osl) as f64 / cycle;
            let meets_sla = workload.ttft_target_secs.is_none_or(|t| ttft <= t)
                && workload.tpot_target_secs.is_none_or(|t| tpot <= t);
            let gpus_for_rps = workload.requests_per_sec.map(|rps| {
                let replica_rps = batch as f64 / cycle;
                (rps / replica_rps).ceil() as u64 * layout.parallel.replica_size() as u64
            });
            out.push(ParetoPoint {
                parallel: layout.parallel,
                batch_per_replica: batch,
                ttft_secs: ttft,
                tpot_secs: tpot,
                tokens_per_sec_per_user: 1.0 / tpot,
                tokens_per_sec_per_gpu: replica_tokens_per_sec / gpus_per_replica,
                kv_capacity_seqs: capacity,
                meets_sla,
                gpus_for_rps,
            });
        }
    }
    out
}

/// The points no other point beats on both tokens/s per GPU and tokens/s per user, most
/// tokens/s per GPU first.
pub fn frontier(points: &[ParetoPoint]) -> Vec<ParetoPoint> {
    let dominated = |p: &ParetoPoint| {
        points.iter().any(|q| {
            q.tokens_per_sec_per_gpu >= p.tokens_per_sec_per_gpu
                && q.tokens_per_sec_per_user >= p.tokens_per_sec_per_user
                && (q.tokens_per_sec_per_gpu > p.tokens_per_sec_per_gpu
                    || q.tokens_per_sec_per_user > p.tokens_per_sec_per_user)
        })
    };
    let mut front: Vec<ParetoPoint> = points.iter().filter(|p| !dominated(p)).cloned().collect();
    front.sort_by(|a, b| {
        b.tokens_per_sec_per_gpu
            .total_cmp(&a.tokens_per_sec_per_gpu)
    });
    front.dedup_by(|a, b| a.parallel == b.parallel && a.batch_per_replica == b.batch_per_replica);
    front
}

/// The best point that meets the targets: most tokens/s per GPU for throughput, most
/// tokens/s per user for latency, the fewest GPUs for `--rps` for cost (without `--rps`:
/// most tokens/s per GPU); ties: fewer GPUs per replica, then less PP.
pub fn choose(points: &[ParetoPoint], objective: Objective) -> Option<&ParetoPoint> {
    points.iter().filter(|p| p.meets_sla).max_by(|a, b| {
        let primary = match objective {
            Objective::Cost => match (a.gpus_for_rps, b.gpus_for_rps) {
                (Some(ga), Some(gb)) => gb.cmp(&ga).then(
                    a.tokens_per_sec_per_user
                        .total_cmp(&b.tokens_per_sec_per_user),
                ),
                _ => a
                    .tokens_per_sec_per_gpu
                    .total_cmp(&b.tokens_per_sec_per_gpu),
            },
            Objective::Throughput => a
                .tokens_per_sec_per_gpu
                .total_cmp(&b.tokens_per_sec_per_gpu),
            Objective::Latency => a
                .tokens_per_sec_per_user
                .total_cmp(&b.tokens_per_sec_per_user),
        };
        primary
            .then((b.parallel.tp * b.parallel.pp).cmp(&(a.parallel.tp * a.parallel.pp)))
            .then(b.parallel.pp.cmp(&a.parallel.pp))
    })
}

/// A disaggregated deployment: prefill workers run the prompts, decode workers receive
/// their KV caches and generate. `--json` `disaggregated`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Disaggregated {
    /// One prefill worker's layout (TP × PP; DP counts the workers) and how many.
    pub prefill: Degrees,
    pub prefill_workers: u64,
    pub decode: Degrees,
    pub decode_workers: u64,
    /// Sequences each decode worker decodes together.
    pub batch_per_decode_worker: u64,
    /// GPUs used (prefill + decode workers).
    pub gpus: u64,
    /// One prompt's prefill, its KV cache's transfer, and the decode step it joins.
    pub ttft_secs: f64,
    /// One decode step: decode workers never run a prefill.
    pub tpot_secs: f64,
    pub tokens_per_sec_per_user: f64,
    pub tokens_per_sec_per_gpu: f64,
    /// Seconds to move one request's KV cache (`isl` tokens) from its prefill worker.
    pub kv_transfer_secs: f64,
    /// Prefill GPUs over decode GPUs.
    pub prefill_to_decode_gpus: f64,
    pub meets_sla: bool,
}

/// A worker shape for disaggregation: one replica's layout (experts not sharded across
/// replicas) with its costs.
pub struct WorkerCosts<'a> {
    /// TP × PP of one worker (`dp` and `ep` 1, or `ep = tp` inside it).
    pub parallel: Degrees,
    pub stages: &'a [StageMemory],
    pub links: &'a Links,
}

/// The best disaggregated deployment on `n_gpus` GPUs that meets the targets: for every
/// prefill shape A and decode shape B (each one replica of a feasible layout) and every
/// decode batch `b`, the split of the GPUs that balances the prefill rate `x / P_A` (requests/s)
/// with the decode rate `y · b / (osl · D_B(b))`, `x · |A| + y · |B| ≤ n_gpus`; served
/// requests/s = the smaller rate; tokens/s per GPU = that × `osl` over the GPUs used. TTFT =
/// `P_A + isl · kv_bytes_per_token / transfer + D_B(b)`; TPOT = `D_B(b)`. Chosen by the
/// objective like [`choose`]. `None` when no pair fits or meets the targets.
#[allow(clippy::too_many_arguments)]
pub fn disaggregate(
    spec: &ModelSpec,
    workers: &[WorkerCosts<'_>],
    dtype: Dtype,
    hardware: &HardwareSpec,
    transfer: &cost::Link,
    n_gpus: u64,
    workload: &Workload,
    objective: Objective,
) -> Option<Disaggregated> {
    let isl = workload.isl_tokens.max(1);
    let osl = workload.osl_tokens.max(1);
    let context = isl + osl / 2;
    let prefills = prefill_costs(spec, workers, dtype, hardware, transfer, isl);
    let mut best: Option<Disaggregated> = None;
    for decode in workers {
        let kv_tokens = decode.stages.iter().map(|s| s.kv_tokens).min().unwrap_or(0);
        let capacity = (kv_tokens / (isl + osl)).min(MAX_NUM_SEQS);
        if capacity == 0 {
            continue;
        }
        for batch in batches(capacity) {
            let step = cost::decode_step_secs(
                spec,
                &decode.parallel,
                decode.stages,
                dtype,
                hardware,
                decode.links,
                batch,
                context,
            );
            let decode_cost = DecodeCost {
                parallel: decode.parallel,
                batch,
                step_secs: step,
                // Requests/s one decode worker finishes at this batch.
                requests_per_sec: batch as f64 / (osl as f64 * step),
            };
            for prefill in &prefills {
                for candidate in splits(prefill, &decode_cost, n_gpus, workload) {
                    if !candidate.meets_sla {
                        continue;
                    }
                    if beats(&candidate, best.as_ref(), objective) {
                        best = Some(candidate);
                    }
                }
            }
        }
    }
    best
}

/// One prefill worker shape's costs for one prompt of `isl` tokens.
#[derive(Clone, Copy)]
struct PrefillCost {
    parallel: Degrees,
    /// The prompt's prefill, seconds.
    prefill_secs: f64,
    /// Moving the prompt's KV cache to a decode worker, seconds.
    transfer_secs: f64,
}

/// One decode worker shape at one batch.
#[derive(Clone, Copy)]
struct DecodeCost {
    parallel: Degrees,
    /// Sequences decoded together.
    batch: u64,
    /// One decode step of the batch, seconds.
    step_secs: f64,
    /// Requests one worker finishes per second at this batch.
    requests_per_sec: f64,
}

/// The prefill and KV-transfer costs of every worker shape for a prompt of `isl_tokens`,
/// the transfer over `transfer`.
fn prefill_costs(
    spec: &ModelSpec,
    workers: &[WorkerCosts<'_>],
    dtype: Dtype,
    hardware: &HardwareSpec,
    transfer: &cost::Link,
    isl_tokens: u64,
) -> Vec<PrefillCost> {
    workers
        .iter()
        .map(|w| {
            let p = cost::prefill_secs(
                spec,
                &w.parallel,
                w.stages,
                dtype,
                hardware,
                w.links,
                isl_tokens,
            );
            // The whole model's KV bytes per token: each stage's per-GPU bytes × its TP GPUs.
            let kv_per_token: u64 = w
                .stages
                .iter()
                .map(|s| s.kv_bytes_per_token * w.parallel.tp as u64)
                .sum();
            let transfer_secs =
                (isl_tokens * kv_per_token) as f64 / transfer.bytes_per_sec + transfer.latency_secs;
            PrefillCost {
                parallel: w.parallel,
                prefill_secs: p,
                transfer_secs,
            }
        })
        .collect()
}

/// The deployments of `prefill` and `decode` workers on at most `n_gpus` GPUs whose prefill
/// worker count is next to the balancing one (rounded down, then up), whether or not they
/// meet `workload`'s targets.
fn splits(
    prefill: &PrefillCost,
    decode: &DecodeCost,
    n_gpus: u64,
    workload: &Workload,
) -> Vec<Disaggregated> {
    let osl = workload.osl_tokens.max(1);
    let g_d = decode.parallel.replica_size() as u64;
    let g_p = prefill.parallel.replica_size() as u64;
    if g_p + g_d > n_gpus {
        return Vec::new();
    }
    let (prefill_secs, step) = (prefill.prefill_secs, decode.step_secs);
    // Balance x / P = y · r with x·g_p + y·g_d = n: x* = n / (g_p + g_d / (P · r)).
    let x_star =
        n_gpus as f64 / (g_p as f64 + g_d as f64 / (prefill_secs * decode.requests_per_sec));
    let mut out = Vec::new();
    for x in [x_star.floor() as u64, x_star.ceil() as u64] {
        let x = x.max(1);
        if x * g_p + g_d > n_gpus {
            continue;
        }
        let y = (n_gpus - x * g_p) / g_d;
        if y == 0 {
            continue;
        }
        let served = (x as f64 / prefill_secs).min(y as f64 * decode.requests_per_sec);
        let gpus = x * g_p + y * g_d;
        let ttft = prefill_secs + prefill.transfer_secs + step;
        out.push(Disaggregated {
            prefill: prefill.parallel,
            prefill_workers: x,
            decode: decode.parallel,
            decode_workers: y,
            batch_per_decode_worker: decode.batch,
            gpus,
            ttft_secs: ttft,
            tpot_secs: step,
            tokens_per_sec_per_user: 1.0 / step,
            tokens_per_sec_per_gpu: served * osl as f64 / gpus as f64,
            kv_transfer_secs: prefill.transfer_secs,
            prefill_to_decode_gpus: (x * g_p) as f64 / (y * g_d) as f64,
            meets_sla: workload.ttft_target_secs.is_none_or(|t| ttft <= t)
                && workload.tpot_target_secs.is_none_or(|t| step <= t),
        });
    }
    out
}

/// Whether `candidate` beats `best` (always, when there is none) on `objective`: tokens/s
/// per GPU for throughput and cost, tokens/s per user (then per GPU) for latency.
fn beats(candidate: &Disaggregated, best: Option<&Disaggregated>, objective: Objective) -> bool {
    best.is_none_or(|b| match objective {
        Objective::Throughput | Objective::Cost => {
            candidate.tokens_per_sec_per_gpu > b.tokens_per_sec_per_gpu
        }
        Objective::Latency => {
            candidate.tokens_per_sec_per_user > b.tokens_per_sec_per_user
                || (candidate.tokens_per_sec_per_user == b.tokens_per_sec_per_user
                    && candidate.tokens_per_sec_per_gpu > b.tokens_per_sec_per_gpu)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(gpu: f64, user: f64) -> ParetoPoint {
        ParetoPoint {
            parallel: Degrees {
                tp: 1,
                pp: 1,
                ep: 1,
                dp: 1,
            },
            batch_per_replica: gpu as u64,
            ttft_secs: 0.1,
            tpot_secs: 1.0 / user,
            tokens_per_sec_per_user: user,
            tokens_per_sec_per_gpu: gpu,
            kv_capacity_seqs: 8,
            meets_sla: user >= 20.0,
            gpus_for_rps: None,
        }
    }

    #[test]
    fn the_frontier_drops_dominated_points_and_choose_respects_the_targets() {
        let points = vec![
            point(100.0, 50.0),
            point(200.0, 30.0),
            point(150.0, 20.0), // dominated by (200, 30)
            point(400.0, 10.0),
        ];
        let front = frontier(&points);
        let gpu: Vec<f64> = front.iter().map(|p| p.tokens_per_sec_per_gpu).collect();
        assert_eq!(gpu, [400.0, 200.0, 100.0]);
        // (400, 10) misses the 20 tokens/s/user target: throughput takes (200, 30).
        let best = choose(&points, Objective::Throughput).expect("a point meets it");
        assert_eq!(best.tokens_per_sec_per_gpu, 200.0);
        let fastest = choose(&points, Objective::Latency).expect("a point meets it");
        assert_eq!(fastest.tokens_per_sec_per_user, 50.0);
        assert_eq!(batches(6), [1, 2, 4, 6]);
        assert_eq!(batches(1), [1]);
    }
}
