//! The CUDA backend, checked without a GPU: NVRTC from PyPI compiles every kernel to CUBIN for
//! each architecture we support, ptxas' resources stay within what the launch can use, and
//! each kernel's parameters are the ones its Rust launch description passes.

use infer::runtime::formats::ggml::GgmlType;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use infer::runtime::cuda::backend::Device;
use infer::runtime::cuda::kernels::FAMILIES;
use infer::runtime::cuda::nvrtc::{Nvrtc, ptx_entries};

use crate::support::cache::{cached_dir, recipe_hash, test_cache};
use crate::support::process::{run, transcript_of};
use crate::support::runtime::host;

/// NVRTC from PyPI, pinned: it compiles without a GPU or a driver (FACTS.md).
const NVRTC_WHEEL: &str = "nvidia-cuda-nvrtc-cu12==12.9.86";

/// `wheel` (`name==version`) from PyPI, downloaded once (`pip download --no-deps`) and
/// unzipped into the test cache under `label-<hash>`: every file, or only `members`.
/// Returns the directory it was unzipped into.
fn pypi_wheel(label: &str, wheel: &str, members: &[&str]) -> PathBuf {
    let dir = test_cache().join(format!("{label}-{}", recipe_hash(wheel.as_bytes())));
    cached_dir(&dir, |staging| {
        std::fs::create_dir_all(staging).expect("staging dir");
        let status = Command::new("python3")
            .args(["-m", "pip", "download", "--quiet", "--no-deps", "--dest"])
            .arg(staging)
            .arg(wheel)
            .status()
            .expect("python3 -m pip");
        assert!(status.success(), "pip download {wheel} failed");
        let unzip = "import sys, zipfile, glob, os\n\
                     for wheel in glob.glob(sys.argv[1] + '/*.whl'):\n    \
                     z = zipfile.ZipFile(wheel)\n    \
                     z.extractall(sys.argv[1], sys.argv[2:] or None)\n    \
                     os.remove(wheel)\n";
        let status = Command::new("python3")
            .args(["-c", unzip])
            .arg(staging)
            .args(members)
            .status()
            .expect("python3");
        assert!(status.success(), "unzipping {wheel} failed");
    })
}

/// The directory holding `libnvrtc.so.12` (the whole wheel, unzipped once).
fn nvrtc_lib_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| pypi_wheel("nvrtc", NVRTC_WHEEL, &[]).join("nvidia/cuda_nvrtc/lib"))
}

/// NVRTC of CUDA 13 from PyPI, pinned: what PyTorch 2.11 (cu130) installs on today's GPU
/// nodes, into the shared `nvidia/cu13/lib` (FACTS.md).
const NVRTC13_WHEEL: &str = "nvidia-cuda-nvrtc==13.0.88";

/// The unzipped CUDA 13 NVRTC wheel (its `nvidia/cu13/lib` holds `libnvrtc.so.13` and the
/// `libnvrtc-builtins.so.13.0` it opens; the `.alt` variants are left out).
fn nvrtc13_root() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        pypi_wheel(
            "nvrtc13",
            NVRTC13_WHEEL,
            &[
                "nvidia/cu13/lib/libnvrtc.so.13",
                "nvidia/cu13/lib/libnvrtc-builtins.so.13.0",
            ],
        )
    })
}

/// NCCL from PyPI, pinned: what `--device cuda` TP ranks load (`libnccl.so.2`).
const NCCL_WHEEL: &str = "nvidia-nccl-cu12==2.32.3";

/// The directory holding `libnccl.so.2` (only that file of the 350 MB wheel).
fn nccl_lib_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        pypi_wheel("nccl", NCCL_WHEEL, &["nvidia/nccl/lib/libnccl.so.2"]).join("nvidia/nccl/lib")
    })
}

/// cuBLAS from PyPI, pinned: what `--device cuda` runs prefill's GEMMs with.
const CUBLAS_WHEEL: &str = "nvidia-cublas-cu12==12.9.1.4";

/// Our cuBLAS binding against the real library from PyPI (only `libcublas.so.12` and the
/// `libcublasLt.so.12` it needs, of the 580 MB wheel), on this machine without a GPU: a
/// missing library names the pip packages; opened from its directory, every entry point
/// binds and its version is the wheel's; creating a handle without a GPU is an error, not a
/// crash — what `GpuRunner::load_cublas` turns into a warning, leaving prefill on the
/// matrix-vector kernels — and dropping nothing panics. A CUDA 12.2 driver (R535) is never
/// offered CUDA 13's soname.
#[test]
fn cublas_from_pypi_loads_reports_its_version_and_fails_cleanly_without_a_gpu() {
    use infer::runtime::cuda::cublas::Cublas;
    use infer::runtime::libraries::{CUBLAS, sonames_for_driver};
    assert_eq!(
        sonames_for_driver(CUBLAS, Some((12, 2))),
        ["libcublas.so.12"]
    );
    assert_eq!(
        sonames_for_driver(CUBLAS, Some((13, 0))),
        ["libcublas.so.13", "libcublas.so.12"]
    );
    let empty = tempfile::tempdir().expect("tempdir");
    // Nothing else in this test binary opens cuBLAS, and this machine's loader has none
    // (unless a CUDA toolkit was installed system-wide).
    if let Err(error) = Cublas::open(&[empty.path().to_path_buf()], Some((12, 2))) {
        let text = format!("{error:#}");
        assert!(
            text.contains("pip install nvidia-cublas-cu12")
                && text.contains("libcublas.so.12")
                && !text.contains("libcublas.so.13 or")
                && text.contains("CUDA 13 libraries need driver R580"),
            "{text}"
        );
    }
    let dir = pypi_wheel(
        "cublas",
        CUBLAS_WHEEL,
        &[
            "nvidia/cublas/lib/libcublas.so.12",
            "nvidia/cublas/lib/libcublasLt.so.12",
        ],
    )
    .join("nvidia/cublas/lib");
    let cublas = Cublas::open(&[empty.path().to_path_buf(), dir.clone()], Some((13, 0)))
        .unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(cublas.soname, "libcublas.so.12");
    if let Some(path) = &cublas.path {
        assert_eq!(path, &dir.join("libcublas.so.12"));
    }
    assert_eq!(cublas.version_string(), "12.9.1");
    // SAFETY: a null stream is the default stream.
    let handle = unsafe { cublas.create(std::ptr::null_mut()) };
    assert!(handle.is_err(), "a cuBLAS handle without a GPU");
    let text = format!("{:#}", handle.err().expect("an error"));
    assert!(text.contains("cublasCreate failed"), "{text}");
}

