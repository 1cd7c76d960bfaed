//! `infer agent`: the remote end of a run on one host, started once per host over one SSH
//! exec channel (never a channel per rank: OpenSSH allows 10 per connection by default).
//! It reads [`ToAgent`] frames on stdin and answers with [`FromAgent`] frames on stdout:
//! it starts one `infer rank` per rank in its own process group with a parent-death signal,
//! streams every output line back, reports exits, may host the rendezvous store, and runs
//! the doctor's authenticated probes (`probes.rs`).
//!
//! It is the remote end of gang semantics: it stops every rank group (SIGTERM, grace,
//! SIGKILL) when stdin reaches EOF (the launcher or its connection died), when the launcher
//! has been silent for the lease (a network partition), or when told to. Each run records
//! its process groups in `~/.cache/infer/runs/RUN_ID/pgids`, so `infer agent --kill RUN_ID`
//! over a fresh connection stops exactly that run (a group is signalled only if its leader
//! carries `INFER_RUN_ID=RUN_ID` in its environment: never pattern matching on names).

use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use sha2::Digest;

use super::GRACE_PERIOD;
use super::protocol::{
    AgentHello, FromAgent, ToAgent, read_frame, valid_host_dir, valid_run_id, write_frame,
};
use crate::rendezvous::StoreServer;
use crate::topology::Interface;

/// The frame writer shared by the main loop and the rank output threads.
type Output = Arc<Mutex<std::io::Stdout>>;

/// Runs the agent on stdin/stdout until the launcher goes away or says to shut down.
///
/// Errors: stdout is gone before the first frame, or the first frame is not a run.
pub fn run_agent() -> Result<()> {
    let output: Output = Arc::new(Mutex::new(std::io::stdout()));
    let exe = std::env::current_exe().context("cannot find the agent's own executable")?;
    let hello = hello(&exe)?;
    send(&output, &FromAgent::Hello(Box::new(hello)));
    let frames = read_stdin_frames();
    // The first frame names the run; a probe (staging, topology) may end here with EOF.
    let (run_id, host, lease) = match frames.recv() {
        Ok(Ok(ToAgent::Run {
            run_id,
            host,
            lease_secs,
        })) => (run_id, host, Duration::from_secs(lease_secs.max(1))),
        Ok(Ok(ToAgent::HashFile { path })) => {
            send(&output, &file_info(&path));
            return Ok(());
        }
        Ok(Ok(other)) => bail!("the first frame must name the run, got {other:?}"),
        Ok(Err(_)) | Err(_) => return Ok(()),
    };
    if !valid_run_id(&run_id) {
        bail!("`{run_id}` is not a run id of `infer`");
    }
    if !valid_host_dir(&host) {
        bail!("host name `{host}` cannot name a directory");
    }
    let run_dir = runs_dir()?.join(&run_id).join(&host);
    super::run_dir::private_dir(&run_dir)
        .with_context(|| format!("cannot create `{}`", run_dir.display()))?;
    let mut agent = Agent {
        output,
        exe,
        run_id,
        run_dir,
        ranks: HashMap::new(),
        store: None,
        store_lost: Arc::default(),
        store_watch: Arc::default(),
        upload: None,
    };
    let reason = agent.serve(&frames, lease);
    // Say why before the ranks' exits are reported (the launcher may still be listening).
    agent.error(None, format!("stopping every rank: {reason}"));
    agent.stop_all();
    let _ = std::fs::remove_file(agent.run_dir.join("pgids"));
    // What ended the run goes to the host's log of this run (the launcher may be gone).
    if let Ok(mut log) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(agent.run_dir.join("agent.log"))
    {
        let _ = writeln!(log, "agent stopped: {reason}");
    }
    Ok(())
}

