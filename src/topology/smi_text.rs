//! Importer for `nvidia-smi topo -m` text as people paste it into issues and scripts.
//!
//! Copes with tabs or spaces, indented blocks, `> ` quote prefixes, markdown fences, shell
//! prompts, legends, `ulimit` lines and `collect-env` text around the matrix; the old
//! format whose NIC columns are named `mlx5_*` and the new `NIC<n>` columns mapped through
//! the `NIC Legend` (the NIC number is not the mlx5 number); unsorted NIC columns; blank
//! affinity cells; and a `nvidia-smi topo -p2p` matrix in the same paste. GPU names are
//! taken from `nvidia-smi -L` style lines (`GPU 0: NVIDIA H100 … (UUID: GPU-…)`) when present.
//!
//! It does no I/O: it takes the text and returns a [`Host`] or an error naming the line.

use std::collections::HashMap;

use anyhow::{Result, bail};

use super::{Gpu, Host, LinkCode, Nic, NicKind, P2pStatus, nvlink_domains};

/// Parses one host's `nvidia-smi topo -m` output (and an optional `-p2p` matrix).
///
/// `origin` names the input in errors (a path or `stdin`) and becomes the host name.
///
/// Errors (each names the 1-based line): no `GPU0` header line at all (not a topology), a
/// ragged row (too few or too many link cells), an unknown link code, a missing or
/// duplicated GPU row, a matrix that is not symmetric.
pub(crate) fn parse(text: &str, origin: &str) -> Result<Host> {
    let lines: Vec<&str> = text.lines().map(strip_quote_prefix).collect();
    let blocks = find_blocks(&lines, origin)?;
    let Some(matrix) = blocks.iter().find(|block| block.kind == BlockKind::Links) else {
        if blocks.is_empty() {
            bail!(
                "`{origin}` is not `nvidia-smi topo -m` output: no line starts with the `GPU0` column header\n\
                 hint: paste the output of `nvidia-smi topo -m`, or pass `infer topo --json` output"
            );
        }
        bail!(
            "`{origin}` holds only a `nvidia-smi topo -p2p` matrix; the link matrix of `nvidia-smi topo -m` is needed"
        );
    };
    let mut host = build_host(matrix, &lines, origin)?;
    if let Some(p2p) = blocks
        .iter()
        .find(|block| block.kind == BlockKind::P2p && block.n_gpus == host.gpus.len())
    {
        host.p2p = Some(p2p_matrix(p2p, origin)?);
    }
    for (gpu_idx, (name, uuid)) in gpu_names(&lines) {
        if let Some(gpu) = host.gpus.get_mut(gpu_idx) {
            gpu.name = Some(name);
            gpu.uuid = uuid;
        }
    }
    Ok(host)
}

/// Which of nvidia-smi's matrices a block is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum BlockKind {
    /// `nvidia-smi topo -m`: link codes.
    Links,
    /// `nvidia-smi topo -p2p <r|w|rw|n|a|p>`: P2P status codes.
    P2p,
}

/// A header line and the rows under it.
struct Block {
    kind: BlockKind,
    /// 0-based index of the header line.
    header_line: usize,
    /// Device columns in header order: `GPU0..GPU<n-1>` first, then NICs.
    devices: Vec<String>,
    n_gpus: usize,
    /// Affinity column names after the devices (`CPU Affinity`, `NUMA Affinity`, `GPU NUMA ID`).
    affinity_columns: Vec<String>,
    /// `(0-based line index, tokens)` of each row, label first.
    rows: Vec<(usize, Vec<String>)>,
}

/// Removes leading whitespace and markdown/e-mail quote markers (`> `, `>> `, `> > `).
fn strip_quote_prefix(line: &str) -> &str {
    let mut rest = line.trim_start();
    while let Some(after) = rest.strip_prefix('>') {
        rest = after.trim_start();
    }
    rest
}

fn is_code(token: &str) -> bool {
    token.parse::<LinkCode>().is_ok() || token.parse::<P2pStatus>().is_ok()
}

