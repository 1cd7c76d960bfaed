//! The launcher→rank contract, typed: everything `infer rank` learns from its environment.
//! `launch/` builds a [`RankEnv`] per rank and spawns the process with
//! [`RankEnv::to_env`] (plus its host's keys, which never appear in `manifest.json`); the rank
//! reads it back with [`RankEnv::from_env`]. A serving rank's settings (`infer up`) ride along
//! as [`ServingEnv`]. Every name is a constant: torchrun's and NCCL's here, ours in
//! [`crate::envvars`]; a new option is a field here, written and read in one place.
//!
//! Errors name the variable and say what was wrong with it.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use anyhow::{Context, Result, bail};

use crate::degrees::Degrees;
use crate::envvars as var;
use crate::runtime::cpu::quant::Numerics;
use crate::runtime::model::source::ModelSource;

/// The rank's global index (torchrun's name).
pub(crate) const RANK: &str = "RANK";
/// Ranks in the gang.
pub(crate) const WORLD_SIZE: &str = "WORLD_SIZE";
/// The rank's index among its host's ranks.
pub(crate) const LOCAL_RANK: &str = "LOCAL_RANK";
/// Ranks on the rank's host.
pub(crate) const LOCAL_WORLD_SIZE: &str = "LOCAL_WORLD_SIZE";
/// The store's address as the rank reaches it.
pub(crate) const MASTER_ADDR: &str = "MASTER_ADDR";
/// The store's port.
pub(crate) const MASTER_PORT: &str = "MASTER_PORT";
/// The GPUs the rank sees (empty for CPU ranks).
pub(crate) const CUDA_VISIBLE_DEVICES: &str = "CUDA_VISIBLE_DEVICES";
/// `PCI_BUS_ID`, so GPU numbers match `nvidia-smi`'s.
pub(crate) const CUDA_DEVICE_ORDER: &str = "CUDA_DEVICE_ORDER";
/// NCCL's socket interface (`=name`: exactly that one).
pub(crate) const NCCL_SOCKET_IFNAME: &str = "NCCL_SOCKET_IFNAME";
/// Gloo's socket interface (PyTorch's CPU collectives), the same interface.
pub(crate) const GLOO_SOCKET_IFNAME: &str = "GLOO_SOCKET_IFNAME";
/// The HCAs NCCL may use (`=mlx5_0,mlx5_1`: exact names).
pub(crate) const NCCL_IB_HCA: &str = "NCCL_IB_HCA";
/// The C++ compiler the host harness builds the kernels with.
pub const CXX: &str = "CXX";

/// What a rank process is told by its launcher.
#[derive(Clone, Debug, PartialEq)]
pub struct RankEnv {
    /// Global rank, `0..world_size`; ranks are ordered DP, PP, TP (TP fastest), as vLLM's.
    pub rank: usize,
    pub world_size: usize,
    /// Index among the ranks on this host, which are consecutive.
    pub local_rank: usize,
    pub local_world_size: usize,
    /// The rendezvous store, as this rank reaches it.
    pub store: SocketAddr,
    /// The layout; `ep` is 1, or `tp` (experts sharded over each TP group).
    pub degrees: Degrees,
    pub threads: usize,
    pub numerics: Numerics,
    /// Timeout of every collective and store wait (whole seconds on the wire).
    pub timeout: Duration,
    /// The weights; `None`: a rank of collectives only.
    pub model: Option<ModelSource>,
    /// Collectives on this host over TCP only ([`var::SHM_DISABLE`]).
    pub shm_disable: bool,
    /// `CUDA_VISIBLE_DEVICES`: empty for CPU ranks, the rank's GPU for device ranks.
    pub cuda_visible_devices: String,
    /// `--device cuda`: where NVIDIA's libraries are and whether the kernels run on the
    /// host harness; `None`: the CPU engine.
    pub device: Option<DeviceEnv>,
    /// The host's own settings on a multi-host run.
    pub host: HostEnv,
    /// `infer up`'s settings; `None` for `infer generate`, benches and probes.
    pub serving: Option<ServingEnv>,
    /// A fault for the tests to inject ([`var::TEST_FAULT`]; debug builds only).
    pub test_fault: Option<TestFault>,
    /// Which start of its DP replica this rank is ([`var::INCARNATION`]; 0: the first).
    pub incarnation: usize,
}