/// The NCCL binding against the real library from PyPI, on this machine without a GPU: a
/// missing library names the pip package; every entry point used (all-reduce, send and
/// receive among them) binds; the version is the wheel's; unique ids (which need
/// no GPU) are 128 bytes that differ and survive the trip through bytes; joining a
/// communicator fails with NCCL's own message rather than crashing (no CUDA device here) —
/// what makes a rank fall back to the host collectives with a warning. The choice between
/// NCCL and the fallback: a member without NCCL, or two members on one GPU, mean fallback.
#[test]
fn nccl_from_pypi_binds_makes_ids_and_fails_cleanly_without_a_gpu() {
    use infer::runtime::collectives::nccl::{Nccl, UNIQUE_ID_BYTES, UniqueId, usable};
    let empty = tempfile::tempdir().expect("tempdir");
    if let Err(error) = Nccl::open(&[empty.path().to_path_buf()]) {
        assert!(
            error.to_string().contains("pip install nvidia-nccl-cu12"),
            "{error}"
        );
    }
    let nccl = Nccl::open(&[nccl_lib_dir().to_path_buf()]).unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(nccl.version().expect("version"), (2, 32, 3));
    let (a, b) = (
        nccl.unique_id().expect("an id"),
        nccl.unique_id().expect("another id"),
    );
    assert_eq!(a.to_bytes().len(), UNIQUE_ID_BYTES);
    assert_ne!(a.to_bytes(), b.to_bytes(), "ids differ");
    assert!(a.to_bytes().iter().any(|&byte| byte != 0));
    let back = UniqueId::from_bytes(&a.to_bytes()).expect("128 bytes");
    assert_eq!(back.to_bytes(), a.to_bytes());
    assert!(UniqueId::from_bytes(&[0; 12]).is_err());
    let has_driver = infer::runtime::libraries::open(
        infer::runtime::libraries::DRIVER,
        &infer::runtime::libraries::search_dirs(&|name| std::env::var_os(name)),
    )
    .is_ok();
    if !has_driver {
        // SAFETY: no CUDA context exists here; NCCL finds no device and says so.
        let error = unsafe { nccl.init_rank(1, &a, 0) }
            .err()
            .expect("no GPU, no communicator");
        let text = error.to_string();
        assert!(
            text.contains("ncclCommInitRank failed") && text.contains("cuda"),
            "{text}"
        );
    }
    use infer::runtime::collectives::nccl::GroupKind::{Pipeline, Tp};
    assert!(usable(Tp, &[(0, 0, 0x17, 0), (0, 0, 0x2a, 0)], 0).is_ok());
    // The same PCI address on two hosts is two GPUs.
    assert!(usable(Tp, &[(0, 0, 0x17, 0), (4, 0, 0x17, 0)], 0).is_ok());
    let shared = usable(Tp, &[(0, 0, 0x17, 0), (0, 0, 0x17, 0)], 0).expect_err("one GPU");
    assert!(
        shared.contains("TP ranks 0 and 1 share one GPU (PCI 0000:17:00)"),
        "{shared}"
    );
    let shared = usable(Pipeline, &[(0, 0, 0x17, 0), (0, 0, 0x17, 0)], 0).expect_err("one GPU");
    assert!(
        shared.contains("pipeline stages 0 and 1 share one GPU (PCI 0000:17:00)"),
        "{shared}"
    );
    let missing = usable(Tp, &[(0, 0, 0x17, 0), (0, 0, 0x2a, 0)], 1).expect_err("missing");
    assert!(
        missing.contains("1 of the group's 2 ranks found no NCCL"),
        "{missing}"
    );
}

/// The NCCL decision of a TP group, and of a pipeline, over real TCP collectives, with
/// PyPI's NCCL on this machine without a GPU: every member's init fails (no CUDA device),
/// and every member says so and keeps the host collectives; a member without NCCL, or two
/// members on one GPU, make the whole group keep them without trying (the warning names
/// why).
#[test]
fn a_tp_group_agrees_on_nccl_or_the_host_collectives_with_a_warning() {
    use crate::support::runtime::{Transport, with_group};
    use infer::runtime::collectives::nccl::{GroupKind, Nccl, negotiate};
    let dir = nccl_lib_dir().to_path_buf();
    let has_driver = infer::runtime::libraries::open(
        infer::runtime::libraries::DRIVER,
        &infer::runtime::libraries::search_dirs(&|name| std::env::var_os(name)),
    )
    .is_ok();
    /// (case, whether a rank has NCCL, each rank's GPU PCI address)
    type Case = (
        &'static str,
        fn(usize) -> bool,
        fn(usize) -> (u32, u32, u32),
    );
    let cases: [Case; 3] = [
        ("init fails", |_| true, |rank| (0, 0x17 + rank as u32, 0)),
        (
            "rank 1 lacks NCCL",
            |rank| rank == 0,
            |rank| (0, 0x17 + rank as u32, 0),
        ),
        ("one GPU", |_| true, |_| (0, 0x17, 0)),
    ];
    let kinds = [
        (GroupKind::Tp, "TP all-reduces", "TP ranks"),
        (GroupKind::Pipeline, "pipeline hand-offs", "pipeline stages"),
    ];
    for ((case, has_nccl, pci), (kind, traffic, members)) in cases
        .into_iter()
        .flat_map(|case| kinds.map(|kind| (case, kind)))
    {
        if case == "init fails" && has_driver {
            continue;
        }
        let lines = with_group(2, Transport::Tcp, |comm| {
            let rank = comm.rank();
            let nccl = if has_nccl(rank) {
                Nccl::open(std::slice::from_ref(&dir))
            } else {
                Err(anyhow::anyhow!("NCCL (libnccl.so.2) is not installed"))
            };
            let mut inits = 0;
            let (joined, line) = negotiate(
                kind,
                comm,
                nccl,
                0,
                pci(rank),
                &mut |nccl, id, size, rank| {
                    inits += 1;
                    // SAFETY: no CUDA context exists here; NCCL finds no device and says so.
                    unsafe { nccl.init_rank(size, id, rank) }
                },
            )
            .unwrap_or_else(|e| panic!("{case}: {e:#}"));
            assert!(joined.is_none(), "{case}: no GPU, no communicator");
            (line, inits)
        });
        for (rank, (line, inits)) in lines.iter().enumerate() {
            assert!(
                line.starts_with(&format!(
                    "warning: {traffic} go through host memory (TCP, shared memory inside a host): "
                )),
                "{case}: {line}"
            );
            let shared = format!("{members} 0 and 1 share one GPU (PCI 0000:17:00)");
            let (why, tried) = match case {
                "init fails" => ("NCCL failed to start here: ncclCommInitRank failed", 1),
                "rank 1 lacks NCCL" => ("1 of the group's 2 ranks found no NCCL", 0),
                _ => (shared.as_str(), 0),
            };
            assert!(line.contains(why), "{case}, rank {rank}: {line}");
            assert_eq!(*inits, tried, "{case}, rank {rank}: init calls");
        }
        if case == "rank 1 lacks NCCL" {
            assert!(
                lines[1]
                    .0
                    .contains("this rank: NCCL (libnccl.so.2) is not installed")
            );
        }
    }
}

