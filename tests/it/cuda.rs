//! The CUDA backend, checked without a GPU: NVRTC from PyPI compiles every kernel to CUBIN for
//! each architecture we support, ptxas' resources stay within what the launch can use, and
//! each kernel's parameters are the ones its Rust launch description passes.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use infer::runtime::cuda::kernels::FAMILIES;
use infer::runtime::cuda::nvrtc::{Nvrtc, ptx_entries};

use super::engines::{cached_dir, recipe_hash, test_cache};

/// NVRTC from PyPI, pinned: it compiles without a GPU or a driver (FACTS.md).
const NVRTC_WHEEL: &str = "nvidia-cuda-nvrtc-cu12==12.9.86";

/// The directory holding `libnvrtc.so.12`: the wheel downloaded once (`pip download
/// --no-deps`) and unzipped into the test cache.
pub fn nvrtc_lib_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = test_cache().join(format!("nvrtc-{}", recipe_hash(NVRTC_WHEEL.as_bytes())));
        let dir = cached_dir(&dir, |staging| {
            std::fs::create_dir_all(staging).expect("staging dir");
            let status = Command::new("python3")
                .args(["-m", "pip", "download", "--quiet", "--no-deps", "--dest"])
                .arg(staging)
                .arg(NVRTC_WHEEL)
                .status()
                .expect("python3 -m pip");
            assert!(status.success(), "pip download {NVRTC_WHEEL} failed");
            let unzip = "import sys, zipfile, glob\n\
                         for wheel in glob.glob(sys.argv[1] + '/*.whl'):\n    \
                         zipfile.ZipFile(wheel).extractall(sys.argv[1])\n";
            let status = Command::new("python3")
                .args(["-c", unzip])
                .arg(staging)
                .status()
                .expect("python3");
            assert!(status.success(), "unzipping the NVRTC wheel failed");
            for wheel in std::fs::read_dir(staging).expect("staging").flatten() {
                if wheel.path().extension().is_some_and(|e| e == "whl") {
                    let _ = std::fs::remove_file(wheel.path());
                }
            }
        });
        dir.join("nvidia/cuda_nvrtc/lib")
    })
}

