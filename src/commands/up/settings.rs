//! `infer up`'s flags checked once into [`crate::launch::serving::UpSettings`] (or, with `--engine`, the engine
//! launcher's settings): the scheduler's limits, the GPU settings, prefill/decode replicas,
//! the served model id, the shutdown timeout, the node of a multi-node launch.

use anyhow::{Context, Result, bail};

use crate::cli::{DeviceArg, UpArgs};
use crate::launch::serving::UpSettings;
use crate::model;

/// The scheduler's limits from `--kv-cache-tokens`, `--max-batch` and
/// `--max-num-batched-tokens`. Errors: a KV cache under one block of tokens, a batch of 0,
/// or a step's token budget under the batch.
pub(super) fn scheduler_limits(args: &UpArgs) -> Result<crate::serve::scheduler::Limits> {
    if args.kv_cache_tokens < crate::runtime::model::kv::BLOCK_TOKENS {
        bail!(
            "--kv-cache-tokens must hold at least one block of {} tokens, got {}",
            crate::runtime::model::kv::BLOCK_TOKENS,
            args.kv_cache_tokens
        );
    }
    if args.max_batch == 0 {
        bail!("--max-batch must be at least 1 (the most sequences decoded together)");
    }
    let mut limits = crate::serve::scheduler::Limits::for_this_host(args.max_batch);
    if let Some(tokens) = args.max_num_batched_tokens {
        if tokens < args.max_batch {
            bail!(
                "--max-num-batched-tokens ({tokens}) must be at least --max-batch ({}): every running sequence decodes one token per step",
                args.max_batch
            );
        }
        limits.max_batched_tokens = tokens;
    }
    Ok(limits)
}

/// With `--device cuda`: this host's kernels and GPUs, checked before anything starts
/// (`None` on the CPU). Errors: no driver or no GPU on this host (unless the ranks run on an
/// inventory's hosts, whose agents report their GPUs instead).
pub(super) fn gpu_settings(args: &UpArgs) -> Result<Option<crate::serve::http::GpuSettings>> {
    if args.device != DeviceArg::Cuda {
        return Ok(None);
    }
    // Before anything starts: a driver and a GPU on this host.
    // (On an inventory's hosts, their agents report their GPUs instead.)
    let remote = args
        .cluster
        .as_deref()
        .is_some_and(crate::inventory::is_inventory);
    let (kernels, gpus) = super::super::cuda_device(remote)?;
    Ok(Some(crate::serve::http::GpuSettings { kernels, gpus }))
}

/// `--prefill N --decode M` as (prefill replicas, decode replicas), `None` without them.
/// Errors: a count of 0, `--plan` alongside, or a planned (not inventory) `--cluster`.
pub(super) fn pd_replicas(args: &UpArgs) -> Result<Option<(usize, usize)>> {
    let (Some(prefill), Some(decode)) = (args.prefill, args.decode) else {
        return Ok(None);
    };
    if prefill == 0 || decode == 0 {
        bail!("--prefill and --decode must each be at least 1, got {prefill} and {decode}");
    }
    if args.plan.is_some() {
        bail!(
            "--prefill/--decode give the layout themselves (with --tp/--pp for each replica); drop --plan"
        );
    }
    if let Some(cluster) = args
        .cluster
        .as_deref()
        .filter(|c| !crate::inventory::is_inventory(c) && !c.ends_with(".toml") && !c.contains('/'))
    {
        bail!(
            "--prefill/--decode run on an inventory's hosts (`--cluster hosts.toml`), not on the planned cluster `{cluster}`"
        );
    }
    Ok(Some((prefill, decode)))
}

/// Checks the flags that depend on the model: `--max-model-len` (tokens) within its context
/// and a non-empty `--served-model-name`. Errors: either out of range, or a model whose
/// spec does not read.
pub(super) fn check_model_flags(
    args: &UpArgs,
    source: &crate::runtime::model::source::ModelSource,
) -> Result<()> {
    if let Some(len) = args.max_model_len {
        let context = model::spec_of(source)?.max_position_embeddings;
        if len == 0 || len > context {
            bail!(
                "--max-model-len must be 1 to the model's context of {context} tokens, got {len}"
            );
        }
    }
    if args.served_model_name.as_deref().is_some_and(str::is_empty) {
        bail!("--served-model-name must not be empty");
    }
    Ok(())
}

