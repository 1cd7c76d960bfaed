//! `infer bench allreduce`: all-reduce bandwidth of worker processes on this host (TCP ring
//! and shared memory), or of ranks over an inventory's hosts, as nccl-tests' tables and as
//! the JSON report `infer plan --calibration` reads.

use anyhow::{Context, Result};

use crate::ExitStatus;
use crate::cli::BenchAllreduceArgs;
use crate::plan::calibration::Scope;
use crate::runtime::collectives::AllreduceRow;
use crate::runtime::exec::bench::AllreduceWorkerReport;
use crate::ui::Printer;

/// `infer bench allreduce`: all-reduce bandwidth of `--world` processes on this host (TCP
/// ring and shared memory), or over an inventory's hosts with `--cluster`. Errors: a world
/// under 2, a worker that fails or prints no report.
pub(super) fn allreduce(args: &BenchAllreduceArgs, printer: &Printer) -> Result<ExitStatus> {
    if args.world < 2 {
        anyhow::bail!("--world must be at least 2 (a one-process all-reduce moves no data)");
    }
    if let Some(inventory) = &args.cluster {
        return allreduce_cluster(args, inventory, printer);
    }
    let report = run_local_workers(args)?;
    if args.json {
        return printer
            .json(&local_allreduce_json(args, &report))
            .map(|()| ExitStatus::Success);
    }
    printer.data(&local_allreduce_text(args, &report));
    Ok(ExitStatus::Success)
}

/// Starts `--world` `bench allreduce-worker` processes on this host around a rendezvous
/// store and waits for them all. Returns rank 0's report. Errors: the store or a worker
/// does not start, a worker exits with a failure, rank 0 prints no report.
fn run_local_workers(args: &BenchAllreduceArgs) -> Result<AllreduceWorkerReport> {
    use std::process::{Command, Stdio};
    // Every worker on this host (host 0).
    let keys = crate::keyring::Keyring::master(
        &crate::rendezvous::random_token(),
        crate::keyring::LAUNCHER_HOST,
        vec![0; args.world],
    );
    let server = crate::rendezvous::StoreServer::start("127.0.0.1:0", &keys)?;
    let worker_keys = keys.for_host(0)?.to_text()?;
    let exe = std::env::current_exe().context("cannot find the `infer` executable")?;
    let mut children = Vec::new();
    for rank in 0..args.world {
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
                &args.world.to_string(),
                "--max-bytes",
                &args.max_bytes.to_string(),
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
        anyhow::bail!(message);
    }
    let report: AllreduceWorkerReport =
        serde_json::from_slice(&outputs[0].stdout).context("rank 0 printed no report")?;
    Ok(report)
}

/// The `--json` report of the local bench: the TCP table, and the shared-memory one when
/// it was measured.
fn local_allreduce_json(
    args: &BenchAllreduceArgs,
    report: &AllreduceWorkerReport,
) -> crate::plan::calibration::AllreduceReport {
    let mut tables = vec![json_table(
        "TCP ring over loopback",
        Scope::IntraHost,
        args.world,
        Vec::new(),
        &report.tcp_rows,
    )];
    if !report.shm_rows.is_empty() {
        tables.push(json_table(
            &report.shm_transport,
            Scope::IntraHost,
            args.world,
            Vec::new(),
            &report.shm_rows,
        ));
    }
    crate::plan::calibration::AllreduceReport {
        bench: "allreduce".into(),
        tables,
        stream_bytes_per_sec: report.stream_bytes_per_sec,
    }
}

/// The text report of the local bench: the TCP table, the shared-memory one (or why it
/// was not measured), and one plain TCP stream's GB/s.
fn local_allreduce_text(args: &BenchAllreduceArgs, report: &AllreduceWorkerReport) -> String {
    let stream = report.stream_bytes_per_sec / 1e9;
    let mut table = allreduce_table(
        &format!(
            "TCP ring over loopback, {} processes on this host",
            args.world
        ),
        &report.tcp_rows,
        args.world,
        stream,
    );
    table.push('\n');
    if report.shm_rows.is_empty() {
        table.push_str(&format!(
            "# shared memory: not measured ({})\n",
            report.shm_transport
        ));
    } else {
        table.push_str(&allreduce_table(
            &format!(
                "{}, {} processes on this host",
                report.shm_transport, args.world
            ),
            &report.shm_rows,
            args.world,
            stream,
        ));
    }
    table.push_str(&format!(
        "\n# one plain TCP stream between two processes: {stream:.3} GB/s\n"
    ));
    table
}

