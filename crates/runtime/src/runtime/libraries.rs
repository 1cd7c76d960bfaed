//! Finding and opening NVIDIA's shared libraries where users keep them.
//!
//! We open every CUDA library ourselves, by full path, with libloading: the driver API
//! (`libcuda.so.1`, which cudarc then finds by name), NVRTC (`cuda::nvrtc`), cuBLAS
//! (`cuda::cublas`) and NCCL (`collectives/nccl.rs`). NVRTC and cuBLAS are bound by our own
//! code and never through cudarc: cudarc 0.19's loader knows only CUDA 12 names and panics
//! when none loads (../shared/FACTS.md).
//!
//! Sonames: CUDA 13 first, then CUDA 12 ([`NVRTC`], [`CUBLAS`]), restricted to what the
//! driver runs ([`sonames_for_driver`]): a CUDA 13 library needs a CUDA 13 driver (R580 or
//! newer); CUDA 12 libraries run on every driver from R525 (CUDA minor-version
//! compatibility, CUDA Compatibility guide §"Minor Version Compatibility").
//!
//! Where ([`search_dirs`]): `INFER_CUDA_LIB_DIRS`, `LD_LIBRARY_PATH`, the Python environments
//! users install NVIDIA's wheels into (the `python3` on `PATH`, `VIRTUAL_ENV`, `CONDA_PREFIX`,
//! `~/.local`, `/usr/local`, `/usr`: their `site-packages/nvidia/cu13/lib`, where the CUDA 13
//! wheels share one folder, then every `site-packages/nvidia/*/lib`, where the CUDA 12
//! wheels have one each), `/usr/local/cuda/lib64` and `/usr/local/cuda-*/lib64` (newest
//! first), then the system loader's own paths.

use std::collections::HashMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use anyhow::{Result, bail};
use serde::Serialize;

/// The driver API (`libcuda.so.1`), installed with the NVIDIA driver.
pub const DRIVER: &str = "libcuda.so.1";
/// NVRTC's sonames, CUDA 13 first (`nvidia-cuda-nvrtc` 13.x on PyPI:
/// `nvidia/cu13/lib/libnvrtc.so.13`; `nvidia-cuda-nvrtc-cu12`:
/// `nvidia/cuda_nvrtc/lib/libnvrtc.so.12`).
pub const NVRTC: &[&str] = &["libnvrtc.so.13", "libnvrtc.so.12"];
/// cuBLAS's sonames, CUDA 13 first (`nvidia-cublas` 13.x: `nvidia/cu13/lib/libcublas.so.13`;
/// `nvidia-cublas-cu12`: `nvidia/cublas/lib/libcublas.so.12`); each needs its
/// `libcublasLt.so.<major>` beside it.
pub const CUBLAS: &[&str] = &["libcublas.so.13", "libcublas.so.12"];
/// NCCL 2 (`nvidia-nccl-cu12`, `nvidia-nccl-cu13`: both `nvidia/nccl/lib/libnccl.so.2`).
pub const NCCL: &str = "libnccl.so.2";

/// Where one library came from, for `infer smoke`'s report.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Found {
    /// What it is (`driver`, `NVRTC`, `NVRTC builtins`, `cuBLAS`, `NCCL`).
    pub library: String,
    /// The name it was opened under (`libnvrtc.so.13`).
    pub soname: String,
    /// The file opened; `None` when the system loader found it on its own paths.
    pub path: Option<PathBuf>,
}

/// A library opened and kept open for the life of the process.
pub struct Opened {
    /// The soname that was found.
    pub soname: String,
    /// The file (`None`: the system loader's paths).
    pub path: Option<PathBuf>,
    /// The handle, for binding entry points (never closed).
    pub library: &'static libloading::Library,
}

/// The sonames of `candidates` (newest CUDA major first, each ending in `.so.<major>`) that a
/// driver supporting CUDA `driver_cuda` (`(13, 0)` on R580) can run: a library's CUDA major
/// must not exceed the driver's. `None` (no driver known, e.g. compiling without a GPU):
/// all of them.
pub fn sonames_for_driver(
    candidates: &'static [&'static str],
    driver_cuda: Option<(i32, i32)>,
) -> Vec<&'static str> {
    candidates
        .iter()
        .copied()
        .filter(|soname| match (driver_cuda, soname_major(soname)) {
            (Some((driver_major, _)), Some(major)) => major <= driver_major,
            _ => true,
        })
        .collect()
}

