//! The planner: chooses TP × PP × EP × DP for a model on a cluster, places every rank, and
//! explains why. Pure: no I/O, no clock, no environment; the same inputs give the same plan.
//!
//! [`plan`] enumerates every (tp, pp, dp, ep) that uses the cluster's GPUs, rejects the
//! invalid ones (head divisibility, expert divisibility, TP across hosts or a `SYS` path,
//! memory), scores every other one with the roofline model of [`cost`] and picks by
//! objective; ties go to fewer GPUs per replica, then less PP. No rule prunes a valid
//! layout: each is costed or refused for a reason true of it.
//!
//! Hosts without GPUs plan the same way with their CPU as the device ([`cluster`]): the
//! layouts of every rank count from one to the most each host takes, each rank costed with
//! its share of the host's memory, memory bandwidth and compute rate.

pub mod accuracy;
pub mod calibration;
pub(crate) mod cluster;
pub(crate) mod cost;
pub(crate) mod env;
pub(crate) mod layout;
pub(crate) mod memory;
pub mod model;
pub(crate) mod render;
pub mod sla;

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use cluster::{Cluster, Device, HardwareSpec};
use cost::Estimate;
use layout::{Groups, RankPlacement};
use memory::{StageMemory, gib};
use model::{Dtype, ModelSpec};

use crate::degrees::{DegreePins, Degrees};
use crate::topology::LinkCode;

/// What to optimise.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Objective {
    /// Lowest time per output token of one sequence (TPOT at batch 1).
    Latency,
    /// Most decode tokens per second over the cluster at full KV capacity.
    Throughput,
    /// Fewest GPUs that serve `--rps` requests per second within the targets; without
    /// `--rps`, the most tokens/s per GPU (every GPU of the cluster in use).
    Cost,
}

/// The planner's inputs besides model and cluster (flags merged and validated).
#[derive(Clone, Debug, PartialEq)]
pub struct Settings {
    pub objective: Objective,
    /// Weight dtype; `None` keeps the checkpoint's own.
    pub dtype: Option<Dtype>,
    /// KV-cache dtype; `None` is the activation dtype (bf16, or fp16 with `--dtype fp16`).
    pub kv_dtype: Option<Dtype>,
    /// Longest sequence to serve, tokens; `None` is the model's `max_position_embeddings`.
    pub max_model_len_tokens: Option<u64>,
    /// Fraction of GPU memory the engine may use (vLLM's default 0.9).
    pub gpu_memory_utilization: f64,
    /// Pinned degrees: the plan uses exactly these and checks them.
    pub pins: DegreePins,
    /// The traffic (`--isl/--osl`) and latency targets (`--ttft-ms/--tpot-ms`).
    pub workload: sla::Workload,
    /// Show the disaggregated (prefill/decode) deployment even when aggregated serving wins.
    pub disaggregate: bool,
}

impl Default for Settings {
    fn default() -> Settings {
        Settings {
            objective: Objective::Throughput,
            dtype: None,
            kv_dtype: None,
            max_model_len_tokens: None,
            gpu_memory_utilization: 0.9,
            pins: DegreePins::default(),
            workload: sla::Workload::default(),
            disaggregate: false,
        }
    }
}

/// A layout that was considered, and how it fared. `--json` `alternatives[]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Alternative {
    pub parallel: Degrees,
    pub feasible: bool,
    /// Why it was rejected, or how it compares with the chosen plan.
    pub reason: String,
    pub tpot_secs: Option<f64>,
    pub tokens_per_sec: Option<f64>,
    /// MoE models: its routed experts' costs, as the chosen plan's `estimate.moe`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe: Option<cost::MoeCosts>,
}

/// A placement of one model onto a cluster, with the reasons. The `--json` output of `infer plan`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    pub model: String,
    /// What `vllm serve` would load (a Hugging Face id or a path).
    pub serve_id: String,
    pub cluster: String,
    /// What the ranks compute on: `gpu` (one rank per GPU) or `cpu` (rank processes sharing
    /// each host's CPU and memory; `ranks[].cuda_visible_devices` empty). Plans written before
    /// CPU plans existed are GPU plans.
    #[serde(default)]
    pub device: Device,
    pub objective: Objective,
    pub dtype: Dtype,
    pub kv_dtype: Dtype,
    pub max_model_len: u64,
    pub gpu_memory_utilization: f64,
    /// Parameters of the model, and those active per token (MoE).
    pub params: u64,
    pub active_params: u64,
    /// Whole-model weight bytes in `dtype`.
    pub weights_bytes: u64,
    pub parallel: Degrees,
    pub world_size: u64,
    pub ranks: Vec<RankPlacement>,
    pub groups: Groups,
    /// Per PP stage, the memory of each of its GPUs.
    pub memory: Vec<StageMemory>,
    pub estimate: Estimate,
    /// Environment per host name.
    pub env: BTreeMap<String, BTreeMap<String, String>>,
    /// The decision path, the choice and why the runners-up lost.
    pub explain: Vec<String>,
    pub warnings: Vec<String>,
    /// What the user should know but cannot act on from this input (a shorthand cluster
    /// has no NICs to name); never a warning.
    #[serde(default)]
    pub notes: Vec<String>,
    pub alternatives: Vec<Alternative>,
    /// The equivalent `vllm serve` command line; `None` (absent from `--json`) for CPU
    /// ranks, which vLLM does not run (`infer up` serves them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vllm_command: Option<String>,
    /// The traffic planned for and its targets.
    #[serde(default)]
    pub workload: sla::Workload,
    /// The Pareto frontier of every feasible layout and batch: tokens/s per GPU against
    /// tokens/s per user, with TTFT, TPOT, KV capacity and ✓/✗ against the targets.
    #[serde(default)]
    pub pareto: Vec<sla::ParetoPoint>,
    /// With targets: the point chosen (the best that meets them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sla_choice: Option<sla::ParetoPoint>,
    /// The best prefill/decode split of the same GPUs, when `--disaggregate` asked for it
    /// or it beats aggregated serving.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disaggregated: Option<sla::Disaggregated>,
}

/// No layout works. `message` says why with the numbers, `hint` what to change.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Infeasible {
    pub model: String,
    pub cluster: String,
    pub message: String,
    pub hint: String,
    /// GPUs of the cluster's kind the model needs at least (0 when GPUs are not the problem,
    /// and on CPU hosts, where the message says how many hosts it needs).
    pub min_gpus_needed: u64,
    /// When the weights fit but no layout's KV cache holds `--max-model-len`: the longest
    /// context, tokens, that some layout's KV cache holds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_tokens_that_fit: Option<u64>,
    pub alternatives: Vec<Alternative>,
}

/// The planner's answer.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    Feasible(Box<Plan>),
    Infeasible(Box<Infeasible>),
}

/// One evaluated candidate.
struct Candidate {
    parallel: Degrees,
    verdict: Result<(Estimate, Vec<StageMemory>, layout::Layout), String>,
    warnings: Vec<String>,
    /// When the weights fit but the KV cache cannot hold `--max-model-len`: the tokens it
    /// does hold (per sequence, the smallest stage's).
    kv_tokens_that_fit: Option<u64>,
    /// The figures of each of its devices it was costed with: the cluster's slowest GPU, or
    /// one CPU rank's share of its host.
    hardware: HardwareSpec,
}

/// KV-cache block, tokens: a context chosen to fit is a multiple of it (vLLM's default
/// `--block-size` 16, and our paged cache's block).
pub const KV_BLOCK_TOKENS: u64 = 16;

/// Plans `spec` on `cluster`. When the weights fit but no layout's KV cache holds the
/// model's whole context (and `--max-model-len` was not given), plans with the longest
/// context that fits, rounded down to [`KV_BLOCK_TOKENS`], and says so; an explicit
/// `--max-model-len` is honoured or refused. With `--objective cost` and `--rps`, the plan
/// uses only the GPUs its chosen point needs (that many replicas), not the whole cluster.
pub fn plan(spec: &ModelSpec, cluster: &Cluster, settings: &Settings) -> Outcome {
    match plan_fitting(spec, cluster, settings) {
        Outcome::Feasible(plan) => Outcome::Feasible(right_size(spec, cluster, settings, plan)),
        infeasible => infeasible,
    }
}

