//! A model (the whole of it, or one tensor-parallel shard) on the CUDA kernels as an
//! [`Executor`]: what `--device cuda` generates and serves with, in one process or in each
//! rank process of a TP replica.

use std::path::PathBuf;

use anyhow::{Context, Result};

use crate::runtime::collectives::Comm;
use crate::runtime::cuda::backend::KernelBackend;
use crate::runtime::exec::executor::Executor;
use crate::runtime::exec::forward::{BackendExecutor, BackendModel};
use crate::runtime::model::llama::Llama;
use crate::runtime::model::tokenizer::Tokenizer;

/// Where the CUDA kernels run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KernelDevice {
    /// The first GPU this process sees (a rank's launcher gives it its own through
    /// `CUDA_VISIBLE_DEVICES`); NVIDIA's libraries are looked for in `lib_dirs` first, and
    /// CUBINs are cached in `cache_dir`.
    Gpu {
        lib_dirs: Vec<PathBuf>,
        cache_dir: PathBuf,
    },
    /// The host harness ([`crate::runtime::cuda::host`]): the same kernel sources built by the C++ compiler
    /// `compiler` and run on CPU threads, the library cached in `cache_dir`. What
    /// `INFER_CUDA_HOST_HARNESS=1` selects: the device path (rank processes, collectives,
    /// serving) checked on a machine without a GPU, slowly.
    HostHarness {
        compiler: String,
        cache_dir: PathBuf,
    },
}

/// The groups of a rank's shard ([`load_executor`]); `None`: no such parallelism.
#[derive(Default)]
pub struct Groups {
    /// The TP group (members in TP rank order).
    pub tp: Option<Box<dyn Comm>>,
    /// The pipeline (members in stage order).
    pub pp: Option<Box<dyn Comm>>,
    /// Tells this rank's host from the other members' (its first global rank): members on
    /// different hosts may have GPUs of the same PCI address.
    pub host_key: u64,
}

/// What [`load_executor`] put where.
pub struct Loaded {
    pub executor: Box<dyn Executor>,
    /// The device, for messages ("cuda:0 (NVIDIA H100 80GB HBM3, sm_90)").
    pub device: String,
    /// Where large products run (cuBLAS or not), how the TP group's all-reduces and the
    /// pipeline's hand-offs travel (a line starting "warning: " is a warning).
    pub notes: Vec<String>,
}

