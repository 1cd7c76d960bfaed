//! `infer bench`: measurements that print figures. `decode` times the built-in engine's
//! prefill and batch-1 decode on one process and reports peak RSS.

use std::time::Instant;

use anyhow::{Context, Result};

use crate::cli::{BenchCommand, BenchDecodeArgs};
use crate::runtime::engine::Engine;
use crate::runtime::llama::SequenceInput;
use crate::runtime::sampling::argmax;
use crate::ui::Printer;
use crate::{ExitStatus, model};

/// Runs an `infer bench` subcommand.
pub fn run(command: &BenchCommand, printer: &Printer) -> Result<ExitStatus> {
    match command {
        BenchCommand::Decode(args) => decode(args, printer),
    }
}

fn decode(args: &BenchDecodeArgs, printer: &Printer) -> Result<ExitStatus> {
    let path = model::weights_path(args.model.as_deref(), &mut |line| printer.note(line))?;
    let engine = Engine::load(&path, args.threads)?;
    // A prompt of ordinary text, repeated to the requested length.
    let text = "The quick brown fox jumps over the lazy dog while the engine measures its speed. "
        .repeat(64);
    let mut prompt = engine.tokenizer.encode(&text, false)?;
    prompt.truncate(args.prompt_tokens.max(1));
    let (mut best_prefill, mut best_decode) = (0f64, 0f64);
    for run in 0..=args.runs.max(1) {
        let (prefill, decode) = engine.install(|| -> Result<(f64, f64)> {
            let mut cache = engine.model.new_cache();
            let start = Instant::now();
            let logits = engine.model.forward(&mut [SequenceInput {
                tokens: &prompt,
                cache: &mut cache,
                all_logits: false,
            }])?;
            let prefill = prompt.len() as f64 / start.elapsed().as_secs_f64();
            let mut next = argmax(&logits[0]);
            let start = Instant::now();
            for _ in 0..args.decode_tokens {
                let logits = engine.model.forward(&mut [SequenceInput {
                    tokens: &[next],
                    cache: &mut cache,
                    all_logits: false,
                }])?;
                next = argmax(&logits[0]);
            }
            Ok((
                prefill,
                args.decode_tokens as f64 / start.elapsed().as_secs_f64(),
            ))
        })?;
        // Run 0 warms caches and page-faults the weights in.
        if run > 0 {
            best_prefill = best_prefill.max(prefill);
            best_decode = best_decode.max(decode);
        }
    }
    let peak_rss_bytes = peak_rss_bytes()?;
    printer.data(&format!(
        "model       {}\nthreads     {}\nprefill     {best_prefill:.1} tok/s ({} prompt tokens, best of {})\ndecode      {best_decode:.1} tok/s (batch 1, {} tokens after the prompt, best of {})\npeak RSS    {:.1} MB",
        engine.name,
        engine.threads(),
        prompt.len(),
        args.runs.max(1),
        args.decode_tokens,
        args.runs.max(1),
        peak_rss_bytes as f64 / 1e6
    ));
    Ok(ExitStatus::Success)
}

/// Peak resident set size of this process (`VmHWM` in `/proc/self/status`), bytes.
fn peak_rss_bytes() -> Result<u64> {
    let status = std::fs::read_to_string("/proc/self/status")
        .context("failed to read `/proc/self/status`")?;
    let line = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .context("`/proc/self/status` has no `VmHWM`")?;
    let kib: u64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .context("malformed `VmHWM`")?;
    Ok(kib * 1024)
}