/// With `--objective cost` and `--rps`: the chosen point's layout with only the replicas
/// `--rps` needs (its `gpus_for_rps`), planned again with those degrees pinned; its ranks,
/// groups, environment, memory and estimate replace the whole-cluster ones. Unchanged when
/// the point needs the whole cluster, or when EP spans replicas (then a replica is not
/// independent of the others).
fn right_size(
    spec: &ModelSpec,
    cluster: &Cluster,
    settings: &Settings,
    mut plan: Box<Plan>,
) -> Box<Plan> {
    let Some(gpus) = plan
        .sla_choice
        .as_ref()
        .filter(|_| settings.objective == Objective::Cost)
        .and_then(|point| point.gpus_for_rps)
    else {
        return plan;
    };
    let p = plan.parallel;
    let dp = (gpus as usize / p.replica_size().max(1)).max(1);
    if dp >= p.dp || p.ep > p.tp {
        return plan;
    }
    let pinned = Settings {
        pins: Degrees { dp, ..p }.pins(),
        max_model_len_tokens: Some(plan.max_model_len),
        workload: sla::Workload {
            requests_per_sec: None,
            ttft_target_secs: None,
            tpot_target_secs: None,
            ..settings.workload
        },
        ..settings.clone()
    };
    let Outcome::Feasible(sized) = plan_with_context(spec, cluster, &pinned) else {
        return plan;
    };
    plan.explain.push(format!(
        "the plan uses {} of the cluster's {} GPUs ({dp} replica{} of TP{} × PP{}): what {} requests/s need (--objective cost); the others stay free",
        sized.world_size,
        cluster.n_gpus(),
        if dp == 1 { "" } else { "s" },
        p.tp,
        p.pp,
        settings.workload.requests_per_sec.unwrap_or_default()
    ));
    // The chosen layout's line, from the right-sized plan's own numbers.
    if let (Some(at), Some(line)) = (
        plan.explain.iter().position(|l| l.starts_with("chosen: ")),
        sized.explain.iter().find(|l| l.starts_with("chosen: ")),
    ) {
        plan.explain[at] = line.clone();
    }
    plan.parallel = sized.parallel;
    plan.world_size = sized.world_size;
    plan.ranks = sized.ranks;
    plan.groups = sized.groups;
    plan.memory = sized.memory;
    plan.estimate = sized.estimate;
    plan.env = sized.env;
    plan.vllm_command = sized.vllm_command;
    plan
}

/// [`plan`] before right-sizing: the model's whole context, else the longest that fits.
fn plan_fitting(spec: &ModelSpec, cluster: &Cluster, settings: &Settings) -> Outcome {
    let outcome = plan_with_context(spec, cluster, settings);
    let Outcome::Infeasible(infeasible) = &outcome else {
        return outcome;
    };
    if settings.max_model_len_tokens.is_some() {
        return outcome;
    }
    let Some(fits) = infeasible
        .kv_tokens_that_fit
        .map(|tokens| tokens / KV_BLOCK_TOKENS * KV_BLOCK_TOKENS)
        .filter(|&tokens| tokens >= KV_BLOCK_TOKENS)
    else {
        return outcome;
    };
    let shorter = Settings {
        max_model_len_tokens: Some(fits),
        ..settings.clone()
    };
    match plan_with_context(spec, cluster, &shorter) {
        Outcome::Feasible(mut plan) => {
            let why = format!(
                "the KV cache cannot hold the model's whole context of {} tokens on `{}`: planned with --max-model-len {fits}, the longest that fits (a multiple of the {KV_BLOCK_TOKENS}-token KV block); more GPUs, `--kv-dtype fp8` or a smaller `--dtype` give a longer one",
                spec.max_position_embeddings, cluster.description
            );
            plan.explain.insert(0, why.clone());
            plan.warnings.insert(0, why);
            Outcome::Feasible(plan)
        }
        Outcome::Infeasible(_) => outcome,
    }
}

/// One planning run's inputs and the dtypes and context they resolve to.
#[derive(Clone, Copy)]
struct Run<'a> {
    spec: &'a ModelSpec,
    cluster: &'a Cluster,
    settings: &'a Settings,
    /// Weight dtype: the flag's, else the checkpoint's (GGUF keeps its own).
    dtype: Dtype,
    /// KV-cache dtype: the flag's, else the activation dtype.
    kv_dtype: Dtype,
    /// Longest sequence to serve, tokens.
    max_model_len_tokens: u64,
}

impl<'a> Run<'a> {
    /// Resolves the dtypes and the context `settings` leave to the model.
    fn new(spec: &'a ModelSpec, cluster: &'a Cluster, settings: &'a Settings) -> Run<'a> {
        let dtype = if spec.native_dtype == Dtype::Gguf {
            Dtype::Gguf
        } else {
            let dtype = settings.dtype.unwrap_or(spec.native_dtype);
            // CPU ranks run int4 and int8 as the CPU engine's Q4_0 and Q8_0.
            if cluster.device() == Device::Cpu {
                dtype.on_cpu()
            } else {
                dtype
            }
        };
        let kv_dtype = settings.kv_dtype.unwrap_or(if dtype == Dtype::Fp16 {
            Dtype::Fp16
        } else {
            Dtype::Bf16
        });
        let max_model_len_tokens = settings
            .max_model_len_tokens
            .unwrap_or(spec.max_position_embeddings);
        Run {
            spec,
            cluster,
            settings,
            dtype,
            kv_dtype,
            max_model_len_tokens,
        }
    }

    /// Warnings about flags the model ignores or exceeds.
    fn input_warnings(&self) -> Vec<String> {
        let (spec, max_model_len) = (self.spec, self.max_model_len_tokens);
        let mut warnings = Vec::new();
        if spec.native_dtype == Dtype::Gguf && self.settings.dtype.is_some() {
            warnings.push(
                "`--dtype` is ignored for GGUF files: their tensors keep their own types"
                    .to_string(),
            );
        }
        if max_model_len > spec.max_position_embeddings {
            warnings.push(format!(
                "--max-model-len {max_model_len} exceeds the model's max_position_embeddings {}",
                spec.max_position_embeddings
            ));
        }
        warnings
    }

    /// The `vllm serve` command line for `parallel` with this run's dtypes and context.
    fn vllm_command(&self, parallel: &Degrees) -> String {
        render::vllm_command(
            self.spec,
            parallel,
            self.dtype,
            self.kv_dtype,
            self.max_model_len_tokens,
            self.settings.gpu_memory_utilization,
        )
    }
}

/// [`plan`] for the context `settings` says (the model's whole one by default).
fn plan_with_context(spec: &ModelSpec, cluster: &Cluster, settings: &Settings) -> Outcome {
    let run = Run::new(spec, cluster, settings);
    let mut warnings = run.input_warnings();

    // Enumerate and check every layout, then rank the feasible ones by the objective.
    let candidates = candidates(&run);
    let fits_without_pp = candidates
        .iter()
        .any(|c| c.parallel.pp == 1 && c.verdict.is_ok());
    let mut ranked = rank(&candidates, settings);

    // Every feasible layout at every batch its KV cache holds, for the workload.
    let points = sla_points(&run, &ranked);
    let pareto = sla::frontier(&points);
    let sla_choice = match choose_within_targets(&run, &points, &candidates, &mut ranked) {
        Ok(choice) => choice,
        Err(missed) => return Outcome::Infeasible(missed),
    };

    let alternatives = |chosen: Option<&Candidate>| -> Vec<Alternative> {
        candidates
            .iter()
            .filter(|c| chosen.is_none_or(|chosen| chosen.parallel != c.parallel))
            .map(|c| describe(c, chosen, settings.objective))
            .collect()
    };
    let Some(best) = ranked.first() else {
        return Outcome::Infeasible(Box::new(infeasible(&run, &candidates, alternatives(None))));
    };
    let (estimate, stages, layout) = best
        .verdict
        .as_ref()
        .expect("ranked candidates are feasible");

    // The chosen layout's environment, and what the user should know about it.
    warnings.extend(best.warnings.iter().cloned());
    let multi_host = layout.ranks.iter().any(|r| r.host != layout.ranks[0].host);
    let env = host_envs(cluster, layout, multi_host, &mut warnings);
    let notes = notes(cluster, multi_host);
    if let Some(uneven) = uneven_stages_warning(spec, stages, best.parallel) {
        warnings.push(uneven);
    }

    // Explain: the decision path, the measurements, disaggregation and the targets.
    let mut explain = explain(&run, &candidates, &ranked, fits_without_pp);
    explain.extend(measured_lines(cluster));
    let show_disaggregated = if cluster.device() == Device::Cpu {
        if settings.disaggregate {
            warnings.push(
                "--disaggregate: the planner does not split CPU ranks into prefill and decode pools; `infer up --prefill N --decode M` runs such a split as given".into(),
            );
        }
        None
    } else {
        let disaggregated = best_disaggregated(&run, &ranked);
        let aggregated_best = sla::choose(&points, settings.objective).cloned();
        weigh_disaggregated(
            settings,
            disaggregated.as_ref(),
            aggregated_best.as_ref(),
            &mut explain,
            &mut warnings,
        )
    };
    if let Some(point) = &sla_choice {
        explain_targets(&run, point, &points, &ranked, &mut explain);
    }

    let alternatives = alternatives(Some(best));
    let parallel = best.parallel;
    Outcome::Feasible(Box::new(Plan {
        model: spec.name.clone(),
        serve_id: spec.serve_id.clone(),
        cluster: cluster.description.clone(),
        device: cluster.device(),
        objective: settings.objective,
        dtype: run.dtype,
        kv_dtype: run.kv_dtype,
        max_model_len: run.max_model_len_tokens,
        gpu_memory_utilization: settings.gpu_memory_utilization,
        params: spec.param_counts().total(),
        active_params: spec.active_params(),
        weights_bytes: spec.weight_bytes(run.dtype),
        parallel,
        world_size: parallel.world_size() as u64,
        ranks: layout.ranks.clone(),
        groups: layout.groups.clone(),
        memory: stages.clone(),
        estimate: estimate.clone(),
        env,
        explain,
        warnings,
        notes,
        alternatives,
        vllm_command: (cluster.device() == Device::Gpu).then(|| run.vllm_command(&parallel)),
        workload: settings.workload,
        pareto,
        sla_choice,
        disaggregated: show_disaggregated,
    }))
}

/// The feasible candidates, best first by the objective ([`compare`]). Every one is ranked
/// by its cost: PP loses to TP × DP by its stage hops and bubble where it does, not by rule.
fn rank<'c>(candidates: &'c [Candidate], settings: &Settings) -> Vec<&'c Candidate> {
    let mut ranked: Vec<&Candidate> = candidates.iter().filter(|c| c.verdict.is_ok()).collect();
    ranked.sort_by(|a, b| compare(a, b, settings.objective));
    ranked
}

