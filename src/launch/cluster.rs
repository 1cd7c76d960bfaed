//! Launching over the hosts of an inventory: SSH targets (inventory, then `~/.ssh/config`,
//! then OpenSSH's defaults), rank placement (TP groups inside a host, consecutive ranks per
//! host), the data network chosen from each host's own interfaces, the store on rank 0's
//! host at its data address, and the gang started through the agents.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, anyhow, bail};

use super::remote::{Preflight, RemoteCluster, RemoteHostSpec};
use super::ssh::{SshOptions, SshTarget, default_identity_files, default_known_hosts};
use super::ssh_config;
use super::{Gang, LaunchSpec, Placement, Progress, StoreLocation};
use crate::cluster::InventoryEntry;
use crate::runtime::exec::engine::Generation;
use crate::runtime::exec::rank_env::HostEnv;
use crate::runtime::exec::worker::Job;
use crate::topology::Interface;

/// How to reach and use the hosts of an inventory.
#[derive(Clone, Debug)]
pub struct ClusterOptions {
    /// The inventory (`hosts.toml`).
    pub inventory: PathBuf,
    /// Host-key policy.
    pub ssh: SshOptions,
    /// Copy the model to hosts that lack it (or have another file at its path).
    pub push_model: bool,
}

/// One host's choice of data network.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DataInterface {
    /// Interface name on that host.
    pub name: String,
    /// Its IPv4 address on the data network.
    pub address: Ipv4Addr,
}

/// Runs one generation with `spec`'s layout over the inventory's hosts and returns the
/// driver's result. `progress` hears host preflight lines, rank milestones and rank output.
///
/// Errors: preflight failures (every host named with its cause; nothing started), a layout
/// that does not fit the hosts, a rank or host that fails (the whole gang stopped).
pub fn run_generation(
    spec: &LaunchSpec,
    job: &Job,
    options: &ClusterOptions,
    progress: &mut dyn FnMut(Progress),
) -> Result<Generation> {
    let bytes = run_job(spec, job, options, progress)?;
    serde_json::from_slice(&bytes).context("the driver wrote a malformed result")
}

/// Runs a job that ends with a `result` (a generation, a benchmark) over the inventory's
/// hosts and returns the result's bytes.
///
/// Errors: as [`run_generation`].
pub fn run_job(
    spec: &LaunchSpec,
    job: &Job,
    options: &ClusterOptions,
    progress: &mut dyn FnMut(Progress),
) -> Result<Vec<u8>> {
    let mut run = start(spec, job, options, progress)?;
    progress(run.gang.started());
    let bytes = run
        .gang
        .wait_for("result", &|| false, progress)?
        .ok_or_else(|| anyhow!("the run was stopped"))?;
    run.gang.finish();
    Ok(bytes)
}

/// A gang started over the hosts of an inventory. Dropping it stops the gang, then the
/// agents, then closes the connections (fields drop in this order).
pub struct ClusterRun {
    /// The ranks.
    pub gang: Gang,
    /// The hosts' connections and agents.
    pub remote: RemoteCluster,
    /// Index (in the inventory) of rank 0's host.
    pub rank0_host: usize,
}

/// Connects, places and starts the gang.
///
/// Errors: as [`run_generation`].
pub fn start(
    spec: &LaunchSpec,
    job: &Job,
    options: &ClusterOptions,
    progress: &mut dyn FnMut(Progress),
) -> Result<ClusterRun> {
    spec.check_layout()?;
    let entries = crate::cluster::launch_inventory(&options.inventory)?;
    check_host_names(&entries, &options.inventory)?;
    let rank_hosts = place(&entries, spec.tp, spec.pp, spec.dp)?;
    let targets = ssh_targets(&entries)?;
    let remote = RemoteCluster::connect(
        &targets,
        &Preflight {
            ssh: options.ssh,
            // Random weights are generated on every host: no file to check or push.
            model: spec
                .model
                .as_ref()
                .and_then(|m| m.path().map(std::path::Path::to_path_buf)),
            push_model: options.push_model,
            same_build: true,
        },
        &mut |host, stage| {
            progress(Progress::Host {
                host: host.into(),
                stage: stage.into(),
            })
        },
    )?;
    let data = data_interfaces(&remote, &entries, &targets, progress)?;
    let placement = place_ranks(spec, &remote, &entries, &rank_hosts, &data);
    let token = crate::rendezvous::random_token();
    let store_host = rank_hosts[0];
    let (ranks_address, launcher_address) = remote.host_store(
        store_host,
        &format!("{}:0", data[store_host].address),
        &token,
    )?;
    let mut spec = spec.clone();
    if spec.gpus.is_some() {
        spec.gpus = Some(device_ranks_gpus(
            &remote,
            &entries,
            &rank_hosts,
            &placement,
        )?);
    }
    spec.placement = placement;
    let spawner = remote.spawner(rank_hosts);
    let mut gang = Gang::start_on(
        &spawner,
        &spec,
        job,
        StoreLocation::Remote {
            ranks: ranks_address,
            launcher: launcher_address,
        },
        &token,
    )?;
    gang.set_manifest_field("run_id", remote.run_id.clone().into());
    gang.set_manifest_field("hosts", manifest_hosts(&remote, &entries, &data).into());
    gang.write_manifest(&spec, None)?;
    Ok(ClusterRun {
        gang,
        remote,
        rank0_host: store_host,
    })
}

/// Checks that every host name of the inventory (`inventory`) can name a run directory.
///
/// Errors: the first name that cannot, with the characters allowed.
fn check_host_names(entries: &[InventoryEntry], inventory: &Path) -> Result<()> {
    if let Some(entry) = entries
        .iter()
        .find(|e| !super::protocol::valid_host_dir(&e.name))
    {
        bail!(
            "host name `{}` in `{}`: use letters, digits, `.`, `_` and `-` (it names the host's run directory)",
            entry.name,
            inventory.display()
        );
    }
    Ok(())
}

