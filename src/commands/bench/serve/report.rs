//! `infer bench serve --plan`'s report: the layout measured, what each side ran on, and per
//! concurrency and metric, predicted, measured and the relative error.

use serde::Serialize;

use crate::degrees::Degrees;
use crate::plan::accuracy::Row;

/// `--plan --json`: the layout measured, what each side ran on, and every row.
#[derive(Serialize)]
pub(super) struct PlanCheck<'a> {
    /// The plan's model.
    pub(super) model: &'a str,
    /// The plan's layout, the one measured.
    pub(super) layout: Degrees,
    /// The cluster the plan's predictions are for (`infer plan`'s `cluster`).
    pub(super) predicted_for: &'a str,
    /// Where the measurements were taken.
    pub(super) measured_on: String,
    /// Prompt tokens of each request.
    pub(super) isl_tokens: u64,
    /// Output tokens of each request.
    pub(super) osl_tokens: u64,
    /// Predicted against measured, per concurrency and metric.
    pub(super) rows: Vec<Row>,
}

/// The comparison table: what each side ran on, then per concurrency and metric, predicted,
/// measured and the relative error.
pub(super) fn table(check: &PlanCheck<'_>) -> String {
    let mut lines = vec![
        format!(
            "predicted      {} for {} on {}, {} prompt + {} output tokens per request",
            check.layout, check.model, check.predicted_for, check.isl_tokens, check.osl_tokens
        ),
        format!("measured       {}", check.measured_on),
        format!(
            "{:>7}  {:<9} {:>12} {:>12} {:>10}",
            "streams", "metric", "predicted", "measured", "error"
        ),
    ];
    for row in &check.rows {
        let (name, scale, unit) = match row.metric {
            "ttft_p50_secs" => ("ttft p50", 1e3, "ms"),
            "tpot_p50_secs" => ("tpot p50", 1e3, "ms"),
            _ => ("tokens/s", 1.0, ""),
        };
        lines.push(format!(
            "{:>7}  {name:<9} {:>10.2}{unit:<2} {:>10.2}{unit:<2} {:>+9.1}%",
            row.concurrency,
            row.predicted * scale,
            row.measured * scale,
            row.relative_error * 100.0
        ));
    }
    lines.join("\n")
}
