//! Launching over the hosts of an inventory: rank placement (a plan's, or TP groups inside a
//! host and consecutive ranks per host), the store on rank 0's host at its data address, and the
//! gang started through the agents. The hosts' SSH targets and data interfaces are
//! `network.rs`'s; the doctor's survey of the hosts is `survey.rs`'s.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, anyhow, bail};

use super::network::{DataInterface, data_interfaces, ssh_targets};
use super::remote::{Preflight, RemoteCluster};
use super::ssh::SshOptions;
use super::{Gang, LaunchSpec, Placement, Progress, StoreLocation};
use crate::degrees::Degrees;
use crate::inventory::InventoryEntry;
use crate::runtime::exec::engine::Generation;
use crate::runtime::exec::rank_env::HostEnv;
use crate::runtime::exec::worker::Job;

/// How to reach and use the hosts of an inventory.
#[derive(Clone, Debug)]
pub(crate) struct ClusterOptions {
    /// The inventory (`hosts.toml`).
    pub inventory: PathBuf,
    /// Host-key policy.
    pub ssh: SshOptions,
    /// Copy the model to hosts that lack it (or have another file at its path).
    pub push_model: bool,
}

/// Runs one generation with `spec`'s layout over the inventory's hosts and returns the
/// driver's result. `progress` hears host preflight lines, rank milestones and rank output.
///
/// Errors: preflight failures (every host named with its cause; nothing started), a layout
/// that does not fit the hosts, a rank or host that fails (the whole gang stopped).
pub(crate) fn run_generation(
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
pub(crate) fn run_job(
    spec: &LaunchSpec,
    job: &Job,
    options: &ClusterOptions,
    progress: &mut dyn FnMut(Progress),
) -> Result<Vec<u8>> {
    let mut run = start(spec, job, options, progress)?;
    progress(run.gang.started());
    let bytes = run
        .gang
        .wait_for(crate::rendezvous::RESULT_KEY, &|| false, progress)?
        .ok_or_else(|| anyhow!("the run was stopped"))?;
    run.gang.finish();
    Ok(bytes)
}

/// A gang started over the hosts of an inventory. Dropping it stops the gang, then the
/// agents, then closes the connections (fields drop in this order).
pub(crate) struct ClusterRun {
    /// The ranks.
    pub gang: Gang,
    /// The hosts' connections and agents, and where the ranks go.
    pub hosts: ClusterHosts,
}

impl std::ops::Deref for ClusterRun {
    type Target = ClusterHosts;

    fn deref(&self) -> &ClusterHosts {
        &self.hosts
    }
}

/// The hosts of an inventory, connected, checked and with their agents running, and the
/// placement of a layout's ranks over them: what [`ClusterHosts::start_gang`] starts a gang
/// on, again after a failure (`infer up --max-restarts`).
pub(crate) struct ClusterHosts {
    /// The hosts' connections and agents.
    pub remote: RemoteCluster,
    /// Index (in the inventory) of rank 0's host.
    pub rank0_host: usize,
    entries: Vec<InventoryEntry>,
    /// Each rank's host (index in the inventory).
    rank_hosts: Vec<usize>,
    data: Vec<DataInterface>,
    /// The spec with each rank's placement (and GPUs) filled in.
    spec: LaunchSpec,
}

/// Connects, places and starts the gang.
///
/// Errors: as [`run_generation`].
pub(crate) fn start(
    spec: &LaunchSpec,
    job: &Job,
    options: &ClusterOptions,
    progress: &mut dyn FnMut(Progress),
) -> Result<ClusterRun> {
    let hosts = connect(spec, options, progress)?;
    let gang = hosts.start_gang(job, 0)?;
    Ok(ClusterRun { gang, hosts })
}

/// Connects to the inventory's hosts (preflight: SSH, agents, binary, model), finds their
/// data interfaces and places `spec`'s ranks over them. Starts no rank.
///
/// Errors: as [`run_generation`].
pub(crate) fn connect(
    spec: &LaunchSpec,
    options: &ClusterOptions,
    progress: &mut dyn FnMut(Progress),
) -> Result<ClusterHosts> {
    spec.check_layout()?;
    let entries = crate::inventory::launch_inventory(&options.inventory)?;
    check_host_names(&entries, &options.inventory)?;
    let rank_hosts = match &spec.planned_hosts {
        Some(names) => planned(&entries, names, spec.degrees)?,
        None => place(&entries, spec.degrees)?,
    };
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
    Ok(ClusterHosts {
        remote,
        rank0_host: rank_hosts[0],
        entries,
        rank_hosts,
        data,
        spec,
    })
}

impl ClusterHosts {
    /// Starts the gang through the agents, with a new store on rank 0's host (at its data
    /// address; the other agents watch it): start `restart` of a supervised run (0 the
    /// first; a restart goes on in `run_dir`).
    ///
    /// Errors: the store cannot listen, a rank cannot start.
    pub(crate) fn start_gang(&self, job: &Job, restart: usize) -> Result<Gang> {
        self.start_gang_in(job, restart, None)
    }

    /// Starts `ranks` of `gang` (one DP replica's) again on their hosts through the
    /// agents, as start `restart` ([`Gang::restart_ranks`]).
    ///
    /// Errors: as [`Gang::restart_ranks`].
    pub(crate) fn restart_ranks(
        &self,
        gang: &mut Gang,
        ranks: std::ops::Range<usize>,
        restart: usize,
        files: &Path,
    ) -> Result<()> {
        let spawner = self.remote.spawner(self.rank_hosts.clone());
        gang.restart_ranks(&spawner, &self.spec, ranks, restart, files)
    }

    /// [`ClusterHosts::start_gang`] in the run directory `run_dir` (a restart's).
    ///
    /// Errors: as [`ClusterHosts::start_gang`].
    pub(crate) fn start_gang_in(
        &self,
        job: &Job,
        restart: usize,
        run_dir: Option<&Path>,
    ) -> Result<Gang> {
        // Each host's index is its place in the inventory; the keys of one start of the gang.
        let keys = crate::keyring::Keyring::master(
            &crate::rendezvous::random_token(),
            crate::keyring::LAUNCHER_HOST,
            self.rank_hosts.iter().map(|&h| h as u32).collect(),
        )
        .with_hosts(self.remote.hosts.len())
        .with_addresses(self.data.iter().map(|d| d.address.into()).collect());
        let store_host = self.rank0_host;
        let (ranks_address, launcher_address) = self.remote.host_store(
            store_host,
            &format!("{}:0", self.data[store_host].address),
            &keys,
        )?;
        let mut spec = self.spec.clone();
        spec.restart = restart;
        if let Some(dir) = run_dir {
            spec.run_dir = Some(dir.to_path_buf());
        }
        let spawner = self.remote.spawner(self.rank_hosts.clone());
        let mut gang = Gang::start_on(
            &spawner,
            &spec,
            job,
            StoreLocation::Remote {
                ranks: ranks_address,
                launcher: launcher_address,
            },
            &keys,
        )?;
        gang.set_manifest_field("run_id", self.remote.run_id.clone().into());
        gang.set_manifest_field(
            "hosts",
            manifest_hosts(&self.remote, &self.entries, &self.data).into(),
        );
        gang.write_manifest(&spec, None)?;
        Ok(gang)
    }
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

/// Which host each rank runs on (indexed by rank, vLLM order: DP, PP, TP with TP fastest).
/// A TP group never spans hosts; TP groups are spread evenly over the hosts in inventory
/// order, consecutive groups together, so PP stages and DP replicas cross hosts.
///
/// Errors: a TP group larger than every host, or more ranks than slots (naming both).
pub(crate) fn place(entries: &[InventoryEntry], degrees: Degrees) -> Result<Vec<usize>> {
    let Degrees { tp, pp, dp, .. } = degrees;
    let world = degrees.world_size();
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

/// The inventory index of each rank's host, from the host names a plan gave (`names`,
/// indexed by rank).
///
/// Errors: not one name per rank of `degrees`, a name the inventory does not list, more
/// ranks on a host than its slots.
pub(crate) fn planned(
    entries: &[InventoryEntry],
    names: &[String],
    degrees: Degrees,
) -> Result<Vec<usize>> {
    if names.len() != degrees.world_size() {
        bail!(
            "the plan places {} ranks, and its layout (tp {} × pp {} × dp {}) has {}",
            names.len(),
            degrees.tp,
            degrees.pp,
            degrees.dp,
            degrees.world_size()
        );
    }
    let hosts = names
        .iter()
        .map(|name| {
            entries
                .iter()
                .position(|e| &e.name == name)
                .with_context(|| {
                    format!("the plan places ranks on `{name}`, which the inventory does not list")
                })
        })
        .collect::<Result<Vec<usize>>>()?;
    for (index, entry) in entries.iter().enumerate() {
        let n_ranks = hosts.iter().filter(|&&h| h == index).count();
        if n_ranks > entry.slots {
            bail!(
                "the plan places {n_ranks} ranks on `{}`, which takes {}",
                entry.name,
                entry.slots
            );
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Degrees `tp × pp × dp`, no EP.
    fn d(tp: usize, pp: usize, dp: usize) -> Degrees {
        Degrees { tp, pp, dp, ep: 1 }
    }

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
    fn a_plans_hosts_are_kept_and_checked_against_the_inventory() {
        let two = [entry("a", 2), entry("b", 2)];
        let names = |hosts: &[&str]| hosts.iter().map(|h| h.to_string()).collect::<Vec<_>>();
        assert_eq!(
            planned(&two, &names(&["a", "b"]), d(1, 1, 2)).expect("one rank each"),
            vec![0, 1]
        );
        assert_eq!(
            planned(&two, &names(&["b", "b"]), d(2, 1, 1)).expect("both on b"),
            vec![1, 1]
        );
        let error = planned(&two, &names(&["a", "c"]), d(1, 1, 2)).expect_err("no c");
        assert!(error.to_string().contains("`c`"), "{error}");
        let error = planned(&two, &names(&["a", "a", "a"]), d(1, 3, 1)).expect_err("a takes 2");
        assert!(error.to_string().contains("3 ranks on `a`"), "{error}");
        let error = planned(&two, &names(&["a"]), d(1, 1, 2)).expect_err("one name short");
        assert!(error.to_string().contains("has 2"), "{error}");
    }

    #[test]
    fn tp_groups_stay_inside_hosts_and_spread_over_them() {
        let two = [entry("a", 2), entry("b", 2)];
        assert_eq!(place(&two, d(1, 2, 1)).expect("pp 2"), vec![0, 1]);
        assert_eq!(
            place(&two, d(2, 2, 1)).expect("tp 2 pp 2"),
            vec![0, 0, 1, 1]
        );
        assert_eq!(place(&two, d(1, 1, 2)).expect("dp 2"), vec![0, 1]);
        assert_eq!(place(&two, d(1, 4, 1)).expect("pp 4"), vec![0, 0, 1, 1]);
        let error = place(&two, d(3, 1, 1)).expect_err("tp 3 fits no host");
        assert!(error.to_string().contains("`a` 2, `b` 2"), "{error}");
        let uneven = [entry("a", 4), entry("b", 1)];
        assert_eq!(
            place(&uneven, d(2, 2, 1)).expect("both groups on a"),
            vec![0, 0, 0, 0]
        );
        assert_eq!(
            place(&uneven, d(1, 5, 1)).expect("fills"),
            vec![0, 0, 0, 0, 1]
        );
    }
}
