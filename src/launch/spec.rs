//! What to launch: the layout, the model, the serving settings and where each rank runs
//! ([`LaunchSpec`], [`Placement`], [`StoreLocation`]), checked against the model before
//! anything starts.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Result, bail};

use crate::degrees::Degrees;
use crate::envvars;
use crate::runtime::cpu::quant::Numerics;
use crate::runtime::exec::rank_env::{HostEnv, ServingEnv};

/// Environment variables whose values `manifest.json` never shows: our run token, run keys
/// and API key, and the credentials a rank may inherit from the usual tools (Hugging Face, OpenAI,
/// vLLM). Named one by one: `INFER_KV_CACHE_TOKENS` holds a size, not a secret.
pub const SECRET_ENV: &[&str] = &[
    envvars::RUN_TOKEN,
    envvars::RUN_KEYS,
    envvars::API_KEY,
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "OPENAI_API_KEY",
    "VLLM_API_KEY",
];

/// What to launch.
#[derive(Clone, Debug)]
pub struct LaunchSpec {
    /// The layout: world size `dp × pp × tp`; `ep` is 1, or `tp` (experts sharded over each
    /// TP group).
    pub degrees: Degrees,
    /// The weights every rank loads (a GGUF file, or random weights every rank generates
    /// alike); `None`: a gang of collectives only, no model (it runs [`crate::runtime::exec::worker::Job::AllReduce`] and
    /// nothing else).
    pub model: Option<crate::runtime::model::source::ModelSource>,
    /// Threads of each rank's pool.
    pub threads_per_rank: usize,
    /// How every rank's matrix products round (`INFER_NUMERICS`).
    pub numerics: Numerics,
    /// Timeout of collectives and store waits inside the ranks.
    pub timeout: Duration,
    /// `infer up`'s settings, which every rank of a serving gang gets (`None`: the gang
    /// serves nothing).
    pub serving: Option<ServingEnv>,
    /// Where the layout came from (flags, a plan file, a plan for a cluster), for the
    /// manifest.
    pub layout_from: String,
    /// Where each rank runs when they are spread over hosts (indexed by rank); empty: every
    /// rank on this host.
    pub placement: Vec<Placement>,
    /// On an inventory's hosts: the host a plan put each rank on (its name, indexed by
    /// rank); `None`: the launcher spreads the ranks itself (`hosts::place`).
    pub planned_hosts: Option<Vec<String>>,
    /// The run directory (rank logs, `manifest.json`; `--run-dir`); `None`: a new one under
    /// [`super::runs_dir`], the oldest beyond [`super::KEEP_RUNS`] removed.
    pub run_dir: Option<PathBuf>,
    /// `--device cuda` ranks: each rank's `CUDA_VISIBLE_DEVICES` (indexed by rank; its host's
    /// GPU, so the rank computes on its first visible GPU); `None`: CPU ranks, which see no GPU.
    pub gpus: Option<Vec<String>>,
    /// Which start of a supervised run this is (`infer up --max-restarts`): 0 the first;
    /// a restart reuses `run_dir` (the failed start's files moved aside) and injects no
    /// test fault (`INFER_TEST_FAULT` concerns the first start).
    pub restart: usize,
}

/// The timeout of a gang's collectives and store waits (`INFER_TIMEOUT_SECS`): 60 s, or
/// 600 s when the ranks run the CUDA kernels on the host harness (`harness`), which spawns a
/// CPU thread per CUDA thread and takes seconds a step even on an idle machine, so a loaded
/// one can keep a pipeline stage waiting past a minute.
pub fn rank_timeout(harness: bool) -> Duration {
    Duration::from_secs(if harness { 600 } else { 60 })
}

/// `CUDA_VISIBLE_DEVICES` of `world` device ranks on one host with `visible` GPUs: rank `r`
/// gets GPU `r % visible` (ranks beyond the GPUs share them, and their collectives go through
/// host memory); with `visible` 0 (the host harness) rank `r` gets `r`, as on a host with
/// enough GPUs.
pub fn local_gpus(world: usize, visible: usize) -> Vec<String> {
    gpus_by_local_rank(0..world, visible)
}

