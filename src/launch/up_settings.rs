//! `infer up`'s settings, each checked once here, before anything loads or starts: the
//! [`UpSettings`] the launcher takes, the node of a multi-node launch ([`NodeSettings`]),
//! and the checks of the values they are built from (the scheduler's limits, where the
//! layout comes from, the model's length and id, the timeouts, the API key). No clap types:
//! the command hands in plain values.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};

use crate::degrees::DegreePins;
use crate::runtime::cpu::quant::Numerics;
use crate::runtime::model::source::ModelSource;
use crate::serve::scheduler::Limits;

/// Everything `infer up` was asked for, validated (no clap types).
#[derive(Clone, Debug)]
pub(crate) struct UpSettings {
    /// The weights (a `.gguf` file or a model directory, or random weights of a shape).
    pub model: ModelSource,
    /// The id `/v1/models` lists.
    pub model_id: String,
    /// Longest prompt plus completion, tokens (`--max-model-len`; `None`: the model's
    /// context).
    pub max_model_len: Option<usize>,
    /// After Ctrl-C, how long requests in flight may finish before they are cancelled
    /// (`--shutdown-timeout`).
    pub shutdown_timeout: Duration,
    /// A replica with work and no progress for longer is stalled (`--stall-timeout`).
    pub stall_timeout: Duration,
    /// Requests that may wait beyond those running before new ones get 503
    /// (`--max-queued-requests`; `None`: no bound).
    pub max_queued_requests: Option<usize>,
    /// Restarts of the gang after a failure, with the HTTP front kept up
    /// (`--max-restarts`; 0: the run ends at the first failure).
    pub max_restarts: usize,
    /// Pinned degrees (`--tp/--pp/--dp/--ep`).
    pub pins: DegreePins,
    /// A saved plan (`infer plan --json`).
    pub plan: Option<PathBuf>,
    /// `--cluster`: `local`, a shorthand, or an inventory file.
    pub cluster: Option<String>,
    pub host: String,
    pub port: u16,
    /// Threads per rank (0: the host's cores over its ranks).
    pub threads: usize,
    pub numerics: Numerics,
    /// Most sequences running at once and tokens per step, on every replica.
    pub limits: Limits,
    pub kv_cache_tokens: usize,
    /// Whether replicas reuse cached prompt prefixes (`--no-prefix-cache` turns it off).
    pub prefix_cache: bool,
    /// Prefill/decode disaggregation: the first this many of the `dp` replicas prefill,
    /// the others decode (`INFER_PD_PREFILL`).
    pub pd_prefill: Option<usize>,
    pub api_key: Option<String>,
    /// `/metrics` requires the API key too (`--protect-metrics`).
    pub protect_metrics: bool,
    pub ssh: super::ssh::SshOptions,
    pub push_model: bool,
    /// The run directory (`--run-dir`); `None`: a new one under the cache's `runs/`.
    pub run_dir: Option<PathBuf>,
    /// This process is one node of a multi-node launch (`--nnodes`).
    pub node: Option<NodeSettings>,
    /// `--device cuda`: the model on this host's GPU (one process; ranks on GPUs are not
    /// built).
    pub gpu: Option<crate::serve::http::GpuSettings>,
}

/// The shortest `INFER_RUN_TOKEN` an `--nnodes` launch accepts: 16 characters (a random
/// hex string of 16 is 64 bits; `openssl rand -hex 16` gives 128).
const MIN_TOKEN_BYTES: usize = 16;

/// One node of a launch whose nodes each run `infer up --nnodes N --node-rank R`
/// (torchrun's model: no SSH; a scheduler, pdsh or the user starts every node).
#[derive(Clone, Debug)]
pub(crate) struct NodeSettings {
    pub nnodes: usize,
    pub node_rank: usize,
    /// Node 0's store, as every node reaches it (`MASTER_ADDR:MASTER_PORT`).
    pub master: SocketAddr,
    /// Where this node's ranks' collectives listen (`INFER_BIND_ADDR`).
    pub bind_addr: std::net::IpAddr,
    /// The secret every node shares (`INFER_RUN_TOKEN`).
    pub token: String,
}

impl NodeSettings {
    /// The ranks this node runs out of `world`: its consecutive, even share.
    pub(crate) fn ranks(&self, world: usize) -> std::ops::Range<usize> {
        let share = world / self.nnodes;
        self.node_rank * share..(self.node_rank + 1) * share
    }

