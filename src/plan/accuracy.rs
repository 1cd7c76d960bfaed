//! A plan's predictions next to measurements of its layout: for each batch the plan predicts,
//! TTFT p50, TPOT p50 and tokens/s predicted, measured, and the relative error
//! `(measured − predicted) / predicted`. What `infer bench serve --plan` prints. Pure: the
//! measurements are given; nothing here runs or times anything.

use serde::Serialize;

use super::Plan;
use crate::degrees::Degrees;

/// What the plan predicts for its own layout at one batch: one of its `pareto[]` points.
#[derive(Clone, Debug, PartialEq)]
pub struct Prediction {
    /// Sequences decoded together per replica.
    pub batch_per_replica: u64,
    /// Concurrent requests over the whole layout: `batch_per_replica · dp`.
    pub concurrency: u64,
    /// Time to first token of a request of `isl` prompt tokens, seconds.
    pub ttft_secs: f64,
    /// Time per output token a user sees, seconds.
    pub tpot_secs: f64,
    /// Output tokens per second of the whole layout (all its GPUs).
    pub tokens_per_sec: f64,
}

/// What a benchmark measured at one concurrency.
#[derive(Clone, Debug, PartialEq)]
pub struct Measurement {
    /// Median time to first token, seconds.
    pub ttft_p50_secs: f64,
    /// Median time per output token after the first, seconds.
    pub tpot_p50_secs: f64,
    /// Output tokens per second of wall time over every stream.
    pub tokens_per_sec: f64,
}

/// One metric at one concurrency. `--json` `rows[]`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Row {
    /// Concurrent requests the metric was measured at (`batch_per_replica · dp`).
    pub concurrency: u64,
    /// `ttft_p50_secs`, `tpot_p50_secs` or `tokens_per_sec`.
    pub metric: &'static str,
    pub predicted: f64,
    pub measured: f64,
    /// `(measured − predicted) / predicted`: 0.5 is 50% more than predicted (slower for a
    /// time, faster for tokens/s). Infinite or NaN when the prediction is 0.
    pub relative_error: f64,
}

/// The plan's predictions for its own layout (`parallel`), one per batch of its `pareto[]`
/// points of that layout, smallest batch first. These points, unlike `estimate`, carry TTFT
/// as well as TPOT and tokens/s, all for the plan's traffic (`workload`: `isl` prompt and
/// `osl` output tokens per request), and the batch is what a benchmark can set: that many
/// concurrent requests per replica. Empty when no point of the frontier has the plan's layout.
pub fn predictions(plan: &Plan) -> Vec<Prediction> {
    let gpus = plan.parallel.world_size() as f64;
    let mut out: Vec<Prediction> = plan
        .pareto
        .iter()
        .filter(|p| p.parallel == plan.parallel)
        .map(|p| Prediction {
            batch_per_replica: p.batch_per_replica,
            concurrency: p.batch_per_replica * plan.parallel.dp as u64,
            ttft_secs: p.ttft_secs,
            tpot_secs: p.tpot_secs,
            tokens_per_sec: p.tokens_per_sec_per_gpu * gpus,
        })
        .collect();
    out.sort_by_key(|p| p.batch_per_replica);
    out.dedup_by_key(|p| p.batch_per_replica);
    out
}

/// Why a plan's layout cannot be measured by starting `infer up` on one host: its ranks
/// span several hosts (the inter-host links it was costed on would not be crossed), or its
/// expert parallelism is not the one `infer up`'s engine runs (`ep` 1 or equal to `tp`).
/// `None` when it can.
pub fn unrunnable_here(plan: &Plan) -> Option<String> {
    let mut hosts: Vec<&str> = plan.ranks.iter().map(|r| r.host.as_str()).collect();
    hosts.sort_unstable();
    hosts.dedup();
    let Degrees { tp, ep, .. } = plan.parallel;
    if hosts.len() > 1 {
        return Some(format!(
            "the plan's {} ranks span {} hosts ({}), and the bench starts ranks on this host only",
            plan.world_size,
            hosts.len(),
            hosts.join(", ")
        ));
    }
    if ep != 1 && ep != tp {
        return Some(format!(
            "the plan shards experts over EP{ep} with TP{tp}, and `infer up` shards them over \
             each replica's TP group (EP equal to TP)"
        ));
    }
    None
}

/// The three rows of one concurrency: TTFT p50, TPOT p50 and tokens/s, each predicted,
/// measured and its relative error.
pub fn compare(prediction: &Prediction, measurement: &Measurement) -> Vec<Row> {
    [
        (
            "ttft_p50_secs",
            prediction.ttft_secs,
            measurement.ttft_p50_secs,
        ),
        (
            "tpot_p50_secs",
            prediction.tpot_secs,
            measurement.tpot_p50_secs,
        ),
        (
            "tokens_per_sec",
            prediction.tokens_per_sec,
            measurement.tokens_per_sec,
        ),
    ]
    .into_iter()
    .map(|(metric, predicted, measured)| Row {
        concurrency: prediction.concurrency,
        metric,
        predicted,
        measured,
        relative_error: (measured - predicted) / predicted,
    })
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_error_is_measured_minus_predicted_over_predicted() {
        let prediction = Prediction {
            batch_per_replica: 2,
            concurrency: 4,
            ttft_secs: 0.010,
            tpot_secs: 0.020,
            tokens_per_sec: 200.0,
        };
        let measurement = Measurement {
            ttft_p50_secs: 0.015,
            tpot_p50_secs: 0.010,
            tokens_per_sec: 200.0,
        };
        let rows = compare(&prediction, &measurement);
        let got: Vec<(&str, u64, f64, f64)> = rows
            .iter()
            .map(|r| (r.metric, r.concurrency, r.measured, r.relative_error))
            .collect();
        assert_eq!(
            got,
            [
                ("ttft_p50_secs", 4, 0.015, (0.015 - 0.010) / 0.010),
                ("tpot_p50_secs", 4, 0.010, -0.5),
                ("tokens_per_sec", 4, 200.0, 0.0),
            ]
        );
    }
}