/// Puts `model` (the whole model, or a TP shard of a pipeline stage) on `device` with a KV
/// cache of `kv_cache_tokens` positions, as an executor that samples on the host with
/// `tokenizer`. A TP shard sums over `groups.tp`, a pipeline stage passes hidden states along
/// `groups.pp`; their members must run the same steps.
///
/// Errors: no driver or GPU (the probe's message), no NVRTC (naming the pip package), no
/// C++ compiler for the harness, a kernel that does not compile or load, what the backend
/// does not run (named), device memory.
pub fn load_executor(
    device: &KernelDevice,
    model: &Llama,
    kv_cache_tokens: usize,
    tokenizer: Tokenizer,
    groups: Groups,
) -> Result<Loaded> {
    fn boxed<B>(mut executor: BackendExecutor<B>, groups: Groups) -> Box<dyn Executor>
    where
        B: crate::runtime::backend::Backend + Send + 'static,
        B::Buffer: Send,
        B::Matrix: Send,
    {
        if let Some(tp) = groups.tp {
            executor = executor.with_tp_group(tp);
        }
        if let Some(pp) = groups.pp {
            executor = executor.with_pp_group(pp);
        }
        Box::new(executor)
    }
    match device {
        KernelDevice::Gpu {
            lib_dirs,
            cache_dir,
        } => {
            let (mut runner, gpu) = crate::runtime::cuda::gpu::open_first(lib_dirs, cache_dir)?;
            let mut groups = groups;
            let mut notes = vec![runner.gemm_line().to_string()];
            // Every rank joins its TP group's communicator, then its pipeline's: the same
            // order everywhere, so no init waits on a member busy with the other group.
            use crate::runtime::collectives::nccl::GroupKind;
            if let Some(tp) = groups.tp.as_deref_mut() {
                notes.push(runner.join_nccl(GroupKind::Tp, tp, lib_dirs, groups.host_key)?);
            }
            if let Some(pp) = groups.pp.as_deref_mut() {
                notes.push(runner.join_nccl(GroupKind::Pipeline, pp, lib_dirs, groups.host_key)?);
            }
            let model = model_on(runner, &gpu, model, kv_cache_tokens)?;
            Ok(Loaded {
                executor: boxed(BackendExecutor::new(model, tokenizer), groups),
                device: format!("cuda:{} ({}, sm_{})", gpu.ordinal, gpu.name, gpu.arch()),
                notes,
            })
        }
        KernelDevice::HostHarness {
            compiler,
            cache_dir,
        } => {
            let kernels =
                crate::runtime::cuda::host::HostKernels::build_cached(cache_dir, compiler)?;
            let model = BackendModel::new(KernelBackend::new(kernels), model, kv_cache_tokens)
                .context("cannot put the model on the host harness")?;
            let mut notes = vec![format!(
                "prefill and batches over {} tokens run on one GEMM each: a host loop standing in for cuBLAS, which needs a GPU",
                crate::runtime::cuda::backend::MAX_MATVEC_TOKENS
            )];
            for (group, traffic) in [
                (groups.tp.is_some(), "TP all-reduces"),
                (groups.pp.is_some(), "pipeline hand-offs"),
            ] {
                if group {
                    notes.push(format!(
                        "{traffic} go through host memory (TCP, shared memory inside a host): the host harness has no NCCL"
                    ));
                }
            }
            Ok(Loaded {
                executor: boxed(BackendExecutor::new(model, tokenizer), groups),
                device: format!(
                    "the host harness ({}=1: CUDA kernels on CPU threads)",
                    crate::envvars::CUDA_HOST_HARNESS
                ),
                notes,
            })
        }
    }
}

/// Opens the first visible GPU (after `CUDA_VISIBLE_DEVICES`), compiles or takes from
/// `cache_dir` every kernel for its architecture, and uploads `model` with a KV cache of
/// `kv_cache_tokens` positions: the model `--device cuda` runs. NVIDIA's libraries are
/// looked for in `dirs` first.
///
/// Errors: no driver or GPU (the probe's message), no NVRTC (naming the pip package), a
/// kernel that does not compile or load, what the backend does not run (named), GPU memory.
pub(crate) fn load_model(
    dirs: &[std::path::PathBuf],
    cache_dir: &std::path::Path,
    model: &crate::runtime::model::llama::Llama,
    kv_cache_tokens: usize,
) -> Result<BackendModel<KernelBackend<crate::runtime::cuda::gpu::GpuRunner>>> {
    let (runner, gpu) = crate::runtime::cuda::gpu::open_first(dirs, cache_dir)?;
    model_on(runner, &gpu, model, kv_cache_tokens)
}

/// `model` uploaded to `runner`'s GPU with a KV cache of `kv_cache_tokens` positions.
///
/// Errors: what the backend does not run (named), GPU memory.
pub(crate) fn model_on(
    runner: crate::runtime::cuda::gpu::GpuRunner,
    gpu: &crate::runtime::cuda::device::Gpu,
    model: &crate::runtime::model::llama::Llama,
    kv_cache_tokens: usize,
) -> Result<BackendModel<KernelBackend<crate::runtime::cuda::gpu::GpuRunner>>> {
    BackendModel::new(KernelBackend::new(runner), model, kv_cache_tokens)
        .with_context(|| format!("cannot put the model on {} (sm_{})", gpu.name, gpu.arch()))
}