/// Each rank's placement on its host (`rank_hosts[rank]`): local rank, threads (the
/// host's CPUs over its ranks unless `spec` pins them), the host's data interface and its
/// active HCAs.
fn place_ranks(
    spec: &LaunchSpec,
    remote: &RemoteCluster,
    entries: &[InventoryEntry],
    rank_hosts: &[usize],
    data: &[DataInterface],
) -> Vec<Placement> {
    let mut placement = Vec::with_capacity(rank_hosts.len());
    for (rank, &host) in rank_hosts.iter().enumerate() {
        let on_host: Vec<usize> = (0..rank_hosts.len())
            .filter(|r| rank_hosts[*r] == host)
            .collect();
        let local_rank = on_host
            .iter()
            .position(|r| *r == rank)
            .expect("the rank is on its host");
        let threads = (remote.hosts[host].hello.n_cpus / on_host.len()).max(1);
        let interface = &data[host];
        // CPU ranks use no GPU: every active HCA of the host is as near as any.
        let hcas =
            crate::plan::env::nearest_active_hcas(&remote.hosts[host].hello.topology.nics, &[]);
        placement.push(Placement {
            host: entries[host].name.clone(),
            local_rank,
            local_world_size: on_host.len(),
            env: HostEnv {
                name: Some(entries[host].name.clone()),
                bind_addr: Some(interface.address.to_string()),
                socket_ifname: Some(interface.name.clone()),
                ib_hcas: hcas,
            },
            threads: Some(match spec.threads_per_rank {
                0 => threads,
                n => n,
            }),
        });
    }
    placement
}

/// The `hosts` field of the run's manifest: each host's name, addresses, data interface,
/// `infer` binary and run directory.
fn manifest_hosts(
    remote: &RemoteCluster,
    entries: &[InventoryEntry],
    data: &[DataInterface],
) -> Vec<serde_json::Value> {
    remote
        .hosts
        .iter()
        .zip(entries)
        .zip(data)
        .map(|((host, entry), interface)| {
            serde_json::json!({
                "name": host.name,
                "ssh_address": entry.address,
                "hostname": host.hello.hostname,
                "data_interface": interface.name,
                "data_address": interface.address.to_string(),
                "infer": host.hello.exe,
                "infer_sha256": host.hello.sha256,
                "remote_run_dir": format!("{}/{}/{}", host.hello.run_dir, remote.run_id, host.name),
            })
        })
        .collect()
}

/// `--device cuda` ranks on an inventory's hosts: each rank's `CUDA_VISIBLE_DEVICES` from its
/// local rank and the GPUs its host's agent found (NVML), before any rank starts.
///
/// Errors: a host of the gang without a GPU, named (unless `INFER_CUDA_HOST_HARNESS=1` runs
/// the kernels on the hosts' CPUs).
fn device_ranks_gpus(
    remote: &RemoteCluster,
    entries: &[InventoryEntry],
    rank_hosts: &[usize],
    placement: &[Placement],
) -> Result<Vec<String>> {
    let harness = std::env::var(crate::envvars::CUDA_HOST_HARNESS).is_ok_and(|v| v == "1");
    let mut gpus = Vec::with_capacity(rank_hosts.len());
    for (&host, place) in rank_hosts.iter().zip(placement) {
        let visible = remote.hosts[host].hello.topology.gpus.len();
        if visible == 0 && !harness {
            bail!(
                "--device cuda: host `{}` ({}) has no GPU that NVML can see, and {} of the ranks would run there; use --device cpu, or leave the host out of the inventory",
                entries[host].name,
                remote.hosts[host].hello.hostname,
                rank_hosts.iter().filter(|h| **h == host).count()
            );
        }
        gpus.extend(super::gpus_by_local_rank([place.local_rank], visible));
    }
    Ok(gpus)
}

/// What [`connect_to_probe`] returns: the inventory, its SSH targets, the hosts that
/// answered, and the failures of the others.
type ProbeConnection = (
    Vec<InventoryEntry>,
    Vec<RemoteHostSpec>,
    RemoteCluster,
    Vec<super::remote::PreflightFailure>,
);

/// The inventory's hosts connected for a probe (no model, any `infer` build a host has);
/// hosts that fail come back as failures, the others stay connected.
///
/// Errors: an unreadable inventory or `~/.ssh/config`, the SSH runtime cannot start.
fn connect_to_probe(
    inventory: &Path,
    ssh: SshOptions,
    progress: &mut dyn FnMut(Progress),
) -> Result<ProbeConnection> {
    let entries = crate::cluster::launch_inventory(inventory)?;
    let targets = ssh_targets(&entries)?;
    let (remote, failures) = RemoteCluster::connect_partial(
        &targets,
        &Preflight {
            ssh,
            model: None,
            push_model: false,
            same_build: false,
        },
        &mut |host, stage| {
            progress(Progress::Host {
                host: host.into(),
                stage: stage.into(),
            })
        },
    )?;
    Ok((entries, targets, remote, failures))
}

