//! `infer up`: serve the OpenAI-compatible API until Ctrl-C or SIGTERM. A thin wrapper:
//! the flags become [`crate::launch::serving::UpSettings`], [`crate::launch::serving::up`] does the work (the engine
//! in this process at one rank, else a gang of rank processes here or on an inventory's
//! hosts), and its events go to the printer.

use anyhow::{Result, bail};

use crate::cli::UpArgs;
use crate::launch::events::UpEvent;
use crate::ui::Printer;
use crate::{ExitStatus, model};

mod report;
mod settings;

use report::{UpReporter, report_progress_plain};
use settings::{
    check_model_flags, gpu_settings, model_id, pd_replicas, scheduler_limits, shutdown_timeout,
    stall_timeout, up_settings,
};

/// Runs `infer up`. Errors: bad flags, a model that does not load, an address that cannot
/// be bound, a rank that fails (named, with its last log lines).
pub(crate) fn run(args: &UpArgs, printer: &Printer) -> Result<ExitStatus> {
    let limits = scheduler_limits(args)?;
    let gpu = gpu_settings(args)?;
    if let Some(engine) = args.engine.filter(|e| *e != crate::cli::EngineArg::Infer) {
        if args.model.load.load_format != crate::cli::LoadFormatArg::Auto {
            bail!(
                "--load-format dummy gives infer's own engine random weights; --engine {engine:?} loads its own (vLLM and SGLang have their own --load-format dummy)"
            );
        }
        return run_engine(args, engine.into(), printer);
    }
    let pd_prefill = pd_replicas(args)?;
    let source = super::model_source(&args.model, &mut |line| printer.note(line))?;
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
    if args.protect_metrics {
        bail!(
            "--protect-metrics with --engine {engine}: the engine serves /metrics without the API key (vLLM, SGLang and llama.cpp guard the API only); leave it out and keep /metrics on a trusted network"
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
            if args.api_key.is_some() || args.api_key_file.is_some() {
                // (Checked before --protect-metrics, which needs a key.)
                bail!(
                    "--api-key with --engine {engine} --prefill/--decode: the PD router in front of the workers would serve without it; leave out --api-key (and keep the router on a trusted network) or serve aggregated"
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
    let model = match (engine, args.model.path.as_deref()) {
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
        max_model_len_tokens: args.max_model_len,
        ssh: crate::launch::ssh::SshOptions {
            accept_new: args.ssh.ssh_accept_new,
        },
        run_dir: args.run_dir.clone(),
        shutdown_timeout: shutdown_timeout(args.shutdown_timeout)?,
        ready_timeout: std::time::Duration::from_secs(args.ready_timeout),
        stall_timeout: stall_timeout(args.stall_timeout)?,
        max_restarts: args.max_restarts,
        api_key: settings::api_key(args)?,
    };
    crate::launch::engines::up(&settings, &mut |event| match event {
        UpEvent::Note(text) => printer.note_or_warn(&text),
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
