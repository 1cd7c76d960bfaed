//! Parser for `NCCL_DEBUG=INFO` output as people paste it: any prefix before the NCCL line
//! header (`> `, `[trainer3]:`, `[1,0]<stdout>:`), interleaved foreign lines, and the log
//! formats of NCCL 2.4 (`Ring 00 : 1[0] -> 2[0] via direct shared memory`) through 2.2x
//! (`Channel 00/0 : 0[0] -> 2[0] [receive] via NET/IB/3/GDRDMA`).
//!
//! It extracts facts, each with the line it came from; the checks in `checks/` judge them.

/// One line of evidence: where it was, the host that printed it, and the text.
#[derive(Clone, Debug, PartialEq)]
pub struct Evidence {
    /// 1-based line number in the log.
    pub line_no: usize,
    /// Host name from the `host:pid:tid [dev]` header; `None` for lines without one.
    pub host: Option<String>,
    /// The line, trimmed, without quote prefixes.
    pub text: String,
}

/// How one channel/ring connection moves data.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Transport {
    /// `P2P/IPC`, `P2P/CUMEM`, `P2P/direct pointer`…: GPU peer access (NVLink or PCIe).
    P2p(String),
    /// `SHM` or `direct shared memory`: through host memory.
    Shm,
    /// `NET/Socket`: TCP.
    Socket,
    /// `NET/IB` (InfiniBand or RoCE verbs); `gdr` when `GDRDMA` (GPUDirect RDMA).
    Ib { gdr: bool },
    /// A net plugin (`NET/IBext`, `NET/AWS Libfabric`, …), named.
    Plugin(String),
}

/// A channel or ring connection line.
#[derive(Clone, Debug, PartialEq)]
pub struct Connection {
    pub transport: Transport,
    pub evidence: Evidence,
}

/// Everything the checks need from one log.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NcclLog {
    /// How the log was named (a path).
    pub origin: String,
    /// `NCCL version 2.19.3+cuda12.3` → `2.19.3`, with its CUDA build `12.3`.
    pub version: Option<(String, Option<String>, Evidence)>,
    /// `cudaDriverVersion 12000` → 12000 (CUDA 12.0).
    pub cuda_driver_version: Option<(u32, Evidence)>,
    pub connections: Vec<Connection>,
    /// `NET/Socket : Using [0]eno3:10.0.0.1<0> …` and `Bootstrap : Using …`: interface names.
    pub socket_interfaces: Vec<(String, Evidence)>,
    /// `NET/IB : Using [0]mlx5_10:1/RoCE …`: HCA port names.
    pub ib_devices: Vec<(String, Evidence)>,
    /// `NET/IB : No device found.`
    pub ib_not_found: Option<Evidence>,
    /// A `NET/Socket : Using …` line: NCCL's socket transport initialised with interfaces.
    pub net_socket: Option<Evidence>,
    /// `Using network Socket|IB|…`.
    pub network: Option<(String, Evidence)>,
    /// `NCCL_X set by environment to V` / `NCCL_X set to V`.
    pub env: Vec<(String, String, Evidence)>,
    /// Lines that report failures: `NCCL WARN`, `ncclInternalError`, `Last error`, `failed`.
    pub failures: Vec<Evidence>,
    /// `Could not find real path of /sys/class/net/<if>/device`: a virtual interface.
    pub virtual_interfaces: Vec<(String, Evidence)>,
    /// `CUDA Dev 0[4]`: the rank sees one device whose NVML index is 4.
    pub single_visible_device: Option<Evidence>,
    /// Every other line mentioning verbs or IB plugins (`libibverbs`, `IBext`, `HPC-X`).
    pub ib_hints: Vec<Evidence>,
    /// Lines in the file.
    pub lines: usize,
    /// Lines NCCL wrote (`NCCL INFO`, `NCCL WARN`, `NCCL version`, an `nccl…Error` code).
    pub nccl_lines: usize,
}

impl NcclLog {
    /// Hosts seen in NCCL headers, sorted.
    pub fn hosts(&self) -> Vec<String> {
        let mut hosts: Vec<String> = self
            .connections
            .iter()
            .map(|c| &c.evidence)
            .chain(self.socket_interfaces.iter().map(|(_, e)| e))
            .chain(self.ib_devices.iter().map(|(_, e)| e))
            .filter_map(|e| e.host.clone())
            .collect();
        hosts.sort();
        hosts.dedup();
        hosts
    }
}

