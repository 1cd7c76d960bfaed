//! Command-line types (clap derive). Their doc comments are the `--help` text. The only file
//! that imports clap; commands turn these into settings for the domain modules.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

/// Plan, launch and diagnose distributed LLM inference on bare-metal GPU clusters.
#[derive(Debug, Parser)]
#[command(name = "infer", version, about, long_about = None, propagate_version = true)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Probe this host's GPUs, NVLink, NICs and HCAs (or import a recorded topology) and
    /// print the matrix like `nvidia-smi topo -m`.
    Topo(TopoArgs),
    /// Choose TP × PP × EP × DP for a model on a cluster (of GPUs, or of hosts' CPUs), place
    /// every rank, and print the memory per GPU (or CPU rank), the NCCL env per host and the
    /// reasons.
    Plan(PlanArgs),
    /// Diagnose what breaks distributed inference: NCCL falling back to TCP, wrong
    /// interfaces, NCCL errors and version mismatches, from logs, topologies and this host.
    Doctor(DoctorArgs),
    /// Serve the model over an OpenAI-compatible HTTP API until Ctrl-C (continuous batching).
    Up(UpArgs),
    /// One-shot generation with the built-in engine (CPU), for scripts and tests.
    Generate(GenerateArgs),
    /// Measurements that print figures (decode tokens/s, …).
    #[command(subcommand)]
    Bench(BenchCommand),
    /// The single-GPU CI check: the GPU, driver and NVRTC, every kernel compiled for this
    /// GPU, the model on the GPU against the CPU engine; a pass/fail table, exit 0 or 1
    /// (2 without a GPU).
    Smoke(SmokeArgs),
    /// What a model file carries besides its weights, written in other tools' formats.
    #[command(subcommand)]
    Model(ModelCommand),
    /// Internal: one rank process, configured by its environment (`RANK`, `WORLD_SIZE`,
    /// `MASTER_ADDR`, `MASTER_PORT`, `INFER_*`).
    #[command(hide = true)]
    Rank,
    /// Internal: the remote end of a multi-host run, started by the launcher over SSH; it
    /// reads its instructions as frames on stdin.
    #[command(hide = true)]
    Agent(AgentArgs),
}

/// `infer model`.
#[derive(Debug, Subcommand)]
pub enum ModelCommand {
    /// Write a GGUF model's tokenizer as a Hugging Face tokenizer directory, for load
    /// generators that count tokens with `AutoTokenizer`.
    ///
    /// The files (`tokenizer.json`, `tokenizer_config.json`, `special_tokens_map.json`,
    /// `config.json`, `generation_config.json`) are what
    /// `transformers.AutoTokenizer.from_pretrained(DIR)` loads without the hub: AIPerf,
    /// inference-perf or `vllm bench serve` then count tokens as the engine does. Prints the
    /// paths written.
    ExportTokenizer(ExportTokenizerArgs),
}

/// `infer model export-tokenizer`.
#[derive(Debug, Args)]
pub struct ExportTokenizerArgs {
    /// A `.gguf` file, or `smollm2` for the embedded SmolLM2-135M-Instruct (fetched into the
    /// cache on first use).
    #[arg(value_name = "MODEL")]
    pub model: String,
    /// The directory to write into (created when missing; other files in it are kept).
    #[arg(value_name = "DIR")]
    pub dir: PathBuf,
    /// Overwrite the files of the same names already in DIR (else they are refused and
    /// nothing is written).
    #[arg(long)]
    pub force: bool,
}

/// `infer agent` (internal).
#[derive(Debug, Args)]
pub struct AgentArgs {
    /// Stop exactly the rank process groups of run RUN_ID on this host, and exit.
    #[arg(long, value_name = "RUN_ID")]
    pub kill: Option<String>,

    /// With `--kill`: only the groups recorded for this inventory host name.
    #[arg(long, value_name = "NAME", requires = "kill")]
    pub host: Option<String>,
}

/// How to reach the hosts of an inventory (`--cluster hosts.toml`).
#[derive(Debug, Args, Clone, Default)]
pub struct SshArgs {
    /// Trust and record the key of a host that has no key in `known_hosts` yet (a changed
    /// key, or a host known by a key of another algorithm, is still refused).
    #[arg(long)]
    pub ssh_accept_new: bool,

    /// Copy the model to hosts that lack it (compared by sha256).
    #[arg(long)]
    pub push_model: bool,
}

/// `infer smoke`.
#[derive(Debug, Args)]
pub struct SmokeArgs {
    /// The backend to check (only `cuda` has checks).
    #[arg(long, value_enum, default_value_t = DeviceArg::Cuda)]
    pub device: DeviceArg,
    /// Print the report as JSON (`driver`, `nvrtc`, `nccl`, `libraries[]` with `library`,
    /// `soname`, `path`, and `checks[]` with `name`, `passed`, `detail`).
    #[arg(long)]
    pub json: bool,
    /// The GGUF model the model checks run (a machine without network: a file carried
    /// there). Default: the embedded SmolLM2 from the cache, downloaded once if it is not
    /// there.
    #[arg(long, short = 'm', value_name = "PATH")]
    pub model: Option<String>,
}

