//! The `infer` binary: parse the command line, run it, print any error, choose the exit code.
//!
//! Exit codes: 0 success, 1 the answer is "no" (an infeasible plan, doctor errors), 2 bad
//! input or an unexpected failure. Only this file chooses them.

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = infer::cli::Cli::parse();
    let printer = infer::ui::Printer::from_env();
    match infer::run(cli, &printer) {
        Ok(infer::ExitStatus::Success) => ExitCode::SUCCESS,
        Ok(infer::ExitStatus::No) => ExitCode::from(1),
        Err(error) => {
            printer.error(&error);
            ExitCode::from(2)
        }
    }
}