/// Parses `text`, named `origin`.
pub fn parse(text: &str, origin: &str) -> NcclLog {
    let mut log = NcclLog {
        origin: origin.to_string(),
        ..NcclLog::default()
    };
    for (index, raw) in text.lines().enumerate() {
        log.lines += 1;
        let line = strip_prefixes(raw);
        if line.is_empty() {
            continue;
        }
        if is_nccl_line(line) {
            log.nccl_lines += 1;
        }
        let (host, body) = split_header(line);
        let evidence = Evidence {
            line_no: index + 1,
            host,
            text: line.to_string(),
        };
        parse_body(&mut log, body, evidence);
    }
    log
}

/// Whether NCCL wrote `line`: its `INFO`/`WARN` header, its version banner, or one of its
/// result codes (`ncclInternalError`, `ncclSystemError`, …).
fn is_nccl_line(line: &str) -> bool {
    line.contains("NCCL INFO")
        || line.contains("NCCL WARN")
        || line.contains("NCCL version ")
        || line
            .split(|c: char| !c.is_ascii_alphanumeric())
            .any(|word| {
                word.len() > "nccl".len() + "Error".len()
                    && word.starts_with("nccl")
                    && word.ends_with("Error")
                    && word.as_bytes()[4].is_ascii_uppercase()
            })
}

/// Decodes a log's bytes: UTF-8, with any invalid byte replaced (`U+FFFD`) rather than the
/// whole file refused (logs interleave processes and sometimes binary noise).
pub fn decode(bytes: &[u8]) -> std::borrow::Cow<'_, str> {
    String::from_utf8_lossy(bytes)
}

/// Removes quote markers and launcher prefixes before the NCCL header.
fn strip_prefixes(line: &str) -> &str {
    let mut rest = line.trim();
    while let Some(after) = rest.strip_prefix('>') {
        rest = after.trim_start();
    }
    rest
}

/// Splits `host:pid:tid [dev] NCCL INFO body` into the host and the body after the level.
fn split_header(line: &str) -> (Option<String>, &str) {
    for marker in [" NCCL INFO ", " NCCL WARN "] {
        if let Some(position) = line.find(marker) {
            let header = &line[..position];
            // Launchers prefix `[name]:` or `[1,0]<stdout>:`; the host is the field before `:pid:tid`.
            let fields: Vec<&str> = header.split(':').collect();
            let host = if fields.len() >= 3 {
                let candidate = fields[fields.len() - 3];
                let candidate = candidate
                    .rsplit(['[', ']', ' ', '>'])
                    .next()
                    .unwrap_or(candidate);
                (!candidate.is_empty()).then(|| candidate.to_string())
            } else {
                None
            };
            let body_start = position + marker.len();
            let body = if marker.contains("WARN") {
                &line[position + 1..]
            } else {
                &line[body_start..]
            };
            return (host, body);
        }
    }
    (None, line)
}

/// Records what one line's body (after the level) says: versions, transports, settings,
/// hints and failures.
fn parse_body(log: &mut NcclLog, body: &str, evidence: Evidence) {
    if parse_versions(log, body, &evidence)
        || parse_transports(log, body, &evidence)
        || parse_settings(log, body, &evidence)
    {
        return;
    }
    parse_hints_and_failures(log, body, evidence);
}

/// `NCCL version` (the first only) and `cudaDriverVersion`. Returns whether the line was
/// one of them.
fn parse_versions(log: &mut NcclLog, body: &str, evidence: &Evidence) -> bool {
    if let Some(rest) = body.strip_prefix("NCCL version ") {
        let version = rest.split_whitespace().next().unwrap_or(rest);
        let (number, cuda) = match version.split_once("+cuda") {
            Some((number, cuda)) => (number.to_string(), Some(cuda.to_string())),
            None => (version.to_string(), None),
        };
        if log.version.is_none() {
            log.version = Some((number, cuda, evidence.clone()));
        }
        return true;
    }
    if let Some(rest) = body.strip_prefix("cudaDriverVersion ") {
        if let Ok(version) = rest.trim().parse() {
            log.cuda_driver_version
                .get_or_insert((version, evidence.clone()));
        }
        return true;
    }
    false
}