/// Every (layout, batch) point of the `ranked` layouts for the workload; a point that needs
/// more GPUs than the cluster has for `--rps` does not meet the targets.
fn sla_points(run: &Run<'_>, ranked: &[&Candidate]) -> Vec<sla::ParetoPoint> {
    let max_batch = memory::max_num_seqs(run.cluster.device());
    let costs: Vec<sla::LayoutCosts<'_>> = ranked
        .iter()
        .filter_map(|c| {
            c.verdict
                .as_ref()
                .ok()
                .map(|(_, stages, layout)| sla::LayoutCosts {
                    parallel: c.parallel,
                    stages,
                    links: &layout.links,
                    hardware: &c.hardware,
                    max_batch,
                })
        })
        .collect();
    let mut points = sla::points(run.spec, &costs, run.dtype, &run.settings.workload);
    // A point that needs more GPUs than the cluster has cannot serve `--rps` here.
    let n_gpus = run.cluster.n_gpus();
    for point in &mut points {
        if point.gpus_for_rps.is_some_and(|g| g > n_gpus) {
            point.meets_sla = false;
        }
    }
    points
}

/// With targets: the best point that meets them, its layout moved to the front of `ranked`.
/// `Ok(None)` without targets, or when no layout has a point at all.
///
/// Errors: the [`Infeasible`] answer saying how close the best points come, when some
/// points exist but none meets the targets.
fn choose_within_targets(
    run: &Run<'_>,
    points: &[sla::ParetoPoint],
    candidates: &[Candidate],
    ranked: &mut Vec<&Candidate>,
) -> Result<Option<sla::ParetoPoint>, Box<Infeasible>> {
    let settings = run.settings;
    if !settings.workload.has_targets() {
        return Ok(None);
    }
    match sla::choose(points, settings.objective) {
        Some(point) => {
            // The layout of the best point that meets the targets goes first.
            if let Some(at) = ranked.iter().position(|c| c.parallel == point.parallel) {
                let chosen = ranked.remove(at);
                ranked.insert(0, chosen);
            }
            Ok(Some(point.clone()))
        }
        None if !points.is_empty() => Err(Box::new(missed_targets(
            run.spec,
            run.cluster,
            &settings.workload,
            points,
            candidates
                .iter()
                .map(|c| describe(c, None, settings.objective))
                .collect(),
        ))),
        None => Ok(None),
    }
}

/// The environment of each host the layout uses, by host name; what cannot be chosen goes
/// to `warnings`.
fn host_envs(
    cluster: &Cluster,
    layout: &layout::Layout,
    multi_host: bool,
    warnings: &mut Vec<String>,
) -> BTreeMap<String, BTreeMap<String, String>> {
    cluster
        .hosts
        .iter()
        .filter(|h| layout.ranks.iter().any(|r| r.host == h.name))
        .map(|h| {
            let gpus: Vec<usize> = layout
                .ranks
                .iter()
                .filter(|r| r.host == h.name)
                .map(|r| r.gpu)
                .collect();
            (
                h.name.clone(),
                env::host_env(h, &gpus, multi_host, warnings),
            )
        })
        .collect()
}

/// What the user should know but cannot act on: a multi-host plan on a shorthand cluster
/// names no NICs.
fn notes(cluster: &Cluster, multi_host: bool) -> Vec<String> {
    let mut notes = Vec::new();
    if multi_host && cluster.hosts.iter().any(env::is_synthetic) {
        notes.push(format!(
            "`{}` names no NICs: the plan cannot choose `NCCL_SOCKET_IFNAME` or `NCCL_IB_HCA`, and costs cross-host traffic as TCP sockets (no RDMA known: 12.5 GB/s, 50 µs per call); set them per host, or plan on an inventory whose hosts carry their `infer topo --json`",
            cluster.description
        ));
    }
    notes
}

/// The warning for PP stages of different layer counts, if they are.
fn uneven_stages_warning(
    spec: &ModelSpec,
    stages: &[StageMemory],
    parallel: Degrees,
) -> Option<String> {
    if stages.iter().all(|s| s.n_layers == stages[0].n_layers) {
        return None;
    }
    let sizes: Vec<String> = stages.iter().map(|s| s.n_layers.to_string()).collect();
    Some(format!(
        "uneven pipeline stages: {} layers ({} not divisible by PP{})",
        sizes.join("/"),
        spec.n_layers,
        parallel.pp
    ))
}

/// The best disaggregated deployment: one replica of each ranked layout whose experts stay
/// inside it, as a prefill or a decode worker, the GPUs split between the two pools.
fn best_disaggregated(run: &Run<'_>, ranked: &[&Candidate]) -> Option<sla::Disaggregated> {
    let (cluster, settings) = (run.cluster, run.settings);
    let hardware = cluster.slowest_hardware();
    let mut shapes: Vec<Degrees> = Vec::new();
    let workers: Vec<sla::WorkerCosts<'_>> = ranked
        .iter()
        .filter(|c| c.parallel.ep == 1 || (c.parallel.ep == c.parallel.tp && c.parallel.dp == 1))
        .filter_map(|c| {
            let worker = Degrees {
                dp: 1,
                ..c.parallel
            };
            if shapes.contains(&worker) {
                return None;
            }
            shapes.push(worker);
            c.verdict
                .as_ref()
                .ok()
                .map(|(_, stages, layout)| sla::WorkerCosts {
                    parallel: worker,
                    stages,
                    links: &layout.links,
                })
        })
        .collect();
    let transfer = kv_transfer_link(cluster);
    sla::disaggregate(
        run.spec,
        &workers,
        run.dtype,
        hardware,
        &transfer,
        cluster.n_gpus(),
        &settings.workload,
        settings.objective,
    )
}

/// The link a KV cache crosses from a prefill to a decode worker: the network between
/// hosts, else NVLink (one direction), else PCIe.
fn kv_transfer_link(cluster: &Cluster) -> cost::Link {
    let hardware = cluster.slowest_hardware();
    if cluster.hosts.len() > 1 {
        layout::network_link(cluster)
    } else if hardware.nvlink_gb_per_sec > 0.0 {
        cost::Link {
            bytes_per_sec: hardware.nvlink_gb_per_sec / 2.0 * 1e9,
            latency_secs: cost::NVLINK_LATENCY_SECS,
            message_latency_secs: cost::NVLINK_LATENCY_SECS,
        }
    } else {
        cost::Link {
            bytes_per_sec: hardware.pcie_gb_per_sec * 1e9,
            latency_secs: cost::PCIE_LATENCY_SECS,
            message_latency_secs: cost::PCIE_LATENCY_SECS,
        }
    }
}

/// One line per `--calibration` measurement the cluster's figures use.
fn measured_lines(cluster: &Cluster) -> Vec<String> {
    let mut lines = Vec::new();
    for (measured, what) in [
        (&cluster.measured.intra_host, "inside a host"),
        (&cluster.measured.inter_host, "between hosts"),
    ] {
        if let Some(m) = measured {
            lines.push(format!(
                "measured, not datasheet: links {what} cost {:.1} GB/s and {:.0} µs per collective, from {} (--calibration)",
                m.bytes_per_sec / 1e9,
                m.latency_secs * 1e6,
                m.source
            ));
        }
    }
    for m in &cluster.measured.decode {
        if m.hardware_id == cluster::CPU_HARDWARE_ID {
            let compute = match (m.flops_per_sec, m.probed_flops_per_sec) {
                (Some(flops), Some(probed)) => format!(
                    ", and computes {:.1} GFLOP/s in a prefill ({:.0}% of the probed {:.1} GFLOP/s)",
                    flops / 1e9,
                    100.0 * flops / probed,
                    probed / 1e9
                ),
                _ => String::new(),
            };
            lines.push(format!(
                "measured, not probed: the CPU `{}` reads weights at {:.1} GB/s in a decode step ({:.0}% of the probed {:.1} GB/s){compute}, from {} (--calibration)",
                m.device_name,
                m.bytes_per_sec / 1e9,
                100.0 * m.bytes_per_sec / m.datasheet_bytes_per_sec,
                m.datasheet_bytes_per_sec / 1e9,
                m.source
            ));
            continue;
        }
        lines.push(format!(
            "measured, not datasheet: {} GPUs read weights at {:.0} GB/s in a decode step ({:.0}% of the datasheet's {:.0} GB/s), from {} (--calibration)",
            m.hardware_id,
            m.bytes_per_sec / 1e9,
            100.0 * m.bytes_per_sec / m.datasheet_bytes_per_sec,
            m.datasheet_bytes_per_sec / 1e9,
            m.source
        ));
    }
    lines
}