/// Each host's data interface (the inventory's `nccl-socket-ifname`, else the network every
/// host shares that is not the SSH one), checked up, and reported through `progress`.
///
/// Errors: no common network, an interface that is down.
pub fn data_interfaces(
    remote: &RemoteCluster,
    entries: &[InventoryEntry],
    targets: &[RemoteHostSpec],
    progress: &mut dyn FnMut(Progress),
) -> Result<Vec<DataInterface>> {
    // The SSH address is what the host was connected at (after `~/.ssh/config`'s HostName).
    let hellos: Vec<(&[Interface], Option<&str>, Option<&str>)> = remote
        .hosts
        .iter()
        .zip(entries)
        .zip(targets)
        .map(|((host, entry), target)| {
            (
                &host.hello.interfaces[..],
                entry.nccl_socket_ifname.as_deref(),
                Some(target.target.address.as_str()),
            )
        })
        .collect();
    let names: Vec<&str> = entries.iter().map(|e| e.name.as_str()).collect();
    let data = choose_data_interfaces(&names, &hellos)?;
    for ((host, entry), interface) in remote.hosts.iter().zip(entries).zip(&data) {
        if let Some(found) = host
            .hello
            .interfaces
            .iter()
            .find(|i| i.name == interface.name)
            && !found.up
        {
            bail!(
                "data interface `{}` ({}) is down on `{}`\nhint: `ip link set dev {} up` there, or check its cable and switch port",
                interface.name,
                interface.address,
                entry.name,
                interface.name
            );
        }
    }
    for (entry, interface) in entries.iter().zip(&data) {
        progress(Progress::Host {
            host: entry.name.clone(),
            stage: format!("data interface `{}` {}", interface.name, interface.address),
        });
    }
    Ok(data)
}

/// What `infer doctor --cluster` needs from every host, gathered in parallel over SSH: each
/// agent's hello, its own live findings, the data interface chosen for it, and the
/// reachability matrix between the data addresses (every host probes every other at once,
/// bound to its own data address; the listener reports the source it saw).
///
/// Errors: an unreadable inventory, the SSH runtime cannot start, a host that answered
/// preflight and then stopped answering.
pub fn survey(
    inventory: &Path,
    ssh: SshOptions,
    bandwidth: bool,
    engine: Option<(crate::engines::EngineKind, Option<&Path>)>,
    progress: &mut dyn FnMut(Progress),
) -> Result<crate::doctor::cluster::ClusterEvidence> {
    use crate::doctor::cluster::ClusterEvidence;
    let (entries, targets, mut remote, failures) = connect_to_probe(inventory, ssh, progress)?;
    let answering: Vec<usize> = remote
        .hosts
        .iter()
        .filter_map(|h| entries.iter().position(|e| e.name == h.name))
        .collect();
    let names: Vec<&str> = answering
        .iter()
        .map(|i| entries[*i].name.as_str())
        .collect();
    let data = survey_data_interfaces(&remote, &entries, &targets, &answering, &names);
    let hosts = host_evidence(&remote, &entries, &targets, &answering)?;
    let (matrix, pairs, allreduce) = match &data {
        Ok(data) if data.len() > 1 => {
            let probed = probe_network(&remote, &names, data, bandwidth, progress)?;
            (Some(probed.matrix), probed.bandwidth, probed.allreduce)
        }
        _ => (None, None, None),
    };
    let engine = engine.map(|(kind, engine_bin)| engine_survey(&remote, kind, engine_bin));
    remote.shutdown();
    Ok(ClusterEvidence {
        hosts,
        unreachable: failures
            .into_iter()
            .map(|f| (f.host, f.stage.to_string(), f.message))
            .collect(),
        data,
        matrix,
        bandwidth: pairs,
        allreduce,
        engine,
    })
}

/// The data interface (name, address) of each answering host (`answering`: their
/// positions in `entries`, named `names`), or why none could be chosen.
fn survey_data_interfaces(
    remote: &RemoteCluster,
    entries: &[InventoryEntry],
    targets: &[RemoteHostSpec],
    answering: &[usize],
    names: &[&str],
) -> std::result::Result<Vec<(String, String)>, String> {
    let hellos: Vec<(&[Interface], Option<&str>, Option<&str>)> = remote
        .hosts
        .iter()
        .zip(answering)
        .map(|(host, index)| {
            (
                &host.hello.interfaces[..],
                entries[*index].nccl_socket_ifname.as_deref(),
                Some(targets[*index].target.address.as_str()),
            )
        })
        .collect();
    if names.is_empty() {
        Err("no host answered".into())
    } else {
        choose_data_interfaces(names, &hellos)
            .map(|chosen| {
                chosen
                    .into_iter()
                    .map(|d| (d.name, d.address.to_string()))
                    .collect()
            })
            .map_err(|error| format!("{error:#}"))
    }
}

/// Each answering host's evidence: its agent's hello and its live doctor findings.
///
/// Errors: a host that stopped answering.
fn host_evidence(
    remote: &RemoteCluster,
    entries: &[InventoryEntry],
    targets: &[RemoteHostSpec],
    answering: &[usize],
) -> Result<Vec<crate::doctor::cluster::HostEvidence>> {
    let mut hosts = Vec::new();
    for (position, host) in remote.hosts.iter().enumerate() {
        let live = remote
            .doctor_findings(position)?
            .into_iter()
            .map(|finding| finding.into_finding(&host.name))
            .collect();
        hosts.push(crate::doctor::cluster::HostEvidence {
            name: host.name.clone(),
            infer_version: host.hello.version.clone(),
            infer_sha256: host.hello.sha256.clone(),
            infer_path: host.hello.exe.clone(),
            wanted_interface: entries[answering[position]].nccl_socket_ifname.clone(),
            ssh_address: targets[answering[position]].target.address.clone(),
            nccl: host.hello.nccl.clone(),
            interfaces: host.hello.interfaces.clone(),
            topology: host.hello.topology.clone(),
            clock_offset_ms: host.clock_offset_ms,
            live,
        });
    }
    Ok(hosts)
}

