//! `infer bench serve --plan`: a plan's predictions next to a benchmark of its layout on the
//! real SmolLM2 model, and the plans it refuses. See: #40

use std::path::Path;

use serde_json::Value;

use crate::support::process::run;

/// Writes `infer plan --json` for SmolLM2 on one H100 with short requests (`--isl 24 --osl
/// 6`) into `dir`; returns its path. The bench serves the plan's layout on this host's CPU.
fn write_plan(dir: &Path) -> String {
    let output = run(&[
        "plan",
        "--json",
        "--cluster",
        "1x1xh100-sxm",
        "--isl",
        "24",
        "--osl",
        "6",
    ]);
    assert_eq!(
        output.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let path = dir.join("plan.json");
    std::fs::write(&path, &output.stdout).expect("write the plan");
    path.display().to_string()
}

/// The plan's smallest concurrency (its layout's smallest `pareto` batch times DP).
fn smallest_concurrency(plan_path: &str) -> u64 {
    let plan: Value =
        serde_json::from_str(&std::fs::read_to_string(plan_path).expect("plan")).expect("JSON");
    let layout = &plan["parallel"];
    plan["pareto"]
        .as_array()
        .expect("pareto")
        .iter()
        .filter(|p| &p["parallel"] == layout)
        .map(|p| {
            p["batch_per_replica"].as_u64().expect("batch") * layout["dp"].as_u64().expect("dp")
        })
        .min()
        .expect("a point of the plan's layout")
}

/// Each `infer bench serve` with the extra arguments of `cases` exits 2 before any server
/// starts, its stderr naming the problem (the case's message), nothing on stdout.
fn assert_refused(cases: &[(&[&str], &str)]) {
    for (extra, message) in cases {
        let mut args = vec!["bench", "serve"];
        args.extend_from_slice(extra);
        let output = run(&args);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(message), "{args:?}: {stderr}");
        assert!(output.stdout.is_empty(), "{args:?}");
    }
}

/// The JSON has TTFT p50, TPOT p50 and tokens/s at the concurrency asked for, each with a
/// finite predicted and measured value and `relative_error = (measured − predicted) /
/// predicted`; it says what each side ran on.
#[test]
fn bench_serve_plan_reports_predicted_measured_and_error() {
    crate::support::model::smollm2();
    let dir = tempfile::tempdir().expect("temp dir");
    let plan = write_plan(dir.path());
    let concurrency = smallest_concurrency(&plan).to_string();
    let args = [
        "bench",
        "serve",
        "--plan",
        &plan,
        "--json",
        "--concurrency",
        &concurrency,
        "--rounds",
        "1",
        "--threads",
        "2",
    ];
    let output = run(&args);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(0), "{stderr}");
    let report: Value = serde_json::from_slice(&output.stdout).expect("stdout is JSON");
    assert_eq!(report["layout"]["tp"], 1, "{report}");
    assert!(
        report["predicted_for"]
            .as_str()
            .is_some_and(|s| !s.is_empty()),
        "{report}"
    );
    assert!(
        report["measured_on"]
            .as_str()
            .is_some_and(|s| s.contains("CPU")),
        "{report}"
    );
    let rows = report["rows"].as_array().expect("rows");
    let metrics: Vec<&str> = rows
        .iter()
        .map(|r| r["metric"].as_str().expect("metric"))
        .collect();
    assert_eq!(
        metrics,
        ["ttft_p50_secs", "tpot_p50_secs", "tokens_per_sec"],
        "{report}"
    );
    for row in rows {
        let get = |k: &str| row[k].as_f64().unwrap_or_else(|| panic!("{k} in {row}"));
        let (predicted, measured) = (get("predicted"), get("measured"));
        assert!(predicted.is_finite() && predicted > 0.0, "{row}");
        assert!(measured.is_finite() && measured > 0.0, "{row}");
        let expected = (measured - predicted) / predicted;
        assert!(
            (get("relative_error") - expected).abs() <= 1e-9 * expected.abs().max(1.0),
            "{row}"
        );
        assert_eq!(row["concurrency"].to_string(), concurrency, "{row}");
    }
}

