//! `infer bench`: measurements that print figures. `decode` times the built-in engine's
//! prefill and batch-1 decode on one process and reports peak RSS.

use anyhow::{Context, Result};

use crate::cli::{BenchAllreduceArgs, BenchAllreduceWorkerArgs, BenchCommand, BenchDecodeArgs};
use crate::runtime::exec::bench::{self, AllreduceWorkerReport};
use crate::runtime::exec::engine::Engine;
use crate::ui::Printer;
use crate::{ExitStatus, model};

/// Runs an `infer bench` subcommand.
pub(crate) fn run(command: &BenchCommand, printer: &Printer) -> Result<ExitStatus> {
    match command {
        BenchCommand::Decode(args) => decode(args, printer),
        BenchCommand::Allreduce(args) => allreduce(args, printer),
        BenchCommand::Serve(args) => super::bench_serve::run(args, printer),
        BenchCommand::AllreduceWorker(args) => allreduce_worker(args, printer),
    }
}

/// `infer bench decode`: prefill and decode tokens/s of the built-in engine on this host's
/// CPU (or on GPU 0 with `--device cuda`) and the peak RSS in bytes. Errors: no GPU with
/// `--device cuda`, a model that does not load, a forward pass that fails.
fn decode(args: &BenchDecodeArgs, printer: &Printer) -> Result<ExitStatus> {
    let cuda = args.device == crate::cli::DeviceArg::Cuda;
    let driver = if cuda {
        Some(super::require_gpu()?)
    } else {
        None
    };
    let source = super::model_source(args.model.as_deref(), &args.load, &mut |line| {
        printer.note(line)
    })?;
    if let Some(driver) = driver {
        // The GPU first: a context that cannot be made fails before minutes of loading.
        let cache = model::default::cache_dir()?.join("kernels");
        let opened = crate::runtime::cuda::gpu::open_first(&super::cuda_lib_dirs(), &cache)?;
        let engine = Engine::from_source(&source, args.threads, args.numerics.into())?;
        return decode_cuda(args, &engine, &driver, opened, printer);
    }
    let engine = Engine::from_source(&source, args.threads, args.numerics.into())?;
    let prompt = bench::prompt(&engine, args.prompt_tokens)?;
    let speed = bench::cpu_decode(&engine, &prompt, args.batch, args.decode_tokens, args.runs)?;
    let (best_prefill, best_decode) = (speed.prefill_tokens_per_sec, speed.decode_tokens_per_sec);
    let peak_rss_bytes = bench::peak_rss_bytes()?;
    if args.json {
        return printer
            .json(&cpu_decode_report(
                args,
                &engine,
                prompt.len(),
                (best_prefill, best_decode),
                peak_rss_bytes,
            ))
            .map(|()| ExitStatus::Success);
    }
    printer.data(&format!(
        "model       {}\nthreads     {}\nnumerics    {}\nprefill     {best_prefill:.1} tok/s ({} prompt tokens, best of {})\ndecode      {best_decode:.1} tok/s (batch {}, {} tokens each after the prompt, best of {})\npeak RSS    {:.1} MB",
        engine.name,
        engine.threads(),
        crate::runtime::cpu::quant::Numerics::from(args.numerics).name(),
        prompt.len(),
        args.runs.max(1),
        args.batch.max(1),
        args.decode_tokens,
        args.runs.max(1),
        peak_rss_bytes as f64 / 1e6
    ));
    Ok(ExitStatus::Success)
}

/// The JSON report of a CPU decode bench from the best (prefill, decode) tokens/s and the
/// peak RSS in bytes.
fn cpu_decode_report(
    args: &BenchDecodeArgs,
    engine: &Engine,
    prompt_tokens: usize,
    (best_prefill, best_decode): (f64, f64),
    peak_rss_bytes: u64,
) -> crate::plan::calibration::DecodeReport {
    let batch = args.batch.max(1);
    let decode_step_secs = batch as f64 / best_decode;
    let decode_weight_bytes = engine.model.decode_weight_bytes() as u64;
    crate::plan::calibration::DecodeReport {
        bench: "decode".into(),
        model: model_file_name(engine),
        device: "cpu".into(),
        device_name: bench::cpu_name(),
        threads: engine.threads(),
        numerics: crate::runtime::cpu::quant::Numerics::from(args.numerics)
            .name()
            .into(),
        batch,
        prompt_tokens,
        decode_tokens: args.decode_tokens,
        prefill_tokens_per_sec: best_prefill,
        decode_tokens_per_sec: best_decode,
        decode_step_secs,
        decode_weight_bytes,
        weight_bytes_per_sec: decode_weight_bytes as f64 / decode_step_secs,
        peak_rss_bytes,
        gpu_memory_used_bytes: None,
        hbm_bytes_per_sec: None,
        batches: Vec::new(),
    }
}

/// The model file's name (what a decode report names), else the engine's name.
fn model_file_name(engine: &Engine) -> String {
    std::path::Path::new(&engine.name)
        .file_name()
        .map_or_else(|| engine.name.clone(), |n| n.to_string_lossy().into_owned())
}