/// What [`probe_network`] measured between the hosts' data addresses.
struct NetworkProbes {
    matrix: crate::doctor::cluster::Matrix,
    /// With `--bandwidth`: each pair's stream.
    bandwidth: Option<Vec<crate::doctor::cluster::PairBandwidth>>,
    /// With `--bandwidth`: one all-reduce over every host.
    allreduce: Option<crate::doctor::cluster::AllreduceProbe>,
}

/// The probes between the hosts' data addresses (`data[i]`: interface, address of host
/// `names[i]`; two hosts or more): a listener on each, the bandwidth of each pair (with
/// `bandwidth`), every host reaching every other, every other host reaching a rendezvous
/// store on the first, and (with `bandwidth`) an all-reduce.
///
/// Errors: a host that stopped answering.
fn probe_network(
    remote: &RemoteCluster,
    names: &[&str],
    data: &[(String, String)],
    bandwidth: bool,
    progress: &mut dyn FnMut(Progress),
) -> Result<NetworkProbes> {
    let mut listeners = Vec::new();
    for (position, (_, address)) in data.iter().enumerate() {
        listeners.push(remote.listen(position, &format!("{address}:0"))?);
    }
    let pairs = if bandwidth {
        Some(measure_bandwidth(remote, names, data, &listeners)?)
    } else {
        None
    };
    let probes: Vec<(usize, String, Vec<String>)> = data
        .iter()
        .enumerate()
        .map(|(position, (_, address))| {
            let others = listeners
                .iter()
                .enumerate()
                .filter(|(other, _)| *other != position)
                .map(|(_, l)| l.clone())
                .collect();
            (position, address.clone(), others)
        })
        .collect();
    let results = remote.reach_all(&probes)?;
    // The rendezvous store's own port on the first host (rank 0's), as ranks reach it.
    let token = crate::rendezvous::random_token();
    let (store, store_here) = remote.host_store(0, &format!("{}:0", data[0].1), &token)?;
    let mut store_cells = vec![None];
    for (position, (_, address)) in data.iter().enumerate().skip(1) {
        let result = remote.connect_only(position, address, &store.to_string())?;
        store_cells.push(Some(crate::doctor::cluster::Cell {
            to: result.to,
            from: result.from,
            rtt_us: result.rtt_us,
            seen_as: None,
            error: result.error,
        }));
    }
    let allreduce = bandwidth
        .then(|| allreduce_evidence(remote, names, data, (store, store_here), &token, progress));
    Ok(NetworkProbes {
        matrix: crate::doctor::cluster::Matrix {
            hosts: names.iter().map(|n| n.to_string()).collect(),
            cells: matrix_cells(results, data.len()),
            store: store.to_string(),
            store_cells,
        },
        bandwidth: pairs,
        allreduce,
    })
}

/// The bandwidth of every pair of hosts, one pair at a time (so no two streams share a
/// link): [`BANDWIDTH_PROBE_BYTES`](crate::doctor::cluster::BANDWIDTH_PROBE_BYTES) from
/// the first to the second's listener (`listeners`), against the slower link's rate.
///
/// Errors: a host that stopped answering.
fn measure_bandwidth(
    remote: &RemoteCluster,
    names: &[&str],
    data: &[(String, String)],
    listeners: &[String],
) -> Result<Vec<crate::doctor::cluster::PairBandwidth>> {
    use crate::doctor::cluster::BANDWIDTH_PROBE_BYTES;
    let rate = |position: usize| data_link_rate(remote, position, &data[position].0);
    let mut measured = Vec::new();
    for from in 0..data.len() {
        for to in from + 1..data.len() {
            let result =
                remote.stream(from, &data[from].1, &listeners[to], BANDWIDTH_PROBE_BYTES)?;
            let expected = match (rate(from), rate(to)) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            measured.push(crate::doctor::cluster::PairBandwidth {
                from: names[from].to_string(),
                to: names[to].to_string(),
                gbps: result
                    .as_ref()
                    .ok()
                    .map(|secs| BANDWIDTH_PROBE_BYTES as f64 * 8.0 / secs / 1e9),
                expected_gbps: expected,
                error: result.err(),
            });
        }
    }
    Ok(measured)
}

/// The all-reduce probe's evidence: [`allreduce_probe`]'s rows with the slowest data link,
/// or why it was not run (the hosts run different builds) or failed.
fn allreduce_evidence(
    remote: &RemoteCluster,
    names: &[&str],
    data: &[(String, String)],
    store: (std::net::SocketAddr, std::net::SocketAddr),
    token: &str,
    progress: &mut dyn FnMut(Progress),
) -> crate::doctor::cluster::AllreduceProbe {
    use crate::doctor::cluster::{AllreduceProbe, LinkRate};
    let slowest_link = (0..data.len())
        .filter_map(|position| {
            Some(LinkRate {
                host: names[position].to_string(),
                interface: data[position].0.clone(),
                gbps: data_link_rate(remote, position, &data[position].0)?,
            })
        })
        .reduce(|a, b| if b.gbps < a.gbps { b } else { a });
    let mut probe = AllreduceProbe {
        hosts: names.iter().map(|n| n.to_string()).collect(),
        transport: String::new(),
        rows: Vec::new(),
        slowest_link,
        error: None,
    };
    let builds: std::collections::BTreeSet<&str> = remote
        .hosts
        .iter()
        .map(|h| h.hello.sha256.as_str())
        .collect();
    if builds.len() > 1 {
        probe.error = Some(
            "not run: the hosts run different `infer` builds, whose ranks may not speak the same protocol (see `versions`)".into(),
        );
    } else {
        match allreduce_probe(remote, names, data, store, token, progress) {
            Ok(bench) => {
                probe.transport = bench.transport;
                probe.rows = bench.rows;
            }
            Err(error) => probe.error = Some(format!("{error:#}")),
        }
    }
    probe
}

