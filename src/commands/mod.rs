//! One module per subcommand: each turns clap arguments into a call of a domain module and
//! hands the result to [`crate::ui::Printer`]. No domain logic lives here.

pub(crate) mod agent;
pub(crate) mod bench;
mod device;
pub(crate) mod doctor;
pub(crate) mod generate;
pub(crate) mod model;
pub(crate) mod plan;
pub(crate) mod rank;
pub(crate) mod smoke;
pub(crate) mod topo;
pub(crate) mod up;

use device::{cuda_device, cuda_lib_dirs, host_harness, require_gpu};

/// Rank processes load GGUF files only (for now). Errors: `path` is a directory.
fn require_gguf_for_ranks(path: &std::path::Path) -> anyhow::Result<()> {
    if path.is_dir() {
        anyhow::bail!(
            "--tp/--pp/--dp run GGUF models for now; `{}` is a directory",
            path.display()
        );
    }
    Ok(())
}

/// Shows a launcher milestone on `progress` (a bar on a terminal, plain lines otherwise):
/// ranks started, shards loaded; rank output prefixed with `[rank N]` when `echo_ranks`.
pub(crate) fn report_progress(
    progress: &crate::ui::Progress,
    event: &crate::launch::Progress,
    echo_ranks: bool,
) {
    use crate::launch::Progress;
    match event {
        Progress::Started {
            world_size,
            run_dir,
            pids,
        } => progress.update(
            *world_size as u64,
            &format!(
                "started {} (pids {}); logs and manifest.json in {}",
                if pids.len() == *world_size {
                    format!("{world_size} ranks")
                } else {
                    format!("{} of the {world_size} ranks here", pids.len())
                },
                pids.iter()
                    .map(u32::to_string)
                    .collect::<Vec<_>>()
                    .join(", "),
                run_dir.display()
            ),
        ),
        Progress::Loaded { loaded, world_size } => {
            let message = format!("{loaded}/{world_size} ranks loaded their shard");
            if progress.is_bar() || loaded == world_size {
                progress.update((world_size + loaded) as u64, &message);
            }
        }
        Progress::Host { host, stage } => progress.note(&format!("[{host}] {stage}")),
        Progress::RankLine { label, line, .. } if echo_ranks => {
            let line = line.strip_prefix("note: ").unwrap_or(line);
            progress.note(&format!("[{label}] {line}"))
        }
        Progress::RankLine { .. } => {}
    }
}

/// The weights `--model` and `--load-format` name: the file ([`crate::model::weights_path`])
/// or random weights of the model's shape ([`crate::model::dummy`]).
///
/// Errors: `--dtype`/`--num-layers` without `--load-format dummy`, and those of the two.
fn model_source(
    model_args: &crate::cli::ModelArgs,
    progress: &mut dyn FnMut(&str),
) -> anyhow::Result<crate::runtime::model::source::ModelSource> {
    use crate::runtime::model::source::ModelSource;
    let model = model_args.path.as_deref();
    match model_args.load.dummy()? {
        None => crate::model::weights_path(model, progress).map(ModelSource::File),
        Some((dtype, num_layers)) => {
            crate::model::dummy(model, dtype, num_layers).map(ModelSource::Dummy)
        }
    }
}
