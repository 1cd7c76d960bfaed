//! `infer rank` (hidden): one rank process. Reads its configuration from the environment the
//! launcher set and runs [`crate::runtime::exec::worker::run_rank`].

use std::time::Duration;

use anyhow::{Context, Result};

use crate::ExitStatus;
use crate::runtime::cpu::quant::Numerics;
use crate::runtime::exec::worker::{RankConfig, run_rank};
use crate::runtime::model::source::ModelSource;

fn var(name: &str) -> Result<String> {
    std::env::var(name).with_context(|| {
        format!("`{name}` is not set: `infer rank` is started by `infer generate`/`infer up`")
    })
}

fn number<T: std::str::FromStr>(name: &str) -> Result<T> {
    var(name)?
        .parse()
        .ok()
        .with_context(|| format!("`{name}` is not a number"))
}

/// Runs the rank described by the environment.
pub fn run(printer: &crate::ui::Printer) -> Result<ExitStatus> {
    let config = RankConfig {
        rank: number("RANK")?,
        world_size: number("WORLD_SIZE")?,
        tp: number("INFER_TP")?,
        pp: number("INFER_PP")?,
        dp: match std::env::var("INFER_DP") {
            Ok(_) => number("INFER_DP")?,
            Err(_) => 1,
        },
        ep: match std::env::var("INFER_EP") {
            Ok(_) => number("INFER_EP")?,
            Err(_) => 1,
        },
        store_address: format!("{}:{}", var("MASTER_ADDR")?, var("MASTER_PORT")?),
        token: var("INFER_RUN_TOKEN")?,
        model: match (
            std::env::var_os("INFER_MODEL"),
            std::env::var("INFER_DUMMY_MODEL"),
        ) {
            (Some(path), _) => Some(ModelSource::File(path.into())),
            (None, Ok(json)) => Some(ModelSource::Dummy(
                serde_json::from_str(&json).context("`INFER_DUMMY_MODEL` is not a dummy model")?,
            )),
            (None, Err(_)) => None,
        },
        threads: number("INFER_THREADS")?,
        timeout: Duration::from_secs(number("INFER_TIMEOUT_SECS")?),
        kv_cache_tokens: match std::env::var("INFER_KV_CACHE_TOKENS") {
            Ok(_) => Some(number("INFER_KV_CACHE_TOKENS")?),
            Err(_) => None,
        },
        prefix_cache: std::env::var("INFER_PREFIX_CACHE").is_ok_and(|v| v == "1"),
        pd_prefill_replicas: match std::env::var("INFER_PD_PREFILL") {
            Ok(_) => Some(number("INFER_PD_PREFILL")?),
            Err(_) => None,
        },
        shm: std::env::var("INFER_SHM_DISABLE").map_or(true, |v| v != "1"),
        bind_addr: std::env::var("INFER_BIND_ADDR").unwrap_or_else(|_| "127.0.0.1".into()),
        host_ranks: {
            let (rank, local_rank, local_world): (u64, u64, u64) = (
                number("RANK")?,
                number("LOCAL_RANK")?,
                number("LOCAL_WORLD_SIZE")?,
            );
            let first = rank
                .checked_sub(local_rank)
                .context("`LOCAL_RANK` exceeds `RANK`")?;
            first..first + local_world
        },
        device: match std::env::var("INFER_DEVICE").as_deref() {
            Err(_) | Ok("cpu") => None,
            Ok("cuda") => Some(rank_device()?),
            Ok(other) => anyhow::bail!("`INFER_DEVICE` is `{other}`, not `cpu` or `cuda`"),
        },
        cuda_visible_devices: std::env::var("CUDA_VISIBLE_DEVICES").ok(),
        numerics: match std::env::var("INFER_NUMERICS") {
            Ok(name) => Numerics::from_name(&name)
                .with_context(|| format!("`INFER_NUMERICS` is `{name}`, not `exact` or `fast`"))?,
            Err(_) => Numerics::Exact,
        },
    };
    // Rank 0 of a serving gang listens before it loads, answering 503 meanwhile.
    let mut server = if config.rank == 0 {
        crate::serve::http::bind_rank_http()?
    } else {
        None
    };
    run_rank(
        &config,
        &mut |line| printer.note_or_warn(line),
        &mut |driver, store| {
            crate::serve::http::serve_driver(driver, store, server.take(), &mut |line| {
                printer.note(line)
            })
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