/// `infer agent --kill RUN_ID [--host NAME]`: stops exactly that run's rank groups on this
/// host (those recorded under `NAME`, or under any host name of the run when `None`, as
/// where hosts share a home directory; only live local groups of the run are signalled).
///
/// Errors: a malformed run id or host name. A run that is already gone is not an error.
pub fn kill_run(run_id: &str, host: Option<&str>) -> Result<usize> {
    if !valid_run_id(run_id) {
        bail!("`{run_id}` is not a run id of `infer` (they look like `run-1a2b3c4d`)");
    }
    let run_dir = runs_dir()?.join(run_id);
    let host_dirs: Vec<PathBuf> = match host {
        Some(host) if valid_host_dir(host) => vec![run_dir.join(host)],
        Some(host) => bail!("`{host}` is not a host name of an inventory"),
        None => std::fs::read_dir(&run_dir)
            .map(|entries| entries.filter_map(|e| Some(e.ok()?.path())).collect())
            .unwrap_or_default(),
    };
    let text: String = host_dirs
        .iter()
        .filter_map(|dir| std::fs::read_to_string(dir.join("pgids")).ok())
        .collect();
    let marker = format!("{}={run_id}", crate::envvars::RUN_ID);
    let groups: Vec<i32> = text
        .lines()
        .filter_map(|line| line.split_whitespace().nth(1)?.parse().ok())
        .filter(|pgid: &i32| {
            // Only a group whose leader is still this run's rank: pids are reused.
            std::fs::read(format!("/proc/{pgid}/environ"))
                .is_ok_and(|environ| environ.split(|b| *b == 0).any(|v| v == marker.as_bytes()))
        })
        .collect();
    signal_groups(&groups, rustix::process::Signal::TERM);
    let deadline = Instant::now() + GRACE_PERIOD;
    while Instant::now() < deadline && groups.iter().any(|g| group_alive(*g)) {
        std::thread::sleep(Duration::from_millis(20));
    }
    signal_groups(&groups, rustix::process::Signal::KILL);
    Ok(groups.len())
}

/// A run's ranks on this host.
struct Agent {
    output: Output,
    exe: PathBuf,
    run_id: String,
    run_dir: PathBuf,
    ranks: HashMap<usize, Child>,
    /// The rendezvous store, when this host runs it (rank 0's host).
    store: Option<StoreServer>,
    /// Set by the store watcher when the store has been unreachable for the lease: why.
    store_lost: Arc<Mutex<Option<String>>>,
    /// Which store the watcher watches: each [`ToAgent::WatchStore`] counts one up, and a
    /// watcher of an older store (a restarted gang's) ends without a word.
    store_watch: Arc<std::sync::atomic::AtomicU64>,
    /// A file being pushed: (final path, temporary file, its path).
    upload: Option<(PathBuf, File, PathBuf)>,
}

impl Agent {
    /// Handles frames until the run ends, and says why it ended.
    fn serve(&mut self, frames: &Receiver<Result<ToAgent>>, lease: Duration) -> String {
        let mut heard = Instant::now();
        let mut said = Instant::now();
        loop {
            if said.elapsed() >= Duration::from_secs(1) {
                send(&self.output, &FromAgent::Alive);
                said = Instant::now();
            }
            match frames.recv_timeout(Duration::from_millis(50)) {
                Ok(Ok(ToAgent::Shutdown)) => return "the launcher asked to shut down".into(),
                Ok(Ok(frame)) => {
                    heard = Instant::now();
                    self.handle(frame, lease);
                }
                Ok(Err(error)) => return format!("unreadable frame from the launcher: {error:#}"),
                Err(RecvTimeoutError::Disconnected) => {
                    return "stdin closed: the launcher or its connection is gone".into();
                }
                Err(RecvTimeoutError::Timeout) => {}
            }
            if let Some(why) = self.store_lost.lock().ok().and_then(|mut l| l.take()) {
                return why;
            }
            if heard.elapsed() > lease {
                return format!(
                    "no word from the launcher for {} s (lease): network partition?",
                    lease.as_secs()
                );
            }
            self.reap();
        }
    }

