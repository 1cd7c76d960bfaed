//! Human output of `infer topo`: the `nvidia-smi topo -m` style matrix with its legend, the
//! NVLink domains, a GPU table and a NIC table. Returns text; `ui` writes it.

use comfy_table::presets::{NOTHING, UTF8_FULL_CONDENSED};
use comfy_table::{ContentArrangement, Table};

use super::{Host, Nic, NicKind, Topology};

/// nvidia-smi's legend for the link codes, reworded.
const LEGEND: &str = "\
Legend:
  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node
  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)
  PIX  = Connection traversing at most a single PCIe bridge
  NV#  = Connection traversing a bonded set of # NVLinks";

/// Renders every host of `topology`.
pub(crate) fn render(topology: &Topology) -> String {
    topology
        .hosts
        .iter()
        .map(render_host)
        .collect::<Vec<_>>()
        .join("\n")
}

fn render_host(host: &Host) -> String {
    let mut out = String::new();
    let mut title = format!("host {} ({})", host.hostname, host.source);
    if let Some(driver) = &host.driver_version {
        title.push_str(&format!(", driver {driver}"));
    }
    if let Some(cuda) = &host.cuda_driver_version {
        title.push_str(&format!(", CUDA {cuda}"));
    }
    out.push_str(&title);
    out.push_str("\n\n");

    if host.gpus.is_empty() {
        out.push_str("no NVIDIA GPUs\n\n");
    } else {
        // NICs that have a PCIe position relative to the GPUs get a matrix column, as in nvidia-smi.
        let matrix_nics: Vec<&Nic> = host
            .nics
            .iter()
            .filter(|nic| !nic.gpu_links.is_empty())
            .collect();
        out.push_str(&matrix(host, &matrix_nics));
        out.push_str("\n\n");
        out.push_str(LEGEND);
        out.push('\n');
        if !matrix_nics.is_empty() {
            out.push_str("\nNIC Legend:\n");
            for (nic_idx, nic) in matrix_nics.iter().enumerate() {
                out.push_str(&format!("  NIC{nic_idx}: {}\n", nic.name));
            }
        }
        out.push('\n');
        out.push_str(&format!("NVLink domains: {}\n", domains_line(host)));
        if let Some(p2p) = &host.p2p {
            let blocked = (0..p2p.len())
                .flat_map(|i| (i + 1..p2p.len()).map(move |j| (i, j)))
                .filter(|&(i, j)| !p2p[i][j].is_ok())
                .count();
            let n_pairs = p2p.len() * p2p.len().saturating_sub(1) / 2;
            out.push_str(&format!(
                "P2P read/write: {} of {n_pairs} GPU pairs OK\n",
                n_pairs - blocked
            ));
        }
        out.push('\n');
        out.push_str(&gpu_table(host));
        out.push('\n');
    }

    if host.nics.is_empty() {
        out.push_str("no network interfaces\n");
    } else {
        out.push_str(&nic_table(host));
        out.push('\n');
    }
    for note in &host.notes {
        out.push_str(&format!("note: {note}\n"));
    }
    out
}

fn matrix(host: &Host, nics: &[&Nic]) -> String {
    let mut table = Table::new();
    table
        .load_style(NOTHING)
        .set_content_arrangement(ContentArrangement::Disabled);
    let mut header: Vec<String> = vec![String::new()];
    header.extend((0..host.gpus.len()).map(|i| format!("GPU{i}")));
    header.extend((0..nics.len()).map(|i| format!("NIC{i}")));
    header.extend(["CPU Affinity".to_string(), "NUMA Affinity".to_string()]);
    table.set_header(header);
    for (gpu_idx, gpu) in host.gpus.iter().enumerate() {
        let mut row = vec![format!("GPU{gpu_idx}")];
        row.extend(host.gpu_links[gpu_idx].iter().map(ToString::to_string));
        row.extend(nics.iter().map(|nic| nic.gpu_links[gpu_idx].to_string()));
        row.push(
            gpu.cpu_affinity
                .clone()
                .unwrap_or_else(|| "N/A".to_string()),
        );
        row.push(gpu.numa_node.map_or("N/A".to_string(), |n| n.to_string()));
        table.add_row(row);
    }
    table
        .to_string()
        .lines()
        .map(str::trim_end)
        .collect::<Vec<_>>()
        .join("\n")
}