fn nvrtc() -> &'static Nvrtc {
    static NVRTC: OnceLock<Nvrtc> = OnceLock::new();
    NVRTC.get_or_init(|| {
        Nvrtc::open(&[nvrtc_lib_dir().to_path_buf()], None).expect("NVRTC from the wheel opens")
    })
}

/// Registers per thread × threads per block within the 64 K registers of an SM's file
/// (every architecture from sm_80 to sm_90 has 65536 32-bit registers per SM; CUDA C
/// Programming Guide, "Compute Capabilities" table).
const REGISTERS_PER_SM: u32 = 65536;
/// Static shared memory a block may declare without opting in (48 KiB, same table).
const STATIC_SHARED_BYTES: u32 = 48 << 10;

#[test]
fn every_kernel_compiles_to_cubin_for_each_architecture_within_its_resources() {
    let nvrtc = nvrtc();
    assert_eq!(nvrtc.version, (12, 9), "the pinned CUDA 12 wheel");
    assert_eq!(nvrtc.soname, "libnvrtc.so.12");
    every_kernel_compiles_within_its_resources(nvrtc);
}

/// NVRTC 13.0 from PyPI (the CUDA 13 stack of today's GPU nodes), bound by our own code and
/// opened by full path from its `nvidia/cu13/lib` (whose `libnvrtc.so.13` has no RUNPATH: its
/// builtins are opened first from the same folder, or every compile fails), compiles every
/// kernel for sm_80 to sm_120 within the same resources as NVRTC 12.
#[test]
fn nvrtc_13_compiles_every_kernel_for_each_architecture_within_its_resources() {
    let dir = nvrtc13_root().join("nvidia/cu13/lib");
    let nvrtc = Nvrtc::open(std::slice::from_ref(&dir), None).unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(nvrtc.version, (13, 0));
    assert_eq!(nvrtc.soname, "libnvrtc.so.13");
    assert_eq!(
        nvrtc.path.as_deref(),
        Some(dir.join("libnvrtc.so.13").as_path())
    );
    assert_eq!(
        nvrtc.builtins.as_deref(),
        Some(dir.join("libnvrtc-builtins.so.13.0").as_path())
    );
    every_kernel_compiles_within_its_resources(&nvrtc);
}

/// Every family compiled by `nvrtc` for every [`infer::runtime::cuda::TESTED_ARCHS`]: a
/// CUBIN, the described kernels with the described parameters, no spills, registers and
/// static shared memory within an SM's.
fn every_kernel_compiles_within_its_resources(nvrtc: &Nvrtc) {
    let mut compiled_kernels = 0;
    for &arch in infer::runtime::cuda::TESTED_ARCHS {
        for family in FAMILIES {
            let compiled = nvrtc
                .compile(family.file, &family.full_source(), arch)
                .unwrap_or_else(|e| panic!("{e:#}"));
            // A CUBIN is an ELF file (`\x7fELF`), for this exact architecture.
            assert_eq!(
                &compiled.cubin[..4],
                b"\x7fELF",
                "{} sm_{arch}",
                family.file
            );
            let entries = ptx_entries(&compiled.ptx);
            assert_eq!(
                entries.len(),
                family.kernels.len(),
                "{} sm_{arch}: the source's kernels are the described ones: {:?}",
                family.file,
                entries.keys()
            );
            for kernel in family.kernels {
                let case = format!("{} sm_{arch}", kernel.name);
                let params = entries
                    .get(kernel.name)
                    .unwrap_or_else(|| panic!("{case}: not in the PTX"));
                let described: Vec<&str> = kernel.params.iter().map(|p| p.ptx_type()).collect();
                assert_eq!(params, &described, "{case}: parameters");
                let resources = compiled
                    .resources
                    .get(kernel.name)
                    .unwrap_or_else(|| panic!("{case}: ptxas said nothing:\n{}", compiled.log));
                assert!(
                    resources.registers > 0,
                    "{case}: {resources:?}\n{}",
                    compiled.log
                );
                assert_eq!(
                    resources.spill_store_bytes, 0,
                    "{case}: spills {resources:?}"
                );
                assert_eq!(
                    resources.spill_load_bytes, 0,
                    "{case}: spills {resources:?}"
                );
                assert!(
                    resources.registers * kernel.block_threads <= REGISTERS_PER_SM,
                    "{case}: {} registers × {} threads",
                    resources.registers,
                    kernel.block_threads
                );
                assert!(
                    resources.shared_bytes <= STATIC_SHARED_BYTES,
                    "{case}: {resources:?}"
                );
                compiled_kernels += 1;
            }
        }
    }
    let kernels: usize = FAMILIES.iter().map(|f| f.kernels.len()).sum();
    assert_eq!(
        compiled_kernels,
        kernels * infer::runtime::cuda::TESTED_ARCHS.len()
    );
}