/// A missing file, a file that is not a plan, `--tp` other than the plan's, and a
/// `--concurrency` the plan does not predict each exit 2 with a message naming the problem,
/// before any server starts.
#[test]
fn bench_serve_plan_refuses_bad_input() {
    crate::support::model::smollm2();
    let dir = tempfile::tempdir().expect("temp dir");
    let plan = write_plan(dir.path());
    let malformed = dir.path().join("malformed.json");
    std::fs::write(&malformed, "{\"parallel\": ").expect("write");
    let malformed = malformed.display().to_string();
    let missing = dir.path().join("missing.json").display().to_string();
    let cases: [(&[&str], &str); 5] = [
        (&["--plan", &missing], "failed to read the plan"),
        (
            &["--plan", &malformed],
            "is not a plan written by `infer plan --json`",
        ),
        (
            &["--plan", &plan, "--tp", "2"],
            "--tp 2 conflicts with the plan's layout TP1",
        ),
        (
            &["--plan", &plan, "--concurrency", "7777"],
            "keeps none of the plan's concurrencies",
        ),
        (
            &["--plan", &plan, "--model", "x.gguf"],
            "cannot be used with",
        ),
    ];
    assert_refused(&cases);
}

/// `--load-format dummy` measures a plan for a profile, which has no weights to load: the
/// server gets random weights of the plan's model in its dtype (int8, planned on CPU ranks
/// as Q8_0), and the comparison comes out as for a file. The plans and flags it cannot
/// measure exit 2 naming the problem. See: #40
#[test]
fn bench_serve_plan_measures_a_profile_with_random_weights() {
    let dir = tempfile::tempdir().expect("temp dir");
    let write = |name: &str, dtype: &str| {
        let output = run(&[
            "plan",
            "--json",
            "--model",
            "smollm2-135m",
            "--cluster",
            "local",
            "--dtype",
            dtype,
            "--max-model-len",
            "512",
            "--isl",
            "16",
            "--osl",
            "4",
            "--tp",
            "1",
            "--pp",
            "1",
            "--dp",
            "1",
        ]);
        assert_eq!(
            output.status.code(),
            Some(0),
            "{}",
            String::from_utf8_lossy(&output.stderr)
        );
        let path = dir.path().join(name);
        std::fs::write(&path, &output.stdout).expect("write the plan");
        path.display().to_string()
    };
    let int8 = write("int8.json", "int8");
    // CPU ranks run int8 as the engine's Q8_0, the LM head in it too: the plan says so, and
    // the random weights are what it planned.
    let planned: Value =
        serde_json::from_slice(&std::fs::read(&int8).expect("read the plan")).expect("JSON");
    assert_eq!(planned["dtype"], "q8_0", "{planned}");
    let fp8 = write("fp8.json", "fp8");
    let cases: [(&[&str], &str); 5] = [
        (&["--plan", &int8], "add --load-format dummy"),
        (
            &[
                "--plan",
                &int8,
                "--load-format",
                "dummy",
                "--num-layers",
                "2",
            ],
            "cuts the model the plan is for",
        ),
        (
            &["--plan", &fp8, "--load-format", "dummy"],
            "`fp8` has no random-weight type",
        ),
        (&["--load-format", "dummy"], "needs --model"),
        (&["--dtype", "q8_0"], "add --load-format dummy"),
    ];
    assert_refused(&cases);
    let concurrency = smallest_concurrency(&int8).to_string();
    let output = run(&[
        "bench",
        "serve",
        "--plan",
        &int8,
        "--load-format",
        "dummy",
        "--json",
        "--concurrency",
        &concurrency,
        "--rounds",
        "1",
    ]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(0), "{stderr}");
    let report: Value = serde_json::from_slice(&output.stdout).expect("stdout is JSON");
    assert_eq!(report["model"], "smollm2-135m", "{report}");
    let rows = report["rows"].as_array().expect("rows");
    assert_eq!(rows.len(), 3, "{report}");
    for row in rows {
        let measured = row["measured"].as_f64().expect("measured");
        assert!(measured.is_finite() && measured > 0.0, "{row}");
    }
}