    /// The node's settings from its flags: `master_addr` resolved (IPv4 first), the bind
    /// address found from the route to it when not given.
    ///
    /// Errors: `node_rank` ≥ `nnodes`, a master address that does not resolve, no route to
    /// it, a token that is missing or empty.
    pub(crate) fn resolve(
        nnodes: usize,
        node_rank: usize,
        master_addr: &str,
        master_port: u16,
        bind_addr: Option<std::net::IpAddr>,
        token: Option<String>,
    ) -> Result<NodeSettings> {
        use std::net::ToSocketAddrs;
        if nnodes == 0 || node_rank >= nnodes {
            bail!(
                "--node-rank must be 0 to --nnodes − 1 ({}), got {node_rank}",
                nnodes.saturating_sub(1)
            );
        }
        let token = token.filter(|t| !t.is_empty()).with_context(|| {
            format!(
                "--nnodes: set `{}` to one secret shared by every node (e.g. `openssl rand -hex 16`): node 0's store admits only ranks that present it",
                crate::envvars::RUN_TOKEN
            )
        })?;
        if token.len() < MIN_TOKEN_BYTES {
            bail!(
                "--nnodes: `{}` is {} characters; a secret that guards the run needs at least {MIN_TOKEN_BYTES} (e.g. `openssl rand -hex 16`)",
                crate::envvars::RUN_TOKEN,
                token.len()
            );
        }
        let addresses: Vec<SocketAddr> = (master_addr, master_port)
            .to_socket_addrs()
            .with_context(|| format!("--master-addr `{master_addr}` does not resolve"))?
            .collect();
        let master = addresses
            .iter()
            .find(|a| a.is_ipv4())
            .or_else(|| addresses.first())
            .copied()
            .with_context(|| format!("--master-addr `{master_addr}` has no address"))?;
        let bind_addr = match bind_addr {
            Some(address) => address,
            None => {
                // The source address of the route to node 0 (no packet is sent).
                let probe = std::net::UdpSocket::bind(if master.is_ipv4() {
                    "0.0.0.0:0"
                } else {
                    "[::]:0"
                })
                .context("cannot open a socket to find this node's address")?;
                probe.connect(master).with_context(|| {
                    format!("no route from this host to --master-addr {master}: give --bind-addr")
                })?;
                probe.local_addr()?.ip()
            }
        };
        Ok(NodeSettings {
            nnodes,
            node_rank,
            master,
            bind_addr,
            token,
        })
    }
}

/// The scheduler's limits from `--kv-cache-tokens`, `--max-batch` and
/// `--max-num-batched-tokens` (`None`: this host's default). Errors: a KV cache under one
/// block of tokens, a batch of 0, or a step's token budget under the batch.
pub(crate) fn scheduler_limits(
    kv_cache_tokens: usize,
    max_batch: usize,
    max_num_batched_tokens: Option<usize>,
) -> Result<Limits> {
    let block_tokens = crate::runtime::model::kv::BLOCK_TOKENS;
    if kv_cache_tokens < block_tokens {
        bail!(
            "--kv-cache-tokens must hold at least one block of {block_tokens} tokens, got {kv_cache_tokens}"
        );
    }
    if max_batch == 0 {
        bail!("--max-batch must be at least 1 (the most sequences decoded together)");
    }
    let mut limits = Limits::for_this_host(max_batch);
    if let Some(tokens) = max_num_batched_tokens {
        if tokens < max_batch {
            bail!(
                "--max-num-batched-tokens ({tokens}) must be at least --max-batch ({max_batch}): every running sequence decodes one token per step"
            );
        }
        limits.max_batched_tokens = tokens;
    }
    Ok(limits)
}

/// `--prefill N --decode M` as (prefill replicas, decode replicas), `None` without them.
/// Errors: a count of 0.
pub(crate) fn pd_counts(
    prefill: Option<usize>,
    decode: Option<usize>,
) -> Result<Option<(usize, usize)>> {
    let (Some(prefill), Some(decode)) = (prefill, decode) else {
        return Ok(None);
    };
    if prefill == 0 || decode == 0 {
        bail!("--prefill and --decode must each be at least 1, got {prefill} and {decode}");
    }
    Ok(Some((prefill, decode)))
}