/// A compilation error names the file and carries NVRTC's log; the disk cache hits on the
/// same source and misses on any change.
#[test]
fn compile_errors_are_reported_and_the_cache_keys_on_the_source() {
    let nvrtc = nvrtc();
    let error = nvrtc
        .compile(
            "broken.cu",
            "extern \"C\" __global__ void k() { undeclared(); }",
            80,
        )
        .err()
        .expect("does not compile");
    let text = format!("{error:#}");
    assert!(
        text.contains("broken.cu") && text.contains("undeclared"),
        "{text}"
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let family = &FAMILIES[0];
    let source = family.full_source();
    let (first, hit) = nvrtc
        .compile_cached(dir.path(), family.file, &source, 86)
        .expect("compiles");
    assert!(!hit);
    let (again, hit) = nvrtc
        .compile_cached(dir.path(), family.file, &source, 86)
        .expect("cached");
    assert!(hit);
    assert_eq!(first, again);
    let changed = format!("{source}\n// changed\n");
    let (_, hit) = nvrtc
        .compile_cached(dir.path(), family.file, &changed, 86)
        .expect("compiles");
    assert!(!hit, "a changed source misses the cache");
    let (_, hit) = nvrtc
        .compile_cached(dir.path(), family.file, &source, 90)
        .expect("compiles");
    assert!(!hit, "another architecture misses the cache");
}

/// `--device cuda` without a driver (this machine) is bad input with the fix, exit 2, for
/// every command that takes it, and before anything starts; `infer smoke` says it needs a
/// GPU. (A host with a driver runs these commands for real, so there is nothing to check.)
#[test]
fn device_cuda_without_a_driver_exits_2_naming_the_driver() {
    let has_driver = infer::runtime::libraries::open(
        infer::runtime::libraries::DRIVER,
        &infer::runtime::libraries::search_dirs(&|name| std::env::var_os(name)),
    )
    .is_ok();
    if has_driver {
        // The commands run for real on such a host: the no-driver error is CI's to check.
        return;
    }
    // The host is named (what a cluster's launcher says of each host): redacted in the
    // snapshot of every command's whole error.
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").expect("hostname");
    let host = format!("`{}`", host.trim());
    let mut transcript = String::new();
    for args in [
        &["generate", "--device", "cuda", "--prompt", "hi"][..],
        &["bench", "decode", "--device", "cuda"],
        &["up", "--device", "cuda", "--tp", "3", "--port", "0"],
        &["smoke"],
        &["smoke", "--json"],
    ] {
        let output = run(args);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(output.stdout.is_empty(), "{args:?}: nothing on stdout");
        assert!(
            stderr.contains(&format!("on host {host}")),
            "{args:?}: {stderr}"
        );
        transcript.push_str(&transcript_of(args, &output, &[(&host, "`[HOST]`")]));
        transcript.push('\n');
    }
    insta::assert_snapshot!(transcript);
}

/// A library is opened by full path from the first directory that has it (what lets
/// cudarc find pip's `libnvrtc.so.12` by name afterwards), and a missing one is an error,
/// never a panic.
#[test]
fn libraries_open_from_the_given_directories_or_say_why_not() {
    use infer::runtime::libraries::open;
    let libm_dir = [
        "/lib/x86_64-linux-gnu",
        "/usr/lib/x86_64-linux-gnu",
        "/lib64",
        "/usr/lib64",
    ]
    .iter()
    .map(PathBuf::from)
    .find(|d| d.join("libm.so.6").is_file())
    .expect("libm.so.6 is somewhere");
    let empty = tempfile::tempdir().expect("tempdir");
    let found =
        open("libm.so.6", &[empty.path().to_path_buf(), libm_dir.clone()]).expect("libm opens");
    assert_eq!(found, Some(libm_dir.join("libm.so.6")));
    // NVRTC missing, in a process of its own: in this one another test may have opened the
    // cache's copy already, and an open library is found again by name.
    let child = child_test("nvrtc_missing_child")
        .env_remove("LD_LIBRARY_PATH")
        .env_remove("INFER_CUDA_LIB_DIRS")
        .output()
        .expect("the test binary runs");
    let stdout = String::from_utf8_lossy(&child.stdout);
    assert!(
        child.status.success() && stdout.contains("1 passed"),
        "{stdout}\n{}",
        String::from_utf8_lossy(&child.stderr)
    );
    let error = open("libinfer-missing-test.so.7", &[empty.path().to_path_buf()])
        .expect_err("no such library");
    assert!(
        error.to_string().contains("libinfer-missing-test.so.7"),
        "{error}"
    );
}

/// Run by [`libraries_open_from_the_given_directories_or_say_why_not`] in a fresh process
/// (nothing opened yet): NVRTC that is neither in the given directory nor on the system
/// loader's paths is an error naming the pip package. (A host whose loader has NVRTC —
/// a CUDA toolkit installed — opens it; this machine's has none, so CI checks the message.)
#[test]
#[ignore = "run by libraries_open_from_the_given_directories_or_say_why_not in a fresh process"]
fn nvrtc_missing_child() {
    let empty = tempfile::tempdir().expect("tempdir");
    match Nvrtc::open(&[empty.path().to_path_buf()], None) {
        Err(error) => {
            let text = error.to_string();
            assert!(
                text.contains("pip install nvidia-cuda-nvrtc` (CUDA 13")
                    && text.contains("pip install nvidia-cuda-nvrtc-cu12")
                    && text.contains("libnvrtc.so.13 or libnvrtc.so.12"),
                "{text}"
            );
        }
        Ok(found) => {
            // Found on the system loader's paths (a CUDA toolkit): nothing to check here.
            assert_eq!(found.path, None, "nothing is in the empty directory");
        }
    }
}

/// The stand-in driver (`tests/fixtures/standin_libcuda.c`, NOT a driver: one sm_90 GPU that
/// refuses every context), built once by `cc`: the folder holding its `libcuda.so.1`.
fn standin_driver() -> PathBuf {
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/standin_libcuda.c");
    let text = std::fs::read(&source).expect("the stand-in's source");
    cached_dir(
        &test_cache().join(format!("standin-driver-{}", recipe_hash(&text))),
        |staging| {
            std::fs::create_dir_all(staging).expect("staging dir");
            let status = Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()))
                .args(["-shared", "-fPIC", "-O1", "-Wl,-soname,libcuda.so.1", "-o"])
                .arg(staging.join("libcuda.so.1"))
                .arg(&source)
                .status()
                .expect("cc runs");
            assert!(status.success(), "building the stand-in driver failed");
        },
    )
}

/// A real venv (`python3 -m venv`) at `dir` whose site-packages holds the `nvidia/*` folders
/// of each unzipped wheel in `wheels` (linked, not copied): NVIDIA's wheels as pip lays them
/// out. Returns its `bin/`.
fn venv_with(dir: &Path, wheels: &[&Path]) -> PathBuf {
    let status = Command::new("python3")
        .args(["-m", "venv", "--without-pip"])
        .arg(dir)
        .status()
        .expect("python3 -m venv");
    assert!(status.success(), "python3 -m venv failed");
    let lib = std::fs::read_dir(dir.join("lib"))
        .expect("the venv's lib")
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("python3"))
        })
        .expect("lib/python3.*");
    let nvidia = lib.join("site-packages/nvidia");
    std::fs::create_dir_all(&nvidia).expect("site-packages/nvidia");
    for wheel in wheels {
        for entry in std::fs::read_dir(wheel.join("nvidia"))
            .expect("a wheel's nvidia/")
            .flatten()
        {
            std::os::unix::fs::symlink(entry.path(), nvidia.join(entry.file_name()))
                .expect("link a wheel's folder");
        }
    }
    dir.join("bin")
}

/// The real SmolLM2 cut to its first 8 layers by `scripts/cut_gguf.py` (what the GPU check
/// carries), once per test cache.
fn cut_smollm2() -> PathBuf {
    let model = crate::support::model::smollm2();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/cut_gguf.py");
    let recipe = std::fs::read(&script).expect("the cut script");
    let dir = cached_dir(
        &test_cache().join(format!("smollm2-8l-{}", recipe_hash(&recipe))),
        |staging| {
            std::fs::create_dir_all(staging).expect("staging dir");
            let status = Command::new("python3")
                .arg(&script)
                .arg(&model)
                .arg(staging.join("smollm2-8l.gguf"))
                .arg("8")
                .status()
                .expect("python3 runs");
            assert!(status.success(), "cut_gguf.py failed");
        },
    );
    dir.join("smollm2-8l.gguf")
}