/// Compares the disaggregated deployment with aggregated serving's best point in
/// `explain`; returns the deployment to show: when it wins or `--disaggregate` asked for
/// it. Without one, `--disaggregate` gets a warning.
fn weigh_disaggregated(
    settings: &Settings,
    disaggregated: Option<&sla::Disaggregated>,
    aggregated_best: Option<&sla::ParetoPoint>,
    explain: &mut Vec<String>,
    warnings: &mut Vec<String>,
) -> Option<sla::Disaggregated> {
    let (Some(d), Some(a)) = (disaggregated, aggregated_best) else {
        if settings.disaggregate {
            warnings.push(
                "no disaggregated deployment fits: no prefill and decode worker pair fits the GPUs and meets the targets".into(),
            );
        }
        return None;
    };
    let (d_value, a_value, what) = match settings.objective {
        Objective::Throughput | Objective::Cost => (
            d.tokens_per_sec_per_gpu,
            a.tokens_per_sec_per_gpu,
            "tokens/s per GPU",
        ),
        Objective::Latency => (
            d.tokens_per_sec_per_user,
            a.tokens_per_sec_per_user,
            "tokens/s per user",
        ),
    };
    let wins = d_value > a_value;
    explain.push(format!(
        "disaggregated: {} prefill worker{} of {} and {} decode worker{} of {} (batch {}, P:D GPUs {:.2}) give {:.0} {what} against aggregated serving's {:.0}: {} by {:.0}%",
        d.prefill_workers,
        if d.prefill_workers == 1 { "" } else { "s" },
        d.prefill,
        d.decode_workers,
        if d.decode_workers == 1 { "" } else { "s" },
        d.decode,
        d.batch_per_decode_worker,
        d.prefill_to_decode_gpus,
        d_value,
        a_value,
        if wins { "disaggregated wins" } else { "aggregated wins" },
        ((d_value - a_value).abs() / d_value.min(a_value).max(f64::MIN_POSITIVE)) * 100.0
    ));
    (wins || settings.disaggregate).then(|| d.clone())
}

/// With targets the runners-up lost on the targets, not on the raw objective: replaces the
/// `  not …` lines after `chosen: ` in `explain` with that, and adds the chosen point's line.
fn explain_targets(
    run: &Run<'_>,
    point: &sla::ParetoPoint,
    points: &[sla::ParetoPoint],
    ranked: &[&Candidate],
    explain: &mut Vec<String>,
) {
    explain.retain(|line| !line.starts_with("  not "));
    let at = explain
        .iter()
        .position(|line| line.starts_with("chosen: "))
        .map_or(explain.len(), |i| i + 1);
    let runners_up: Vec<String> = ranked
        .iter()
        .skip(1)
        .take(3)
        .map(|runner_up| runner_up_within_targets(run.settings.objective, point, points, runner_up))
        .collect();
    explain.splice(at..at, runners_up);
    explain.push(chosen_point_line(run, point, points));
}

/// Why `runner_up` lost to the chosen `point` within the targets: more GPUs for the rate
/// (`--objective cost` with `--rps`), else less of the objective, else no batch meets them.
fn runner_up_within_targets(
    objective: Objective,
    point: &sla::ParetoPoint,
    points: &[sla::ParetoPoint],
    runner_up: &Candidate,
) -> String {
    let value_of = |p: &sla::ParetoPoint| match objective {
        Objective::Throughput | Objective::Cost => p.tokens_per_sec_per_gpu,
        Objective::Latency => p.tokens_per_sec_per_user,
    };
    let unit = match objective {
        Objective::Throughput | Objective::Cost => "tokens/s per GPU",
        Objective::Latency => "tokens/s per user",
    };
    let within = points
        .iter()
        .filter(|p| p.parallel == runner_up.parallel && p.meets_sla);
    let line = match (objective, point.gpus_for_rps) {
        (Objective::Cost, Some(chosen_gpus)) => within
            .filter_map(|p| p.gpus_for_rps)
            .min()
            .map(|gpus| format!(
                "  not {}: needs at least {gpus} GPUs for the rate within the targets vs {chosen_gpus}",
                runner_up.parallel
            )),
        _ => {
            let chosen_value = value_of(point);
            within
                .map(value_of)
                .fold(None, |best: Option<f64>, v| Some(best.map_or(v, |b| b.max(v))))
                .map(|value| format!(
                    "  not {}: at most {value:.0} {unit} within the targets vs {chosen_value:.0}",
                    runner_up.parallel
                ))
        }
    };
    line.unwrap_or_else(|| {
        format!(
            "  not {}: no batch of it meets the targets",
            runner_up.parallel
        )
    })
}

/// The chosen point's line: the workload, its TTFT, TPOT and tokens/s per GPU, the GPUs
/// `--rps` needs, and how many points meet the targets.
fn chosen_point_line(
    run: &Run<'_>,
    point: &sla::ParetoPoint,
    points: &[sla::ParetoPoint],
) -> String {
    let settings = run.settings;
    let n_gpus = run.cluster.n_gpus();
    let replica = point.parallel.replica_size().max(1) as u64;
    format!(
        "for {} prompt and {} output tokens per request{}: {} at {} sequences per replica gives TTFT {:.0} ms, TPOT {:.1} ms, {:.0} tokens/s per GPU{}, the {} of the {} layout-and-batch points that meet the targets",
        settings.workload.isl_tokens,
        settings.workload.osl_tokens,
        targets_text(&settings.workload),
        point.parallel,
        point.batch_per_replica,
        point.ttft_secs * 1e3,
        point.tpot_secs * 1e3,
        point.tokens_per_sec_per_gpu,
        point.gpus_for_rps.map_or(String::new(), |g| format!(
            ", and {g} of the cluster's {n_gpus} GPUs ({} replica{} of this layout) serve {} requests/s",
            g / replica,
            if g / replica == 1 { "" } else { "s" },
            settings.workload.requests_per_sec.unwrap_or_default()
        )),
        match (settings.objective, point.gpus_for_rps) {
            (Objective::Cost, Some(_)) => "fewest GPUs",
            (Objective::Throughput | Objective::Cost, _) => "most tokens/s per GPU",
            (Objective::Latency, _) => "most tokens/s per user",
        },
        points.iter().filter(|p| p.meets_sla).count()
    )
}

/// ` within TTFT ≤ … and TPOT ≤ …` for the targets given.
fn targets_text(workload: &sla::Workload) -> String {
    let mut parts = Vec::new();
    if let Some(t) = workload.ttft_target_secs {
        parts.push(format!("TTFT ≤ {:.0} ms", t * 1e3));
    }
    if let Some(t) = workload.tpot_target_secs {
        parts.push(format!("TPOT ≤ {:.0} ms", t * 1e3));
    }
    if let Some(rps) = workload.requests_per_sec {
        parts.push(format!("{rps} requests/s"));
    }
    if parts.is_empty() {
        String::new()
    } else {
        format!(" within {}", parts.join(" and "))
    }
}

/// No layout and batch meets the targets: say how close the best come.
fn missed_targets(
    spec: &ModelSpec,
    cluster: &Cluster,
    workload: &sla::Workload,
    points: &[sla::ParetoPoint],
    alternatives: Vec<Alternative>,
) -> Infeasible {
    let fastest_tpot = points
        .iter()
        .min_by(|a, b| a.tpot_secs.total_cmp(&b.tpot_secs))
        .expect("points is not empty");
    let fastest_ttft = points
        .iter()
        .min_by(|a, b| a.ttft_secs.total_cmp(&b.ttft_secs))
        .expect("points is not empty");
    Infeasible {
        model: spec.name.clone(),
        cluster: cluster.description.clone(),
        message: format!(
            "no layout serves {} prompt and {} output tokens per request{} on `{}`: the lowest TPOT is {:.1} ms ({}, batch {}), the lowest TTFT {:.0} ms ({}, batch {})",
            workload.isl_tokens,
            workload.osl_tokens,
            targets_text(workload),
            cluster.description,
            fastest_tpot.tpot_secs * 1e3,
            fastest_tpot.parallel,
            fastest_tpot.batch_per_replica,
            fastest_ttft.ttft_secs * 1e3,
            fastest_ttft.parallel,
            fastest_ttft.batch_per_replica
        ),
        hint: "relax --ttft-ms/--tpot-ms, add GPUs, or quantize (`--dtype fp8`, `--kv-dtype fp8`)"
            .into(),
        min_gpus_needed: 0,
        kv_tokens_that_fit: None,
        alternatives,
    }
}

