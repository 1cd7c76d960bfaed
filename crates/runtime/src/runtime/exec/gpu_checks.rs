//! `infer smoke`: what a user's single-GPU CI job runs. Each check is a row that passes or
//! fails with its detail; the command exits 1 when any fails. What this build checks on a
//! GPU: the driver and GPU, NVRTC, NCCL's version (optional), every kernel compiled for the
//! GPU's exact architecture within its resources, every kernel run on the GPU against the
//! CPU backend ([`crate::runtime::cuda::checks`]), cuBLAS loaded and prefill's GEMM path for every weight
//! type against the CPU's products, and the model on the GPU: greedy steps of the embedded
//! SmolLM2 against the CPU engine, twice, bit for bit, and as TP 3 shards on the one GPU
//! summed over the fallback collectives. (`launch::smoke` adds the serving row: `infer up
//! --device cuda` answering a chat request.)

use std::path::PathBuf;

use anyhow::Result;
use serde::Serialize;

use crate::runtime::cuda::checks::Check;
use crate::runtime::cuda::device::{Driver, probe};
use crate::runtime::cuda::kernels::FAMILIES;
use crate::runtime::cuda::nvrtc::Nvrtc;
use crate::runtime::exec::engine::Engine;
use crate::runtime::exec::forward::{Comparison, compare_with_cpu};
use crate::runtime::libraries::Found;

/// Everything `infer smoke` found.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub driver: Driver,
    /// NVRTC's version, `major.minor`, when it loaded.
    pub nvrtc: Option<String>,
    /// NCCL's version, `major.minor.patch`, when it is installed.
    pub nccl: Option<String>,
    /// Which file each NVIDIA library came from (the driver, NVRTC and its builtins,
    /// cuBLAS, NCCL), for those that loaded.
    pub libraries: Vec<Found>,
    pub checks: Vec<Check>,
}

/// Runs `body`, turning a panic inside it (a CUDA library or binding that panics instead of
/// returning an error) into a failing row named `name`, so the report is still printed.
fn guarded<T>(name: &str, body: impl FnOnce() -> T) -> std::result::Result<T, Check> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)).map_err(|payload| {
        let message = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "no message".into());
        Check {
            name: name.to_string(),
            passed: false,
            detail: format!("panicked: {message}"),
        }
    })
}

impl Report {
    /// Whether every check passed.
    pub fn passed(&self) -> bool {
        self.checks.iter().all(|c| c.passed)
    }
}

/// The tensor-parallel degree of the TP check: SmolLM2-135M's 9 heads on 3 KV heads split
/// 3 ways, not 2.
const SMOKE_TP: usize = 3;

/// Greedy decode steps compared with the CPU engine.
const GREEDY_STEPS: usize = 32;

