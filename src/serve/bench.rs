//! `infer bench serve`'s load generator: starts a real `infer up` process, waits until it listens (the time to
//! ready), then drives it over HTTP with 1, 4 and 16 concurrent streams (each sending
//! `--rounds` requests one after another) and prints
//! tokens/s, TTFT and TPOT percentiles the way vLLM's `benchmark_serving.py` reports them.
//!
//! The client is plain HTTP/1.1 (`Connection: close`) reading the SSE `data:` lines as they
//! arrive, so TTFT includes the HTTP server. Every stream runs on one client thread (a
//! single-threaded tokio runtime), as `benchmark_serving.py` runs its streams on one asyncio
//! loop: on a small machine, 16 client threads woken on every token would compete with the
//! server for the cores and measure the client as much as the server.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::degrees::Degrees;
use crate::runtime::cpu::quant::Numerics;
use crate::runtime::model::dummy::DummyDtype;

/// What `infer bench serve` runs: the server's settings and the load it is driven with.
#[derive(Clone, Debug)]
pub(crate) struct ServeBench {
    /// `infer up --model` (`None`: the embedded default).
    pub(crate) model: Option<String>,
    /// Concurrent streams of each sweep point, each at least 1.
    pub(crate) concurrency: Vec<usize>,
    /// Completion tokens per request.
    pub(crate) max_tokens: usize,
    /// Requests each stream sends one after another (at least 1).
    pub(crate) rounds: usize,
    /// Sweeps over every concurrency (at least 1).
    pub(crate) repeat: usize,
    /// `infer up --threads` (0: one per core).
    pub(crate) threads: usize,
    pub(crate) numerics: Numerics,
    /// The server's `--tp`, `--pp` and `--dp` (`ep` 1).
    pub(crate) degrees: Degrees,
    pub(crate) workload: Workload,
    /// `infer up --max-num-batched-tokens`.
    pub(crate) max_num_batched_tokens: Option<usize>,
    /// `infer up --no-prefix-cache`.
    pub(crate) no_prefix_cache: bool,
    /// `infer up --prefill N --decode M`.
    pub(crate) prefill_decode: Option<(usize, usize)>,
    /// Every request asks for exactly `max_tokens` (`ignore_eos`), as a plan's traffic does.
    pub(crate) ignore_eos: bool,
    /// `infer up --load-format dummy`: random weights of the model's shape; `None`: the
    /// model's own.
    pub(crate) dummy: Option<DummyLoad>,
    /// Per concurrency, how long one request is expected to take, seconds: the streams'
    /// first requests are then spread evenly over that time (stream `i` of `b` starts after
    /// `i/b` of it), so that every request arrives while the others decode — the steady
    /// state a plan predicts — instead of all at once, which requests of equal lengths would
    /// keep doing round after round. Empty: every stream starts at once.
    pub(crate) request_secs: Vec<f64>,
}

/// Random weights for the server (`infer up --load-format dummy --dtype … --num-layers …`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct DummyLoad {
    /// `--dtype`.
    pub(crate) dtype: DummyDtype,
    /// `--num-layers`; `None`: the model's own.
    pub(crate) num_layers: Option<usize>,
}

/// What the streams send.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Workload {
    /// Short prompts (a dozen tokens).
    Chat,
    /// Short prompts, and every eighth request a prompt of about 2,000 tokens.
    Mixed,
    /// A ~500-token shared system text, then a short question.
    SharedPrefix,
    /// Prompts of exactly this many token ids ([`ids_prompt`]), every one of a sweep
    /// different from its first token on, so that no prefix cache serves them: a plan's
    /// `isl`.
    Tokens(usize),
}

/// Prompts the clients cycle through (ordinary text, so generation runs to `max_tokens`
/// more often than not).
const PROMPTS: [&str; 4] = [
    "Once upon a time, in a small village by the sea,",
    "The history of the steam engine begins",
    "Here is a short story about a robot who learns to paint:",
    "In the morning the market opens early, and",
];

