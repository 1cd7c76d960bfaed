//! The processes of `infer bench allreduce`: `world` worker processes on this host around a
//! rendezvous store, or collectives-only ranks over an inventory's hosts. Both run the one
//! measurement, [`crate::runtime::collectives::bench`]; the reports are the command's.

use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail};

use crate::degrees::Degrees;
use crate::keyring::{Keyring, LAUNCHER_HOST};
use crate::launch::hosts::{ClusterOptions, run_job};
use crate::launch::{LaunchSpec, Progress};
use crate::rendezvous::{StoreServer, random_token};
use crate::runtime::collectives::bench::AllreduceBench;
use crate::runtime::cpu::quant::Numerics;
use crate::runtime::exec::worker::Job;

/// Starts `world` `infer bench allreduce-worker` processes on this host around a rendezvous
/// store, each sweeping sizes up to `max_bytes`, and waits for them all. Returns rank 0's
/// result.
///
/// Errors: the store or a worker does not start, a worker exits with a failure, rank 0
/// prints no result.
pub(crate) fn allreduce_local(world: usize, max_bytes: usize) -> Result<AllreduceBench> {
    // Every worker on this host (host 0).
    let keys = Keyring::master(&random_token(), LAUNCHER_HOST, vec![0; world]);
    let server = StoreServer::start("127.0.0.1:0", &keys)?;
    let worker_keys = keys.for_host(0)?.to_text()?;
    let exe = std::env::current_exe().context("cannot find the `infer` executable")?;
    let mut children = Vec::new();
    for rank in 0..world {
        let child = Command::new(&exe)
            .args([
                "bench",
                "allreduce-worker",
                "--store",
                &server.address().to_string(),
            ])
            .args([
                "--rank",
                &rank.to_string(),
                "--world",
                &world.to_string(),
                "--max-bytes",
                &max_bytes.to_string(),
            ])
            .env(crate::envvars::RUN_KEYS, &worker_keys)
            .stdout(if rank == 0 {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stderr(Stdio::inherit())
            .spawn()
            .context("failed to start a worker process")?;
        children.push(child);
    }
    let mut outputs = Vec::new();
    let mut failed = None;
    for (rank, child) in children.into_iter().enumerate() {
        let output = child
            .wait_with_output()
            .context("failed to wait for a worker")?;
        if !output.status.success() && failed.is_none() {
            failed = Some(format!("worker rank {rank} exited with {}", output.status));
        }
        outputs.push(output);
    }
    if let Some(message) = failed {
        bail!(message);
    }
    serde_json::from_slice(&outputs[0].stdout).context("rank 0 printed no report")
}

/// `world` rank processes with no model (collectives only), placed over the hosts of
/// `options`' inventory as consecutive ranks; they all-reduce in one group (shared memory
/// when every rank is on one host, TCP on the data network otherwise) up to `max_bytes`.
/// `progress` hears what [`run_job`] reports. Returns rank 0's result and the names of the
/// hosts that ran ranks, sorted.
///
/// Errors: a host or rank that fails (the gang is stopped), a malformed result.
pub(crate) fn allreduce_cluster(
    world: usize,
    max_bytes: usize,
    options: &ClusterOptions,
    progress: &mut dyn FnMut(&Progress),
) -> Result<(AllreduceBench, Vec<String>)> {
    let spec = LaunchSpec {
        degrees: Degrees {
            pp: world,
            ..Degrees::ONE
        },
        model: None,
        threads_per_rank: 1,
        numerics: Numerics::Exact,
        timeout: Duration::from_secs(120),
        serving: None,
        layout_from: "infer bench allreduce --cluster".into(),
        placement: Vec::new(),
        planned_hosts: None,
        run_dir: None,
        gpus: None,
        restart: 0,
    };
    let job = Job::AllReduce { max_bytes };
    let mut hosts = Vec::new();
    let bytes = run_job(&spec, &job, options, &mut |event| {
        if let Progress::RankLine { label, .. } = &event
            && let Some(host) = label.split_whitespace().next()
            && label.contains(" r")
            && !hosts.contains(&host.to_string())
        {
            hosts.push(host.to_string());
        }
        progress(&event)
    })?;
    let report = serde_json::from_slice(&bytes).context("rank 0 wrote a malformed report")?;
    hosts.sort();
    Ok((report, hosts))
}
