//! `infer generate`: load the engine, tokenize (optionally through the chat template),
//! generate, and stream the text or print JSON.

use anyhow::{Result, bail};
use serde::Serialize;

use crate::ExitStatus;
use crate::cli::GenerateArgs;
use crate::runtime::exec::engine::{Engine, Generation};
use crate::runtime::model::chat::ChatMessage;
use crate::runtime::model::sampling::SamplingParams;
use crate::runtime::model::source::ModelSource;
use crate::ui::Printer;

/// `--json` output.
#[derive(Serialize)]
struct Output<'a> {
    model: &'a str,
    prompt: &'a str,
    #[serde(flatten)]
    generation: &'a Generation,
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
    if args.tp == 0 || args.pp == 0 {
        bail!("--tp and --pp must be at least 1");
    }
    if args.max_tokens == 0 {
        bail!("--max-tokens must be at least 1 (it counts the tokens to generate)");
    }
    let source = super::model_source(args.model.as_deref(), &args.load, &mut |line| {
        printer.note(line)
    })?;
    if args.tp * args.pp > 1 || args.cluster.is_some() {
        return distributed(args, &source, device.as_ref(), printer);
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
fn warn_if_capped(printer: &Printer, prompt_tokens: usize, max_tokens: usize, context: usize) {
    if prompt_tokens.saturating_add(max_tokens) > context {
        printer.warn(&format!(
            "--max-tokens {max_tokens} does not fit: the model's context is {context} tokens and the prompt takes {prompt_tokens}; generating at most {}",
            context.saturating_sub(prompt_tokens)
        ));
    }
}

/// The sampling flags.
fn sampling_params(args: &GenerateArgs) -> SamplingParams {
    SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        seed: args.seed,
        max_tokens: args.max_tokens,
        stop: args.stop.clone(),
        logprobs: false,
        top_logprobs: 0,
    }
}

/// `--tp/--pp` > 1: the same generation on `tp × pp` real rank processes.
/// `device`: `--device cuda` ranks on these kernels, with this many GPUs visible here (0:
/// the host harness).
fn distributed(
    args: &GenerateArgs,
    source: &ModelSource,
    device: Option<&(crate::runtime::exec::kernel_executor::KernelDevice, usize)>,
    printer: &Printer,
) -> Result<ExitStatus> {
    let (tokenizer, context) = tokenizer_and_context(source)?;
    let prompt = rank_prompt(args, &tokenizer)?;
    let prompt_tokens = tokenizer.encode(&prompt, true)?;
    if let Some(context) = context {
        warn_if_capped(printer, prompt_tokens.len(), args.max_tokens, context);
    }
    let job = crate::runtime::exec::worker::Job::Generate {
        prompt_tokens,
        params: sampling_params(args),
    };
    let world = args.tp * args.pp;
    let spec = rank_launch_spec(args, source, device);
    let generation = run_ranks(args, &spec, &job, printer)?;
    if args.json {
        printer.json(&Output {
            model: &source.name(),
            prompt: &prompt,
            generation: &generation,
        })?;
    } else {
        printer.data(&generation.text);
        printer.note(&format!(
            "{} prompt tokens, {} generated at {:.1} tok/s on {world} ranks (tp {} × pp {})",
            generation.prompt_tokens.len(),
            generation.tokens.len(),
            generation.timings.decode_tokens_per_sec,
            args.tp,
            args.pp
        ));
    }
    Ok(ExitStatus::Success)
}

/// The model's tokenizer and its context in tokens (if the file gives one), without
/// loading the weights here. Errors: a file the ranks cannot load (not GGUF), or a header
/// or tokenizer that does not read.
fn tokenizer_and_context(
    source: &ModelSource,
) -> Result<(crate::runtime::model::tokenizer::Tokenizer, Option<usize>)> {
    use crate::runtime::formats::gguf::Header;
    use crate::runtime::model::tokenizer::Tokenizer;
    // The tokenizer and the context, without loading the weights here.
    Ok(match source {
        ModelSource::File(path) => {
            super::require_gguf_for_ranks(path)?;
            let header = Header::read_file(path)?;
            let arch = header.str("general.architecture")?;
            let context = header.u64(&format!("{arch}.context_length")).ok();
            (Tokenizer::from_gguf(&header)?, context.map(|c| c as usize))
        }
        ModelSource::Dummy(dummy) => (dummy.tokenizer()?, Some(dummy.max_context_tokens)),
    })
}