/// `infer smoke --json --model <cut SmolLM2>` as a GPU node's user would run it: a clean
/// environment whose `PATH` starts with the venv's `bin/` (no `VIRTUAL_ENV`, no
/// `LD_LIBRARY_PATH`), the stand-in driver in `INFER_CUDA_LIB_DIRS` reporting CUDA
/// `driver_version` (`13000`, `12020`). Returns the report, stderr and the exit code.
fn smoke_on(venv_bin: &Path, driver_version: &str) -> (serde_json::Value, String, Option<i32>) {
    let home = tempfile::tempdir().expect("tempdir");
    let output = Command::new(env!("CARGO_BIN_EXE_infer"))
        .env_clear()
        .env("PATH", format!("{}:/usr/bin:/bin", venv_bin.display()))
        .env("HOME", home.path())
        .env("INFER_CACHE_DIR", home.path().join("cache"))
        .env("INFER_CUDA_LIB_DIRS", standin_driver())
        .env("INFER_STANDIN_CUDA_VERSION", driver_version)
        .env("NO_COLOR", "1")
        .args(["smoke", "--json", "--model"])
        .arg(cut_smollm2())
        .stdin(std::process::Stdio::null())
        .output()
        .expect("infer smoke runs");
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    let report = serde_json::from_slice(&output.stdout)
        .unwrap_or_else(|e| panic!("smoke printed no JSON ({e}):\n{stderr}"));
    (report, stderr, output.status.code())
}

/// The row of `report` named `name`.
fn row<'a>(report: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    report["checks"]
        .as_array()
        .expect("checks[]")
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no row `{name}` in {report:#}"))
}

/// The library `library` of `report["libraries"]`, when it loaded.
fn library<'a>(report: &'a serde_json::Value, library: &str) -> Option<&'a serde_json::Value> {
    report["libraries"]
        .as_array()
        .expect("libraries[]")
        .iter()
        .find(|l| l["library"] == library)
}

/// What every stand-in run shows: the JSON printed, exit 1, no panic anywhere, the GPU
/// seen, every kernel compiled for sm_90 by the NVRTC `nvrtc_version` named `soname` found
/// in the venv, and every failing row failing at the context the stand-in refuses.
fn assert_passes_up_to_the_context(
    (report, stderr, code): &(serde_json::Value, String, Option<i32>),
    venv: &Path,
    soname: &str,
    nvrtc_version: &str,
) {
    assert_eq!(*code, Some(1), "{report:#}\n{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(!report.to_string().contains("panicked"), "{report:#}");
    assert!(
        row(report, "GPU and driver")["passed"] == true,
        "{report:#}"
    );
    assert!(row(report, "NVRTC")["passed"] == true, "{report:#}");
    assert_eq!(report["nvrtc"], nvrtc_version, "{report:#}");
    let nvrtc = library(report, "NVRTC").expect("NVRTC loaded");
    assert_eq!(nvrtc["soname"], soname);
    let path = nvrtc["path"].as_str().expect("opened by path");
    assert!(
        path.starts_with(&*venv.to_string_lossy()),
        "{path}: from the venv"
    );
    assert!(path.ends_with(soname), "{path}");
    let builtins = library(report, "NVRTC builtins").expect("builtins opened");
    assert_eq!(
        builtins["soname"],
        format!("libnvrtc-builtins.so.{nvrtc_version}")
    );
    assert_eq!(
        library(report, "driver").expect("driver")["path"],
        standin_driver()
            .join("libcuda.so.1")
            .to_string_lossy()
            .as_ref()
    );
    let checks = report["checks"].as_array().expect("checks[]");
    let compiled: Vec<_> = checks
        .iter()
        .filter(|c| {
            c["name"]
                .as_str()
                .is_some_and(|n| n.starts_with("compile "))
        })
        .collect();
    assert_eq!(compiled.len(), FAMILIES.len(), "{report:#}");
    for check in &compiled {
        assert!(check["passed"] == true, "{check:#}");
        assert!(
            check["name"]
                .as_str()
                .is_some_and(|n| n.ends_with("for sm_90"))
        );
    }
    let failed: Vec<_> = checks.iter().filter(|c| c["passed"] == false).collect();
    assert!(!failed.is_empty(), "the context is refused: {report:#}");
    for check in failed {
        assert!(
            check["detail"]
                .as_str()
                .is_some_and(|d| d.contains("stand-in driver: no GPU here")),
            "fails only at the context: {check:#}"
        );
    }
}

/// Today's GPU node without its GPU: a CUDA 13.0 driver (the stand-in, R580's version) and
/// only CUDA 13's NVRTC wheel, in a venv found through the `python3` on `PATH` — the real
/// binary's `infer smoke --json --model CUT.gguf` opens NVRTC 13 from the venv's
/// `nvidia/cu13/lib` with its builtins, compiles every kernel for the GPU's sm_90, fails
/// only at the context, prints its JSON and exits 1; no panic. The same with CUDA 12's
/// wheel alone; and with both wheels on a CUDA 12.2 driver (R535), which cannot run CUDA
/// 13's libraries, NVRTC 12 is chosen — and with only CUDA 13's there, the NVRTC row fails
/// saying which driver it needs, and the report is still printed. Offline without `--model`
/// and with nothing cached, smoke exits 2 naming `--model`.
#[test]
fn smoke_on_a_cuda_13_or_12_stack_passes_every_row_up_to_the_context_without_a_panic() {
    let venvs = tempfile::tempdir().expect("tempdir");
    let cuda12 = nvrtc_lib_dir()
        .parent()
        .and_then(Path::parent)
        .and_then(Path::parent)
        .expect("the CUDA 12 wheel's root")
        .to_path_buf();
    let only13 = venvs.path().join("only13");
    let bin13 = venv_with(&only13, &[nvrtc13_root()]);
    let run = smoke_on(&bin13, "13000");
    assert_passes_up_to_the_context(&run, &only13, "libnvrtc.so.13", "13.0");
    assert_eq!(run.0["driver"]["cuda_version"], serde_json::json!([13, 0]));

    let only12 = venvs.path().join("only12");
    let bin12 = venv_with(&only12, &[&cuda12]);
    let run = smoke_on(&bin12, "13000");
    assert_passes_up_to_the_context(&run, &only12, "libnvrtc.so.12", "12.9");

    let both = venvs.path().join("both");
    let bin_both = venv_with(&both, &[nvrtc13_root(), &cuda12]);
    let run = smoke_on(&bin_both, "12020");
    assert_passes_up_to_the_context(&run, &both, "libnvrtc.so.12", "12.9");
    assert_eq!(run.0["driver"]["cuda_version"], serde_json::json!([12, 2]));

    // Offline, with no --model and nothing cached: exit 2 naming --model.
    let home = tempfile::tempdir().expect("tempdir");
    let offline = Command::new(env!("CARGO_BIN_EXE_infer"))
        .env_clear()
        .env("PATH", format!("{}:/usr/bin:/bin", bin13.display()))
        .env("HOME", home.path())
        .env("INFER_CACHE_DIR", home.path().join("cache"))
        .env("INFER_CUDA_LIB_DIRS", standin_driver())
        // Nothing listens on port 9 (discard) here: as a node without network, refused.
        .env("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
        .args(["smoke", "--json"])
        .stdin(std::process::Stdio::null())
        .output()
        .expect("infer smoke runs");
    let stderr = String::from_utf8_lossy(&offline.stderr);
    assert_eq!(offline.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("pass --model PATH"), "{stderr}");
    assert!(offline.stdout.is_empty(), "nothing on stdout");

    let (report, stderr, code) = smoke_on(&bin13, "12020");
    assert_eq!(code, Some(1), "{report:#}\n{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    let nvrtc = row(&report, "NVRTC");
    assert!(nvrtc["passed"] == false, "{report:#}");
    let detail = nvrtc["detail"].as_str().expect("detail");
    assert!(
        detail.contains("libnvrtc.so.12")
            && detail.contains("pip install nvidia-cuda-nvrtc-cu12")
            && detail.contains("CUDA 13 libraries need driver R580"),
        "{detail}"
    );
    assert!(library(&report, "NVRTC").is_none(), "{report:#}");
}

/// `scripts/gpu-check.sh`, the one call a GPU machine gets, end to end on this machine
/// against the stand-in driver and CUDA 13's NVRTC in a venv found through `PATH`: within
/// its budget, every step run (and failing where the stand-in refuses a context, the CPU
/// generation passing), and exactly the two files it promises in the output folder — the
/// summary with each step's exit code, and the archive with every step's output.
#[test]
fn the_gpu_check_script_runs_every_step_within_its_budget_and_writes_what_it_promises() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let scratch = tempfile::tempdir().expect("tempdir");
    let venv = scratch.path().join("venv");
    let bin = venv_with(&venv, &[nvrtc13_root()]);
    let out = scratch.path().join("out");
    let budget = 240;
    let started = std::time::Instant::now();
    let output = Command::new("bash")
        .arg(root.join("scripts/gpu-check.sh"))
        .arg(&out)
        .env_clear()
        .env("PATH", format!("{}:/usr/bin:/bin", bin.display()))
        .env("HOME", scratch.path())
        .env("INFER_CUDA_LIB_DIRS", standin_driver())
        .env("INFER_BIN", env!("CARGO_BIN_EXE_infer"))
        .env("MODEL", cut_smollm2())
        .env("DUMMY_DTYPES", "q4_0")
        .env("BUDGET", budget.to_string())
        .output()
        .expect("bash runs the script");
    let elapsed = started.elapsed().as_secs();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    assert!(
        elapsed <= budget + 15,
        "{elapsed} s for a budget of {budget} s"
    );
    let mut files: Vec<String> = std::fs::read_dir(&out)
        .expect("the output folder")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    assert_eq!(files, ["gpu-check.tgz", "summary.txt"]);
    let summary = std::fs::read_to_string(out.join("summary.txt")).expect("summary");
    for line in [
        "smoke rc=1 ",
        "generate_cuda rc=2 ",
        "generate_cpu rc=0 ",
        "bench_smollm2 rc=2 ",
        "bench_llama8b_q4_0 rc=2 ",
        "total ",
    ] {
        assert!(summary.contains(line), "`{line}` in:\n{summary}");
    }
    assert!(
        summary.contains("smoke: ") && summary.contains("rows pass; failing: "),
        "{summary}"
    );
    assert!(
        summary.contains("NVRTC: ") && summary.contains("nvidia/cu13/lib/libnvrtc.so.13"),
        "{summary}"
    );
    let listing = Command::new("tar")
        .arg("-tzf")
        .arg(out.join("gpu-check.tgz"))
        .output()
        .expect("tar lists the archive");
    let listing = String::from_utf8_lossy(&listing.stdout);
    for file in [
        "machine.txt",
        "libraries.txt",
        "version.txt",
        "summary.txt",
        "smoke.out",
        "smoke.err",
        "generate_cuda.err",
        "generate_cpu.out",
        "bench_smollm2.err",
        "bench_llama8b_q4_0.err",
    ] {
        assert!(
            listing.contains(&format!("./{file}")),
            "{file} in:\n{listing}"
        );
    }
}

/// `scripts/prepare-gpu-check.sh` with a given binary and the real SmolLM2: the stripped,
/// gzipped binary that still runs, the model cut to 8 layers that still loads, and the
/// size of what travels, checked against the 64 MiB a GPU machine accepts.
#[test]
fn the_prepare_script_ships_a_running_binary_and_a_cut_model_within_64_mib() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dest = tempfile::tempdir().expect("tempdir");
    let model = crate::support::model::smollm2();
    let output = Command::new("bash")
        .arg(root.join("scripts/prepare-gpu-check.sh"))
        .env("BIN", env!("CARGO_BIN_EXE_infer"))
        .env("MODEL", &model)
        .env("DEST", dest.path())
        .output()
        .expect("bash runs the script");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(stdout.contains("MiB of 64 MiB"), "{stdout}");
    let binary = dest.path().join("infer");
    let unpacked = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "gzip -dc '{0}.gz' > '{0}' && chmod +x '{0}' && '{0}' --version",
            binary.display()
        ))
        .output()
        .expect("sh runs");
    assert!(
        unpacked.status.success() && String::from_utf8_lossy(&unpacked.stdout).contains("infer"),
        "{}",
        String::from_utf8_lossy(&unpacked.stderr)
    );
    let cut = dest.path().join("smollm2-8l.gguf");
    let llama =
        infer::runtime::model::llama::Llama::open_gguf(&cut).unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(llama.layers.len(), 8);
    assert_eq!(llama.config.vocab_size, 49152);
}

