//! Measured link figures that replace the datasheet constants (`infer plan --calibration
//! FILE`): an all-reduce table as nccl-tests' `all_reduce_perf` prints it — what users have
//! — or as `infer bench allreduce` prints it (the same columns). Pure: the text comes in.
//!
//! From a table: the link's bandwidth is the highest bus bandwidth of any size (`busbw`:
//! what each link of a ring carries, comparable with a link rate — nccl-tests'
//! `doc/PERFORMANCE.md`), its per-call latency the time of the smallest size. Whether it
//! measured links inside one host or between hosts comes from nccl-tests' `#  Rank … on
//! HOST device …` lines (one host or several) or `infer bench allreduce`'s header ("on
//! this host", "spans hosts").
//!
//! Or the JSON `infer bench allreduce --json` prints ([`AllreduceReport`]: the same rows,
//! with the scope stated), or the JSON `infer bench decode --json` prints ([`DecodeReport`]:
//! a decode step's time and the weight bytes it read, on one device). A decode measurement
//! on one of the cluster's GPU models replaces that model's datasheet HBM bandwidth with the
//! bandwidth the engine achieved; one on the CPU of a cluster of CPU hosts replaces the
//! probed memory bandwidth the same way, and the probed compute rate with the rate its
//! prefill achieved ([`calibrate`](super::cluster::calibrate)).

use anyhow::{Result, bail};
use serde::{Deserialize, Serialize};

/// Where a measured link runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Scope {
    /// Between GPUs of one host (NVLink, PCIe): TP, EP and PP groups inside a host.
    IntraHost,
    /// Between hosts: groups that span hosts, and the KV transfer of disaggregation.
    InterHost,
}

/// One measured link; [`MeasuredLink::link`] (in [`cost`](super::cost)) is the cost model's view
/// of it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MeasuredLink {
    pub scope: Scope,
    /// Highest bus bandwidth of the table, bytes/s.
    pub bytes_per_sec: f64,
    /// Time of the smallest all-reduce, seconds.
    pub latency_secs: f64,
    /// One 8-byte send/recv over the same transport, seconds, where the report has it
    /// (`infer bench allreduce --json` from this version on; not nccl-tests' tables).
    #[serde(default)]
    pub message_latency_secs: Option<f64>,
    /// Where it came from (the file name) and what it measured (`8 ranks on 1 host`).
    pub source: String,
}

/// A decode step measured on one GPU model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MeasuredDecode {
    /// The hardware profile it ran on (`h100-sxm`).
    pub hardware_id: String,
    /// The device's own name (`NVIDIA H100 80GB HBM3`).
    pub device_name: String,
    /// Weight bytes one decode step read over the step's time, bytes/s: what the plan uses
    /// as that GPU's HBM bandwidth.
    pub bytes_per_sec: f64,
    /// The profile's datasheet figure it replaces (a CPU's probed one), bytes/s.
    pub datasheet_bytes_per_sec: f64,
    /// On a CPU: the compute rate its prefill achieved, flops/s, which replaces the probed
    /// one; `None` on a GPU, or from a report without `prefill_flops_per_sec`.
    #[serde(default)]
    pub flops_per_sec: Option<f64>,
    /// The probed compute rate `flops_per_sec` replaces, flops/s.
    #[serde(default)]
    pub probed_flops_per_sec: Option<f64>,
    /// Where it came from (the file name, the model, the batch).
    pub source: String,
}

/// Measurements that replace the datasheet figures: at most one per scope, one decode
/// measurement per GPU model.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Calibration {
    pub intra_host: Option<MeasuredLink>,
    pub inter_host: Option<MeasuredLink>,
    #[serde(default)]
    pub decode: Vec<MeasuredDecode>,
}

/// `infer bench allreduce --json`: one table per transport measured.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AllreduceReport {
    /// Always `"allreduce"`: what the file is.
    pub bench: String,
    pub tables: Vec<AllreduceTable>,
    /// One plain TCP stream between two of the processes, bytes/s.
    pub stream_bytes_per_sec: f64,
}

/// One transport's all-reduce sizes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AllreduceTable {
    /// What carried it (`TCP ring over loopback`, `shared memory`, `TCP`).
    pub transport: String,
    pub scope: Scope,
    /// Processes in the group.
    pub world_size: usize,
    /// The hosts they ran on (empty: this host).
    pub hosts: Vec<String>,
    /// One 8-byte send/recv between two of the processes, seconds (half a ping-pong round
    /// trip); absent from reports of earlier versions.
    #[serde(default)]
    pub message_secs: Option<f64>,
    pub rows: Vec<AllreduceJsonRow>,
}