/// Connections (`… via …`), the IB devices NCCL uses or their absence, and the socket
/// and bootstrap interfaces. Returns whether the line was one of them.
fn parse_transports(log: &mut NcclLog, body: &str, evidence: &Evidence) -> bool {
    if let Some(position) = body.find(" via ")
        && (body.starts_with("Channel ") || body.starts_with("Ring ") || body.contains("->"))
    {
        let via = body[position + 5..].trim();
        log.connections.push(Connection {
            transport: transport(via),
            evidence: evidence.clone(),
        });
        return true;
    }
    if let Some(rest) = body
        .strip_prefix("NET/IB : Using ")
        .or_else(|| body.strip_prefix("NET/IB: Using "))
    {
        for device in bracketed_items(rest.split(';').next().unwrap_or(rest)) {
            log.ib_devices.push((device, evidence.clone()));
        }
        return true;
    }
    if body.starts_with("NET/IB : No device found") || body.starts_with("NET/IB: No device found") {
        log.ib_not_found = Some(evidence.clone());
        return true;
    }
    for prefix in [
        "NET/Socket : Using ",
        "NET/Socket: Using ",
        "Bootstrap : Using ",
        "Bootstrap: Using ",
    ] {
        if let Some(rest) = body.strip_prefix(prefix) {
            if prefix.starts_with("NET/Socket") && log.net_socket.is_none() {
                log.net_socket = Some(evidence.clone());
            }
            for item in bracketed_items(rest)
                .into_iter()
                .chain(plain_interface(rest))
            {
                let name = item.split(':').next().unwrap_or(&item).to_string();
                if !log.socket_interfaces.iter().any(|(n, _)| *n == name) {
                    log.socket_interfaces.push((name, evidence.clone()));
                }
            }
            return true;
        }
    }
    false
}

/// `Using network`, `NCCL_*` settings, virtual interfaces (no real sysfs path) and a rank
/// that sees a single GPU (`CUDA Dev 0[n]`). Returns whether the line was one of them.
fn parse_settings(log: &mut NcclLog, body: &str, evidence: &Evidence) -> bool {
    if let Some(rest) = body.strip_prefix("Using network ") {
        log.network = Some((rest.trim().to_string(), evidence.clone()));
        return true;
    }
    if let Some(rest) = body
        .strip_prefix("NCCL_")
        .filter(|_| body.contains(" set "))
    {
        let (name, value) = match rest
            .split_once(" set by environment to ")
            .or_else(|| rest.split_once(" set to "))
        {
            Some((name, value)) => (name, value.trim().trim_end_matches('.')),
            None => return true,
        };
        let name = format!("NCCL_{name}");
        if !log.env.iter().any(|(n, v, _)| *n == name && v == value) {
            log.env.push((name, value.to_string(), evidence.clone()));
        }
        return true;
    }
    if let Some(rest) = body.strip_prefix("Could not find real path of /sys/class/net/") {
        let interface = rest.split('/').next().unwrap_or(rest).to_string();
        if !log.virtual_interfaces.iter().any(|(n, _)| *n == interface) {
            log.virtual_interfaces.push((interface, evidence.clone()));
        }
        return true;
    }
    if body.starts_with("CUDA Dev ") && log.single_visible_device.is_none() {
        // `CUDA Dev 0[4]`: CUDA device 0 is NVML device 4, so this rank sees a single GPU.
        let spec = body.trim_start_matches("CUDA Dev ");
        if spec.starts_with("0[") && !spec.starts_with("0[0]") {
            log.single_visible_device = Some(evidence.clone());
        }
        return true;
    }
    false
}

/// Any other line: a hint that InfiniBand libraries are involved, and a failure (NCCL
/// errors, refused connections, `failed`, but not the missing net plugin).
fn parse_hints_and_failures(log: &mut NcclLog, body: &str, evidence: Evidence) {
    let lower = body.to_ascii_lowercase();
    if lower.contains("libibverbs")
        || lower.contains("ibext")
        || lower.contains("hpc-x")
        || lower.contains("hpcx")
    {
        log.ib_hints.push(evidence.clone());
    }
    let is_failure = body.starts_with("NCCL WARN")
        || lower.contains("ncclinternalerror")
        || lower.contains("ncclsystemerror")
        || lower.contains("ncclremoteerror")
        || lower.contains("ncclinvalidusage")
        || lower.starts_with("last error")
        || lower.contains("connection refused")
        || lower.contains("failed")
        || lower.contains("neither af_inet");
    if is_failure && !lower.contains("failed to find ncclnetplugin") {
        log.failures.push(evidence);
    }
}

/// `via` text → transport.
fn transport(via: &str) -> Transport {
    let via = via.trim();
    if via.starts_with("P2P") {
        Transport::P2p(via.to_string())
    } else if via.starts_with("SHM") || via.contains("shared memory") {
        Transport::Shm
    } else if via.starts_with("NET/Socket") {
        Transport::Socket
    } else if via.starts_with("NET/IB/") || via == "NET/IB" {
        Transport::Ib {
            gdr: via.contains("GDRDMA"),
        }
    } else if let Some(name) = via.strip_prefix("NET/") {
        Transport::Plugin(name.split('/').next().unwrap_or(name).to_string())
    } else {
        Transport::Plugin(via.to_string())
    }
}

