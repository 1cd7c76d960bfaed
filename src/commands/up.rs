//! `infer up`: load the engine, start the continuous-batching scheduler and serve the
//! OpenAI-compatible API until Ctrl-C or SIGTERM.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};

use crate::cli::UpArgs;
use crate::runtime::engine::Engine;
use crate::runtime::gguf::Header;
use crate::runtime::tokenizer::Tokenizer;
use crate::serve::scheduler::Scheduler;
use crate::serve::{AppState, router};
use crate::ui::Printer;
use crate::{ExitStatus, model};

/// Runs `infer up`. Errors: a model that does not load, an address that cannot be bound.
pub fn run(args: &UpArgs, printer: &Printer) -> Result<ExitStatus> {
    let started = Instant::now();
    let path = model::weights_path(args.model.as_deref(), &mut |line| printer.note(line))?;
    let engine = Engine::load(&path, args.threads)?;
    let tokenizer = if path.is_dir() {
        Tokenizer::from_dir(&path)?
    } else {
        Tokenizer::from_gguf(&Header::read_file(&path)?)?
    };
    let model_id = path.file_stem().map_or_else(
        || path.display().to_string(),
        |s| s.to_string_lossy().into_owned(),
    );
    let max_context_tokens = engine.model.config.max_context_tokens;
    let scheduler = Scheduler::start(engine, args.max_batch);
    let state = Arc::new(AppState {
        scheduler,
        model_id: model_id.clone(),
        tokenizer,
        max_context_tokens,
        api_key: args.api_key.clone(),
    });
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("failed to start the HTTP runtime")?;
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
            .await
            .with_context(|| {
                format!(
                    "cannot listen on {}:{} (in use? try `--port`)",
                    args.host, args.port
                )
            })?;
        let address = listener.local_addr()?;
        printer.note(&format!(
            "serving `{model_id}` on http://{address} (ready in {:.2} s); Ctrl-C stops",
            started.elapsed().as_secs_f64()
        ));
        axum::serve(listener, router(state))
            .with_graceful_shutdown(async {
                let mut terminate =
                    tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
                let sigterm = async {
                    match terminate.as_mut() {
                        Some(s) => {
                            s.recv().await;
                        }
                        None => std::future::pending::<()>().await,
                    }
                };
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = sigterm => {}
                }
            })
            .await
            .context("the HTTP server failed")
    })?;
    printer.note("stopped");
    Ok(ExitStatus::Success)
}