/// The CUDA major of a soname (`libnvrtc.so.13` → 13).
fn soname_major(soname: &str) -> Option<i32> {
    soname
        .rsplit(".so.")
        .next()?
        .split('.')
        .next()?
        .parse()
        .ok()
}

/// The Python prefixes whose site-packages may hold NVIDIA's wheels, most specific first:
/// the environment of the `python3` that `PATH` finds (a venv is the folder above its
/// `bin/`, whether or not `VIRTUAL_ENV` is set; for an interpreter reached through a
/// symbolic link, also the installation it points into), `VIRTUAL_ENV`, `CONDA_PREFIX`,
/// `~/.local` (pip's `--user`), `/usr/local`, `/usr`.
fn python_prefixes(var: &dyn Fn(&str) -> Option<OsString>) -> Vec<PathBuf> {
    let mut prefixes = Vec::new();
    if let Some(path) = var("PATH") {
        let python = std::env::split_paths(&path)
            .map(|dir| dir.join("python3"))
            .find(|python| python.is_file());
        if let Some(python) = python {
            if let Some(prefix) = python.parent().and_then(Path::parent) {
                prefixes.push(prefix.to_path_buf());
            }
            if let Ok(real) = std::fs::canonicalize(&python)
                && let Some(prefix) = real.parent().and_then(Path::parent)
            {
                prefixes.push(prefix.to_path_buf());
            }
        }
    }
    for name in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        if let Some(value) = var(name).filter(|v| !v.is_empty()) {
            prefixes.push(PathBuf::from(value));
        }
    }
    if let Some(home) = var("HOME").filter(|v| !v.is_empty()) {
        prefixes.push(Path::new(&home).join(".local"));
    }
    prefixes.extend([PathBuf::from("/usr/local"), PathBuf::from("/usr")]);
    prefixes
}

/// Sorted entries of `dir` whose names satisfy `keep` (none when it cannot be read).
fn entries(dir: &Path, keep: impl Fn(&str) -> bool) -> Vec<PathBuf> {
    let Ok(read) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut paths: Vec<PathBuf> = read
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.file_name().is_some_and(|n| keep(&n.to_string_lossy())))
        .collect();
    paths.sort();
    paths
}

/// The `nvidia/cu13/lib` and then every other `nvidia/*/lib` of `prefix`'s
/// `lib{,64}/python3*/{site,dist}-packages`.
fn wheel_dirs(prefix: &Path) -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    for lib in ["lib", "lib64"] {
        for python in entries(&prefix.join(lib), |n| n.starts_with("python3")) {
            for packages in ["site-packages", "dist-packages"] {
                let nvidia = python.join(packages).join("nvidia");
                dirs.push(nvidia.join("cu13").join("lib"));
                dirs.extend(
                    entries(&nvidia, |_| true)
                        .into_iter()
                        .map(|p| p.join("lib")),
                );
            }
        }
    }
    dirs
}

