//! One module per subcommand: each turns clap arguments into a call of a domain module and
//! hands the result to [`crate::ui::Printer`]. No domain logic lives here.

pub mod agent;
pub mod bench;
pub mod bench_serve;
pub mod doctor;
pub mod generate;
pub mod plan;
pub mod rank;
pub mod topo;
pub mod up;

/// Rank processes load GGUF files only (for now). Errors: `path` is a directory.
fn require_gguf_for_ranks(path: &std::path::Path) -> anyhow::Result<()> {
    if path.is_dir() {
        anyhow::bail!(
            "--tp/--pp/--dp run GGUF models for now; `{}` is a directory",
            path.display()
        );
    }
    Ok(())
}
