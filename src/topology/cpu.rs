//! This host's CPU as hardware to plan for: its name, its cores, its memory, and two short
//! measurements taken on every core at once — the memory bandwidth (a STREAM-like read of a
//! buffer far larger than the private caches) and the compute rate (independent fused
//! multiply-adds). Together they take about half a second.
//!
//! The figures are peaks, as a GPU's datasheet figures are: the engine's own kernels reach
//! a fraction of them, and `infer plan --calibration` with `infer bench decode --json`
//! replaces them with what the engine achieves. Nothing here plans or prints.

use std::hint::black_box;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};

/// Bytes the bandwidth probe reads per pass: 256 MiB, larger than any core's private caches
/// and than most hosts' last-level cache. (STREAM asks for 4× the last-level cache; on hosts
/// with a larger cache than this the figure is partly the cache's, as it is for a model whose
/// weights fit in it, and a calibration replaces it.) Reading it takes 20–40 ms at
/// 10 GB/s; writing it once first costs about as much again per pass.
const BANDWIDTH_PROBE_BYTES: usize = 256 << 20;

/// Timed passes over the buffer; the fastest counts (STREAM reports the best of its trials).
const BANDWIDTH_PASSES: usize = 3;

/// Iterations of the compute probe's loop on each core: 10 independent 8-wide fused
/// multiply-adds each, 160 flops, so 3·10⁶ iterations are 0.48 GFLOP per core, a few tens of
/// milliseconds.
const COMPUTE_ITERATIONS: u64 = 3_000_000;

