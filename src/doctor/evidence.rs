//! What `infer doctor --cluster` learns about every host (gathered over SSH by
//! `launch::survey`, checked here without I/O): each host's agent hello (versions,
//! interfaces, topology, clock), its own live findings, the data interface chosen for it,
//! and the reachability matrix between the hosts' data addresses.

use serde::Serialize;

use crate::topology::Host;
use crate::topology::Interface;

use super::Finding;

/// Everything the cross-host checks look at.
#[derive(Clone, Debug)]
pub struct ClusterEvidence {
    /// The hosts that answered, in inventory order.
    pub hosts: Vec<HostEvidence>,
    /// Hosts that could not be reached: (name, stage, message).
    pub unreachable: Vec<(String, String, String)>,
    /// The data interface of each answering host (indexed like `hosts`), or why none could
    /// be chosen.
    pub data: Result<Vec<(String, String)>, String>,
    /// `matrix.cells[i][j]`: host `i` connecting to host `j`'s data address (`None` on the
    /// diagonal, or when no data interface could be chosen).
    pub matrix: Option<Matrix>,
    /// With `--bandwidth`: one TCP stream per pair of hosts over the data interfaces.
    pub bandwidth: Option<Vec<PairBandwidth>>,
    /// With `--bandwidth` and two hosts or more: one all-reduce over every answering host.
    pub allreduce: Option<AllreduceProbe>,
    /// With `--engine E`: that engine on every answering host.
    pub engine: Option<EngineEvidence>,
}

/// What `infer doctor --cluster --engine E` found of the engine on the hosts.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct EngineEvidence {
    /// `vllm`, `sglang` or `llamacpp`.
    pub engine: String,
    /// One per answering host, in inventory order (the first is the head).
    pub hosts: Vec<EngineHostEvidence>,
}

/// The engine on one host.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct EngineHostEvidence {
    pub host: String,
    /// The version it reports.
    pub version: Option<String>,
    /// torch and NCCL (vLLM, SGLang).
    pub torch: Option<String>,
    /// Why the engine is not usable there (with a `hint:` line).
    pub error: Option<String>,
    /// Ports the engine would take that are in use there: (port, what for, why).
    pub ports_taken: Vec<(u16, String, String)>,
}

/// An all-reduce with our own collectives over the hosts' data interfaces: one rank per
/// host (no model), one group, every power-of-two size up to [`ALLREDUCE_PROBE_BYTES`], as
/// nccl-tests' `all_reduce_perf -b 8 -e 64M -f 2` sweeps.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct AllreduceProbe {
    /// The hosts, in rank order (rank `i` on `hosts[i]`).
    pub hosts: Vec<String>,
    /// What carried it (TCP when the group spans hosts).
    pub transport: String,
    /// One row per message size.
    pub rows: Vec<crate::runtime::collectives::AllreduceRow>,
    /// The slowest data link of the group (sysfs `speed`), if any rate is known.
    pub slowest_link: Option<LinkRate>,
    /// Why it did not run or failed.
    pub error: Option<String>,
}

impl AllreduceProbe {
    /// The highest bus bandwidth of any size, bytes/s (`None`: no rows).
    pub fn peak_busbw_bytes_per_sec(&self) -> Option<f64> {
        self.rows
            .iter()
            .map(|r| r.busbw_bytes_per_sec(self.hosts.len()))
            .reduce(f64::max)
    }
}

/// One host's data link rate.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LinkRate {
    /// Inventory name of the host.
    pub host: String,
    /// Its data interface.
    pub interface: String,
    /// Link rate from sysfs `speed`, Gbit/s.
    pub gbps: f64,
}

/// The largest all-reduce of the probe (64 MiB, nccl-tests' usual `-e`).
pub(crate) const ALLREDUCE_PROBE_BYTES: usize = 64 << 20;

/// One pair's bandwidth probe: `from` streamed [`BANDWIDTH_PROBE_BYTES`] to `to`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PairBandwidth {
    /// The sending host.
    pub from: String,
    /// The receiving host.
    pub to: String,
    /// Measured, Gbit/s; `None` when the stream failed.
    pub gbps: Option<f64>,
    /// The slower of the two data NICs' link rates from sysfs, Gbit/s (`None`: unknown).
    pub expected_gbps: Option<f64>,
    /// Why the stream failed.
    pub error: Option<String>,
}