/// `infer generate`.
#[derive(Debug, Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Where the model runs: `cpu` (the quantized CPU kernels) or `cuda`.
    #[arg(long, value_enum, default_value_t = DeviceArg::Cpu)]
    pub device: DeviceArg,

    /// The prompt text.
    #[arg(long, short = 'p', value_name = "P")]
    pub prompt: String,

    /// Wrap the prompt as a user message in the model's chat template.
    #[arg(long)]
    pub chat: bool,

    /// Most tokens to generate (at least 1; the model's context caps it, with a warning).
    #[arg(long, short = 'n', value_name = "N", default_value_t = 64)]
    pub max_tokens: usize,

    /// Sampling temperature; 0 is greedy.
    #[arg(
        long,
        short = 't',
        value_name = "T",
        default_value_t = 0.0,
        allow_negative_numbers = true
    )]
    pub temperature: f32,

    /// Nucleus sampling: keep the most likely tokens up to this probability mass.
    #[arg(
        long,
        value_name = "P",
        default_value_t = 1.0,
        allow_negative_numbers = true
    )]
    pub top_p: f32,

    /// Keep only the K most likely tokens (0: all).
    #[arg(long, value_name = "K", default_value_t = 0)]
    pub top_k: usize,

    /// Seed of the sampler: the same seed gives the same tokens.
    #[arg(long, value_name = "S")]
    pub seed: Option<u64>,

    /// Stop when the output contains this string (repeatable).
    #[arg(long, value_name = "S")]
    pub stop: Vec<String>,

    /// Worker threads (0: one per core; with several ranks, divided among them).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub threads: usize,
    /// How the quantized matrix products round: `exact` (llama.cpp's AVX2 build, bit for
    /// bit) or `fast` (each block's integer dot product rounded once: ~1.5× the batched
    /// throughput, logits differ in the last bits).
    #[arg(long, value_enum, default_value_t = NumericsArg::Exact)]
    pub numerics: NumericsArg,

    #[command(flatten)]
    pub stages: StageArgs,

    /// Run the ranks on the hosts of this inventory (`hosts.toml`) over SSH: TP groups
    /// inside a host, PP stages across hosts.
    #[arg(long, value_name = "HOSTS_TOML")]
    pub cluster: Option<PathBuf>,

    #[command(flatten)]
    pub ssh: SshArgs,

    /// Where the run's rank logs and `manifest.json` go (a new or empty directory).
    /// Default: a new `run-<id>` under `~/.cache/infer/runs/`, which keeps the newest 20
    /// (`INFER_KEEP_RUNS`).
    #[arg(long, value_name = "DIR")]
    pub run_dir: Option<PathBuf>,

    /// Print JSON (prompt and generated token ids, text, timings) instead of streaming text.
    #[arg(long)]
    pub json: bool,
}

/// `infer bench`.
#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Decode tokens/s at batch 1, prefill tokens/s and peak RSS of the built-in engine.
    Decode(BenchDecodeArgs),
    /// All-reduce bus bandwidth of the TCP collectives between real processes on this host,
    /// as nccl-tests' `all_reduce_perf` prints it, next to one plain TCP stream.
    Allreduce(BenchAllreduceArgs),
    /// Serving through `infer up` over HTTP: tokens/s for 1, 4 and 16 concurrent streams,
    /// TTFT and TPOT p50/p99, and the time from start to ready.
    Serve(BenchServeArgs),
    /// Internal: one process of `infer bench allreduce`.
    #[command(hide = true)]
    AllreduceWorker(BenchAllreduceWorkerArgs),
}

/// `infer bench allreduce`.
#[derive(Debug, Args)]
pub struct BenchAllreduceArgs {
    /// Processes in the group.
    #[arg(long, value_name = "N", default_value_t = 4)]
    pub world: usize,
    /// Largest message, bytes (sizes double from 8 B).
    #[arg(long, value_name = "BYTES", default_value_t = 64 << 20)]
    pub max_bytes: usize,
    /// Measure between the hosts of this inventory (`hosts.toml`) over SSH instead: the
    /// `--world` processes spread evenly over its hosts, all-reducing over the data network.
    #[arg(long, value_name = "HOSTS_TOML")]
    pub cluster: Option<PathBuf>,
    /// Print JSON (`tables[]` with `scope`, `transport`, `rows[]`) instead of the tables:
    /// what `infer plan --calibration` reads.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub ssh: SshArgs,
}