    fn handle(&mut self, frame: ToAgent, lease: Duration) {
        match frame {
            ToAgent::WatchStore { address, keys } => {
                let keys = match crate::keyring::Keyring::from_text(&keys.0) {
                    Ok(keys) => keys,
                    Err(error) => return self.error(None, format!("{error:#}")),
                };
                let lost = Arc::clone(&self.store_lost);
                let current = Arc::clone(&self.store_watch);
                let watch = current.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
                std::thread::spawn(move || {
                    watch_store(&address, &keys, lease, &lost, &|| {
                        current.load(std::sync::atomic::Ordering::SeqCst) == watch
                    })
                });
            }
            ToAgent::Run { .. } | ToAgent::Heartbeat | ToAgent::Shutdown => {}
            ToAgent::Doctor => self.doctor(),
            ToAgent::ProbeCpu => self.probe_cpu(),
            ToAgent::Listen {
                bind,
                secret,
                host,
                max_stream_bytes,
            } => match secret
                .context(super::probes::OLDER_LAUNCHER)
                .and_then(|secret| super::probes::listen(&bind, secret, host, max_stream_bytes))
            {
                Ok(address) => send(
                    &self.output,
                    &FromAgent::Listening {
                        address: address.to_string(),
                    },
                ),
                Err(error) => self.error(None, format!("{error:#}")),
            },
            ToAgent::Stream {
                from,
                to,
                bytes,
                secret,
                host,
                to_host,
            } => {
                let output = Arc::clone(&self.output);
                std::thread::spawn(move || {
                    let streamed = match &secret {
                        Some(secret) => {
                            super::probes::stream_to(&from, &to, to_host, bytes, secret, host)
                        }
                        None => Err(super::probes::OLDER_LAUNCHER.into()),
                    };
                    let (secs, error) = match streamed {
                        Ok(secs) => (Some(secs), None),
                        Err(error) => (None, Some(error)),
                    };
                    send(&output, &FromAgent::Streamed { secs, error });
                });
            }
            ToAgent::Connect { from, to } => self.connect(from, to),
            ToAgent::Reach {
                from,
                targets,
                target_hosts,
                secret,
                host,
            } => {
                let output = Arc::clone(&self.output);
                std::thread::spawn(move || {
                    let results = super::probes::reach_each(
                        &from,
                        &targets,
                        &target_hosts,
                        secret.as_ref(),
                        host,
                    );
                    send(&output, &FromAgent::Reached { results });
                });
            }
            ToAgent::HostStore { bind, keys } => match crate::keyring::Keyring::from_text(&keys.0)
                .and_then(|keys| StoreServer::start(&bind, &keys))
            {
                Ok(server) => {
                    send(
                        &self.output,
                        &FromAgent::StoreAt {
                            address: server.address().to_string(),
                        },
                    );
                    self.store = Some(server);
                }
                Err(error) => self.error(None, format!("{error:#}")),
            },
            ToAgent::HashFile { path } => {
                // Hashing a large model takes a while: the loop must keep answering.
                let output = Arc::clone(&self.output);
                std::thread::spawn(move || send(&output, &file_info(&path)));
            }
            ToAgent::FileStart { path, .. } => self.start_upload(&path),
            ToAgent::FileChunk { bytes } => self.write_upload(&bytes),
            ToAgent::FileEnd => self.finish_upload(),
            ToAgent::Spawn {
                rank,
                env,
                keys,
                argv,
            } => match self.spawn(rank, &env, &keys.0, argv.as_deref()) {
                Ok(pid) => send(&self.output, &FromAgent::Spawned { rank, pid }),
                Err(error) => self.error(Some(rank), format!("{error:#}")),
            },
            ToAgent::Exec {
                argv,
                env,
                timeout_secs,
            } => self.exec(argv, env, timeout_secs),
            ToAgent::CheckPorts { ports } => {
                let taken = ports
                    .into_iter()
                    .filter_map(|(address, port)| {
                        std::net::TcpListener::bind((address.as_str(), port))
                            .err()
                            .map(|error| (address, port, error.to_string()))
                    })
                    .collect();
                send(&self.output, &FromAgent::PortsChecked { taken });
            }
            ToAgent::Signal { rank, signal } => {
                if let Some(child) = self.ranks.get_mut(&rank)
                    && matches!(child.try_wait(), Ok(None))
                    && let Some(signal) = rustix::process::Signal::from_named_raw(signal)
                {
                    signal_groups(&[child.id() as i32], signal);
                }
            }
        }
    }