/// Every (tp, pp, dp, ep) that uses all GPUs (or exactly the pinned degrees).
fn enumerate(spec: &ModelSpec, n_gpus: u64, settings: &Settings) -> Vec<Degrees> {
    let n_gpus = n_gpus as usize;
    let divisors = |n: usize| (1..=n).filter(move |d| n.is_multiple_of(*d));
    let mut out = Vec::new();
    let pins = settings.pins;
    let tps: Vec<usize> = match pins.tp {
        Some(tp) => vec![tp],
        None => divisors(n_gpus).collect(),
    };
    for tp in tps {
        let pps: Vec<usize> = match pins.pp {
            Some(pp) => vec![pp],
            None => divisors(n_gpus / tp.max(1))
                .filter(|&pp| pp as u64 <= spec.n_layers)
                .collect(),
        };
        for pp in pps {
            let dp = match pins.dp {
                Some(dp) => dp,
                None if tp * pp == 0 || !n_gpus.is_multiple_of(tp * pp) => continue,
                None => n_gpus / (tp * pp),
            };
            let eps: Vec<usize> = match (pins.ep, &spec.moe) {
                (Some(ep), _) => vec![ep],
                (None, Some(_)) if tp * dp > 1 => vec![1, tp * dp],
                _ => vec![1],
            };
            for ep in eps {
                out.push(Degrees { tp, pp, ep, dp });
            }
        }
    }
    out
}

/// Every layout considered, checked and (when valid) estimated. On GPUs: every (tp, pp, dp,
/// ep) of [`enumerate`] over the cluster's GPUs. On CPU hosts: those of `r` ranks on every
/// host for each `r` from 1 to the most every host takes, each evaluated on the cluster as it
/// looks with `r` ranks per host ([`Cluster::with_cpu_ranks`]); a pinned layout whose ranks
/// do not spread evenly over the hosts, or exceed them, is refused with the reason.
fn candidates(run: &Run<'_>) -> Vec<Candidate> {
    let (spec, cluster, settings) = (run.spec, run.cluster, run.settings);
    if cluster.device() == Device::Gpu {
        return enumerate(spec, cluster.n_gpus(), settings)
            .into_iter()
            .map(|parallel| evaluate(run, parallel))
            .collect();
    }
    let n_hosts = cluster.hosts.len().max(1) as u64;
    let max_ranks = cluster.max_cpu_ranks_per_host();
    let mut layouts: Vec<Degrees> = Vec::new();
    for ranks in 1..=max_ranks {
        for parallel in enumerate(spec, ranks * n_hosts, settings) {
            if !layouts.contains(&parallel) {
                layouts.push(parallel);
            }
        }
    }
    layouts
        .into_iter()
        .map(|parallel| {
            let world = parallel.world_size() as u64;
            let ranks = world / n_hosts;
            let refused = if world == 0 || !world.is_multiple_of(n_hosts) {
                Some(format!(
                    "{world} CPU ranks do not spread evenly over {n_hosts} hosts"
                ))
            } else if ranks > max_ranks {
                Some(format!(
                    "needs {ranks} CPU ranks per host; the hosts take at most {max_ranks} (one per core, or `cpu-ranks`)"
                ))
            } else {
                None
            };
            match refused {
                Some(reason) => Candidate {
                    parallel,
                    verdict: Err(reason),
                    warnings: Vec::new(),
                    kv_tokens_that_fit: None,
                    hardware: cluster.slowest_hardware().clone(),
                },
                None => {
                    let view = cluster.with_cpu_ranks(ranks);
                    evaluate(
                        &Run {
                            cluster: &view,
                            ..*run
                        },
                        parallel,
                    )
                }
            }
        })
        .collect()
}

/// Checks one layout and, when it is valid and fits, estimates it.
fn evaluate(run: &Run<'_>, parallel: Degrees) -> Candidate {
    let mut warnings = Vec::new();
    let mut kv_tokens_that_fit = None;
    let device = run.cluster.device();
    let hardware = run.cluster.slowest_hardware();
    let verdict = (|| {
        check_degrees(run.spec, run.cluster, parallel)?;
        let layout = layout::place(&parallel, run.cluster);
        check_layout(run, parallel, &layout, &mut warnings)?;
        let stages = memory::stage_memory(
            run.spec,
            &parallel,
            run.dtype,
            run.kv_dtype,
            run.cluster.min_memory_bytes(),
            run.settings.gpu_memory_utilization,
            device,
        );
        check_memory(&stages, run.max_model_len_tokens, &mut kv_tokens_that_fit)?;
        let estimate = cost::estimate(
            run.spec,
            &parallel,
            &stages,
            run.dtype,
            hardware,
            &layout.links,
            run.max_model_len_tokens,
            memory::max_num_seqs(device),
        );
        Ok((estimate, stages, layout))
    })();
    Candidate {
        parallel,
        verdict,
        warnings,
        kv_tokens_that_fit,
        hardware: hardware.clone(),
    }
}

/// How the cluster's devices are named in reasons: `("GPU", "GPUs")`, or `("CPU rank", "CPU
/// ranks")`.
fn device_nouns(cluster: &Cluster) -> (&'static str, &'static str) {
    match cluster.device() {
        Device::Gpu => ("GPU", "GPUs"),
        Device::Cpu => ("CPU rank", "CPU ranks"),
    }
}

/// Checks the degrees of `parallel` against the model and the cluster's GPU count.
///
/// Errors: why the layout is invalid (a degree of 0, TP not dividing the heads, EP on a
/// dense model or not dividing the experts or TP·DP, more stages than layers, more GPUs
/// than the cluster has), as the alternative's reason.
fn check_degrees(spec: &ModelSpec, cluster: &Cluster, parallel: Degrees) -> Result<(), String> {
    let [tp, pp, ep, dp] = [parallel.tp, parallel.pp, parallel.ep, parallel.dp].map(|d| d as u64);
    if tp == 0 || pp == 0 || ep == 0 || dp == 0 {
        return Err("degrees must be at least 1".to_string());
    }
    if !spec.n_heads.is_multiple_of(tp) {
        let valid: Vec<String> = (1..=spec.n_heads)
            .filter(|d| spec.n_heads.is_multiple_of(*d))
            .map(|d| d.to_string())
            .collect();
        return Err(format!(
            "tp={tp} does not divide {} attention heads (valid tp: {})",
            spec.n_heads,
            valid.join(", ")
        ));
    }
    if spec.mla.is_none() && !spec.n_kv_heads.is_multiple_of(tp) && tp % spec.n_kv_heads != 0 {
        return Err(format!(
            "tp={tp} neither divides nor is a multiple of {} KV heads",
            spec.n_kv_heads
        ));
    }
    match &spec.moe {
        None if ep > 1 => {
            return Err(format!(
                "ep={ep} needs a mixture-of-experts model; `{}` is dense",
                spec.name
            ));
        }
        Some(moe) if moe.n_experts % ep != 0 => {
            return Err(format!("ep={ep} does not divide {} experts", moe.n_experts));
        }
        _ => {}
    }
    if (tp * dp) % ep != 0 {
        return Err(format!("ep={ep} does not divide tp·dp = {}", tp * dp));
    }
    if pp > spec.n_layers {
        return Err(format!("pp={pp} exceeds {} layers", spec.n_layers));
    }
    if parallel.world_size() as u64 > cluster.n_gpus() {
        return Err(format!(
            "needs {} {}; the cluster has {}",
            parallel.world_size(),
            device_nouns(cluster).1,
            cluster.n_gpus()
        ));
    }
    Ok(())
}

/// Checks the links of a placed layout: TP stays inside a node and off the CPU
/// interconnect unless `--tp` pins it (then a warning); TP over PCIe and EP across hosts
/// are warnings.
///
/// Errors: TP groups that would span hosts or cross a `SYS` path, unpinned.
fn check_layout(
    run: &Run<'_>,
    parallel: Degrees,
    layout: &layout::Layout,
    warnings: &mut Vec<String>,
) -> Result<(), String> {
    let Degrees { tp, ep, .. } = parallel;
    let (settings, cluster) = (run.settings, run.cluster);
    // The CPU ranks of one host share one device: no link inside a host to check.
    let cpu = cluster.device() == Device::Cpu;
    match layout.tp_worst_link {
        None if settings.pins.tp.is_some() => warnings.push(format!(
            "TP{tp} groups span hosts: every layer's all-reduce crosses the network (keep TP inside a node, PP across)"
        )),
        None => return Err(format!("TP{tp} would span hosts ({} {} per host): TP stays inside a node", cluster.min_gpus_per_host(), device_nouns(cluster).1)),
        Some(_) if cpu => {}
        Some(LinkCode::Sys) if settings.pins.tp.is_some() => warnings.push(format!(
            "TP{tp} groups cross the CPU interconnect (SYS): all-reduces run at a fraction of PCIe speed"
        )),
        Some(LinkCode::Sys) => return Err(format!("TP{tp} groups would cross the CPU interconnect (SYS path between GPUs)")),
        Some(code) if tp > 1 && !code.is_nvlink() => {
            warnings.push(format!("TP{tp} groups are not all NVLinked (worst pair {code}): all-reduces run over PCIe"));
        }
        _ => {}
    }
    if layout.ep_crosses_hosts {
        warnings.push(format!(
            "EP{ep} groups span hosts: every MoE layer's all-to-all crosses the network"
        ));
    }
    Ok(())
}