#[test]
fn host_harness_runs_the_kernels_like_the_cpu_backend() {
    use infer::runtime::cuda::checks::run_all;
    use infer::runtime::cuda::host::HostArg::U32;
    let host = host();
    // The checks `infer smoke` runs on the GPU, here on the host harness.
    let checks = run_all(host);
    let failed: Vec<_> = checks.iter().filter(|c| !c.passed).collect();
    assert!(failed.is_empty(), "{failed:#?}");
    let names: Vec<&str> = checks.iter().map(|c| c.name.as_str()).collect();
    // Every kernel but the activation quantizer (run by each product check) has its check
    // (one check may run two kernels: "argmax_partial_f32 + argmax_combine_f32").
    for family in FAMILIES {
        for kernel in family.kernels.iter().filter(|k| k.name != "quantize_q8_1") {
            assert!(
                names.iter().any(|n| n.contains(kernel.name)),
                "no check runs {}: {names:?}",
                kernel.name
            );
        }
    }
    // Each NMSE is measured, not assumed: the products' are those of 8-bit activations.
    for check in checks.iter().filter(|c| c.name.starts_with("mul_mat_vec")) {
        assert!(check.detail.starts_with("NMSE "), "{check:?}");
        assert!(!check.detail.starts_with("NMSE 0.00e0"), "{check:?}");
    }
    // Arguments that are not the kernel's parameters are refused before anything runs.
    // SAFETY: the launch is refused before it reads any buffer (that is what is checked).
    let error = unsafe { host.launch("argmax_combine_f32", [1, 1, 1], [256, 1, 1], &[U32(1)]) }
        .expect_err("wrong arguments");
    assert!(error.to_string().contains("argmax_combine_f32"), "{error}");
}