/// The reachability matrix of `n_hosts` hosts from each host's results (one per other
/// host, in order); the diagonal is empty.
fn matrix_cells(
    results: Vec<Vec<super::protocol::ReachResult>>,
    n_hosts: usize,
) -> Vec<Vec<Option<crate::doctor::cluster::Cell>>> {
    results
        .into_iter()
        .enumerate()
        .map(|(row, mut results)| {
            (0..n_hosts)
                .map(|column| {
                    if column == row {
                        return None;
                    }
                    let result = results.remove(0);
                    Some(crate::doctor::cluster::Cell {
                        to: result.to,
                        from: result.from,
                        rtt_us: result.rtt_us,
                        seen_as: result.seen_as,
                        error: result.error,
                    })
                })
                .collect()
        })
        .collect()
}

/// `engine` on every connected host, in parallel: its programs and versions
/// ([`super::engine::probe_engine`]) and whether its usual ports are free. The first host
/// is taken as the head.
fn engine_survey(
    remote: &RemoteCluster,
    engine: crate::engines::EngineKind,
    engine_bin: Option<&Path>,
) -> crate::doctor::cluster::EngineEvidence {
    use crate::doctor::cluster::{EngineEvidence, EngineHostEvidence};
    // An agent of another build may not know the requests the probe sends.
    let own_sha = std::env::current_exe()
        .ok()
        .and_then(|exe| super::agent::sha256_file(&exe).ok().flatten())
        .map(|(sha, _)| sha);
    let hosts = std::thread::scope(|scope| {
        let jobs: Vec<_> = remote
            .hosts
            .iter()
            .enumerate()
            .map(|(index, host)| {
                let own_sha = own_sha.as_deref();
                scope.spawn(move || {
                    if own_sha.is_some_and(|sha| sha != host.hello.sha256) {
                        return EngineHostEvidence {
                            host: host.name.clone(),
                            version: None,
                            torch: None,
                            error: Some(format!(
                                "`{}` runs another `infer` build (`{}`), which cannot check the engine\nhint: install this \
                                 build there (`infer up --cluster` stages it), then rerun",
                                host.name, host.hello.exe
                            )),
                            ports_taken: Vec::new(),
                        };
                    }
                    let head = index == 0;
                    let probed = super::engine::probe_engine(
                        &|argv, timeout| remote.exec(index, argv, &[], timeout),
                        &host.name,
                        engine,
                        engine_bin,
                        head,
                    );
                    let usual = super::engine::usual_ports(engine, head);
                    let wanted: Vec<(String, u16)> =
                        usual.iter().map(|(p, _)| ("0.0.0.0".to_string(), *p)).collect();
                    let ports_taken = remote
                        .ports_taken(index, &wanted)
                        .unwrap_or_default()
                        .into_iter()
                        .map(|(_, port, why)| {
                            let purpose = usual
                                .iter()
                                .find(|(p, _)| *p == port)
                                .map_or("", |(_, what)| what);
                            (port, purpose.to_string(), why)
                        })
                        .collect();
                    let (version, torch, error) = match probed {
                        Ok(found) => (found.version, found.torch, None),
                        Err(error) => (None, None, Some(error)),
                    };
                    EngineHostEvidence {
                        host: host.name.clone(),
                        version,
                        torch,
                        error,
                        ports_taken,
                    }
                })
            })
            .collect();
        jobs.into_iter()
            .zip(&remote.hosts)
            .map(|(job, host)| {
                job.join().unwrap_or_else(|_| EngineHostEvidence {
                    host: host.name.clone(),
                    version: None,
                    torch: None,
                    error: Some("the engine probe panicked".into()),
                    ports_taken: Vec::new(),
                })
            })
            .collect()
    });
    EngineEvidence {
        engine: engine.to_string(),
        hosts,
    }
}

/// The link rate (sysfs `speed`, Gbit/s) of data interface `name` on host `position`, as
/// its agent's topology reports it.
fn data_link_rate(remote: &RemoteCluster, position: usize, name: &str) -> Option<f64> {
    remote.hosts[position]
        .hello
        .topology
        .nics
        .iter()
        .find(|n| n.netdev.as_deref() == Some(name) || n.name == name)
        .and_then(|n| n.rate_gbps)
}

/// One all-reduce over every host of `remote` with our own collectives: one rank per host
/// (no model), bound to the host's data address (`data[i]`: interface, address), one group
/// over TCP, sizes up to [`ALLREDUCE_PROBE_BYTES`](crate::doctor::cluster::ALLREDUCE_PROBE_BYTES).
/// `store` is the rendezvous store on the first host (as ranks reach it, as this process
/// reaches it) whose token is `token`.
///
/// Errors: a rank that cannot start, fails or stops heartbeating (the gang is stopped).
fn allreduce_probe(
    remote: &RemoteCluster,
    names: &[&str],
    data: &[(String, String)],
    store: (std::net::SocketAddr, std::net::SocketAddr),
    token: &str,
    progress: &mut dyn FnMut(Progress),
) -> Result<crate::runtime::exec::worker::AllreduceBench> {
    let placement = names
        .iter()
        .zip(data)
        .map(|(name, (interface, address))| Placement {
            host: name.to_string(),
            local_rank: 0,
            local_world_size: 1,
            env: HostEnv {
                name: Some(name.to_string()),
                bind_addr: Some(address.clone()),
                socket_ifname: Some(interface.clone()),
                ib_hcas: Vec::new(),
            },
            threads: None,
        })
        .collect();
    let spec = LaunchSpec {
        tp: 1,
        pp: names.len(),
        dp: 1,
        ep: 1,
        model: None,
        threads_per_rank: 1,
        numerics: crate::runtime::cpu::quant::Numerics::Exact,
        timeout: std::time::Duration::from_secs(30),
        serving: None,
        layout_from: "infer doctor --cluster --bandwidth".into(),
        placement,
        run_dir: None,
        gpus: None,
    };
    let spawner = remote.spawner((0..names.len()).collect());
    let mut gang = Gang::start_on(
        &spawner,
        &spec,
        &Job::AllReduce {
            max_bytes: crate::doctor::cluster::ALLREDUCE_PROBE_BYTES,
        },
        StoreLocation::Remote {
            ranks: store.0,
            launcher: store.1,
        },
        token,
    )?;
    let bytes = gang
        .wait_for("result", &|| false, progress)?
        .ok_or_else(|| anyhow!("every rank exited without a result"))?;
    gang.finish();
    serde_json::from_slice(&bytes).context("rank 0 wrote a malformed all-reduce report")
}

