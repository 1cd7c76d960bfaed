//! `infer up`: serve the OpenAI-compatible API until Ctrl-C or SIGTERM. A thin wrapper:
//! the flags become [`UpSettings`], [`crate::launch::serving::up`] does the work (the engine
//! in this process at one rank, else a gang of rank processes here or on an inventory's
//! hosts), and its events go to the printer.

use anyhow::{Result, bail};

use crate::cli::{DeviceArg, UpArgs};
use crate::launch::Progress;
use crate::launch::events::UpEvent;
use crate::launch::serving::UpSettings;
use crate::ui::{self, Printer};
use crate::{ExitStatus, model};

/// Runs `infer up`. Errors: bad flags, a model that does not load, an address that cannot
/// be bound, a rank that fails (named, with its last log lines).
pub(crate) fn run(args: &UpArgs, printer: &Printer) -> Result<ExitStatus> {
    let limits = scheduler_limits(args)?;
    let gpu = gpu_settings(args)?;
    if let Some(engine) = args.engine.filter(|e| *e != crate::cli::EngineArg::Infer) {
        if args.load.load_format != crate::cli::LoadFormatArg::Auto {
            bail!(
                "--load-format dummy gives infer's own engine random weights; --engine {engine:?} loads its own (vLLM and SGLang have their own --load-format dummy)"
            );
        }
        return run_engine(args, engine.into(), printer);
    }
    let pd_prefill = pd_replicas(args)?;
    let source = super::model_source(args.model.as_deref(), &args.load, &mut |line| {
        printer.note(line)
    })?;
    check_model_flags(args, &source)?;
    let settings = up_settings(args, source, limits, gpu, pd_prefill)?;
    let mut reporter = UpReporter {
        printer,
        model_id: &settings.model_id,
        bar: None,
        serving: false,
    };
    crate::launch::serving::up(&settings, &mut |event| reporter.report(event))?;
    printer.note("stopped");
    Ok(ExitStatus::Success)
}

/// The scheduler's limits from `--kv-cache-tokens`, `--max-batch` and
/// `--max-num-batched-tokens`. Errors: a KV cache under one block of tokens, a batch of 0,
/// or a step's token budget under the batch.
fn scheduler_limits(args: &UpArgs) -> Result<crate::serve::scheduler::Limits> {
    if args.kv_cache_tokens < crate::runtime::model::kv::BLOCK_TOKENS {
        bail!(
            "--kv-cache-tokens must hold at least one block of {} tokens, got {}",
            crate::runtime::model::kv::BLOCK_TOKENS,
            args.kv_cache_tokens
        );
    }
    if args.max_batch == 0 {
        bail!("--max-batch must be at least 1 (the most sequences decoded together)");
    }
    let mut limits = crate::serve::scheduler::Limits::for_this_host(args.max_batch);
    if let Some(tokens) = args.max_num_batched_tokens {
        if tokens < args.max_batch {
            bail!(
                "--max-num-batched-tokens ({tokens}) must be at least --max-batch ({}): every running sequence decodes one token per step",
                args.max_batch
            );
        }
        limits.max_batched_tokens = tokens;
    }
    Ok(limits)
}

/// With `--device cuda`: this host's kernels and GPUs, checked before anything starts
/// (`None` on the CPU). Errors: no driver or no GPU on this host (unless the ranks run on an
/// inventory's hosts, whose agents report their GPUs instead).
fn gpu_settings(args: &UpArgs) -> Result<Option<crate::serve::http::GpuSettings>> {
    if args.device != DeviceArg::Cuda {
        return Ok(None);
    }
    // Before anything starts: a driver and a GPU on this host.
    // (On an inventory's hosts, their agents report their GPUs instead.)
    let remote = args
        .cluster
        .as_deref()
        .is_some_and(crate::inventory::is_inventory);
    let (kernels, gpus) = super::cuda_device(remote)?;
    Ok(Some(crate::serve::http::GpuSettings { kernels, gpus }))
}