/// Splits the lines into matrix blocks: a header whose first token is `GPU0` (and whose
/// second is not a code, which would make it a row), then every following line whose first
/// token is one of the header's device columns.
fn find_blocks(lines: &[&str], origin: &str) -> Result<Vec<Block>> {
    let mut blocks = Vec::new();
    let mut line_idx = 0;
    while line_idx < lines.len() {
        let tokens: Vec<&str> = lines[line_idx].split_whitespace().collect();
        let is_header =
            tokens.first() == Some(&"GPU0") && tokens.get(1).is_none_or(|t| !is_code(t));
        if !is_header {
            line_idx += 1;
            continue;
        }
        let (devices, affinity_columns) = split_header(&tokens);
        let n_gpus = devices
            .iter()
            .take_while(|d| gpu_column_index(d).is_some())
            .count();
        for (position, device) in devices.iter().enumerate().take(n_gpus) {
            if gpu_column_index(device) != Some(position) {
                bail!(
                    "`{origin}` line {}: GPU column `{device}` is out of order; expected `GPU{position}`",
                    line_idx + 1
                );
            }
        }
        let mut rows = Vec::new();
        let mut row_idx = line_idx + 1;
        while let Some(line) = lines.get(row_idx) {
            let row: Vec<String> = line.split_whitespace().map(str::to_string).collect();
            match row.first() {
                Some(label) if devices.contains(label) => rows.push((row_idx, row)),
                _ => break,
            }
            row_idx += 1;
        }
        let kind = classify(&rows, devices.len());
        blocks.push(Block {
            kind,
            header_line: line_idx,
            devices,
            n_gpus,
            affinity_columns,
            rows,
        });
        line_idx = row_idx;
    }
    Ok(blocks)
}

/// A block is a P2P matrix when the cells of its first row are P2P codes but not link codes.
fn classify(rows: &[(usize, Vec<String>)], n_devices: usize) -> BlockKind {
    let Some((_, first)) = rows.first() else {
        return BlockKind::Links;
    };
    let cells = first.iter().skip(1).take(n_devices);
    let p2p_only = cells
        .filter(|cell| *cell != "X")
        .any(|cell| cell.parse::<P2pStatus>().is_ok() && cell.parse::<LinkCode>().is_err());
    if p2p_only {
        BlockKind::P2p
    } else {
        BlockKind::Links
    }
}

/// Splits header tokens into device columns and (multi-word) affinity column names.
fn split_header(tokens: &[&str]) -> (Vec<String>, Vec<String>) {
    const AFFINITY: [&[&str]; 3] = [
        &["CPU", "Affinity"],
        &["NUMA", "Affinity"],
        &["GPU", "NUMA", "ID"],
    ];
    let mut devices = Vec::new();
    let mut affinity = Vec::new();
    let mut position = 0;
    while position < tokens.len() {
        let rest = &tokens[position..];
        if let Some(words) = AFFINITY.iter().find(|words| rest.starts_with(words)) {
            affinity.push(words.join(" "));
            position += words.len();
        } else if affinity.is_empty() {
            devices.push(rest[0].to_string());
            position += 1;
        } else {
            // An affinity column this importer does not know: keep it so cells line up.
            affinity.push(rest[0].to_string());
            position += 1;
        }
    }
    (devices, affinity)
}

/// `GPU<n>` → `n`.
fn gpu_column_index(name: &str) -> Option<usize> {
    name.strip_prefix("GPU")?.parse().ok()
}

/// Shape of a value that belongs in an affinity column.
fn is_affinity_value(column: &str, value: &str) -> bool {
    if value == "N/A" {
        return true;
    }
    if column == "CPU Affinity" {
        is_cpu_list(value)
    } else {
        value.parse::<u32>().is_ok()
    }
}

/// `0-47,96-143` and the like.
fn is_cpu_list(value: &str) -> bool {
    value.split(',').all(|range| {
        let mut ends = range.splitn(2, '-');
        ends.all(|end| !end.is_empty() && end.bytes().all(|b| b.is_ascii_digit()))
    })
}

/// Each device row's (1-based line number, link cells), by row label.
type DeviceRows<'a> = HashMap<&'a str, (usize, Vec<LinkCode>)>;

/// The host a `Links` block describes: its GPUs (with their affinity), the GPU link matrix,
/// NVLink domains and the NIC columns. Errors: a row twice, a ragged row, a GPU without a
/// row, an `X` off the diagonal or an asymmetric matrix.
fn build_host(block: &Block, lines: &[&str], origin: &str) -> Result<Host> {
    let (device_rows, affinity_by_gpu) = read_rows(block, origin)?;
    let gpu_links = gpu_link_matrix(block, &device_rows, origin)?;
    let (nics, notes) = nics_from_columns(block, lines, &device_rows);
    let gpus = gpus_with_affinity(affinity_by_gpu);
    let nvlink_domains = nvlink_domains(&gpu_links);
    Ok(Host {
        hostname: origin.to_string(),
        source: "nvidia-smi topo -m".to_string(),
        driver_version: None,
        cuda_driver_version: None,
        gpus,
        gpu_links,
        p2p: None,
        nvlink_domains,
        nics,
        notes,
    })
}