/// A host's CPU as the planner sees it: one device whose ranks share its cores, memory and
/// memory bandwidth.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CpuProfile {
    /// The processor's name, `/proc/cpuinfo`'s first `model name` (what `infer bench decode
    /// --json` reports as `device_name` on the CPU); `unknown CPU` without one.
    pub name: String,
    /// Cores this process may run on (`sched_getaffinity`, cgroup quotas): the most CPU ranks
    /// the host takes, one thread each at least.
    pub n_cores: u64,
    /// Main memory, bytes (`/proc/meminfo`'s `MemTotal`).
    pub memory_bytes: u64,
    /// Memory read bandwidth of all cores together, bytes/s.
    pub memory_bytes_per_sec: f64,
    /// The compute rate of all cores together, flops/s: [`probe_cpu`]'s f32 fused
    /// multiply-add throughput (a multiply-add is two), which the planner's probe replaces
    /// with the CPU engine's own quantized products in a prompt (its integer dot products
    /// outrun the FMA peak: 2-core EPYC, 250–260 GFLOP/s against 229), and a calibration
    /// with the real model's.
    pub flops_per_sec: f64,
    /// The rate at which the CPU engine reads its weights in a decode step on every core,
    /// bytes/s: its kernels' rate, which is what bounds a decode step, and may be well
    /// below `memory_bytes_per_sec` (a host whose kernels are compute-bound). Measured by
    /// the planner's probe of a host (`crate::inventory::probe_cpu_for_planning`) or given by
    /// a calibration; `None` where only the hardware was probed ([`probe_cpu`]), and then
    /// the planner reads weights at `memory_bytes_per_sec`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode_bytes_per_sec: Option<f64>,
    /// The same for bf16 weights, bytes/s: the engine converts each to f32 in its products,
    /// so that these are bound by compute, not memory. `None` where not measured, and then
    /// bf16 and fp16 weights are read at the quantized rate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode_bf16_bytes_per_sec: Option<f64>,
    /// The rate of the CPU engine's bf16 products in a prompt, flops/s: each weight is
    /// converted to f32, so that they run at a fraction of `flops_per_sec` (a 2-core EPYC:
    /// 4–10 GFLOP/s against 230). Measured by the planner's probe
    /// (`runtime::exec::bench::engine_decode_rates`), or a calibration's prompt rate; `None`
    /// where not measured, and then bf16 and fp16 prompts compute at `flops_per_sec`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_bf16_flops_per_sec: Option<f64>,
    /// Seconds each decoder layer of a one-sequence decode step costs beyond its weights'
    /// bytes: the layer's fixed work and its threads' hand-offs between operations, which
    /// make a model of many thin layers read slower than one of a few wide ones (SmolLM2's 30
    /// layers of 576 at three quarters of the rate). With it, `decode_bytes_per_sec` is the
    /// wide probe's step less its layers' cost. Measured by the planner's probe on a model of
    /// 32 tiny layers that the caches hold (`runtime::exec::bench::engine_decode_rates`);
    /// `None` where not measured, or after a calibration, whose measured rate already counts
    /// its model's layers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode_layer_secs: Option<f64>,
    /// `decode_bytes_per_sec` of one thread alone, bytes/s: a one-thread engine's step on
    /// the same probe, which pays no hand-offs between threads, so that it reads more than
    /// its share of the all-core rate (a 2-core EPYC VM: SmolLM2's step took 6.3 ms on one
    /// thread and 4.0–4.4 ms on both). `None` on one core or where not measured, and then a
    /// rank gets its threads' share of the all-core rates.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode_one_thread_bytes_per_sec: Option<f64>,
    /// `decode_attention_flops_per_sec` of one thread alone, flops/s; `None` as above.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode_one_thread_attention_flops_per_sec: Option<f64>,
    /// The arithmetic rate of the CPU engine's decode attention on every core with a task for
    /// every thread ([`attention_occupancy`] 1), flops/s of the planner's count
    /// (`4 · n_heads · head_dim` per cached position and layer): each query head's score
    /// against an f16 key, its softmax term and its share of the weighted sum of f16 values.
    /// Its time goes with this arithmetic, not with the KV bytes, at a small fraction of
    /// `flops_per_sec`, and its rate with the shape (2-core EPYC: SmolLM2's 3 query heads of
    /// 64 per KV head at 19–20 GFLOP/s, the probe's 2 of 128 at 13–16). Measured by the
    /// planner's probe, or on the real model by a calibration; `None` where not measured,
    /// and then the KV cache is read at the weights' rate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode_attention_flops_per_sec: Option<f64>,
    /// The arithmetic rate of the CPU engine's prefill attention on every core, flops/s of
    /// the planner's count (`2 · tokens² · n_heads · head_dim` per layer for a prompt): a
    /// prompt's tokens attend in one task per (token, KV head) with the prompt's kernels,
    /// well below the rate of its products (2-core EPYC: 38–46 GFLOP/s for SmolLM2, against
    /// ~220 for its products), so that a long prompt's time grows with its square. Measured
    /// by the planner's probe (`runtime::exec::bench::engine_prefill_attention_flops_per_sec`)
    /// or on the real model by a calibration; `None` where not measured, and then a prompt's
    /// attention is computed at `flops_per_sec`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_attention_flops_per_sec: Option<f64>,
    /// The share of the host's prompt rates (`flops_per_sec`, `prefill_bf16_flops_per_sec`,
    /// `prefill_attention_flops_per_sec`) that one thread computes while every core runs
    /// one, 0 to 1: above `1 / n_cores`, since a team of threads pays hand-offs between them
    /// that a thread alone does not, the more so the narrower the model (2-core EPYC: 0.50–0.51
    /// for the probe's wide model, 0.54–0.56 for SmolLM2's 128-token prompt). Measured side
    /// by side by the planner's probe (`runtime::exec::bench::engine_decode_rates`), or on the
    /// real model by a calibration; `None` on one core or where not measured, and then a rank
    /// gets its threads' share of the prompt rates.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_one_thread_share: Option<f64>,
    /// How the figures were obtained (`probed on this host in 0.41 s`).
    pub source: String,
}

