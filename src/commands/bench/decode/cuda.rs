//! `infer bench decode --device cuda`'s reports: each batch's speed and the weight bandwidth
//! a decode step achieves against the GPU's datasheet HBM bandwidth (its hardware profile),
//! as text lines or as the JSON report `infer plan --calibration` reads.

use anyhow::{Context, Result};

use super::cpu::model_file_name;
use crate::cli::BenchDecodeArgs;
use crate::plan::calibration::{BatchSpeed, DecodeReport};
use crate::plan::cluster::hardware_for_gpu_name;
use crate::runtime::cuda::device::Gpu;
use crate::runtime::exec::bench::{CudaDecode, peak_rss_bytes};
use crate::runtime::exec::engine::Engine;

/// What `infer bench decode --device cuda` measured, with what its report names.
pub(super) struct CudaReport<'a> {
    engine: &'a Engine,
    /// GPU 0 as the driver lists it.
    gpu: &'a Gpu,
    prompt_tokens: usize,
    measured: CudaDecode,
    /// The GPU's datasheet HBM bandwidth (its hardware profile), bytes/s, if known.
    hbm_bytes_per_sec: Option<f64>,
}

impl<'a> CudaReport<'a> {
    /// The report of `measured` on `gpu`, which looks up the GPU's datasheet bandwidth.
    pub(super) fn new(
        engine: &'a Engine,
        gpu: &'a Gpu,
        prompt_tokens: usize,
        measured: CudaDecode,
    ) -> CudaReport<'a> {
        let hbm_bytes_per_sec = hardware_for_gpu_name(&gpu.name)
            .and_then(|id| crate::inventory::hardware(id).ok())
            .map(|h| h.hbm_gb_per_sec * 1e9);
        CudaReport {
            engine,
            gpu,
            prompt_tokens,
            measured,
            hbm_bytes_per_sec,
        }
    }

    /// Each batch's speed and achieved weight bandwidth (bytes/s, and its fraction of HBM).
    fn batch_speeds(&self) -> Vec<BatchSpeed> {
        self.measured
            .rows
            .iter()
            .map(|(batch, speed)| {
                let weight_bytes_per_sec =
                    self.measured.weight_bytes as f64 / speed.decode_step_secs;
                BatchSpeed {
                    batch: *batch,
                    decode_tokens_per_sec: speed.decode_tokens_per_sec,
                    decode_step_secs: speed.decode_step_secs,
                    weight_bytes_per_sec,
                    hbm_fraction: self.hbm_bytes_per_sec.map(|hbm| weight_bytes_per_sec / hbm),
                    launches_per_step: speed.launches_per_step,
                    issue_step_secs: Some(speed.issue_step_secs),
                }
            })
            .collect()
    }

    /// The `--json` report: the largest batch's figures and every batch's. Errors: no batch
    /// measured, or the peak RSS cannot be read.
    pub(super) fn json(&self, args: &BenchDecodeArgs) -> Result<DecodeReport> {
        let batch_speeds = self.batch_speeds();
        let (batch, speed) = self
            .measured
            .rows
            .last()
            .copied()
            .context("no batch measured")?;
        let weight_bytes = self.measured.weight_bytes;
        Ok(DecodeReport {
            bench: "decode".into(),
            model: model_file_name(self.engine),
            device: "cuda".into(),
            device_name: self.gpu.name.clone(),
            threads: 0,
            numerics: "q8_1-dp4a".into(),
            batch,
            prompt_tokens: self.prompt_tokens,
            decode_tokens: args.decode_tokens,
            prefill_tokens_per_sec: speed.prefill_tokens_per_sec,
            prefill_flops_per_sec: None,
            prefill_attention_flops: None,
            prefill_attention_flops_per_sec: None,
            decode_tokens_per_sec: speed.decode_tokens_per_sec,
            decode_step_secs: speed.decode_step_secs,
            decode_weight_bytes: weight_bytes,
            weight_bytes_per_sec: weight_bytes as f64 / speed.decode_step_secs,
            decode_attention_flops: None,
            kv_heads: None,
            decode_attention_flops_per_sec: None,
            prefill_one_thread_share: None,
            peak_rss_bytes: peak_rss_bytes()?,
            gpu_memory_used_bytes: Some(self.measured.memory_used_bytes),
            hbm_bytes_per_sec: self.hbm_bytes_per_sec,
            batches: batch_speeds,
        })
    }

    /// The text report's lines: model, weight gigabytes, device, prefill, one decode line
    /// per batch, GPU memory in GiB.
    pub(super) fn text_lines(&self, args: &BenchDecodeArgs) -> Vec<String> {
        let (engine, gpu, rows) = (self.engine, self.gpu, &self.measured.rows);
        let (weight_bytes, hbm) = (self.measured.weight_bytes, self.hbm_bytes_per_sec);
        let mut lines = vec![
            format!("model       {}", engine.name),
            format!(
                "weights     {:.2} GB read per decode step",
                weight_bytes as f64 / 1e9
            ),
            format!(
                "device      cuda:{} ({}, sm_{})",
                gpu.ordinal,
                gpu.name,
                gpu.arch()
            ),
            format!(
                "prefill     {:.1} tok/s ({} prompt tokens, best of {})",
                rows[0].1.prefill_tokens_per_sec,
                self.prompt_tokens,
                args.runs.max(1)
            ),
        ];
        for speed in self.batch_speeds() {
            lines.push(format!(
                "decode      {:.1} tok/s at batch {}: {:.0} GB/s of weights{}{}, {:.2} of {:.2} ms a step issuing it",
                speed.decode_tokens_per_sec,
                speed.batch,
                speed.weight_bytes_per_sec / 1e9,
                hbm.zip(speed.hbm_fraction).map_or(String::new(), |(hbm, fraction)| format!(
                    " ({:.0}% of the datasheet's {:.0} GB/s)",
                    100.0 * fraction,
                    hbm / 1e9
                )),
                speed
                    .launches_per_step
                    .map_or(String::new(), |n| format!(", {n:.0} launches a step")),
                speed.issue_step_secs.unwrap_or(0.0) * 1e3,
                speed.decode_step_secs * 1e3
            ));
        }
        lines.push(format!(
            "GPU memory  {:.2} GiB in use",
            self.measured.memory_used_bytes as f64 / (1u64 << 30) as f64
        ));
        lines
    }
}