/// The block's rows: each device row's link cells, and each GPU's affinity columns by
/// name. Errors: a row label twice, a row whose cells do not parse or do not line up with
/// the header.
fn read_rows<'a>(
    block: &'a Block,
    origin: &str,
) -> Result<(DeviceRows<'a>, Vec<HashMap<String, String>>)> {
    let n_devices = block.devices.len();
    let n_gpus = block.n_gpus;
    let mut device_rows: DeviceRows<'a> = HashMap::new();
    let mut affinity_by_gpu: Vec<HashMap<String, String>> = vec![HashMap::new(); n_gpus];
    for (line_idx, tokens) in &block.rows {
        let line_no = line_idx + 1;
        let label = tokens[0].as_str();
        let cells = parse_link_cells(tokens, &block.devices, line_no, origin)?;
        if let Some((earlier, _)) = device_rows.insert(label, (line_no, cells)) {
            bail!(
                "`{origin}` line {line_no}: row `{label}` appears twice (first on line {earlier})"
            );
        }
        let extra = &tokens[1 + n_devices..];
        match gpu_column_index(label).filter(|&i| i < n_gpus) {
            Some(gpu_idx) => {
                affinity_by_gpu[gpu_idx] = assign_affinity(extra, &block.affinity_columns)
                    .ok_or_else(|| {
                        ragged(
                            origin,
                            line_no,
                            label,
                            n_devices + extra.len(),
                            &block.devices,
                        )
                    })?;
            }
            None if !extra.is_empty() => {
                return Err(ragged(
                    origin,
                    line_no,
                    label,
                    n_devices + extra.len(),
                    &block.devices,
                ));
            }
            None => {}
        }
    }

    Ok((device_rows, affinity_by_gpu))
}

/// The GPU × GPU link matrix from the GPU rows. Errors: a GPU the header names without a
/// row, `X` off the diagonal (or missing on it), an asymmetric pair.
fn gpu_link_matrix(
    block: &Block,
    device_rows: &DeviceRows<'_>,
    origin: &str,
) -> Result<Vec<Vec<LinkCode>>> {
    let n_gpus = block.n_gpus;
    let mut gpu_links = Vec::with_capacity(n_gpus);
    for gpu_idx in 0..n_gpus {
        let label = format!("GPU{gpu_idx}");
        let Some((_, cells)) = device_rows.get(label.as_str()) else {
            bail!(
                "`{origin}` line {}: the header names {n_gpus} GPUs but there is no row for `{label}`",
                block.header_line + 1
            );
        };
        gpu_links.push(cells[..n_gpus].to_vec());
    }
    for (i, row) in gpu_links.iter().enumerate() {
        let line_no = device_rows[format!("GPU{i}").as_str()].0;
        for (j, &code) in row.iter().enumerate() {
            if (i == j) != (code == LinkCode::SelfLink) {
                bail!(
                    "`{origin}` line {line_no}: cell `GPU{j}` of row `GPU{i}` is `{code}`; `X` belongs exactly on the diagonal"
                );
            }
            let mirror = gpu_links[j][i];
            if code != mirror {
                bail!(
                    "`{origin}` line {line_no}: GPU{i}→GPU{j} is `{code}` but GPU{j}→GPU{i} is `{mirror}`; the matrix must be symmetric"
                );
            }
        }
    }

    Ok(gpu_links)
}

/// The NIC columns as NICs (named by the `NIC Legend` when it has them) with their links
/// to every GPU, and a note naming NIC columns the legend lacks.
fn nics_from_columns(
    block: &Block,
    lines: &[&str],
    device_rows: &DeviceRows<'_>,
) -> (Vec<Nic>, Vec<String>) {
    let n_gpus = block.n_gpus;
    let legend = nic_legend(lines);
    let mut notes = Vec::new();
    let nic_columns = &block.devices[n_gpus..];
    let missing_legend: Vec<&str> = nic_columns
        .iter()
        .filter(|c| c.starts_with("NIC") && !legend.contains_key(c.as_str()))
        .map(String::as_str)
        .collect();
    if !missing_legend.is_empty() {
        notes.push(format!(
            "no `NIC Legend` entry for {}: real device names unknown",
            missing_legend.join(", ")
        ));
    }
    let nics = nic_columns
        .iter()
        .enumerate()
        .map(|(nic_idx, column)| Nic {
            name: legend
                .get(column.as_str())
                .cloned()
                .unwrap_or_else(|| column.clone()),
            kind: NicKind::Unknown,
            state: None,
            rate_gbps: None,
            netdev: None,
            is_virtual: false,
            mtu_bytes: None,
            mac: None,
            addresses: Vec::new(),
            pci_bus_id: None,
            numa_node: None,
            ports: Vec::new(),
            gpu_links: (0..n_gpus)
                .map(|g| device_rows[format!("GPU{g}").as_str()].1[n_gpus + nic_idx])
                .collect(),
        })
        .collect();

    (nics, notes)
}

