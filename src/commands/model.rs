//! `infer model export-tokenizer`: a GGUF file's tokenizer written as a Hugging Face
//! tokenizer directory ([`crate::runtime::model::export`]); the paths written to stdout.

use std::path::{Path, PathBuf};

use anyhow::{Result, bail};

use crate::ExitStatus;
use crate::cli::{ExportTokenizerArgs, ModelCommand};
use crate::model::DEFAULT_ALIAS;
use crate::runtime::model::export::export_tokenizer;
use crate::ui::Printer;

/// Runs `infer model …`. Errors: as the subcommand's.
pub(crate) fn run(command: &ModelCommand, printer: &Printer) -> Result<ExitStatus> {
    match command {
        ModelCommand::ExportTokenizer(args) => export(args, printer),
    }
}

/// Runs `infer model export-tokenizer`. Errors: a MODEL that is not a GGUF file, files in
/// the way without `--force`, I/O.
fn export(args: &ExportTokenizerArgs, printer: &Printer) -> Result<ExitStatus> {
    let model = gguf_path(&args.model, printer)?;
    let written = export_tokenizer(&model, &args.dir, args.force)?;
    for path in &written {
        printer.data(&path.display().to_string());
    }
    printer.note(&format!(
        "wrote the tokenizer of `{}`; load it with `AutoTokenizer.from_pretrained(\"{}\")`",
        model.display(),
        args.dir.display()
    ));
    Ok(ExitStatus::Success)
}

/// The GGUF file MODEL names: a file, or [`DEFAULT_ALIAS`] for the embedded default
/// ([`crate::model::weights_path`], fetched on first use).
///
/// Errors: a directory (a Hugging Face directory has its tokenizer files already), a path
/// that does not exist.
fn gguf_path(model: &str, printer: &Printer) -> Result<PathBuf> {
    let path = Path::new(model);
    if path.is_dir() {
        bail!(
            "`{model}` is a directory; a Hugging Face model directory holds its tokenizer files already\nhint: pass that directory to `AutoTokenizer.from_pretrained` as it is, or pass a `.gguf` file here"
        );
    }
    if !path.exists() && model != DEFAULT_ALIAS {
        bail!(
            "`{model}` does not exist\nhint: pass a `.gguf` file, or `{DEFAULT_ALIAS}` for the embedded SmolLM2"
        );
    }
    crate::model::weights_path(Some(model), &mut |line| printer.note(line))
}
