//! `infer bench decode`: prefill and decode tokens/s of the built-in engine on this host's CPU
//! or on GPU 0 (measured by [`crate::runtime::exec::bench`]), reported as text or as the
//! JSON report `infer plan --calibration` reads ([`cpu`], [`cuda`]).

use anyhow::Result;

use crate::cli::{BenchDecodeArgs, DeviceArg};
use crate::runtime::cuda::gpu::open_first;
use crate::runtime::exec::bench;
use crate::runtime::exec::engine::Engine;
use crate::ui::Printer;
use crate::{ExitStatus, model};

mod cpu;
mod cuda;

/// `infer bench decode`: prefill and decode tokens/s of the built-in engine on this host's
/// CPU (or on GPU 0 with `--device cuda`) and the peak RSS in bytes. Errors: no GPU with
/// `--device cuda`, a model that does not load, a forward pass that fails.
pub(super) fn decode(args: &BenchDecodeArgs, printer: &Printer) -> Result<ExitStatus> {
    let driver = if args.device == DeviceArg::Cuda {
        Some(super::super::require_gpu()?)
    } else {
        None
    };
    let source = super::super::model_source(&args.model, &mut |line| printer.note(line))?;
    let Some(driver) = driver else {
        let engine = Engine::from_source(&source, args.threads, args.numerics.into())?;
        let prompt = bench::prompt(&engine, args.prompt_tokens)?;
        let speed = bench::cpu_decode(&engine, &prompt, args.batch, args.decode_tokens, args.runs)?;
        let peak_rss_bytes = bench::peak_rss_bytes()?;
        if args.json {
            // The planner's count of the prompt's arithmetic, for a calibration of the
            // CPU's compute rate.
            let spec = model::spec_of(&source).ok();
            // Its attention's own rates, which split the prefill's and the decode step's
            // time for the planner.
            let attention = cpu::AttentionRates {
                prefill_flops_per_sec: bench::engine_prefill_attention_flops_per_sec(&engine)?,
                decode_flops_per_sec: bench::engine_decode_attention_rate(&engine)?
                    .map(|rate| rate.flops_per_sec),
                one_thread_share: bench::engine_prompt_run(&engine, &prompt)?.one_thread_share,
            };
            let report = cpu::json(
                args,
                &engine,
                spec,
                prompt.len(),
                speed,
                attention,
                peak_rss_bytes,
            );
            return printer.json(&report).map(|()| ExitStatus::Success);
        }
        printer.data(&cpu::text(
            args,
            &engine,
            prompt.len(),
            speed,
            peak_rss_bytes,
        ));
        return Ok(ExitStatus::Success);
    };
    // The GPU first: a context that cannot be made fails before minutes of loading.
    let cache = model::default::cache_dir()?.join("kernels");
    let opened = open_first(&super::super::cuda_lib_dirs(), &cache)?;
    let engine = Engine::from_source(&source, args.threads, args.numerics.into())?;
    let gpu = &driver.gpus[0];
    let prompt = bench::prompt(&engine, args.prompt_tokens)?;
    let batches: Vec<usize> = if args.batch > 1 {
        vec![1, args.batch]
    } else {
        vec![1, 16]
    };
    // Whether prefill's products run on cuBLAS (its figure depends on it).
    let measured = bench::cuda_decode(
        &engine,
        opened,
        &prompt,
        &batches,
        (args.decode_tokens, args.runs),
        &mut |line| printer.note_or_warn(line),
    )?;
    if let Some(rows) = &measured.kernel_profile {
        printer.note(&bench::kernel_profile_table(rows));
    }
    let report = cuda::CudaReport::new(&engine, gpu, prompt.len(), measured);
    if args.json {
        return printer
            .json(&report.json(args)?)
            .map(|()| ExitStatus::Success);
    }
    printer.data(&report.text_lines(args).join("\n"));
    Ok(ExitStatus::Success)
}