/// `infer bench decode --device cuda`: the model on GPU 0, decode at batch 1 and at
/// `--batch` (16 unless given), the weight bandwidth a decode step achieves against the
/// GPU's datasheet HBM bandwidth (its hardware profile), prefill, and the GPU memory in use.
fn decode_cuda(
    args: &BenchDecodeArgs,
    engine: &Engine,
    driver: &crate::runtime::cuda::device::Driver,
    (runner, opened_gpu): (
        crate::runtime::cuda::gpu::GpuRunner,
        crate::runtime::cuda::device::Gpu,
    ),
    printer: &Printer,
) -> Result<ExitStatus> {
    let gpu = &driver.gpus[0];
    let prompt = bench::prompt(engine, args.prompt_tokens)?;
    let batches: Vec<usize> = if args.batch > 1 {
        vec![1, args.batch]
    } else {
        vec![1, 16]
    };
    let largest = batches.iter().copied().max().unwrap_or(1);
    let mut device = crate::runtime::exec::kernel_executor::model_on(
        runner,
        &opened_gpu,
        &engine.model,
        largest * (prompt.len() + args.decode_tokens + 16),
    )?;
    // Whether prefill's products run on cuBLAS (its figure depends on it).
    printer.note_or_warn(device.backend().device.gemm_line());
    let weight_bytes = engine.model.decode_weight_bytes() as u64;
    let hbm_bytes_per_sec = crate::plan::cluster::hardware_for_gpu_name(&gpu.name)
        .and_then(|id| crate::inventory::hardware(id).ok())
        .map(|h| h.hbm_gb_per_sec * 1e9);
    let rows = bench::device_decode(
        &mut device,
        &prompt,
        &batches,
        args.decode_tokens,
        args.runs,
    )?;
    let memory_used_bytes = device.backend().device.memory_used_bytes()?;
    if let Some(rows) = device.backend().device.profile()? {
        printer.note(&kernel_profile_table(&rows));
    }
    let measured = CudaDecode {
        engine,
        gpu,
        prompt_tokens: prompt.len(),
        rows,
        weight_bytes,
        hbm_bytes_per_sec,
        memory_used_bytes,
    };
    if args.json {
        return printer
            .json(&measured.json_report(args)?)
            .map(|()| ExitStatus::Success);
    }
    printer.data(&measured.text_lines(args).join("\n"));
    Ok(ExitStatus::Success)
}

/// [`crate::envvars::CUDA_PROFILE`]'s table for stderr: GPU time per kernel (name, launches,
/// milliseconds) over every run.
fn kernel_profile_table(rows: &[(String, u64, f64)]) -> String {
    // INFER_CUDA_PROFILE: GPU time per kernel over every run above, on stderr.
    let total_ms: f64 = rows.iter().map(|r| r.2).sum();
    let mut table = vec![format!(
        "GPU time per kernel ({}), every run: {total_ms:.1} ms",
        crate::envvars::CUDA_PROFILE
    )];
    for (name, calls, ms) in rows {
        table.push(format!(
            "  {name:<32} {calls:>8} launches {ms:>10.2} ms {:>9.1} µs each {:>5.1}%",
            1e3 * ms / (*calls).max(1) as f64,
            100.0 * ms / total_ms.max(1e-9)
        ));
    }
    table.join("\n")
}

/// What `infer bench decode --device cuda` measured, for its report.
struct CudaDecode<'a> {
    engine: &'a Engine,
    /// GPU 0 as the driver lists it.
    gpu: &'a crate::runtime::cuda::device::Gpu,
    prompt_tokens: usize,
    /// The best timed run at each batch, smallest batch first.
    rows: Vec<(usize, crate::runtime::exec::forward::DecodeSpeed)>,
    /// Weight bytes a decode step reads.
    weight_bytes: u64,
    /// The GPU's datasheet HBM bandwidth (its hardware profile), if known.
    hbm_bytes_per_sec: Option<f64>,
    /// GPU memory in use after the runs.
    memory_used_bytes: u64,
}