/// The checked flags as [`UpSettings`]. Errors: a negative `--shutdown-timeout` (seconds), a
/// `--stall-timeout` that is not positive, or
/// `--nnodes/--node-rank/--master-addr` that do not resolve.
pub(super) fn up_settings(
    args: &UpArgs,
    source: crate::runtime::model::source::ModelSource,
    limits: crate::serve::scheduler::Limits,
    gpu: Option<crate::serve::http::GpuSettings>,
    pd_prefill: Option<(usize, usize)>,
) -> Result<UpSettings> {
    Ok(UpSettings {
        model_id: served_model_id(args, &source),
        // Checked against the model's context, which a token index (`usize`) reaches.
        max_model_len: args
            .max_model_len
            .map(usize::try_from)
            .transpose()
            .context("--max-model-len is larger than this machine can index")?,
        shutdown_timeout: shutdown_timeout(args.shutdown_timeout)?,
        stall_timeout: stall_timeout(args.stall_timeout)?,
        max_restarts: args.max_restarts,
        max_queued_requests: args.max_queued_requests,
        model: source,
        pins: crate::degrees::DegreePins {
            dp: pd_prefill
                .map(|(prefill, decode)| prefill + decode)
                .or(args.degrees.dp),
            ..args.degrees.pins()
        },
        pd_prefill: pd_prefill.map(|(prefill, _)| prefill),
        plan: args.plan.clone(),
        cluster: args.cluster.clone(),
        host: args.host.clone(),
        port: args.port,
        threads: args.threads,
        numerics: args.numerics.into(),
        limits,
        prefix_cache: !args.no_prefix_cache,
        kv_cache_tokens: args.kv_cache_tokens,
        api_key: api_key(args)?,
        protect_metrics: protect_metrics(args)?,
        ssh: crate::launch::ssh::SshOptions {
            accept_new: args.ssh.ssh_accept_new,
        },
        push_model: args.ssh.push_model,
        run_dir: args.run_dir.clone(),
        node: node_settings(args)?,
        gpu,
    })
}

/// The id `/v1/models` lists: `--served-model-name`, else a profile's name as it is, or a
/// file's or directory's stem.
pub(super) fn served_model_id(
    args: &UpArgs,
    source: &crate::runtime::model::source::ModelSource,
) -> String {
    args.served_model_name
        .clone()
        .unwrap_or_else(|| match source {
            crate::runtime::model::source::ModelSource::File(path) => model_id(path),
            // A profile's name as it is; a file's or directory's stem.
            crate::runtime::model::source::ModelSource::Dummy(dummy) => {
                let path = std::path::Path::new(&dummy.name);
                if path.exists() {
                    model_id(path)
                } else {
                    dummy.name.clone()
                }
            }
        })
}

/// `--shutdown-timeout` seconds as a duration. Errors: a negative or non-finite number.
pub(super) fn shutdown_timeout(shutdown_timeout_secs: f64) -> Result<std::time::Duration> {
    std::time::Duration::try_from_secs_f64(shutdown_timeout_secs).map_err(|_| {
        anyhow::anyhow!("--shutdown-timeout must be 0 or more seconds, got {shutdown_timeout_secs}")
    })
}

/// `--stall-timeout` seconds as a duration. Errors: a number that is not positive and
/// finite.
pub(super) fn stall_timeout(stall_timeout_secs: f64) -> Result<std::time::Duration> {
    std::time::Duration::try_from_secs_f64(stall_timeout_secs)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| {
            anyhow::anyhow!(
                "--stall-timeout must be more than 0 seconds, got {stall_timeout_secs} (10 is the default)"
            )
        })
}

/// This node of a multi-node launch (`--nnodes`, `--node-rank`, `--master-addr`), `None`
/// unless all three are given. Errors: a node rank out of range or an address that does
/// not resolve.
pub(super) fn node_settings(args: &UpArgs) -> Result<Option<crate::launch::serving::NodeSettings>> {
    match (args.nnodes, args.node_rank, &args.master_addr) {
        (Some(nnodes), Some(node_rank), Some(master_addr)) => {
            Ok(Some(crate::launch::serving::NodeSettings::resolve(
                nnodes,
                node_rank,
                master_addr,
                args.master_port,
                args.bind_addr,
                std::env::var(crate::envvars::RUN_TOKEN).ok(),
            )?))
        }
        _ => Ok(None),
    }
}

/// The id `/v1/models` lists for the model at `path`: its file stem.
pub(super) fn model_id(path: &std::path::Path) -> String {
    path.file_stem().map_or_else(
        || path.display().to_string(),
        |s| s.to_string_lossy().into_owned(),
    )
}

/// The API key: `--api-key` (or `INFER_API_KEY`), or the first line of `--api-key-file`.
///
/// Errors: the file cannot be read, or its first line is empty.
/// `--protect-metrics`, checked: it guards `/metrics` with the API key, so it needs one.
///
/// Errors: `--protect-metrics` without `--api-key`, `--api-key-file` or `INFER_API_KEY`.
pub(super) fn protect_metrics(args: &UpArgs) -> Result<bool> {
    if args.protect_metrics && args.api_key.is_none() && args.api_key_file.is_none() {
        bail!(
            "--protect-metrics guards /metrics with the API key, and there is none: add --api-key-file FILE (or {}, or --api-key)",
            crate::envvars::API_KEY
        );
    }
    Ok(args.protect_metrics)
}

pub(super) fn api_key(args: &UpArgs) -> Result<Option<String>> {
    let Some(path) = &args.api_key_file else {
        return Ok(args.api_key.clone());
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

#[cfg(test)]
mod tests {
    use clap::Parser;

    use crate::cli::{Cli, Command};

    /// A plan of CPU ranks batches as many sequences per replica as `infer up` does unless
    /// told otherwise.
    #[test]
    fn cpu_plans_batch_what_up_batches_by_default() {
        let cli = Cli::try_parse_from(["infer", "up"]).expect("`infer up` parses");
        let Command::Up(args) = cli.command else {
            panic!("`infer up` is the up command");
        };
        assert_eq!(args.max_batch as u64, crate::plan::memory::CPU_MAX_NUM_SEQS);
    }
}