/// Where the layout comes from, checked: the pinned degrees (`dp` is every replica with
/// `--prefill/--decode`) and the prefill replicas, given the saved `plan` and `--cluster`.
///
/// Errors: `--prefill/--decode` with a plan or a planned (not inventory) cluster, an
/// inventory file that does not exist, pinned degrees with a plan or a planned cluster.
pub(crate) fn layout(
    pins: DegreePins,
    pd: Option<(usize, usize)>,
    plan: Option<&Path>,
    cluster: Option<&str>,
) -> Result<(DegreePins, Option<usize>)> {
    if pd.is_some() {
        if plan.is_some() {
            bail!(
                "--prefill/--decode give the layout themselves (with --tp/--pp for each replica); drop --plan"
            );
        }
        if let Some(cluster) = cluster.filter(|c| {
            !crate::inventory::is_inventory(c) && !c.ends_with(".toml") && !c.contains('/')
        }) {
            bail!(
                "--prefill/--decode run on an inventory's hosts (`--cluster hosts.toml`), not on the planned cluster `{cluster}`"
            );
        }
    }
    let pins = DegreePins {
        dp: pd.map(|(prefill, decode)| prefill + decode).or(pins.dp),
        ..pins
    };
    if let Some(cluster) = cluster
        && (cluster.ends_with(".toml") || cluster.contains('/'))
        && !Path::new(cluster).is_file()
    {
        bail!("the inventory `{cluster}` does not exist (or is not a file)");
    }
    let inventory = cluster.is_some_and(crate::inventory::is_inventory);
    let from_plan = plan.is_some() || (cluster.is_some() && !inventory);
    if from_plan && pins.any() {
        bail!("give the layout either with --plan/--cluster or with --tp/--pp/--dp/--ep, not both");
    }
    Ok((pins, pd.map(|(prefill, _)| prefill)))
}

/// `--max-model-len` (tokens) checked against the model's context, as a token index.
/// Errors: 0 or beyond the context, or a model whose spec does not read.
pub(crate) fn max_model_len(len: Option<u64>, source: &ModelSource) -> Result<Option<usize>> {
    let Some(len) = len else {
        return Ok(None);
    };
    let context = crate::model::spec_of(source)?.max_position_embeddings;
    if len == 0 || len > context {
        bail!("--max-model-len must be 1 to the model's context of {context} tokens, got {len}");
    }
    // Within the model's context, which a token index (`usize`) reaches.
    usize::try_from(len)
        .map(Some)
        .context("--max-model-len is larger than this machine can index")
}

/// The id `/v1/models` lists: `served_model_name` (`--served-model-name`), else a profile's
/// name as it is, or a file's or directory's stem. Errors: an empty name.
pub(crate) fn served_model_id(
    served_model_name: Option<&str>,
    source: &ModelSource,
) -> Result<String> {
    if let Some(name) = served_model_name {
        if name.is_empty() {
            bail!("--served-model-name must not be empty");
        }
        return Ok(name.to_string());
    }
    Ok(match source {
        ModelSource::File(path) => model_id(path),
        ModelSource::Dummy(dummy) => {
            let path = Path::new(&dummy.name);
            if path.exists() {
                model_id(path)
            } else {
                dummy.name.clone()
            }
        }
    })
}

/// The id `/v1/models` lists for the model at `path`: its file stem.
pub(crate) fn model_id(path: &Path) -> String {
    path.file_stem().map_or_else(
        || path.display().to_string(),
        |s| s.to_string_lossy().into_owned(),
    )
}

/// `--shutdown-timeout` seconds as a duration. Errors: a negative or non-finite number.
pub(crate) fn shutdown_timeout(shutdown_timeout_secs: f64) -> Result<Duration> {
    Duration::try_from_secs_f64(shutdown_timeout_secs).map_err(|_| {
        anyhow::anyhow!("--shutdown-timeout must be 0 or more seconds, got {shutdown_timeout_secs}")
    })
}

/// `--stall-timeout` seconds as a duration. Errors: a number that is not positive and
/// finite.
pub(crate) fn stall_timeout(stall_timeout_secs: f64) -> Result<Duration> {
    Duration::try_from_secs_f64(stall_timeout_secs)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| {
            anyhow::anyhow!(
                "--stall-timeout must be more than 0 seconds, got {stall_timeout_secs} (10 is the default)"
            )
        })
}

/// The API key: `api_key` (`--api-key` or `INFER_API_KEY`), or the first line of
/// `api_key_file` (`--api-key-file`).
///
/// Errors: the file cannot be read, or its first line is empty.
pub(crate) fn api_key(
    api_key: Option<&str>,
    api_key_file: Option<&Path>,
) -> Result<Option<String>> {
    let Some(path) = api_key_file else {
        return Ok(api_key.map(str::to_string));
    };
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read --api-key-file `{}`", path.display()))?;
    let key = text.lines().next().unwrap_or_default().trim();
    if key.is_empty() {
        bail!(
            "--api-key-file `{}` has no key on its first line",
            path.display()
        );
    }
    Ok(Some(key.to_string()))
}

/// `--protect-metrics`, checked: it guards `/metrics` with the API key, so it needs one
/// (`has_key`: `--api-key`, `--api-key-file` or `INFER_API_KEY` was given).
///
/// Errors: `--protect-metrics` without a key.
pub(crate) fn protect_metrics(protect_metrics: bool, has_key: bool) -> Result<bool> {
    if protect_metrics && !has_key {
        bail!(
            "--protect-metrics guards /metrics with the API key, and there is none: add --api-key-file FILE (or {}, or --api-key)",
            crate::envvars::API_KEY
        );
    }
    Ok(protect_metrics)
}
