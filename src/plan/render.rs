//! Human output of `infer plan` (summary, memory per stage, rank table, NCCL env, the
//! equivalent `vllm serve` command — or, for CPU ranks, `infer up` command) and of an
//! infeasible answer. Returns text.

use comfy_table::Table;
use comfy_table::presets::UTF8_FULL_CONDENSED;

use super::cluster::Device;
use super::memory::gib;
use super::model::{Dtype, ModelSpec};
use super::sla::Disaggregated;
use super::{Infeasible, Plan};
use crate::degrees::Degrees;

/// Rank rows shown in text before "… N more"; `--json` always has all of them.
const MAX_RANK_ROWS: usize = 32;

/// The `vllm serve` command line for the same placement.
pub(crate) fn vllm_command(
    spec: &ModelSpec,
    parallel: &Degrees,
    dtype: Dtype,
    kv_dtype: Dtype,
    max_model_len: u64,
    utilization: f64,
) -> String {
    let mut parts = vec![format!("vllm serve {}", spec.serve_id)];
    parts.push(format!("--tensor-parallel-size {}", parallel.tp));
    if parallel.pp > 1 {
        parts.push(format!("--pipeline-parallel-size {}", parallel.pp));
    }
    if parallel.dp > 1 {
        parts.push(format!("--data-parallel-size {}", parallel.dp));
    }
    if parallel.ep > 1 {
        parts.push("--enable-expert-parallel".to_string());
    }
    if dtype != spec.native_dtype
        && let Some(method) = dtype.vllm_quantization()
    {
        parts.push(format!("--quantization {method}"));
    }
    if dtype == Dtype::Fp16 {
        parts.push("--dtype float16".to_string());
    }
    if kv_dtype == Dtype::Fp8 {
        parts.push("--kv-cache-dtype fp8".to_string());
    }
    parts.push(format!("--max-model-len {max_model_len}"));
    parts.push(format!("--gpu-memory-utilization {utilization}"));
    parts.join(" ")
}

/// The `infer up` command line that serves `parallel` with CPU ranks.
fn infer_up_command(parallel: &Degrees) -> String {
    let mut parts = vec![format!(
        "infer up --tp {} --pp {}",
        parallel.tp, parallel.pp
    )];
    if parallel.dp > 1 {
        parts.push(format!("--dp {}", parallel.dp));
    }
    if parallel.ep > 1 {
        parts.push(format!("--ep {}", parallel.ep));
    }
    parts.join(" ")
}

/// What a plan's devices are called in its text: `GPU`, or `rank` for CPU ranks.
fn device_noun(plan: &Plan) -> &'static str {
    match plan.device {
        Device::Gpu => "GPU",
        Device::Cpu => "rank",
    }
}

/// The text report of a plan; `explain_all` adds every alternative considered.
pub(crate) fn render(plan: &Plan, explain_all: bool) -> String {
    let mut out = summary_table(plan);
    out.push_str(&format!("\n\nmemory per {}\n", device_noun(plan)));
    out.push_str(&memory_table(plan));
    out.push_str("\n\nranks\n");
    out.push_str(&ranks_table(plan));
    out.push_str(&groups_text(plan));
    out.push_str(&env_text(plan));
    if !plan.pareto.is_empty() {
        out.push_str("\n\n");
        out.push_str(&pareto_table(plan));
    }
    if let Some(d) = &plan.disaggregated {
        out.push_str(&disaggregated_text(d, plan.workload.has_targets()));
    }
    out.push_str(&why_text(plan, explain_all));
    match (plan.device, &plan.vllm_command) {
        (Device::Gpu, Some(command)) => {
            out.push_str(&format!("\n\nvllm equivalent:\n  {command}\n"));
        }
        // A GPU plan always has its command; one read from an edited file may not.
        (Device::Gpu, None) => out.push('\n'),
        (Device::Cpu, _) => out.push_str(&format!(
            "\n\nserve it with CPU ranks:\n  {} (or `infer up --plan` with this plan's `--json`)\n",
            infer_up_command(&plan.parallel)
        )),
    }
    out
}

/// The one-row summary table: model, cluster, layout, dtypes, context, TPOT and tokens/s.
fn summary_table(plan: &Plan) -> String {
    let mut summary = Table::new();
    summary.load_style(UTF8_FULL_CONDENSED);
    summary.set_header([
        "model",
        "cluster",
        "parallel",
        "world",
        "dtype / kv",
        "max-model-len",
        "TPOT (batch 1)",
        "tokens/s",
    ]);
    summary.add_row([
        plan.model.clone(),
        plan.cluster.clone(),
        plan.parallel.to_string(),
        plan.world_size.to_string(),
        format!("{} / {}", plan.dtype, plan.kv_dtype),
        plan.max_model_len.to_string(),
        format!("{:.2} ms", plan.estimate.tpot_secs * 1e3),
        format!(
            "{:.0} @ {} seq/replica",
            plan.estimate.tokens_per_sec, plan.estimate.batch_per_replica
        ),
    ]);
    summary.to_string()
}