/// One GPU per row with its NUMA node and CPU affinity (`N/A`: none), nothing else known.
fn gpus_with_affinity(affinity_by_gpu: Vec<HashMap<String, String>>) -> Vec<Gpu> {
    affinity_by_gpu
        .into_iter()
        .enumerate()
        .map(|(index, affinity)| Gpu {
            index,
            name: None,
            uuid: None,
            memory_bytes: None,
            pci_bus_id: None,
            numa_node: affinity.get("NUMA Affinity").and_then(|v| v.parse().ok()),
            cpu_affinity: affinity
                .get("CPU Affinity")
                .filter(|v| *v != "N/A")
                .cloned(),
            nvlinks_active: None,
            nvlinks_inactive: None,
        })
        .collect()
}

/// Parses the `n_devices` link cells after a row label.
fn parse_link_cells(
    tokens: &[String],
    devices: &[String],
    line_no: usize,
    origin: &str,
) -> Result<Vec<LinkCode>> {
    let label = &tokens[0];
    let mut cells = Vec::with_capacity(devices.len());
    for (column, device) in devices.iter().enumerate() {
        let Some(cell) = tokens.get(1 + column) else {
            return Err(ragged(origin, line_no, label, tokens.len() - 1, devices));
        };
        match cell.parse::<LinkCode>() {
            Ok(code) => cells.push(code),
            Err(_) if is_affinity_value("CPU Affinity", cell) || cell == "N/A" => {
                return Err(ragged(origin, line_no, label, column, devices));
            }
            Err(_) => bail!(
                "`{origin}` line {line_no}: cell `{device}` of row `{label}` is `{cell}`, not an nvidia-smi link code \
                 (X, NV<n>, PIX, PXB, PHB, NODE, SYS)"
            ),
        }
    }
    Ok(cells)
}

fn ragged(
    origin: &str,
    line_no: usize,
    label: &str,
    n_cells: usize,
    devices: &[String],
) -> anyhow::Error {
    anyhow::anyhow!(
        "`{origin}` line {line_no}: row `{label}` has {n_cells} link cells, expected {} (one per column {}..{}): the matrix is ragged",
        devices.len(),
        devices[0],
        devices[devices.len() - 1]
    )
}

/// Assigns a GPU row's trailing cells to the affinity columns. Blank cells vanish when a
/// paste is split on whitespace; the cell that is blank in practice is `CPU Affinity` (VMs
/// without affinity information), so with fewer values than columns the values are first
/// tried right-aligned, then shifted left, each value having to fit its column's shape.
/// `None` when no placement fits (a ragged row).
fn assign_affinity(values: &[String], columns: &[String]) -> Option<HashMap<String, String>> {
    fn place(
        values: &[String],
        columns: &[String],
        first_column: usize,
        chosen: &mut Vec<usize>,
    ) -> bool {
        let Some(value) = values.get(chosen.len()) else {
            return true;
        };
        let remaining = values.len() - chosen.len();
        if columns.len() < first_column + remaining {
            return false;
        }
        for column in (first_column..=columns.len() - remaining).rev() {
            if is_affinity_value(&columns[column], value) {
                chosen.push(column);
                if place(values, columns, column + 1, chosen) {
                    return true;
                }
                chosen.pop();
            }
        }
        false
    }
    let mut chosen = Vec::new();
    if !place(values, columns, 0, &mut chosen) {
        return None;
    }
    Some(
        chosen
            .into_iter()
            .zip(values)
            .map(|(c, v)| (columns[c].clone(), v.clone()))
            .collect(),
    )
}

/// `NIC0: mlx5_1` lines of the `NIC Legend`, anywhere in the paste.
fn nic_legend(lines: &[&str]) -> HashMap<String, String> {
    let mut legend = HashMap::new();
    for line in lines {
        let Some((key, value)) = line.split_once(':') else {
            continue;
        };
        let key = key.trim();
        let value = value.trim();
        let is_nic = key
            .strip_prefix("NIC")
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
        if is_nic && !value.is_empty() && !value.contains(char::is_whitespace) {
            legend.insert(key.to_string(), value.to_string());
        }
    }
    legend
}

