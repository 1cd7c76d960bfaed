//! The launcher's side of remote hosts: one SSH connection and one `infer agent` per host,
//! opened in parallel (bounded fan-out) with a preflight that checks every host before
//! anything starts anywhere; staging of the launcher's own binary where a host's differs;
//! the model compared by sha256 (or pushed); the store's port forwarded to the launcher;
//! [`RemoteSpawner`], the [`Spawner`] that starts ranks through the agents.
//!
//! The remote command is always a fixed string (our inspection and staging commands, with a
//! plain path as their one argument, and `<checked path> agent`); no binary runs before its
//! owner, mode, directories and sha256 were checked there. Each host's keys, rank
//! environments and files travel as frames.

use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::protocol::{AgentHello, FILE_CHUNK_BYTES, FromAgent, MAX_FRAME_BYTES, ToAgent};
use super::ssh::{ConnectError, Connection, SshOptions, SshTarget};
use super::{RankHandle, Spawner};

/// Hosts connected at once during preflight.
pub(crate) const MAX_PARALLEL_HOSTS: usize = 32;
/// How long the agents keep ranks alive without hearing from the launcher.
pub const LEASE: Duration = Duration::from_secs(10);
/// How long the launcher waits for word from an agent before it declares the host lost:
/// half the lease, so the launcher names the host before that host's agent stops its ranks
/// and their peers fail.
pub(crate) const AGENT_SILENCE: Duration = Duration::from_secs(5);

/// One host as the launcher needs it.
#[derive(Clone, Debug)]
pub struct RemoteHostSpec {
    /// How to reach it.
    pub target: SshTarget,
    /// `infer` on the host; `None`: the launcher's own path, then the staged copy.
    pub infer_path: Option<String>,
}

/// What every host must pass before anything starts.
#[derive(Clone, Debug)]
pub struct Preflight {
    /// Host-key policy.
    pub ssh: SshOptions,
    /// The model file, at the same path on every host; `None`: no model to check (a probe).
    pub model: Option<PathBuf>,
    /// Copy the model to hosts that lack it.
    pub push_model: bool,
    /// Run only this exact build on the hosts (staging it where it is missing); `false`
    /// takes whatever `infer` a host has (a probe that reports versions), staging only
    /// where there is none.
    pub same_build: bool,
}

/// A connected host with its agent running.
pub struct RemoteHost {
    /// Inventory name.
    pub name: String,
    /// What its agent said first (versions, interfaces, topology, clock).
    pub hello: AgentHello,
    /// The host's clock minus this machine's when its hello arrived, milliseconds.
    pub clock_offset_ms: i64,
    connection: Arc<Connection>,
    to_agent: tokio::sync::mpsc::UnboundedSender<ToAgent>,
    state: Arc<Mutex<HostState>>,
}

/// What the agent has reported so far.
#[derive(Default)]
struct HostState {
    exits: HashMap<usize, ExitStatus>,
    spawned: HashMap<usize, std::result::Result<u32, String>>,
    sinks: HashMap<usize, (File, std::sync::mpsc::Sender<(usize, String)>)>,
    store_at: Option<std::result::Result<String, String>>,
    file_info: Option<(Option<String>, u64)>,
    /// Errors the agent reported that concern no rank.
    errors: Vec<String>,
    /// Answers to the doctor's requests.
    findings: Option<Vec<crate::doctor::WireFinding>>,
    /// The answer to [`ToAgent::ProbeCpu`].
    cpu: Option<crate::topology::CpuProfile>,
    listening: Option<String>,
    reached: Option<Vec<super::protocol::ReachResult>>,
    streamed: Option<(Option<f64>, Option<String>)>,
    /// Answers to [`ToAgent::Exec`] and [`ToAgent::CheckPorts`].
    executed: Option<super::Executed>,
    ports_checked: Option<Vec<(String, u16, String)>>,
    /// Set when the connection or the agent is gone: why.
    lost: Option<String>,
    /// When the agent last sent a frame.
    heard: Option<Instant>,
}

/// One host's reachability probes: the host, the address it probes from, and each target
/// (a probe listener's address and its host).
pub(crate) type ReachProbes = (usize, String, Vec<(String, usize)>);

/// Every host of a run, connected and checked, on one async runtime.
pub struct RemoteCluster {
    runtime: tokio::runtime::Runtime,
    /// The hosts that passed preflight, in inventory order.
    pub hosts: Vec<RemoteHost>,
    /// This run's id (`run-` and 16 hex digits): names the hosts' run directories.
    pub run_id: String,
    heartbeat: Option<tokio::task::JoinHandle<()>>,
}

/// A host that failed preflight: its name, the class of fault and the message.
pub struct PreflightFailure {
    /// Inventory name.
    pub host: String,
    /// The stage or fault class (`auth refused`, `model missing`, `binary arch`).
    pub stage: &'static str,
    /// What happened and what to do about it.
    pub message: String,
}

impl RemoteCluster {
    /// Connects to every host in parallel, starts its agent (staging our binary where
    /// needed) and checks the model. `report` hears each host's stage as it passes.
    ///
    /// Errors: every host that failed, one line each naming the host, the stage and the
    /// cause; nothing has been started anywhere then.
    pub fn connect(
        hosts: &[RemoteHostSpec],
        preflight: &Preflight,
        report: &mut dyn FnMut(&str, &str),
    ) -> Result<RemoteCluster> {
        let (mut cluster, failures) = RemoteCluster::connect_partial(hosts, preflight, report)?;
        if !failures.is_empty() {
            cluster.shutdown();
            let lines: Vec<String> = failures
                .iter()
                .map(|f| {
                    format!(
                        "  {:<12} {:<18} {}",
                        f.host,
                        f.stage,
                        f.message
                            .replace('\n', "\n                                  ")
                    )
                })
                .collect();
            bail!(
                "preflight failed on {} of {} hosts; nothing was started:\n{}",
                failures.len(),
                hosts.len(),
                lines.join("\n")
            );
        }
        Ok(cluster)
    }