/// The memory of one GPU of each PP stage, in GiB, with its KV tokens and concurrency.
fn memory_table(plan: &Plan) -> String {
    let mut memory = Table::new();
    memory.load_style(UTF8_FULL_CONDENSED);
    memory.set_header([
        "stage",
        "layers",
        "weights",
        "reserve",
        "KV cache",
        "KV tokens",
        "max concurrency",
        "of usable",
    ]);
    for stage in &plan.memory {
        memory.add_row([
            stage.pp_rank.to_string(),
            format!(
                "{}-{}",
                stage.first_layer,
                stage.first_layer + stage.n_layers.max(1) - 1
            ),
            format!("{:.2} GiB", gib(stage.weights_bytes)),
            format!("{:.2} GiB", gib(stage.reserve_bytes)),
            format!("{:.2} GiB", gib(stage.kv_cache_bytes)),
            stage.kv_tokens.to_string(),
            (stage.kv_tokens / plan.max_model_len.max(1)).to_string(),
            format!("{:.1} GiB", gib(stage.usable_bytes)),
        ]);
    }
    memory.to_string()
}

/// The first [`MAX_RANK_ROWS`] ranks as a table, then how many more there are. CPU ranks
/// have no GPU and no `CUDA_VISIBLE_DEVICES` column.
fn ranks_table(plan: &Plan) -> String {
    let gpu = plan.device == Device::Gpu;
    let mut ranks = Table::new();
    ranks.load_style(UTF8_FULL_CONDENSED);
    let mut header = vec!["rank", "host", "gpu", "local_rank", "tp", "pp", "dp", "ep"];
    if gpu {
        header.push("CUDA_VISIBLE_DEVICES");
    } else {
        header.remove(2);
    }
    ranks.set_header(header);
    for rank in plan.ranks.iter().take(MAX_RANK_ROWS) {
        let mut row = vec![
            rank.rank.to_string(),
            rank.host.clone(),
            rank.gpu.to_string(),
            rank.local_rank.to_string(),
            rank.tp_rank.to_string(),
            rank.pp_rank.to_string(),
            rank.dp_rank.to_string(),
            rank.ep_rank.to_string(),
        ];
        if gpu {
            row.push(rank.cuda_visible_devices.clone());
        } else {
            row.remove(2);
        }
        ranks.add_row(row);
    }
    let mut out = ranks.to_string();
    if plan.ranks.len() > MAX_RANK_ROWS {
        out.push_str(&format!(
            "\n… {} more ranks (see `--json`)",
            plan.ranks.len() - MAX_RANK_ROWS
        ));
    }
    out
}

/// The `groups` section: the first eight TP, PP, DP (and, with EP, EP) groups of each kind.
fn groups_text(plan: &Plan) -> String {
    let groups = |name: &str, groups: &[Vec<u64>]| {
        let shown: Vec<String> = groups.iter().take(8).map(|g| format!("{g:?}")).collect();
        let more = if groups.len() > 8 {
            format!(" … {} more", groups.len() - 8)
        } else {
            String::new()
        };
        format!("\n  {name}: {}{more}", shown.join(" "))
    };
    let mut out = String::from("\n\ngroups");
    out.push_str(&groups("tp", &plan.groups.tp));
    out.push_str(&groups("pp", &plan.groups.pp));
    out.push_str(&groups("dp", &plan.groups.dp));
    if plan.parallel.ep > 1 {
        out.push_str(&groups("ep", &plan.groups.ep));
    }
    out
}

/// The `environment per host` section: each host's variables on one line.
fn env_text(plan: &Plan) -> String {
    let mut out = String::from("\n\nenvironment per host");
    for (host, env) in &plan.env {
        let vars: Vec<String> = env.iter().map(|(k, v)| format!("{k}={v}")).collect();
        if vars.is_empty() {
            // CPU ranks: no GPU order, no NCCL.
            out.push_str(&format!("\n  {host}: nothing to set"));
        } else {
            out.push_str(&format!("\n  {host}: {}", vars.join(" ")));
        }
    }
    out
}

/// The disaggregated deployment's paragraph; `meets_targets` adds that it meets them.
fn disaggregated_text(d: &Disaggregated, meets_targets: bool) -> String {
    format!(
        "\n\ndisaggregated (prefill/decode): {} × {} prefill + {} × {} decode workers on {} GPUs, batch {} per decode worker\n  TTFT {:.0} ms (KV transfer {:.1} ms), TPOT {:.1} ms, {:.1} tokens/s per user, {:.0} tokens/s per GPU, P:D GPUs {:.2}{}",
        d.prefill_workers,
        d.prefill,
        d.decode_workers,
        d.decode,
        d.gpus,
        d.batch_per_decode_worker,
        d.ttft_secs * 1e3,
        d.kv_transfer_secs * 1e3,
        d.tpot_secs * 1e3,
        d.tokens_per_sec_per_user,
        d.tokens_per_sec_per_gpu,
        d.prefill_to_decode_gpus,
        if meets_targets {
            ", meets the targets"
        } else {
            ""
        }
    )
}

