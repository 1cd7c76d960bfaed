//! `infer topo`: probe this host or import a recorded topology, print it as text or JSON.

use std::io::Read;

use anyhow::{Context, Result};

use crate::ExitStatus;
use crate::cli::TopoArgs;
use crate::topology::probe::{ProbeOptions, probe_host};
use crate::topology::{Topology, render};
use crate::ui::Printer;

/// Runs `infer topo`. Errors: unreadable or malformed `--from` input, a failed probe.
pub(crate) fn run(args: &TopoArgs, printer: &Printer) -> Result<ExitStatus> {
    if let Some(inventory) = &args.cluster {
        return cluster(args, inventory, printer);
    }
    let topology = match &args.from {
        Some(path) if path.as_os_str() == "-" => {
            let mut text = String::new();
            std::io::stdin()
                .read_to_string(&mut text)
                .context("failed to read standard input")?;
            Topology::import(&text, "stdin")?
        }
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("failed to read `{}`", path.display()))?;
            let origin = path.file_name().map_or_else(
                || path.display().to_string(),
                |n| n.to_string_lossy().into_owned(),
            );
            Topology::import(&text, &origin)?
        }
        None => Topology {
            hosts: vec![probe_host(&ProbeOptions {
                sysfs_root: args.sysfs_root.clone(),
            })?],
        },
    };
    if args.json {
        printer.json(&topology)?;
    } else {
        printer.data(&render::render(&topology));
    }
    Ok(ExitStatus::Success)
}

/// `--cluster`: every host probed on that host; a host that cannot be reached is an error
/// line (and exit 1) while the others still print.
fn cluster(args: &TopoArgs, inventory: &std::path::Path, printer: &Printer) -> Result<ExitStatus> {
    let ssh = crate::launch::ssh::SshOptions {
        accept_new: args.ssh.ssh_accept_new,
    };
    let (topology, failures) =
        crate::launch::survey::probe_topologies(inventory, ssh, &mut |event| {
            if let crate::launch::Progress::Host { host, stage } = event
                && stage.starts_with("connected")
            {
                printer.note(&format!("[{host}] {stage}"));
            }
        })?;
    if args.json {
        printer.json(&topology)?;
    } else if !topology.hosts.is_empty() {
        printer.data(&render::render(&topology));
    }
    for failure in &failures {
        printer.note(&format!(
            "error: host `{}` could not be probed ({}): {}",
            failure.host, failure.stage, failure.message
        ));
    }
    Ok(if failures.is_empty() {
        ExitStatus::Success
    } else {
        ExitStatus::No
    })
}
