//! `GET /metrics`' Prometheus text: every replica's counters and histograms added up, by
//! prefill/decode role under disaggregation, and the data-parallel router's counts. Every
//! metric name and help text here is part of the API (dashboards and tests read them).

use super::health::Verdict;
use super::router::RouteReason;
use super::scheduler::{HistogramSnapshot, MetricsSnapshot};

/// One plain Prometheus series of `/metrics`: its name, help, type and value.
struct Series {
    name: &'static str,
    help: &'static str,
    /// `gauge` or `counter`.
    kind: &'static str,
    value: fn(&MetricsSnapshot) -> u64,
}

/// Every plain series of `/metrics`, in the order they are rendered.
const SERIES: [Series; 19] = [
    Series {
        name: "infer_requests_running",
        help: "Sequences in the running batch.",
        kind: "gauge",
        value: |m| m.running,
    },
    Series {
        name: "infer_requests_waiting",
        help: "Requests waiting to join the batch.",
        kind: "gauge",
        value: |m| m.waiting,
    },
    Series {
        name: "infer_requests_total",
        help: "Requests received.",
        kind: "counter",
        value: |m| m.requests_total,
    },
    Series {
        name: "infer_prompt_tokens_total",
        help: "Prompt tokens processed.",
        kind: "counter",
        value: |m| m.prompt_tokens_total,
    },
    Series {
        name: "infer_generation_tokens_total",
        help: "Tokens generated.",
        kind: "counter",
        value: |m| m.generation_tokens_total,
    },
    Series {
        name: "infer_kv_cache_bytes",
        help: "KV-cache bytes held by running sequences.",
        kind: "gauge",
        value: |m| m.kv_cache_bytes,
    },
    Series {
        name: "infer_kv_cache_blocks_used",
        help: "KV-cache blocks (16 positions each) held by live sequences.",
        kind: "gauge",
        value: |m| m.kv_blocks_used,
    },
    Series {
        name: "infer_kv_cache_blocks_total",
        help: "KV-cache blocks the pool can hold.",
        kind: "gauge",
        value: |m| m.kv_blocks_total,
    },
    Series {
        name: "infer_preemptions_total",
        help: "Sequences preempted (KV blocks freed, recomputed later) because blocks ran out.",
        kind: "counter",
        value: |m| m.preemptions_total,
    },
    Series {
        name: "infer_prefix_cache_queries_total",
        help: "Prompt tokens of admitted sequences looked up in the prefix cache.",
        kind: "counter",
        value: |m| m.prefix_cache_queries_total,
    },
    Series {
        name: "infer_prefix_cache_hits_total",
        help: "Prompt tokens whose KV blocks the prefix cache supplied.",
        kind: "counter",
        value: |m| m.prefix_cache_hits_total,
    },
    Series {
        name: "infer_pd_kv_bytes_sent_total",
        help: "Prefill/decode disaggregation: KV bytes prefill replicas sent to decode replicas (by each driver rank's shard).",
        kind: "counter",
        value: |m| m.pd_kv_bytes_sent_total,
    },
    Series {
        name: "infer_pd_kv_send_microseconds_total",
        help: "Prefill/decode disaggregation: time spent sending those KV bytes, microseconds.",
        kind: "counter",
        value: |m| m.pd_kv_send_micros_total,
    },
    Series {
        name: "infer_pd_kv_bytes_sent_shm_total",
        help: "Prefill/decode disaggregation: of the KV bytes sent, those that went through a shared ring in /dev/shm (prefill and decode rank on one host); the rest went over TCP.",
        kind: "counter",
        value: |m| m.pd_kv_bytes_sent_shm_total,
    },
    Series {
        name: "infer_pd_kv_parts_sent_total",
        help: "Prefill/decode disaggregation: KV parts sent, each a chunk of a prompt's positions as the prefill computed it (by each driver rank's shard).",
        kind: "counter",
        value: |m| m.pd_kv_parts_sent_total,
    },
    Series {
        name: "infer_pd_handoffs_total",
        help: "Prefill/decode disaggregation: requests a prefill replica handed to a decode replica.",
        kind: "counter",
        value: |m| m.pd_handoffs_total,
    },
    Series {
        name: "infer_pd_decode_prefill_tokens_total",
        help: "Prefill/decode disaggregation: prompt tokens a decode replica computed itself (recomputation after preemption).",
        kind: "counter",
        value: |m| m.pd_decode_prefill_tokens_total,
    },
    Series {
        name: "infer_pd_transfer_failures_total",
        help: "Prefill/decode disaggregation: requests failed because their KV transfer failed.",
        kind: "counter",
        value: |m| m.pd_transfer_failures_total,
    },
    Series {
        name: "infer_prefix_cache_evictions_total",
        help: "Cached KV blocks evicted (least recently used first) to make room.",
        kind: "counter",
        value: |m| m.prefix_cache_evictions_total,
    },
];