/// GPU names from `nvidia-smi -L` / `collect-env` style lines: `GPU 0: NAME (UUID: GPU-…)`
/// and `GPU 0,1,2,3: NAME`.
fn gpu_names(lines: &[&str]) -> Vec<(usize, (String, Option<String>))> {
    let mut names = Vec::new();
    for line in lines {
        let Some(rest) = line.strip_prefix("GPU ") else {
            continue;
        };
        let Some((indices, description)) = rest.split_once(':') else {
            continue;
        };
        let Some(indices) = indices
            .split(',')
            .map(|i| i.trim().parse::<usize>().ok())
            .collect::<Option<Vec<usize>>>()
        else {
            continue;
        };
        let description = description.trim();
        let (name, uuid) = match description.split_once("(UUID:") {
            Some((name, uuid)) => (
                name.trim(),
                Some(uuid.trim().trim_end_matches(')').trim().to_string()),
            ),
            None => (description, None),
        };
        if name.is_empty() {
            continue;
        }
        for index in indices {
            names.push((index, (name.to_string(), uuid.clone())));
        }
    }
    names
}

fn p2p_matrix(block: &Block, origin: &str) -> Result<Vec<Vec<P2pStatus>>> {
    let n_gpus = block.n_gpus;
    let mut matrix = vec![Vec::new(); n_gpus];
    for (line_idx, tokens) in &block.rows {
        let Some(gpu_idx) = gpu_column_index(&tokens[0]).filter(|&i| i < n_gpus) else {
            continue;
        };
        for column in 0..n_gpus {
            let cell = tokens.get(1 + column).ok_or_else(|| {
                anyhow::anyhow!(
                    "`{origin}` line {}: P2P row `{}` has fewer than {n_gpus} cells",
                    line_idx + 1,
                    tokens[0]
                )
            })?;
            let status = cell.parse::<P2pStatus>().map_err(|_| {
                anyhow::anyhow!(
                    "`{origin}` line {}: P2P cell `GPU{column}` of row `{}` is `{cell}`, not a P2P status (OK, CNS, GNS, TNS, NS, DR, U)",
                    line_idx + 1,
                    tokens[0]
                )
            })?;
            matrix[gpu_idx].push(status);
        }
    }
    if let Some(missing) = matrix.iter().position(Vec::is_empty) {
        bail!(
            "`{origin}` line {}: the P2P matrix has no row for `GPU{missing}`",
            block.header_line + 1
        );
    }
    Ok(matrix)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists() {
        assert!(is_cpu_list("0-47,96-143"));
        assert!(is_cpu_list("0"));
        assert!(is_cpu_list("0,2,4"));
        assert!(!is_cpu_list("0-"));
        assert!(!is_cpu_list("PIX"));
        assert!(!is_cpu_list(""));
    }

    #[test]
    fn affinity_values_fill_columns_by_shape() {
        let columns: Vec<String> = ["CPU Affinity", "NUMA Affinity", "GPU NUMA ID"]
            .map(String::from)
            .to_vec();
        let values: Vec<String> = ["0-63", "0", "N/A"].map(String::from).to_vec();
        let assigned = assign_affinity(&values, &columns).expect("fits");
        assert_eq!(assigned["CPU Affinity"], "0-63");
        assert_eq!(assigned["NUMA Affinity"], "0");
        // A blank CPU affinity cell: the NUMA node still lands in its column.
        let values: Vec<String> = ["1", "N/A"].map(String::from).to_vec();
        let assigned = assign_affinity(&values, &columns).expect("fits");
        assert_eq!(assigned.get("NUMA Affinity").map(String::as_str), Some("1"));
        assert_eq!(assigned.get("CPU Affinity"), None);
        // A link code where an affinity belongs does not fit.
        let values: Vec<String> = ["SYS"].map(String::from).to_vec();
        assert!(assign_affinity(&values, &columns).is_none());
    }

    #[test]
    fn quote_prefixes_are_stripped() {
        assert_eq!(strip_quote_prefix("> GPU0\tX"), "GPU0\tX");
        assert_eq!(strip_quote_prefix(">> > GPU0"), "GPU0");
        assert_eq!(strip_quote_prefix("   GPU0"), "GPU0");
    }

    #[test]
    fn gpu_name_lines() {
        let lines = [
            "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1234)",
            "GPU 1,2: NVIDIA H20",
            "GPU0 X NV18",
        ];
        let names = gpu_names(&lines);
        assert_eq!(
            names[0],
            (
                0,
                (
                    "NVIDIA H100 80GB HBM3".to_string(),
                    Some("GPU-1234".to_string())
                )
            )
        );
        assert_eq!(names[1].0, 1);
        assert_eq!(names[2], (2, ("NVIDIA H20".to_string(), None)));
        assert_eq!(names.len(), 3);
    }
}
