//! `infer generate --tp/--pp` (or `--cluster`): the generation on a gang of rank processes,
//! here or on an inventory's hosts; rank 0's driver tokenizes and samples.

use anyhow::Result;

use super::{Output, sampling_params, warn_if_capped};
use crate::ExitStatus;
use crate::cli::GenerateArgs;
use crate::runtime::exec::engine::Generation;
use crate::runtime::model::chat::ChatMessage;
use crate::runtime::model::source::ModelSource;
use crate::ui::Printer;

/// `--tp/--pp` > 1: the same generation on `tp × pp` real rank processes.
/// `device`: `--device cuda` ranks on these kernels, with this many GPUs visible here (0:
/// the host harness).
pub(super) fn distributed(
    args: &GenerateArgs,
    degrees: crate::degrees::Degrees,
    source: &ModelSource,
    device: Option<&(crate::runtime::exec::kernel_executor::KernelDevice, usize)>,
    printer: &Printer,
) -> Result<ExitStatus> {
    // The tokenizer and the context, without loading the weights here.
    if let Some(path) = source.path() {
        super::super::require_gguf_for_ranks(path)?;
    }
    let (tokenizer, context) = source.tokenizer_and_context()?;
    let prompt = rank_prompt(args, &tokenizer)?;
    let prompt_tokens = tokenizer.encode(&prompt, true)?;
    if let Some(context) = context {
        warn_if_capped(printer, prompt_tokens.len(), args.max_tokens, context);
    }
    let job = crate::runtime::exec::worker::Job::Generate {
        prompt_tokens,
        params: sampling_params(args),
    };
    let world = degrees.world_size();
    let spec = rank_launch_spec(args, degrees, source, device);
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
            degrees.tp,
            degrees.pp
        ));
    }
    Ok(ExitStatus::Success)
}

/// The prompt text the ranks tokenize: `--prompt` as it is, or with `--chat` rendered
/// through the model's chat template as one user message. Errors: `--chat` with a model
/// that has no chat template, or a template that does not render.
fn rank_prompt(
    args: &GenerateArgs,
    tokenizer: &crate::runtime::model::tokenizer::Tokenizer,
) -> Result<String> {
    if !args.chat {
        return Ok(args.prompt.clone());
    }
    let messages = [ChatMessage {
        role: "user".into(),
        content: args.prompt.clone(),
    }];
    crate::runtime::model::chat::render_for(tokenizer, &messages)?
        .ok_or_else(|| anyhow::anyhow!("the model has no chat template"))
}

/// The gang of `--tp × --pp` ranks: threads per rank (0: this host's cores over its ranks,
/// or each host's on a cluster), the rank timeout and the GPUs each rank sees.
fn rank_launch_spec(
    args: &GenerateArgs,
    degrees: crate::degrees::Degrees,
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
    let world = degrees.world_size();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads_per_rank = match (args.threads, &args.cluster) {
        (0, None) => (cores / world).max(1),
        // On a cluster, 0 means each host's cores over its ranks.
        (threads, _) => threads,
    };
    crate::launch::LaunchSpec {
        degrees,
        model: Some(source.clone()),
        threads_per_rank,
        numerics: args.numerics.into(),
        timeout: crate::launch::rank_timeout(harness),
        serving: None,
        layout_from: "infer generate --tp/--pp".into(),
        placement: Vec::new(),
        planned_hosts: None,
        run_dir: args.run_dir.clone(),
        gpus: gpus.map(|visible| crate::launch::local_gpus(world, visible)),
        restart: 0,
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
    let progress = printer.progress(2 * spec.degrees.world_size() as u64);
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
                super::super::report_progress(&progress, &event, true)
            })?
        }
        None => crate::launch::run_generation(spec, job, &mut |event| {
            super::super::report_progress(&progress, &event, false)
        })?,
    };
    progress.finish();
    Ok(generation)
}