/// `{0-3} {4-7}`, or a sentence when no two GPUs are NVLinked.
fn domains_line(host: &Host) -> String {
    if host.nvlink_domains.iter().all(|d| d.len() < 2) {
        return "none (no NVLink between any two GPUs; TP traffic crosses PCIe)".to_string();
    }
    let sets: Vec<String> = host
        .nvlink_domains
        .iter()
        .map(|d| format!("{{{}}}", gpu_set(d)))
        .collect();
    let largest = host.nvlink_domains.iter().map(Vec::len).max().unwrap_or(0);
    format!("{} (largest: {largest} GPUs)", sets.join(" "))
}

/// `[0,1,2,3]` → `0-3`; `[0,2]` → `0,2`.
pub(crate) fn gpu_set(gpus: &[usize]) -> String {
    let contiguous = gpus.windows(2).all(|w| w[1] == w[0] + 1);
    match gpus {
        [] => "-".to_string(),
        [one] => one.to_string(),
        [first, .., last] if contiguous => format!("{first}-{last}"),
        _ => gpus
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(","),
    }
}

fn gpu_table(host: &Host) -> String {
    let mut table = Table::new();
    table.load_style(UTF8_FULL_CONDENSED);
    table.set_header(["GPU", "name", "memory", "PCI bus id", "NUMA", "UUID"]);
    for gpu in &host.gpus {
        table.add_row([
            gpu.index.to_string(),
            gpu.name.clone().unwrap_or_else(|| "-".to_string()),
            gpu.memory_bytes.map_or("-".to_string(), |b| {
                format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64)
            }),
            gpu.pci_bus_id.clone().unwrap_or_else(|| "-".to_string()),
            gpu.numa_node.map_or("-".to_string(), |n| n.to_string()),
            gpu.uuid.clone().unwrap_or_else(|| "-".to_string()),
        ]);
    }
    table.to_string()
}

fn nic_table(host: &Host) -> String {
    let mut table = Table::new();
    table.load_style(UTF8_FULL_CONDENSED);
    table.set_header([
        "NIC",
        "kind",
        "state",
        "rate",
        "netdev",
        "addresses",
        "nearest GPUs",
        "virtual",
    ]);
    for nic in &host.nics {
        let nearest = host.nearest_gpus(nic);
        let nearest = match nearest.first() {
            Some(&first) => format!("{} ({})", gpu_set(&nearest), nic.gpu_links[first]),
            None => "-".to_string(),
        };
        table.add_row([
            nic.name.clone(),
            match nic.kind {
                NicKind::Ib => "ib",
                NicKind::Roce => "roce",
                NicKind::Eth => "eth",
                NicKind::Unknown => "?",
            }
            .to_string(),
            nic.state.clone().unwrap_or_else(|| "-".to_string()),
            nic.rate_gbps
                .map_or("-".to_string(), |r| format!("{r} Gb/s")),
            nic.netdev.clone().unwrap_or_else(|| "-".to_string()),
            if nic.addresses.is_empty() {
                "-".to_string()
            } else {
                nic.addresses.join(" ")
            },
            nearest,
            if nic.is_virtual { "yes" } else { "no" }.to_string(),
        ]);
    }
    table.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_sets_are_compact() {
        assert_eq!(gpu_set(&[0, 1, 2, 3]), "0-3");
        assert_eq!(gpu_set(&[0, 2]), "0,2");
        assert_eq!(gpu_set(&[5]), "5");
        assert_eq!(gpu_set(&[]), "-");
    }
}