/// Runs the checks on GPU 0, compiling kernels into `cache_dir`, with NVIDIA's libraries
/// looked for in `dirs` first; the model checks run `model` (a GGUF file: the embedded
/// SmolLM2 in `infer smoke`).
///
/// Errors: no driver or no GPU (then there is nothing to check: exit 2).
pub fn run(
    cache_dir: &std::path::Path,
    dirs: &[PathBuf],
    model: &std::path::Path,
) -> Result<Report> {
    let driver = probe(dirs)?;
    let gpu = driver.gpus[0].clone();
    let mut libraries = vec![Found {
        library: "driver".into(),
        soname: crate::runtime::libraries::DRIVER.into(),
        path: driver.library.clone(),
    }];
    let mut checks = vec![Check {
        name: "GPU and driver".into(),
        passed: true,
        detail: format!(
            "{} (sm_{}, {:.1} GiB), driver supports CUDA {}.{}; {} GPU{} visible",
            gpu.name,
            gpu.arch(),
            gpu.memory_bytes as f64 / (1u64 << 30) as f64,
            driver.cuda_version.0,
            driver.cuda_version.1,
            driver.gpus.len(),
            if driver.gpus.len() == 1 { "" } else { "s" }
        ),
    }];
    let opened = guarded("NVRTC", || Nvrtc::open(dirs, Some(driver.cuda_version)));
    let nvrtc = match opened {
        Ok(Ok(nvrtc)) => {
            checks.push(Check {
                name: "NVRTC".into(),
                passed: true,
                detail: format!(
                    "{}.{} from {}{}",
                    nvrtc.version.0,
                    nvrtc.version.1,
                    nvrtc.path.as_ref().map_or_else(
                        || format!("{} on the system loader's paths", nvrtc.soname),
                        |p| p.display().to_string()
                    ),
                    nvrtc
                        .builtins
                        .as_ref()
                        .map_or(String::new(), |p| format!(" (builtins {})", p.display()))
                ),
            });
            libraries.extend(nvrtc.found());
            Some(nvrtc)
        }
        Ok(Err(error)) => {
            checks.push(Check {
                name: "NVRTC".into(),
                passed: false,
                detail: format!("{error:#}"),
            });
            None
        }
        Err(check) => {
            checks.push(check);
            None
        }
    };
    if let Some(nvrtc) = &nvrtc {
        for family in FAMILIES {
            let name = format!("compile {} for sm_{}", family.file, gpu.arch());
            checks.push(
                guarded(&name, || {
                    compile_check(nvrtc, family, gpu.arch(), cache_dir)
                })
                .unwrap_or_else(|check| check),
            );
        }
        let gpu_rows = guarded("load the kernels on the GPU", || {
            gpu_checks(&gpu, driver.cuda_version, nvrtc, cache_dir, dirs)
        });
        match gpu_rows {
            Ok((rows, cublas)) => {
                checks.extend(rows);
                libraries.extend(cublas);
            }
            Err(check) => checks.push(check),
        }
    }
    let nccl = match guarded("NCCL", || nccl_check(dirs)) {
        Ok((check, version, found)) => {
            checks.push(check);
            libraries.extend(found);
            version
        }
        Err(check) => {
            checks.push(check);
            None
        }
    };
    if nvrtc.is_some() {
        let rows = guarded("the model on the GPU", || {
            model_checks(dirs, cache_dir, model)
        });
        checks.extend(rows.unwrap_or_else(|check| vec![check]));
    }
    Ok(Report {
        driver,
        nvrtc: nvrtc.map(|n| format!("{}.{}", n.version.0, n.version.1)),
        nccl,
        libraries,
        checks,
    })
}

/// Every op on the GPU against the CPU backend (test-backend-ops tolerances), then
/// prefill's products (dequantize, convert, cuBLAS); with where cuBLAS came from.
fn gpu_checks(
    gpu: &crate::runtime::cuda::device::Gpu,
    driver_cuda: (i32, i32),
    nvrtc: &Nvrtc,
    cache_dir: &std::path::Path,
    dirs: &[PathBuf],
) -> (Vec<Check>, Option<Found>) {
    let mut checks = Vec::new();
    let mut runner = match crate::runtime::cuda::gpu::GpuRunner::new(
        gpu.ordinal,
        gpu.arch(),
        nvrtc,
        cache_dir,
    ) {
        Ok(runner) => runner,
        Err(error) => {
            checks.push(Check {
                name: "load the kernels on the GPU".into(),
                passed: false,
                detail: format!("{error:#}"),
            });
            return (checks, None);
        }
    };
    checks.extend(
        crate::runtime::cuda::checks::run_all(&runner)
            .into_iter()
            .map(|c| Check {
                name: format!("op {} vs CPU", c.name),
                ..c
            }),
    );
    let line = runner.load_cublas(dirs, driver_cuda);
    let loaded = crate::runtime::cuda::backend::Device::has_gemm(&runner);
    checks.push(Check {
        name: "cuBLAS".into(),
        passed: loaded,
        detail: line.strip_prefix("warning: ").unwrap_or(&line).to_string(),
    });
    if loaded {
        checks.extend(
            crate::runtime::cuda::checks::gemm_checks(&runner)
                .into_iter()
                .map(|c| Check {
                    name: format!("op {} vs CPU", c.name),
                    ..c
                }),
        );
    }
    (checks, runner.cublas_found())
}

