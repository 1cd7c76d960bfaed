//! `infer generate`: load the engine, tokenize (optionally through the chat template),
//! generate, and stream the text or print JSON.

use anyhow::{Result, bail};
use serde::Serialize;

use crate::ExitStatus;
use crate::cli::GenerateArgs;
use crate::runtime::exec::engine::{Engine, Generation};
use crate::runtime::model::chat::ChatMessage;
use crate::runtime::model::sampling::SamplingParams;
use crate::ui::Printer;

mod ranks;

use ranks::distributed;

/// `--json` output.
#[derive(Serialize)]
pub(super) struct Output<'a> {
    pub(super) model: &'a str,
    pub(super) prompt: &'a str,
    #[serde(flatten)]
    pub(super) generation: &'a Generation,
}

/// Runs `infer generate`. Errors: bad flags, a model that does not load, a prompt too long.
pub(crate) fn run(args: &GenerateArgs, printer: &Printer) -> Result<ExitStatus> {
    let cuda = args.device == crate::cli::DeviceArg::Cuda;
    let device = if cuda {
        // On an inventory's hosts, their agents report their GPUs.
        Some(super::cuda_device(args.cluster.is_some())?)
    } else {
        None
    };
    if !(args.top_p > 0.0 && args.top_p <= 1.0) {
        bail!("--top-p must be in (0, 1], got {}", args.top_p);
    }
    if args.temperature < 0.0 || !args.temperature.is_finite() {
        bail!(
            "--temperature must be 0 (greedy) or positive, got {}",
            args.temperature
        );
    }
    let degrees = args.stages.degrees()?;
    if args.max_tokens == 0 {
        bail!("--max-tokens must be at least 1 (it counts the tokens to generate)");
    }
    let source = super::model_source(&args.model, &mut |line| printer.note(line))?;
    if degrees.world_size() > 1 || args.cluster.is_some() {
        return distributed(args, degrees, &source, device.as_ref(), printer);
    }
    let engine = Engine::from_source(&source, args.threads, args.numerics.into())?;
    let prompt = if args.chat {
        engine.chat_prompt(&[ChatMessage {
            role: "user".into(),
            content: args.prompt.clone(),
        }])?
    } else {
        args.prompt.clone()
    };
    let prompt_tokens = engine.tokenizer.encode(&prompt, true)?;
    warn_if_capped(
        printer,
        prompt_tokens.len(),
        args.max_tokens,
        engine.model.config.max_context_tokens,
    );
    let params = sampling_params(args);
    let streaming = !args.json;
    let mut on_text = |text: &str| {
        if streaming {
            printer.stream(text);
        }
    };
    let generation = if let Some((kernels, _)) = &device {
        // The weights go to the GPU; the tokenizer and the sampler stay here.
        let kv_tokens = (prompt_tokens.len() + args.max_tokens + 16)
            .min(engine.model.config.max_context_tokens + 16);
        let mut loaded = crate::runtime::exec::kernel_executor::load_executor(
            kernels,
            &engine.model,
            kv_tokens,
            engine.tokenizer.clone(),
            Default::default(),
        )?;
        for note in &loaded.notes {
            printer.note_or_warn(note);
        }
        crate::runtime::exec::executor::generate(
            &mut *loaded.executor,
            &prompt_tokens,
            &params,
            &mut on_text,
        )?
    } else {
        engine.generate(&prompt_tokens, &params, &mut on_text)?
    };
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

/// Warns when the context cannot hold `max_tokens` after the prompt: generation stops at the
/// context's end (finish reason `length`), as vLLM caps `max_tokens`.
pub(super) fn warn_if_capped(
    printer: &Printer,
    prompt_tokens: usize,
    max_tokens: usize,
    context: usize,
) {
    if prompt_tokens.saturating_add(max_tokens) > context {
        printer.warn(&format!(
            "--max-tokens {max_tokens} does not fit: the model's context is {context} tokens and the prompt takes {prompt_tokens}; generating at most {}",
            context.saturating_sub(prompt_tokens)
        ));
    }
}

/// The sampling flags.
pub(super) fn sampling_params(args: &GenerateArgs) -> SamplingParams {
    SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        seed: args.seed,
        max_tokens: args.max_tokens,
        stop: args.stop.clone(),
        ..SamplingParams::default()
    }
}
