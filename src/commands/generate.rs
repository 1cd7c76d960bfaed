//! `infer generate`: load the engine, tokenize (optionally through the chat template),
//! generate, and stream the text or print JSON.

use anyhow::{Result, bail};
use serde::Serialize;

use crate::cli::GenerateArgs;
use crate::runtime::chat::ChatMessage;
use crate::runtime::engine::{Engine, Generation};
use crate::runtime::sampling::SamplingParams;
use crate::ui::Printer;
use crate::{ExitStatus, model};

/// `--json` output.
#[derive(Serialize)]
struct Output<'a> {
    model: &'a str,
    prompt: &'a str,
    #[serde(flatten)]
    generation: &'a Generation,
}

/// Runs `infer generate`. Errors: bad flags, a model that does not load, a prompt too long.
pub fn run(args: &GenerateArgs, printer: &Printer) -> Result<ExitStatus> {
    if !(args.top_p > 0.0 && args.top_p <= 1.0) {
        bail!("--top-p must be in (0, 1], got {}", args.top_p);
    }
    if args.temperature < 0.0 || !args.temperature.is_finite() {
        bail!(
            "--temperature must be 0 (greedy) or positive, got {}",
            args.temperature
        );
    }
    let path = model::weights_path(args.model.as_deref(), &mut |line| printer.note(line))?;
    let engine = Engine::load(&path, args.threads)?;
    let prompt = if args.chat {
        engine.chat_prompt(&[ChatMessage {
            role: "user".into(),
            content: args.prompt.clone(),
        }])?
    } else {
        args.prompt.clone()
    };
    let prompt_tokens = engine.tokenizer.encode(&prompt, true)?;
    let params = SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        seed: args.seed,
        max_tokens: args.max_tokens,
        stop: args.stop.clone(),
    };
    let streaming = !args.json;
    let generation = engine.generate(&prompt_tokens, &params, &mut |text| {
        if streaming {
            printer.stream(text);
        }
    })?;
    if args.json {
        printer.json(&Output {
            model: &engine.name,
            prompt: &prompt,
            generation: &generation,
        })?;
    } else {
        printer.stream("\n");
        let t = &generation.timings;
        printer.note(&format!(
            "{} prompt tokens at {:.1} tok/s (TTFT {:.0} ms), {} generated at {:.1} tok/s, {} threads",
            generation.prompt_tokens.len(),
            t.prefill_tokens_per_sec,
            t.prefill_secs * 1e3,
            generation.tokens.len(),
            t.decode_tokens_per_sec,
            engine.threads()
        ));
    }
    Ok(ExitStatus::Success)
}
