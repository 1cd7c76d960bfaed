//! `infer up`'s flags turned into [`UpSettings`] (or, with `--engine`, the engine launcher's
//! settings). The checks are the launcher's ([`crate::launch::up_settings`]); this file only
//! hands them the flags, in the order they are checked.

use anyhow::Result;

use crate::cli::{DeviceArg, UpArgs};
use crate::launch::up_settings::{self, NodeSettings, UpSettings};
use crate::serve::http::GpuSettings;
use crate::serve::scheduler::Limits;
use crate::ui::Printer;

/// With `--device cuda`: this host's kernels and GPUs, checked before anything starts
/// (`None` on the CPU). Errors: no driver or no GPU on this host (unless the ranks run on an
/// inventory's hosts, whose agents report their GPUs instead).
pub(super) fn gpu_settings(args: &UpArgs) -> Result<Option<GpuSettings>> {
    if args.device != DeviceArg::Cuda {
        return Ok(None);
    }
    let remote = args
        .cluster
        .as_deref()
        .is_some_and(crate::inventory::is_inventory);
    let (kernels, gpus) = super::super::cuda_device(remote)?;
    Ok(Some(GpuSettings { kernels, gpus }))
}

/// The flags as [`UpSettings`]: the layout's source first, then the model (fetched on first
/// use), its length and id, the timeouts, the API key and this node. Errors: any check's.
pub(super) fn up_settings(
    args: &UpArgs,
    limits: Limits,
    gpu: Option<GpuSettings>,
    printer: &Printer,
) -> Result<UpSettings> {
    let pd = up_settings::pd_counts(args.prefill, args.decode)?;
    let (pins, pd_prefill) = up_settings::layout(
        args.degrees.pins(),
        pd,
        args.plan.as_deref(),
        args.cluster.as_deref(),
    )?;
    let model = super::super::model_source(&args.model, &mut |line| printer.note(line))?;
    let max_model_len = up_settings::max_model_len(args.max_model_len, &model)?;
    let model_id = up_settings::served_model_id(args.served_model_name.as_deref(), &model)?;
    Ok(UpSettings {
        model_id,
        max_model_len,
        shutdown_timeout: up_settings::shutdown_timeout(args.shutdown_timeout)?,
        stall_timeout: up_settings::stall_timeout(args.stall_timeout)?,
        max_restarts: args.max_restarts,
        max_queued_requests: args.max_queued_requests,
        model,
        pins,
        pd_prefill,
        plan: args.plan.clone(),
        cluster: args.cluster.clone(),
        host: args.host.clone(),
        port: args.port,
        threads: args.threads,
        numerics: args.numerics.into(),
        limits,
        prefix_cache: !args.no_prefix_cache,
        kv_cache_tokens: args.kv_cache_tokens,
        api_key: up_settings::api_key(args.api_key.as_deref(), args.api_key_file.as_deref())?,
        protect_metrics: up_settings::protect_metrics(
            args.protect_metrics,
            args.api_key.is_some() || args.api_key_file.is_some(),
        )?,
        ssh: crate::launch::ssh::SshOptions {
            accept_new: args.ssh.ssh_accept_new,
        },
        push_model: args.ssh.push_model,
        run_dir: args.run_dir.clone(),
        node: node_settings(args)?,
        gpu,
    })
}

/// This node of a multi-node launch (`--nnodes`, `--node-rank`, `--master-addr`), `None`
/// unless all three are given. Errors: a node rank out of range or an address that does
/// not resolve.
fn node_settings(args: &UpArgs) -> Result<Option<NodeSettings>> {
    let (Some(nnodes), Some(node_rank), Some(master_addr)) =
        (args.nnodes, args.node_rank, &args.master_addr)
    else {
        return Ok(None);
    };
    NodeSettings::resolve(
        nnodes,
        node_rank,
        master_addr,
        args.master_port,
        args.bind_addr,
        std::env::var(crate::envvars::RUN_TOKEN).ok(),
    )
    .map(Some)
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