/// Directories searched for NVIDIA libraries, in the order of the module's documentation
/// (the system loader's own paths come after them, in [`open`]). Directories that do not
/// exist are left out. `var` reads an environment variable (the caller's environment:
/// `runtime/` reads none itself).
pub fn search_dirs(var: &dyn Fn(&str) -> Option<OsString>) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    for name in [crate::envvars::CUDA_LIB_DIRS, "LD_LIBRARY_PATH"] {
        if let Some(value) = var(name) {
            dirs.extend(std::env::split_paths(&value).filter(|p| !p.as_os_str().is_empty()));
        }
    }
    for prefix in python_prefixes(var) {
        dirs.extend(wheel_dirs(&prefix));
    }
    dirs.push(PathBuf::from("/usr/local/cuda/lib64"));
    let mut toolkits = entries(Path::new("/usr/local"), |n| n.starts_with("cuda-"));
    // `cuda-13.0` before `cuda-12.9` before `cuda-12.10`'s elders: newest first by version.
    toolkits.sort_by_key(|p| {
        let name = p.file_name().map(|n| n.to_string_lossy().into_owned());
        let version = name.as_deref().and_then(|n| n.strip_prefix("cuda-"));
        let mut parts = version
            .unwrap_or_default()
            .split('.')
            .map(|x| x.parse::<u32>().unwrap_or(0));
        std::cmp::Reverse((parts.next().unwrap_or(0), parts.next().unwrap_or(0)))
    });
    dirs.extend(toolkits.into_iter().map(|p| p.join("lib64")));
    // The same folder reached twice (a venv's `lib64` links to its `lib`) is searched once.
    let mut seen = Vec::new();
    dirs.retain(|d| {
        let real = std::fs::canonicalize(d).unwrap_or_else(|_| d.clone());
        d.is_dir() && !seen.contains(&real) && {
            seen.push(real);
            true
        }
    });
    dirs
}

