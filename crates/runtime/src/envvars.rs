//! Every `INFER_*` environment variable, one documented constant each: the knobs users set
//! (first), and the launcher→rank contract that `launch/` writes and `infer rank` reads
//! (typed in `runtime::exec::rank_env`). Nothing else in `src/` spells an `INFER_` name
//! (`tests/tidy.rs` checks), so `grep` on a constant finds every reader and writer.
//!
//! The torchrun names a rank also gets (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//! `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`) and NCCL's own are spelled where they
//! are written and read, `runtime::exec::rank_env`.

// ---- Set by users ----

/// Where models, kernels, run directories and staged binaries are cached (default
/// `~/.cache/infer`).
pub const CACHE_DIR: &str = "INFER_CACHE_DIR";
/// The API key `infer up` requires (`--api-key`'s environment form, as vLLM's
/// `VLLM_API_KEY`); passed to a serving rank 0.
pub const API_KEY: &str = "INFER_API_KEY";
/// The secret every node of `infer up --nnodes` shares (never in an argv, never in
/// `manifest.json`); each node's launcher derives its ranks' keys from it.
pub const RUN_TOKEN: &str = "INFER_RUN_TOKEN";
/// `1`: collectives between ranks on one host go over TCP, not shared memory (as
/// `NCCL_SHM_DISABLE`); passed on to every rank.
pub const SHM_DISABLE: &str = "INFER_SHM_DISABLE";
/// `1`: the CPU kernels' portable paths, no SIMD.
pub(crate) const NO_SIMD: &str = "INFER_NO_SIMD";
/// `1`: no AVX-512 VNNI kernels (AVX2 only).
pub(crate) const NO_VNNI: &str = "INFER_NO_VNNI";
/// Directories searched first for NVIDIA's libraries (a `PATH`-style list); the launcher
/// passes its search path to device ranks under this name.
pub(crate) const CUDA_LIB_DIRS: &str = "INFER_CUDA_LIB_DIRS";
/// `1`: `--device cuda` runs the CUDA kernels on CPU threads (the host harness), for
/// machines without a GPU; passed on to device ranks.
pub const CUDA_HOST_HARNESS: &str = "INFER_CUDA_HOST_HARNESS";
/// Set: the GPU runner times every kernel with CUDA events (`infer bench decode`).
pub(crate) const CUDA_PROFILE: &str = "INFER_CUDA_PROFILE";
/// How many run directories `launch::runs_dir` keeps (default 20).
pub const KEEP_RUNS: &str = "INFER_KEEP_RUNS";

// ---- The launcher→rank contract (written by `launch/`, read by `infer rank`) ----

/// Tensor-parallel degree.
pub(crate) const TP: &str = "INFER_TP";
/// Pipeline-parallel degree.
pub(crate) const PP: &str = "INFER_PP";
/// Data-parallel replicas (default 1).
pub(crate) const DP: &str = "INFER_DP";
/// Expert-parallel degree: 1 or `tp` (default 1).
pub(crate) const EP: &str = "INFER_EP";
/// Threads of the rank's pool.
pub(crate) const THREADS: &str = "INFER_THREADS";
/// `exact` or `fast`: how the rank's integer products round (default `exact`).
pub(crate) const NUMERICS: &str = "INFER_NUMERICS";
/// Timeout of the rank's collectives and store waits, whole seconds.
pub(crate) const TIMEOUT_SECS: &str = "INFER_TIMEOUT_SECS";
/// The GGUF file or Hugging Face directory the rank loads.
pub(crate) const MODEL: &str = "INFER_MODEL";
/// The dummy model (JSON) the rank generates instead of loading a file.
pub(crate) const DUMMY_MODEL: &str = "INFER_DUMMY_MODEL";
/// `cuda`: the rank computes on its first visible GPU (or the host harness); `cpu` or unset:
/// on the CPU.
pub(crate) const DEVICE: &str = "INFER_DEVICE";
/// The address the rank's collectives and KV inbox listen on (its host's data address;
/// default `127.0.0.1`).
pub(crate) const BIND_ADDR: &str = "INFER_BIND_ADDR";
/// The inventory name of the rank's host.
pub(crate) const HOST: &str = "INFER_HOST";
/// The keys of the rank's host ([`crate::keyring`]: pair keys with every host, its store
/// key, the host of every rank); never in an argv or `manifest.json`, and removed from the
/// rank's environment once read.
pub const RUN_KEYS: &str = "INFER_RUN_KEYS";
/// Set by an agent on every process it starts: the run it belongs to (`infer agent --kill`
/// stops exactly that run's processes).
pub const RUN_ID: &str = "INFER_RUN_ID";