    /// [`RemoteCluster::connect`] that keeps the hosts that passed and returns the others'
    /// failures (for probes, where one host down must not hide the rest).
    ///
    /// Errors: the runtime cannot start, the model or this executable cannot be read.
    pub fn connect_partial(
        hosts: &[RemoteHostSpec],
        preflight: &Preflight,
        report: &mut dyn FnMut(&str, &str),
    ) -> Result<(RemoteCluster, Vec<PreflightFailure>)> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .context("cannot start the SSH runtime")?;
        let run_id = format!("run-{:016x}", rand::random::<u64>());
        let model_sha =
            match &preflight.model {
                Some(model) => Some(super::agent::sha256_file(model)?.with_context(|| {
                    format!("the model `{}` does not exist here", model.display())
                })?),
                None => None,
            };
        let exe = std::env::current_exe().context("cannot find the `infer` executable")?;
        let own_sha = super::agent::sha256_file(&exe)?
            .context("the `infer` executable vanished")?
            .0;
        // Every host's preflight runs as its own task (at most MAX_PARALLEL_HOSTS at once);
        // their stages come back on a channel and are reported here, on this thread.
        let (stages, mut stage_reports) =
            tokio::sync::mpsc::unbounded_channel::<(String, String)>();
        let results = runtime.block_on(async {
            let semaphore = Arc::new(tokio::sync::Semaphore::new(MAX_PARALLEL_HOSTS));
            let mut tasks = tokio::task::JoinSet::new();
            for (index, spec) in hosts.iter().enumerate() {
                let (spec, preflight, semaphore, stages) = (
                    spec.clone(),
                    preflight.clone(),
                    Arc::clone(&semaphore),
                    stages.clone(),
                );
                let (model_sha, own_sha, exe, run_id) = (
                    model_sha.clone(),
                    own_sha.clone(),
                    exe.clone(),
                    run_id.clone(),
                );
                tasks.spawn(async move {
                    let _permit = semaphore.acquire().await;
                    let result = connect_host(
                        &spec, &preflight, &model_sha, &own_sha, &exe, &run_id, &stages,
                    )
                    .await;
                    (index, result)
                });
            }
            drop(stages);
            let mut results: Vec<Option<std::result::Result<RemoteHost, PreflightFailure>>> =
                (0..hosts.len()).map(|_| None).collect();
            loop {
                tokio::select! {
                    Some((host, stage)) = stage_reports.recv() => report(&host, &stage),
                    joined = tasks.join_next() => match joined {
                        Some(Ok((index, result))) => results[index] = Some(result),
                        Some(Err(error)) => return Err(anyhow!("a preflight task failed: {error}")),
                        None => break,
                    },
                }
            }
            while let Ok((host, stage)) = stage_reports.try_recv() {
                report(&host, &stage);
            }
            Ok(results)
        })?;
        let mut connected = Vec::new();
        let mut failures = Vec::new();
        for result in results.into_iter().flatten() {
            match result {
                Ok(host) => {
                    report(&host.name, "ready");
                    connected.push(host);
                }
                Err(failure) => {
                    report(&failure.host, &format!("failed ({})", failure.stage));
                    failures.push(failure);
                }
            }
        }
        let mut cluster = RemoteCluster {
            runtime,
            hosts: connected,
            run_id,
            heartbeat: None,
        };
        let senders: Vec<_> = cluster.hosts.iter().map(|h| h.to_agent.clone()).collect();
        cluster.heartbeat = Some(cluster.runtime.spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(1)).await;
                for sender in &senders {
                    let _ = sender.send(ToAgent::Heartbeat);
                }
            }
        }));
        Ok((cluster, failures))
    }

    /// Asks `host`'s agent to run the rendezvous store on `bind` with the store's keys of
    /// `keys` (the run's secret: the agent gets only the store keys, every other agent its
    /// own host's keys to watch the store), and forwards a local port to it over that host's
    /// SSH connection (as `ssh -L`). Returns (the address ranks use, the local address the
    /// launcher uses).
    ///
    /// Errors: the store cannot listen there, or forwarding is refused by `sshd`; `keys`
    /// without the run's secret.
    pub fn host_store(
        &self,
        host_index: usize,
        bind: &str,
        keys: &crate::keyring::Keyring,
    ) -> Result<(std::net::SocketAddr, std::net::SocketAddr)> {
        let host = &self.hosts[host_index];
        host.send(ToAgent::HostStore {
            bind: bind.into(),
            keys: super::protocol::SecretText(keys.for_store()?.to_text()?),
        })?;
        let address = host.wait_for(Duration::from_secs(10), "the store to listen", |s| {
            s.store_at.take()
        })?;
        let address: std::net::SocketAddr = address
            .map_err(|message| anyhow!("`{}`: {message}", host.name))?
            .parse()
            .context("the agent reported a malformed store address")?;
        // Every other host's agent watches the store: losing it stops that host's ranks.
        for (index, other) in self.hosts.iter().enumerate() {
            if index != host_index {
                other.send(ToAgent::WatchStore {
                    address: address.to_string(),
                    keys: super::protocol::SecretText(keys.for_host(index as u32)?.to_text()?),
                })?;
            }
        }
        let listener = std::net::TcpListener::bind("127.0.0.1:0")
            .context("cannot open the local end of the store tunnel")?;
        let local = listener.local_addr()?;
        self.forward(host_index, address, listener)?;
        Ok((address, local))
    }

    /// Forwards every connection accepted on `listener` (on this machine) to `remote` as
    /// host `host_index` reaches it, over that host's SSH connection (as `ssh -L`).
    ///
    /// Returns the handle that stops the forwarding (connections already open go on).
    ///
    /// Errors: the listener cannot be handed to the runtime. A connection `sshd` refuses
    /// to forward is closed.
    pub fn forward(
        &self,
        host_index: usize,
        remote: std::net::SocketAddr,
        listener: std::net::TcpListener,
    ) -> Result<tokio::task::AbortHandle> {
        listener.set_nonblocking(true)?;
        let connection = Arc::clone(&self.hosts[host_index].connection);
        let _guard = self.runtime.enter();
        let listener =
            tokio::net::TcpListener::from_std(listener).context("cannot forward the port")?;
        let accepting = self.runtime.spawn(async move {
            while let Ok((mut socket, peer)) = listener.accept().await {
                let connection = Arc::clone(&connection);
                tokio::spawn(async move {
                    let _ = socket.set_nodelay(true);
                    if let Ok(channel) = connection
                        .handle
                        .channel_open_direct_tcpip(
                            remote.ip().to_string(),
                            u32::from(remote.port()),
                            peer.ip().to_string(),
                            u32::from(peer.port()),
                        )
                        .await
                    {
                        let mut stream = channel.into_stream();
                        let _ = tokio::io::copy_bidirectional(&mut socket, &mut stream).await;
                    }
                });
            }
        });
        Ok(accepting.abort_handle())
    }

    /// Runs `argv` on host `index` (no shell: `argv[0]` found on the agent's `PATH` unless it
    /// names a path) with `env` added, for at most `timeout`.
    ///
    /// Errors: the host is lost or does not answer in time.
    pub fn exec(
        &self,
        index: usize,
        argv: &[String],
        env: &[(String, String)],
        timeout: Duration,
    ) -> Result<super::Executed> {
        let host = &self.hosts[index];
        host.send(ToAgent::Exec {
            argv: argv.to_vec(),
            env: env.to_vec(),
            timeout_secs: timeout.as_secs().max(1),
        })?;
        host.wait_for(
            timeout + Duration::from_secs(5),
            "a program it was asked to run",
            |s| s.executed.take(),
        )
    }

    /// The sha256 (hex) of the file at `path` on host `index`; `None` when it does not exist.
    ///
    /// Errors: the host is lost or does not answer in 10 minutes (a large file is hashed).
    pub fn file_sha256(&self, index: usize, path: &str) -> Result<Option<String>> {
        let host = &self.hosts[index];
        host.send(ToAgent::HashFile { path: path.into() })?;
        let (sha, _) = host.wait_for(Duration::from_secs(600), "the file's sha256", |s| {
            s.file_info.take()
        })?;
        Ok(sha)
    }

    /// The ports of `ports` (address, port) that host `index` cannot bind, with why.
    ///
    /// Errors: the host is lost or does not answer in 10 s.
    pub fn ports_taken(
        &self,
        index: usize,
        ports: &[(String, u16)],
    ) -> Result<Vec<(String, u16, String)>> {
        let host = &self.hosts[index];
        host.send(ToAgent::CheckPorts {
            ports: ports.to_vec(),
        })?;
        host.wait_for(Duration::from_secs(10), "its port check", |s| {
            s.ports_checked.take()
        })
    }

    /// Host `index`'s own live doctor findings, run there.
    ///
    /// Errors: the host is lost or does not answer within 30 s.
    pub fn doctor_findings(&self, index: usize) -> Result<Vec<crate::doctor::WireFinding>> {
        let host = &self.hosts[index];
        host.send(ToAgent::Doctor)?;
        host.wait_for(Duration::from_secs(30), "its live checks", |s| {
            s.findings.take()
        })
    }

    /// Host `index`'s CPU, probed there.
    ///
    /// Errors: the host is lost, the probe fails, or it does not answer within 30 s.
    pub(crate) fn cpu_profile(&self, index: usize) -> Result<crate::topology::CpuProfile> {
        let host = &self.hosts[index];
        host.send(ToAgent::ProbeCpu)?;
        host.wait_for(Duration::from_secs(30), "its CPU probe", |s| s.cpu.take())
    }

    /// Asks host `index` to listen for the doctor's probes on `bind`, as host `index` of the
    /// survey keyed by `secret`, taking bandwidth probes of at most `max_stream_bytes`;
    /// returns the address.
    ///
    /// Errors: it cannot listen there, or does not answer.
    pub(crate) fn listen(
        &self,
        index: usize,
        bind: &str,
        secret: &super::protocol::ProbeSecret,
        max_stream_bytes: u64,
    ) -> Result<String> {
        let host = &self.hosts[index];
        host.send(ToAgent::Listen {
            bind: bind.into(),
            secret: Some(secret.clone()),
            host: index as u64,
            max_stream_bytes,
        })?;
        host.wait_for(Duration::from_secs(10), "its probe listener", |s| {
            s.listening
                .take()
                .map(Ok)
                .or_else(|| s.errors.pop().map(Err))
        })?
        .map_err(|message| anyhow!("`{}`: {message}", host.name))
    }

    /// Has every host in `probes` probe its targets at once (`(host, from address, targets)`,
    /// each target a listener's address and its host), proving `secret`, and returns each
    /// host's results in target order.
    ///
    /// Errors: a host is lost or does not answer within 30 s and 10 s a target.
    pub(crate) fn reach_all(
        &self,
        probes: &[ReachProbes],
        secret: &super::protocol::ProbeSecret,
    ) -> Result<Vec<Vec<super::protocol::ReachResult>>> {
        for (index, from, targets) in probes {
            self.hosts[*index].send(ToAgent::Reach {
                from: from.clone(),
                targets: targets.iter().map(|(to, _)| to.clone()).collect(),
                target_hosts: targets.iter().map(|(_, host)| *host as u64).collect(),
                secret: Some(secret.clone()),
                host: *index as u64,
            })?;
        }
        probes
            .iter()
            .map(|(index, _, targets)| {
                let within = Duration::from_secs(30 + 10 * targets.len() as u64);
                self.hosts[*index].wait_for(within, "its probes", |s| s.reached.take())
            })
            .collect()
    }

    /// Has host `index` connect from `from` to `to` (and close at once).
    ///
    /// Errors: the host is lost or does not answer within 10 s.
    pub fn connect_only(
        &self,
        index: usize,
        from: &str,
        to: &str,
    ) -> Result<super::protocol::ReachResult> {
        let host = &self.hosts[index];
        host.send(ToAgent::Connect {
            from: from.into(),
            to: to.into(),
        })?;
        let mut results = host.wait_for(Duration::from_secs(10), "its connection probe", |s| {
            s.reached.take()
        })?;
        results.pop().context("an empty connection probe result")
    }

    /// Has host `index` send `bytes` bytes from `from` to host `to_index`'s probe listener
    /// `to`, proving `secret`, and returns the seconds it took, or why it failed.
    ///
    /// Errors: the host is lost or does not answer within 80 s.
    pub(crate) fn stream(
        &self,
        index: usize,
        from: &str,
        (to, to_index): (&str, usize),
        bytes: u64,
        secret: &super::protocol::ProbeSecret,
    ) -> Result<std::result::Result<f64, String>> {
        let host = &self.hosts[index];
        host.send(ToAgent::Stream {
            from: from.into(),
            to: to.into(),
            bytes,
            secret: Some(secret.clone()),
            host: index as u64,
            to_host: to_index as u64,
        })?;
        let (secs, error) = host.wait_for(Duration::from_secs(80), "its bandwidth probe", |s| {
            s.streamed.take()
        })?;
        Ok(secs.ok_or_else(|| error.unwrap_or_else(|| "no result".into())))
    }

    /// The [`Spawner`] that starts rank `r` on host `rank_hosts[r]`.
    pub fn spawner(&self, rank_hosts: Vec<usize>) -> RemoteSpawner<'_> {
        RemoteSpawner {
            cluster: self,
            rank_hosts,
        }
    }

    /// Tells every agent to stop its ranks and exit, and closes the connections.
    pub fn shutdown(&mut self) {
        if let Some(task) = self.heartbeat.take() {
            task.abort();
        }
        for host in &self.hosts {
            let _ = host.to_agent.send(ToAgent::Shutdown);
        }
        // Give the agents a moment to stop their ranks before the connections close
        // (closing alone would also stop them: stdin EOF).
        let deadline = Instant::now() + super::GRACE_PERIOD + Duration::from_millis(500);
        while Instant::now() < deadline
            && self
                .hosts
                .iter()
                .any(|h| h.state.lock().is_ok_and(|s| s.lost.is_none()))
        {
            std::thread::sleep(Duration::from_millis(20));
        }
        self.hosts.clear();
    }
}