/// The Prometheus text of every replica's metrics added up (`m`): the KV-cache usage and
/// prefix-cache hit ratios, every [`SERIES`], and the TTFT and TPOT histograms (seconds).
pub(super) fn render_totals(m: &MetricsSnapshot) -> String {
    let mut text = format!(
        "# HELP infer_kv_cache_usage_ratio Fraction of the KV-cache blocks in use (0 to 1).\n# TYPE infer_kv_cache_usage_ratio gauge\ninfer_kv_cache_usage_ratio {}\n",
        m.kv_blocks_used as f64 / m.kv_blocks_total.max(1) as f64
    );
    text.push_str(&format!(
        "# HELP infer_prefix_cache_hit_rate Fraction of the looked-up prompt tokens found in the prefix cache (0 to 1).\n# TYPE infer_prefix_cache_hit_rate gauge\ninfer_prefix_cache_hit_rate {}\n",
        m.prefix_cache_hits_total as f64 / m.prefix_cache_queries_total.max(1) as f64
    ));
    for Series {
        name,
        help,
        kind,
        value,
    } in &SERIES
    {
        let value = value(m);
        text.push_str(&format!(
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}\n"
        ));
    }
    text.push_str("# HELP infer_requests_aborted_total Requests whose client went away (or that shutdown cancelled) before they finished, by where they were: waiting (dropped from the queue, never computed) or running (stopped early, KV freed).\n# TYPE infer_requests_aborted_total counter\n");
    for (stage, count) in [
        ("waiting", m.aborted_waiting_total),
        ("running", m.aborted_running_total),
    ] {
        text.push_str(&format!(
            "infer_requests_aborted_total{{stage=\"{stage}\"}} {count}\n"
        ));
    }
    text.push_str(
        &m.ttft
            .render("infer_time_to_first_token_seconds", "Time to first token."),
    );
    text.push_str(&m.tpot.render(
        "infer_time_per_output_token_seconds",
        "Time per output token after the first.",
    ));
    text.push_str(&m.e2e.render(
        "infer_e2e_request_latency_seconds",
        "Time from a request's arrival to its end.",
    ));
    text
}

/// vLLM's plain series: name, type, help and value (vLLM's help texts).
type VllmSeries = (
    &'static str,
    &'static str,
    &'static str,
    fn(&MetricsSnapshot) -> String,
);

/// Every plain series [`render_vllm`] writes, in order.
const VLLM_SERIES: [VllmSeries; 8] = [
    (
        "vllm:num_requests_running",
        "gauge",
        "Number of requests in model execution batches.",
        |m| m.running.to_string(),
    ),
    (
        "vllm:num_requests_waiting",
        "gauge",
        "Number of requests waiting to be processed.",
        |m| m.waiting.to_string(),
    ),
    (
        "vllm:kv_cache_usage_perc",
        "gauge",
        "KV-cache usage. 1 means 100 percent usage.",
        |m| (m.kv_blocks_used as f64 / m.kv_blocks_total.max(1) as f64).to_string(),
    ),
    (
        "vllm:prompt_tokens_total",
        "counter",
        "Number of prefill tokens processed.",
        |m| m.prompt_tokens_total.to_string(),
    ),
    (
        "vllm:generation_tokens_total",
        "counter",
        "Number of generation tokens processed.",
        |m| m.generation_tokens_total.to_string(),
    ),
    (
        "vllm:prefix_cache_queries_total",
        "counter",
        "Prefix cache queries, in terms of number of queried tokens.",
        |m| m.prefix_cache_queries_total.to_string(),
    ),
    (
        "vllm:prefix_cache_hits_total",
        "counter",
        "Prefix cache hits, in terms of number of cached tokens.",
        |m| m.prefix_cache_hits_total.to_string(),
    ),
    (
        "vllm:num_preemptions_total",
        "counter",
        "Cumulative number of preemptions from the engine.",
        |m| m.preemptions_total.to_string(),
    ),
];

/// The series vLLM exports (`vllm/v1/metrics/loggers.py`), each labelled
/// `model_name="<served model name>"`, from every replica's metrics added up (`m`), so
/// that dashboards and autoscalers written for vLLM read this server unchanged.
pub(super) fn render_vllm(m: &MetricsSnapshot, model_name: &str) -> String {
    // A label value escapes `\`, `"` and newlines (Prometheus text format 0.0.4).
    let label = format!(
        "model_name=\"{}\"",
        model_name
            .replace('\\', "\\\\")
            .replace('"', "\\\"")
            .replace('\n', "\\n")
    );
    let mut text = String::new();
    for (name, kind, help, value) in VLLM_SERIES {
        text.push_str(&format!(
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{{{label}}} {}\n",
            value(m)
        ));
    }
    for (name, help, histogram) in [
        (
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            &m.ttft,
        ),
        (
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds.",
            &m.tpot,
        ),
        (
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            &m.tpot,
        ),
        (
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            &m.e2e,
        ),
    ] {
        text.push_str(&format!("# HELP {name} {help}\n# TYPE {name} histogram\n"));
        text.push_str(&histogram.render_labelled(name, &label));
    }
    text
}

