//! `infer agent` (hidden): the remote end of a multi-host run, or `--kill RUN_ID` to stop
//! exactly one run's ranks on this host. See [`crate::launch::agent`].

use anyhow::Result;

use crate::ExitStatus;
use crate::cli::AgentArgs;
use crate::ui::Printer;

/// Runs the agent on stdin/stdout, or kills one run.
pub(crate) fn run(args: &AgentArgs, printer: &Printer) -> Result<ExitStatus> {
    match &args.kill {
        Some(run_id) => {
            let stopped = crate::launch::agent::kill_run(run_id, args.host.as_deref())?;
            printer.note(&format!(
                "stopped {stopped} rank process groups of `{run_id}`"
            ));
        }
        None => crate::launch::agent::run_agent()?,
    }
    Ok(ExitStatus::Success)
}