impl CpuProfile {
    /// The rate a decode step reads weights at, bytes/s: the engine's measured rate when
    /// there is one, else the memory's.
    pub fn weight_read_bytes_per_sec(&self) -> f64 {
        self.decode_bytes_per_sec
            .unwrap_or(self.memory_bytes_per_sec)
    }
}

/// The busy share of `threads` threads over a layer's decode attention of `tasks` tasks,
/// 0 to 1: the CPU engine runs one task per (sequence, KV head) of a layer
/// (`runtime::model::llama::Llama::attend`), each on one thread, and the layer ends with its
/// last round of `ceil(tasks / threads)`: `tasks / (rounds · threads)`. One sequence of a
/// model with 3 KV heads on 2 threads keeps them busy 3/4 of the time.
pub fn attention_occupancy(tasks: u64, threads: u64) -> f64 {
    let (tasks, threads) = (tasks.max(1), threads.max(1));
    tasks as f64 / (tasks.div_ceil(threads) * threads) as f64
}

/// Seconds the CPU engine's decode attention takes over `attention_flops` at
/// `flops_per_sec` with every thread busy, when `tasks` tasks share `threads` threads
/// ([`attention_occupancy`]).
pub fn attention_secs(attention_flops: f64, flops_per_sec: f64, tasks: u64, threads: u64) -> f64 {
    attention_flops / (flops_per_sec * attention_occupancy(tasks, threads))
}

/// Probes this host's CPU: reads its name and memory, then measures its memory bandwidth and
/// compute rate on every core.
///
/// Errors: `/proc/meminfo` cannot be read or has no `MemTotal`, or the bandwidth probe's
/// buffer cannot be allocated.
pub fn probe_cpu() -> Result<CpuProfile> {
    let started = Instant::now();
    let meminfo =
        std::fs::read_to_string("/proc/meminfo").context("cannot read `/proc/meminfo`")?;
    let memory_bytes = mem_total_bytes(&meminfo)?;
    let name = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|text| model_name(&text))
        .unwrap_or_else(|| "unknown CPU".to_string());
    let n_cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let memory_bytes_per_sec = read_bandwidth_bytes_per_sec(n_cores)?;
    let flops_per_sec = fma_flops_per_sec(n_cores);
    Ok(CpuProfile {
        name,
        n_cores: n_cores as u64,
        memory_bytes,
        memory_bytes_per_sec,
        flops_per_sec,
        decode_bytes_per_sec: None,
        decode_bf16_bytes_per_sec: None,
        decode_layer_secs: None,
        decode_one_thread_bytes_per_sec: None,
        decode_one_thread_attention_flops_per_sec: None,
        decode_attention_flops_per_sec: None,
        prefill_attention_flops_per_sec: None,
        prefill_bf16_flops_per_sec: None,
        prefill_one_thread_share: None,
        source: format!(
            "probed on this host in {:.2} s",
            started.elapsed().as_secs_f64()
        ),
    })
}

/// `MemTotal` of `/proc/meminfo`'s text, bytes. Errors: no such line, or not `<n> kB`.
fn mem_total_bytes(meminfo: &str) -> Result<u64> {
    let line = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .context("`/proc/meminfo` has no `MemTotal`")?;
    let kib = line
        .trim()
        .strip_suffix("kB")
        .and_then(|n| n.trim().parse::<u64>().ok());
    match kib {
        Some(kib) if kib > 0 => Ok(kib * 1024),
        _ => bail!("`/proc/meminfo`'s `MemTotal:{line}` is not a size in kB"),
    }
}

/// The first `model name` of `/proc/cpuinfo`'s text.
fn model_name(cpuinfo: &str) -> Option<String> {
    cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, name)| name.trim().to_string())
        .filter(|name| !name.is_empty())
}