impl Drop for RemoteCluster {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl RemoteHost {
    fn send(&self, frame: ToAgent) -> Result<()> {
        self.to_agent
            .send(frame)
            .map_err(|_| anyhow!("lost the agent on `{}`", self.name))
    }

    /// One look at the host's state: `take`'s value if it has arrived, an error if the host
    /// is lost.
    fn poll<T>(
        &self,
        what: &str,
        take: &mut impl FnMut(&mut HostState) -> Option<T>,
    ) -> Result<Option<T>> {
        let mut state = self
            .state
            .lock()
            .map_err(|_| anyhow!("host state poisoned"))?;
        if let Some(value) = take(&mut state) {
            return Ok(Some(value));
        }
        match &state.lost {
            Some(lost) => bail!("lost host `{}` while waiting for {what}: {lost}", self.name),
            None => Ok(None),
        }
    }

    /// Waits (blocking this thread) until `take` finds what it waits for in the host's state.
    fn wait_for<T>(
        &self,
        timeout: Duration,
        what: &str,
        mut take: impl FnMut(&mut HostState) -> Option<T>,
    ) -> Result<T> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(value) = self.poll(what, &mut take)? {
                return Ok(value);
            }
            if Instant::now() >= deadline {
                bail!(
                    "`{}` did not answer within {} s while waiting for {what}",
                    self.name,
                    timeout.as_secs()
                );
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// [`RemoteHost::wait_for`] on the runtime (preflight), up to 10 minutes (hashing or
    /// pushing a large model).
    async fn wait_async<T>(
        &self,
        what: &str,
        mut take: impl FnMut(&mut HostState) -> Option<T>,
    ) -> Result<T> {
        let deadline = Instant::now() + Duration::from_secs(600);
        loop {
            if let Some(value) = self.poll(what, &mut take)? {
                return Ok(value);
            }
            if Instant::now() >= deadline {
                bail!("`{}` did not answer while waiting for {what}", self.name);
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

/// Starts ranks through the agents.
pub struct RemoteSpawner<'a> {
    cluster: &'a RemoteCluster,
    rank_hosts: Vec<usize>,
}

impl Spawner for RemoteSpawner<'_> {
    fn spawn(
        &self,
        rank: usize,
        env: &[(String, String)],
        keys: &str,
        log: &Path,
        lines: &std::sync::mpsc::Sender<(usize, String)>,
    ) -> Result<Box<dyn RankHandle>> {
        self.start(rank, env, keys, None, log, lines)
            .map_err(|(host, message)| anyhow!("cannot start rank {rank} on `{host}`: {message}"))
    }

    fn spawn_program(
        &self,
        index: usize,
        argv: &[String],
        env: &[(String, String)],
        log: &Path,
        lines: &std::sync::mpsc::Sender<(usize, String)>,
    ) -> Result<Box<dyn RankHandle>> {
        let what = argv.first().map_or("the program", String::as_str);
        self.start(index, env, "", Some(argv.to_vec()), log, lines)
            .map_err(|(host, message)| anyhow!("cannot start `{what}` on `{host}`: {message}"))
    }

    fn describe(&self, rank: usize) -> String {
        format!("{} r{rank}", self.cluster.hosts[self.rank_hosts[rank]].name)
    }
}

impl RemoteSpawner<'_> {
    /// Asks member `index`'s agent to start it (`infer rank`, or `argv`), its output into
    /// `log` and `lines`. Errors: (the host, why) — the agent refused, or did not answer.
    fn start(
        &self,
        index: usize,
        env: &[(String, String)],
        keys: &str,
        argv: Option<Vec<String>>,
        log: &Path,
        lines: &std::sync::mpsc::Sender<(usize, String)>,
    ) -> std::result::Result<Box<dyn RankHandle>, (String, String)> {
        let host = &self.cluster.hosts[self.rank_hosts[index]];
        let fail = |error: anyhow::Error| (host.name.clone(), format!("{error:#}"));
        let file = super::run_dir::create_private(log)
            .with_context(|| format!("cannot create `{}`", log.display()))
            .map_err(fail)?;
        {
            let mut state = host
                .state
                .lock()
                .map_err(|_| (host.name.clone(), "host state poisoned".to_string()))?;
            state.sinks.insert(index, (file, lines.clone()));
            // A restarted gang's member: its earlier process's exit is history.
            state.exits.remove(&index);
        }
        host.send(ToAgent::Spawn {
            rank: index,
            env: env.to_vec(),
            keys: super::protocol::SecretText(keys.into()),
            argv,
        })
        .map_err(fail)?;
        let pid = host
            .wait_for(
                Duration::from_secs(10),
                &format!("member {index} to start"),
                |s| s.spawned.remove(&index),
            )
            .map_err(fail)?
            .map_err(|message| (host.name.clone(), message))?;
        Ok(Box::new(RemoteRank {
            rank: index,
            pid,
            host: host.name.clone(),
            to_agent: host.to_agent.clone(),
            state: Arc::clone(&host.state),
        }))
    }
}

/// A rank on a remote host, seen through its agent's frames.
struct RemoteRank {
    rank: usize,
    pid: u32,
    host: String,
    to_agent: tokio::sync::mpsc::UnboundedSender<ToAgent>,
    state: Arc<Mutex<HostState>>,
}

impl RankHandle for RemoteRank {
    fn id(&self) -> u32 {
        self.pid
    }

    fn try_wait(&mut self) -> Result<Option<ExitStatus>> {
        let state = self
            .state
            .lock()
            .map_err(|_| anyhow!("host state poisoned"))?;
        if let Some(status) = state.exits.get(&self.rank) {
            return Ok(Some(*status));
        }
        if let Some(lost) = &state.lost {
            bail!(
                "lost host `{}` (rank {} ran there): {lost}",
                self.host,
                self.rank
            );
        }
        Ok(None)
    }

    fn signal(&mut self, signal: rustix::process::Signal) {
        let _ = self.to_agent.send(ToAgent::Signal {
            rank: self.rank,
            signal: signal.as_raw(),
        });
    }

    fn wait(&mut self) {
        let deadline = Instant::now() + super::GRACE_PERIOD * 2;
        while Instant::now() < deadline && matches!(self.try_wait(), Ok(None)) {
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn host(&self) -> Option<&str> {
        Some(&self.host)
    }

    fn host_note(&self) -> Option<String> {
        let state = self.state.lock().ok()?;
        let said = state.errors.last()?;
        Some(format!("the agent on `{}` said: {said}", self.host))
    }
}

/// Preflight of one host: connect, agent (staged if needed), model. Ends with the agent
/// started for `run_id`.
async fn connect_host(
    spec: &RemoteHostSpec,
    preflight: &Preflight,
    model_sha: &Option<(String, u64)>,
    own_sha: &str,
    exe: &Path,
    run_id: &str,
    stages: &tokio::sync::mpsc::UnboundedSender<(String, String)>,
) -> std::result::Result<RemoteHost, PreflightFailure> {
    let name = spec.target.name.clone();
    let passed = |stage: String| {
        let _ = stages.send((name.clone(), stage));
    };
    let fail = |stage: &'static str, message: String| PreflightFailure {
        host: name.clone(),
        stage,
        message,
    };
    let connection = super::ssh::connect(&spec.target, preflight.ssh)
        .await
        .map_err(|ConnectError { class, message }| fail(class.name(), message))?;
    let connection = Arc::new(connection);
    passed(format!(
        "connected as `{}` to {}:{}",
        spec.target.user, spec.target.address, spec.target.port
    ));
    // The binary: the inventory's path, else ours, else the staged copy; pushed if none
    // of them is this exact build.
    let (channel, hello) = find_agent(&connection, spec, preflight, own_sha, exe).await?;
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64);
    let clock_offset_ms = hello.unix_time_ms as i64 - now_ms;
    passed(format!(
        "binary `{}` ({}, sha256 {}, owner and mode checked)",
        hello.exe,
        hello.arch,
        // An agent's hello is input: a short or odd hash is shown as it came.
        hello.sha256.get(..12).unwrap_or(&hello.sha256)
    ));
    let state: Arc<Mutex<HostState>> = Arc::default();
    let to_agent = pump_frames(channel, Arc::clone(&state));
    let host = RemoteHost {
        name: name.clone(),
        hello,
        clock_offset_ms,
        connection,
        to_agent,
        state,
    };
    host.send(ToAgent::Run {
        run_id: run_id.into(),
        host: name.clone(),
        lease_secs: LEASE.as_secs(),
    })
    .map_err(|e| fail("agent", format!("{e:#}")))?;
    // The model: the same bytes at the same path.
    check_model(&host, preflight, model_sha, stages).await?;
    Ok(host)
}

/// A preflight failure of host `host` at `stage`.
fn preflight_failure(host: &str, stage: &'static str, message: String) -> PreflightFailure {
    PreflightFailure {
        host: host.to_string(),
        stage,
        message,
    }
}

/// Starts the agent of this exact build (any build without `preflight.same_build`) on the
/// host of `spec`: the inventory's `infer-path`, else this program's path, else the copy
/// staged under `~/.cache/infer/bin`; this program is staged there when none will do.
///
/// Nothing runs before it is checked: each candidate is first looked at with one fixed
/// command ([`INSPECT`]: `readlink`, `stat`, `sha256sum`), and only a regular file owned by
/// the SSH user or root, not writable by group or others, in directories nobody else can
/// write to, is run, by its resolved path; with `same_build` only a file whose sha256 is
/// this program's. The hash measured there replaces the one the agent reports about itself.
///
/// Errors (as the host's preflight failure): a path that is not plain, a candidate that
/// others could have written (with the `chmod`/`chown` that fixes it), a host of another
/// architecture, the staging fails or the staged copy is not this build.
async fn find_agent(
    connection: &Connection,
    spec: &RemoteHostSpec,
    preflight: &Preflight,
    own_sha: &str,
    exe: &Path,
) -> std::result::Result<(AgentStream, AgentHello), PreflightFailure> {
    let fail =
        |stage: &'static str, message: String| preflight_failure(&spec.target.name, stage, message);
    let staged = format!(
        ".cache/infer/bin/infer-{}-{}",
        env!("CARGO_PKG_VERSION"),
        own_sha.get(..8).unwrap_or(own_sha)
    );
    let mut candidates: Vec<String> = Vec::new();
    match &spec.infer_path {
        Some(path) => candidates.push(path.clone()),
        None => {
            let own = exe.display().to_string();
            if safe_remote_path(&own) {
                candidates.push(own);
            }
        }
    }
    candidates.push(staged.clone());
    for path in &candidates {
        if !safe_remote_path(path) {
            return Err(fail(
                "binary",
                format!("`{path}` is not a plain path (letters, digits, `/._+-` only)"),
            ));
        }
        let Some(file) = inspect(connection, path)
            .await
            .map_err(|message| fail("binary", message))?
        else {
            continue;
        };
        if let Err(problem) = file.check(path) {
            // A stale staged copy is replaced (and its directory made private) by staging.
            if *path == staged {
                continue;
            }
            return Err(fail("binary", problem));
        }
        if preflight.same_build && file.sha256 != own_sha {
            continue;
        }
        if let Some(started) = start_agent(connection, &file).await {
            return Ok(started);
        }
    }
    stage_agent(connection, &spec.target.name, exe, &staged, own_sha).await
}

/// Copies this program (`exe`) to `staged` (relative to the home directory of `host`): a
/// temporary file created 0600 in `~/.cache/infer/bin` (made 0700), made 0700 and renamed
/// into place; then checks it as [`find_agent`] checks any candidate, and starts it.
///
/// Errors (as the host's preflight failure): a host of another architecture, `exe`
/// unreadable, the copy fails, the staged copy fails the checks, is not this build or does
/// not run.
async fn stage_agent(
    connection: &Connection,
    host: &str,
    exe: &Path,
    staged: &str,
    own_sha: &str,
) -> std::result::Result<(AgentStream, AgentHello), PreflightFailure> {
    let fail = |stage: &'static str, message: String| preflight_failure(host, stage, message);
    let (arch, _) = connection
        .output("uname -m", b"")
        .await
        .map_err(|e| fail("binary", format!("{e:#}")))?;
    let arch = String::from_utf8_lossy(&arch).trim().to_string();
    if arch != std::env::consts::ARCH {
        return Err(fail(
            "binary arch",
            format!(
                "the host is `{arch}`, this `infer` is built for `{}`: install a matching `infer` there and name it with `infer-path`",
                std::env::consts::ARCH
            ),
        ));
    }
    let bytes = std::fs::read(exe)
        .map_err(|e| fail("binary", format!("cannot read `{}`: {e}", exe.display())))?;
    let (_, status) = connection
        .output(&format!("sh -c '{STAGE}' sh {staged}"), &bytes)
        .await
        .map_err(|e| fail("binary", format!("{e:#}")))?;
    if status != Some(0) {
        return Err(fail(
            "binary",
            format!(
                "staging `infer` into `~/{staged}` failed (exit {status:?})\n\
                 hint: `~/.cache/infer/bin` must be a directory you own, on a disk with room"
            ),
        ));
    }
    let file = inspect(connection, staged)
        .await
        .map_err(|message| fail("binary", message))?
        .ok_or_else(|| fail("binary", format!("the staged `~/{staged}` is not there")))?;
    file.check(staged)
        .map_err(|problem| fail("binary", problem))?;
    if file.sha256 != own_sha {
        return Err(fail(
            "binary",
            format!("the staged `~/{staged}` has another sha256 than this build"),
        ));
    }
    start_agent(connection, &file).await.ok_or_else(|| {
        fail(
            "binary",
            format!("the staged `{}` does not run as an agent", file.path),
        )
    })
}

/// The fixed command that inspects a candidate binary, given as `$1` (a plain path): its
/// resolved path, the SSH user's uid, the file's owner, mode and type, each directory
/// above it up to `/`, and its sha256 (regular files only); `missing` when there is none.
/// One line, no `'` and no `!`, so that any login shell hands it to `sh` as it is.
const INSPECT: &str = "p=$(readlink -f -- \"$1\") && [ -e \"$p\" ] || { echo missing; exit 0; }; \
     echo \"path $p\"; echo \"uid $(id -u)\"; stat -L -c \"file %u %a %F\" -- \"$p\" || exit 1; \
     d=$p; until [ \"$d\" = / ]; do d=$(dirname -- \"$d\"); stat -c \"dir %u %a %n\" -- \"$d\" || exit 1; done; \
     [ -f \"$p\" ] || exit 0; s=$(sha256sum < \"$p\") || exit 1; echo \"sha256 ${s%% *}\"";

/// The fixed command that stages the bytes on its stdin at `$1` (relative to the home
/// directory): a private temporary file in a private `~/.cache/infer/bin`, made 0700 and
/// renamed into place. Same shape rules as [`INSPECT`].
const STAGE: &str = "umask 077; mkdir -p .cache/infer/bin && chmod 700 .cache/infer/bin && \
     t=$(mktemp .cache/infer/bin/.upload.XXXXXX) && { cat > \"$t\" && chmod 700 \"$t\" && mv -f -- \"$t\" \"$1\" || { rm -f -- \"$t\"; exit 1; }; }";

/// A candidate binary on a host, as [`INSPECT`] saw it.
#[derive(Debug, PartialEq, Eq)]
struct RemoteFile {
    /// The path it resolves to (symbolic links followed).
    path: String,
    /// The SSH user's uid.
    uid: u32,
    /// The file's owner (uid).
    owner: u32,
    /// The file's permission bits.
    mode: u32,
    /// `stat`'s file type (`regular file`, `directory`, …).
    kind: String,
    /// Each directory above it, nearest first: (path, owner, mode).
    dirs: Vec<(String, u32, u32)>,
    /// Its sha256 (hex); empty when it is not a regular file.
    sha256: String,
}

/// Reads [`INSPECT`]'s output: `None` when nothing is there.
///
/// Errors: output that is not what the command prints (a line missing or malformed).
fn parse_inspection(output: &str) -> std::result::Result<Option<RemoteFile>, String> {
    if output.trim() == "missing" {
        return Ok(None);
    }
    let malformed = |what: &str| format!("unexpected output from the inspection ({what})");
    let octal = |text: &str| u32::from_str_radix(text, 8).map_err(|_| malformed("a mode"));
    let number = |text: &str| text.parse::<u32>().map_err(|_| malformed("a uid"));
    let (mut path, mut uid, mut file, mut sha256) = (None, None, None, String::new());
    let mut dirs = Vec::new();
    for line in output.lines() {
        let (tag, rest) = line.split_once(' ').unwrap_or((line, ""));
        match tag {
            "path" => path = Some(rest.to_string()),
            "uid" => uid = Some(number(rest)?),
            "file" | "dir" => {
                let mut fields = rest.splitn(3, ' ');
                let (Some(owner), Some(mode), Some(last)) =
                    (fields.next(), fields.next(), fields.next())
                else {
                    return Err(malformed(tag));
                };
                let (owner, mode) = (number(owner)?, octal(mode)?);
                if tag == "file" {
                    file = Some((owner, mode, last.to_string()));
                } else {
                    dirs.push((last.to_string(), owner, mode));
                }
            }
            "sha256" => {
                if rest.len() != 64 || !rest.bytes().all(|b| b.is_ascii_hexdigit()) {
                    return Err(malformed("a sha256"));
                }
                sha256 = rest.to_ascii_lowercase();
            }
            _ => return Err(malformed("an unknown line")),
        }
    }
    let (Some(path), Some(uid), Some((owner, mode, kind))) = (path, uid, file) else {
        return Err(malformed("a line is missing"));
    };
    if kind == "regular file" && sha256.is_empty() {
        return Err(malformed("no sha256"));
    }
    Ok(Some(RemoteFile {
        path,
        uid,
        owner,
        mode,
        kind,
        dirs,
        sha256,
    }))
}

/// Looks at `path` on the host with [`INSPECT`]: `None` when nothing is there.
///
/// Errors: the command cannot run or fails (`readlink`, `stat`, `sha256sum` missing), or
/// prints what it should not.
async fn inspect(
    connection: &Connection,
    path: &str,
) -> std::result::Result<Option<RemoteFile>, String> {
    let (output, status) = connection
        .output(&format!("sh -c '{INSPECT}' sh {path}"), b"")
        .await
        .map_err(|e| format!("cannot inspect `{path}`: {e:#}"))?;
    if status != Some(0) {
        return Err(format!(
            "cannot inspect `{path}` (exit {status:?})\n\
             hint: the host needs `sh`, `readlink`, `stat` and `sha256sum` (coreutils)"
        ));
    }
    parse_inspection(&String::from_utf8_lossy(&output))
        .map_err(|problem| format!("cannot inspect `{path}`: {problem}"))
}

impl RemoteFile {
    /// Whether only the SSH user (or root) can have put this file there, as `path` (the
    /// name asked for) resolves.
    ///
    /// Errors: what is wrong and the command that fixes it: a path that resolves to one that
    /// is not plain, a file that is not a regular file, a file or directory owned by another
    /// user, a file writable by group or others, a directory writable by group or others
    /// without the sticky bit (others could rename another file into its place).
    fn check(&self, path: &str) -> std::result::Result<(), String> {
        let trusted = |owner: u32| owner == self.uid || owner == 0;
        let who = |owner: u32| format!("uid {owner}, not you (uid {}) or root", self.uid);
        if !safe_remote_path(&self.path) {
            return Err(format!(
                "`{path}` resolves to `{}`, which is not a plain path (letters, digits, `/._+-` only)",
                self.path.escape_debug()
            ));
        }
        if self.kind != "regular file" {
            return Err(format!(
                "`{path}` is a {}, not a program\nhint: point `infer-path` at the `infer` executable",
                self.kind.escape_debug()
            ));
        }
        let described = if path == self.path {
            format!("`{path}`")
        } else {
            format!("`{path}` (`{}`)", self.path)
        };
        if !trusted(self.owner) {
            return Err(format!(
                "{described} is owned by {}, so it was not run\n\
                 hint: `chown {} {}`, or install your own copy and name it with `infer-path`",
                who(self.owner),
                self.uid,
                self.path
            ));
        }
        if self.mode & 0o022 != 0 {
            return Err(format!(
                "{described} has mode {:04o} (writable by others: owner uid {}), so it was not run\n\
                 hint: `chmod go-w {}`, then rerun",
                self.mode, self.owner, self.path
            ));
        }
        for (dir, owner, mode) in &self.dirs {
            if !trusted(*owner) {
                return Err(format!(
                    "{described} is in `{dir}`, owned by {}: its owner could replace the file, so it was not run\n\
                     hint: install `infer` in a directory you own and name it with `infer-path`",
                    who(*owner)
                ));
            }
            if mode & 0o022 != 0 && mode & 0o1000 == 0 {
                return Err(format!(
                    "{described} is in `{dir}`, mode {mode:04o}: others can replace the file, so it was not run\n\
                     hint: `chmod go-w {dir}`, then rerun"
                ));
            }
        }
        Ok(())
    }
}

/// Checks that `preflight.model` is on `host` at the same path with the same sha256
/// (`model_sha`: sha256 and size in bytes), pushing it there when it is not and
/// `--push-model` allows; nothing without a model. Each stage passed goes to `stages`.
///
/// Errors (as the host's preflight failure): the agent is lost, the model is missing or
/// differs (without `--push-model`), the push fails.
async fn check_model(
    host: &RemoteHost,
    preflight: &Preflight,
    model_sha: &Option<(String, u64)>,
    stages: &tokio::sync::mpsc::UnboundedSender<(String, String)>,
) -> std::result::Result<(), PreflightFailure> {
    let passed = |stage: String| {
        let _ = stages.send((host.name.clone(), stage));
    };
    let fail = |stage: &'static str, message: String| preflight_failure(&host.name, stage, message);
    let (Some(model_path), Some(model_sha)) = (&preflight.model, model_sha) else {
        return Ok(());
    };
    let model = model_path.display().to_string();
    host.send(ToAgent::HashFile {
        path: model.clone(),
    })
    .map_err(|e| fail("agent", format!("{e:#}")))?;
    let (remote_sha, _) = host
        .wait_async("the model's sha256", |s| s.file_info.take())
        .await
        .map_err(|e| fail("model", format!("{e:#}")))?;
    match remote_sha {
        Some(sha) if sha == model_sha.0 => passed(format!("model `{model}` (sha256 matches)")),
        Some(_) if !preflight.push_model => {
            return Err(fail(
                "model different",
                format!(
                    "`{model}` differs from the launcher's copy (sha256); copy it there or rerun with `--push-model`"
                ),
            ));
        }
        None if !preflight.push_model => {
            return Err(fail(
                "model missing",
                format!("`{model}` does not exist there; copy it or rerun with `--push-model`"),
            ));
        }
        _ => {
            push_file(host, model_path, &model_sha.0)
                .await
                .map_err(|e| fail("model push", format!("{e:#}")))?;
            passed(format!("model `{model}` pushed (sha256 checked)"));
        }
    }
    Ok(())
}

async fn push_file(host: &RemoteHost, path: &Path, sha: &str) -> Result<()> {
    use std::io::Read;
    let mut file = File::open(path).with_context(|| format!("cannot read `{}`", path.display()))?;
    let size_bytes = file.metadata()?.len();
    let remote = path.display().to_string();
    host.send(ToAgent::FileStart {
        path: remote.clone(),
        size_bytes,
    })?;
    let mut buffer = vec![0u8; FILE_CHUNK_BYTES];
    loop {
        let n = file.read(&mut buffer)?;
        if n == 0 {
            break;
        }
        host.send(ToAgent::FileChunk {
            bytes: buffer[..n].to_vec(),
        })?;
    }
    host.send(ToAgent::FileEnd)?;
    let (remote_sha, _) = host
        .wait_async("the pushed model's sha256", |s| s.file_info.take())
        .await?;
    if remote_sha.as_deref() != Some(sha) {
        bail!("the pushed `{remote}` has another sha256 than the launcher's");
    }
    Ok(())
}

/// Runs `<file's resolved path> agent` (a file [`RemoteFile::check`] passed) and reads its
/// hello, whose sha256 becomes the one measured by [`INSPECT`] (what the program says about
/// itself is not trusted); `None` when nothing answers (not executable, another program).
async fn start_agent(
    connection: &Connection,
    file: &RemoteFile,
) -> Option<(AgentStream, AgentHello)> {
    if !safe_remote_path(&file.path) {
        return None;
    }
    let channel = connection
        .exec(&format!("{} agent", file.path))
        .await
        .ok()?;
    let mut stream = channel.into_stream();
    let hello = tokio::time::timeout(
        Duration::from_secs(30),
        read_frame_async::<FromAgent>(&mut stream),
    )
    .await;
    match hello {
        Ok(Ok(Some(FromAgent::Hello(mut hello)))) => {
            hello.sha256.clone_from(&file.sha256);
            Some((stream, *hello))
        }
        _ => None,
    }
}

/// An agent's exec channel as a byte stream (its stdin and stdout).
type AgentStream = russh::ChannelStream<russh::client::Msg>;

/// Starts the two tasks of a host: one writes the frames sent on the returned sender to
/// the agent's stdin (a `Shutdown` frame also closes it: EOF), the other applies every
/// frame the agent sends to `state` (and copies rank lines to their logs and the
/// launcher). Either marks the host lost when the channel fails.
fn pump_frames(
    stream: AgentStream,
    state: Arc<Mutex<HostState>>,
) -> tokio::sync::mpsc::UnboundedSender<ToAgent> {
    let (mut reader, mut writer) = tokio::io::split(stream);
    let (sender, mut frames) = tokio::sync::mpsc::unbounded_channel::<ToAgent>();
    let writer_state = Arc::clone(&state);
    tokio::spawn(async move {
        while let Some(frame) = frames.recv().await {
            let Ok(body) = serde_json::to_vec(&frame) else {
                continue;
            };
            let length = (body.len() as u32).to_le_bytes();
            let sent = async {
                writer.write_all(&length).await?;
                writer.write_all(&body).await?;
                writer.flush().await
            }
            .await;
            if let Err(error) = sent {
                mark_lost(&writer_state, format!("cannot write to the agent: {error}"));
                break;
            }
            if matches!(frame, ToAgent::Shutdown) {
                let _ = writer.shutdown().await;
                break;
            }
        }
    });
    let watched = Arc::clone(&state);
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_millis(250)).await;
            let Ok(mut state) = watched.lock() else { break };
            if state.lost.is_some() {
                break;
            }
            if state.heard.is_some_and(|at| at.elapsed() > AGENT_SILENCE) {
                state.lost = Some(format!(
                    "no word from its agent for {} s (network partition, or the host is down)",
                    AGENT_SILENCE.as_secs()
                ));
                break;
            }
        }
    });
    tokio::spawn(async move {
        let why = loop {
            match read_frame_async::<FromAgent>(&mut reader).await {
                Ok(Some(frame)) => apply(&state, frame),
                Ok(None) => {
                    break "the agent's channel closed (host down, or the connection lost)"
                        .to_string();
                }
                Err(error) => break format!("{error:#}"),
            }
        };
        mark_lost(&state, why);
    });
    sender
}

