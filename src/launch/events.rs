//! What both `infer up` launchers (`serving.rs`: rank processes; `engine.rs`: other
//! engines) share: the events they report to the command, and the watcher that counts
//! Ctrl-C and SIGTERM.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use anyhow::{Context, Result};

use super::Progress;

/// What `infer up` (`serving::up`: rank processes, `engine::up`: other engines) reports
/// besides the gang's [`Progress`].
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum UpEvent {
    /// A line for the user (where the layout came from, why it stopped early).
    Note(String),
    /// One process: listening (503) while the engine loads.
    Listening(SocketAddr),
    /// Serving at this address; `world_size` 1 is the in-process engine.
    Ready {
        address: String,
        world_size: usize,
        layout: String,
        ready_secs: f64,
    },
    /// A launcher milestone or a rank's output line.
    Gang(Progress),
}

/// Warns, once `host:port` is bound, when the server listens beyond this machine without an
/// API key.
pub(super) fn warn_if_exposed(host: &str, api_key: Option<&str>, events: &mut dyn FnMut(UpEvent)) {
    let loopback = host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback());
    if api_key.is_none() && !loopback {
        events(UpEvent::Note(format!(
            "warning: serving on {host} without an API key: whoever reaches this port can use the model; set `{}` (or --api-key)",
            crate::envvars::API_KEY
        )));
    }
}

/// Counts SIGINTs and SIGTERMs into `signals` (a thread with its own small runtime).
pub(super) fn watch_signals(signals: Arc<AtomicUsize>) -> Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("failed to start the signal watcher")?;
    let mut terminate = runtime
        .block_on(async {
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        })
        .context("cannot watch SIGTERM")?;
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            runtime.block_on(async {
                loop {
                    tokio::select! {
                        _ = tokio::signal::ctrl_c() => {}
                        _ = terminate.recv() => {}
                    }
                    signals.fetch_add(1, Ordering::SeqCst);
                }
            });
        })
        .context("failed to start the signal watcher")?;
    Ok(())
}