/// `--prefill N --decode M` as (prefill replicas, decode replicas), `None` without them.
/// Errors: a count of 0, `--plan` alongside, or a planned (not inventory) `--cluster`.
fn pd_replicas(args: &UpArgs) -> Result<Option<(usize, usize)>> {
    let (Some(prefill), Some(decode)) = (args.prefill, args.decode) else {
        return Ok(None);
    };
    if prefill == 0 || decode == 0 {
        bail!("--prefill and --decode must each be at least 1, got {prefill} and {decode}");
    }
    if args.plan.is_some() {
        bail!(
            "--prefill/--decode give the layout themselves (with --tp/--pp for each replica); drop --plan"
        );
    }
    if let Some(cluster) = args
        .cluster
        .as_deref()
        .filter(|c| !crate::inventory::is_inventory(c) && !c.ends_with(".toml") && !c.contains('/'))
    {
        bail!(
            "--prefill/--decode run on an inventory's hosts (`--cluster hosts.toml`), not on the planned cluster `{cluster}`"
        );
    }
    Ok(Some((prefill, decode)))
}

/// Checks the flags that depend on the model: `--max-model-len` (tokens) within its context
/// and a non-empty `--served-model-name`. Errors: either out of range, or a model whose
/// spec does not read.
fn check_model_flags(
    args: &UpArgs,
    source: &crate::runtime::model::source::ModelSource,
) -> Result<()> {
    if let Some(len) = args.max_model_len {
        let context = model::spec_of(source)?.max_position_embeddings;
        if len == 0 || len as u64 > context {
            bail!(
                "--max-model-len must be 1 to the model's context of {context} tokens, got {len}"
            );
        }
    }
    if args.served_model_name.as_deref().is_some_and(str::is_empty) {
        bail!("--served-model-name must not be empty");
    }
    Ok(())
}

/// The checked flags as [`UpSettings`]. Errors: a negative `--shutdown-timeout` (seconds) or
/// `--nnodes/--node-rank/--master-addr` that do not resolve.
fn up_settings(
    args: &UpArgs,
    source: crate::runtime::model::source::ModelSource,
    limits: crate::serve::scheduler::Limits,
    gpu: Option<crate::serve::http::GpuSettings>,
    pd_prefill: Option<(usize, usize)>,
) -> Result<UpSettings> {
    Ok(UpSettings {
        model_id: served_model_id(args, &source),
        max_model_len: args.max_model_len,
        shutdown_timeout: shutdown_timeout(args.shutdown_timeout)?,
        model: source,
        pins: crate::degrees::DegreePins {
            dp: pd_prefill
                .map(|(prefill, decode)| prefill + decode)
                .or(args.degrees.dp),
            ..args.degrees.pins()
        },
        pd_prefill: pd_prefill.map(|(prefill, _)| prefill),
        plan: args.plan.clone(),
        cluster: args.cluster.clone(),
        host: args.host.clone(),
        port: args.port,
        threads: args.threads,
        numerics: args.numerics.into(),
        limits,
        prefix_cache: !args.no_prefix_cache,
        kv_cache_tokens: args.kv_cache_tokens,
        api_key: args.api_key.clone(),
        ssh: crate::launch::ssh::SshOptions {
            accept_new: args.ssh.ssh_accept_new,
        },
        push_model: args.ssh.push_model,
        run_dir: args.run_dir.clone(),
        node: node_settings(args)?,
        gpu,
    })
}

/// The id `/v1/models` lists: `--served-model-name`, else a profile's name as it is, or a
/// file's or directory's stem.
fn served_model_id(args: &UpArgs, source: &crate::runtime::model::source::ModelSource) -> String {
    args.served_model_name
        .clone()
        .unwrap_or_else(|| match source {
            crate::runtime::model::source::ModelSource::File(path) => model_id(path),
            // A profile's name as it is; a file's or directory's stem.
            crate::runtime::model::source::ModelSource::Dummy(dummy) => {
                let path = std::path::Path::new(&dummy.name);
                if path.exists() {
                    model_id(path)
                } else {
                    dummy.name.clone()
                }
            }
        })
}