fn mark_lost(state: &Mutex<HostState>, why: String) {
    if let Ok(mut state) = state.lock()
        && state.lost.is_none()
    {
        state.lost = Some(why);
    }
}

fn apply(state: &Mutex<HostState>, frame: FromAgent) {
    let Ok(mut state) = state.lock() else { return };
    state.heard = Some(Instant::now());
    match frame {
        FromAgent::Hello(_) | FromAgent::Alive => {}
        FromAgent::Findings { findings } => state.findings = Some(findings),
        FromAgent::Cpu { profile } => state.cpu = Some(profile),
        FromAgent::Listening { address } => state.listening = Some(address),
        FromAgent::Reached { results } => state.reached = Some(results),
        FromAgent::Streamed { secs, error } => state.streamed = Some((secs, error)),
        FromAgent::Executed {
            program,
            code,
            stdout,
            stderr,
            error,
        } => {
            state.executed = Some(super::Executed {
                program,
                code,
                stdout,
                stderr,
                error,
            })
        }
        FromAgent::PortsChecked { taken } => state.ports_checked = Some(taken),
        FromAgent::StoreAt { address } => state.store_at = Some(Ok(address)),
        FromAgent::FileInfo {
            sha256, size_bytes, ..
        } => state.file_info = Some((sha256, size_bytes)),
        FromAgent::Spawned { rank, pid } => {
            state.spawned.insert(rank, Ok(pid));
        }
        FromAgent::Line { rank, line } => {
            if let Some((file, lines)) = state.sinks.get_mut(&rank) {
                let _ = writeln!(file, "{line}");
                let _ = lines.send((rank, line));
            }
        }
        FromAgent::Exited { rank, code, signal } => {
            let raw = match (code, signal) {
                (_, Some(signal)) => signal & 0x7f,
                (Some(code), None) => (code & 0xff) << 8,
                (None, None) => 0xff << 8,
            };
            state.exits.insert(rank, ExitStatus::from_raw(raw));
        }
        FromAgent::Error {
            rank: Some(rank),
            message,
        } => {
            state.spawned.insert(rank, Err(message));
        }
        FromAgent::Error {
            rank: None,
            message,
        } => {
            if state.store_at.is_none() {
                state.store_at = Some(Err(message.clone()));
            }
            state.errors.push(message);
        }
    }
}