/// Checks that every stage's GPU holds its weights and reserve, and a KV cache of
/// `max_model_len_tokens`; when only the KV cache falls short, `kv_tokens_that_fit` gets
/// the tokens it does hold.
///
/// Errors: the stage whose weights and reserve exceed the usable memory, or the KV cache's
/// shortfall, as the alternative's reason.
fn check_memory(
    stages: &[StageMemory],
    max_model_len_tokens: u64,
    kv_tokens_that_fit: &mut Option<u64>,
) -> Result<(), String> {
    let max_model_len = max_model_len_tokens;
    if let Some(full) = stages
        .iter()
        .find(|s| s.weights_bytes + s.reserve_bytes > s.usable_bytes)
    {
        return Err(format!(
            "weights {:.1} GiB + reserve {:.1} GiB per GPU exceed the {:.1} GiB usable (stage {})",
            gib(full.weights_bytes),
            gib(full.reserve_bytes),
            gib(full.usable_bytes),
            full.pp_rank
        ));
    }
    let kv_tokens = stages.iter().map(|s| s.kv_tokens).min().unwrap_or(0);
    if kv_tokens < max_model_len {
        *kv_tokens_that_fit = Some(kv_tokens);
        return Err(format!(
            "no room for KV cache: {:.1} GiB left per GPU holds {kv_tokens} tokens < --max-model-len {max_model_len}",
            gib(stages.iter().map(|s| s.kv_cache_bytes).min().unwrap_or(0))
        ));
    }
    Ok(())
}

/// Better first: by objective, then fewer GPUs per replica (less communication), then less PP,
/// then fewer ranks in all.
fn compare(a: &Candidate, b: &Candidate, objective: Objective) -> std::cmp::Ordering {
    let (ea, eb) = match (&a.verdict, &b.verdict) {
        (Ok((ea, ..)), Ok((eb, ..))) => (ea, eb),
        _ => return std::cmp::Ordering::Equal,
    };
    let (va, vb, primary) = match objective {
        Objective::Latency => (
            ea.tpot_secs,
            eb.tpot_secs,
            ea.tpot_secs.total_cmp(&eb.tpot_secs),
        ),
        Objective::Throughput | Objective::Cost => (
            ea.tokens_per_sec,
            eb.tokens_per_sec,
            eb.tokens_per_sec.total_cmp(&ea.tokens_per_sec),
        ),
    };
    // Equal but for rounding (DP over a CPU host's ranks splits its bandwidth exactly as it
    // multiplies the batch) is a tie, for the rules below to settle.
    let primary = if (va - vb).abs() <= 1e-9 * va.abs().max(vb.abs()) {
        std::cmp::Ordering::Equal
    } else {
        primary
    };
    primary
        .then((a.parallel.tp * a.parallel.pp).cmp(&(b.parallel.tp * b.parallel.pp)))
        .then(a.parallel.pp.cmp(&b.parallel.pp))
        .then(a.parallel.ep.cmp(&b.parallel.ep))
        // CPU ranks: fewer of them on a host, when they do as well.
        .then(a.parallel.world_size().cmp(&b.parallel.world_size()))
}

/// The alternative `candidate` is: why it was refused, or its costed figure against the
/// `chosen` layout's on the objective (without one: no batch of it met the targets).
fn describe(
    candidate: &Candidate,
    chosen: Option<&Candidate>,
    objective: Objective,
) -> Alternative {
    let parallel = candidate.parallel;
    match &candidate.verdict {
        Err(reason) => Alternative {
            parallel,
            feasible: false,
            reason: reason.clone(),
            tpot_secs: None,
            tokens_per_sec: None,
            moe: None,
        },
        Ok((estimate, ..)) => {
            let reason = if let Some(Ok((best, ..))) = chosen.map(|c| &c.verdict) {
                match objective {
                    // With targets the chosen layout is the best point within them, which
                    // another layout may beat on the raw figure at its own batch.
                    Objective::Latency if estimate.tpot_secs < best.tpot_secs => format!(
                        "TPOT {:.2} ms vs {:.2} ms ({:.2}× faster at batch 1, but the chosen layout has the best point within the targets)",
                        estimate.tpot_secs * 1e3,
                        best.tpot_secs * 1e3,
                        best.tpot_secs / estimate.tpot_secs
                    ),
                    Objective::Latency => format!(
                        "TPOT {:.2} ms vs {:.2} ms ({:.2}× slower)",
                        estimate.tpot_secs * 1e3,
                        best.tpot_secs * 1e3,
                        estimate.tpot_secs / best.tpot_secs
                    ),
                    Objective::Throughput | Objective::Cost
                        if estimate.tokens_per_sec > best.tokens_per_sec =>
                    {
                        format!(
                            "{:.0} tokens/s vs {:.0} ({:.0}% more at its full batch, but the chosen layout has the best point within the targets)",
                            estimate.tokens_per_sec,
                            best.tokens_per_sec,
                            100.0 * (estimate.tokens_per_sec / best.tokens_per_sec - 1.0)
                        )
                    }
                    Objective::Throughput | Objective::Cost => format!(
                        "{:.0} tokens/s vs {:.0} ({:.0}% less)",
                        estimate.tokens_per_sec,
                        best.tokens_per_sec,
                        100.0 * (1.0 - estimate.tokens_per_sec / best.tokens_per_sec)
                    ),
                }
            } else {
                "no batch of it meets the targets".to_string()
            };
            Alternative {
                parallel,
                feasible: true,
                reason,
                tpot_secs: Some(estimate.tpot_secs),
                tokens_per_sec: Some(estimate.tokens_per_sec),
                moe: estimate.moe.clone(),
            }
        }
    }
}

/// The decision path (the tree of the module doc) in words, the choice, and the runners-up.
fn explain(
    run: &Run<'_>,
    candidates: &[Candidate],
    ranked: &[&Candidate],
    fits_without_pp: bool,
) -> Vec<String> {
    let (spec, cluster, settings, dtype) = (run.spec, run.cluster, run.settings, run.dtype);
    let max_model_len = run.max_model_len_tokens;
    let hardware = cluster.slowest_hardware();
    let usable = cluster.min_memory_bytes() as f64 * settings.gpu_memory_utilization;
    let weights = spec.weight_bytes(dtype);
    let mut lines = vec![format!(
        "{}: {:.2} B parameters ({:.2} B active per token), {:.1} GiB of weights in {dtype}",
        spec.name,
        spec.param_counts().total() as f64 / 1e9,
        spec.active_params() as f64 / 1e9,
        gib(weights)
    )];
    match cluster.device() {
        Device::Gpu => lines.push(format!(
            "one {} holds {:.1} GiB at gpu_memory_utilization {}; the cluster has {} GPUs, {} per host",
            hardware.name,
            usable / (1u64 << 30) as f64,
            settings.gpu_memory_utilization,
            cluster.n_gpus(),
            cluster.min_gpus_per_host()
        )),
        Device::Cpu => lines.extend(cpu_lines(run, ranked.first().copied())),
    }
    lines.push(decision(run, candidates));
    if !fits_without_pp && ranked.iter().all(|c| c.parallel.pp > 1) && !ranked.is_empty() {
        lines.push(format!(
            "KV cache must hold --max-model-len {max_model_len} tokens on every stage"
        ));
    }
    lines.extend(chosen_lines(ranked, settings.objective));
    lines.extend(experts_line(ranked, settings.objective));
    lines
}

/// MoE models: the best layout with EP against the best without (MoE-TP: every expert
/// sliced over TP), by the objective, with what differs between them in a decode step — the
/// rows of each expert's GEMM, the busiest EP GPU's load, the time in experts, and the
/// all-to-alls against the all-reduces ([`cost::MoeStep`]). `None` for dense models, or
/// when only one kind fits.
fn experts_line(ranked: &[&Candidate], objective: Objective) -> Option<String> {
    let best = |with_ep: bool| {
        ranked.iter().find_map(|c| match &c.verdict {
            Ok((estimate, ..)) if (c.parallel.ep > 1) == with_ep => {
                estimate.moe.as_ref().map(|moe| (c.parallel, estimate, moe))
            }
            _ => None,
        })
    };
    let ((ep_layout, ep_estimate, ep_moe), (tp_layout, tp_estimate, tp_moe)) =
        (best(true)?, best(false)?);
    let (ep_value, tp_value, unit, ep_step, tp_step, ep_wins) = match objective {
        Objective::Latency => (
            ep_estimate.tpot_secs * 1e3,
            tp_estimate.tpot_secs * 1e3,
            "ms TPOT at batch 1",
            &ep_moe.at_batch_1,
            &tp_moe.at_batch_1,
            ep_estimate.tpot_secs < tp_estimate.tpot_secs,
        ),
        Objective::Throughput | Objective::Cost => (
            ep_estimate.tokens_per_sec,
            tp_estimate.tokens_per_sec,
            "tokens/s",
            &ep_moe.at_batch,
            &tp_moe.at_batch,
            ep_estimate.tokens_per_sec > tp_estimate.tokens_per_sec,
        ),
    };
    let (better, worse) = match objective {
        Objective::Latency => (ep_value.min(tp_value), ep_value.max(tp_value)),
        Objective::Throughput | Objective::Cost => (ep_value.max(tp_value), ep_value.min(tp_value)),
    };
    let margin = match objective {
        Objective::Latency => worse / better.max(f64::MIN_POSITIVE) - 1.0,
        Objective::Throughput | Objective::Cost => better / worse.max(f64::MIN_POSITIVE) - 1.0,
    };
    let bound = |step: &cost::MoeStep| {
        if step.tokens_per_expert * step.busiest_gpu_load < step.ridge_tokens_per_expert {
            "memory-bound"
        } else {
            "compute-bound"
        }
    };
    Some(format!(
        "EP vs MoE-TP: {} wins by {:.0}%: {ep_layout} {ep_value:.2} {unit} vs {tp_layout} {tp_value:.2}; \
         per decode step at batch {} vs {}: {:.2} vs {:.2} tokens per expert GEMM ({} vs {}; compute-bound from {:.0}), \
         the busiest EP GPU carries {:.2}× the mean rows, experts {:.3} vs {:.3} ms, all-to-all {:.3} ms vs all-reduce {:.3} ms",
        if ep_wins { "EP" } else { "MoE-TP" },
        100.0 * margin,
        ep_step.batch,
        tp_step.batch,
        ep_step.tokens_per_expert,
        tp_step.tokens_per_expert,
        bound(ep_step),
        bound(tp_step),
        ep_step.ridge_tokens_per_expert,
        ep_step.busiest_gpu_load,
        ep_step.expert_secs * 1e3,
        tp_step.expert_secs * 1e3,
        ep_step.collective_secs * 1e3,
        tp_step.collective_secs * 1e3,
    ))
}

