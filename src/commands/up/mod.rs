//! `infer up`: serve the OpenAI-compatible API until Ctrl-C or SIGTERM. A thin wrapper:
//! the flags become [`crate::launch::up_settings::UpSettings`], [`crate::launch::serving::up`] does the work (the engine
//! in this process at one rank, else a gang of rank processes here or on an inventory's
//! hosts), and its events go to the printer.

use anyhow::{Result, bail};

use crate::ExitStatus;
use crate::cli::UpArgs;
use crate::ui::Printer;

mod engine;
mod report;
mod settings;

use report::UpReporter;
use settings::{gpu_settings, up_settings};

/// Runs `infer up`. Errors: bad flags, a model that does not load, an address that cannot
/// be bound, a rank that fails (named, with its last log lines).
pub(crate) fn run(args: &UpArgs, printer: &Printer) -> Result<ExitStatus> {
    let limits = crate::launch::up_settings::scheduler_limits(
        args.kv_cache_tokens,
        args.max_batch,
        args.max_num_batched_tokens,
    )?;
    let gpu = gpu_settings(args)?;
    if let Some(engine) = args.engine.filter(|e| *e != crate::cli::EngineArg::Infer) {
        if args.model.load.load_format != crate::cli::LoadFormatArg::Auto {
            bail!(
                "--load-format dummy gives infer's own engine random weights; --engine {engine:?} loads its own (vLLM and SGLang have their own --load-format dummy)"
            );
        }
        return engine::run(args, engine.into(), printer);
    }
    let settings = up_settings(args, limits, gpu, printer)?;
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