// ---- A serving rank's settings (`infer up`) ----

/// Rank 0's HTTP host.
pub(crate) const HTTP_HOST: &str = "INFER_HTTP_HOST";
/// Where clients reach rank 0's HTTP server when the launcher forwards to it (its
/// `--host`; unset: [`HTTP_HOST`]): a loopback name there makes rank 0 answer only
/// loopback `Host` names.
pub(crate) const HTTP_CLIENT_HOST: &str = "INFER_HTTP_CLIENT_HOST";
/// `1`: rank 0's `/metrics` requires the API key too (`--protect-metrics`).
pub(crate) const PROTECT_METRICS: &str = "INFER_PROTECT_METRICS";
/// Rank 0's HTTP port.
pub const HTTP_PORT: &str = "INFER_HTTP_PORT";
/// Most sequences a step runs.
pub(crate) const MAX_BATCH: &str = "INFER_MAX_BATCH";
/// Most tokens a step runs.
pub(crate) const MAX_NUM_BATCHED_TOKENS: &str = "INFER_MAX_NUM_BATCHED_TOKENS";
/// `1`: replicas reuse cached prompt prefixes.
pub(crate) const PREFIX_CACHE: &str = "INFER_PREFIX_CACHE";
/// The model id `/v1/models` answers.
pub(crate) const MODEL_ID: &str = "INFER_MODEL_ID";
/// KV-cache positions of each replica.
pub(crate) const KV_CACHE_TOKENS: &str = "INFER_KV_CACHE_TOKENS";
/// Prefill/decode disaggregation: the first this many replicas prefill.
pub(crate) const PD_PREFILL: &str = "INFER_PD_PREFILL";
/// How long requests in flight may finish after SIGTERM, seconds (fractional).
pub(crate) const SHUTDOWN_TIMEOUT_SECS: &str = "INFER_SHUTDOWN_TIMEOUT_SECS";
/// A replica with work and no step completed for this long is stalled, seconds
/// (`--stall-timeout`).
pub(crate) const STALL_TIMEOUT_SECS: &str = "INFER_STALL_TIMEOUT_SECS";
/// A fault a rank injects into itself, for the tests only (debug builds; a release build
/// refuses it): `stall:rank=R:step=N`, rank `R` stops making progress at its `N`th step
/// while its process and heartbeats live on.
pub(crate) const TEST_FAULT: &str = "INFER_TEST_FAULT";
/// Which start of its DP replica a rank belongs to (absent: the first, 0): a replica
/// restarted alone joins groups of this incarnation, so it never meets its predecessor's
/// stale addresses in the store.
pub const INCARNATION: &str = "INFER_INCARNATION";
/// `1`: a DP replica other than rank 0's may be restarted alone (`--max-restarts` with
/// `--dp`): rank 0's router marks a lost replica as restarting instead of failing, and
/// links to its next incarnation.
pub(crate) const REPLICA_RESTARTS: &str = "INFER_REPLICA_RESTARTS";
/// Requests that may wait beyond those running before new ones get 503
/// (`--max-queued-requests`).
pub(crate) const MAX_QUEUED_REQUESTS: &str = "INFER_MAX_QUEUED_REQUESTS";
/// Longest prompt plus completion, tokens (`--max-model-len`).
pub(crate) const MAX_MODEL_LEN: &str = "INFER_MAX_MODEL_LEN";