/// The prompt text the ranks tokenize: `--prompt` as it is, or with `--chat` rendered
/// through the model's chat template as one user message. Errors: `--chat` with a model
/// that has no chat template, or a template that does not render.
fn rank_prompt(
    args: &GenerateArgs,
    tokenizer: &crate::runtime::model::tokenizer::Tokenizer,
) -> Result<String> {
    Ok(if args.chat {
        let template = tokenizer
            .chat_template
            .as_deref()
            .ok_or_else(|| anyhow::anyhow!("the model has no chat template"))?;
        let token = |id: Option<u32>| id.and_then(|i| tokenizer.token(i)).unwrap_or_default();
        crate::runtime::model::chat::render(
            template,
            &[ChatMessage {
                role: "user".into(),
                content: args.prompt.clone(),
            }],
            true,
            &token(tokenizer.bos_id),
            &token(tokenizer.eos_ids.first().copied()),
        )?
    } else {
        args.prompt.clone()
    })
}

/// The gang of `--tp × --pp` ranks: threads per rank (0: this host's cores over its ranks,
/// or each host's on a cluster), the rank timeout and the GPUs each rank sees.
fn rank_launch_spec(
    args: &GenerateArgs,
    source: &ModelSource,
    device: Option<&(crate::runtime::exec::kernel_executor::KernelDevice, usize)>,
) -> crate::launch::LaunchSpec {
    let gpus = device.map(|(_, gpus)| *gpus);
    let harness = matches!(
        device,
        Some((
            crate::runtime::exec::kernel_executor::KernelDevice::HostHarness { .. },
            _
        ))
    );
    let world = args.tp * args.pp;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads_per_rank = match (args.threads, &args.cluster) {
        (0, None) => (cores / world).max(1),
        // On a cluster, 0 means each host's cores over its ranks.
        (threads, _) => threads,
    };
    crate::launch::LaunchSpec {
        degrees: crate::degrees::Degrees {
            tp: args.tp,
            pp: args.pp,
            ..crate::degrees::Degrees::ONE
        },
        model: Some(source.clone()),
        threads_per_rank,
        numerics: args.numerics.into(),
        timeout: crate::launch::rank_timeout(harness),
        serving: None,
        layout_from: "infer generate --tp/--pp".into(),
        placement: Vec::new(),
        run_dir: args.run_dir.clone(),
        gpus: gpus.map(|visible| crate::launch::local_gpus(world, visible)),
    }
}

/// Runs `job` on the gang `spec` (on `--cluster`'s hosts, else on this host) with a
/// progress bar. Errors: a rank that does not start or fails.
fn run_ranks(
    args: &GenerateArgs,
    spec: &crate::launch::LaunchSpec,
    job: &crate::runtime::exec::worker::Job,
    printer: &Printer,
) -> Result<Generation> {
    let progress = printer.progress(2 * (args.tp * args.pp) as u64);
    let generation = match &args.cluster {
        Some(inventory) => {
            let options = crate::launch::hosts::ClusterOptions {
                inventory: inventory.clone(),
                ssh: crate::launch::ssh::SshOptions {
                    accept_new: args.ssh.ssh_accept_new,
                },
                push_model: args.ssh.push_model,
            };
            crate::launch::hosts::run_generation(spec, job, &options, &mut |event| {
                super::report_progress(&progress, &event, true)
            })?
        }
        None => crate::launch::run_generation(spec, job, &mut |event| {
            super::report_progress(&progress, &event, false)
        })?,
    };
    progress.finish();
    Ok(generation)
}