/// Read bandwidth of `n_threads` threads, each summing its share of a
/// [`BANDWIDTH_PROBE_BYTES`] buffer, bytes/s: the fastest of [`BANDWIDTH_PASSES`].
///
/// Errors: the buffer cannot be allocated.
fn read_bandwidth_bytes_per_sec(n_threads: usize) -> Result<f64> {
    let n_threads = n_threads.max(1);
    let share_words = BANDWIDTH_PROBE_BYTES / 8 / n_threads;
    // Each thread fills its own share (the pages then sit by its core, as first touched),
    // with values that are not zero: untouched or zeroed pages all map the kernel's one zero
    // page, which stays in the cache.
    let parts: Vec<Vec<u64>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..n_threads)
            .map(|part_idx| {
                scope.spawn(move || {
                    let mut part: Vec<u64> = Vec::new();
                    part.try_reserve_exact(share_words).ok()?;
                    part.extend((0..share_words).map(|i| (part_idx * share_words + i) as u64 | 1));
                    Some(part)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().ok().flatten())
            .collect::<Option<Vec<_>>>()
    })
    .context("cannot allocate the memory bandwidth probe's 256 MiB")?;
    let mut best_secs = f64::INFINITY;
    for _ in 0..BANDWIDTH_PASSES {
        let started = Instant::now();
        std::thread::scope(|scope| {
            for part in &parts {
                scope.spawn(move || black_box(sum_words(part)));
            }
        });
        best_secs = best_secs.min(started.elapsed().as_secs_f64());
    }
    let read_bytes = (share_words * n_threads * 8) as f64;
    Ok(read_bytes / best_secs.max(f64::MIN_POSITIVE))
}

/// The wrapping sum of `words`, over eight independent lanes so that the loads, not the adds'
/// latency, bound it (the compiler turns the lanes into vector adds).
fn sum_words(words: &[u64]) -> u64 {
    let mut lanes = [0u64; 8];
    let chunks = words.chunks_exact(8);
    let rest = chunks.remainder();
    for chunk in chunks {
        for (lane, word) in lanes.iter_mut().zip(chunk) {
            *lane = lane.wrapping_add(*word);
        }
    }
    rest.iter()
        .chain(&lanes)
        .fold(0u64, |sum, word| sum.wrapping_add(*word))
}

/// Passes of the compute probe; the fastest counts, as for the bandwidth: one pass of a few
/// tens of milliseconds came out at half the rate now and then on a shared 2-core VM (a
/// process exiting next to it), which halved every compute-bound prediction of the plan.
const COMPUTE_PASSES: usize = 3;

/// Fused multiply-add throughput of `n_threads` threads running [`COMPUTE_ITERATIONS`] each,
/// flops/s: the fastest of [`COMPUTE_PASSES`].
fn fma_flops_per_sec(n_threads: usize) -> f64 {
    (0..COMPUTE_PASSES)
        .map(|_| {
            let started = Instant::now();
            let flops: f64 = std::thread::scope(|scope| {
                let handles: Vec<_> = (0..n_threads.max(1))
                    .map(|_| scope.spawn(|| fma_flops(black_box(COMPUTE_ITERATIONS))))
                    .collect();
                handles
                    .into_iter()
                    .map(|h| h.join().map_or(0.0, |(flops, _)| flops))
                    .sum()
            });
            flops / started.elapsed().as_secs_f64().max(f64::MIN_POSITIVE)
        })
        .fold(0.0, f64::max)
}

/// Runs `iterations` of 10 independent 8-wide multiply-adds; returns the flops done and a
/// result the compiler cannot discard. AVX2 with FMA where the CPU has it (checked at run
/// time: the binary is built for baseline x86-64), else the portable loop.
fn fma_flops(iterations: u64) -> (f64, f32) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has AVX2 and FMA, checked on the line above.
        let result = unsafe { fma_avx2(iterations) };
        return (iterations as f64 * 160.0, result);
    }
    (iterations as f64 * 160.0, fma_portable(iterations))
}