impl CudaDecode<'_> {
    /// Each batch's speed and achieved weight bandwidth (bytes/s, and its fraction of HBM).
    fn batch_speeds(&self) -> Vec<crate::plan::calibration::BatchSpeed> {
        self.rows
            .iter()
            .map(|(batch, speed)| {
                let weight_bytes_per_sec = self.weight_bytes as f64 / speed.decode_step_secs;
                crate::plan::calibration::BatchSpeed {
                    batch: *batch,
                    decode_tokens_per_sec: speed.decode_tokens_per_sec,
                    decode_step_secs: speed.decode_step_secs,
                    weight_bytes_per_sec,
                    hbm_fraction: self.hbm_bytes_per_sec.map(|hbm| weight_bytes_per_sec / hbm),
                    launches_per_step: speed.launches_per_step,
                    issue_step_secs: Some(speed.issue_step_secs),
                }
            })
            .collect()
    }

    /// The `--json` report: the largest batch's figures and every batch's. Errors: no batch
    /// measured, or the peak RSS cannot be read.
    fn json_report(
        &self,
        args: &BenchDecodeArgs,
    ) -> Result<crate::plan::calibration::DecodeReport> {
        let batch_speeds = self.batch_speeds();
        let (batch, speed) = self.rows.last().copied().context("no batch measured")?;
        let weight_bytes = self.weight_bytes;
        Ok(crate::plan::calibration::DecodeReport {
            bench: "decode".into(),
            model: model_file_name(self.engine),
            device: "cuda".into(),
            device_name: self.gpu.name.clone(),
            threads: 0,
            numerics: "q8_1-dp4a".into(),
            batch,
            prompt_tokens: self.prompt_tokens,
            decode_tokens: args.decode_tokens,
            prefill_tokens_per_sec: speed.prefill_tokens_per_sec,
            decode_tokens_per_sec: speed.decode_tokens_per_sec,
            decode_step_secs: speed.decode_step_secs,
            decode_weight_bytes: weight_bytes,
            weight_bytes_per_sec: weight_bytes as f64 / speed.decode_step_secs,
            peak_rss_bytes: bench::peak_rss_bytes()?,
            gpu_memory_used_bytes: Some(self.memory_used_bytes),
            hbm_bytes_per_sec: self.hbm_bytes_per_sec,
            batches: batch_speeds,
        })
    }

    /// The text report's lines: model, weight gigabytes, device, prefill, one decode line
    /// per batch, GPU memory in GiB.
    fn text_lines(&self, args: &BenchDecodeArgs) -> Vec<String> {
        let (engine, gpu, rows) = (self.engine, self.gpu, &self.rows);
        let (weight_bytes, hbm_bytes_per_sec) = (self.weight_bytes, self.hbm_bytes_per_sec);
        let mut lines = vec![
            format!("model       {}", engine.name),
            format!(
                "weights     {:.2} GB read per decode step",
                weight_bytes as f64 / 1e9
            ),
            format!(
                "device      cuda:{} ({}, sm_{})",
                gpu.ordinal,
                gpu.name,
                gpu.arch()
            ),
            format!(
                "prefill     {:.1} tok/s ({} prompt tokens, best of {})",
                rows[0].1.prefill_tokens_per_sec,
                self.prompt_tokens,
                args.runs.max(1)
            ),
        ];
        for (batch, speed) in rows {
            let bandwidth = weight_bytes as f64 / speed.decode_step_secs;
            let issuing = format!(
                ", {:.2} of {:.2} ms a step issuing it",
                speed.issue_step_secs * 1e3,
                speed.decode_step_secs * 1e3
            );
            lines.push(format!(
                "decode      {:.1} tok/s at batch {batch}: {:.0} GB/s of weights{}{}{}",
                speed.decode_tokens_per_sec,
                bandwidth / 1e9,
                hbm_bytes_per_sec.map_or(String::new(), |hbm| format!(
                    " ({:.0}% of the datasheet's {:.0} GB/s)",
                    100.0 * bandwidth / hbm,
                    hbm / 1e9
                )),
                speed
                    .launches_per_step
                    .map_or(String::new(), |n| format!(", {n:.0} launches a step")),
                issuing,
            ));
        }
        lines.push(format!(
            "GPU memory  {:.2} GiB in use",
            self.memory_used_bytes as f64 / (1u64 << 30) as f64
        ));
        lines
    }
}

use crate::plan::calibration::Scope;
use crate::runtime::collectives::AllreduceRow;

/// `infer bench allreduce`: all-reduce bandwidth of `--world` processes on this host (TCP
/// ring and shared memory), or over an inventory's hosts with `--cluster`. Errors: a world
/// under 2, a worker that fails or prints no report.
fn allreduce(args: &BenchAllreduceArgs, printer: &Printer) -> Result<ExitStatus> {
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
    let token = crate::rendezvous::random_token();
    let server = crate::rendezvous::StoreServer::start("127.0.0.1:0", &token)?;
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
            .env(crate::envvars::RUN_TOKEN, &token)
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
        run_dir: None,
        gpus: None,
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
        super::report_progress(&progress, &event, false)
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

/// `infer bench allreduce-worker`: one process of the local bench; rank 0 prints the
/// report as JSON. Errors: no run token, the store or a peer unreachable, a collective fails.
fn allreduce_worker(args: &BenchAllreduceWorkerArgs, printer: &Printer) -> Result<ExitStatus> {
    let token =
        crate::runtime::exec::rank_env::run_token(&crate::runtime::exec::rank_env::process_env)?;
    let shm_disable = std::env::var(crate::envvars::SHM_DISABLE).is_ok_and(|v| v == "1");
    let report = bench::all_reduce_worker(
        &args.store,
        &token,
        args.rank,
        args.world,
        args.max_bytes,
        shm_disable,
    )?;
    if let Some(report) = report {
        printer.data(&serde_json::to_string(&report)?);
    }
    Ok(ExitStatus::Success)
}