    /// Runs this host's live doctor checks on a thread of their own and sends their
    /// findings (or the error that stopped them).
    fn doctor(&self) {
        let output = Arc::clone(&self.output);
        std::thread::spawn(move || {
            let findings = match crate::doctor::checks::live(Path::new("/sys")) {
                Ok(findings) => findings
                    .iter()
                    .map(crate::doctor::WireFinding::from_finding)
                    .collect(),
                Err(error) => {
                    return send(
                        &output,
                        &FromAgent::Error {
                            rank: None,
                            message: format!("{error:#}"),
                        },
                    );
                }
            };
            send(&output, &FromAgent::Findings { findings });
        });
    }

    /// Probes this host's CPU on a thread of its own (a fraction of a second of every core)
    /// and answers with [`FromAgent::Cpu`], or an error.
    fn probe_cpu(&self) {
        let output = Arc::clone(&self.output);
        std::thread::spawn(move || {
            let frame = match crate::inventory::probe_cpu_for_planning() {
                Ok(profile) => FromAgent::Cpu { profile },
                Err(error) => FromAgent::Error {
                    rank: None,
                    message: format!("cannot probe the CPU: {error:#}"),
                },
            };
            send(&output, &frame);
        });
    }

    /// Connects from address `from` to `to` once, on a thread of its own, and sends the
    /// result with its round trip in microseconds (or why it failed).
    fn connect(&self, from: String, to: String) {
        let output = Arc::clone(&self.output);
        std::thread::spawn(move || {
            let started = Instant::now();
            let connected = super::probes::connect_from(&from, &to).map(drop);
            let result = super::protocol::ReachResult {
                rtt_us: connected
                    .is_ok()
                    .then(|| started.elapsed().as_micros() as u64),
                seen_as: None,
                error: connected.err(),
                to,
                from,
            };
            send(
                &output,
                &FromAgent::Reached {
                    results: vec![result],
                },
            );
        });
    }

    /// Opens the temporary file an upload to `path` is written into (its folder created).
    /// A failure is sent to the launcher as an error.
    fn start_upload(&mut self, path: &str) {
        let target = PathBuf::from(path);
        let temporary = target.with_extension("infer-upload");
        // A new file (`O_EXCL`, never through a link another user planted), 0600 until the
        // upload is whole.
        let opened = target
            .parent()
            .map_or(Ok(()), std::fs::create_dir_all)
            .and_then(|()| {
                use std::os::unix::fs::OpenOptionsExt;
                let _ = std::fs::remove_file(&temporary);
                std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .mode(0o600)
                    .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
                    .open(&temporary)
            });
        match opened {
            Ok(file) => self.upload = Some((target, file, temporary)),
            Err(error) => self.error(None, format!("cannot create `{path}`: {error}")),
        }
    }

    /// Appends `bytes` to the upload in progress; a write that fails ends the upload and is
    /// sent to the launcher as an error.
    fn write_upload(&mut self, bytes: &[u8]) {
        if let Some((target, file, _)) = &mut self.upload
            && let Err(error) = file.write_all(bytes)
        {
            let message = format!("cannot write `{}`: {error}", target.display());
            self.upload = None;
            self.error(None, message);
        }
    }

    /// Syncs the upload in progress and renames it to its path, then sends the file's
    /// sha256 and size (hashed on a thread of its own). A failure is sent as an error.
    fn finish_upload(&mut self) {
        if let Some((target, file, temporary)) = self.upload.take() {
            let done = file
                .sync_all()
                .and_then(|()| std::fs::rename(&temporary, &target));
            match done {
                Ok(()) => {
                    let output = Arc::clone(&self.output);
                    let path = target.display().to_string();
                    std::thread::spawn(move || send(&output, &file_info(&path)));
                }
                Err(error) => self.error(
                    None,
                    format!("cannot finish `{}`: {error}", target.display()),
                ),
            }
        }
    }

    /// Runs `argv` with `env` on a thread of its own, for at most `timeout_secs`, and sends
    /// what it printed and how it ended.
    fn exec(&self, argv: Vec<String>, env: Vec<(String, String)>, timeout_secs: u64) {
        let output = Arc::clone(&self.output);
        std::thread::spawn(move || {
            let done = super::run_program(&argv, &env, Duration::from_secs(timeout_secs));
            send(
                &output,
                &FromAgent::Executed {
                    program: done.program,
                    code: done.code,
                    stdout: done.stdout,
                    stderr: done.stderr,
                    error: done.error,
                },
            )
        });
    }