/// Every host of the inventory as its own agent probes it (`infer topo --json` there), in
/// parallel; each host named as in the inventory. Hosts that cannot be reached come back
/// as failures, the others still answer.
///
/// Errors: an unreadable inventory, the SSH runtime cannot start.
pub fn probe_topologies(
    inventory: &Path,
    ssh: SshOptions,
    progress: &mut dyn FnMut(Progress),
) -> Result<(
    crate::topology::Topology,
    Vec<super::remote::PreflightFailure>,
)> {
    let (_, _, mut remote, failures) = connect_to_probe(inventory, ssh, progress)?;
    let hosts = remote
        .hosts
        .iter()
        .map(|host| {
            let mut topology = host.hello.topology.clone();
            topology.hostname = host.name.clone();
            topology
        })
        .collect();
    remote.shutdown();
    Ok((crate::topology::Topology { hosts }, failures))
}

/// Which host each rank runs on (indexed by rank, vLLM order: DP, PP, TP with TP fastest).
/// A TP group never spans hosts; TP groups are spread evenly over the hosts in inventory
/// order, consecutive groups together, so PP stages and DP replicas cross hosts.
///
/// Errors: a TP group larger than every host, or more ranks than slots (naming both).
pub fn place(entries: &[InventoryEntry], tp: usize, pp: usize, dp: usize) -> Result<Vec<usize>> {
    let world = tp * pp * dp;
    let n_groups = pp * dp;
    let capacity: Vec<usize> = entries.iter().map(|e| e.slots / tp).collect();
    let total: usize = capacity.iter().sum();
    if total < n_groups {
        let slots: Vec<String> = entries
            .iter()
            .map(|e| format!("`{}` {}", e.name, e.slots))
            .collect();
        bail!(
            "{world} ranks (tp {tp} × pp {pp} × dp {dp}) do not fit the hosts' slots ({}): \
             each TP group of {tp} must fit on one host",
            slots.join(", ")
        );
    }
    let usable = capacity.iter().filter(|c| **c > 0).count().max(1);
    let per_host = n_groups.div_ceil(usable);
    let mut hosts = Vec::with_capacity(world);
    let mut host = 0;
    let mut used = 0;
    for _ in 0..n_groups {
        while used >= capacity[host].min(per_host) {
            host += 1;
            used = 0;
            if host == entries.len() {
                // Even spreading left some groups over: fill remaining capacity in order.
                return place_greedy(&capacity, tp, n_groups);
            }
        }
        hosts.extend(std::iter::repeat_n(host, tp));
        used += 1;
    }
    Ok(hosts)
}

fn place_greedy(capacity: &[usize], tp: usize, n_groups: usize) -> Result<Vec<usize>> {
    let mut hosts = Vec::new();
    for (host, capacity) in capacity.iter().enumerate() {
        for _ in 0..*capacity {
            if hosts.len() / tp < n_groups {
                hosts.extend(std::iter::repeat_n(host, tp));
            }
        }
    }
    Ok(hosts)
}

/// One IPv4 address of a host: interface name, address, prefix length, whether the
/// interface is virtual.
type HostAddress = (String, Ipv4Addr, u8, bool);

/// The IPv4 network (masked address, prefix length) of `ip` with `prefix`.
fn network_of(ip: Ipv4Addr, prefix: u8) -> (u32, u8) {
    let mask = if prefix == 0 {
        0
    } else {
        u32::MAX << (32 - prefix)
    };
    (u32::from(ip) & mask, prefix)
}

/// The interface every host's collectives use: the inventory's `nccl-socket-ifname` where
/// given, else an interface on an IPv4 network every host has an address in, preferring a
/// network that does not carry the SSH (management) addresses, then physical interfaces.
/// Each host keeps its own interface name (`data0` on one, `ens5` on another).
///
/// `hosts[i]` is (interfaces, override, SSH address) of host `names[i]`.
///
/// Interfaces that are down count (the caller reports them): a data NIC that lost its link
/// must not be silently replaced by the management network.
///
/// Errors: an override naming an interface that is missing or without IPv4 on that host
/// (listing what it has); no network common to all hosts.
pub fn choose_data_interfaces(
    names: &[&str],
    hosts: &[(&[Interface], Option<&str>, Option<&str>)],
) -> Result<Vec<DataInterface>> {
    let parsed: Vec<Vec<HostAddress>> = hosts
        .iter()
        .map(|(interfaces, ..)| host_addresses(interfaces))
        .collect();
    // Overrides first: they must exist on their host.
    let chosen = chosen_overrides(names, hosts, &parsed)?;
    if chosen.iter().all(Option::is_some) {
        return Ok(chosen.into_iter().flatten().collect());
    }
    let ssh_addresses: Vec<Ipv4Addr> = hosts
        .iter()
        .filter_map(|(_, _, a)| a.as_ref()?.parse().ok())
        .collect();
    let candidates = common_networks(&parsed, &chosen, &ssh_addresses);
    let Some(best) = candidates.first() else {
        if hosts.len() == 1 {
            // One host: any of its addresses, the SSH one last.
            let ssh = ssh_addresses.first();
            if let Some((name, ip, ..)) = parsed[0]
                .iter()
                .min_by_key(|(_, ip, _, v)| (Some(ip) == ssh, *v))
            {
                return Ok(vec![DataInterface {
                    name: name.clone(),
                    address: *ip,
                }]);
            }
        }
        bail!(
            "no IPv4 network reaches every host ({}); name each host's data interface with `nccl-socket-ifname` in the inventory",
            names.join(", ")
        );
    };
    Ok(parsed
        .iter()
        .zip(chosen)
        .map(|(interfaces, fixed)| {
            fixed.unwrap_or_else(|| {
                let (name, ip, ..) = interfaces
                    .iter()
                    .find(|(_, ip, p, _)| network_of(*ip, *p) == *best)
                    .expect("every host has an address on the chosen network");
                DataInterface {
                    name: name.clone(),
                    address: *ip,
                }
            })
        })
        .collect())
}