/// The host harness, counting the GEMMs it is asked for, or saying it has none (as a GPU
/// without cuBLAS).
struct CountingGemms<'a> {
    inner: &'a infer::runtime::cuda::host::HostKernels,
    has_gemm: bool,
    calls: std::cell::Cell<usize>,
}

impl infer::runtime::cuda::backend::Device for CountingGemms<'_> {
    type Buffer = infer::runtime::cuda::host::HostBuffer;

    fn name(&self) -> String {
        format!("{} (counting GEMMs)", self.inner.name())
    }
    fn alloc(&self, len_bytes: usize) -> anyhow::Result<Self::Buffer> {
        self.inner.alloc(len_bytes)
    }
    fn upload(&self, bytes: &[u8]) -> anyhow::Result<Self::Buffer> {
        self.inner.upload(bytes)
    }
    fn download(&self, buffer: &Self::Buffer, len_bytes: usize) -> anyhow::Result<Vec<u8>> {
        self.inner.download(buffer, len_bytes)
    }
    fn launch(
        &self,
        kernel: &str,
        grid: [u32; 3],
        block: [u32; 3],
        args: &[infer::runtime::cuda::backend::DeviceArg<'_, Self::Buffer>],
    ) -> anyhow::Result<()> {
        Device::launch(self.inner, kernel, grid, block, args)
    }
    fn has_gemm(&self) -> bool {
        self.has_gemm
    }
    fn gemm(
        &self,
        gemm: infer::runtime::cuda::backend::Gemm<'_, Self::Buffer>,
    ) -> anyhow::Result<()> {
        self.calls.set(self.calls.get() + 1);
        self.inner.gemm(gemm)
    }
}

/// Prefill and batches over `MAX_MATVEC_TOKENS_QUANTIZED` tokens (quantized weights) or
/// `MAX_MATVEC_TOKENS` (unquantized): the weights dequantized to f16 (or taken as they are),
/// the activations converted, one GEMM (cuBLAS on a GPU, a host loop here), within the
/// products' NMSE of the CPU's for every weight type; smaller batches stay on the
/// matrix-vector kernels, and so does every product on a device without a GEMM.
#[test]
fn batches_over_the_matvec_limit_run_one_gemm_like_the_cpu_backend() {
    use infer::runtime::backend::{Backend, bytes_of, f32s_of, nmse};
    use infer::runtime::cuda::backend::{
        KernelBackend, MAX_MATVEC_TOKENS, MAX_MATVEC_TOKENS_QUANTIZED,
    };
    use infer::runtime::cuda::checks::{NMSE_PRODUCTS, gemm_checks, random_rows, values};
    let checks = gemm_checks(host());
    assert_eq!(checks.len(), 8, "{checks:#?}");
    for check in &checks {
        assert!(check.passed, "{check:?}");
        assert!(check.detail.starts_with("NMSE "), "{check:?}");
    }
    // A Q4_K product of 37 rows × 768 columns: how many GEMMs each batch takes.
    let (n_rows, n_cols) = (37usize, 768usize);
    let weights = random_rows(GgmlType::Q4K, 5, n_rows, n_cols);
    let bf16: Vec<u8> = values(7, n_rows * n_cols)
        .iter()
        .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
        .collect();
    let product_of = |device: &CountingGemms, ty: GgmlType, n_tokens: usize| -> Vec<f32> {
        let backend = KernelBackend::new(device);
        let bytes = if ty == GgmlType::Bf16 {
            &bf16
        } else {
            &weights
        };
        let w = backend
            .upload_matrix(ty, n_rows, n_cols, bytes)
            .expect("uploads");
        let x = backend
            .upload(&bytes_of(&values(6, n_tokens * n_cols)))
            .expect("uploads");
        let y = backend.zeros(n_tokens * n_rows * 4).expect("allocates");
        backend.matmul(&y, &w, &x, n_tokens).expect("multiplies");
        f32s_of(
            &backend
                .download(&y, n_tokens * n_rows * 4)
                .expect("downloads"),
        )
    };
    let counting = |has_gemm| CountingGemms {
        inner: host(),
        has_gemm,
        calls: std::cell::Cell::new(0),
    };
    let product = |device: &CountingGemms, n_tokens| product_of(device, GgmlType::Q4K, n_tokens);
    let device = counting(true);
    product(&device, MAX_MATVEC_TOKENS_QUANTIZED);
    assert_eq!(
        device.calls.get(),
        0,
        "{MAX_MATVEC_TOKENS_QUANTIZED} tokens: matvec"
    );
    let through_gemm = product(&device, MAX_MATVEC_TOKENS_QUANTIZED + 1);
    assert_eq!(device.calls.get(), 1, "one GEMM for the whole batch");
    // Unquantized weights go to the GEMM past MAX_MATVEC_TOKENS.
    product_of(&device, GgmlType::Bf16, MAX_MATVEC_TOKENS);
    assert_eq!(
        device.calls.get(),
        1,
        "{MAX_MATVEC_TOKENS} BF16 tokens: matvec"
    );
    product_of(&device, GgmlType::Bf16, MAX_MATVEC_TOKENS + 1);
    assert_eq!(device.calls.get(), 2, "BF16 past the limit: one GEMM");
    let without = counting(false);
    let through_matvec = product(&without, MAX_MATVEC_TOKENS_QUANTIZED + 1);
    assert_eq!(without.calls.get(), 0);
    let error = nmse(&through_gemm, &through_matvec);
    assert!(
        error > 0.0 && error <= NMSE_PRODUCTS,
        "GEMM vs matvec: NMSE {error:e}"
    );
    // `infer smoke` on a GPU without cuBLAS: every GEMM check fails, saying why.
    let checks = gemm_checks(&without);
    assert!(
        checks
            .iter()
            .all(|c| !c.passed && c.detail.contains("has no GEMM")),
        "{checks:#?}"
    );
    assert!(!without.has_gemm() && device.has_gemm());
}

/// The family sources with `edit` applied to `file`'s (`from` must occur in it).
fn sources_with(file: &str, from: &str, to: &str) -> Vec<(&'static str, String)> {
    FAMILIES
        .iter()
        .map(|f| {
            let source = f.full_source();
            if f.file == file {
                assert!(source.contains(from), "`{from}` is not in {file}");
                (f.file, source.replacen(from, to, 1))
            } else {
                (f.file, source)
            }
        })
        .collect()
}

/// A bug planted in the kernels, by name (`INFER_TEST_PLANT`): the rms_norm reduction's
/// first `__syncthreads` removed, or the warp shuffles' first offset wrong (8 for 16).
fn planted(name: &str) -> Vec<(&'static str, String)> {
    match name {
        "none" => sources_with("norm.cu", "", ""),
        "no-syncthreads" => sources_with(
            "norm.cu",
            "partial[threadIdx.x] = sum;\n    __syncthreads();",
            "partial[threadIdx.x] = sum;",
        ),
        "shuffle-offset" => {
            // The shared helpers are prepended to every family: plant in matvec's copy.
            sources_with("matvec.cu", "for (int offset = 16;", "for (int offset = 8;")
        }
        other => panic!("no planted bug `{other}`"),
    }
}

