//! Finding NVIDIA's shared libraries where users have them, before cudarc touches them.
//!
//! cudarc (`dynamic-loading`) opens each library by bare name and panics when none of its
//! candidate names loads. We look first — in `INFER_CUDA_LIB_DIRS`, `LD_LIBRARY_PATH`, pip
//! wheels' `site-packages/nvidia/*/lib` (where `nvidia-cuda-nvrtc-cu12` and
//! `nvidia-nccl-cu12` put `libnvrtc.so.12` and `libnccl.so.2`), `/usr/local/cuda`, then the
//! system loader's own paths — and open the file by its full path. The dynamic loader then
//! answers cudarc's later `dlopen("libnvrtc.so.12")` with the library already loaded (it
//! matches loaded objects by their `SONAME`), so cudarc never searches, and never panics.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use anyhow::{Result, bail};

/// The driver API (`libcuda.so.1`), installed with the NVIDIA driver.
pub const DRIVER: &str = "libcuda.so.1";
/// NVRTC of CUDA 12 (`nvidia-cuda-nvrtc-cu12` on PyPI).
pub const NVRTC: &str = "libnvrtc.so.12";
/// cuBLAS of CUDA 12 (`nvidia-cublas-cu12`).
pub const CUBLAS: &str = "libcublas.so.12";
/// NCCL 2 (`nvidia-nccl-cu12`).
pub const NCCL: &str = "libnccl.so.2";

/// Directories searched for NVIDIA libraries, in order: `INFER_CUDA_LIB_DIRS` and
/// `LD_LIBRARY_PATH` (colon-separated), every `nvidia/*/lib` of the Python environments
/// found (`$VIRTUAL_ENV`, `$CONDA_PREFIX`, `~/.local`, `/usr/local`, `/usr`), then
/// `/usr/local/cuda/lib64`. Directories that do not exist are left out. `var` reads an
/// environment variable (the caller's environment: `runtime/` reads none itself).
pub fn search_dirs(var: &dyn Fn(&str) -> Option<std::ffi::OsString>) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    for name in ["INFER_CUDA_LIB_DIRS", "LD_LIBRARY_PATH"] {
        if let Some(value) = var(name) {
            dirs.extend(std::env::split_paths(&value).filter(|p| !p.as_os_str().is_empty()));
        }
    }
    let mut prefixes: Vec<PathBuf> = Vec::new();
    for name in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        if let Some(value) = var(name) {
            prefixes.push(PathBuf::from(value));
        }
    }
    if let Some(home) = var("HOME") {
        prefixes.push(Path::new(&home).join(".local"));
    }
    prefixes.extend([PathBuf::from("/usr/local"), PathBuf::from("/usr")]);
    for prefix in prefixes {
        for lib in ["lib", "lib64"] {
            let Ok(entries) = std::fs::read_dir(prefix.join(lib)) else {
                continue;
            };
            let mut pythons: Vec<PathBuf> = entries
                .flatten()
                .map(|e| e.path())
                .filter(|p| {
                    p.file_name()
                        .is_some_and(|n| n.to_string_lossy().starts_with("python3"))
                })
                .collect();
            pythons.sort();
            for python in pythons {
                for packages in ["site-packages", "dist-packages"] {
                    let nvidia = python.join(packages).join("nvidia");
                    let Ok(entries) = std::fs::read_dir(&nvidia) else {
                        continue;
                    };
                    let mut libs: Vec<PathBuf> = entries
                        .flatten()
                        .map(|e| e.path().join("lib"))
                        .filter(|p| p.is_dir())
                        .collect();
                    libs.sort();
                    dirs.extend(libs);
                }
            }
        }
    }
    dirs.push(PathBuf::from("/usr/local/cuda/lib64"));
    let mut seen = Vec::new();
    dirs.retain(|d| {
        d.is_dir() && !seen.contains(d) && {
            seen.push(d.clone());
            true
        }
    });
    dirs
}

/// Libraries opened so far, by file name (kept open for the life of the process).
fn opened() -> &'static Mutex<HashMap<String, PathBuf>> {
    static OPENED: OnceLock<Mutex<HashMap<String, PathBuf>>> = OnceLock::new();
    OPENED.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Opens `soname` (`libnvrtc.so.12`) from the first of `dirs` that has it, else through
/// the system loader's own paths, and keeps it open; returns where it came from (`None`:
/// the system loader found it). Idempotent.
///
/// Errors: no directory has it and the system loader cannot open it (the loader's message).
pub fn open(soname: &str, dirs: &[PathBuf]) -> Result<Option<PathBuf>> {
    let mut opened = opened().lock().unwrap_or_else(|e| e.into_inner());
    if let Some(path) = opened.get(soname) {
        return Ok((!path.as_os_str().is_empty()).then(|| path.clone()));
    }
    for dir in dirs {
        let path = dir.join(soname);
        if path.is_file() {
            // SAFETY: loading a library runs its initialisers; NVIDIA's libraries are
            // designed to be dlopen'ed (cudarc and the CUDA runtime do the same).
            let library = unsafe { libloading::Library::new(&path) };
            match library {
                Ok(library) => {
                    std::mem::forget(library);
                    opened.insert(soname.to_string(), path.clone());
                    return Ok(Some(path));
                }
                Err(error) => bail!("`{}` exists but does not load: {error}", path.display()),
            }
        }
    }
    // SAFETY: as above.
    match unsafe { libloading::Library::new(soname) } {
        Ok(library) => {
            std::mem::forget(library);
            opened.insert(soname.to_string(), PathBuf::new());
            Ok(None)
        }
        Err(error) => bail!("{error}"),
    }
}

/// Opens the driver API from `dirs` (then the system loader's paths).
///
/// Errors: no driver on this host, with what to do instead.
pub fn open_driver(dirs: &[PathBuf]) -> Result<()> {
    open(DRIVER, dirs)
        .map(|_| ())
        .map_err(|_| anyhow::anyhow!("no NVIDIA driver ({DRIVER}) on this host; use --device cpu"))
}

/// Opens NVRTC from `dirs` (or the system loader's paths).
///
/// Errors: not found, naming the package that provides it.
pub fn open_nvrtc(dirs: &[PathBuf]) -> Result<Option<PathBuf>> {
    open(NVRTC, dirs).map_err(|error| {
        anyhow::anyhow!(
            "NVRTC ({NVRTC}) is not installed: `pip install nvidia-cuda-nvrtc-cu12` (or put a CUDA 12 toolkit's lib64 \
             on LD_LIBRARY_PATH); the loader said: {error}"
        )
    })
}

/// Opens cuBLAS from `dirs` (or the system loader's paths); it needs `libcublasLt.so.12`
/// beside it, as the pip wheel and the toolkit ship them.
///
/// Errors: not found or not loadable, naming the package that provides it.
pub fn open_cublas(dirs: &[PathBuf]) -> Result<Option<PathBuf>> {
    open(CUBLAS, dirs).map_err(|error| {
        anyhow::anyhow!(
            "cuBLAS ({CUBLAS}) is not installed: `pip install nvidia-cublas-cu12` (or put a CUDA 12 toolkit's lib64 \
             on LD_LIBRARY_PATH); the loader said: {error}"
        )
    })
}
