//! Planning speed: `deepseek-v3` on `128x8xh100-sxm` (1024 GPUs) with the full search: every
//! layout, the Pareto points of every batch for 2048/512-token requests within TPOT ≤ 50 ms,
//! and the disaggregated prefill/decode candidates.
//! Prints figures; the target (under 100 ms) is checked by reading them, not by a test.
#![allow(clippy::print_stdout)]

use std::path::Path;
use std::time::Instant;

fn main() {
    let spec = infer::model::profile("deepseek-v3")
        .expect("profile `deepseek-v3` ships with infer")
        .1;
    let settings = infer::plan::Settings {
        workload: infer::plan::sla::Workload {
            isl_tokens: 2048,
            osl_tokens: 512,
            ttft_target_secs: None,
            tpot_target_secs: Some(0.050),
            requests_per_sec: None,
        },
        disaggregate: true,
        ..infer::plan::Settings::default()
    };
    for cluster_name in ["16x8xh100-sxm", "128x8xh100-sxm"] {
        let cluster =
            infer::inventory::load(cluster_name, Path::new("/sys")).expect("shorthand parses");
        // One warm-up, then timed runs.
        let outcome = infer::plan::plan(&spec, &cluster, &settings);
        let iterations = 10;
        let start = Instant::now();
        for _ in 0..iterations {
            std::hint::black_box(infer::plan::plan(&spec, &cluster, &settings));
        }
        let per_plan_ms = start.elapsed().as_secs_f64() * 1e3 / iterations as f64;
        let chosen = match &outcome {
            infer::plan::Outcome::Feasible(plan) => format!(
                "{}; {} Pareto points; disaggregated: {}",
                plan.parallel,
                plan.pareto.len(),
                plan.disaggregated
                    .as_ref()
                    .map_or("none fits".to_string(), |d| format!(
                        "{} × {} prefill + {} × {} decode",
                        d.prefill_workers, d.prefill, d.decode_workers, d.decode
                    ))
            ),
            infer::plan::Outcome::Infeasible(_) => "infeasible".to_string(),
        };
        println!(
            "plan deepseek-v3 on {cluster_name:>15}: {per_plan_ms:8.2} ms per plan (mean of {iterations}), chose {chosen}"
        );
    }
}