/// `infer bench serve`.
#[derive(Debug, Args)]
pub struct BenchServeArgs {
    /// A `.gguf` file or model directory. Default: the embedded SmolLM2 model.
    #[arg(long, value_name = "M")]
    pub model: Option<String>,
    /// How the server loads the model: `--load-format dummy` serves random weights of its
    /// shape (with `--plan`, the plan's model, which may be a profile such as
    /// `llama-3.1-8b`, in the weight type nearest the plan's dtype unless `--dtype` says).
    #[command(flatten)]
    pub load: LoadArgs,
    /// Concurrent streams to measure, one after another [default: 1,4,16; with `--plan`,
    /// every batch the plan predicts for its layout, of which this flag keeps some].
    #[arg(long, value_name = "N,..", value_delimiter = ',')]
    pub concurrency: Option<Vec<usize>>,
    /// Tokens each request asks for (`max_tokens`).
    #[arg(long, value_name = "N", default_value_t = 64)]
    pub max_tokens: usize,
    /// Requests each stream sends one after another (more rounds, steadier figures).
    #[arg(long, value_name = "N", default_value_t = 4)]
    pub rounds: usize,
    /// Sweeps over every concurrency, one after another; tokens/s is the median over them
    /// and the ratio to one stream is shown per sweep too (on a shared or throttled
    /// machine, one sweep can be off by 20% either way).
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub repeat: usize,
    /// Engine worker threads of the server (0: one per core, divided among ranks).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub threads: usize,
    /// How the quantized matrix products round: `exact` (llama.cpp's AVX2 build, bit for
    /// bit) or `fast` (each block's integer dot product rounded once: ~1.5× the batched
    /// throughput, logits differ in the last bits).
    #[arg(long, value_enum, default_value_t = NumericsArg::Exact)]
    pub numerics: NumericsArg,
    /// The server's degrees (`infer up --tp/--pp`; with `--plan`, the plan's).
    #[command(flatten)]
    pub stages: StageArgs,
    /// What the streams send: `chat` (short prompts), `mixed` (short prompts, and every
    /// eighth request a ~2k-token prompt) or `shared-prefix` (one ~500-token system text
    /// before every question, as with a long system prompt).
    #[arg(long, value_enum, default_value_t = Workload::Chat)]
    pub workload: Workload,
    /// The server's token budget per step (`infer up --max-num-batched-tokens`); a value
    /// above any prompt's length turns chunked prefill off, for comparison.
    #[arg(long, value_name = "TOKENS")]
    pub max_num_batched_tokens: Option<usize>,
    /// Serve with the prefix cache off (`infer up --no-prefix-cache`), for comparison.
    #[arg(long)]
    pub no_prefix_cache: bool,
    /// Serve disaggregated: this many prefill replicas (`infer up --prefill`, with
    /// `--decode`), each `--tp × --pp` ranks.
    #[arg(long, value_name = "N", requires = "decode")]
    pub prefill: Option<usize>,
    /// Decode replicas of a disaggregated server (`infer up --decode`, with `--prefill`).
    #[arg(long, value_name = "M", requires = "prefill")]
    pub decode: Option<usize>,
    /// Check a plan (`infer plan --json` output): serve its model with its layout (TP, PP,
    /// DP), send its traffic (prompts of its `isl` tokens, `osl` tokens each, prefix cache
    /// off) at each batch it predicts, and print TTFT p50, TPOT p50 and tokens/s predicted,
    /// measured, and the relative error `(measured − predicted) / predicted`.
    #[arg(
        long,
        value_name = "PLAN_JSON",
        conflicts_with_all = ["model", "max_tokens", "workload", "no_prefix_cache", "prefill", "decode"]
    )]
    pub plan: Option<PathBuf>,
    /// With `--plan`: print the comparison as JSON (`layout`, `rows[]` with `concurrency`,
    /// `metric`, `predicted`, `measured`, `relative_error`) instead of the tables.
    #[arg(long, requires = "plan")]
    pub json: bool,
}

/// `infer bench serve --workload`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Workload {
    /// Short prompts (a dozen tokens).
    Chat,
    /// Short prompts, and every eighth request a prompt of about 2,000 tokens.
    Mixed,
    /// A ~500-token shared system text, then a short question.
    SharedPrefix,
}

/// `infer bench allreduce-worker` (hidden).
#[derive(Debug, Args)]
pub struct BenchAllreduceWorkerArgs {
    #[arg(long)]
    pub store: String,
    #[arg(long)]
    pub rank: u64,
    #[arg(long)]
    pub world: usize,
    #[arg(long)]
    pub max_bytes: usize,
}

/// The model a command runs and how its weights load (`generate`, `up`, `bench decode`).
#[derive(Debug, Args, Clone, Default)]
pub struct ModelArgs {
    /// A `.gguf` file or a Hugging Face model directory. Default: the embedded
    /// SmolLM2-135M-Instruct Q4_1 GGUF (fetched into the cache on first use).
    #[arg(long = "model", short = 'm', id = "model", value_name = "M")]
    pub path: Option<String>,
    #[command(flatten)]
    pub load: LoadArgs,
}

/// The tensor- and pipeline-parallel degrees of a command that runs ranks without data
/// parallelism (`generate`, `bench serve`); vLLM's long names are aliases. Default 1 each.
#[derive(Args, Clone, Copy, Debug, Default)]
pub struct StageArgs {
    /// Tensor-parallel degree: this many `infer rank` processes share each layer (default 1;
    /// `bench serve --plan`: the plan's).
    #[arg(long, visible_alias = "tensor-parallel-size", value_name = "N")]
    pub tp: Option<usize>,
    /// Pipeline-parallel degree: the layers are split over this many stages of processes
    /// (default 1; `bench serve --plan`: the plan's).
    #[arg(long, visible_alias = "pipeline-parallel-size", value_name = "N")]
    pub pp: Option<usize>,
}

impl StageArgs {
    /// The degrees given, 1 where not given (and DP, EP 1). Errors: a degree of 0.
    pub fn degrees(&self) -> anyhow::Result<crate::degrees::Degrees> {
        for (flag, value) in [("--tp", self.tp), ("--pp", self.pp)] {
            if value == Some(0) {
                anyhow::bail!("{flag} must be at least 1");
            }
        }
        Ok(crate::degrees::Degrees {
            tp: self.tp.unwrap_or(1),
            pp: self.pp.unwrap_or(1),
            ..crate::degrees::Degrees::ONE
        })
    }
}