/// NCCL is optional (TP groups sum through host memory without it, with a warning):
/// reported, and failed only when it is installed but does not answer. Returns the row,
/// the version and where it came from.
fn nccl_check(dirs: &[PathBuf]) -> (Check, Option<String>, Option<Found>) {
    let name = "NCCL".to_string();
    match crate::runtime::collectives::nccl::Nccl::open(dirs) {
        Ok(library) => {
            let found = Found {
                library: "NCCL".into(),
                soname: crate::runtime::libraries::NCCL.into(),
                path: library.path.clone(),
            };
            match library.version() {
                Ok((major, minor, patch)) => {
                    let version = format!("{major}.{minor}.{patch}");
                    let check = Check {
                        name,
                        passed: true,
                        detail: format!("{version}: TP groups across GPUs sum through it"),
                    };
                    (check, Some(version), Some(found))
                }
                Err(error) => {
                    let check = Check {
                        name,
                        passed: false,
                        detail: format!("installed but does not answer: {error:#}"),
                    };
                    (check, None, Some(found))
                }
            }
        }
        Err(error) => {
            let check = Check {
                name,
                passed: true,
                detail: format!(
                    "{error:#}; TP groups across GPUs will sum through host memory instead"
                ),
            };
            (check, None, None)
        }
    }
}

/// One family compiled for `arch`: registers and spills per kernel.
fn compile_check(
    nvrtc: &Nvrtc,
    family: &crate::runtime::cuda::kernels::Family,
    arch: u32,
    cache_dir: &std::path::Path,
) -> Check {
    let name = format!("compile {} for sm_{arch}", family.file);
    let source = family.full_source();
    let compiled = match nvrtc.compile(family.file, &source, arch) {
        Ok(compiled) => compiled,
        Err(error) => {
            return Check {
                name,
                passed: false,
                detail: format!("{error:#}"),
            };
        }
    };
    let mut passed = true;
    let mut parts = Vec::new();
    for kernel in family.kernels {
        match compiled.resources.get(kernel.name) {
            Some(r) => {
                let spills = r.spill_store_bytes + r.spill_load_bytes;
                passed &= spills == 0 && r.registers * kernel.block_threads <= 65536;
                parts.push(format!(
                    "{}: {} registers, {} B spilled, {} B shared",
                    kernel.name, r.registers, spills, r.shared_bytes
                ));
            }
            None => {
                passed = false;
                parts.push(format!("{}: not in ptxas' report", kernel.name));
            }
        }
    }
    // The same CUBIN goes to the cache the backend loads from.
    let cache = PathBuf::from(cache_dir);
    if let Err(error) = nvrtc.compile_cached(&cache, family.file, &source, arch) {
        passed = false;
        parts.push(format!("cache: {error:#}"));
    }
    Check {
        name,
        passed,
        detail: parts.join("; "),
    }
}

/// The model on the GPU against the CPU engine: [`GREEDY_STEPS`] greedy steps of `model`
/// teacher-forced on both (tokens equal where the CPU's top-1 margin exceeds 0.1), then the
/// same steps again on the GPU, bit for bit.
fn model_checks(
    dirs: &[PathBuf],
    cache_dir: &std::path::Path,
    model: &std::path::Path,
) -> Vec<Check> {
    let greedy = format!("{GREEDY_STEPS} greedy tokens equal the CPU engine's");
    let repeat = "two runs bit-identical".to_string();
    let fail = |name: &str, error: anyhow::Error| Check {
        name: name.to_string(),
        passed: false,
        detail: format!("{error:#}"),
    };
    let run = || -> Result<(Comparison, Comparison, Result<String>)> {
        let engine = Engine::load(model, 0, crate::runtime::cpu::quant::Numerics::Exact)?;
        let text = "The capital of France is";
        let prompt = engine.tokenizer.encode(text, true)?;
        let mut device = super::kernel_executor::load_model(
            dirs,
            cache_dir,
            &engine.model,
            prompt.len() + GREEDY_STEPS + 32,
        )?;
        let first = engine
            .install(|| compare_with_cpu(&mut device, &engine.model, &prompt, GREEDY_STEPS))?;
        let second = engine
            .install(|| compare_with_cpu(&mut device, &engine.model, &prompt, GREEDY_STEPS))?;
        drop(device);
        Ok((first, second, tp_check(dirs, cache_dir, &engine, &prompt)))
    };
    let tp = format!("TP {SMOKE_TP} on one GPU through the fallback collectives");
    match run() {
        Err(error) => vec![
            fail(&greedy, anyhow::anyhow!("{error:#}")),
            fail(&repeat, anyhow::anyhow!("{error:#}")),
            fail(&tp, error),
        ],
        Ok((first, second, tp_outcome)) => vec![
            Check {
                name: greedy,
                passed: first.disagreements.is_empty() && first.decided > 0,
                detail: format!(
                    "{} of {} steps decided (margin > 0.1), {} disagree{}; logits NMSE ≤ {:.2e}",
                    first.decided,
                    first.steps,
                    first.disagreements.len(),
                    first
                        .disagreements
                        .first()
                        .map_or(String::new(), |(step, cpu, gpu)| format!(
                            " (first at step {step}: CPU {cpu}, GPU {gpu})"
                        )),
                    first.worst_nmse
                ),
            },
            Check {
                name: repeat,
                passed: first.device_logits == second.device_logits,
                detail: if first.device_logits == second.device_logits {
                    format!("{} steps' logits identical", first.steps)
                } else {
                    "the GPU's logits differ between two runs of the same steps".into()
                },
            },
            match tp_outcome {
                Ok(detail) => Check {
                    name: tp,
                    passed: true,
                    detail,
                },
                Err(error) => fail(&tp, error),
            },
        ],
    }
}

