//! `infer rank` (hidden): one rank process. Reads its configuration from the environment the
//! launcher set and runs [`crate::runtime::exec::worker::run_rank`].

use anyhow::{Context, Result};

use crate::ExitStatus;
use crate::runtime::exec::rank_env::{RankEnv, forget_secrets, process_env, run_keys};
use crate::runtime::exec::worker::{RankConfig, run_rank};

/// Runs the rank described by the environment.
pub(crate) fn run(printer: &crate::ui::Printer) -> Result<ExitStatus> {
    let env = RankEnv::from_env(&process_env)?;
    let keys = run_keys(&process_env)?;
    forget_secrets();
    let config = RankConfig {
        rank: env.rank as u64,
        world_size: env.world_size as u64,
        degrees: env.degrees,
        store_address: env.store.to_string(),
        keys: keys.clone(),
        model: env.model.clone(),
        threads: env.threads,
        timeout: env.timeout,
        kv_cache_tokens: env.serving.as_ref().map(|s| s.kv_cache_tokens),
        prefix_cache: env.serving.as_ref().is_some_and(|s| s.prefix_cache),
        pd_prefill_replicas: env.serving.as_ref().and_then(|s| s.pd_prefill),
        shm: !env.shm_disable,
        bind_addr: env.bind_addr().to_string(),
        host_ranks: {
            let ranks = env.host_ranks();
            ranks.start as u64..ranks.end as u64
        },
        device: match &env.device {
            None => None,
            Some(_) => Some(rank_device()?),
        },
        cuda_visible_devices: Some(env.cuda_visible_devices.clone()),
        numerics: env.numerics,
        stall_at_step: env
            .test_fault
            .filter(|fault| fault.rank == env.rank)
            .map(|fault| fault.step),
        incarnation: env.incarnation,
    };
    // Rank 0 of a serving gang listens before it loads, answering 503 meanwhile.
    let mut server = if config.rank == 0 {
        crate::serve::http::bind_rank_http(env.serving.as_ref())?
    } else {
        None
    };
    run_rank(
        &config,
        &mut |line| printer.note_or_warn(line),
        &mut |driver, store| {
            crate::serve::http::serve_driver(
                driver,
                store,
                server.take(),
                &env,
                &keys,
                &mut |line| printer.note(line),
            )
        },
    )
    .with_context(|| format!("rank {} failed", config.rank))?;
    Ok(ExitStatus::Success)
}

/// A `--device cuda` rank's kernels: the host harness under `INFER_CUDA_HOST_HARNESS=1`, else
/// its first visible GPU (the launcher's `CUDA_VISIBLE_DEVICES`), NVIDIA's libraries looked
/// for in `INFER_CUDA_LIB_DIRS` first (the launcher's search path).
fn rank_device() -> Result<crate::runtime::exec::kernel_executor::KernelDevice> {
    use crate::runtime::exec::kernel_executor::KernelDevice;
    let cache_dir = crate::model::default::cache_dir()?.join("kernels");
    if let Some(harness) = super::host_harness(&cache_dir) {
        return Ok(harness);
    }
    Ok(KernelDevice::Gpu {
        lib_dirs: super::cuda_lib_dirs(),
        cache_dir,
    })
}