fn nvrtc() -> &'static Nvrtc {
    static NVRTC: OnceLock<Nvrtc> = OnceLock::new();
    NVRTC.get_or_init(|| {
        Nvrtc::open(&[nvrtc_lib_dir().to_path_buf()]).expect("NVRTC from the wheel opens")
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
    assert!(nvrtc.version.0 >= 12, "NVRTC {:?}", nvrtc.version);
    let mut compiled_kernels = 0;
    for &arch in infer::runtime::cuda::TESTED_ARCHS {
        for family in FAMILIES {
            let compiled = nvrtc
                .compile(family.file, family.source, arch)
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
    let (first, hit) = nvrtc
        .compile_cached(dir.path(), family.file, family.source, 86)
        .expect("compiles");
    assert!(!hit);
    let (again, hit) = nvrtc
        .compile_cached(dir.path(), family.file, family.source, 86)
        .expect("cached");
    assert!(hit);
    assert_eq!(first, again);
    let changed = format!("{}\n// changed\n", family.source);
    let (_, hit) = nvrtc
        .compile_cached(dir.path(), family.file, &changed, 86)
        .expect("compiles");
    assert!(!hit, "a changed source misses the cache");
    let (_, hit) = nvrtc
        .compile_cached(dir.path(), family.file, family.source, 90)
        .expect("compiles");
    assert!(!hit, "another architecture misses the cache");
}

/// `--device cuda` without a driver (this machine) is bad input with the fix, exit 2, for
/// every command that takes it, and before anything starts; `infer smoke` says it needs a
/// GPU. (On a host with a driver the same commands stop at what the backend lacks.)
#[test]
fn device_cuda_without_a_driver_exits_2_naming_the_driver() {
    let has_driver = infer::runtime::cuda::libraries::open(
        infer::runtime::cuda::libraries::DRIVER,
        &infer::runtime::cuda::libraries::search_dirs(&|name| std::env::var_os(name)),
    )
    .is_ok();
    for args in [
        &["generate", "--device", "cuda", "--prompt", "hi"][..],
        &["bench", "decode", "--device", "cuda"],
        &["up", "--device", "cuda", "--tp", "3", "--port", "0"],
        &["smoke"],
        &["smoke", "--json"],
    ] {
        let output = super::run(args);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(output.stdout.is_empty(), "{args:?}: nothing on stdout");
        if has_driver {
            assert!(
                stderr.contains("does not run the model on the GPU yet")
                    || stderr.contains("sees no GPU"),
                "{args:?}: {stderr}"
            );
        } else {
            assert!(
                stderr.contains("no NVIDIA driver (libcuda.so.1) on this host; use --device cpu"),
                "{args:?}: {stderr}"
            );
        }
        if args[0] == "smoke" {
            assert!(
                stderr.contains("infer smoke needs an NVIDIA GPU"),
                "{stderr}"
            );
        }
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}

/// A library is opened by full path from the first directory that has it (what lets
/// cudarc find pip's `libnvrtc.so.12` by name afterwards), and a missing one is an error,
/// never a panic.
#[test]
fn libraries_open_from_the_given_directories_or_say_why_not() {
    use infer::runtime::cuda::libraries::open;
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
    let error = open("libinfer-missing-test.so.7", &[empty.path().to_path_buf()])
        .expect_err("no such library");
    assert!(
        error.to_string().contains("libinfer-missing-test.so.7"),
        "{error}"
    );
}

/// The kernels built for the host once per test process.
fn host() -> &'static infer::runtime::cuda::host::HostKernels {
    static HOST: OnceLock<(tempfile::TempDir, infer::runtime::cuda::host::HostKernels)> =
        OnceLock::new();
    &HOST
        .get_or_init(|| {
            let dir = tempfile::tempdir().expect("tempdir");
            let kernels = infer::runtime::cuda::host::HostKernels::build(
                dir.path(),
                &std::env::var("CXX").unwrap_or_else(|_| "c++".into()),
            )
            .unwrap_or_else(|e| panic!("{e:#}"));
            (dir, kernels)
        })
        .1
}

/// Normalized mean squared error, llama.cpp's `test-backend-ops` measure:
/// `Σ (a − b)² / Σ b²`.
fn nmse(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let error: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - *y as f64).powi(2))
        .sum();
    let norm: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    error / norm.max(f64::MIN_POSITIVE)
}

/// test-backend-ops' tolerances: products 5e-4, everything else 1e-7.
const NMSE_PRODUCTS: f64 = 5e-4;
const NMSE_OTHERS: f64 = 1e-7;

/// Deterministic values in [−1, 1) (a 64-bit LCG; the seed names the case).
fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn ptr<T>(v: &mut [T]) -> infer::runtime::cuda::host::HostArg {
    infer::runtime::cuda::host::HostArg::Ptr(v.as_mut_ptr().cast())
}

/// Q8_0 rows (34-byte blocks: an f16 scale, 32 int8 quants) of `values(seed)`.
fn q8_0_rows(seed: u64, rows: usize, cols: usize) -> Vec<u8> {
    let quants = values(seed, rows * cols);
    let scales = values(seed + 1, rows * cols / 32);
    let mut bytes = Vec::new();
    for (b, block) in quants.chunks(32).enumerate() {
        let d = half::f16::from_f32(0.001 + scales[b].abs() * 0.02);
        bytes.extend_from_slice(&d.to_bits().to_le_bytes());
        bytes.extend(block.iter().map(|v| ((v * 127.0).round() as i8) as u8));
    }
    bytes
}

#[test]
fn host_harness_runs_the_kernels_like_the_cpu_backend() {
    use infer::runtime::cpu::quant::{GgmlType, dequantize_row};
    use infer::runtime::cuda::host::HostArg::{F32, U32};
    let host = host();
    // RMSNorm over 3 rows of 576 (SmolLM2's width): not a multiple of the 256 threads.
    let (rows, cols) = (3usize, 576usize);
    let mut x = values(1, rows * cols);
    let mut w = values(2, cols);
    let mut y = vec![0f32; rows * cols];
    unsafe {
        host.launch(
            "rms_norm_f32",
            [rows as u32, 1, 1],
            [256, 1, 1],
            &[
                ptr(&mut y),
                ptr(&mut x),
                ptr(&mut w),
                U32(cols as u32),
                F32(1e-5),
            ],
        )
    }
    .expect("launch");
    let mut cpu = vec![0f32; rows * cols];
    infer::runtime::model::llama::rms_norm(&x, &w, 1e-5, &mut cpu);
    assert!(nmse(&y, &cpu) <= NMSE_OTHERS, "rms_norm {}", nmse(&y, &cpu));

    // SwiGLU over 1000 values (a partial last block).
    let n = 1000;
    let (mut gate, mut up) = (values(3, n), values(4, n));
    let mut out = vec![0f32; n];
    unsafe {
        host.launch(
            "swiglu_f32",
            [n.div_ceil(256) as u32, 1, 1],
            [256, 1, 1],
            &[ptr(&mut out), ptr(&mut gate), ptr(&mut up), U32(n as u32)],
        )
    }
    .expect("launch");
    let cpu: Vec<f32> = gate
        .iter()
        .zip(&up)
        .map(|(g, u)| infer::runtime::cpu::mathfn::silu(*g) * u)
        .collect();
    assert!(
        nmse(&out, &cpu) <= NMSE_OTHERS,
        "swiglu {}",
        nmse(&out, &cpu)
    );

    // RoPE, both pairings: 3 tokens × 5 heads × 64, positions 0, 7, 4095.
    let (tokens, heads, head_dim) = (3usize, 5usize, 64usize);
    let mut positions: Vec<i32> = vec![0, 7, 4095];
    let mut inv_freqs: Vec<f32> = (0..head_dim / 2)
        .map(|i| 10000f32.powf(-2.0 * i as f32 / head_dim as f32))
        .collect();
    for (kernel, neox) in [("rope_interleaved_f32", false), ("rope_neox_f32", true)] {
        let original = values(5, tokens * heads * head_dim);
        let mut x = original.clone();
        let pairs = tokens * heads * head_dim / 2;
        unsafe {
            host.launch(
                kernel,
                [pairs.div_ceil(256) as u32, 1, 1],
                [256, 1, 1],
                &[
                    ptr(&mut x),
                    ptr(&mut positions),
                    ptr(&mut inv_freqs),
                    U32(tokens as u32),
                    U32(heads as u32),
                    U32(head_dim as u32),
                ],
            )
        }
        .expect("launch");
        let mut reference = original.clone();
        for (t, &position) in positions.iter().enumerate() {
            for h in 0..heads {
                let base = (t * heads + h) * head_dim;
                for (i, &inv_freq) in inv_freqs.iter().enumerate() {
                    let (a, b) = if neox {
                        (base + i, base + i + head_dim / 2)
                    } else {
                        (base + 2 * i, base + 2 * i + 1)
                    };
                    let angle = position as f64 * inv_freq as f64;
                    let (x0, x1) = (original[a] as f64, original[b] as f64);
                    reference[a] = (x0 * angle.cos() - x1 * angle.sin()) as f32;
                    reference[b] = (x0 * angle.sin() + x1 * angle.cos()) as f32;
                }
            }
        }
        assert!(
            nmse(&x, &reference) <= NMSE_OTHERS,
            "{kernel} {}",
            nmse(&x, &reference)
        );
    }

    // Embedding rows of a Q8_0 table (5 rows of 96) for ids 4, 0, 4.
    let (vocab, dim) = (5usize, 96usize);
    let mut table = q8_0_rows(6, vocab, dim);
    let mut ids: Vec<i32> = vec![4, 0, 4];
    let mut rows_out = vec![0f32; ids.len() * dim];
    unsafe {
        host.launch(
            "get_rows_q8_0",
            [ids.len() as u32, dim.div_ceil(256) as u32, 1],
            [256, 1, 1],
            &[
                ptr(&mut rows_out),
                ptr(&mut table),
                ptr(&mut ids),
                U32(dim as u32),
            ],
        )
    }
    .expect("launch");
    let row_bytes = dim / 32 * 34;
    for (k, &id) in ids.iter().enumerate() {
        let mut cpu = vec![0f32; dim];
        dequantize_row(
            GgmlType::Q8_0,
            &table[id as usize * row_bytes..(id as usize + 1) * row_bytes],
            &mut cpu,
        );
        assert_eq!(
            &rows_out[k * dim..(k + 1) * dim],
            &cpu[..],
            "row {k}: exact"
        );
    }

    // Every quantized type × Q8_1 activations (dp4a): 5 rows × 8448 columns (33 super-blocks
    // of 256: 264 blocks of 32 per row, more than the 128 threads), against the f64 product
    // of the CPU backend's dequantized rows.
    let (n_rows, n_cols) = (5usize, 8448usize);
    let mut activations = values(8, n_cols);
    let mut quantized = vec![0u8; n_cols / 32 * 40];
    unsafe {
        host.launch(
            "quantize_q8_1",
            [(n_cols / 32) as u32, 1, 1],
            [32, 1, 1],
            &[
                ptr(&mut quantized),
                ptr(&mut activations),
                U32(n_cols as u32),
            ],
        )
    }
    .expect("launch");
    // (type, kernel, block bytes, values per block, offsets of the f16 scales in a block)
    let types: [(GgmlType, &str, usize, usize, &[usize]); 5] = [
        (GgmlType::Q4_0, "mul_mat_vec_q4_0_q8_1", 18, 32, &[0]),
        (GgmlType::Q4_1, "mul_mat_vec_q4_1_q8_1", 20, 32, &[0, 2]),
        (GgmlType::Q8_0, "mul_mat_vec_q8_0_q8_1", 34, 32, &[0]),
        (GgmlType::Q4K, "mul_mat_vec_q4_k_q8_1", 144, 256, &[0, 2]),
        (GgmlType::Q6K, "mul_mat_vec_q6_k_q8_1", 210, 256, &[208]),
    ];
    for (seed, (ty, kernel, block_bytes, block_values, scales)) in types.into_iter().enumerate() {
        let row_bytes = n_cols / block_values * block_bytes;
        // Random quants; sane f16 scales (2^-10 to 2^-6) where the format keeps them.
        let mut weights: Vec<u8> = values(20 + seed as u64, n_rows * row_bytes)
            .iter()
            .map(|v| ((v + 1.0) * 127.5) as u8)
            .collect();
        let scale_values = values(40 + seed as u64, weights.len() / block_bytes * scales.len());
        for (k, block) in weights.chunks_mut(block_bytes).enumerate() {
            for (s, &offset) in scales.iter().enumerate() {
                let scale = half::f16::from_f32(
                    (1.0 / 1024.0) * (1.0 + 15.0 * scale_values[k * scales.len() + s].abs()),
                );
                block[offset..offset + 2].copy_from_slice(&scale.to_bits().to_le_bytes());
            }
        }
        let mut product = vec![0f32; n_rows];
        unsafe {
            host.launch(
                kernel,
                [n_rows as u32, 1, 1],
                [128, 1, 1],
                &[
                    ptr(&mut product),
                    ptr(&mut weights),
                    ptr(&mut quantized),
                    U32(n_cols as u32),
                    U32(row_bytes as u32),
                ],
            )
        }
        .expect("launch");
        let reference: Vec<f32> = (0..n_rows)
            .map(|r| {
                let mut row = vec![0f32; n_cols];
                dequantize_row(ty, &weights[r * row_bytes..(r + 1) * row_bytes], &mut row);
                row.iter()
                    .zip(&activations)
                    .map(|(w, x)| *w as f64 * *x as f64)
                    .sum::<f64>() as f32
            })
            .collect();
        let error = nmse(&product, &reference);
        assert!(
            error <= NMSE_PRODUCTS && error > 0.0,
            "{kernel}: NMSE {error}: {product:?} vs {reference:?}"
        );
    }

    // Paged attention, GQA (6 query heads on 2 KV heads, head_dim 64), blocks scattered over
    // the pool: two decode queries (37 and 600 positions: two tiles of 512) and four prefill
    // queries of the first sequence with their causal lengths, against f64 attention.
    let (n_heads, n_kv_heads, head_dim, n_blocks) = (6usize, 2usize, 64usize, 60usize);
    let block_len = 16usize;
    let kv_values = n_blocks * n_kv_heads * block_len * head_dim;
    let to_f16 = |v: &[f32]| -> Vec<u16> {
        v.iter()
            .map(|x| half::f16::from_f32(*x).to_bits())
            .collect()
    };
    let mut k_cache = to_f16(&values(50, kv_values));
    let mut v_cache = to_f16(&values(51, kv_values));
    let max_blocks = 38usize;
    // Sequence 0 holds blocks 59, 3, 17; sequence 1 every block from 58 down, skipping those.
    let mut tables = vec![0i32; 2 * max_blocks];
    tables[..3].copy_from_slice(&[59, 3, 17]);
    let others: Vec<i32> = (0..59)
        .rev()
        .filter(|b| *b != 3 && *b != 17)
        .take(38)
        .collect();
    tables[max_blocks..].copy_from_slice(&others);
    let mut table_rows: Vec<i32> = vec![0, 1, 0, 0, 0, 0];
    let mut context_lens: Vec<i32> = vec![37, 600, 34, 35, 36, 37];
    let n_queries = table_rows.len();
    let mut queries = values(52, n_queries * n_heads * head_dim);
    let mut attended = vec![0f32; queries.len()];
    let scale = 1.0 / (head_dim as f32).sqrt();
    unsafe {
        host.launch(
            "paged_attention_f16kv",
            [n_heads as u32, n_queries as u32, 1],
            [128, 1, 1],
            &[
                ptr(&mut attended),
                ptr(&mut queries),
                ptr(&mut k_cache),
                ptr(&mut v_cache),
                ptr(&mut tables),
                ptr(&mut table_rows),
                ptr(&mut context_lens),
                U32(max_blocks as u32),
                U32(n_heads as u32),
                U32(n_kv_heads as u32),
                U32(head_dim as u32),
                F32(scale),
            ],
        )
    }
    .expect("launch");
    let f16_at = |cache: &[u16], block: i32, kv_head: usize, position: usize, d: usize| {
        let index = ((block as usize * n_kv_heads + kv_head) * block_len + position % block_len)
            * head_dim
            + d;
        half::f16::from_bits(cache[index]).to_f64()
    };
    let mut reference = vec![0f32; attended.len()];
    for query in 0..n_queries {
        let table = &tables[table_rows[query] as usize * max_blocks..][..max_blocks];
        for head in 0..n_heads {
            let kv_head = head / (n_heads / n_kv_heads);
            let q = &queries[(query * n_heads + head) * head_dim..][..head_dim];
            let len = context_lens[query] as usize;
            let scores: Vec<f64> = (0..len)
                .map(|p| {
                    let block = table[p / block_len];
                    (0..head_dim)
                        .map(|d| q[d] as f64 * f16_at(&k_cache, block, kv_head, p, d))
                        .sum::<f64>()
                        * scale as f64
                })
                .collect();
            let max = scores.iter().cloned().fold(f64::MIN, f64::max);
            let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let total: f64 = weights.iter().sum();
            for d in 0..head_dim {
                let value: f64 = (0..len)
                    .map(|p| weights[p] * f16_at(&v_cache, table[p / block_len], kv_head, p, d))
                    .sum();
                reference[(query * n_heads + head) * head_dim + d] = (value / total) as f32;
            }
        }
    }
    let error = nmse(&attended, &reference);
    assert!(error <= NMSE_OTHERS, "paged_attention_f16kv NMSE {error}");

    // Greedy sampling with a tie: the lowest index wins, as the CPU's argmax.
    let vocab = 1000;
    let mut logits = values(9, 2 * vocab);
    logits[vocab + 10] = 5.0;
    logits[vocab + 900] = 5.0;
    let mut chosen = vec![0i32; 2];
    unsafe {
        host.launch(
            "argmax_f32",
            [2, 1, 1],
            [256, 1, 1],
            &[ptr(&mut chosen), ptr(&mut logits), U32(vocab as u32)],
        )
    }
    .expect("launch");
    for row in 0..2 {
        let cpu = infer::runtime::model::sampling::argmax(&logits[row * vocab..(row + 1) * vocab]);
        assert_eq!(chosen[row] as u32, cpu, "row {row}");
    }
    assert_eq!(chosen[1], 10);

    // Arguments that are not the kernel's parameters are refused before anything runs.
    let error = unsafe { host.launch("argmax_f32", [1, 1, 1], [256, 1, 1], &[U32(1)]) }
        .expect_err("wrong arguments");
    assert!(error.to_string().contains("argmax_f32"), "{error}");
}