/// [`SMOKE_TP`] shards of the model on the one GPU, one thread each, their row-parallel sums
/// over TCP through a rendezvous store on the loopback: the shards' logits must agree with
/// the CPU engine (as the greedy check) and with each other, bit for bit.
fn tp_check(
    dirs: &[PathBuf],
    cache_dir: &std::path::Path,
    engine: &Engine,
    prompt: &[u32],
) -> Result<String> {
    use crate::rendezvous::{StoreClient, StoreServer, random_token};
    use crate::runtime::collectives::TcpComm;
    let timeout = std::time::Duration::from_secs(60);
    let run = crate::keyring::Keyring::master(
        &random_token(),
        crate::keyring::LAUNCHER_HOST,
        vec![0; SMOKE_TP],
    );
    let server = StoreServer::start("127.0.0.1:0", &run)?;
    let keys = run.for_host(0)?;
    let address = server.address().to_string();
    let members: Vec<u64> = (0..SMOKE_TP as u64).collect();
    let outcomes: Vec<Result<Comparison>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..SMOKE_TP)
            .map(|rank| {
                let (address, keys, members) = (&address, &keys, &members);
                scope.spawn(move || -> Result<Comparison> {
                    let shard = engine
                        .model
                        .shard(rank, SMOKE_TP, 0, engine.model.layers.len())?;
                    let mut device = super::kernel_executor::load_model(
                        dirs,
                        cache_dir,
                        &shard,
                        prompt.len() + GREEDY_STEPS + 32,
                    )?;
                    let mut store =
                        StoreClient::connect(address, keys, Some(rank as u64), timeout)?;
                    let mut comm = TcpComm::connect(
                        &mut store,
                        "smoke-tp",
                        members,
                        rank as u64,
                        "127.0.0.1",
                        timeout,
                    )?;
                    crate::runtime::exec::forward::compare_with_cpu_tp(
                        &mut device,
                        &engine.model,
                        prompt,
                        GREEDY_STEPS,
                        Some(&mut comm),
                    )
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("a TP rank's thread panicked")))
            })
            .collect()
    });
    let comparisons: Vec<Comparison> = outcomes.into_iter().collect::<Result<_>>()?;
    let first = &comparisons[0];
    if comparisons
        .iter()
        .any(|c| c.device_logits != first.device_logits)
    {
        anyhow::bail!(
            "the {SMOKE_TP} shards' logits differ (the all-reduce must give every rank the same sum)"
        );
    }
    if !first.disagreements.is_empty() || first.decided == 0 {
        anyhow::bail!(
            "{} of {} decided steps disagree with the CPU engine (first: {:?})",
            first.disagreements.len(),
            first.decided,
            first.disagreements.first()
        );
    }
    Ok(format!(
        "{} shards agree bit for bit; {} of {} steps decided, none disagree; logits NMSE ≤ {:.2e}",
        SMOKE_TP, first.decided, first.steps, first.worst_nmse
    ))
}