/// `[0]eno3:10.0.0.1<0> [1]lxcbr0:…` → `["eno3:10.0.0.1<0>", "lxcbr0:…"]`.
fn bracketed_items(text: &str) -> Vec<String> {
    text.split('[')
        .skip(1)
        .filter_map(|part| {
            part.split_once(']')
                .map(|(_, item)| item.split_whitespace().next().unwrap_or("").to_string())
        })
        .filter(|item| !item.is_empty())
        .collect()
}

/// `Bootstrap : Using eno3:10.0.0.1<0>` (no brackets) → `["eno3:10.0.0.1<0>"]`.
fn plain_interface(text: &str) -> Option<String> {
    let first = text.split_whitespace().next()?;
    (!first.starts_with('[')).then(|| first.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_give_hosts_behind_any_prefix() {
        let (host, body) = split_header(
            "[trainer3]:twshared1016:1958:1958 [3] NCCL INFO NCCL_SOCKET_IFNAME set to eth2",
        );
        assert_eq!(host.as_deref(), Some("twshared1016"));
        assert_eq!(body, "NCCL_SOCKET_IFNAME set to eth2");
        let (host, _) = split_header("dgxh100-4:460770:460842 [0] NCCL INFO Using network IB");
        assert_eq!(host.as_deref(), Some("dgxh100-4"));
        let (host, body) =
            split_header("node1:12:34 [0] NCCL WARN Call to connect returned Connection refused");
        assert_eq!(host.as_deref(), Some("node1"));
        assert!(body.starts_with("NCCL WARN"));
    }

    #[test]
    fn transports_of_every_format() {
        assert_eq!(
            transport("P2P/IPC/read"),
            Transport::P2p("P2P/IPC/read".into())
        );
        assert_eq!(transport("P2P/CUMEM"), Transport::P2p("P2P/CUMEM".into()));
        assert_eq!(transport("direct shared memory"), Transport::Shm);
        assert_eq!(transport("SHM/direct/direct"), Transport::Shm);
        assert_eq!(transport("NET/Socket/3"), Transport::Socket);
        assert_eq!(transport("NET/IB/3/GDRDMA"), Transport::Ib { gdr: true });
        assert_eq!(transport("NET/IB/0"), Transport::Ib { gdr: false });
        assert_eq!(
            transport("NET/IBext/0/GDRDMA"),
            Transport::Plugin("IBext".into())
        );
    }

    #[test]
    fn nccl_2_26_formats() {
        // NCCL ≥ 2.26 prints the version behind the INFO header and `Bootstrap:` without a space.
        let log = parse(
            "gpu-a:4242:4242 [0] NCCL INFO NCCL version 2.26.2+cuda12.8\n\
             gpu-a:4242:4242 [0] NCCL INFO Bootstrap: Using bond0:10.1.0.7<0>\n\
             gpu-a:4242:4300 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_3:1/IB [RO]; OOB bond0:10.1.0.7<0>\n\
             gpu-a:4242:4300 [0] NCCL INFO Channel 00/0 : 0[0] -> 8[0] [send] via NET/IBext_v9/0/GDRDMA\n",
            "a.log",
        );
        let (version, cuda, evidence) = log.version.expect("version parsed");
        assert_eq!(
            (version.as_str(), cuda.as_deref()),
            ("2.26.2", Some("12.8"))
        );
        assert_eq!(evidence.host.as_deref(), Some("gpu-a"));
        assert_eq!(log.socket_interfaces[0].0, "bond0");
        assert_eq!(
            log.ib_devices
                .iter()
                .map(|(d, _)| d.as_str())
                .collect::<Vec<_>>(),
            ["mlx5_0:1/IB", "mlx5_3:1/IB"]
        );
        assert_eq!(
            log.connections[0].transport,
            Transport::Plugin("IBext_v9".into())
        );
    }

    #[test]
    fn bracketed_interface_lists() {
        assert_eq!(
            bracketed_items(
                "[0]eno3:169.229.48.108<0> [1]lxcbr0:10.0.3.1<0> [2]tailscale0:100.72.221.35<0>"
            ),
            [
                "eno3:169.229.48.108<0>",
                "lxcbr0:10.0.3.1<0>",
                "tailscale0:100.72.221.35<0>"
            ]
        );
        assert_eq!(
            bracketed_items("[0]mlx5_10:1/RoCE [1]mlx5_11:1/RoCE [RO]"),
            ["mlx5_10:1/RoCE", "mlx5_11:1/RoCE"]
        );
    }
}