/// Data parallelism's Prometheus counters: the requests `routed` to each replica, and the
/// router's `decisions` per replica by [`RouteReason`].
pub(super) fn render_routing(routed: &[u64], decisions: &[[u64; 3]]) -> String {
    let mut text = String::from(
        "# HELP infer_dp_requests_routed_total Requests routed to each data-parallel replica.\n# TYPE infer_dp_requests_routed_total counter\n",
    );
    for (replica, count) in routed.iter().enumerate() {
        text.push_str(&format!(
            "infer_dp_requests_routed_total{{replica=\"{replica}\"}} {count}\n"
        ));
    }
    text.push_str("# HELP infer_router_decisions_total Requests routed to each replica, by the cache-aware policy's reason.\n# TYPE infer_router_decisions_total counter\n");
    for (replica, counts) in decisions.iter().enumerate() {
        for (reason, count) in RouteReason::ALL.iter().zip(counts) {
            text.push_str(&format!(
                "infer_router_decisions_total{{replica=\"{replica}\",reason=\"{}\"}} {count}\n",
                reason.name()
            ));
        }
    }
    text
}

/// Each replica's forward progress: seconds since its loop last made progress (a step, a
/// keep-alive, or work arriving while idle) and whether `/health` judges it stalled.
pub(super) fn render_health(verdict: &Verdict) -> String {
    let mut text = String::from(
        "# HELP infer_seconds_since_last_step Seconds since the replica's loop last made progress (a step or keep-alive ended, or work arrived while idle).\n# TYPE infer_seconds_since_last_step gauge\n",
    );
    for r in &verdict.replicas {
        text.push_str(&format!(
            "infer_seconds_since_last_step{{replica=\"{}\"}} {:.3}\n",
            r.replica, r.seconds_since_progress
        ));
    }
    text.push_str("# HELP infer_replica_stalled 1 while the replica has work and no progress past --stall-timeout.\n# TYPE infer_replica_stalled gauge\n");
    for r in &verdict.replicas {
        text.push_str(&format!(
            "infer_replica_stalled{{replica=\"{}\"}} {}\n",
            r.replica,
            u8::from(r.status == "stalled")
        ));
    }
    text
}

/// Prefill/decode disaggregation's metrics by role (`role="prefill"`: replicas
/// `0..prefill`, `role="decode"`: the others): requests waiting and running, and the TTFT
/// and TPOT histograms. A prefill replica observes each request's TTFT; a decode replica its
/// TPOT, the first decoded token's measured from the hand-off (so it includes the KV
/// import).
pub(super) fn render_roles(replicas: &[MetricsSnapshot], prefill: usize) -> String {
    let mut roles = [MetricsSnapshot::default(), MetricsSnapshot::default()];
    for (index, replica) in replicas.iter().enumerate() {
        roles[usize::from(index >= prefill)].add(replica);
    }
    let names = ["prefill", "decode"];
    let mut text = String::new();
    for (name, help, value) in [
        (
            "infer_pd_requests_waiting",
            "Requests waiting to join a batch, by prefill/decode role.",
            (|m: &MetricsSnapshot| m.waiting) as fn(&MetricsSnapshot) -> u64,
        ),
        (
            "infer_pd_requests_running",
            "Sequences in the running batches, by prefill/decode role.",
            |m: &MetricsSnapshot| m.running,
        ),
    ] {
        text.push_str(&format!("# HELP {name} {help}\n# TYPE {name} gauge\n"));
        for (role, m) in names.iter().zip(&roles) {
            text.push_str(&format!("{name}{{role=\"{role}\"}} {}\n", value(m)));
        }
    }
    for (name, help, histogram) in [
        (
            "infer_pd_time_to_first_token_seconds",
            "Time to first token, by prefill/decode role (prefill replicas sample first tokens).",
            (|m: &MetricsSnapshot| &m.ttft) as fn(&MetricsSnapshot) -> &HistogramSnapshot,
        ),
        (
            "infer_pd_time_per_output_token_seconds",
            "Time per output token after the first, by prefill/decode role (a decode replica's first token counts from the hand-off).",
            |m: &MetricsSnapshot| &m.tpot,
        ),
    ] {
        text.push_str(&format!("# HELP {name} {help}\n# TYPE {name} histogram\n"));
        for (role, m) in names.iter().zip(&roles) {
            text.push_str(&histogram(m).render_labelled(name, &format!("role=\"{role}\"")));
        }
    }
    text
}