/// The `why` section, every layout considered (with `explain_all`), then the warnings and
/// notes, one a line.
fn why_text(plan: &Plan, explain_all: bool) -> String {
    let mut out = String::from("\n\nwhy");
    for line in &plan.explain {
        out.push_str(&format!("\n  {line}"));
    }
    if explain_all {
        out.push_str("\n\nevery layout considered");
        for alternative in &plan.alternatives {
            let verdict = if alternative.feasible { "ok " } else { "no " };
            out.push_str(&format!(
                "\n  {verdict} {}: {}",
                alternative.parallel, alternative.reason
            ));
        }
    }
    for warning in &plan.warnings {
        out.push_str(&format!("\nwarning: {warning}"));
    }
    for note in &plan.notes {
        out.push_str(&format!("\nnote: {note}"));
    }
    out
}

/// Pareto rows shown in text; `--json` has all of them.
const MAX_PARETO_ROWS: usize = 10;

/// The Pareto frontier as a table, most tokens/s per GPU first; `*` marks the chosen
/// layout's rows (the chosen point with targets).
fn pareto_table(plan: &Plan) -> String {
    let w = &plan.workload;
    let mut targets = Vec::new();
    if let Some(t) = w.ttft_target_secs {
        targets.push(format!("TTFT ≤ {:.0} ms", t * 1e3));
    }
    if let Some(t) = w.tpot_target_secs {
        targets.push(format!("TPOT ≤ {:.0} ms", t * 1e3));
    }
    if let Some(rps) = w.requests_per_sec {
        targets.push(format!("{rps} requests/s"));
    }
    let mut out = format!(
        "pareto frontier: {} prompt + {} output tokens per request{}",
        w.isl_tokens,
        w.osl_tokens,
        if targets.is_empty() {
            String::new()
        } else {
            format!(", {}", targets.join(", "))
        }
    );
    let mut table = Table::new();
    table.load_style(UTF8_FULL_CONDENSED);
    let mut header = vec![
        "",
        "layout",
        "batch",
        "TTFT",
        "TPOT",
        "tok/s/user",
        match plan.device {
            Device::Gpu => "tok/s/GPU",
            Device::Cpu => "tok/s/rank",
        },
        "KV seqs",
    ];
    if w.requests_per_sec.is_some() {
        header.push("GPUs for rps");
    }
    if w.has_targets() {
        header.push("SLA");
    }
    table.set_header(header);
    for point in plan.pareto.iter().take(MAX_PARETO_ROWS) {
        let chosen = match &plan.sla_choice {
            Some(choice) => {
                choice.parallel == point.parallel
                    && choice.batch_per_replica == point.batch_per_replica
            }
            None => point.parallel == plan.parallel,
        };
        let mut row = vec![
            if chosen { "*" } else { "" }.to_string(),
            point.parallel.to_string(),
            point.batch_per_replica.to_string(),
            format!("{:.0} ms", point.ttft_secs * 1e3),
            format!("{:.1} ms", point.tpot_secs * 1e3),
            format!("{:.1}", point.tokens_per_sec_per_user),
            format!("{:.0}", point.tokens_per_sec_per_gpu),
            point.kv_capacity_seqs.to_string(),
        ];
        if let Some(gpus) = point.gpus_for_rps {
            row.push(gpus.to_string());
        }
        if w.has_targets() {
            row.push(if point.meets_sla { "✓" } else { "✗" }.to_string());
        }
        table.add_row(row);
    }
    out.push('\n');
    out.push_str(&table.to_string());
    if plan.pareto.len() > MAX_PARETO_ROWS {
        out.push_str(&format!(
            "\n… {} more point{} on the frontier (see `--json`)",
            plan.pareto.len() - MAX_PARETO_ROWS,
            if plan.pareto.len() - MAX_PARETO_ROWS == 1 {
                ""
            } else {
                "s"
            }
        ));
    }
    out
}

/// The text of an infeasible answer (for stdout; the exit code says "no").
pub(crate) fn render_infeasible(infeasible: &Infeasible, explain_all: bool) -> String {
    let mut out = format!(
        "infeasible: {}\nhint: {}\n",
        infeasible.message, infeasible.hint
    );
    if explain_all {
        out.push_str("\nevery layout considered\n");
        for alternative in &infeasible.alternatives {
            let verdict = if alternative.feasible { "ok " } else { "no " };
            out.push_str(&format!(
                "  {verdict} {}: {}\n",
                alternative.parallel, alternative.reason
            ));
        }
    }
    out
}