    fn error(&self, rank: Option<usize>, message: String) {
        send(&self.output, &FromAgent::Error { rank, message });
    }

    /// Starts one rank (or, with `argv`, another program as member `rank`): its own
    /// process group, a parent-death signal, exactly `env`.
    fn spawn(
        &mut self,
        rank: usize,
        env: &[(String, String)],
        keys: &str,
        argv: Option<&[String]>,
    ) -> Result<u32> {
        if self.ranks.contains_key(&rank) {
            bail!("rank {rank} was already started on this host");
        }
        let log = self.run_dir.join(format!("rank{rank}.log"));
        let mut env = env.to_vec();
        env.push((crate::envvars::RUN_ID.into(), self.run_id.clone()));
        let output = Arc::clone(&self.output);
        let line = move |line| send(&output, &FromAgent::Line { rank, line });
        let child = match argv {
            None => super::start_rank_process(&self.exe, rank, &env, keys, &log, line)?,
            Some(argv) => {
                let Some((name, args)) = argv.split_first() else {
                    bail!("an empty command line");
                };
                let path = std::env::var_os("PATH").unwrap_or_default();
                let program = super::find_program(name, &path)
                    .with_context(|| format!("`{name}` is not on this host's PATH"))?;
                super::start_process(&program, args, &env, &log, line)?
            }
        };
        let pid = child.id();
        let mut pgids = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.run_dir.join("pgids"))
            .context("cannot record the rank's process group")?;
        writeln!(pgids, "{rank} {pid}").context("cannot record the rank's process group")?;
        self.ranks.insert(rank, child);
        Ok(pid)
    }

    /// Reports ranks that have exited since the last look.
    fn reap(&mut self) {
        let exited: Vec<(usize, std::process::ExitStatus)> = self
            .ranks
            .iter_mut()
            .filter_map(|(rank, child)| Some((*rank, child.try_wait().ok()??)))
            .collect();
        for (rank, status) in exited {
            self.ranks.remove(&rank);
            // Let the output threads send the last lines first.
            std::thread::sleep(Duration::from_millis(20));
            send(
                &self.output,
                &FromAgent::Exited {
                    rank,
                    code: status.code(),
                    signal: status.signal(),
                },
            );
        }
    }

    /// SIGTERM to every live rank group, SIGKILL after the grace period, reap all.
    fn stop_all(&mut self) {
        let groups: Vec<i32> = self.ranks.values().map(|c| c.id() as i32).collect();
        signal_groups(&groups, rustix::process::Signal::TERM);
        let deadline = Instant::now() + GRACE_PERIOD;
        while Instant::now() < deadline
            && self
                .ranks
                .values_mut()
                .any(|c| matches!(c.try_wait(), Ok(None)))
        {
            std::thread::sleep(Duration::from_millis(20));
        }
        signal_groups(&groups, rustix::process::Signal::KILL);
        for child in self.ranks.values_mut() {
            let _ = child.wait();
        }
        self.reap();
    }
}