/// [`local_gpus`] of ranks spread over hosts: each rank's `CUDA_VISIBLE_DEVICES` from its
/// `LOCAL_RANK` and the GPUs its host shows (`local_rank % visible`; 0: `local_rank`).
pub fn gpus_by_local_rank(
    local_ranks: impl IntoIterator<Item = usize>,
    visible: usize,
) -> Vec<String> {
    local_ranks
        .into_iter()
        .map(|local_rank| match visible {
            0 => local_rank,
            n => local_rank % n,
        })
        .map(|gpu| gpu.to_string())
        .collect()
}

impl LaunchSpec {
    /// The host index of each rank (`[rank]`): hosts numbered in the order their first rank
    /// appears in the placement; every rank on host 0 without one.
    pub fn rank_hosts(&self) -> Vec<u32> {
        if self.placement.is_empty() {
            return vec![0; self.degrees.world_size()];
        }
        let mut names: Vec<&str> = Vec::new();
        self.placement
            .iter()
            .map(|placed| {
                let index = names
                    .iter()
                    .position(|n| *n == placed.host)
                    .unwrap_or_else(|| {
                        names.push(&placed.host);
                        names.len() - 1
                    });
                index as u32
            })
            .collect()
    }

    /// Checks the layout against the model's header before anything starts: the TP degree
    /// splits its heads and MLP, PP has a layer per stage, EP divides its experts. A gang
    /// without a model (collectives only) passes.
    ///
    /// Errors: a degree of 0, an unreadable GGUF header, a layout the model cannot take
    /// (the message lists the TP degrees that work).
    pub fn check_layout(&self) -> Result<()> {
        self.degrees.check()?;
        let Degrees { tp, pp, ep, .. } = self.degrees;
        let model = match &self.model {
            None => return Ok(()),
            Some(crate::runtime::model::source::ModelSource::Dummy(dummy)) => {
                let config = dummy.config();
                return crate::runtime::model::llama::LayoutLimits {
                    name: dummy.name.clone(),
                    n_layers: config.n_layers,
                    n_heads: config.n_heads,
                    n_kv_heads: config.n_kv_heads,
                    intermediate_size: config.intermediate_size,
                    n_experts: 0,
                }
                .check(tp, pp, ep);
            }
            Some(crate::runtime::model::source::ModelSource::File(path)) => path,
        };
        if model.is_dir() {
            bail!(
                "`{}` is a directory: ranks load GGUF files; give the `.gguf` file",
                model.display()
            );
        }
        let header = crate::runtime::formats::gguf::Header::read_file(model)?;
        let name = model.file_name().map_or_else(
            || model.display().to_string(),
            |n| n.to_string_lossy().into_owned(),
        );
        crate::runtime::model::llama::LayoutLimits::from_header(&header, &name)?.check(tp, pp, ep)
    }
}

/// Where one rank runs on a multi-host launch, and its host's own settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    /// Inventory name of the host.
    pub host: String,
    /// Rank within the host (`LOCAL_RANK`); the host's ranks are consecutive.
    pub local_rank: usize,
    /// Ranks on the host (`LOCAL_WORLD_SIZE`).
    pub local_world_size: usize,
    /// The host's own settings: its data interface and address (where the rank's
    /// collectives listen), its HCAs.
    pub env: HostEnv,
    /// Threads of this rank's pool when its host decides them (`None`: the spec's).
    pub threads: Option<usize>,
}

/// Where the rendezvous store runs.
#[derive(Clone, Copy, Debug)]
pub enum StoreLocation {
    /// In this process, on loopback (every rank on this host).
    Local,
    /// In this process, listening on this address (node 0 of `infer up --nnodes`: the
    /// other nodes' launchers and ranks connect to it).
    Listen(std::net::SocketAddr),
    /// On another host (rank 0's, run by its agent): `ranks` is `MASTER_ADDR:MASTER_PORT`
    /// as ranks reach it, `launcher` where this process reaches it (a forwarded port).
    Remote {
        ranks: std::net::SocketAddr,
        launcher: std::net::SocketAddr,
    },
}
