//! `infer bench decode`: prefill and decode tokens/s of the built-in engine on this host's CPU
//! or on GPU 0 (measured by [`crate::runtime::exec::bench`]), reported as text or as the
//! JSON report `infer plan --calibration` reads.

use anyhow::{Context, Result};

use crate::cli::BenchDecodeArgs;
use crate::runtime::exec::bench;
use crate::runtime::exec::engine::Engine;
use crate::ui::Printer;
use crate::{ExitStatus, model};

/// `infer bench decode`: prefill and decode tokens/s of the built-in engine on this host's
/// CPU (or on GPU 0 with `--device cuda`) and the peak RSS in bytes. Errors: no GPU with
/// `--device cuda`, a model that does not load, a forward pass that fails.
pub(super) fn decode(args: &BenchDecodeArgs, printer: &Printer) -> Result<ExitStatus> {
    let cuda = args.device == crate::cli::DeviceArg::Cuda;
    let driver = if cuda {
        Some(super::super::require_gpu()?)
    } else {
        None
    };
    let source = super::super::model_source(&args.model, &mut |line| printer.note(line))?;
    if let Some(driver) = driver {
        // The GPU first: a context that cannot be made fails before minutes of loading.
        let cache = model::default::cache_dir()?.join("kernels");
        let opened = crate::runtime::cuda::gpu::open_first(&super::super::cuda_lib_dirs(), &cache)?;
        let engine = Engine::from_source(&source, args.threads, args.numerics.into())?;
        return decode_cuda(args, &engine, &driver, opened, printer);
    }
    let engine = Engine::from_source(&source, args.threads, args.numerics.into())?;
    let prompt = bench::prompt(&engine, args.prompt_tokens)?;
    let speed = bench::cpu_decode(&engine, &prompt, args.batch, args.decode_tokens, args.runs)?;
    let (best_prefill, best_decode) = (speed.prefill_tokens_per_sec, speed.decode_tokens_per_sec);
    let peak_rss_bytes = bench::peak_rss_bytes()?;
    if args.json {
        // The planner's count of the prompt's arithmetic, for a calibration of the CPU's
        // compute rate.
        let prefill_flops = model::spec_of(&source)
            .ok()
            .map(|spec| crate::plan::cost::prefill_flops(&spec, prompt.len() as u64));
        let mut report = cpu_decode_report(
            args,
            &engine,
            prompt.len(),
            (best_prefill, best_decode),
            peak_rss_bytes,
        );
        report.prefill_flops_per_sec =
            prefill_flops.map(|flops| flops * best_prefill / prompt.len().max(1) as f64);
        return printer.json(&report).map(|()| ExitStatus::Success);
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
/// peak RSS in bytes (`prefill_flops_per_sec` left for the caller, who has the model's spec).
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
        prefill_flops_per_sec: None,
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
            prefill_flops_per_sec: None,
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
