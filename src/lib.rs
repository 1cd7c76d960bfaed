//! `infer`: plan, launch and diagnose distributed LLM inference on bare-metal GPU clusters.
//!
//! The library behind the binary. [`run`] dispatches a parsed command line to a command in
//! [`commands`]; each command is a thin wrapper over a domain module ([`topology`], …).
//! See ARCHITECTURE.md for the code map and the invariants.

pub mod cli;
pub(crate) mod commands;
pub mod doctor;
pub mod inventory;
pub mod launch;
pub mod model;
pub mod plan;
pub mod serve;
pub(crate) mod serving_engines;
pub mod topology;
pub mod ui;

// The engine core and the pieces every layer shares live in the `infer-runtime` crate, below
// this one; re-exported here so each keeps its path (`infer::runtime::…`, `crate::keyring::…`).
pub(crate) use infer_runtime::envvars;
pub use infer_runtime::{degrees, handshake, keyring, rendezvous, runtime};

/// How a command that ran to completion answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExitStatus {
    /// Exit code 0.
    Success,
    /// Exit code 1: the command worked and the answer is "no" (infeasible plan, doctor errors).
    No,
}

/// Runs one command. Errors are bad input or unexpected failures (exit code 2).
pub fn run(cli: cli::Cli, printer: &ui::Printer) -> anyhow::Result<ExitStatus> {
    match cli.command {
        cli::Command::Topo(args) => commands::topo::run(&args, printer),
        cli::Command::Plan(args) => commands::plan::run(&args, printer),
        cli::Command::Doctor(args) => commands::doctor::run(&args, printer),
        cli::Command::Up(args) => commands::up::run(&args, printer),
        cli::Command::Generate(args) => commands::generate::run(&args, printer),
        cli::Command::Bench(command) => commands::bench::run(&command, printer),
        cli::Command::Smoke(args) => commands::smoke::run(&args, printer),
        cli::Command::Model(command) => commands::model::run(&command, printer),
        cli::Command::Rank => commands::rank::run(printer),
        cli::Command::Agent(args) => commands::agent::run(&args, printer),
    }
}
