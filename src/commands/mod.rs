//! One module per subcommand: each turns clap arguments into a call of a domain module and
//! hands the result to [`crate::ui::Printer`]. No domain logic lives here.

pub(crate) mod agent;
pub(crate) mod bench;
pub(crate) mod doctor;
pub(crate) mod generate;
pub(crate) mod model;
pub(crate) mod plan;
pub(crate) mod rank;
pub(crate) mod smoke;
pub(crate) mod topo;
pub(crate) mod up;

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
    let (model, load) = (model_args.path.as_deref(), &model_args.load);
    match load.load_format {
        crate::cli::LoadFormatArg::Auto => {
            if load.dtype.is_some() || load.num_layers.is_some() {
                anyhow::bail!(
                    "--dtype and --num-layers shape random weights: add --load-format dummy (a model file's weights keep their own type and layers)"
                );
            }
            crate::model::weights_path(model, progress).map(ModelSource::File)
        }
        crate::cli::LoadFormatArg::Dummy => crate::model::dummy(
            model,
            load.dtype
                .map_or(crate::runtime::model::dummy::DummyDtype::Bf16, Into::into),
            load.num_layers,
        )
        .map(ModelSource::Dummy),
    }
}

/// Where NVIDIA's libraries are looked for first, from this process's environment
/// ([`crate::runtime::libraries::search_dirs`]).
fn cuda_lib_dirs() -> Vec<std::path::PathBuf> {
    crate::runtime::libraries::search_dirs(&|name| std::env::var_os(name))
}

/// `--device cuda`'s first step, before anything starts: a driver and a GPU on this host.
///
/// Errors: no driver or no GPU, naming this host.
fn require_gpu() -> anyhow::Result<crate::runtime::cuda::device::Driver> {
    use anyhow::Context;
    crate::runtime::cuda::device::probe(&cuda_lib_dirs()).with_context(|| {
        format!(
            "--device cuda on host `{}`",
            crate::topology::probe::local_hostname()
        )
    })
}

/// `--device cuda` on `infer generate` and `infer up`, before anything starts: the kernels on
/// this host's GPUs (a driver and a GPU must be here, unless the ranks run on an inventory's
/// hosts, `remote`, whose agents report theirs) or, with `INFER_CUDA_HOST_HARNESS=1`, on the
/// host harness (the same sources on CPU threads, built by `$CXX` or `c++`: the device path
/// checked on a machine without a GPU). Returns the device and the visible GPUs that local
/// rank processes are given (none for the harness: each rank's `CUDA_VISIBLE_DEVICES` is then
/// its local rank, as it would be on a GPU host).
///
/// Errors: no driver or no GPU, naming this host; no cache directory.
fn cuda_device(
    remote: bool,
) -> anyhow::Result<(crate::runtime::exec::kernel_executor::KernelDevice, usize)> {
    use crate::runtime::exec::kernel_executor::KernelDevice;
    let cache_dir = crate::model::default::cache_dir()?.join("kernels");
    if let Some(harness) = host_harness(&cache_dir) {
        return Ok((harness, 0));
    }
    if remote {
        return Ok((
            KernelDevice::Gpu {
                lib_dirs: cuda_lib_dirs(),
                cache_dir,
            },
            0,
        ));
    }
    let driver = require_gpu()?;
    Ok((
        KernelDevice::Gpu {
            lib_dirs: cuda_lib_dirs(),
            cache_dir,
        },
        driver.gpus.len(),
    ))
}

/// The host harness, when `INFER_CUDA_HOST_HARNESS=1` asks for it: the kernels built by
/// `$CXX` (else `c++`), the library cached under `cache_dir`.
fn host_harness(
    cache_dir: &std::path::Path,
) -> Option<crate::runtime::exec::kernel_executor::KernelDevice> {
    std::env::var(crate::envvars::CUDA_HOST_HARNESS)
        .is_ok_and(|v| v == "1")
        .then(
            || crate::runtime::exec::kernel_executor::KernelDevice::HostHarness {
                compiler: std::env::var("CXX").unwrap_or_else(|_| "c++".into()),
                cache_dir: cache_dir.to_path_buf(),
            },
        )
}