/// On CPU hosts, what a device is: the host's CPU (its figures and where they come from),
/// shared by its ranks; and, for the chosen layout, each rank's share of it.
fn cpu_lines(run: &Run<'_>, best: Option<&Candidate>) -> Vec<String> {
    let cluster = run.cluster;
    let n_hosts = cluster.hosts.len().max(1) as u64;
    let mut profiles: Vec<&crate::topology::CpuProfile> = Vec::new();
    for cpu in cluster.hosts.iter().filter_map(|h| h.cpu.as_ref()) {
        if !profiles.contains(&&cpu.profile) {
            profiles.push(&cpu.profile);
        }
    }
    let mut lines: Vec<String> = profiles
        .iter()
        .map(|p| {
            let engine = p.decode_bytes_per_sec.map_or(String::new(), |rate| {
                let bf16 = p.decode_bf16_bytes_per_sec.map_or(String::new(), |bf16| {
                    let prompt = p
                        .prefill_bf16_flops_per_sec
                        .map_or(String::new(), |flops| {
                            format!(", its prompts' products at {:.1} GFLOP/s", flops / 1e9)
                        });
                    format!(" ({:.1} GB/s in bf16{prompt})", bf16 / 1e9)
                });
                let kv = p.decode_attention_flops_per_sec.map_or(String::new(), |flops| {
                    let alone = p
                        .decode_one_thread_attention_flops_per_sec
                        .map_or(String::new(), |alone| {
                            format!(", {:.1} on one thread alone", alone / 1e9)
                        });
                    format!(
                        ", its attention over the KV cache at {:.1} GFLOP/s (every thread busy{alone})",
                        flops / 1e9
                    )
                });
                let layers = p.decode_layer_secs.map_or(String::new(), |secs| {
                    format!(" plus {:.0} µs a layer on every core", secs * 1e6)
                });
                let alone = p
                    .decode_one_thread_bytes_per_sec
                    .map_or(String::new(), |alone| {
                        format!(" ({:.1} GB/s on one thread alone)", alone / 1e9)
                    });
                format!(
                    ", its engine's decode step reading weights at {:.1} GB/s{alone}{layers}{bf16}{kv}",
                    rate / 1e9
                )
            });
            let prompt = p
                .prefill_attention_flops_per_sec
                .map_or(String::new(), |flops| {
                    format!(", a prompt's attention at {:.1} GFLOP/s", flops / 1e9)
                });
            let one_thread = p.prefill_one_thread_share.map_or(String::new(), |part| {
                format!(
                    ", one thread computing {part:.2} of its prompt rates while every core runs one"
                )
            });
            format!(
                "each host's CPU is one device its ranks share: {}, {} cores, {:.1} GiB of memory read at {:.1} GB/s{engine}, computing {:.1} GFLOP/s{prompt}{one_thread} ({})",
                p.name,
                p.n_cores,
                gib(p.memory_bytes),
                p.memory_bytes_per_sec / 1e9,
                p.flops_per_sec / 1e9,
                p.source
            )
        })
        .collect();
    let max_ranks = cluster.max_cpu_ranks_per_host();
    let min_cores = profiles.iter().map(|p| p.n_cores).min().unwrap_or(1);
    lines.push(format!(
        "the cluster has {n_hosts} CPU host{}, each taking 1 to {max_ranks} ranks ({}); `r` ranks on a host each get 1/r of its memory and, up to one rank per core, of its cores and compute, and of its engine's rates at least their threads' share and at most what those threads do alone (a team's hand-offs cost what a thread alone does not pay)",
        if n_hosts == 1 { "" } else { "s" },
        if max_ranks <= min_cores {
            "one per core at most".to_string()
        } else {
            // The inventory's `cpu-ranks` is trusted; say what the estimates leave out.
            format!(
                "its `cpu-ranks`, more than its {min_cores} cores: ranks beyond one per core take turns on them: each rank has one thread and, between two collectives, the ranks run in ⌈ranks / cores⌉ turns of the cores, so each gets what one thread does alone for one of its turns (without a one-thread figure, 1/(⌈ranks / cores⌉ · cores) of the host's rates)"
            )
        }
    ));
    if let Some(best) = best {
        let ranks = best.parallel.world_size() as u64 / n_hosts;
        let rank = &best.hardware;
        let cores = cluster
            .hosts
            .iter()
            .filter_map(|h| h.cpu.as_ref().map(|c| c.profile.n_cores))
            .min()
            .unwrap_or(1);
        lines.push(format!(
            "with {ranks} rank{} per host, each rank has {} thread{}, {:.1} GiB usable at gpu_memory_utilization {}, {:.1} GB/s and {:.1} GFLOP/s",
            if ranks == 1 { "" } else { "s" },
            (cores / ranks.max(1)).max(1),
            if (cores / ranks.max(1)).max(1) == 1 { "" } else { "s" },
            gib(rank.memory_bytes) * run.settings.gpu_memory_utilization,
            run.settings.gpu_memory_utilization,
            rank.hbm_gb_per_sec,
            rank.bf16_tflops * 1e3
        ));
        let tp = best.parallel.tp;
        if let Some(chain) = cost::row_chain(rank, run.dtype, tp) {
            lines.push(format!(
                "TP {tp} runs in exact order, as one process would: each layer's two row-parallel products (attention output, MLP down) go from rank to rank, each continuing the previous one's dot products ({} turns of {:.1} MB instead of one, each {:.2}× as fast as with every rank working), then the last rank sends the sums to the others ({tp} messages per product instead of an all-reduce)",
                tp,
                run.spec.row_parallel_bytes(run.dtype) / (tp * best.parallel.pp) as f64 / 1e6,
                chain.alone_speedup,
            ));
        }
    }
    if let Some(asked) = run.settings.dtype
        && asked != run.dtype
        && run.spec.native_dtype != Dtype::Gguf
    {
        lines.push(format!(
            "--dtype {asked} on CPU ranks is planned as {}: the CPU engine runs no AWQ, GPTQ or W8A8 kernels but ggml's blocks of 32 weights with an f16 scale, in every matrix and the LM head ({:.1} GiB of weights)",
            run.dtype,
            gib(run.spec.weight_bytes(run.dtype))
        ));
    }
    lines
}