/// A fault a rank injects into itself, for the tests ([`var::TEST_FAULT`]): rank `rank`
/// stops making progress at its `step`th step (1-based) and waits there until it is
/// stopped, its process and heartbeats alive: a stall, as a wedged collective or kernel
/// gives. Only debug builds (what the tests run) honour it; a release build refuses it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TestFault {
    /// The global rank that stalls.
    pub rank: usize,
    /// The step, counted by that rank from 1, at which it stalls.
    pub step: u64,
}

impl TestFault {
    /// Reads `stall:rank=R:step=N`.
    ///
    /// Errors: another form, or any value in a release build.
    pub fn parse(text: &str) -> Result<TestFault> {
        if !cfg!(debug_assertions) {
            bail!(
                "`{}` is set (`{text}`), but injecting faults is for the tests: a release build refuses it; unset it",
                var::TEST_FAULT
            );
        }
        let fields: Vec<&str> = text.split(':').collect();
        let value = |field: &str, key: &str| {
            field
                .strip_prefix(key)
                .and_then(|v| v.strip_prefix('='))
                .and_then(|v| v.parse::<u64>().ok())
        };
        match fields.as_slice() {
            ["stall", rank, step] => match (value(rank, "rank"), value(step, "step")) {
                (Some(rank), Some(step)) if step > 0 => Ok(TestFault {
                    rank: rank as usize,
                    step,
                }),
                _ => bail!(
                    "`{}` is `{text}`, not `stall:rank=R:step=N` (N from 1)",
                    var::TEST_FAULT
                ),
            },
            _ => bail!(
                "`{}` is `{text}`, not `stall:rank=R:step=N`",
                var::TEST_FAULT
            ),
        }
    }

    /// The launcher's own [`var::TEST_FAULT`], which it passes to its ranks.
    ///
    /// Errors: as [`TestFault::parse`].
    pub fn from_process_env() -> Result<Option<TestFault>> {
        process_env(var::TEST_FAULT)
            .map(|text| TestFault::parse(&text))
            .transpose()
    }
}

/// A `--device cuda` rank's environment.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeviceEnv {
    /// The launcher's search path for NVIDIA's libraries (a `PATH`-style list).
    pub lib_dirs: Option<String>,
    /// The kernels run on the host harness ([`var::CUDA_HOST_HARNESS`]).
    pub host_harness: bool,
    /// The harness's C++ compiler.
    pub cxx: Option<String>,
}

/// The settings of the host a rank runs on (all unset on a one-host run).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HostEnv {
    /// Inventory name.
    pub name: Option<String>,
    /// The data-network address the rank's collectives and KV inbox listen on.
    pub bind_addr: Option<String>,
    /// The data interface (NCCL's and Gloo's socket interface).
    pub socket_ifname: Option<String>,
    /// The HCAs nearest the rank (exact names).
    pub ib_hcas: Vec<String>,
}

/// A serving rank's settings: what `infer up` validated, for the replica drivers and rank
/// 0's HTTP server.
#[derive(Clone, Debug, PartialEq)]
pub struct ServingEnv {
    /// Where rank 0 serves HTTP.
    pub http_host: String,
    pub http_port: u16,
    /// Where clients reach that server when the launcher forwards to it (the user's
    /// `--host`); `None`: `http_host` itself.
    pub client_host: Option<String>,
    /// Most sequences a step runs.
    pub max_batch: usize,
    /// Most tokens a step runs (`None`: the host's default).
    pub max_num_batched_tokens: Option<usize>,
    pub prefix_cache: bool,
    /// What `/v1/models` answers.
    pub model_id: String,
    /// KV-cache positions of each replica.
    pub kv_cache_tokens: usize,
    pub api_key: Option<String>,
    /// `/metrics` requires the API key too ([`var::PROTECT_METRICS`]).
    pub protect_metrics: bool,
    /// The first this many replicas prefill, the others decode.
    pub pd_prefill: Option<usize>,
    /// How long requests in flight may finish after SIGTERM.
    pub shutdown_timeout: Duration,
    /// A replica with work and no progress for longer is stalled (`--stall-timeout`).
    pub stall_timeout: Duration,
    /// Longest prompt plus completion, tokens (`None`: the model's context).
    pub max_model_len: Option<usize>,
    /// Requests that may wait beyond those running (`--max-queued-requests`; `None`: no
    /// bound).
    pub max_queued_requests: Option<usize>,
    /// Whether a lost DP replica (other than rank 0's) is restarted alone while the others
    /// serve ([`var::REPLICA_RESTARTS`]).
    pub replica_restarts: bool,
}