/// How a model's weights are loaded: vLLM's `--load-format`.
#[derive(Debug, Args, Clone, Default)]
pub struct LoadArgs {
    /// `auto`: read the weights from `--model`; `dummy`: random weights of `--model`'s shape
    /// (a profile name such as `llama-3.1-8b`, a `config.json` directory or a GGUF file),
    /// generated on the fly with a fixed seed, never written to disk.
    #[arg(long, value_enum, value_name = "FORMAT", default_value_t = LoadFormatArg::Auto)]
    pub load_format: LoadFormatArg,
    /// With `--load-format dummy`: the weight type (default `bf16`, a checkpoint's own).
    #[arg(long, value_enum, value_name = "TYPE")]
    pub dtype: Option<DummyDtypeArg>,
    /// With `--load-format dummy`: keep only this many layers (a real-size model's shape
    /// on a machine that cannot hold all of it).
    #[arg(long, value_name = "N")]
    pub num_layers: Option<usize>,
}

impl LoadArgs {
    /// With `--load-format dummy`, the random weights' type (default bf16) and layer count
    /// (`None`: the model's own); `None` with `auto`.
    ///
    /// Errors: `--dtype` or `--num-layers` without `--load-format dummy`.
    pub fn dummy(
        &self,
    ) -> anyhow::Result<Option<(crate::runtime::model::dummy::DummyDtype, Option<usize>)>> {
        match self.load_format {
            LoadFormatArg::Auto => {
                if self.dtype.is_some() || self.num_layers.is_some() {
                    anyhow::bail!(
                        "--dtype and --num-layers shape random weights: add --load-format dummy (a model file's weights keep their own type and layers)"
                    );
                }
                Ok(None)
            }
            LoadFormatArg::Dummy => Ok(Some((
                self.dtype
                    .map_or(crate::runtime::model::dummy::DummyDtype::Bf16, Into::into),
                self.num_layers,
            ))),
        }
    }
}

/// `--load-format`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LoadFormatArg {
    #[default]
    Auto,
    Dummy,
}

/// `--dtype` of dummy weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DummyDtypeArg {
    #[value(name = "q4_0")]
    Q4_0,
    #[value(name = "q8_0")]
    Q8_0,
    #[value(name = "q4_k")]
    Q4K,
    F16,
    Bf16,
}

impl From<DummyDtypeArg> for crate::runtime::model::dummy::DummyDtype {
    fn from(arg: DummyDtypeArg) -> Self {
        use crate::runtime::model::dummy::DummyDtype;
        match arg {
            DummyDtypeArg::Q4_0 => DummyDtype::Q4_0,
            DummyDtypeArg::Q8_0 => DummyDtype::Q8_0,
            DummyDtypeArg::Q4K => DummyDtype::Q4K,
            DummyDtypeArg::F16 => DummyDtype::F16,
            DummyDtypeArg::Bf16 => DummyDtype::Bf16,
        }
    }
}

/// `infer bench decode`.
#[derive(Debug, Args)]
pub struct BenchDecodeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Where the model runs: `cpu` (the quantized CPU kernels) or `cuda`.
    #[arg(long, value_enum, default_value_t = DeviceArg::Cpu)]
    pub device: DeviceArg,
    /// Worker threads (0: one per core).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub threads: usize,
    /// How the quantized matrix products round: `exact` (llama.cpp's AVX2 build, bit for
    /// bit) or `fast` (each block's integer dot product rounded once: ~1.5× the batched
    /// throughput, logits differ in the last bits).
    #[arg(long, value_enum, default_value_t = NumericsArg::Exact)]
    pub numerics: NumericsArg,
    /// Prompt length for the prefill measurement, tokens.
    #[arg(long, value_name = "N", default_value_t = 128)]
    pub prompt_tokens: usize,
    /// Tokens to decode for the decode measurement.
    #[arg(long, value_name = "N", default_value_t = 128)]
    pub decode_tokens: usize,
    /// Sequences decoded together in one batch (each step runs one token of each); tok/s
    /// counts the tokens of all of them.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub batch: usize,
    /// Timed repetitions (the best is reported, after one warm-up).
    #[arg(long, value_name = "N", default_value_t = 3)]
    pub runs: usize,
    /// Print JSON (tokens/s, the decode step's time, the weight bytes it read, the device)
    /// instead of the table: what `infer plan --calibration` reads.
    #[arg(long)]
    pub json: bool,
}

/// `infer topo`.
#[derive(Debug, Args)]
pub struct TopoArgs {
    /// Print JSON (`hosts[]` with `gpus`, `gpu_links`, `nvlink_domains`, `nics`) to stdout.
    #[arg(long)]
    pub json: bool,

    /// Import a recorded topology instead of probing: `nvidia-smi topo -m` text or
    /// `infer topo --json` output; `-` reads standard input.
    #[arg(long, value_name = "FILE")]
    pub from: Option<PathBuf>,

    /// Read NICs and HCAs from this sysfs mount point instead of `/sys`.
    #[arg(long, value_name = "DIR", default_value = "/sys")]
    pub sysfs_root: PathBuf,

    /// Probe every host of this inventory (`hosts.toml`) over SSH, in parallel, each on
    /// that host; `--json` writes one topology with every host.
    #[arg(long, value_name = "HOSTS_TOML", conflicts_with = "from")]
    pub cluster: Option<PathBuf>,

    #[command(flatten)]
    pub ssh: SshArgs,
}

