//! `infer doctor --cluster`'s survey of an inventory's hosts over SSH: each agent's hello
//! and live findings, the data interfaces, the reachability matrix between the data
//! addresses, with `--bandwidth` each pair's bandwidth and an all-reduce, the engine's
//! programs and ports; and `infer topo --cluster`'s topologies.

use std::path::Path;

use anyhow::{Context, Result, anyhow};

use super::network::{choose_data_interfaces, ssh_targets};
use super::remote::{Preflight, RemoteCluster, RemoteHostSpec};
use super::ssh::SshOptions;
use super::{Gang, LaunchSpec, Placement, Progress, StoreLocation};
use crate::inventory::InventoryEntry;
use crate::runtime::exec::rank_env::HostEnv;
use crate::runtime::exec::worker::Job;
use crate::topology::Interface;

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
    let entries = crate::inventory::launch_inventory(inventory)?;
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

/// What `infer doctor --cluster` needs from every host, gathered in parallel over SSH: each
/// agent's hello, its own live findings, the data interface chosen for it, and the
/// reachability matrix between the data addresses (every host probes every other at once,
/// bound to its own data address; the listener reports the source it saw).
///
/// Errors: an unreadable inventory, the SSH runtime cannot start, a host that answered
/// preflight and then stopped answering.
pub(crate) fn survey(
    inventory: &Path,
    ssh: SshOptions,
    bandwidth: bool,
    engine: Option<(crate::serving_engines::EngineKind, Option<&Path>)>,
    progress: &mut dyn FnMut(Progress),
) -> Result<crate::doctor::evidence::ClusterEvidence> {
    use crate::doctor::evidence::ClusterEvidence;
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
) -> Result<Vec<crate::doctor::evidence::HostEvidence>> {
    let mut hosts = Vec::new();
    for (position, host) in remote.hosts.iter().enumerate() {
        let live = remote
            .doctor_findings(position)?
            .into_iter()
            .map(|finding| finding.into_finding(&host.name))
            .collect();
        hosts.push(crate::doctor::evidence::HostEvidence {
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
    matrix: crate::doctor::evidence::Matrix,
    /// With `--bandwidth`: each pair's stream.
    bandwidth: Option<Vec<crate::doctor::evidence::PairBandwidth>>,
    /// With `--bandwidth`: one all-reduce over every host.
    allreduce: Option<crate::doctor::evidence::AllreduceProbe>,
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
    // Each probe proves this survey's own secret; a host's identity is its position.
    let secret = super::protocol::ProbeSecret::random();
    let max_stream_bytes = if bandwidth {
        crate::doctor::evidence::BANDWIDTH_PROBE_BYTES
    } else {
        0
    };
    let mut listeners = Vec::new();
    for (position, (_, address)) in data.iter().enumerate() {
        listeners.push(remote.listen(
            position,
            &format!("{address}:0"),
            &secret,
            max_stream_bytes,
        )?);
    }
    let pairs = if bandwidth {
        Some(measure_bandwidth(remote, names, data, &listeners, &secret)?)
    } else {
        None
    };
    let probes: Vec<super::remote::ReachProbes> = data
        .iter()
        .enumerate()
        .map(|(position, (_, address))| {
            let others = listeners
                .iter()
                .enumerate()
                .filter(|(other, _)| *other != position)
                .map(|(other, l)| (l.clone(), other))
                .collect();
            (position, address.clone(), others)
        })
        .collect();
    let results = remote.reach_all(&probes, &secret)?;
    // The rendezvous store's own port on the first host (rank 0's), as ranks reach it.
    // The all-reduce probe runs one rank per host: rank `i` on host `i`.
    let keys = crate::keyring::Keyring::master(
        &crate::rendezvous::random_token(),
        crate::keyring::LAUNCHER_HOST,
        (0..data.len() as u32).collect(),
    )
    .with_hosts(remote.hosts.len())
    .with_addresses(
        data.iter()
            .map(|(_, address)| address.parse())
            .collect::<Result<_, _>>()
            .unwrap_or_default(),
    );
    let (store, store_here) = remote.host_store(0, &format!("{}:0", data[0].1), &keys)?;
    let mut store_cells = vec![None];
    for (position, (_, address)) in data.iter().enumerate().skip(1) {
        let result = remote.connect_only(position, address, &store.to_string())?;
        store_cells.push(Some(crate::doctor::evidence::Cell {
            to: result.to,
            from: result.from,
            rtt_us: result.rtt_us,
            seen_as: None,
            error: result.error,
        }));
    }
    let allreduce = bandwidth
        .then(|| allreduce_evidence(remote, names, data, (store, store_here), &keys, progress));
    Ok(NetworkProbes {
        matrix: crate::doctor::evidence::Matrix {
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
/// link): [`BANDWIDTH_PROBE_BYTES`](crate::doctor::evidence::BANDWIDTH_PROBE_BYTES) from
/// the first to the second's listener (`listeners`, proving `secret`), against the slower
/// link's rate.
///
/// Errors: a host that stopped answering.
fn measure_bandwidth(
    remote: &RemoteCluster,
    names: &[&str],
    data: &[(String, String)],
    listeners: &[String],
    secret: &super::protocol::ProbeSecret,
) -> Result<Vec<crate::doctor::evidence::PairBandwidth>> {
    use crate::doctor::evidence::BANDWIDTH_PROBE_BYTES;
    let rate = |position: usize| data_link_rate(remote, position, &data[position].0);
    let mut measured = Vec::new();
    for from in 0..data.len() {
        for to in from + 1..data.len() {
            let result = remote.stream(
                from,
                &data[from].1,
                (&listeners[to], to),
                BANDWIDTH_PROBE_BYTES,
                secret,
            )?;
            let expected = match (rate(from), rate(to)) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            measured.push(crate::doctor::evidence::PairBandwidth {
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
    keys: &crate::keyring::Keyring,
    progress: &mut dyn FnMut(Progress),
) -> crate::doctor::evidence::AllreduceProbe {
    use crate::doctor::evidence::{AllreduceProbe, LinkRate};
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
        match allreduce_probe(remote, names, data, store, keys, progress) {
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
) -> Vec<Vec<Option<crate::doctor::evidence::Cell>>> {
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
                    Some(crate::doctor::evidence::Cell {
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
/// ([`super::serving_engines::probe_engine`]) and whether its usual ports are free. The first host
/// is taken as the head.
fn engine_survey(
    remote: &RemoteCluster,
    engine: crate::serving_engines::EngineKind,
    engine_bin: Option<&Path>,
) -> crate::doctor::evidence::EngineEvidence {
    use crate::doctor::evidence::{EngineEvidence, EngineHostEvidence};
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
                    let probed = super::serving_engines::probe_engine(
                        &|argv, timeout| remote.exec(index, argv, &[], timeout),
                        &host.name,
                        engine,
                        engine_bin,
                        head,
                    );
                    let usual = super::serving_engines::usual_ports(engine, head);
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
/// over TCP, sizes up to [`ALLREDUCE_PROBE_BYTES`](crate::doctor::evidence::ALLREDUCE_PROBE_BYTES).
/// `store` is the rendezvous store on the first host (as ranks reach it, as this process
/// reaches it), the run's keys `keys`.
///
/// Errors: a rank that cannot start, fails or stops heartbeating (the gang is stopped).
fn allreduce_probe(
    remote: &RemoteCluster,
    names: &[&str],
    data: &[(String, String)],
    store: (std::net::SocketAddr, std::net::SocketAddr),
    keys: &crate::keyring::Keyring,
    progress: &mut dyn FnMut(Progress),
) -> Result<crate::runtime::collectives::bench::AllreduceBench> {
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
        degrees: crate::degrees::Degrees {
            pp: names.len(),
            ..crate::degrees::Degrees::ONE
        },
        model: None,
        threads_per_rank: 1,
        numerics: crate::runtime::cpu::quant::Numerics::Exact,
        timeout: std::time::Duration::from_secs(30),
        serving: None,
        layout_from: "infer doctor --cluster --bandwidth".into(),
        placement,
        run_dir: None,
        planned_hosts: None,
        gpus: None,
        restart: 0,
    };
    let spawner = remote.spawner((0..names.len()).collect());
    let mut gang = Gang::start_on(
        &spawner,
        &spec,
        &Job::AllReduce {
            max_bytes: crate::doctor::evidence::ALLREDUCE_PROBE_BYTES,
        },
        StoreLocation::Remote {
            ranks: store.0,
            launcher: store.1,
        },
        keys,
    )?;
    let bytes = gang
        .wait_for(crate::rendezvous::RESULT_KEY, &|| false, progress)?
        .ok_or_else(|| anyhow!("every rank exited without a result"))?;
    gang.finish();
    serde_json::from_slice(&bytes).context("rank 0 wrote a malformed all-reduce report")
}

/// `infer plan --probe-hosts`: every host's CPU of the inventory `cluster` (`--cluster`),
/// probed there ([`probe_cpus`]).
///
/// Errors: `cluster` is not an inventory file, a host that cannot be reached or probed.
pub(crate) fn probe_inventory_cpus(
    cluster: &str,
    ssh: SshOptions,
) -> Result<Vec<(String, crate::topology::CpuProfile)>> {
    if !crate::inventory::is_inventory(cluster) {
        anyhow::bail!(
            "--probe-hosts probes the hosts of an inventory; `--cluster {cluster}` is not one (give `--cluster hosts.toml`)"
        );
    }
    probe_cpus(Path::new(cluster), ssh, &mut |_| {})
}

/// Every host's CPU of `inventory`, probed there over SSH by its agent: (host name,
/// profile), in inventory order, each profile's `source` naming its host.
///
/// Errors: an unreadable inventory, a host that cannot be reached or probed (named).
pub(crate) fn probe_cpus(
    inventory: &Path,
    ssh: SshOptions,
    progress: &mut dyn FnMut(Progress),
) -> Result<Vec<(String, crate::topology::CpuProfile)>> {
    let (_, _, mut remote, failures) = connect_to_probe(inventory, ssh, progress)?;
    if let Some(failure) = failures.first() {
        remote.shutdown();
        anyhow::bail!(
            "cannot probe host `{}`'s CPU ({}): {}",
            failure.host,
            failure.stage,
            failure.message
        );
    }
    let probed: Result<Vec<_>> = (0..remote.hosts.len())
        .map(|index| {
            let name = remote.hosts[index].name.clone();
            let mut profile = remote
                .cpu_profile(index)
                .with_context(|| format!("cannot probe host `{name}`'s CPU"))?;
            profile.source = profile
                .source
                .replace("on this host", &format!("on `{name}` over SSH"));
            Ok((name, profile))
        })
        .collect();
    remote.shutdown();
    probed
}

/// Every host of the inventory as its own agent probes it (`infer topo --json` there), in
/// parallel; each host named as in the inventory. Hosts that cannot be reached come back
/// as failures, the others still answer.
///
/// Errors: an unreadable inventory, the SSH runtime cannot start.
pub(crate) fn probe_topologies(
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