/// Every IPv4 address of `interfaces` but the loopback's (down interfaces included).
fn host_addresses(interfaces: &[Interface]) -> Vec<HostAddress> {
    interfaces
        .iter()
        // Down interfaces count too: a data NIC that is down must be reported as
        // such, not silently replaced by the management network.
        .filter(|i| i.name != "lo")
        .flat_map(|i| {
            i.ipv4.iter().filter_map(move |cidr| {
                let (ip, prefix) = cidr.split_once('/')?;
                let ip: Ipv4Addr = ip.parse().ok()?;
                let prefix: u8 = prefix.parse().ok().filter(|p| *p <= 32)?;
                (!ip.is_loopback()).then(|| (i.name.clone(), ip, prefix, i.is_virtual))
            })
        })
        .collect()
}

/// Each host's data interface as its override (`nccl-socket-ifname`) names it; `None`
/// where it has none. `parsed[i]`: host `i`'s addresses.
///
/// Errors: an override naming an interface that is missing or without IPv4 on its host,
/// listing what the host has.
fn chosen_overrides(
    names: &[&str],
    hosts: &[(&[Interface], Option<&str>, Option<&str>)],
    parsed: &[Vec<HostAddress>],
) -> Result<Vec<Option<DataInterface>>> {
    let mut chosen: Vec<Option<DataInterface>> = vec![None; hosts.len()];
    for (index, (interfaces, wanted, _)) in hosts.iter().enumerate() {
        let Some(wanted) = wanted else { continue };
        match parsed[index].iter().find(|(name, ..)| name == wanted) {
            Some((name, ip, ..)) => {
                chosen[index] = Some(DataInterface {
                    name: name.clone(),
                    address: *ip,
                })
            }
            None => {
                let has: Vec<String> = interfaces
                    .iter()
                    .map(|i| {
                        format!(
                            "{} ({})",
                            i.name,
                            if i.up {
                                i.ipv4.join(" ")
                            } else {
                                "down".into()
                            }
                        )
                    })
                    .collect();
                bail!(
                    "interface `{wanted}` (nccl-socket-ifname) is missing, down or has no IPv4 address on `{}`; it has: {}",
                    names[index],
                    has.join(", ")
                );
            }
        }
    }
    Ok(chosen)
}

/// The networks (masked address, prefix length) every host has an address in (a host with
/// an override: that address), best first: not the SSH addresses' (`ssh_addresses`), then
/// with the fewest virtual interfaces.
fn common_networks(
    parsed: &[Vec<HostAddress>],
    chosen: &[Option<DataInterface>],
    ssh_addresses: &[Ipv4Addr],
) -> Vec<(u32, u8)> {
    let mut candidates: Vec<(u32, u8)> = parsed
        .first()
        .map(|first| {
            first
                .iter()
                .map(|(_, ip, p, _)| network_of(*ip, *p))
                .collect()
        })
        .unwrap_or_default();
    candidates.sort();
    candidates.dedup();
    candidates.retain(|net| {
        parsed
            .iter()
            .enumerate()
            .all(|(index, interfaces)| match &chosen[index] {
                Some(fixed) => network_of(fixed.address, net.1) == *net,
                None => interfaces
                    .iter()
                    .any(|(_, ip, p, _)| network_of(*ip, *p) == *net),
            })
    });
    let score = |net: &(u32, u8)| {
        let management = ssh_addresses.iter().any(|a| network_of(*a, net.1) == *net);
        let virtual_count = parsed
            .iter()
            .flatten()
            .filter(|(_, ip, p, v)| *v && network_of(*ip, *p) == *net)
            .count();
        (management, virtual_count)
    };
    candidates.sort_by_key(score);
    candidates
}