/// `infer plan`.
#[derive(Debug, Args)]
pub struct PlanArgs {
    /// A `.gguf` file, a Hugging Face model directory (or its `config.json`), or a profile
    /// name from `profiles/models/` (`llama-3.1-70b`, `deepseek-v3`, …). Default: the
    /// embedded SmolLM2-135M-Instruct Q4_1 GGUF (fetched into the cache on first use).
    #[arg(long, short = 'm', value_name = "M")]
    pub model: Option<String>,

    #[command(flatten)]
    pub settings: PlanSettingsArgs,

    /// Print the plan as JSON to stdout.
    #[arg(long)]
    pub json: bool,

    /// Also list every layout considered and why it lost.
    #[arg(long)]
    pub explain: bool,

    /// Write the command line and environment of every node for this engine (`infer`'s own,
    /// vLLM, SGLang or llama.cpp) with the plan's layout, instead of the one-line vLLM
    /// equivalent.
    #[arg(long, value_enum, value_name = "E")]
    pub engine: Option<EngineArg>,

    /// An all-reduce table measured on the hosts (nccl-tests' `all_reduce_perf` output, or
    /// `infer bench allreduce`'s): its peak bus bandwidth and small-message time replace the
    /// datasheet's link inside a host or between hosts (as the table's ranks were placed).
    /// Or `infer bench decode --json` run on the cluster's GPU model (its HBM bandwidth), or
    /// on its hosts' CPU (their probed memory bandwidth and compute rate). Repeatable: one
    /// table per kind of link, one decode per GPU model or CPU.
    #[arg(long, value_name = "FILE")]
    pub calibration: Vec<PathBuf>,

    /// With an inventory of `cpu-ranks` hosts: probe each host's own CPU over SSH (its
    /// cores, memory, memory bandwidth and compute, measured there by its agent) instead of
    /// taking this host's to stand for them.
    #[arg(long)]
    pub probe_hosts: bool,

    /// With `--probe-hosts`: trust and record the key of a host that has no key in
    /// `known_hosts` yet.
    #[arg(long, requires = "probe_hosts")]
    pub ssh_accept_new: bool,

    /// Write one run script per node into DIR (`node0-HOST.sh`, …) and a `launch.json`, for
    /// `--engine` (default: `infer`'s own engine, `infer up --nnodes` on every node).
    #[arg(long, value_name = "DIR")]
    pub emit: Option<PathBuf>,

    /// With `--engine`: what the engine loads (a Hugging Face id or a path present on every
    /// host). Default: the plan's model (`--model`).
    #[arg(long, value_name = "ID", requires = "engine")]
    pub engine_model: Option<String>,

    /// With `--engine`: the head's HTTP port. Default: the engine's (vLLM 8000, SGLang
    /// 30000, llama.cpp 8080).
    #[arg(long, value_name = "PORT", requires = "engine")]
    pub engine_port: Option<u16>,

    /// With `--engine`: the rendezvous port on the head (vLLM `--master-port` or
    /// `--data-parallel-rpc-port`, SGLang `--dist-init-addr`, llama.cpp's RPC servers).
    #[arg(long, value_name = "PORT", requires = "engine")]
    pub dist_port: Option<u16>,

    /// sysfs mount point used when `--cluster local` probes this host.
    #[arg(long, value_name = "DIR", default_value = "/sys", hide = true)]
    pub sysfs_root: PathBuf,
}

/// The planner's flags besides the model, shared by `infer plan` and `infer doctor`.
#[derive(Debug, Args)]
pub struct PlanSettingsArgs {
    /// `local` (probe this host: its GPUs, or without them its CPU, whose ranks share it), a
    /// cluster inventory TOML (hosts with `gpus`, or with `cpu-ranks`), or a shorthand
    /// `NODESxGPUSxHARDWARE` such as `2x8xh100-sxm`.
    #[arg(long, value_name = "C", default_value = "local")]
    pub cluster: String,

    /// What to optimise: `latency` (TPOT of one sequence), `throughput` (tokens/s), or
    /// `cost` (the fewest GPUs that serve `--rps` within the targets).
    #[arg(long, value_enum, default_value_t = ObjectiveArg::Throughput)]
    pub objective: ObjectiveArg,

    /// Weight dtype: bf16, fp16, fp8, int8, int4 (awq), mxfp4, or the CPU engine's q4_0 and
    /// q8_0 (what CPU ranks run int4 and int8 as). Default: the checkpoint's own.
    #[arg(long, value_name = "D")]
    pub dtype: Option<String>,

    /// KV-cache dtype: bf16, fp16 or fp8. Default: the activation dtype.
    #[arg(long, value_name = "D")]
    pub kv_dtype: Option<String>,

    /// Longest sequence to serve, in tokens. Default: the model's context length.
    #[arg(long, value_name = "N")]
    pub max_model_len: Option<u64>,

    /// Fraction of each GPU's memory the engine may use (as vLLM); for CPU ranks, of their
    /// host's memory.
    #[arg(long, value_name = "F", default_value_t = 0.9)]
    pub gpu_memory_utilization: f64,

    #[command(flatten)]
    pub degrees: DegreeArgs,

    /// Prompt tokens per request of the traffic to plan for (the Pareto table's TTFT and
    /// throughput).
    #[arg(long, value_name = "TOKENS", default_value_t = 1024)]
    pub isl: u64,