/// Reads variables by name: the process environment, or a map in tests.
pub(crate) type Lookup<'a> = &'a dyn Fn(&str) -> Option<String>;

/// The process environment as a [`Lookup`] (`None` for unset or non-UTF-8 values).
pub fn process_env(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

fn required(lookup: Lookup, name: &str) -> Result<String> {
    lookup(name).with_context(|| {
        format!("`{name}` is not set: `infer rank` is started by `infer generate` or `infer up`")
    })
}

fn parsed<T: std::str::FromStr>(name: &str, value: &str, what: &str) -> Result<T> {
    value
        .parse()
        .ok()
        .with_context(|| format!("`{name}` is `{value}`, not {what}"))
}

fn number<T: std::str::FromStr>(lookup: Lookup, name: &str) -> Result<T> {
    parsed(name, &required(lookup, name)?, "a number")
}

fn optional_number<T: std::str::FromStr>(lookup: Lookup, name: &str) -> Result<Option<T>> {
    lookup(name)
        .map(|value| parsed(name, &value, "a number"))
        .transpose()
}

fn flag(lookup: Lookup, name: &str) -> bool {
    lookup(name).is_some_and(|v| v == "1")
}

/// The keys of its host a launcher gives a rank ([`var::RUN_KEYS`], [`crate::keyring`]).
///
/// Errors: unset or malformed.
pub fn run_keys(lookup: Lookup) -> Result<crate::keyring::Keyring> {
    crate::keyring::Keyring::from_text(&required(lookup, var::RUN_KEYS)?)
        .with_context(|| format!("`{}` is malformed", var::RUN_KEYS))
}

/// Removes the secrets a launcher passed in the environment ([`var::RUN_KEYS`],
/// [`var::API_KEY`]) from this process's environment once read, so that no process it
/// starts (a compiler, a helper) inherits them. Call it before any other thread starts.
pub fn forget_secrets() {
    for name in [var::RUN_KEYS, var::API_KEY] {
        // SAFETY: called at the start of `infer rank` and `infer bench` workers, while the
        // process has one thread: nothing reads the environment concurrently.
        unsafe { std::env::remove_var(name) };
    }
}

impl RankEnv {
    /// The variables of this rank, in a fixed order, without its keys.
    ///
    /// Errors: a dummy model that cannot be written as JSON.
    pub fn to_env(&self) -> Result<Vec<(String, String)>> {
        let mut env: Vec<(&str, String)> = vec![
            (RANK, self.rank.to_string()),
            (WORLD_SIZE, self.world_size.to_string()),
            (LOCAL_RANK, self.local_rank.to_string()),
            (LOCAL_WORLD_SIZE, self.local_world_size.to_string()),
            (MASTER_ADDR, self.store.ip().to_string()),
            (MASTER_PORT, self.store.port().to_string()),
            (var::TP, self.degrees.tp.to_string()),
            (var::PP, self.degrees.pp.to_string()),
            (var::DP, self.degrees.dp.to_string()),
            (var::EP, self.degrees.ep.to_string()),
            (var::THREADS, self.threads.to_string()),
            (var::NUMERICS, self.numerics.name().to_string()),
            (var::TIMEOUT_SECS, self.timeout.as_secs().to_string()),
            (CUDA_VISIBLE_DEVICES, self.cuda_visible_devices.clone()),
            (CUDA_DEVICE_ORDER, "PCI_BUS_ID".to_string()),
            ("NO_COLOR", "1".to_string()),
        ];
        match &self.model {
            Some(ModelSource::File(path)) => env.push((var::MODEL, path.display().to_string())),
            Some(ModelSource::Dummy(dummy)) => env.push((
                var::DUMMY_MODEL,
                serde_json::to_string(dummy).context("cannot describe the dummy model")?,
            )),
            None => {}
        }
        if self.shm_disable {
            env.push((var::SHM_DISABLE, "1".to_string()));
        }
        if let Some(fault) = self.test_fault {
            env.push((
                var::TEST_FAULT,
                format!("stall:rank={}:step={}", fault.rank, fault.step),
            ));
        }
        if self.incarnation > 0 {
            env.push((var::INCARNATION, self.incarnation.to_string()));
        }
        if let Some(device) = &self.device {
            env.push((var::DEVICE, "cuda".to_string()));
            if let Some(dirs) = &device.lib_dirs {
                env.push((var::CUDA_LIB_DIRS, dirs.clone()));
            }
            if device.host_harness {
                env.push((var::CUDA_HOST_HARNESS, "1".to_string()));
            }
            if let Some(cxx) = &device.cxx {
                env.push((CXX, cxx.clone()));
            }
        }
        let host = &self.host;
        if let Some(interface) = &host.socket_ifname {
            env.push((NCCL_SOCKET_IFNAME, format!("={interface}")));
            env.push((GLOO_SOCKET_IFNAME, interface.clone()));
        }
        if !host.ib_hcas.is_empty() {
            env.push((NCCL_IB_HCA, format!("={}", host.ib_hcas.join(","))));
        }
        if let Some(address) = &host.bind_addr {
            env.push((var::BIND_ADDR, address.clone()));
        }
        if let Some(name) = &host.name {
            env.push((var::HOST, name.clone()));
        }
        if let Some(serving) = &self.serving {
            serving.push_env(&mut env);
        }
        Ok(env
            .into_iter()
            .map(|(name, value)| (name.to_string(), value))
            .collect())
    }

    /// The rank's settings from `lookup` ([`process_env`] in a rank).
    ///
    /// Errors: a required variable unset, or any variable malformed, named with its value.
    pub fn from_env(lookup: Lookup) -> Result<RankEnv> {
        let master_addr: IpAddr = parsed(
            MASTER_ADDR,
            &required(lookup, MASTER_ADDR)?,
            "an IP address",
        )?;
        let master_port: u16 = parsed(MASTER_PORT, &required(lookup, MASTER_PORT)?, "a port")?;
        let store = SocketAddr::new(master_addr, master_port);
        let model = match (lookup(var::MODEL), lookup(var::DUMMY_MODEL)) {
            (Some(path), _) => Some(ModelSource::File(path.into())),
            (None, Some(json)) => Some(ModelSource::Dummy(
                serde_json::from_str(&json)
                    .with_context(|| format!("`{}` is not a dummy model", var::DUMMY_MODEL))?,
            )),
            (None, None) => None,
        };
        let device = match lookup(var::DEVICE).as_deref() {
            None | Some("cpu") => None,
            Some("cuda") => Some(DeviceEnv {
                lib_dirs: lookup(var::CUDA_LIB_DIRS),
                host_harness: flag(lookup, var::CUDA_HOST_HARNESS),
                cxx: lookup(CXX),
            }),
            Some(other) => bail!("`{}` is `{other}`, not `cpu` or `cuda`", var::DEVICE),
        };
        let numerics = match lookup(var::NUMERICS) {
            Some(name) => Numerics::from_name(&name).with_context(|| {
                format!("`{}` is `{name}`, not `exact` or `fast`", var::NUMERICS)
            })?,
            None => Numerics::Exact,
        };
        let env = RankEnv {
            rank: number(lookup, RANK)?,
            world_size: number(lookup, WORLD_SIZE)?,
            local_rank: number(lookup, LOCAL_RANK)?,
            local_world_size: number(lookup, LOCAL_WORLD_SIZE)?,
            store,
            degrees: Degrees {
                tp: number(lookup, var::TP)?,
                pp: number(lookup, var::PP)?,
                dp: optional_number(lookup, var::DP)?.unwrap_or(1),
                ep: optional_number(lookup, var::EP)?.unwrap_or(1),
            },
            threads: number(lookup, var::THREADS)?,
            numerics,
            timeout: Duration::from_secs(number(lookup, var::TIMEOUT_SECS)?),
            model,
            shm_disable: flag(lookup, var::SHM_DISABLE),
            test_fault: lookup(var::TEST_FAULT)
                .map(|text| TestFault::parse(&text))
                .transpose()?,
            incarnation: optional_number(lookup, var::INCARNATION)?.unwrap_or(0),
            cuda_visible_devices: lookup(CUDA_VISIBLE_DEVICES).unwrap_or_default(),
            device,
            host: HostEnv {
                name: lookup(var::HOST),
                bind_addr: lookup(var::BIND_ADDR),
                socket_ifname: lookup(GLOO_SOCKET_IFNAME),
                ib_hcas: lookup(NCCL_IB_HCA)
                    .map(|hcas| {
                        hcas.trim_start_matches('=')
                            .split(',')
                            .filter(|h| !h.is_empty())
                            .map(str::to_string)
                            .collect()
                    })
                    .unwrap_or_default(),
            },
            serving: ServingEnv::from_env(lookup)?,
        };
        if env.local_rank > env.rank {
            bail!(
                "`{LOCAL_RANK}` ({}) exceeds `{RANK}` ({})",
                env.local_rank,
                env.rank
            );
        }
        Ok(env)
    }

    /// The global ranks on this rank's host (consecutive: the launcher places them so).
    pub fn host_ranks(&self) -> std::ops::Range<usize> {
        let first = self.rank - self.local_rank.min(self.rank);
        first..first + self.local_world_size
    }

    /// Where the rank's collectives listen: the host's data address, else loopback.
    pub fn bind_addr(&self) -> &str {
        self.host.bind_addr.as_deref().unwrap_or("127.0.0.1")
    }
}

impl ServingEnv {
    fn push_env(&self, env: &mut Vec<(&'static str, String)>) {
        env.push((var::HTTP_HOST, self.http_host.clone()));
        env.push((var::HTTP_PORT, self.http_port.to_string()));
        if let Some(host) = &self.client_host {
            env.push((var::HTTP_CLIENT_HOST, host.clone()));
        }
        env.push((var::MAX_BATCH, self.max_batch.to_string()));
        if let Some(tokens) = self.max_num_batched_tokens {
            env.push((var::MAX_NUM_BATCHED_TOKENS, tokens.to_string()));
        }
        env.push((
            var::PREFIX_CACHE,
            if self.prefix_cache { "1" } else { "0" }.to_string(),
        ));
        env.push((var::MODEL_ID, self.model_id.clone()));
        env.push((var::KV_CACHE_TOKENS, self.kv_cache_tokens.to_string()));
        if let Some(key) = &self.api_key {
            env.push((var::API_KEY, key.clone()));
        }
        if self.protect_metrics {
            env.push((var::PROTECT_METRICS, "1".to_string()));
        }
        if let Some(prefill) = self.pd_prefill {
            env.push((var::PD_PREFILL, prefill.to_string()));
        }
        env.push((
            var::SHUTDOWN_TIMEOUT_SECS,
            self.shutdown_timeout.as_secs_f64().to_string(),
        ));
        env.push((
            var::STALL_TIMEOUT_SECS,
            self.stall_timeout.as_secs_f64().to_string(),
        ));
        if let Some(len) = self.max_model_len {
            env.push((var::MAX_MODEL_LEN, len.to_string()));
        }
        if let Some(queued) = self.max_queued_requests {
            env.push((var::MAX_QUEUED_REQUESTS, queued.to_string()));
        }
        if self.replica_restarts {
            env.push((var::REPLICA_RESTARTS, "1".to_string()));
        }
    }

    /// A serving rank's settings from `lookup`; `None` when the launcher serves nothing
    /// (no [`var::HTTP_PORT`]).
    ///
    /// Errors: a serving variable unset or malformed, named with its value.
    pub fn from_env(lookup: Lookup) -> Result<Option<ServingEnv>> {
        if lookup(var::HTTP_PORT).is_none() {
            return Ok(None);
        }
        let shutdown_timeout = seconds(lookup, var::SHUTDOWN_TIMEOUT_SECS, 5.0)?;
        let stall_timeout = seconds(lookup, var::STALL_TIMEOUT_SECS, 10.0)?;
        Ok(Some(ServingEnv {
            http_host: required(lookup, var::HTTP_HOST)?,
            http_port: parsed(var::HTTP_PORT, &required(lookup, var::HTTP_PORT)?, "a port")?,
            client_host: lookup(var::HTTP_CLIENT_HOST),
            max_batch: number(lookup, var::MAX_BATCH)?,
            max_num_batched_tokens: optional_number(lookup, var::MAX_NUM_BATCHED_TOKENS)?,
            prefix_cache: flag(lookup, var::PREFIX_CACHE),
            model_id: required(lookup, var::MODEL_ID)?,
            kv_cache_tokens: number(lookup, var::KV_CACHE_TOKENS)?,
            api_key: lookup(var::API_KEY),
            protect_metrics: flag(lookup, var::PROTECT_METRICS),
            pd_prefill: optional_number(lookup, var::PD_PREFILL)?,
            shutdown_timeout,
            stall_timeout,
            max_model_len: optional_number(lookup, var::MAX_MODEL_LEN)?,
            max_queued_requests: optional_number(lookup, var::MAX_QUEUED_REQUESTS)?,
            replica_restarts: flag(lookup, var::REPLICA_RESTARTS),
        }))
    }
}

/// Variable `name` as a duration in (fractional) seconds, `default_secs` when unset.
///
/// Errors: a value that is not a number of seconds (negative, not a number), named.
fn seconds(lookup: Lookup, name: &str, default_secs: f64) -> Result<Duration> {
    let secs: f64 = match lookup(name) {
        Some(value) => parsed(name, &value, "a number of seconds")?,
        None => default_secs,
    };
    Duration::try_from_secs_f64(secs)
        .ok()
        .with_context(|| format!("`{name}` is `{secs}`, not a number of seconds"))
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn sample() -> RankEnv {
        RankEnv {
            rank: 5,
            world_size: 8,
            local_rank: 1,
            local_world_size: 4,
            store: "10.0.0.1:29500".parse().expect("address"),
            degrees: Degrees {
                tp: 2,
                pp: 2,
                dp: 2,
                ep: 2,
            },
            threads: 3,
            numerics: Numerics::Fast,
            timeout: Duration::from_secs(60),
            model: Some(ModelSource::File("/models/m.gguf".into())),
            shm_disable: true,
            test_fault: None,
            incarnation: 3,
            cuda_visible_devices: "1".into(),
            device: Some(DeviceEnv {
                lib_dirs: Some("/a:/b".into()),
                host_harness: true,
                cxx: Some("g++".into()),
            }),
            host: HostEnv {
                name: Some("node1".into()),
                bind_addr: Some("10.0.0.2".into()),
                socket_ifname: Some("ens5".into()),
                ib_hcas: vec!["mlx5_0".into(), "mlx5_1".into()],
            },
            serving: Some(ServingEnv {
                http_host: "127.0.0.1".into(),
                http_port: 8000,
                client_host: Some("0.0.0.0".into()),
                max_batch: 16,
                max_num_batched_tokens: Some(2048),
                prefix_cache: true,
                model_id: "smollm2".into(),
                kv_cache_tokens: 4096,
                api_key: Some("k".into()),
                protect_metrics: true,
                pd_prefill: Some(1),
                shutdown_timeout: Duration::from_millis(2500),
                stall_timeout: Duration::from_secs(7),
                max_model_len: Some(1024),
                max_queued_requests: Some(32),
                replica_restarts: true,
            }),
        }
    }

    fn lookup_of(env: &[(String, String)]) -> impl Fn(&str) -> Option<String> + '_ {
        move |name| {
            let map: HashMap<&str, &str> =
                env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
            map.get(name).map(|v| v.to_string())
        }
    }

    /// What the launcher writes, the rank reads back, for a rank with every option set
    /// and for a bare CPU rank of collectives only.
    #[test]
    fn every_field_survives_the_environment() {
        let full = sample();
        let env = full.to_env().expect("env");
        assert_eq!(RankEnv::from_env(&lookup_of(&env)).expect("read"), full);
        assert_eq!(full.host_ranks(), 4..8);
        let bare = RankEnv {
            numerics: Numerics::Exact,
            model: None,
            shm_disable: false,
            cuda_visible_devices: String::new(),
            device: None,
            host: HostEnv::default(),
            serving: None,
            ..sample()
        };
        let env = bare.to_env().expect("env");
        assert!(
            env.iter()
                .all(|(name, _)| name != var::HTTP_PORT && name != var::MODEL)
        );
        let read = RankEnv::from_env(&lookup_of(&env)).expect("read");
        assert_eq!(read, bare);
        assert_eq!(read.bind_addr(), "127.0.0.1");
    }

    /// A missing or malformed variable is named, with its value.
    #[test]
    fn errors_name_the_variable() {
        let env = sample().to_env().expect("env");
        let without = |name: &str| -> Vec<(String, String)> {
            env.iter().filter(|(n, _)| n != name).cloned().collect()
        };
        let replaced = |name: &str, value: &str| -> Vec<(String, String)> {
            env.iter()
                .map(|(n, v)| {
                    (
                        n.clone(),
                        if n == name {
                            value.to_string()
                        } else {
                            v.clone()
                        },
                    )
                })
                .collect()
        };
        for (env, expected) in [
            (without(var::TP), "`INFER_TP` is not set"),
            (without(var::MODEL_ID), "`INFER_MODEL_ID` is not set"),
            (
                replaced(var::PP, "two"),
                "`INFER_PP` is `two`, not a number",
            ),
            (
                replaced(var::DEVICE, "tpu"),
                "`INFER_DEVICE` is `tpu`, not `cpu` or `cuda`",
            ),
            (
                replaced(var::NUMERICS, "loose"),
                "`INFER_NUMERICS` is `loose`",
            ),
            (
                replaced(var::HTTP_PORT, "99999"),
                "`INFER_HTTP_PORT` is `99999`, not a port",
            ),
            (
                replaced(MASTER_ADDR, "head"),
                "`MASTER_ADDR` is `head`, not an IP address",
            ),
            (
                replaced(LOCAL_RANK, "6"),
                "`LOCAL_RANK` (6) exceeds `RANK` (5)",
            ),
            (
                replaced(var::SHUTDOWN_TIMEOUT_SECS, "-1"),
                "`INFER_SHUTDOWN_TIMEOUT_SECS` is `-1`",
            ),
        ] {
            let error = RankEnv::from_env(&lookup_of(&env)).expect_err(expected);
            assert!(
                format!("{error:#}").contains(expected),
                "{error:#} / {expected}"
            );
        }
    }

    /// `stall:rank=R:step=N` is the one form (debug builds: what the tests run); a release
    /// build refuses any value.
    #[test]
    fn the_test_fault_reads_one_form_and_only_in_debug_builds() {
        let parsed = TestFault::parse("stall:rank=2:step=3");
        if cfg!(debug_assertions) {
            assert_eq!(parsed.expect("parsed"), TestFault { rank: 2, step: 3 });
            for bad in [
                "stall:rank=2",
                "stall:rank=x:step=3",
                "stall:rank=2:step=0",
                "crash:rank=1:step=1",
            ] {
                let error = TestFault::parse(bad).expect_err(bad).to_string();
                assert!(error.contains("`INFER_TEST_FAULT`"), "{error}");
            }
        } else {
            let error = parsed.expect_err("release").to_string();
            assert!(error.contains("a release build refuses it"), "{error}");
        }
    }
}
