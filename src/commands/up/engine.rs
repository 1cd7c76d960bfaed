//! `infer up --engine E`: vLLM, SGLang, llama.cpp (or infer's own engine node by node) in
//! a layout: the flags become [`crate::launch::serving_engines::EngineUpSettings`], and
//! [`crate::launch::serving_engines::up`] checks the hosts, starts the engine and watches it.

use anyhow::{Result, bail};

use super::report::report_progress_plain;
use crate::cli::UpArgs;
use crate::launch::events::UpEvent;
use crate::launch::up_settings;
use crate::serving_engines::EngineKind;
use crate::ui::Printer;
use crate::{ExitStatus, model};

/// `infer up --engine E`: the flags become [`crate::launch::serving_engines::EngineUpSettings`], and
/// [`crate::launch::serving_engines::up`] checks the hosts, starts the engine and watches it.
pub(super) fn run(
    args: &UpArgs,
    engine: crate::serving_engines::EngineKind,
    printer: &Printer,
) -> Result<ExitStatus> {
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
    let pd = match up_settings::pd_counts(args.prefill, args.decode)? {
        Some((prefill, decode)) => {
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
        None => None,
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
        (None, EngineKind::Llamacpp) => Some(up_settings::model_id(std::path::Path::new(&model))),
        (None, _) => None,
    };
    let settings = crate::launch::serving_engines::EngineUpSettings {
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
        shutdown_timeout: up_settings::shutdown_timeout(args.shutdown_timeout)?,
        ready_timeout: std::time::Duration::from_secs(args.ready_timeout),
        stall_timeout: up_settings::stall_timeout(args.stall_timeout)?,
        max_restarts: args.max_restarts,
        api_key: up_settings::api_key(args.api_key.as_deref(), args.api_key_file.as_deref())?,
    };
    crate::launch::serving_engines::up(&settings, &mut |event| match event {
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