    /// Output tokens per request of the traffic to plan for.
    #[arg(long, value_name = "TOKENS", default_value_t = 256)]
    pub osl: u64,

    /// Time-to-first-token target, milliseconds: the plan picks the best layout and batch
    /// that meets it (with `--tpot-ms`, both), or answers "no" with how close it gets.
    #[arg(long, value_name = "MS")]
    pub ttft_ms: Option<f64>,

    /// Time-per-output-token target, milliseconds (what a user sees between tokens).
    #[arg(long, value_name = "MS")]
    pub tpot_ms: Option<f64>,

    /// Requests per second to serve: the Pareto table then says how many GPUs each point
    /// needs for it, and `--objective cost` picks the fewest.
    #[arg(long, value_name = "R")]
    pub rps: Option<f64>,

    /// Also show the best prefill/decode disaggregated split of the GPUs (shown anyway when
    /// it beats aggregated serving; the comparison is always among the reasons).
    #[arg(long)]
    pub disaggregate: bool,
}

/// The parallel degrees, as `infer plan` and `infer up` take them (vLLM's long names are
/// aliases). `infer plan` checks and uses each degree given and chooses the others; `infer up`
/// launches them (1 where not given) unless a plan chooses.
#[derive(Args, Clone, Copy, Debug, Default)]
pub struct DegreeArgs {
    /// Tensor-parallel degree: ranks that split every layer.
    #[arg(long, visible_alias = "tensor-parallel-size", value_name = "N")]
    pub tp: Option<usize>,
    /// Pipeline-parallel degree: stages of contiguous layers.
    #[arg(long, visible_alias = "pipeline-parallel-size", value_name = "N")]
    pub pp: Option<usize>,
    /// Data-parallel degree: independent replicas (each `tp × pp` ranks); `infer up` puts
    /// rank 0's router, which spreads requests by load, in front of them.
    #[arg(long, visible_alias = "data-parallel-size", value_name = "N")]
    pub dp: Option<usize>,
    /// Expert-parallel degree (MoE models): ranks the experts are sharded over. It divides
    /// `tp × dp`; `infer up`'s own engine shards them over each replica's TP group, so there
    /// it equals `--tp`.
    #[arg(long, value_name = "N")]
    pub ep: Option<usize>,
}

impl DegreeArgs {
    /// The degrees given.
    pub fn pins(&self) -> crate::degrees::DegreePins {
        crate::degrees::DegreePins {
            tp: self.tp,
            pp: self.pp,
            dp: self.dp,
            ep: self.ep,
        }
    }
}

/// `--engine`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum EngineArg {
    /// infer's own engine (`infer up`, node by node with `--nnodes`).
    Infer,
    Vllm,
    Sglang,
    Llamacpp,
}

impl From<EngineArg> for crate::serving_engines::EngineKind {
    fn from(engine: EngineArg) -> Self {
        match engine {
            EngineArg::Infer => crate::serving_engines::EngineKind::Infer,
            EngineArg::Vllm => crate::serving_engines::EngineKind::Vllm,
            EngineArg::Sglang => crate::serving_engines::EngineKind::Sglang,
            EngineArg::Llamacpp => crate::serving_engines::EngineKind::Llamacpp,
        }
    }
}

/// `--objective`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ObjectiveArg {
    Latency,
    Throughput,
    Cost,
}

/// `infer doctor`.
#[derive(Debug, Args)]
pub struct DoctorArgs {
    /// An `NCCL_DEBUG=INFO` log (one per node or rank); repeatable.
    #[arg(long = "nccl-log", value_name = "FILE")]
    pub nccl_logs: Vec<PathBuf>,

    /// The hosts' topology: `nvidia-smi topo -m` text or `infer topo --json` output.
    #[arg(long, value_name = "FILE")]
    pub topology: Option<PathBuf>,

    /// A plan to check: `infer plan --json` output.
    #[arg(long, value_name = "FILE", conflicts_with = "model")]
    pub plan: Option<PathBuf>,

    /// Plan this model (with the planner flags below) and check that plan.
    #[arg(long, value_name = "M")]
    pub model: Option<String>,

    #[command(flatten)]
    pub settings: PlanSettingsArgs,

    /// Print the findings as JSON to stdout.
    #[arg(long)]
    pub json: bool,

    /// sysfs mount point for the live checks of this host.
    #[arg(long, value_name = "DIR", default_value = "/sys", hide = true)]
    pub sysfs_root: PathBuf,

    /// With `--cluster hosts.toml`: trust and record the key of a host with no known key
    /// yet (a changed key, or a host known by a key of another algorithm, is still refused).
    #[arg(long)]
    pub ssh_accept_new: bool,

    /// With `--cluster hosts.toml`: also measure each pair of hosts' bandwidth over the data
    /// interfaces (one 64 MiB TCP stream per pair, one pair at a time) against the slower
    /// NIC's link rate.
    #[arg(long)]
    pub bandwidth: bool,

    /// With `--cluster`: also check this serving engine on every host (`vllm`, `sglang`,
    /// `llamacpp`): its programs run, the same version (and torch/NCCL) everywhere, its
    /// usual ports free.
    #[arg(long, value_enum, value_name = "E")]
    pub engine: Option<EngineArg>,

    /// With `--engine`: the directory holding the engine's programs on every host.
    #[arg(long, value_name = "DIR", requires = "engine")]
    pub engine_bin: Option<PathBuf>,