/// Run by [`harness_under`] in a child process that preloads the sanitizer's runtime:
/// builds the harness instrumented (`INFER_TEST_SANITIZER`) with the planted bug
/// (`INFER_TEST_PLANT`) and runs every check; fails when any check fails.
#[test]
#[ignore = "run by the sanitizer tests in a child process that preloads the runtime"]
fn sanitized_harness_child() {
    use infer::runtime::cuda::host::{HostKernels, Sanitizer};
    let sanitizer = match std::env::var("INFER_TEST_SANITIZER").as_deref() {
        Ok("address") => Sanitizer::Address,
        Ok("thread") => Sanitizer::Thread,
        other => panic!("INFER_TEST_SANITIZER is {other:?}"),
    };
    let plant = std::env::var("INFER_TEST_PLANT").unwrap_or_else(|_| "none".into());
    let dir = tempfile::tempdir().expect("tempdir");
    let kernels = HostKernels::build_from(dir.path(), &cxx(), Some(sanitizer), &planted(&plant))
        .unwrap_or_else(|e| panic!("{e:#}"));
    let checks = infer::runtime::cuda::checks::run_all(&kernels);
    let failed: Vec<_> = checks.iter().filter(|c| !c.passed).collect();
    assert!(failed.is_empty(), "{failed:#?}");
}

fn cxx() -> String {
    std::env::var("CXX").unwrap_or_else(|_| "c++".into())
}

/// This test binary, set to run only the ignored test `cuda::<name>` (a child a parent
/// test starts in a process of its own).
fn child_test(name: &str) -> Command {
    let mut command = Command::new(std::env::current_exe().expect("test binary"));
    command.args([
        "--exact",
        &format!("cuda::{name}"),
        "--ignored",
        "--nocapture",
    ]);
    command
}

/// Runs [`sanitized_harness_child`] under `sanitizer` (`address`, `thread`) with `plant`:
/// its exit status and output.
fn harness_under(sanitizer: &str, plant: &str) -> std::process::Output {
    let runtime = match sanitizer {
        "address" => "libasan.so",
        _ => "libtsan.so",
    };
    let path = Command::new(cxx())
        .arg(format!("-print-file-name={runtime}"))
        .output()
        .expect("c++ runs");
    let path = String::from_utf8_lossy(&path.stdout).trim().to_string();
    assert!(
        Path::new(&path).is_file(),
        "`{}` has no {runtime} (`apt-get install g++` ships it): {path}",
        cxx()
    );
    // The test binary is not instrumented: ThreadSanitizer still sees its memcpy calls (an
    // interceptor) and reports libtest's channel, synchronised by atomics it cannot see.
    // Only the kernels' library is judged.
    let exe = std::env::current_exe().expect("test binary");
    let suppressions = tempfile::NamedTempFile::new().expect("temp file");
    let name = exe.file_name().expect("a file name").to_string_lossy();
    std::fs::write(suppressions.path(), format!("called_from_lib:{name}\n")).expect("written");
    child_test("sanitized_harness_child")
        .env("INFER_TEST_SANITIZER", sanitizer)
        .env("INFER_TEST_PLANT", plant)
        .env("LD_PRELOAD", &path)
        .env("ASAN_OPTIONS", "detect_leaks=0:halt_on_error=1")
        .env(
            "TSAN_OPTIONS",
            format!(
                "halt_on_error=1:exitcode=66:suppressions={}",
                suppressions.path().display()
            ),
        )
        .output()
        .expect("the test binary runs")
}

/// Every kernel check passes under `sanitizer` (`address` or `thread`), in a child test
/// process that preloads its runtime, with no sanitizer report.
fn every_kernel_runs_clean_under(sanitizer: &str) {
    let output = harness_under(sanitizer, "none");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "{sanitizer}: {}\n{stderr}",
        String::from_utf8_lossy(&output.stdout)
    );
    assert!(!stderr.contains("Sanitizer"), "{sanitizer}: {stderr}");
    // The child really ran the checks (it is not filtered out).
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains("1 passed"), "{sanitizer}: {stdout}");
}

// Two tests, so that the two sanitizers' runs (minutes each) can run at once.
#[test]
fn every_kernel_runs_clean_under_address_sanitizer() {
    every_kernel_runs_clean_under("address");
}

#[test]
fn every_kernel_runs_clean_under_thread_sanitizer() {
    every_kernel_runs_clean_under("thread");
}

#[test]
fn a_planted_race_or_wrong_shuffle_fails_the_checks() {
    // A missing __syncthreads: ThreadSanitizer reports the race between the block's threads.
    let output = harness_under("thread", "no-syncthreads");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        !output.status.success(),
        "the race went unnoticed: {stderr}"
    );
    assert!(
        stderr.contains("ThreadSanitizer: data race"),
        "no race reported: {stderr}"
    );
    // A wrong shuffle offset: the products' partial sums are added in the wrong pairs, so
    // the checks fail on their numbers (no sanitizer needed: it is deterministic).
    let dir = tempfile::tempdir().expect("tempdir");
    let kernels = infer::runtime::cuda::host::HostKernels::build_from(
        dir.path(),
        &cxx(),
        None,
        &planted("shuffle-offset"),
    )
    .unwrap_or_else(|e| panic!("{e:#}"));
    let checks = infer::runtime::cuda::checks::run_all(&kernels);
    let failed: Vec<&str> = checks
        .iter()
        .filter(|c| !c.passed)
        .map(|c| c.name.as_str())
        .collect();
    assert!(
        failed.iter().any(|n| n.starts_with("mul_mat_vec")),
        "the wrong shuffle went unnoticed: {checks:#?}"
    );
}

/// `infer smoke`'s serving row, run here with CPU ranks: the real binary serves, answers a
/// chat request through the OpenAI API and stops cleanly on SIGTERM; with `--device cuda`
/// on this GPU-less host the row fails with the server's own reason, and nothing is left.
#[test]
fn the_smoke_serving_row_starts_asks_and_stops_the_real_server() {
    use infer::launch::smoke::chat_check;
    use std::time::Duration;
    let exe = Path::new(env!("CARGO_BIN_EXE_infer"));
    let model = crate::support::model::smollm2();
    let row = chat_check(exe, &model, "cpu", Duration::from_secs(120));
    assert!(row.passed, "{row:?}");
    assert!(row.detail.contains("answered \""), "{row:?}");
    assert!(row.detail.contains("stopped cleanly"), "{row:?}");
    let row = chat_check(exe, &model, "cuda", Duration::from_secs(120));
    assert!(!row.passed, "{row:?}");
    assert!(row.detail.contains("exited before it was ready"), "{row:?}");
    assert!(row.detail.contains("libcuda.so.1"), "{row:?}");
}
