//! `infer smoke`: the single-GPU CI check. A thin wrapper: [`crate::runtime::exec::gpu_checks::run`]
//! does the checks; this prints the pass/fail table (or JSON) and picks the exit status.

use anyhow::{Context, Result, bail};

use crate::ExitStatus;
use crate::cli::{DeviceArg, SmokeArgs};
use crate::ui::Printer;

/// Runs `infer smoke`. Exit 0 when every check passes, 1 when one fails. Errors (exit 2):
/// no driver or no GPU, `--device cpu`.
pub(crate) fn run(args: &SmokeArgs, printer: &Printer) -> Result<ExitStatus> {
    if args.device == DeviceArg::Cpu {
        bail!(
            "infer smoke checks the CUDA backend: use --device cuda (the default); the CPU engine is checked by the test suite"
        );
    }
    let cache = crate::model::default::cache_dir()?.join("kernels");
    // Nothing to check without a GPU: say so before fetching the model.
    super::require_gpu().context("infer smoke needs an NVIDIA GPU")?;
    let model = crate::model::weights_path(args.model.as_deref(), &mut |line| printer.note(line))
        .context(
        "infer smoke needs a model to check the GPU with: pass --model PATH (a GGUF file, e.g. \
             one carried to a machine without network)",
    )?;
    let exe = std::env::current_exe().context("cannot find this executable to start `infer up`")?;
    let report = crate::launch::smoke::run(&cache, &super::cuda_lib_dirs(), &model, &exe)
        .context("infer smoke needs an NVIDIA GPU")?;
    if args.json {
        printer.json(&report)?;
    } else {
        let mut table = comfy_table::Table::new();
        table.load_style(comfy_table::presets::UTF8_FULL_CONDENSED);
        table.set_header(["check", "result", "detail"]);
        for check in &report.checks {
            table.add_row([
                check.name.as_str(),
                if check.passed { "pass" } else { "FAIL" },
                check.detail.as_str(),
            ]);
        }
        let failed = report.checks.iter().filter(|c| !c.passed).count();
        printer.data(&format!(
            "{table}\n{} of {} checks passed{}",
            report.checks.len() - failed,
            report.checks.len(),
            if failed == 0 {
                String::new()
            } else {
                format!("; {failed} failed")
            }
        ));
    }
    Ok(if report.passed() {
        ExitStatus::Success
    } else {
        ExitStatus::No
    })
}