    /// The post-mortem of one run of `infer up`: its run directory (printed when it starts),
    /// its run id, or `last` (the newest run). Says first why it ended — a rank killed by the OOM killer or a signal, a
    /// stall (which rank waited on which), a lost host, a clean stop — from the launcher's
    /// record, every rank's log and the kernel's log (OOM kills, NVIDIA Xid errors).
    #[arg(long, value_name = "RUN")]
    pub run: Option<String>,

    /// With `--run`: also pack the run directory and the report (`postmortem.json`) into
    /// FILE, a `.tar.gz` to attach to a bug report.
    #[arg(long, value_name = "FILE", requires = "run")]
    pub bundle: Option<PathBuf>,
}

/// `infer up`.
#[derive(Debug, Args)]
pub struct UpArgs {
    #[command(flatten)]
    pub model: ModelArgs,

    /// The model id `/v1/models` lists and requests name (default: the file's stem).
    #[arg(long, value_name = "NAME")]
    pub served_model_name: Option<String>,

    /// Longest prompt plus completion a request may take, in tokens (default: the model's
    /// context; at most that).
    #[arg(long, value_name = "TOKENS")]
    pub max_model_len: Option<u64>,

    /// After Ctrl-C or SIGTERM, seconds the requests in flight get to finish before they
    /// are cancelled (new ones are refused at once); a second Ctrl-C stops at once.
    #[arg(long, value_name = "SECS", default_value_t = 5.0)]
    pub shutdown_timeout: f64,

    /// Seconds a replica may hold work without completing a step before `/health` calls it
    /// stalled (503 with the reason, or `degraded` while another replica serves) and the
    /// router stops sending it requests; stretched to 4× the slowest recent step when that
    /// is longer. An idle server is never stalled.
    #[arg(long, value_name = "SECS", default_value_t = 10.0)]
    pub stall_timeout: f64,

    /// Times the gang may be restarted after a failure (torchrun's flag): a rank that
    /// exits, stops heartbeating or loses its host, or a replica stalled 5 s past
    /// `--stall-timeout`, stops every rank and starts them again on the same hosts, while
    /// the HTTP server stays up (503 with `Retry-After` meanwhile; requests in flight get an
    /// error naming the cause). With `--engine`, the same for the engine's processes on
    /// every host: one that exits, or a head that generates nothing (or answers no
    /// `/metrics`) 5 s past `--stall-timeout`. 0: the first failure ends the run.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub max_restarts: usize,

    /// Requests that may wait (beyond the `--max-num-seqs` running on each replica) before
    /// new ones are answered 503 with `Retry-After` at once (SGLang's flag): a flood then
    /// sheds load instead of queueing without end. Unset: no bound.
    #[arg(long, value_name = "N")]
    pub max_queued_requests: Option<usize>,

    /// Address to bind (127.0.0.1: this host only).
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1")]
    pub host: String,

    /// Port to bind (0 picks a free one; the chosen address is printed).
    #[arg(long, value_name = "PORT", default_value_t = 8000)]
    pub port: u16,

    /// Worker threads of the engine (0: one per core).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub threads: usize,
    /// How the quantized matrix products round: `exact` (llama.cpp's AVX2 build, bit for
    /// bit) or `fast` (each block's integer dot product rounded once: ~1.5× the batched
    /// throughput, logits differ in the last bits).
    #[arg(long, value_enum, default_value_t = NumericsArg::Exact)]
    pub numerics: NumericsArg,

