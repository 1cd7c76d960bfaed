//! What `infer bench decode` and `infer bench allreduce` measure, without their reports: the
//! engine's prefill and decode speed on this host's CPU or on a device, and one all-reduce
//! worker process of the local all-reduce bench.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};

use super::engine::Engine;
use super::forward::{BackendModel, DecodeSpeed};
use crate::rendezvous::StoreClient;
use crate::runtime::backend::Backend;
use crate::runtime::collectives::shm::ShmComm;
use crate::runtime::collectives::{
    AllreduceRow, Comm, TcpComm, tcp_stream_bytes_per_sec, time_all_reduce,
};
use crate::runtime::model::llama::SequenceInput;
use crate::runtime::model::sampling::argmax;

/// A prompt of ordinary text, `prompt_tokens` long (at least one token).
///
/// Errors: the tokenizer fails.
pub(crate) fn prompt(engine: &Engine, prompt_tokens: usize) -> Result<Vec<u32>> {
    let text = "The quick brown fox jumps over the lazy dog while the engine measures its speed. "
        .repeat(64);
    let mut prompt = engine.tokenizer.encode(&text, false)?;
    prompt.truncate(prompt_tokens.max(1));
    Ok(prompt)
}

/// The best prefill and decode speed of the CPU engine over the timed runs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct CpuDecodeSpeed {
    /// Prompt tokens per second of one sequence's prefill.
    pub(crate) prefill_tokens_per_sec: f64,
    /// Tokens per second over the whole batch.
    pub(crate) decode_tokens_per_sec: f64,
}

/// Prefills `prompt` and decodes `decode_tokens` at `batch` (at least 1) sequences, `runs`
/// times (at least once) after one untimed warm-up run (caches, page faults), on the
/// engine's own thread pool; the best of each figure.
///
/// Errors: a forward pass fails.
pub(crate) fn cpu_decode(
    engine: &Engine,
    prompt: &[u32],
    batch: usize,
    decode_tokens: usize,
    runs: usize,
) -> Result<CpuDecodeSpeed> {
    let mut best = CpuDecodeSpeed {
        prefill_tokens_per_sec: 0.0,
        decode_tokens_per_sec: 0.0,
    };
    for run in 0..=runs.max(1) {
        let speed =
            engine.install(|| cpu_decode_run(engine, prompt, batch.max(1), decode_tokens))?;
        if run > 0 {
            best.prefill_tokens_per_sec = best
                .prefill_tokens_per_sec
                .max(speed.prefill_tokens_per_sec);
            best.decode_tokens_per_sec =
                best.decode_tokens_per_sec.max(speed.decode_tokens_per_sec);
        }
    }
    Ok(best)
}

/// One timed CPU run: prefills `prompt`, then decodes `decode_tokens` at `batch`.
///
/// Errors: a forward pass fails.
fn cpu_decode_run(
    engine: &Engine,
    prompt: &[u32],
    batch: usize,
    decode_tokens: usize,
) -> Result<CpuDecodeSpeed> {
    let mut cache = engine.model.new_cache();
    let start = Instant::now();
    let logits = engine.model.forward(&mut [SequenceInput {
        tokens: prompt,
        cache: &mut cache,
        all_logits: false,
    }])?;
    let prefill_tokens_per_sec = prompt.len() as f64 / start.elapsed().as_secs_f64();
    // The other sequences of the batch are prefilled with the same prompt, untimed.
    let mut caches = vec![cache];
    for _ in 1..batch {
        let mut cache = engine.model.new_cache();
        engine.model.forward(&mut [SequenceInput {
            tokens: prompt,
            cache: &mut cache,
            all_logits: false,
        }])?;
        caches.push(cache);
    }
    let mut next = vec![argmax(&logits[0]); batch];
    let start = Instant::now();
    for _ in 0..decode_tokens {
        let mut inputs: Vec<SequenceInput> = caches
            .iter_mut()
            .zip(&next)
            .map(|(cache, token)| SequenceInput {
                tokens: std::slice::from_ref(token),
                cache,
                all_logits: false,
            })
            .collect();
        let logits = engine.model.forward(&mut inputs)?;
        for (token, logits) in next.iter_mut().zip(&logits) {
            *token = argmax(logits);
        }
    }
    Ok(CpuDecodeSpeed {
        prefill_tokens_per_sec,
        decode_tokens_per_sec: (batch * decode_tokens) as f64 / start.elapsed().as_secs_f64(),
    })
}