/// The step of the decision tree the candidates took: pinned degrees, one GPU, experts
/// sharded without TP, TP inside a node, or TP × PP inside one node or across nodes.
fn decision(run: &Run<'_>, candidates: &[Candidate]) -> String {
    let (cluster, settings) = (run.cluster, run.settings);
    let (one, many) = device_nouns(cluster);
    let fits = |pred: &dyn Fn(&Degrees) -> bool| {
        candidates
            .iter()
            .any(|c| pred(&c.parallel) && c.verdict.is_ok())
    };
    // One GPU holds the whole model only without expert sharding: with EP each GPU holds
    // 1/EP of the experts, so the model needs EP GPUs.
    let one_gpu = fits(&|p| p.tp == 1 && p.pp == 1 && p.ep == 1);
    let experts_sharded = candidates
        .iter()
        .filter(|c| c.parallel.tp == 1 && c.parallel.pp == 1 && c.parallel.ep > 1)
        .find(|c| c.verdict.is_ok())
        .map(|c| c.parallel.ep);
    let one_node = fits(&|p| p.pp == 1 && p.ep == 1);
    let experts_over_ep = candidates
        .iter()
        .filter(|c| c.parallel.pp == 1 && c.parallel.ep > 1)
        .find(|c| c.verdict.is_ok())
        .map(|c| c.parallel);
    let pinned: Vec<String> = settings
        .pins
        .named()
        .iter()
        .filter_map(|(flag, value)| {
            value.map(|v| format!("{} {v} ({flag})", flag[2..].to_uppercase()))
        })
        .collect();
    if !pinned.is_empty() {
        // The candidates are only the pinned layouts: what fits elsewhere is unknown here.
        format!(
            "{} pinned by the flags: only layouts with {} were searched",
            pinned.join(", "),
            if pinned.len() == 1 { "it" } else { "them" }
        )
    } else if one_gpu {
        format!(
            "fits one {one} with room for the KV cache → replicate: DP over the {many} (TP only if it wins on the objective)"
        )
    } else if let Some(ep) = experts_sharded {
        format!(
            "does not fit one {one}; fits without TP when its experts are sharded over EP{ep} (each {one} holds 1/{ep} of them) → attention data-parallel, experts expert-parallel (TP only if it wins on the objective)"
        )
    } else if one_node {
        format!(
            "does not fit one {one}; fits with TP inside a node → TP ≤ {} (× DP for the remaining {many})",
            cluster.min_gpus_per_host()
        )
    } else if let Some(p) = experts_over_ep {
        format!(
            "does not fit one {one}, nor TP inside a node without EP; fits without PP when its experts are sharded over EP{} with TP{} → TP{} × DP{} (EP{}), or PP",
            p.ep, p.tp, p.tp, p.dp, p.ep
        )
    } else if cluster.hosts.len() == 1 {
        // One node: the stages share it; nothing crosses a network.
        format!(
            "does not fit with TP alone on the node's {} {many} → TP × PP inside the node",
            cluster.min_gpus_per_host()
        )
    } else {
        "does not fit TP inside one node → TP inside the node × PP across nodes".to_string()
    }
}

/// The `chosen: ` line of the best ranked layout and a `  not …` line for each of the next
/// three; none when nothing is ranked.
fn chosen_lines(ranked: &[&Candidate], objective: Objective) -> Vec<String> {
    let mut lines = Vec::new();
    if let Some(best) = ranked.first()
        && let Ok((estimate, ..)) = &best.verdict
    {
        lines.push(format!(
            "chosen: {} for {}: TPOT {:.2} ms at batch 1; {:.0} tokens/s at {} sequences per replica",
            best.parallel,
            match objective {
                Objective::Latency => "latency",
                Objective::Throughput => "throughput",
                Objective::Cost => "cost",
            },
            estimate.tpot_secs * 1e3,
            estimate.tokens_per_sec,
            estimate.batch_per_replica
        ));
        for runner_up in ranked.iter().skip(1).take(3) {
            let alternative = describe(runner_up, Some(best), objective);
            lines.push(format!(
                "  not {}: {}",
                runner_up.parallel, alternative.reason
            ));
        }
    }
    lines
}

/// On CPU hosts, when even one rank with the whole host's memory cannot hold the weights, its
/// reserve and one sequence of `--max-model-len` tokens of KV cache on as many hosts as the
/// cluster has: the answer saying how many such hosts it needs. `None` on GPUs, or when that
/// is not why nothing fits.
fn cpu_memory_shortfall(run: &Run<'_>, alternatives: &[Alternative]) -> Option<Infeasible> {
    let (spec, cluster, settings) = (run.spec, run.cluster, run.settings);
    if cluster.device() != Device::Cpu {
        return None;
    }
    let (dtype, max_model_len) = (run.dtype, run.max_model_len_tokens);
    let host = cluster.with_cpu_ranks(1);
    let memory_bytes = host.min_memory_bytes();
    let usable = (memory_bytes as f64 * settings.gpu_memory_utilization) as u64;
    let one = Degrees {
        tp: 1,
        pp: 1,
        ep: 1,
        dp: 1,
    };
    let reserve = memory::reserve_bytes(spec, &one, true, Device::Cpu);
    let weights = spec.weight_bytes(dtype);
    let kv_full_sequence = spec.kv_bytes_per_token(spec.n_layers, 1, run.kv_dtype) * max_model_len;
    let n_hosts = cluster.hosts.len() as u64;
    let min_hosts = (1..=1_000_000u64)
        .find(|&n| weights / n + reserve + kv_full_sequence / n <= usable)
        .unwrap_or(u64::MAX);
    if min_hosts <= n_hosts {
        return None;
    }
    let cpu = &host.slowest_hardware().name;
    Some(Infeasible {
        model: spec.name.clone(),
        cluster: cluster.description.clone(),
        message: format!(
            "`{}` ({dtype}) needs ≥ {:.1} GiB of weights plus KV cache for {max_model_len} tokens; {n_hosts} × {:.1} GiB × {} = {:.1} GiB of host memory on `{}`: \
             it needs at least {min_hosts} hosts of {cpu}",
            spec.name,
            gib(weights),
            gib(memory_bytes),
            settings.gpu_memory_utilization,
            gib(usable * n_hosts),
            cluster.description
        ),
        hint: "lower `--max-model-len`, give a smaller model, or plan over more hosts (an inventory of `cpu-ranks` hosts)".into(),
        min_gpus_needed: 0,
        kv_tokens_that_fit: None,
        alternatives: alternatives.to_vec(),
    })
}

/// Why nothing works, with the numbers and the fix.
fn infeasible(
    run: &Run<'_>,
    candidates: &[Candidate],
    alternatives: Vec<Alternative>,
) -> Infeasible {
    let (spec, cluster, settings) = (run.spec, run.cluster, run.settings);
    let (dtype, kv_dtype, max_model_len) = (run.dtype, run.kv_dtype, run.max_model_len_tokens);
    if let Some(too_big) = cpu_memory_shortfall(run, &alternatives) {
        return too_big;
    }
    let n_gpus = cluster.n_gpus();
    let per_host = cluster.min_gpus_per_host().max(1);
    let memory_bytes = cluster.min_memory_bytes();
    let usable = (memory_bytes as f64 * settings.gpu_memory_utilization) as u64;
    let weights = spec.weight_bytes(dtype);
    // Smallest GPU count whose share of weights, base reserve and one full-length sequence of
    // KV cache fits the usable memory of each GPU.
    let one = Degrees {
        tp: 1,
        pp: 1,
        ep: 1,
        dp: 1,
    };
    let base_reserve =
        memory::reserve_bytes(spec, &one, true, Device::Gpu) + 2 * memory::NCCL_COMMUNICATOR_BYTES;
    let kv_full_sequence = spec.kv_bytes_per_token(spec.n_layers, 1, kv_dtype) * max_model_len;
    let min_gpus_needed = (1..=1_000_000u64)
        .find(|&n| weights / n + base_reserve + kv_full_sequence / n <= usable)
        .unwrap_or(u64::MAX);
    let gpu_name = &cluster.slowest_hardware().name;
    // (CPU hosts that lack memory were answered above, host by host.)
    if cluster.device() == Device::Gpu && min_gpus_needed > n_gpus {
        let nodes = min_gpus_needed.div_ceil(per_host);
        return Infeasible {
            model: spec.name.clone(),
            cluster: cluster.description.clone(),
            message: format!(
                "`{}` ({dtype}) needs ≥ {:.1} GiB of weights plus KV cache for {max_model_len} tokens; {n_gpus} × {:.1} GiB × {} = {:.1} GiB on `{}`: \
                 it needs at least {min_gpus_needed} × {gpu_name} ({nodes} nodes of {per_host})",
                spec.name,
                gib(weights),
                gib(memory_bytes),
                settings.gpu_memory_utilization,
                gib(usable * n_gpus),
                cluster.description
            ),
            hint: {
                let smaller: Vec<&str> = [(Dtype::Fp8, "fp8"), (Dtype::Int4, "int4")]
                    .iter()
                    .filter(|(d, _)| d.bytes_per_param() < dtype.bytes_per_param())
                    .map(|(_, name)| *name)
                    .collect();
                let mut hint = format!(
                    "add nodes (`--cluster {nodes}x{per_host}x{}`) or lower `--max-model-len`",
                    cluster.hosts[0].hardware_id
                );
                if !smaller.is_empty() {
                    hint.push_str(&format!(
                        ", or quantize (`--dtype {}`)",
                        smaller.join("`/`")
                    ));
                }
                hint
            },
            min_gpus_needed,
            kv_tokens_that_fit: candidates.iter().filter_map(|c| c.kv_tokens_that_fit).max(),
            alternatives,
        };
    }
    let mut reasons: Vec<String> = candidates
        .iter()
        .filter_map(|c| {
            c.verdict
                .as_ref()
                .err()
                .map(|reason| format!("{}: {reason}", c.parallel))
        })
        .collect();
    reasons.dedup();
    if reasons.is_empty() {
        reasons.push(format!(
            "no layout uses the cluster's {}",
            device_nouns(cluster).1
        ));
    }
    Infeasible {
        model: spec.name.clone(),
        cluster: cluster.description.clone(),
        message: format!("no valid plan for `{}` on `{}`: {}", spec.name, cluster.description, reasons.join("; ")),
        hint: "change the pinned degrees (`--tp/--pp/--ep/--dp`), or drop them to let the planner search".to_string(),
        min_gpus_needed: 0,
        kv_tokens_that_fit: candidates.iter().filter_map(|c| c.kv_tokens_that_fit).max(),
        alternatives,
    }
}