async fn read_frame_async<T: for<'de> serde::Deserialize<'de>>(
    input: &mut (impl tokio::io::AsyncRead + Unpin),
) -> Result<Option<T>> {
    let mut length = [0u8; 4];
    match input.read_exact(&mut length).await {
        Ok(_) => {}
        Err(error) if error.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(error) => return Err(error.into()),
    }
    let length = u32::from_le_bytes(length);
    if length > MAX_FRAME_BYTES {
        bail!("a frame of {length} bytes exceeds the limit");
    }
    let mut body = vec![0u8; length as usize];
    input.read_exact(&mut body).await?;
    serde_json::from_slice(&body)
        .map(Some)
        .context("malformed agent frame")
}

/// Whether `path` can stand in a fixed remote command as it is: no shell metacharacters,
/// no leading `-`.
fn safe_remote_path(path: &str) -> bool {
    !path.is_empty()
        && !path.starts_with('-')
        && path
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"/._+-".contains(&b))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    const SHA: &str = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08";

    fn file(owner: u32, mode: u32, dirs: &[(&str, u32, u32)]) -> RemoteFile {
        RemoteFile {
            path: "/opt/infer/bin/infer".into(),
            uid: 1000,
            owner,
            mode,
            kind: "regular file".into(),
            dirs: dirs
                .iter()
                .map(|(d, o, m)| (d.to_string(), *o, *m))
                .collect(),
            sha256: SHA.into(),
        }
    }

    /// [`INSPECT`] run by a real `sh` here, as the SSH server runs it.
    fn inspect_here(path: &Path) -> Option<RemoteFile> {
        let output = std::process::Command::new("sh")
            .args(["-c", INSPECT, "sh"])
            .arg(path)
            .output()
            .expect("sh");
        assert!(output.status.success(), "{output:?}");
        parse_inspection(&String::from_utf8_lossy(&output.stdout)).expect("parses")
    }

    #[test]
    fn the_inspection_reads_owner_mode_directories_and_sha256_of_the_resolved_file() {
        let dir = tempfile::tempdir().expect("temp dir");
        let program = dir.path().join("prog");
        std::fs::write(&program, b"test").expect("write");
        std::fs::set_permissions(&program, std::fs::Permissions::from_mode(0o750)).expect("chmod");
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&program, &link).expect("symlink");
        let seen = inspect_here(&link).expect("a file");
        let real = std::fs::canonicalize(&program).expect("canonical");
        assert_eq!(seen.path, real.display().to_string());
        assert_eq!(seen.uid, rustix::process::geteuid().as_raw());
        assert_eq!((seen.owner, seen.mode), (seen.uid, 0o750));
        assert_eq!(seen.kind, "regular file");
        assert_eq!(seen.sha256, SHA);
        // Every directory up to `/`, nearest first.
        let parents: Vec<String> = real
            .ancestors()
            .skip(1)
            .map(|p| p.display().to_string())
            .collect();
        let dirs: Vec<String> = seen.dirs.iter().map(|(d, ..)| d.clone()).collect();
        assert_eq!(dirs, parents);
        let dir_mode = std::fs::metadata(dir.path())
            .expect("stat")
            .permissions()
            .mode();
        assert_eq!(seen.dirs[0].2, dir_mode & 0o7777);
        assert_eq!(inspect_here(&dir.path().join("absent")), None);
        assert_eq!(inspect_here(Path::new("/nonexistent/infer")), None);
        // A directory is seen, and not hashed.
        let seen = inspect_here(dir.path()).expect("a directory");
        assert_eq!(
            (seen.kind.as_str(), seen.sha256.as_str()),
            ("directory", "")
        );
        assert!(seen.check("d").unwrap_err().contains("not a program"));
    }

    #[test]
    fn staging_writes_a_private_file_in_a_private_directory() {
        let home = tempfile::tempdir().expect("temp dir");
        let run = |bytes: &[u8]| {
            let mut child = std::process::Command::new("sh")
                .args(["-c", STAGE, "sh", ".cache/infer/bin/infer-x"])
                .current_dir(home.path())
                .stdin(std::process::Stdio::piped())
                .spawn()
                .expect("sh");
            child
                .stdin
                .take()
                .expect("stdin")
                .write_all(bytes)
                .expect("write");
            assert!(child.wait().expect("wait").success());
        };
        run(b"old");
        // A directory left open by something else is made private again.
        let bin = home.path().join(".cache/infer/bin");
        std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o777)).expect("chmod");
        run(b"test");
        let staged = bin.join("infer-x");
        assert_eq!(std::fs::read(&staged).expect("read"), b"test");
        let mode = |p: &Path| std::fs::metadata(p).expect("stat").permissions().mode() & 0o7777;
        assert_eq!((mode(&staged), mode(&bin)), (0o700, 0o700));
        // Only the staged file: no temporary left behind.
        assert_eq!(std::fs::read_dir(&bin).expect("list").count(), 1);
        let seen = inspect_here(&staged).expect("a file");
        assert_eq!(seen.sha256, SHA);
        assert_eq!(seen.check(".cache/infer/bin/infer-x"), Ok(()));
    }

    #[test]
    fn inspection_output_that_is_not_the_commands_is_refused() {
        let good = format!(
            "path /a/b\nuid 0\nfile 0 755 regular file\ndir 0 755 /a\ndir 0 755 /\nsha256 {SHA}\n"
        );
        let parsed = parse_inspection(&good).expect("parses").expect("a file");
        assert_eq!(
            parsed.dirs,
            vec![("/a".into(), 0, 0o755), ("/".into(), 0, 0o755)]
        );
        assert_eq!(parse_inspection("missing\n"), Ok(None));
        for bad in [
            good.replace(&format!("sha256 {SHA}"), "sha256 abc"),
            good.replace(&format!("sha256 {SHA}\n"), ""),
            good.replace("uid 0\n", ""),
            good.replace("755 regular", "7x5 regular"),
            good.replace("uid 0", "uid -1"),
            format!("{good}extra line\n"),
            String::new(),
        ] {
            assert!(parse_inspection(&bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn only_files_that_nobody_else_could_have_written_pass() {
        let home = [
            ("/opt/infer/bin", 1000, 0o755),
            ("/opt/infer", 0, 0o755),
            ("/", 0, 0o755),
        ];
        let path = "/opt/infer/bin/infer";
        assert_eq!(file(1000, 0o755, &home).check(path), Ok(()));
        assert_eq!(file(0, 0o700, &home).check(path), Ok(()));
        // A sticky world-writable directory (as /tmp) lets nobody else rename files away.
        let tmp = [("/tmp", 0, 0o1777), ("/", 0, 0o755)];
        assert_eq!(file(1000, 0o755, &tmp).check(path), Ok(()));
        // Group or world writable file: refused, with the fix.
        for mode in [0o775, 0o757, 0o777] {
            let problem = file(1000, mode, &home).check(path).unwrap_err();
            assert!(
                problem.contains(&format!("mode {mode:04o}"))
                    && problem.contains("chmod go-w /opt/infer/bin/infer"),
                "{problem}"
            );
        }
        // Another user's file, or a directory another user owns.
        let problem = file(1001, 0o755, &home).check(path).unwrap_err();
        assert!(
            problem.contains("uid 1001, not you (uid 1000) or root"),
            "{problem}"
        );
        let bobs = [("/home/bob/bin", 1001, 0o755), ("/", 0, 0o755)];
        let problem = file(1000, 0o755, &bobs).check(path).unwrap_err();
        assert!(
            problem.contains("`/home/bob/bin`, owned by uid 1001"),
            "{problem}"
        );
        // A directory others can write (no sticky bit): they could swap the file.
        let shared = [("/opt/infer/bin", 0, 0o775), ("/", 0, 0o755)];
        let problem = file(1000, 0o755, &shared).check(path).unwrap_err();
        assert!(problem.contains("chmod go-w /opt/infer/bin"), "{problem}");
        // The name asked for is shown with what it resolves to.
        let problem = file(1000, 0o777, &home).check("bin/infer").unwrap_err();
        assert!(
            problem.starts_with("`bin/infer` (`/opt/infer/bin/infer`)"),
            "{problem}"
        );
        // A link to a path that could not stand in a command.
        let mut odd = file(1000, 0o755, &home);
        odd.path = "/opt/my infer".into();
        assert!(odd.check(path).unwrap_err().contains("not a plain path"));
    }
}