/// The shared system text of `--workload shared-prefix` (about 500 tokens once repeated).
const SYSTEM_TEXT: &str = "You are the operations assistant of a company that serves language \
models on its own GPU servers. The servers sit in racks of eight, each with eight GPUs joined by \
NVLink, and the racks talk over InfiniBand. Engineers ask you about capacity, latency and \
failures. Answer plainly, give units, and say when you do not know. ";

/// A prompt of `--workload mixed`'s long requests: about 2,000 tokens, different from the
/// first token on (so no prefix cache serves it), ending with a question.
fn long_prompt(streams: usize, stream: usize, round: usize) -> String {
    let mut text = format!("Report {streams}/{stream}-{round}. ");
    for section in 0..40 {
        text.push_str(&format!(
            "Section {section}: the cluster ran {} jobs at {} percent utilisation, with {} \
             restarts and a median queue time of {} minutes, while the network carried {} \
             terabytes. ",
            100 + section * 7 + stream,
            40 + (section * 13 + round) % 50,
            section % 5,
            3 + section % 11,
            20 + section * 3,
        ));
    }
    text.push_str("Summarise the report in one sentence:");
    text
}

/// First id of the tokens [`ids_prompt`] opens its prompts with; every vocabulary the bench
/// serves (the engine's GGUF and `config.json` models, random weights of a profile's shape)
/// has ordinary tokens from 300 to [`FIRST_OPENING_ID`] + [`OPENINGS`] − 1.
const FIRST_OPENING_ID: u32 = 1000;

/// Different opening tokens: requests of one sweep open differently up to this many.
const OPENINGS: usize = 4096;

/// A prompt of exactly `tokens` token ids (at least one), whatever the model's tokenizer
/// (a byte-level one turns a word into several tokens): an opening id that differs for
/// each of a sweep's requests (`stream` of `streams`, round `round` of `rounds`), then ids
/// 300–307 over and over. The completions API takes token ids as its `prompt`.
fn ids_prompt(tokens: usize, (stream, round, rounds): (usize, usize, usize)) -> Vec<u32> {
    let opening = FIRST_OPENING_ID + ((stream * rounds + round) % OPENINGS) as u32;
    std::iter::once(opening)
        .chain((0..tokens.saturating_sub(1)).map(|i| 300 + (i % 8) as u32))
        .collect()
}

/// The prompt stream `stream` of `streams` sends in round `round` of `rounds` (text, or
/// token ids for [`Workload::Tokens`]), and whether it is a long one.
fn prompt_for(
    workload: Workload,
    (streams, stream): (usize, usize),
    (rounds, round): (usize, usize),
) -> (serde_json::Value, bool) {
    let short = PROMPTS[(stream + round) % PROMPTS.len()];
    let (text, long) = match workload {
        Workload::Chat => (short.to_string(), false),
        Workload::Mixed if (stream * rounds + round) % 8 == 7 => {
            (long_prompt(streams, stream, round), true)
        }
        Workload::Mixed => (short.to_string(), false),
        Workload::SharedPrefix => (format!("{}\n\nTask: {short}", SYSTEM_TEXT.repeat(6)), false),
        Workload::Tokens(tokens) => {
            return (ids_prompt(tokens, (stream, round, rounds)).into(), false);
        }
    };
    (text.into(), long)
}

/// One finished request as the client saw it.
struct Sample {
    /// A long prompt of `--workload mixed` (reported apart).
    long: bool,
    /// Seconds from sending the request to the first token's chunk.
    ttft_secs: f64,
    /// Mean seconds between token chunks after the first; `None` with one token.
    tpot_secs: Option<f64>,
    /// `usage.completion_tokens` of the final chunk.
    completion_tokens: usize,
}

/// What one concurrency measured, over every sweep.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct PointSummary {
    /// Concurrent streams.
    pub(crate) streams: usize,
    /// Output tokens per second of wall time, the median over the sweeps.
    pub(crate) tokens_per_sec: f64,
    /// Median time to first token of the short prompts, seconds.
    pub(crate) ttft_p50_secs: f64,
    /// Median time per output token after the first, seconds.
    pub(crate) tpot_p50_secs: f64,
}

