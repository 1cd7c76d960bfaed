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

use anyhow::{Result, bail};
use serde::{Deserialize, Serialize};

use super::cost::Link;

/// Where a measured link runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Scope {
    /// Between GPUs of one host (NVLink, PCIe): TP, EP and PP groups inside a host.
    IntraHost,
    /// Between hosts: groups that span hosts, and the KV transfer of disaggregation.
    InterHost,
}

/// One measured link.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MeasuredLink {
    pub scope: Scope,
    /// Highest bus bandwidth of the table, bytes/s.
    pub bytes_per_sec: f64,
    /// Time of the smallest all-reduce, seconds.
    pub latency_secs: f64,
    /// Where it came from (the file name) and what it measured (`8 ranks on 1 host`).
    pub source: String,
}

impl MeasuredLink {
    /// The cost model's link.
    pub fn link(&self) -> Link {
        Link {
            bytes_per_sec: self.bytes_per_sec,
            latency_secs: self.latency_secs,
        }
    }
}

/// Measurements that replace the datasheet figures: at most one per scope.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Calibration {
    pub intra_host: Option<MeasuredLink>,
    pub inter_host: Option<MeasuredLink>,
}

/// Reads one all-reduce table (`name` names it in the plan and in errors).
///
/// Errors: no data rows, or no way to tell whether it ran inside one host or across hosts.
pub fn parse_allreduce_table(name: &str, text: &str) -> Result<MeasuredLink> {
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
    let smallest = rows.iter().min_by_key(|r| r.0).expect("rows is not empty");
    let peak = rows.iter().map(|r| r.2).fold(0.0, f64::max);
    if !(peak > 0.0 && smallest.1 > 0.0) {
        bail!("`{name}`: the table's bus bandwidths and times must be positive");
    }
    let source = if hosts.is_empty() {
        format!("`{name}`")
    } else {
        format!(
            "`{name}`, {ranks} ranks on {} host{}",
            hosts.len(),
            if hosts.len() == 1 { "" } else { "s" }
        )
    };
    Ok(MeasuredLink {
        scope,
        bytes_per_sec: peak * 1e9,
        latency_secs: smallest.1 * 1e-6,
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