/// The best timed run (by decode tokens/s) at each of `batches`, in their order: `runs`
/// timed runs (at least one) after one warm-up run (module loads, first allocations) of
/// [`super::forward::bench_decode`] on `device`.
///
/// Errors: a step fails on the device.
pub(crate) fn device_decode<B: Backend>(
    device: &mut BackendModel<B>,
    prompt: &[u32],
    batches: &[usize],
    decode_tokens: usize,
    runs: usize,
) -> Result<Vec<(usize, DecodeSpeed)>> {
    let mut rows = Vec::new();
    for &batch in batches {
        let mut best: Option<DecodeSpeed> = None;
        for run in 0..=runs.max(1) {
            let speed = super::forward::bench_decode(device, prompt, batch, decode_tokens)?;
            if run > 0 && best.is_none_or(|b| speed.decode_tokens_per_sec > b.decode_tokens_per_sec)
            {
                best = Some(speed);
            }
        }
        rows.push((batch, best.context("no timed run")?));
    }
    Ok(rows)
}

/// The processor's name (`/proc/cpuinfo`'s first `model name`), `unknown CPU` without one.
pub(crate) fn cpu_name() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|text| {
            text.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, name)| name.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into())
}

/// Peak resident set size of this process (`VmHWM` in `/proc/self/status`), bytes.
///
/// Errors: the file cannot be read or has no well-formed `VmHWM`.
pub(crate) fn peak_rss_bytes() -> Result<u64> {
    let status = std::fs::read_to_string("/proc/self/status")
        .context("failed to read `/proc/self/status`")?;
    let line = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .context("`/proc/self/status` has no `VmHWM`")?;
    let kib: u64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .context("malformed `VmHWM`")?;
    Ok(kib * 1024)
}

/// What rank 0 of the local all-reduce bench reports at the end.
#[derive(serde::Serialize, serde::Deserialize)]
pub(crate) struct AllreduceWorkerReport {
    /// The TCP ring over loopback.
    pub(crate) tcp_rows: Vec<AllreduceRow>,
    /// The shared-memory transport (empty when it was unavailable).
    pub(crate) shm_rows: Vec<AllreduceRow>,
    /// What carried the second table (`ShmComm::transport`).
    pub(crate) shm_transport: String,
    /// One plain TCP stream, rank 1 → rank 0, bytes/s.
    pub(crate) stream_bytes_per_sec: f64,
}

/// One process of the local all-reduce bench (`infer bench allreduce-worker`): joins the
/// others at the store on `store_address` with its host's `keys`, sweeps the TCP ring's all-reduce,
/// then the shared-memory transport's (unless `shm_disable` or unavailable), then one plain
/// TCP stream. Rank 0 returns the report; the others `None`.
///
/// Errors: the store or a peer cannot be reached within 60 s, a collective fails.
pub(crate) fn all_reduce_worker(
    store_address: &str,
    keys: &crate::keyring::Keyring,
    rank: u64,
    world: usize,
    max_bytes: usize,
    shm_disable: bool,
) -> Result<Option<AllreduceWorkerReport>> {
    let timeout = Duration::from_secs(60);
    let mut store = StoreClient::connect(store_address, keys, Some(rank), timeout)?;
    let members: Vec<u64> = (0..world as u64).collect();
    let tcp = TcpComm::connect(&mut store, "bench", &members, rank, "127.0.0.1", timeout)?;
    let mut comm = if shm_disable {
        ShmComm::tcp_only(tcp, &format!("{}=1", crate::envvars::SHM_DISABLE))
    } else {
        ShmComm::new(tcp)
    };
    let tcp_rows = time_all_reduce(comm.tcp_mut(), max_bytes)?;
    // The first all-reduce decides the transport (a tiny one, collectively).
    comm.all_reduce_sum(&mut [0f32])?;
    let shm_transport = comm.transport();
    let shm_rows = if comm.uses_shared_memory() {
        time_all_reduce(&mut comm, max_bytes)?
    } else {
        Vec::new()
    };
    let stream_bytes_per_sec = tcp_stream_bytes_per_sec(&mut store, rank, 1, "127.0.0.1", timeout)?;
    comm.barrier()?;
    Ok((rank == 0).then_some(AllreduceWorkerReport {
        tcp_rows,
        shm_rows,
        shm_transport,
        stream_bytes_per_sec,
    }))
}
