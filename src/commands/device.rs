//! `--device cuda` before anything starts, for the commands that take it (`generate`, `up`,
//! `bench decode`, `smoke`, `rank`): where NVIDIA's libraries are, a driver and a GPU on this host,
//! or the host harness that `INFER_CUDA_HOST_HARNESS=1` asks for.

/// Where NVIDIA's libraries are looked for first, from this process's environment
/// ([`crate::runtime::libraries::search_dirs`]).
pub(super) fn cuda_lib_dirs() -> Vec<std::path::PathBuf> {
    crate::runtime::libraries::search_dirs(&|name| std::env::var_os(name))
}

/// `--device cuda`'s first step, before anything starts: a driver and a GPU on this host.
///
/// Errors: no driver or no GPU, naming this host.
pub(super) fn require_gpu() -> anyhow::Result<crate::runtime::cuda::device::Driver> {
    use anyhow::Context;
    crate::runtime::cuda::device::probe(&cuda_lib_dirs()).with_context(|| {
        format!(
            "--device cuda on host `{}`",
            crate::topology::probe::local_hostname()
        )
    })
}

/// `--device cuda` on `infer generate` and `infer up`, before anything starts: the kernels on
/// this host's GPUs (a driver and a GPU must be here, unless the ranks run on an inventory's
/// hosts, `remote`, whose agents report theirs) or, with `INFER_CUDA_HOST_HARNESS=1`, on the
/// host harness (the same sources on CPU threads, built by `$CXX` or `c++`: the device path
/// checked on a machine without a GPU). Returns the device and the visible GPUs that local
/// rank processes are given (none for the harness: each rank's `CUDA_VISIBLE_DEVICES` is then
/// its local rank, as it would be on a GPU host).
///
/// Errors: no driver or no GPU, naming this host; no cache directory.
pub(super) fn cuda_device(
    remote: bool,
) -> anyhow::Result<(crate::runtime::exec::kernel_executor::KernelDevice, usize)> {
    use crate::runtime::exec::kernel_executor::KernelDevice;
    let cache_dir = crate::model::default::cache_dir()?.join("kernels");
    if let Some(harness) = host_harness(&cache_dir) {
        return Ok((harness, 0));
    }
    if remote {
        return Ok((
            KernelDevice::Gpu {
                lib_dirs: cuda_lib_dirs(),
                cache_dir,
            },
            0,
        ));
    }
    let driver = require_gpu()?;
    Ok((
        KernelDevice::Gpu {
            lib_dirs: cuda_lib_dirs(),
            cache_dir,
        },
        driver.gpus.len(),
    ))
}

/// The host harness, when `INFER_CUDA_HOST_HARNESS=1` asks for it: the kernels built by
/// `$CXX` (else `c++`), the library cached under `cache_dir`.
pub(super) fn host_harness(
    cache_dir: &std::path::Path,
) -> Option<crate::runtime::exec::kernel_executor::KernelDevice> {
    std::env::var(crate::envvars::CUDA_HOST_HARNESS)
        .is_ok_and(|v| v == "1")
        .then(
            || crate::runtime::exec::kernel_executor::KernelDevice::HostHarness {
                compiler: std::env::var("CXX").unwrap_or_else(|_| "c++".into()),
                cache_dir: cache_dir.to_path_buf(),
            },
        )
}