/// Libraries opened so far, by the file opened (or by soname when the system loader found
/// it), with where they came from.
type OpenedMap = HashMap<PathBuf, (&'static libloading::Library, Option<PathBuf>)>;

fn opened() -> &'static Mutex<OpenedMap> {
    static OPENED: OnceLock<Mutex<OpenedMap>> = OnceLock::new();
    OPENED.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Loads `target` (a full path, or a bare soname for the system loader) once per process
/// and keeps it open.
fn load(
    target: &Path,
    from: Option<PathBuf>,
) -> Result<(&'static libloading::Library, Option<PathBuf>)> {
    let mut opened = opened().lock().unwrap_or_else(|e| e.into_inner());
    if let Some((library, path)) = opened.get(target) {
        return Ok((library, path.clone()));
    }
    // SAFETY: loading a library runs its initialisers; NVIDIA's libraries are designed to
    // be dlopen'ed (PyTorch, cudarc and the CUDA runtime do the same).
    let library = unsafe { libloading::Library::new(target) }?;
    let library: &'static libloading::Library = Box::leak(Box::new(library));
    opened.insert(target.to_path_buf(), (library, from.clone()));
    Ok((library, from))
}

/// Opens the first of `sonames` found: each directory of `dirs` in order, trying every
/// soname there, then the system loader's paths for each soname in order. Before a file
/// from a directory, `companions(soname)` names libraries that must be loaded first from
/// the same directory when they are there (cuBLAS's `libcublasLt`). Kept open; idempotent.
///
/// Errors: a file that exists but does not load (the loader's message), or none found (the
/// sonames and directories tried, and the loader's last message).
pub fn open_first(
    sonames: &[&str],
    dirs: &[PathBuf],
    companions: &dyn Fn(&str) -> Vec<String>,
) -> Result<Opened> {
    if sonames.is_empty() {
        bail!("no library name to look for");
    }
    for dir in dirs {
        for &soname in sonames {
            let path = dir.join(soname);
            if !path.is_file() {
                continue;
            }
            for companion in companions(soname) {
                let beside = dir.join(&companion);
                if beside.is_file() {
                    load(&beside, Some(beside.clone())).map_err(|error| {
                        anyhow::anyhow!("`{}` exists but does not load: {error}", beside.display())
                    })?;
                }
            }
            let (library, path) = load(&path, Some(path.clone())).map_err(|error| {
                anyhow::anyhow!("`{}` exists but does not load: {error}", path.display())
            })?;
            return Ok(Opened {
                soname: soname.to_string(),
                path,
                library,
            });
        }
    }
    let mut last = String::new();
    for &soname in sonames {
        match load(Path::new(soname), None) {
            Ok((library, path)) => {
                return Ok(Opened {
                    soname: soname.to_string(),
                    path,
                    library,
                });
            }
            Err(error) => last = error.to_string(),
        }
    }
    bail!(
        "none of {} in {} or on the system loader's paths ({last})",
        sonames.join(", "),
        if dirs.is_empty() {
            "no directory".to_string()
        } else {
            dirs.iter()
                .map(|d| d.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        }
    )
}

/// Opens `soname` (`libnccl.so.2`) from the first of `dirs` that has it, else through the
/// system loader's own paths, and keeps it open; returns where it came from (`None`: the
/// system loader found it). Idempotent.
///
/// Errors: a file that does not load, or none found (the loader's message).
pub fn open(soname: &str, dirs: &[PathBuf]) -> Result<Option<PathBuf>> {
    open_first(&[soname], dirs, &|_| Vec::new()).map(|opened| opened.path)
}

/// Opens the driver API from `dirs` (then the system loader's paths).
///
/// Errors: no driver on this host, with what to do instead.
pub fn open_driver(dirs: &[PathBuf]) -> Result<Option<PathBuf>> {
    open(DRIVER, dirs)
        .map_err(|_| anyhow::anyhow!("no NVIDIA driver ({DRIVER}) on this host; use --device cpu"))
}

/// The pip package that provides a library of CUDA major `major` (`nvidia-cuda-nvrtc` for
/// 13, `nvidia-cuda-nvrtc-cu12` for 12), from its CUDA 12 name `cu12_package`.
pub(crate) fn pip_package(cu12_package: &str, major: i32) -> String {
    if major >= 13 {
        cu12_package.trim_end_matches("-cu12").to_string()
    } else {
        cu12_package.to_string()
    }
}

/// The message for a library of which none of `tried` was found, for a driver supporting
/// CUDA `driver_cuda` (`None`: not known): what to install (`cu12_package`, or its CUDA 13
/// name on a CUDA 13 driver; both when the driver is not known), and why CUDA 13's soname
/// was not tried on an older driver.
pub(crate) fn not_installed(
    what: &str,
    cu12_package: &str,
    tried: &[&str],
    driver_cuda: Option<(i32, i32)>,
    error: &anyhow::Error,
) -> anyhow::Error {
    let install = match driver_cuda {
        Some((major, minor)) if major < 13 => format!(
            "`pip install {cu12_package}` (this driver supports CUDA {major}.{minor}: CUDA 13 \
             libraries need driver R580 or newer)"
        ),
        Some(_) => format!("`pip install {}`", pip_package(cu12_package, 13)),
        None => format!(
            "`pip install {}` (CUDA 13, driver R580 or newer) or `pip install {cu12_package}`",
            pip_package(cu12_package, 13)
        ),
    };
    anyhow::anyhow!(
        "{what} ({}) is not installed: {install}, or put a CUDA toolkit's lib64 on \
         LD_LIBRARY_PATH or {}; {error}",
        tried.join(" or "),
        crate::envvars::CUDA_LIB_DIRS
    )
}

/// The newest of `candidates` that a driver supporting CUDA `driver_cuda` runs
/// ([`sonames_for_driver`]), opened from `dirs` ([`open_first`]), and how messages name it
/// (its path, else its soname).
///
/// Errors: none found: what to install for `what` ([`not_installed`], from its CUDA 12 pip
/// package `cu12_package`); a file that does not load.
pub fn open_for_driver(
    what: &str,
    cu12_package: &str,
    candidates: &'static [&'static str],
    dirs: &[PathBuf],
    driver_cuda: Option<(i32, i32)>,
    companions: &dyn Fn(&str) -> Vec<String>,
) -> Result<(Opened, String)> {
    let sonames = sonames_for_driver(candidates, driver_cuda);
    let opened = open_first(&sonames, dirs, companions)
        .map_err(|error| not_installed(what, cu12_package, &sonames, driver_cuda, &error))?;
    let shown = opened
        .path
        .as_ref()
        .map_or(opened.soname.clone(), |p| p.display().to_string());
    Ok((opened, shown))
}

/// The text of a C string a library returns for an error code (static, or null: "unknown
/// error").
///
/// # Safety
/// `text` is null or points to a NUL-terminated string that outlives the call.
pub unsafe fn error_text(text: *const std::ffi::c_char) -> String {
    if text.is_null() {
        "unknown error".to_string()
    } else {
        // SAFETY: the caller's contract.
        unsafe { std::ffi::CStr::from_ptr(text) }
            .to_string_lossy()
            .into_owned()
    }
}