/// `--shutdown-timeout` seconds as a duration. Errors: a negative or non-finite number.
fn shutdown_timeout(shutdown_timeout_secs: f64) -> Result<std::time::Duration> {
    std::time::Duration::try_from_secs_f64(shutdown_timeout_secs).map_err(|_| {
        anyhow::anyhow!("--shutdown-timeout must be 0 or more seconds, got {shutdown_timeout_secs}")
    })
}

/// This node of a multi-node launch (`--nnodes`, `--node-rank`, `--master-addr`), `None`
/// unless all three are given. Errors: a node rank out of range or an address that does
/// not resolve.
fn node_settings(args: &UpArgs) -> Result<Option<crate::launch::serving::NodeSettings>> {
    match (args.nnodes, args.node_rank, &args.master_addr) {
        (Some(nnodes), Some(node_rank), Some(master_addr)) => {
            Ok(Some(crate::launch::serving::NodeSettings::resolve(
                nnodes,
                node_rank,
                master_addr,
                args.master_port,
                args.bind_addr,
                std::env::var(crate::envvars::RUN_TOKEN).ok(),
            )?))
        }
        _ => Ok(None),
    }
}

/// Prints `infer up`'s events: a bar while the gang starts (on a terminal), plain lines
/// once serving.
struct UpReporter<'a> {
    printer: &'a Printer,
    /// The id `/v1/models` lists, named in the notes.
    model_id: &'a str,
    /// The start-up bar, until the gang is ready.
    bar: Option<ui::Progress>,
    /// Whether the gang is ready (rank output then goes out as plain lines).
    serving: bool,
}

impl UpReporter<'_> {
    /// Prints one event.
    fn report(&mut self, event: UpEvent) {
        let printer = self.printer;
        match event {
            UpEvent::Note(text) => printer.note(&text),
            UpEvent::Listening(address) => printer.note(&format!(
                "loading `{}`; http://{address} answers 503 until it is ready",
                self.model_id
            )),
            UpEvent::Gang(event) if self.serving => report_progress_plain(printer, &event),
            UpEvent::Gang(event) => {
                if let Progress::Started { world_size, .. } = &event
                    && self.bar.is_none()
                {
                    self.bar = Some(printer.progress(2 * *world_size as u64 + 1));
                }
                match &self.bar {
                    Some(bar) => super::report_progress(bar, &event, true),
                    None => report_progress_plain(printer, &event),
                }
            }
            UpEvent::Ready {
                address,
                world_size,
                layout,
                ready_secs,
            } => {
                if let Some(bar) = self.bar.take() {
                    if bar.is_bar() {
                        bar.update(2 * world_size as u64 + 1, "ready");
                    }
                    bar.finish();
                }
                self.serving = true;
                let message = match world_size {
                    1 => format!(
                        "serving `{}` on http://{address} (ready in {ready_secs:.2} s); Ctrl-C stops",
                        self.model_id
                    ),
                    n => format!(
                        "serving `{}` on http://{address} with {n} ranks ({layout}), ready in {ready_secs:.2} s; Ctrl-C stops",
                        self.model_id
                    ),
                };
                printer.note(&message);
            }
        }
    }
}

