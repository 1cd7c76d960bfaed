//! Command-line types (clap derive). Their doc comments are the `--help` text. The only file
//! that imports clap; commands turn these into settings for the domain modules.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

/// Plan, launch and diagnose distributed LLM inference on bare-metal GPU clusters.
#[derive(Debug, Parser)]
#[command(name = "infer", version, about, long_about = None, propagate_version = true)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Probe this host's GPUs, NVLink, NICs and HCAs (or import a recorded topology) and
    /// print the matrix like `nvidia-smi topo -m`.
    Topo(TopoArgs),
}

/// `infer topo`.
#[derive(Debug, Args)]
pub struct TopoArgs {
    /// Print JSON (`hosts[]` with `gpus`, `gpu_links`, `nvlink_domains`, `nics`) to stdout.
    #[arg(long)]
    pub json: bool,

    /// Import a recorded topology instead of probing: `nvidia-smi topo -m` text or
    /// `infer topo --json` output; `-` reads standard input.
    #[arg(long, value_name = "FILE")]
    pub from: Option<PathBuf>,

    /// Read NICs and HCAs from this sysfs mount point instead of `/sys`.
    #[arg(long, value_name = "DIR", default_value = "/sys")]
    pub sysfs_root: PathBuf,
}