/// SSH targets of the inventory's hosts: the inventory's values, then `~/.ssh/config`'s
/// (`HostName`, `User`, `Port`, `IdentityFile`, `ProxyJump`), then OpenSSH's defaults.
///
/// Errors: an unreadable `~/.ssh/config` (a missing one is fine).
pub fn ssh_targets(entries: &[InventoryEntry]) -> Result<Vec<RemoteHostSpec>> {
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_default();
    let config_path = home.join(".ssh/config");
    let config_text = match std::fs::read_to_string(&config_path) {
        Ok(text) => text,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(error) => {
            return Err(error).with_context(|| format!("cannot read `{}`", config_path.display()));
        }
    };
    let local_user = std::env::var("USER").unwrap_or_else(|_| "root".into());
    entries
        .iter()
        .map(|entry| {
            let config = ssh_config::lookup(&config_text, &entry.address, &home);
            let target = target_from(
                &entry.name,
                &entry.address,
                entry.port,
                entry.user.clone(),
                entry.identity_file.clone(),
                entry.known_hosts.clone(),
                &config,
                &local_user,
                &home,
            );
            let jump = match &config.proxy_jump {
                Some(spec) => {
                    let (user, host, port) = ssh_config::parse_jump(spec);
                    let jump_config = ssh_config::lookup(&config_text, &host, &home);
                    // The bastion is offered the host's identity file too.
                    Some(Box::new(target_from(
                        &host,
                        &host,
                        port,
                        user,
                        entry.identity_file.clone(),
                        entry.known_hosts.clone(),
                        &jump_config,
                        &local_user,
                        &home,
                    )))
                }
                None => None,
            };
            Ok(RemoteHostSpec {
                target: SshTarget { jump, ..target },
                infer_path: entry.infer_path.clone(),
            })
        })
        .collect()
}

#[allow(clippy::too_many_arguments)]
fn target_from(
    name: &str,
    alias: &str,
    port: Option<u16>,
    user: Option<String>,
    identity_file: Option<PathBuf>,
    known_hosts: Option<PathBuf>,
    config: &ssh_config::HostConfig,
    local_user: &str,
    home: &Path,
) -> SshTarget {
    let mut identity_files: Vec<PathBuf> = identity_file.into_iter().collect();
    identity_files.extend(config.identity_files.iter().cloned());
    if identity_files.is_empty() {
        identity_files = default_identity_files(home);
    }
    let mut known: Vec<PathBuf> = known_hosts.into_iter().collect();
    known.push(default_known_hosts(home));
    SshTarget {
        name: name.into(),
        address: config.hostname.clone().unwrap_or_else(|| alias.into()),
        port: port.or(config.port).unwrap_or(22),
        user: user
            .or_else(|| config.user.clone())
            .unwrap_or_else(|| local_user.into()),
        identity_files,
        known_hosts: known,
        jump: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(name: &str, slots: usize) -> InventoryEntry {
        InventoryEntry {
            name: name.into(),
            address: format!("{name}.example"),
            port: None,
            user: None,
            identity_file: None,
            known_hosts: None,
            slots,
            cpu: true,
            nccl_socket_ifname: None,
            infer_path: None,
        }
    }

    #[test]
    fn tp_groups_stay_inside_hosts_and_spread_over_them() {
        let two = [entry("a", 2), entry("b", 2)];
        assert_eq!(place(&two, 1, 2, 1).expect("pp 2"), vec![0, 1]);
        assert_eq!(place(&two, 2, 2, 1).expect("tp 2 pp 2"), vec![0, 0, 1, 1]);
        assert_eq!(place(&two, 1, 1, 2).expect("dp 2"), vec![0, 1]);
        assert_eq!(place(&two, 1, 4, 1).expect("pp 4"), vec![0, 0, 1, 1]);
        let error = place(&two, 3, 1, 1).expect_err("tp 3 fits no host");
        assert!(error.to_string().contains("`a` 2, `b` 2"), "{error}");
        let uneven = [entry("a", 4), entry("b", 1)];
        assert_eq!(
            place(&uneven, 2, 2, 1).expect("both groups on a"),
            vec![0, 0, 0, 0]
        );
        assert_eq!(place(&uneven, 1, 5, 1).expect("fills"), vec![0, 0, 0, 0, 1]);
    }

    fn interface(name: &str, cidr: &str, is_virtual: bool) -> Interface {
        Interface {
            name: name.into(),
            ipv4: vec![cidr.into()],
            up: true,
            is_virtual,
            mtu_bytes: Some(1500),
        }
    }

    #[test]
    fn the_data_network_is_the_shared_one_that_is_not_management() {
        let h0 = [
            interface("lo", "127.0.0.1/8", true),
            interface("eno1", "10.1.1.10/24", false),
            interface("data0", "10.1.2.10/24", false),
        ];
        let h1 = [
            interface("eth0", "10.1.1.11/24", false),
            interface("ens5", "10.1.2.11/24", false),
            interface("docker0", "172.17.0.1/16", true),
        ];
        let chosen = choose_data_interfaces(
            &["h0", "h1"],
            &[
                (&h0, None, Some("10.1.1.10")),
                (&h1, None, Some("10.1.1.11")),
            ],
        )
        .expect("chosen");
        assert_eq!(
            chosen,
            vec![
                DataInterface {
                    name: "data0".into(),
                    address: "10.1.2.10".parse().unwrap()
                },
                DataInterface {
                    name: "ens5".into(),
                    address: "10.1.2.11".parse().unwrap()
                },
            ]
        );
        // An override wins, and a missing one is named with what the host has.
        let chosen = choose_data_interfaces(
            &["h0", "h1"],
            &[
                (&h0, Some("eno1"), Some("10.1.1.10")),
                (&h1, None, Some("10.1.1.11")),
            ],
        )
        .expect("chosen");
        assert_eq!(chosen[1].name, "eth0");
        let error = choose_data_interfaces(
            &["h0", "h1"],
            &[(&h0, None, None), (&h1, Some("ib0"), None)],
        )
        .expect_err("missing");
        assert!(
            error.to_string().contains("`ib0`") && error.to_string().contains("`h1`"),
            "{error}"
        );
        // No common network.
        let h2 = [interface("eth0", "192.168.9.2/24", false)];
        let error = choose_data_interfaces(&["h0", "h2"], &[(&h0, None, None), (&h2, None, None)])
            .expect_err("nothing shared");
        assert!(error.to_string().contains("nccl-socket-ifname"), "{error}");
    }
}