/// One message size.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AllreduceJsonRow {
    pub bytes: u64,
    /// Time of one all-reduce, seconds.
    pub time_secs: f64,
    /// `bytes / time_secs`, bytes/s.
    pub algbw_bytes_per_sec: f64,
    /// `algbw · 2(n−1)/n`, bytes/s (nccl-tests' `doc/PERFORMANCE.md`).
    pub busbw_bytes_per_sec: f64,
}

/// `infer bench decode --json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DecodeReport {
    /// Always `"decode"`: what the file is.
    pub bench: String,
    /// The model's name.
    pub model: String,
    /// `cpu` or `cuda`.
    pub device: String,
    /// The processor's or the GPU's name (`/proc/cpuinfo`'s model name, NVML's name).
    pub device_name: String,
    pub threads: usize,
    pub numerics: String,
    /// Sequences per decode step.
    pub batch: usize,
    pub prompt_tokens: usize,
    /// Tokens decoded per sequence in the timed loop.
    pub decode_tokens: usize,
    pub prefill_tokens_per_sec: f64,
    /// The prefill's arithmetic per second, flops/s: the planner's count of a prompt of
    /// `prompt_tokens` (the layers' products, the last token's logits and causal attention,
    /// as `cost::prefill_flops`) times `prefill_tokens_per_sec / prompt_tokens`. On a CPU it
    /// replaces the probed compute rate. Absent from older reports.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_flops_per_sec: Option<f64>,
    /// The causal attention part of the prompt's arithmetic, flops (`2 · tokens² · n_heads ·
    /// head_dim` per layer, as `cost::prefill_attention_flops`). Absent from older reports
    /// and from GPU runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_attention_flops: Option<f64>,
    /// The model's own prefill attention rate on this CPU, flops/s
    /// (`runtime::exec::bench::engine_prefill_attention_flops_per_sec`): with
    /// `prefill_attention_flops` it splits the prefill's time between its products and its
    /// attention, which a plan costs apart. Absent from older reports, from GPU runs and
    /// where not measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_attention_flops_per_sec: Option<f64>,
    /// Tokens of all sequences per second.
    pub decode_tokens_per_sec: f64,
    /// Time of one decode step of the whole batch, seconds.
    pub decode_step_secs: f64,
    /// Weight bytes one decode step reads (every layer's matrices and the LM head; the
    /// embedding only looks up rows), bytes.
    pub decode_weight_bytes: u64,
    /// `decode_weight_bytes / decode_step_secs`, bytes/s (KV cache reads not counted).
    pub weight_bytes_per_sec: f64,
    /// Attention arithmetic of an average step of the timed loop: every sequence's
    /// `prompt_tokens + decode_tokens / 2` cached positions, `4 · n_heads · head_dim` flops
    /// each per layer (the planner's count). Flops. Absent from older reports and from GPU
    /// runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode_attention_flops: Option<u64>,
    /// The model's KV heads: each layer's decode attention runs `batch · kv_heads` tasks on
    /// the `threads`. Absent from older reports and from GPU runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_heads: Option<usize>,
    /// The model's own decode attention rate on this CPU, flops/s of the planner's count
    /// (`runtime::exec::bench::engine_decode_attention_rate`): one sequence on `threads`
    /// threads, `kv_heads` tasks a layer. With it a calibration costs a plan's attention at
    /// the model's rate rather than the planner's probe's, whose shape differs. Absent from
    /// older reports, from GPU runs and where not measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode_attention_flops_per_sec: Option<f64>,
    /// The share of the prompt rate on `threads` threads that one thread of the model
    /// computes while every one of them runs one, side by side
    /// (`runtime::exec::bench::engine_prompt_run`): what a one-thread rank of
    /// this model gets. Absent from older reports, from GPU runs and on one thread.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_one_thread_share: Option<f64>,
    pub peak_rss_bytes: u64,
    /// GPU memory in use after the run (`--device cuda`), bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_memory_used_bytes: Option<u64>,
    /// The GPU's datasheet HBM bandwidth (its hardware profile in `profiles/hardware/`),
    /// bytes/s, when the GPU has a profile.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hbm_bytes_per_sec: Option<f64>,
    /// Every batch measured, best run of each (`--device cuda`: batch 1 and 16); the
    /// top-level figures are the last one's.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub batches: Vec<BatchSpeed>,
}