/// [`fma_flops`]'s loop with AVX2 fused multiply-adds: 10 accumulators cover the FMA units'
/// latency (4–5 cycles) times their count (2 per core).
///
/// # Safety
///
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn fma_avx2(iterations: u64) -> f32 {
    use std::arch::x86_64::{
        _mm256_add_ps, _mm256_fmadd_ps, _mm256_set1_ps, _mm256_setzero_ps, _mm256_storeu_ps,
    };
    let a = _mm256_set1_ps(black_box(0.999_9));
    let b = _mm256_set1_ps(black_box(0.000_1));
    let mut accumulators = [_mm256_set1_ps(1.0); 10];
    for _ in 0..iterations {
        for accumulator in &mut accumulators {
            *accumulator = _mm256_fmadd_ps(*accumulator, a, b);
        }
    }
    let mut total = _mm256_setzero_ps();
    for accumulator in accumulators {
        total = _mm256_add_ps(total, accumulator);
    }
    let mut lanes = [0.0f32; 8];
    // SAFETY: `lanes` holds the 8 floats the unaligned store writes.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), total) };
    lanes.iter().sum()
}

/// [`fma_flops`]'s loop in plain Rust (`mul_add`), for CPUs without AVX2 and FMA.
fn fma_portable(iterations: u64) -> f32 {
    let (a, b) = (black_box(0.999_9f32), black_box(0.000_1f32));
    let mut accumulators = [[1.0f32; 8]; 10];
    for _ in 0..iterations {
        for accumulator in &mut accumulators {
            for lane in accumulator.iter_mut() {
                *lane = lane.mul_add(a, b);
            }
        }
    }
    accumulators.iter().flatten().sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_and_cpuinfo_are_read_and_refused_clearly() {
        let meminfo = "MemTotal:       24683656 kB\nMemFree:         5461616 kB\n";
        assert_eq!(mem_total_bytes(meminfo).expect("total"), 24683656 * 1024);
        let error = mem_total_bytes("MemFree: 1 kB\n").expect_err("no total");
        assert!(error.to_string().contains("no `MemTotal`"), "{error}");
        let error = mem_total_bytes("MemTotal: lots\n").expect_err("not kB");
        assert!(error.to_string().contains("not a size in kB"), "{error}");
        let cpuinfo = "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Processor\nflags\t: fpu\n";
        assert_eq!(
            model_name(cpuinfo).as_deref(),
            Some("Intel(R) Xeon(R) Processor")
        );
        assert_eq!(model_name("processor\t: 0\n"), None);
    }

    #[test]
    fn the_sum_covers_every_word_including_the_tail() {
        let words: Vec<u64> = (1..=21).collect();
        assert_eq!(sum_words(&words), 21 * 22 / 2);
        assert_eq!(sum_words(&[]), 0);
    }

    #[test]
    fn both_compute_loops_count_the_same_flops_and_agree() {
        let (flops, fast) = fma_flops(1000);
        assert_eq!(flops, 1000.0 * 10.0 * 8.0 * 2.0);
        let portable = fma_portable(1000);
        assert!(
            (fast - portable).abs() <= 1e-3 * portable.abs(),
            "{fast} vs {portable}"
        );
    }

    #[test]
    fn attention_occupancy_counts_the_idle_threads_of_the_last_round() {
        // SmolLM2 (3 KV heads), one sequence, 2 threads: two rounds, 3 of 4 slots busy.
        assert_eq!(attention_occupancy(3, 2), 0.75);
        // Four sequences: 12 tasks fill 6 rounds of 2.
        assert_eq!(attention_occupancy(12, 2), 1.0);
        // Llama's 8 KV heads on 64 threads: one round, 8 of 64 busy.
        assert_eq!(attention_occupancy(8, 64), 0.125);
        // One thread is always busy; no tasks count as one.
        assert_eq!(attention_occupancy(5, 1), 1.0);
        assert_eq!(attention_occupancy(0, 4), 0.25);
    }
}
