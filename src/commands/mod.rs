//! One module per subcommand: each turns clap arguments into a call of a domain module and
//! hands the result to [`crate::ui::Printer`]. No domain logic lives here.

pub mod bench;
pub mod bench_serve;
pub mod doctor;
pub mod generate;
pub mod plan;
pub mod rank;
pub mod topo;
pub mod up;