/// One batch size of `infer bench decode --device cuda`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BatchSpeed {
    /// Sequences per decode step.
    pub batch: usize,
    /// Tokens of all sequences per second.
    pub decode_tokens_per_sec: f64,
    /// Time of one decode step of the whole batch, seconds.
    pub decode_step_secs: f64,
    /// Weight bytes read per step over the step's time, bytes/s.
    pub weight_bytes_per_sec: f64,
    /// `weight_bytes_per_sec` over the datasheet's HBM bandwidth (0.7 is 70%), when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hbm_fraction: Option<f64>,
    /// Kernel launches (and GEMMs) per decode step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub launches_per_step: Option<f64>,
    /// Seconds the host spends issuing one step's work; near `decode_step_secs`, the step
    /// is bound by the host's launches rather than the GPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub issue_step_secs: Option<f64>,
}

/// One measurement read from a `--calibration` file.
#[derive(Clone, Debug, PartialEq)]
pub enum Measurement {
    Link(MeasuredLink),
    Decode(Box<DecodeReport>),
}

/// Reads a calibration file: JSON from `infer bench allreduce --json` or `infer bench
/// decode --json`, else an all-reduce table ([`parse_allreduce_table`]).
///
/// Errors: JSON of another shape, or what [`parse_allreduce_table`] refuses.
pub fn parse(name: &str, text: &str) -> Result<Measurement> {
    if !text.trim_start().starts_with('{') {
        return parse_allreduce_table(name, text).map(Measurement::Link);
    }
    let value: serde_json::Value = serde_json::from_str(text)
        .map_err(|e| anyhow::anyhow!("`{name}` is not valid JSON: {e}"))?;
    match value.get("bench").and_then(|b| b.as_str()) {
        Some("allreduce") => {
            let report: AllreduceReport = serde_json::from_value(value).map_err(|e| {
                anyhow::anyhow!("`{name}` is not `infer bench allreduce --json` output: {e}")
            })?;
            link_from_report(name, &report).map(Measurement::Link)
        }
        Some("decode") => {
            let report: DecodeReport = serde_json::from_value(value).map_err(|e| {
                anyhow::anyhow!("`{name}` is not `infer bench decode --json` output: {e}")
            })?;
            if !(report.weight_bytes_per_sec > 0.0 && report.weight_bytes_per_sec.is_finite()) {
                bail!("`{name}`: `weight_bytes_per_sec` must be positive");
            }
            Ok(Measurement::Decode(Box::new(report)))
        }
        _ => bail!(
            "`{name}` is JSON but not a benchmark's (`\"bench\": \"allreduce\"` or `\"decode\"`): give `infer bench \
             allreduce --json`, `infer bench decode --json` or an nccl-tests table"
        ),
    }
}

/// The link of `report`'s fastest table (ranks use the fastest transport they have: shared
/// memory over the TCP ring on one host).
fn link_from_report(name: &str, report: &AllreduceReport) -> Result<MeasuredLink> {
    let peak = |t: &AllreduceTable| {
        t.rows
            .iter()
            .map(|r| r.busbw_bytes_per_sec)
            .fold(0.0, f64::max)
    };
    let Some(table) = report
        .tables
        .iter()
        .filter(|t| !t.rows.is_empty())
        .max_by(|a, b| peak(a).total_cmp(&peak(b)))
    else {
        bail!("`{name}` has no all-reduce rows");
    };
    let place = if table.hosts.is_empty() {
        "this host".to_string()
    } else {
        format!("hosts {}", table.hosts.join(", "))
    };
    let rows: Vec<(u64, f64, f64)> = table
        .rows
        .iter()
        .map(|r| (r.bytes, r.time_secs, r.busbw_bytes_per_sec))
        .collect();
    let mut link = link_from_rows(
        name,
        table.scope,
        &rows,
        format!(
            "`{name}`, {} ranks on {place} ({})",
            table.world_size, table.transport
        ),
    )?;
    link.message_latency_secs = table
        .message_secs
        .filter(|secs| *secs > 0.0 && secs.is_finite());
    Ok(link)
}