/// Bytes each bandwidth probe sends (64 MiB: long enough to leave slow start far behind on
/// links up to ~100 Gbit/s).
pub(crate) const BANDWIDTH_PROBE_BYTES: u64 = 64 << 20;

/// One host as its agent described it.
#[derive(Clone, Debug)]
pub struct HostEvidence {
    /// Inventory name.
    pub name: String,
    /// The `infer` version its agent reported.
    pub infer_version: String,
    /// sha256 of that `infer`, hex.
    pub infer_sha256: String,
    /// Where that `infer` is on the host.
    pub infer_path: String,
    /// The interface the inventory names for it (`nccl-socket-ifname`), if any.
    pub wanted_interface: Option<String>,
    /// The address SSH reached it at (its management network).
    pub ssh_address: String,
    /// The NCCL library its processes would load.
    pub nccl: Option<crate::topology::nccl::NcclLibrary>,
    /// Its interfaces with IPv4 addresses.
    pub interfaces: Vec<Interface>,
    /// Its probed topology.
    pub topology: Host,
    /// Its clock minus the launcher's, in milliseconds (corrected by half the round trip).
    pub clock_offset_ms: i64,
    /// Its own live checks (limits, `/dev/shm`, HCA ports, NVML…), as run there.
    pub live: Vec<Finding>,
}

/// The reachability matrix: rows connect to columns.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Matrix {
    /// Host names, rows and columns alike.
    pub hosts: Vec<String>,
    /// `cells[row][column]`; `None` on the diagonal.
    pub cells: Vec<Vec<Option<Cell>>>,
    /// Where a rendezvous store listened on the first host's data address.
    pub store: String,
    /// Each host connecting to that store's port (`None` for the first host).
    pub store_cells: Vec<Option<Cell>>,
}

/// One directed pair.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Cell {
    /// The address connected to (the column host's data address).
    pub to: String,
    /// The address the connection left from (the row host's data address).
    pub from: String,
    /// Round trip of one byte, microseconds; `None` when it failed.
    pub rtt_us: Option<u64>,
    /// The source address the peer saw; it must equal `from`.
    pub seen_as: Option<String>,
    /// Why it failed.
    pub error: Option<String>,
}

/// The matrix as a table: rows connect to columns; cells are the RTT in µs, `✗` with the
/// cause when the connection failed, `!src` when the peer saw another source address.
pub(crate) fn render_matrix(matrix: &Matrix) -> String {
    let mut table = comfy_table::Table::new();
    table.load_style(comfy_table::presets::NOTHING);
    let mut header = vec!["reachability (RTT µs)".to_string()];
    header.extend(matrix.hosts.iter().cloned());
    header.push(format!(
        "store@{}",
        matrix.hosts.first().map_or("?", |h| h.as_str())
    ));
    table.set_header(header);
    for (row, name) in matrix.hosts.iter().enumerate() {
        let mut cells = vec![name.clone()];
        let store = matrix
            .store_cells
            .get(row)
            .cloned()
            .flatten()
            .map(|cell| Cell {
                // A connection to the store is only connected, never asked for its source.
                seen_as: Some(cell.from.clone()),
                ..cell
            });
        for cell in matrix.cells[row].iter().chain([&store]) {
            cells.push(match cell {
                None => "-".to_string(),
                Some(Cell {
                    error: Some(error), ..
                }) => format!("✗ {}", short(error)),
                Some(cell) if cell.seen_as.as_deref() != Some(cell.from.as_str()) => {
                    format!("!src {}", cell.seen_as.as_deref().unwrap_or("?"))
                }
                Some(cell) => cell.rtt_us.map_or("?".into(), |us| us.to_string()),
            });
        }
        table.add_row(cells);
    }
    table
        .to_string()
        .lines()
        .map(|l| l.trim_end().to_string())
        .collect::<Vec<_>>()
        .join("\n")
}

/// The cause in a few words for a matrix cell.
fn short(error: &str) -> &str {
    for (needle, word) in [
        ("timed out", "timeout"),
        ("refused", "refused"),
        ("unreachable", "unreachable"),
        ("Cannot assign", "no address"),
    ] {
        if error.contains(needle) {
            return word;
        }
    }
    "failed"
}
