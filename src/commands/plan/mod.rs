//! `infer plan`: load the model spec and the cluster (the I/O edge), run the pure planner,
//! print the plan or the reason it is infeasible.

use anyhow::Result;

use crate::cli::PlanArgs;
use crate::plan::{Outcome, plan, render};
use crate::ui::Printer;
use crate::{ExitStatus, inventory, model, serving_engines};

mod settings;

pub(crate) use settings::settings;

/// Runs `infer plan`. Exit status `No` when no layout is feasible. Errors: bad flags, an
/// unreadable model or cluster.
pub(crate) fn run(args: &PlanArgs, printer: &Printer) -> Result<ExitStatus> {
    let settings = settings(&args.settings)?;
    // Every argument is checked before the default model is fetched (93 MB on first use).
    let probed = match args.probe_hosts {
        true => crate::launch::survey::probe_inventory_cpus(
            &args.settings.cluster,
            crate::launch::ssh::SshOptions {
                accept_new: args.ssh_accept_new,
            },
        )?,
        false => Vec::new(),
    };
    let cluster = inventory::load_calibrated(
        &args.settings.cluster,
        &args.sysfs_root,
        &probed,
        &args.calibration,
    )?;
    let spec = model::spec(args.model.as_deref(), &mut |line| printer.note(line))?;
    match plan(&spec, &cluster, &settings) {
        Outcome::Feasible(plan) => {
            let launch = engine_launch(args, &plan, &spec, &cluster)?;
            print_plan(args, &plan, launch.as_ref(), printer)?;
            emit_launch(args, launch.as_ref(), printer)?;
            Ok(ExitStatus::Success)
        }
        Outcome::Infeasible(infeasible) => {
            if args.json {
                printer.json(&infeasible)?;
            } else {
                printer.data(&render::render_infeasible(&infeasible, args.explain));
            }
            Ok(ExitStatus::No)
        }
    }
}

/// The engine's launch for a feasible plan with `--engine` (or `--emit`), `None` without
/// either. Errors: `--disaggregate` when no disaggregated deployment fits, or a launch the
/// engine cannot express.
fn engine_launch(
    args: &PlanArgs,
    plan: &crate::plan::Plan,
    spec: &crate::plan::model::ModelSpec,
    cluster: &crate::plan::cluster::Cluster,
) -> Result<Option<serving_engines::EngineLaunch>> {
    // `--emit` alone writes infer's own engine's scripts.
    let engine = args
        .engine
        .or(args.emit.as_ref().map(|_| crate::cli::EngineArg::Infer));
    Ok(match engine {
        Some(engine) => {
            // infer's ranks load the GGUF file `--model` named, when it named one.
            let engine: serving_engines::EngineKind = engine.into();
            let model = args
                .engine_model
                .as_deref()
                .or(args.model.as_deref().filter(|m| {
                    engine == serving_engines::EngineKind::Infer && m.ends_with(".gguf")
                }));
            Some(serving_engines::launch_for_plan(
                &serving_engines::PlanLaunch {
                    engine,
                    plan,
                    spec,
                    cluster,
                    model,
                    disaggregate: args.settings.disaggregate,
                },
                (args.engine_port, args.dist_port),
            )?)
        }
        None => None,
    })
}

/// Prints a feasible plan: JSON (with the launch under `launch`), or the rendered plan with
/// the engine's lines in place of the one-line vLLM equivalent. Errors: JSON that does not
/// serialize or print.
fn print_plan(
    args: &PlanArgs,
    plan: &crate::plan::Plan,
    launch: Option<&serving_engines::EngineLaunch>,
    printer: &Printer,
) -> Result<()> {
    if args.json {
        let mut value = serde_json::to_value(plan)?;
        if let (Some(launch), Some(object)) = (launch, value.as_object_mut()) {
            object.insert("launch".into(), serde_json::to_value(launch)?);
        }
        printer.json(&value)?;
    } else {
        let mut text = render::render(plan, args.explain);
        if let Some(launch) = launch {
            // The engine's own lines replace the one-line vLLM equivalent.
            if let Some(cut) = text.rfind("\n\nvllm equivalent:") {
                text.truncate(cut + 1);
            }
            text.push('\n');
            text.push_str(&serving_engines::render(launch));
        }
        printer.data(&text);
    }
    Ok(())
}

/// With `--emit DIR`: writes the launch's run scripts and `launch.json` into `DIR`.
/// Errors: a file that cannot be written.
fn emit_launch(
    args: &PlanArgs,
    launch: Option<&serving_engines::EngineLaunch>,
    printer: &Printer,
) -> Result<()> {
    if let (Some(launch), Some(dir)) = (launch, &args.emit) {
        let written = crate::launch::serving_engines::emit(launch, dir)?;
        printer.note(&format!(
            "wrote {} run script{} and launch.json into {}",
            written.len(),
            if written.len() == 1 { "" } else { "s" },
            dir.display()
        ));
    }
    Ok(())
}