/// Reads one all-reduce table (`name` names it in the plan and in errors).
///
/// Errors: no data rows, or no way to tell whether it ran inside one host or across hosts.
pub(crate) fn parse_allreduce_table(name: &str, text: &str) -> Result<MeasuredLink> {
    let mut hosts: Vec<String> = Vec::new();
    let mut ranks = 0usize;
    let mut header_scope = None;
    let mut has_redop = false;
    let mut rows: Vec<(u64, f64, f64)> = Vec::new(); // (bytes, time µs, busbw GB/s)
    for line in text.lines() {
        let trimmed = line.trim();
        if let Some(rest) = trimmed.strip_prefix('#') {
            let words: Vec<&str> = rest.split_whitespace().collect();
            // nccl-tests: `#  Rank  0 Group  0 Pid  1234 on  node-1 device  0 [0x18] …`
            if words.first() == Some(&"Rank")
                && let Some(at) = words.iter().position(|w| *w == "on")
                && let Some(host) = words.get(at + 1)
            {
                ranks += 1;
                if !hosts.iter().any(|h| h == host) {
                    hosts.push(host.to_string());
                }
            }
            if words.contains(&"redop") {
                has_redop = true;
            }
            if rest.contains("all-reduce") {
                if rest.contains("spans hosts")
                    || rest.contains("one per host")
                    || rest.contains(" on hosts ")
                {
                    header_scope = Some(Scope::InterHost);
                } else if rest.contains("on this host") {
                    header_scope = Some(Scope::IntraHost);
                }
            }
            continue;
        }
        let fields: Vec<&str> = trimmed.split_whitespace().collect();
        let Some(bytes) = fields.first().and_then(|f| f.parse::<u64>().ok()) else {
            continue;
        };
        // size count type [redop root] time algbw busbw …: out-of-place columns.
        let at = if has_redop { 5 } else { 3 };
        let number = |i: usize| fields.get(i).and_then(|f| f.parse::<f64>().ok());
        if let (Some(time_us), Some(busbw)) = (number(at), number(at + 2)) {
            rows.push((bytes, time_us, busbw));
        }
    }
    if rows.is_empty() {
        bail!(
            "`{name}` has no all-reduce rows (`size count type … time algbw busbw`): paste nccl-tests' `all_reduce_perf` \
             output or `infer bench allreduce`'s"
        );
    }
    let scope = match (hosts.len(), header_scope) {
        (0, Some(scope)) => scope,
        (0, None) => bail!(
            "`{name}` does not say whether it ran inside one host or across hosts: keep nccl-tests' `#  Rank … on HOST` \
             lines (its default output), or use `infer bench allreduce`'s table"
        ),
        (1, _) => Scope::IntraHost,
        (_, _) => Scope::InterHost,
    };
    // In the shared units: bytes, seconds, bytes/s.
    let rows: Vec<(u64, f64, f64)> = rows
        .iter()
        .map(|&(bytes, time_us, busbw_gbs)| (bytes, time_us * 1e-6, busbw_gbs * 1e9))
        .collect();
    let source = if hosts.is_empty() {
        format!("`{name}`")
    } else {
        format!(
            "`{name}`, {ranks} ranks on {} host{}",
            hosts.len(),
            if hosts.len() == 1 { "" } else { "s" }
        )
    };
    link_from_rows(name, scope, &rows, source)
}