/// Polls the store every second while `current()` (no newer store replaced it); when it
/// has been unreachable for `lease`, says so in `lost` (the agent then stops its ranks).
fn watch_store(
    address: &str,
    keys: &crate::keyring::Keyring,
    lease: Duration,
    lost: &Mutex<Option<String>>,
    current: &dyn Fn() -> bool,
) {
    let mut reached = Instant::now();
    let mut client = None;
    loop {
        if !current() {
            return;
        }
        if client.is_none() {
            client = crate::rendezvous::StoreClient::connect(
                address,
                keys,
                None,
                Duration::from_secs(1),
            )
            .ok();
        }
        let key = format!("agents/{}/watch", keys.host());
        match client.as_mut().map(|c| c.add(&key, 0)) {
            Some(Ok(_)) => reached = Instant::now(),
            _ => client = None,
        }
        if reached.elapsed() > lease {
            if let Ok(mut lost) = lost.lock() {
                *lost = Some(format!(
                    "lost the rendezvous store at {address} for {} s",
                    lease.as_secs()
                ));
            }
            return;
        }
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// Sends one frame; a launcher that is gone is noticed by the stdin reader instead.
fn send(output: &Output, frame: &FromAgent) {
    if let Ok(mut out) = output.lock() {
        let _ = write_frame(&mut *out, frame);
    }
}

/// Frames from stdin on a channel; the channel closes at EOF or a read error (after
/// sending the error).
fn read_stdin_frames() -> Receiver<Result<ToAgent>> {
    let (sender, receiver) = channel();
    std::thread::spawn(move || {
        let mut stdin = std::io::stdin().lock();
        loop {
            match read_frame::<ToAgent>(&mut stdin) {
                Ok(Some(frame)) => {
                    if sender.send(Ok(frame)).is_err() {
                        break;
                    }
                }
                Ok(None) => break,
                Err(error) => {
                    let _ = sender.send(Err(error));
                    break;
                }
            }
        }
    });
    receiver
}

/// `~/.cache/infer/runs`.
fn runs_dir() -> Result<PathBuf> {
    let home = std::env::var_os("HOME").context("`HOME` is not set on this host")?;
    Ok(Path::new(&home).join(".cache/infer/runs"))
}

fn hello(exe: &Path) -> Result<AgentHello> {
    let sha256 = sha256_file(exe)?
        .context("the agent's executable vanished")?
        .0;
    let networks = crate::topology::probe::ipv4_networks();
    let host = crate::topology::probe::probe_host(&crate::topology::probe::ProbeOptions {
        sysfs_root: "/sys".into(),
    })?;
    let mut interfaces: Vec<Interface> = host
        .nics
        .iter()
        .filter_map(|nic| {
            let netdev = nic.netdev.clone().unwrap_or_else(|| nic.name.clone());
            Some(Interface {
                ipv4: networks.get(&netdev)?.clone(),
                up: nic
                    .state
                    .as_deref()
                    .is_some_and(|s| s.eq_ignore_ascii_case("up")),
                is_virtual: nic.is_virtual,
                mtu_bytes: nic.mtu_bytes,
                name: netdev,
            })
        })
        .collect();
    interfaces.sort_by(|a, b| a.name.cmp(&b.name));
    interfaces.dedup_by(|a, b| a.name == b.name);
    Ok(AgentHello {
        version: env!("CARGO_PKG_VERSION").into(),
        sha256,
        exe: exe.display().to_string(),
        arch: std::env::consts::ARCH.into(),
        hostname: host.hostname.clone(),
        n_cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
        interfaces,
        run_dir: runs_dir()?.display().to_string(),
        topology: host,
        nccl: crate::topology::nccl::find(),
        unix_time_ms: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64),
    })
}

fn file_info(path: &str) -> FromAgent {
    let (sha256, size_bytes) = match sha256_file(Path::new(path)) {
        Ok(Some((sha, size))) => (Some(sha), size),
        _ => (None, 0),
    };
    FromAgent::FileInfo {
        path: path.into(),
        sha256,
        size_bytes,
    }
}

/// sha256 (hex) and size of a file; `None` when it does not exist.
pub fn sha256_file(path: &Path) -> Result<Option<(String, u64)>> {
    let mut file = match File::open(path) {
        Ok(file) => file,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(error) => {
            return Err(error).with_context(|| format!("cannot read `{}`", path.display()));
        }
    };
    let mut hasher = sha2::Sha256::new();
    let mut buffer = vec![0u8; 1 << 20];
    let mut size = 0u64;
    loop {
        let n = std::io::Read::read(&mut file, &mut buffer)
            .with_context(|| format!("cannot read `{}`", path.display()))?;
        if n == 0 {
            break;
        }
        hasher.update(&buffer[..n]);
        size += n as u64;
    }
    let digest = hasher.finalize();
    Ok(Some((
        digest.iter().map(|b| format!("{b:02x}")).collect(),
        size,
    )))
}

fn signal_groups(groups: &[i32], signal: rustix::process::Signal) {
    for group in groups {
        if let Some(pid) = rustix::process::Pid::from_raw(*group) {
            let _ = rustix::process::kill_process_group(pid, signal);
        }
    }
}

fn group_alive(group: i32) -> bool {
    rustix::process::Pid::from_raw(group)
        .is_some_and(|pid| rustix::process::test_kill_process_group(pid).is_ok())
}