/// `infer up --engine E`: the flags become [`crate::launch::engines::EngineUpSettings`], and
/// [`crate::launch::engines::up`] checks the hosts, starts the engine and watches it.
fn run_engine(
    args: &UpArgs,
    engine: crate::engines::EngineKind,
    printer: &Printer,
) -> Result<ExitStatus> {
    use crate::engines::EngineKind;
    if args.plan.is_some() {
        bail!(
            "--plan with --engine: give the layout as --tp/--pp/--dp/--ep, or use `infer plan --engine {engine} --emit DIR`"
        );
    }
    let pd = match (args.prefill, args.decode) {
        (Some(prefill), Some(decode)) => {
            if prefill == 0 || decode == 0 {
                bail!("--prefill and --decode must each be at least 1, got {prefill} and {decode}");
            }
            if engine == EngineKind::Llamacpp {
                bail!(
                    "--prefill/--decode with --engine llamacpp: llama.cpp has no prefill/decode disaggregation; use --engine vllm, sglang or infer"
                );
            }
            Some((prefill, decode))
        }
        _ => None,
    };
    let cluster = match args.cluster.as_deref() {
        None | Some("local") => None,
        Some(c) if crate::inventory::is_inventory(c) => Some(std::path::PathBuf::from(c)),
        Some(c) => bail!(
            "--cluster `{c}` with --engine: the engine runs on real hosts: give an inventory (hosts.toml) or leave it out for this host"
        ),
    };
    let model = match (engine, args.model.as_deref()) {
        // llama.cpp loads a GGUF file: the default model, an alias, or a path.
        (EngineKind::Llamacpp, model) => {
            let path = model::weights_path(model, &mut |line| printer.note(line))?;
            std::path::absolute(&path)
                .unwrap_or(path)
                .display()
                .to_string()
        }
        (_, Some(model)) if std::path::Path::new(model).exists() => std::path::absolute(model)
            .map_or_else(|_| model.to_string(), |p| p.display().to_string()),
        (_, Some(model)) => model.to_string(),
        (_, None) => bail!(
            "--engine {engine} needs --model: a Hugging Face id in every host's cache, or a path present on every host"
        ),
    };
    // llama.cpp lists a GGUF by its path; `infer up` lists it by its file stem.
    let served_model_name = match (&args.served_model_name, engine) {
        (Some(name), _) => Some(name.clone()),
        (None, EngineKind::Llamacpp) => Some(model_id(std::path::Path::new(&model))),
        (None, _) => None,
    };
    let settings = crate::launch::engines::EngineUpSettings {
        engine,
        model,
        served_model_name,
        inventory: cluster,
        host: args.host.clone(),
        port: args.port,
        dist_port: args.dist_port,
        engine_bin: args.engine_bin.clone(),
        pins: args.degrees.pins(),
        pd,
        max_model_len_tokens: args.max_model_len.map(|n| n as u64),
        ssh: crate::launch::ssh::SshOptions {
            accept_new: args.ssh.ssh_accept_new,
        },
        run_dir: args.run_dir.clone(),
        shutdown_timeout: shutdown_timeout(args.shutdown_timeout)?,
        ready_timeout: std::time::Duration::from_secs(args.ready_timeout),
    };
    crate::launch::engines::up(&settings, &mut |event| match event {
        UpEvent::Note(text) => printer.note(&text),
        UpEvent::Listening(_) => {}
        UpEvent::Gang(event) => report_progress_plain(printer, &event),
        UpEvent::Ready {
            address,
            layout,
            ready_secs,
            ..
        } => printer.note(&format!(
            "serving on http://{address} ({layout}), ready in {ready_secs:.2} s; Ctrl-C stops"
        )),
    })?;
    printer.note("stopped");
    Ok(ExitStatus::Success)
}

/// The id `/v1/models` lists for the model at `path`: its file stem.
fn model_id(path: &std::path::Path) -> String {
    path.file_stem().map_or_else(
        || path.display().to_string(),
        |s| s.to_string_lossy().into_owned(),
    )
}

/// After the bar is gone: rank output as plain `[rank N]` lines.
fn report_progress_plain(printer: &Printer, event: &Progress) {
    match event {
        Progress::RankLine { label, line, .. } => {
            let line = line.strip_prefix("note: ").unwrap_or(line);
            printer.note(&format!("[{label}] {line}"));
        }
        Progress::Host { host, stage } => printer.note(&format!("[{host}] {stage}")),
        _ => {}
    }
}