/// `bench allreduce --cluster`: `--world` rank processes with no model (collectives only),
/// placed over the inventory's hosts as consecutive ranks; they all-reduce in one group
/// (shared memory when every rank is on one host, TCP on the data network otherwise).
fn allreduce_cluster(
    args: &BenchAllreduceArgs,
    inventory: &std::path::Path,
    printer: &Printer,
) -> Result<ExitStatus> {
    let spec = crate::launch::LaunchSpec {
        degrees: crate::degrees::Degrees {
            pp: args.world,
            ..crate::degrees::Degrees::ONE
        },
        model: None,
        threads_per_rank: 1,
        numerics: crate::runtime::cpu::quant::Numerics::Exact,
        timeout: std::time::Duration::from_secs(120),
        serving: None,
        layout_from: "infer bench allreduce --cluster".into(),
        placement: Vec::new(),
        planned_hosts: None,
        run_dir: None,
        gpus: None,
        restart: 0,
    };
    let options = crate::launch::hosts::ClusterOptions {
        inventory: inventory.to_path_buf(),
        ssh: crate::launch::ssh::SshOptions {
            accept_new: args.ssh.ssh_accept_new,
        },
        push_model: args.ssh.push_model,
    };
    let job = crate::runtime::exec::worker::Job::AllReduce {
        max_bytes: args.max_bytes,
    };
    let progress = printer.progress(2 * args.world as u64);
    let mut hosts = Vec::new();
    let bytes = crate::launch::hosts::run_job(&spec, &job, &options, &mut |event| {
        if let crate::launch::Progress::RankLine { label, .. } = &event
            && let Some(host) = label.split_whitespace().next()
            && label.contains(" r")
            && !hosts.contains(&host.to_string())
        {
            hosts.push(host.to_string());
        }
        super::super::report_progress(&progress, &event, false)
    })?;
    progress.finish();
    let report: crate::runtime::exec::worker::AllreduceBench =
        serde_json::from_slice(&bytes).context("rank 0 wrote a malformed report")?;
    let stream = report.stream_bytes_per_sec / 1e9;
    hosts.sort();
    if args.json {
        let scope = if hosts.len() > 1 {
            Scope::InterHost
        } else {
            Scope::IntraHost
        };
        return printer
            .json(&crate::plan::calibration::AllreduceReport {
                bench: "allreduce".into(),
                tables: vec![json_table(
                    &report.transport,
                    scope,
                    args.world,
                    hosts,
                    &report.rows,
                )],
                stream_bytes_per_sec: report.stream_bytes_per_sec,
            })
            .map(|()| ExitStatus::Success);
    }
    let mut table = allreduce_table(
        &format!(
            "{} processes on hosts {} over the data network ({})",
            args.world,
            hosts.join(", "),
            report.transport
        ),
        &report.rows,
        args.world,
        stream,
    );
    table.push_str(&format!(
        "\n# one plain TCP stream from the last rank to rank 0: {stream:.3} GB/s\n"
    ));
    printer.data(&table);
    Ok(ExitStatus::Success)
}

/// One transport's rows as `infer bench allreduce --json` prints them.
fn json_table(
    transport: &str,
    scope: Scope,
    world: usize,
    hosts: Vec<String>,
    rows: &[AllreduceRow],
) -> crate::plan::calibration::AllreduceTable {
    crate::plan::calibration::AllreduceTable {
        transport: transport.to_string(),
        scope,
        world_size: world,
        hosts,
        rows: rows
            .iter()
            .map(|r| crate::plan::calibration::AllreduceJsonRow {
                bytes: r.bytes as u64,
                time_secs: r.time_secs,
                algbw_bytes_per_sec: r.algbw_bytes_per_sec(),
                busbw_bytes_per_sec: r.busbw_bytes_per_sec(world),
            })
            .collect(),
    }
}

/// One nccl-tests style table (size, count, type, time, algbw, busbw) with its busbw at
/// 16 MiB as a share of `stream_gbps`.
fn allreduce_table(title: &str, rows: &[AllreduceRow], world: usize, stream_gbps: f64) -> String {
    let mut table = format!(
        "# all-reduce (sum, float32): {title}\n{}",
        crate::runtime::collectives::nccl_tests_table(rows, world)
    );
    if let Some(row) = rows.iter().find(|r| r.bytes == 16 << 20) {
        let busbw = row.busbw_bytes_per_sec(world) / 1e9;
        table.push_str(&format!(
            "# busbw at 16 MiB = {busbw:.3} GB/s = {:.0}% of one plain TCP stream\n",
            100.0 * busbw / stream_gbps
        ));
    }
    table
}