/// The link of an all-reduce table's `(bytes, time_secs, busbw_bytes_per_sec)` rows: its
/// highest bus bandwidth and the time of its smallest message.
///
/// Errors: no rows, a bandwidth or time that is not positive.
fn link_from_rows(
    name: &str,
    scope: Scope,
    rows: &[(u64, f64, f64)],
    source: String,
) -> Result<MeasuredLink> {
    let Some(smallest) = rows.iter().min_by_key(|r| r.0) else {
        bail!("`{name}` has no all-reduce rows");
    };
    let peak = rows.iter().map(|r| r.2).fold(0.0, f64::max);
    if !(peak > 0.0 && smallest.1 > 0.0) {
        bail!("`{name}`: the table's bus bandwidths and times must be positive");
    }
    Ok(MeasuredLink {
        scope,
        bytes_per_sec: peak,
        latency_secs: smallest.1,
        message_latency_secs: None,
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::cluster::calibrate;

    /// nccl-tests' layout (out-of-place and in-place columns), two hosts.
    const NCCL_TESTS: &str = "\
# nThread 1 nGpus 1 minBytes 8 maxBytes 134217728 step: 2(factor) warmup iters: 5 iters: 20 agg iters: 1 validation: 1 graph: 0
#
# Using devices
#  Rank  0 Group  0 Pid  41211 on   node-a device  0 [0x18] NVIDIA H100 80GB HBM3
#  Rank  1 Group  0 Pid  41212 on   node-a device  1 [0x2a] NVIDIA H100 80GB HBM3
#  Rank  2 Group  0 Pid  52001 on   node-b device  0 [0x18] NVIDIA H100 80GB HBM3
#  Rank  3 Group  0 Pid  52002 on   node-b device  1 [0x2a] NVIDIA H100 80GB HBM3
#
#                                                              out-of-place                       in-place
#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
           8             2     float     sum      -1    31.50    0.00    0.00      0    30.90    0.00    0.00      0
        1024           256     float     sum      -1    33.10    0.03    0.05      0    32.80    0.03    0.05      0
    67108864      16777216     float     sum      -1   2890.1   23.22   34.83      0   2885.4   23.26   34.89      0
   134217728      33554432     float     sum      -1   5701.0   23.54   35.31      0   5699.2   23.55   35.32      0
# Out of bounds values : 0 OK
# Avg bus bandwidth    : 17.549
";

    #[test]
    fn nccl_tests_tables_give_the_peak_busbw_and_the_small_message_time() {
        let link = parse_allreduce_table("ar.txt", NCCL_TESTS).expect("parses");
        assert_eq!(link.scope, Scope::InterHost);
        assert!((link.bytes_per_sec - 35.31e9).abs() < 1.0, "{link:?}");
        assert!((link.latency_secs - 31.5e-6).abs() < 1e-12, "{link:?}");
        assert_eq!(link.source, "`ar.txt`, 4 ranks on 2 hosts");
        let one_host = NCCL_TESTS.replace("node-b", "node-a");
        assert_eq!(
            parse_allreduce_table("x", &one_host).expect("parses").scope,
            Scope::IntraHost
        );
    }

    #[test]
    fn our_own_table_and_bad_input() {
        let ours = "\
# all-reduce (sum, float32): 3 ranks, one per host (h0, h1, h2), TCP: the group spans hosts
#       size        count   type       time    algbw    busbw
#        (B)   (elements)              (us)   (GB/s)   (GB/s)
           8            2  float       48.0    0.000    0.000
    67108864     16777216  float   114762.3    0.585    0.780
";
        let link = parse_allreduce_table("bench.txt", ours).expect("parses");
        assert_eq!(link.scope, Scope::InterHost);
        assert!((link.bytes_per_sec - 0.78e9).abs() < 1.0);
        assert!((link.latency_secs - 48e-6).abs() < 1e-12);
        // `infer bench allreduce --cluster`'s header.
        let cluster = ours.replace(
            "3 ranks, one per host (h0, h1, h2), TCP: the group spans hosts",
            "4 processes on hosts h0, h1 over the data network (TCP)",
        );
        assert_eq!(
            parse_allreduce_table("c", &cluster).expect("parses").scope,
            Scope::InterHost
        );
        let local = ours.replace(
            "3 ranks, one per host (h0, h1, h2), TCP: the group spans hosts",
            "TCP ring over loopback, 2 processes on this host",
        );
        assert_eq!(
            parse_allreduce_table("l", &local).expect("parses").scope,
            Scope::IntraHost
        );
        assert!(parse_allreduce_table("empty", "# nothing\n").is_err());
        let anonymous: String = NCCL_TESTS
            .lines()
            .filter(|l| !l.contains("Rank"))
            .collect::<Vec<_>>()
            .join("\n");
        let error = parse_allreduce_table("anon", &anonymous).expect_err("scope unknown");
        assert!(error.to_string().contains("Rank"), "{error}");
    }

    #[test]
    fn json_reports_and_what_is_refused() {
        let row = |bytes: u64, time_secs: f64, busbw: f64| AllreduceJsonRow {
            bytes,
            time_secs,
            algbw_bytes_per_sec: busbw,
            busbw_bytes_per_sec: busbw,
        };
        let report = AllreduceReport {
            bench: "allreduce".into(),
            tables: vec![
                AllreduceTable {
                    transport: "TCP ring over loopback".into(),
                    scope: Scope::IntraHost,
                    world_size: 2,
                    hosts: Vec::new(),
                    message_secs: Some(30e-6),
                    rows: vec![row(8, 50e-6, 1e5), row(1 << 20, 1e-3, 1e9)],
                },
                AllreduceTable {
                    transport: "shared memory".into(),
                    scope: Scope::IntraHost,
                    world_size: 2,
                    hosts: Vec::new(),
                    message_secs: Some(0.5e-6),
                    rows: vec![row(8, 2e-6, 4e6), row(1 << 20, 1e-4, 9e9)],
                },
            ],
            stream_bytes_per_sec: 3e9,
        };
        let text = serde_json::to_string(&report).expect("serializes");
        // The fastest table is the one ranks use.
        let Measurement::Link(link) = parse("ar.json", &text).expect("parses") else {
            panic!("a link");
        };
        assert_eq!(link.scope, Scope::IntraHost);
        assert_eq!(link.bytes_per_sec, 9e9);
        assert_eq!(link.latency_secs, 2e-6);
        // Its own transport's message latency, which the chain's hops pay.
        assert_eq!(link.message_latency_secs, Some(0.5e-6));
        assert_eq!(link.link().message_latency_secs, 0.5e-6);
        // A report of an earlier version has none: a message costs the all-reduce floor.
        let mut earlier: serde_json::Value = serde_json::from_str(&text).expect("JSON");
        for table in earlier["tables"].as_array_mut().expect("tables") {
            table
                .as_object_mut()
                .expect("a table")
                .remove("message_secs")
                .expect("measured");
        }
        let earlier = earlier.to_string();
        let Measurement::Link(link) = parse("ar.json", &earlier).expect("parses") else {
            panic!("a link");
        };
        assert_eq!(link.message_latency_secs, None);
        assert_eq!(link.link().message_latency_secs, 2e-6);
        assert_eq!(
            link.source,
            "`ar.json`, 2 ranks on this host (shared memory)"
        );
        let error = parse("x.json", r#"{"bench": "serve"}"#).expect_err("not ours");
        assert!(error.to_string().contains("not a benchmark's"), "{error}");
        let error = parse("x.json", r#"{"bench": "decode"}"#).expect_err("fields missing");
        assert!(
            error.to_string().contains("infer bench decode --json"),
            "{error}"
        );
        assert!(parse("x.json", "{ not json").is_err());

        let decode = DecodeReport {
            bench: "decode".into(),
            model: "m.gguf".into(),
            device: "cuda".into(),
            device_name: "NVIDIA L4".into(),
            threads: 1,
            numerics: "exact".into(),
            batch: 1,
            prompt_tokens: 16,
            decode_tokens: 8,
            prefill_tokens_per_sec: 1.0,
            prefill_flops_per_sec: None,
            prefill_attention_flops: None,
            prefill_attention_flops_per_sec: None,
            decode_tokens_per_sec: 100.0,
            decode_step_secs: 0.01,
            decode_weight_bytes: 1_000_000_000,
            weight_bytes_per_sec: 2e11,
            decode_attention_flops: None,
            kv_heads: None,
            decode_attention_flops_per_sec: None,
            prefill_one_thread_share: None,
            peak_rss_bytes: 0,
            gpu_memory_used_bytes: None,
            hbm_bytes_per_sec: None,
            batches: Vec::new(),
        };
        let mut cluster =
            crate::inventory::load("2x4xl4", std::path::Path::new("/sys")).expect("a shorthand");
        let datasheet = cluster.hosts[0].hardware.hbm_gb_per_sec;
        calibrate(
            &mut cluster,
            "l4.json",
            Measurement::Decode(Box::new(decode.clone())),
        )
        .expect("an L4");
        assert!(
            cluster
                .hosts
                .iter()
                .all(|h| h.hardware.hbm_gb_per_sec == 200.0)
        );
        assert_eq!(
            cluster.measured.decode[0].datasheet_bytes_per_sec,
            datasheet * 1e9
        );
        let again = calibrate(
            &mut cluster,
            "l4.json",
            Measurement::Decode(Box::new(decode.clone())),
        );
        assert!(
            again
                .expect_err("twice")
                .to_string()
                .contains("one per GPU model")
        );
        let mut h100 = decode;
        h100.device_name = "NVIDIA H100 80GB HBM3".into();
        let error = calibrate(&mut cluster, "h.json", Measurement::Decode(Box::new(h100)))
            .expect_err("not this cluster's GPU");
        assert!(
            error.to_string().contains("not on this cluster's GPUs"),
            "{error}"
        );
    }
}