    /// Most sequences decoded together; later requests wait for a slot.
    #[arg(
        long,
        visible_alias = "max-num-seqs",
        value_name = "N",
        default_value_t = 16
    )]
    pub max_batch: usize,

    /// Most tokens one engine step computes: one per decoding sequence, then chunks of
    /// waiting prompts (chunked prefill: a long prompt is prefilled over several steps, so
    /// running decodes never wait for all of it). At least `--max-batch`; default 32 per
    /// core of this host, 64 to 4096 (or `--max-batch` when larger).
    #[arg(long, value_name = "TOKENS")]
    pub max_num_batched_tokens: Option<usize>,

    /// Do not reuse the KV blocks of prompt prefixes seen before (automatic prefix caching
    /// is on by default: a request whose prompt starts like an earlier one's — a system
    /// prompt, a conversation's earlier turns — computes only the rest).
    #[arg(long, visible_alias = "no-enable-prefix-caching")]
    pub no_prefix_cache: bool,

    /// Require `Authorization: Bearer <key>` on every API request (vLLM's flag; a flag is
    /// visible to every local user in `ps`: prefer `INFER_API_KEY` or `--api-key-file`).
    #[arg(long, value_name = "KEY", env = crate::envvars::API_KEY)]
    pub api_key: Option<String>,

    /// Read the API key from the first line of `FILE` (e.g. one readable by you only).
    #[arg(long, value_name = "FILE", conflicts_with = "api_key")]
    pub api_key_file: Option<std::path::PathBuf>,

    /// Require the API key on `/metrics` too (as vLLM, it guards the API only by default):
    /// Prometheus then scrapes with `authorization: {credentials: KEY}`. Needs an API key.
    #[arg(long)]
    pub protect_metrics: bool,

    /// Positions the KV cache holds over all running sequences, in blocks of 16 (memory is
    /// taken as blocks are first used). When it is full, the newest sequences are preempted
    /// and resumed later.
    #[arg(long, value_name = "TOKENS", default_value_t = 65536)]
    pub kv_cache_tokens: usize,

    #[command(flatten)]
    pub degrees: DegreeArgs,

    /// Prefill/decode disaggregation: this many replicas (each `--tp × --pp` ranks) run
    /// prompts and hand each request's KV cache to one of `--decode` replicas, which
    /// generate the rest (with `--decode`; instead of `--dp`). With `--engine vllm|sglang`:
    /// prefill workers of `--tp × --pp` GPUs behind the engine's PD router.
    #[arg(long, value_name = "N", requires = "decode", conflicts_with = "dp")]
    pub prefill: Option<usize>,

    /// Decode replicas of a disaggregated deployment (with `--prefill`).
    #[arg(long, value_name = "M", requires = "prefill")]
    pub decode: Option<usize>,

    /// Launch the layout of a saved plan (`infer plan --json > plan.json`) instead of
    /// `--tp/--pp/--dp/--ep`.
    #[arg(long, value_name = "FILE", conflicts_with = "cluster")]
    pub plan: Option<PathBuf>,

    /// Plan for this cluster (`local`, a TOML inventory or `NODESxGPUSxHW`, as `infer plan`)
    /// and launch the chosen layout. An inventory's hosts are reached over SSH and the ranks
    /// run there (`--tp/--pp/--dp` then pin the degrees; CPU-rank hosts get one replica
    /// each by default); this process serves `--host:--port`, forwarded to rank 0.
    #[arg(long, value_name = "C")]
    pub cluster: Option<String>,

    /// Run one node of a multi-node launch, as torchrun does: start the same command on
    /// every node with its own `--node-rank` (by hand, pdsh or a scheduler; `infer plan
    /// --emit DIR` writes the per-node scripts). The world splits evenly over the nodes in
    /// rank order; node 0 hosts the rendezvous store and rank 0's HTTP server. Every node
    /// needs the same `INFER_RUN_TOKEN` (a shared secret) and the model at the same path.
    #[arg(
        long,
        value_name = "N",
        conflicts_with_all = ["cluster", "engine"],
        requires_all = ["node_rank", "master_addr"]
    )]
    pub nnodes: Option<usize>,

    /// With `--nnodes`: this node's place, 0 to N−1.
    #[arg(long, value_name = "R", requires = "nnodes")]
    pub node_rank: Option<usize>,

    /// With `--nnodes`: node 0's data-network address (where its store listens).
    #[arg(long, value_name = "ADDR", requires = "nnodes")]
    pub master_addr: Option<String>,

    /// With `--nnodes`: the rendezvous store's port on node 0.
    #[arg(
        long,
        value_name = "PORT",
        default_value_t = 29500,
        requires = "nnodes"
    )]
    pub master_port: u16,

    /// With `--nnodes`: this node's data-network address, where its ranks' collectives
    /// listen. Default: the address this host reaches `--master-addr` from.
    #[arg(long, value_name = "ADDR", requires = "nnodes")]
    pub bind_addr: Option<std::net::IpAddr>,

    #[command(flatten)]
    pub ssh: SshArgs,

    /// Where the run's rank logs and `manifest.json` go (a new or empty directory).
    /// Default: a new `run-<id>` under `~/.cache/infer/runs/`, which keeps the newest 20
    /// (`INFER_KEEP_RUNS`).
    #[arg(long, value_name = "DIR")]
    pub run_dir: Option<PathBuf>,

    /// Where the ranks compute: `cpu` (the quantized CPU kernels) or `cuda`.
    #[arg(long, value_enum, default_value_t = DeviceArg::Cpu)]
    pub device: DeviceArg,

    /// Launch this engine instead of `infer`'s own: `vllm`, `sglang` or `llamacpp`
    /// (`llama-server`, with `ggml-rpc-server` on the other hosts). Its processes run with
    /// the same preflight, per-host network settings and gang semantics as ranks. `infer`
    /// is the default (the same as leaving it out).
    #[arg(long, value_enum, value_name = "E")]
    pub engine: Option<EngineArg>,

    /// With `--engine`: the directory holding the engine's programs on every host (a
    /// venv's `bin/`). Default: each host's `PATH`.
    #[arg(long, value_name = "DIR", requires = "engine")]
    pub engine_bin: Option<PathBuf>,

    /// With `--engine`: the rendezvous port on the head (vLLM `--master-port` or
    /// `--data-parallel-rpc-port`, SGLang `--dist-init-addr`, llama.cpp's RPC servers).
    #[arg(long, value_name = "PORT", requires = "engine")]
    pub dist_port: Option<u16>,

    /// With `--engine`: how long the head may take to answer `GET /health`, seconds.
    #[arg(long, value_name = "SECS", default_value_t = 600, requires = "engine")]
    pub ready_timeout: u64,
}

/// `--numerics`: how the quantized matrix products round (see
/// `runtime::cpu::quant::Numerics`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum NumericsArg {
    Exact,
    Fast,
}

impl From<NumericsArg> for crate::runtime::cpu::quant::Numerics {
    fn from(arg: NumericsArg) -> Self {
        match arg {
            NumericsArg::Exact => Self::Exact,
            NumericsArg::Fast => Self::Fast,
        }
    }
}

/// A rank's compute device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DeviceArg {
    Cpu,
    Cuda,
}