/// The benchmark's report: its lines, and each concurrency's figures for a caller that
/// compares them.
pub(crate) struct Report {
    pub(crate) rows: Vec<String>,
    pub(crate) points: Vec<PointSummary>,
}

/// Kills the server when the benchmark ends, however it ends.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        // SIGTERM: `infer up` stops its ranks and exits; SIGKILL only if it does not.
        if let Some(pid) = rustix::process::Pid::from_raw(self.0.id() as i32) {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        }
        let deadline = Instant::now() + std::time::Duration::from_secs(5);
        while Instant::now() < deadline && matches!(self.0.try_wait(), Ok(None)) {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Runs the benchmark and returns its report.
///
/// Errors: the server does not start, a request fails.
pub(crate) fn run(args: &ServeBench) -> Result<Report> {
    let max_batch = args.concurrency.iter().copied().max().unwrap_or(1).max(16);
    let numerics = args.numerics.name();
    let (server, address, ready_secs) = start_server(args, max_batch, numerics)?;

    let client = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the client runtime")?;
    // One warm-up request page-faults the weights in.
    client
        .block_on(request(&address, &PROMPTS[0].into(), 8, false, false))
        .context("warm-up request failed")?;
    let mut rows = header_rows(args, ready_secs, numerics, max_batch);
    let measured = measure(&client, &address, args)?;
    rows.extend(result_rows(args, &measured));
    rows.push(cache_row(&client, &address)?);
    drop(server);
    let points = args
        .concurrency
        .iter()
        .zip(&measured)
        .map(|(&streams, (rates, samples))| summary(streams, rates, samples))
        .collect();
    Ok(Report { rows, points })
}

/// One concurrency's figures: the median tokens/s of its sweeps, the TTFT and TPOT medians
/// of its short prompts' requests.
fn summary(streams: usize, rates: &[f64], samples: &[Sample]) -> PointSummary {
    let short = || samples.iter().filter(|s| !s.long);
    let ttft: Vec<f64> = short().map(|s| s.ttft_secs).collect();
    let tpot: Vec<f64> = short().filter_map(|s| s.tpot_secs).collect();
    PointSummary {
        streams,
        tokens_per_sec: percentile(rates, 0.5),
        ttft_p50_secs: percentile(&ttft, 0.5),
        tpot_p50_secs: percentile(&tpot, 0.5),
    }
}

/// Starts `infer up --port 0` with the benchmark's flags and waits until it listens.
/// Returns the server (killed when dropped), its address and the seconds from process
/// start to listening. Errors: the executable is not found, the process does not start,
/// or it exits before it listens.
fn start_server(
    args: &ServeBench,
    max_batch: usize,
    numerics: &str,
) -> Result<(Server, String, f64)> {
    let exe = std::env::current_exe().context("cannot find the `infer` executable")?;
    let started = Instant::now();
    let mut command = Command::new(exe);
    command.args(["up", "--port", "0", "--threads", &args.threads.to_string()]);
    command.args(["--max-batch", &max_batch.to_string()]);
    command.args([
        "--tp",
        &args.degrees.tp.to_string(),
        "--pp",
        &args.degrees.pp.to_string(),
    ]);
    if args.degrees.dp > 1 {
        command.args(["--dp", &args.degrees.dp.to_string()]);
    }
    if let Some(tokens) = args.max_num_batched_tokens {
        command.args(["--max-num-batched-tokens", &tokens.to_string()]);
    }
    if args.no_prefix_cache {
        command.arg("--no-prefix-cache");
    }
    if let Some((prefill, decode)) = args.prefill_decode {
        command.args([
            "--prefill",
            &prefill.to_string(),
            "--decode",
            &decode.to_string(),
        ]);
    }
    command.args(["--numerics", numerics]);
    if let Some(model) = &args.model {
        command.args(["--model", model]);
    }
    if let Some(dummy) = args.dummy {
        command.args(["--load-format", "dummy", "--dtype", dummy.dtype.name()]);
        if let Some(layers) = dummy.num_layers {
            command.args(["--num-layers", &layers.to_string()]);
        }
    }
    command
        .env_remove(crate::envvars::API_KEY)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut child = command.spawn().context("cannot start `infer up`")?;
    let stderr = child.stderr.take().context("no stderr from `infer up`")?;
    let server = Server(child);
    let mut lines = BufReader::new(stderr).lines();
    let address = loop {
        let Some(line) = lines.next() else {
            bail!("`infer up` exited before it was ready");
        };
        let line = line.context("cannot read the output of `infer up`")?;
        if let Some(rest) = line.split("on http://").nth(1) {
            break rest
                .split_whitespace()
                .next()
                .unwrap_or_default()
                .to_string();
        }
    };
    let ready_secs = started.elapsed().as_secs_f64();
    // Keep draining the server's stderr so it never blocks on a full pipe.
    std::thread::spawn(move || for _ in lines {});
    Ok((server, address, ready_secs))
}

/// The report's first rows: the time to ready (seconds) and the layout, the numerics, the
/// scheduling settings, and the results table's header.
fn header_rows(
    args: &ServeBench,
    ready_secs: f64,
    numerics: &str,
    max_batch: usize,
) -> Vec<String> {
    let replicas = args.prefill_decode;
    let mut rows = vec![format!(
        "time to ready  {ready_secs:.2} s (process start to listening, {})",
        if let Some((prefill, decode)) = replicas {
            format!(
                "disaggregated: {prefill} prefill + {decode} decode replicas of tp {} × pp {}",
                args.degrees.tp, args.degrees.pp
            )
        } else if args.degrees.world_size() > 1 {
            format!(
                "{} rank processes, tp {} × pp {} × dp {}",
                args.degrees.world_size(),
                args.degrees.tp,
                args.degrees.pp,
                args.degrees.dp
            )
        } else {
            "1 engine process".to_string()
        }
    )];
    rows.push(format!("numerics       {numerics}"));
    rows.push(format!(
        "scheduling     {} tokens per step, prefix cache {}, workload {}",
        args.max_num_batched_tokens.map_or_else(
            || format!(
                "{} (default)",
                crate::serve::scheduler::Limits::for_this_host(max_batch).max_batched_tokens
            ),
            |t| t.to_string()
        ),
        if args.no_prefix_cache { "off" } else { "on" },
        match args.workload {
            Workload::Chat => "chat".to_string(),
            Workload::Mixed =>
                "mixed (every 8th request ~2k tokens; TTFT/TPOT of the short ones)".to_string(),
            Workload::SharedPrefix => "shared-prefix (~500-token system text)".to_string(),
            Workload::Tokens(tokens) => format!(
                "{tokens}-token prompts, {} tokens each{}",
                args.max_tokens,
                if args.ignore_eos { " (ignore_eos)" } else { "" }
            ),
        }
    ));
    rows.push(format!(
        "{:>7} {:>10} {:>9} {:>9} {:>9} {:>9} {:>8}",
        "streams", "tok/s", "ttft p50", "ttft p99", "tpot p50", "tpot p99", "tokens"
    ));
    rows
}

/// Each concurrency's tokens/s of every sweep and every request's sample, in
/// `args.concurrency`'s order. Errors: a request fails.
fn measure(
    client: &tokio::runtime::Runtime,
    address: &str,
    args: &ServeBench,
) -> Result<Vec<(Vec<f64>, Vec<Sample>)>> {
    // Every sweep measures each concurrency once, sweeps one after another, so slow and
    // fast spells of a shared machine fall on every concurrency alike.
    let mut measured: Vec<(Vec<f64>, Vec<Sample>)> = args
        .concurrency
        .iter()
        .map(|_| (Vec::new(), Vec::new()))
        .collect();
    for _ in 0..args.repeat {
        for (point, (&streams, (rates, all_samples))) in
            args.concurrency.iter().zip(measured.iter_mut()).enumerate()
        {
            let stagger = args.request_secs.get(point).copied().unwrap_or(0.0);
            let (tokens_per_sec, samples) = sweep_point(client, address, streams, stagger, args)?;
            rates.push(tokens_per_sec);
            all_samples.extend(samples);
        }
    }
    Ok(measured)
}

/// The results table's rows: per concurrency, tokens/s, TTFT and TPOT percentiles in
/// milliseconds and tokens, with long prompts and the speed-up over one stream below.
fn result_rows(args: &ServeBench, measured: &[(Vec<f64>, Vec<Sample>)]) -> Vec<String> {
    let mut rows = Vec::new();
    let single_stream: Option<Vec<f64>> = args
        .concurrency
        .iter()
        .zip(measured)
        .find(|(streams, _)| **streams == 1)
        .map(|(_, (rates, _))| rates.clone());
    for (&streams, (rates, samples)) in args.concurrency.iter().zip(measured) {
        let tokens_per_sec = percentile(rates, 0.5);
        let tokens: usize = samples.iter().map(|s| s.completion_tokens).sum();
        let short = || samples.iter().filter(|s| !s.long);
        let ttft: Vec<f64> = short().map(|s| s.ttft_secs).collect();
        let tpot: Vec<f64> = short().filter_map(|s| s.tpot_secs).collect();
        let long_ttft: Vec<f64> = samples
            .iter()
            .filter(|s| s.long)
            .map(|s| s.ttft_secs)
            .collect();
        rows.push(format!(
            "{streams:>7} {tokens_per_sec:>10.1} {:>7.1}ms {:>7.1}ms {:>7.1}ms {:>7.1}ms {tokens:>8}",
            percentile(&ttft, 0.50) * 1e3,
            percentile(&ttft, 0.99) * 1e3,
            percentile(&tpot, 0.50) * 1e3,
            percentile(&tpot, 0.99) * 1e3,
        ));
        if !long_ttft.is_empty() {
            rows.push(format!(
                "{:>7} {} long prompts: ttft p50 {:.1}ms, max {:.1}ms",
                "",
                long_ttft.len(),
                percentile(&long_ttft, 0.5) * 1e3,
                percentile(&long_ttft, 1.0) * 1e3
            ));
        }
        if let (Some(one), true) = (&single_stream, streams > 1) {
            let mut line = format!(
                "{:>7} {:>9.2}x of one stream",
                "",
                tokens_per_sec / percentile(one, 0.5)
            );
            if args.repeat > 1 {
                let ratios: Vec<f64> = rates.iter().zip(one).map(|(r, o)| r / o).collect();
                let low = ratios.iter().copied().fold(f64::INFINITY, f64::min);
                let high = ratios.iter().copied().fold(0.0, f64::max);
                line.push_str(&format!(" (sweeps: {low:.2}x to {high:.2}x)"));
            }
            rows.push(line);
        }
    }
    if args.repeat > 1 {
        rows.push(format!(
            "(tok/s: median of {} sweeps; TTFT/TPOT and tokens: all sweeps)",
            args.repeat
        ));
    }
    rows
}

/// The prefix cache's row from the server's `/metrics`: prompt tokens served from the
/// cache and preemptions. Errors: `/metrics` cannot be read.
fn cache_row(client: &tokio::runtime::Runtime, address: &str) -> Result<String> {
    let metrics = client
        .block_on(get_text(address, "/metrics"))
        .context("cannot read /metrics")?;
    let value = |name: &str| {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name} ")))
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    let (hits, queries) = (
        value("infer_prefix_cache_hits_total"),
        value("infer_prefix_cache_queries_total"),
    );
    Ok(format!(
        "prefix cache   {hits:.0} of {queries:.0} prompt tokens served from the cache ({:.1}%), {:.0} preemptions",
        100.0 * hits / queries.max(1.0),
        value("infer_preemptions_total"),
    ))
}

/// One concurrency of one sweep: `streams` client tasks, each sending `args.rounds`
/// requests one after another, stream `i` first waiting `i/streams` of `stagger_secs`.
/// Returns the generated tokens per second — of wall time when all start at once; with a
/// stagger, the sum of every stream's own rate (its tokens over the time from its first
/// request to its last answer), which leaves out the ramp before the last stream starts —
/// and every request's sample.
fn sweep_point(
    client: &tokio::runtime::Runtime,
    address: &str,
    streams: usize,
    stagger_secs: f64,
    args: &ServeBench,
) -> Result<(f64, Vec<Sample>)> {
    let start = Instant::now();
    let per_stream = client.block_on(async {
        let handles: Vec<_> = (0..streams)
            .map(|i| {
                let address = address.to_string();
                let (max_tokens, rounds, workload) = (args.max_tokens, args.rounds, args.workload);
                let ignore_eos = args.ignore_eos;
                let delay = start_delay(i, streams, stagger_secs);
                tokio::spawn(async move {
                    tokio::time::sleep(delay).await;
                    let first = Instant::now();
                    let mut samples = Vec::with_capacity(rounds);
                    for round in 0..rounds {
                        let (prompt, long) = prompt_for(workload, (streams, i), (rounds, round));
                        samples
                            .push(request(&address, &prompt, max_tokens, long, ignore_eos).await?);
                    }
                    anyhow::Ok((samples, first.elapsed().as_secs_f64()))
                })
            })
            .collect();
        let mut per_stream = Vec::new();
        for handle in handles {
            per_stream.push(handle.await.context("a client task panicked")??);
        }
        anyhow::Ok(per_stream)
    })?;
    let wall_secs = start.elapsed().as_secs_f64();
    let tokens_of = |samples: &[Sample]| samples.iter().map(|s| s.completion_tokens).sum::<usize>();
    let tokens_per_sec = if stagger_secs > 0.0 {
        per_stream
            .iter()
            .map(|(samples, secs)| tokens_of(samples) as f64 / secs.max(1e-9))
            .sum()
    } else {
        per_stream.iter().map(|(s, _)| tokens_of(s)).sum::<usize>() as f64 / wall_secs
    };
    let samples = per_stream.into_iter().flat_map(|(s, _)| s).collect();
    Ok((tokens_per_sec, samples))
}

/// How long stream `i` of `streams` waits before its first request: `i/streams` of
/// `stagger_secs` (0 or less: no wait), so the streams' requests are spread evenly over one
/// request's duration.
fn start_delay(i: usize, streams: usize, stagger_secs: f64) -> Duration {
    Duration::from_secs_f64((stagger_secs * i as f64 / streams.max(1) as f64).max(0.0))
}

/// The `q` quantile (nearest rank) of `values`, 0 when empty.
fn percentile(values: &[f64], q: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

/// Sends one streaming `/v1/completions` request and times its chunks. Errors: no
/// connection, a non-200 answer, an error event, or no answer within 300 s.
async fn request(
    address: &str,
    prompt: &serde_json::Value,
    max_tokens: usize,
    long: bool,
    ignore_eos: bool,
) -> Result<Sample> {
    tokio::time::timeout(
        Duration::from_secs(300),
        stream_completion(address, prompt, max_tokens, long, ignore_eos),
    )
    .await
    .context("no complete answer within 300 s")?
}

/// The body of `GET path`. Errors: no connection, a non-200 answer.
async fn get_text(address: &str, path: &str) -> Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(address)
        .await
        .with_context(|| format!("cannot connect to {address}"))?;
    stream
        .write_all(
            format!("GET {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n")
                .as_bytes(),
        )
        .await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    let (head, body) = response
        .split_once("\r\n\r\n")
        .context("a response without a body")?;
    if !head.starts_with("HTTP/1.1 200") {
        bail!(
            "GET {path} answered {}",
            head.lines().next().unwrap_or_default()
        );
    }
    Ok(body.to_string())
}

async fn stream_completion(
    address: &str,
    prompt: &serde_json::Value,
    max_tokens: usize,
    long: bool,
    ignore_eos: bool,
) -> Result<Sample> {
    use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
    let mut body = serde_json::json!({
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": true,
        "stream_options": {"include_usage": true},
    });
    if ignore_eos {
        body["ignore_eos"] = serde_json::Value::Bool(true);
    }
    let body = body.to_string();
    let mut stream = tokio::net::TcpStream::connect(address)
        .await
        .with_context(|| format!("cannot connect to {address}"))?;
    let sent = Instant::now();
    stream
        .write_all(
            format!(
                "POST /v1/completions HTTP/1.1\r\nHost: {address}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            )
            .as_bytes(),
        )
        .await?;
    let mut reader = BufReader::new(stream);
    let mut status = String::new();
    reader.read_line(&mut status).await?;
    if !status.contains(" 200 ") {
        let mut rest = String::new();
        let _ = reader.read_to_string(&mut rest).await;
        bail!("the server answered {}: {rest}", status.trim());
    }
    let mut token_times = Vec::new();
    let mut completion_tokens = None;
    let mut lines = reader.lines();
    while let Some(line) = lines.next_line().await? {
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            break;
        }
        let chunk: serde_json::Value =
            serde_json::from_str(data).context("a stream chunk is not JSON")?;
        if let Some(error) = chunk.get("error") {
            bail!("the server failed the request: {error}");
        }
        // Token chunks carry no finish reason; the last chunk carries only the usage.
        if let Some(n) = chunk["usage"]["completion_tokens"].as_u64() {
            completion_tokens = Some(n as usize);
        } else if chunk["choices"][0]["finish_reason"].is_null() {
            token_times.push(sent.elapsed().as_secs_f64());
        }
    }
    let completion_tokens = completion_tokens.context("the stream ended without `usage`")?;
    let ttft_secs = *token_times.first().context("the stream carried no token")?;
    let tpot_secs = (token_times.len() > 1)
        .then(|| (token_times[token_times.len() - 1] - ttft_secs) / (token_times.len() - 1) as f64);
    Ok(Sample {
        long,
        ttft_secs,
        tpot_secs,
        completion_tokens,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A plan's `isl` is the prompt's length in tokens whatever the tokenizer, and no two
    /// requests of a sweep share their first token.
    #[test]
    fn staggered_streams_start_evenly_over_one_request() {
        let delays: Vec<f64> = (0..4)
            .map(|i| start_delay(i, 4, 2.0).as_secs_f64())
            .collect();
        assert_eq!(delays, [0.0, 0.5, 1.0, 1.5]);
        // No stagger (the plain benchmark): every stream at once.
        assert!((0..4).all(|i| start_delay(i, 4, 0.0).is_zero()));
        assert!(start_delay(3, 4, -1.0).is_zero());
    }

    #[test]
    fn token_prompts_have_the_exact_length_and_open_differently() {
        for tokens in [1, 2, 24, 1000] {
            assert_eq!(ids_prompt(tokens, (0, 0, 1)).len(), tokens);
        }
        assert_eq!(ids_prompt(0, (0, 0, 1)).len(), 1);
        let (streams, rounds) = (64, 8);
        let mut openings: Vec<u32> = (0..streams)
            .flat_map(|stream| (0..rounds).map(move |round| (stream, round)))
            .map(|(stream, round)| ids_prompt(16, (stream, round, rounds))[0])
            .collect();
        openings.sort_unstable();
        openings.dedup();
        assert_eq!(openings.len(), streams * rounds);
        let ids = ids_prompt(100, (63, 7, rounds));
        assert!(
            ids.iter()
                .all(|&id| (300..FIRST_OPENING_ID + OPENINGS as u32).contains(&id))
        );
        let (prompt, long) = prompt_for(Workload::Tokens(24), (4, 1), (2, 1));
        assert!(!long);
        assert_eq!(prompt.as_array().map(Vec::len), Some(24));
    }
}
