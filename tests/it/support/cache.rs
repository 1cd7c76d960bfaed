//! Tools the tests build or download once and keep outside the repository: the test cache
//! directory, cache entries named after their recipe and built atomically, and the Python
//! packages (`openai`, `tokenizers`) tests check against.

use std::path::{Path, PathBuf};
use std::process::Stdio;

/// Where test tools are cached: `$INFER_TEST_CACHE`, else `~/.cache/infer-tests`.
pub fn test_cache() -> PathBuf {
    std::env::var_os("INFER_TEST_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").expect("HOME is set")).join(".cache/infer-tests")
        })
}

/// A short content hash (FNV-1a, 64 bits) naming a cache entry after its recipe.
pub fn recipe_hash(bytes: &[u8]) -> String {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        hash ^= u64::from(b);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{hash:016x}")
}

/// Builds `dir` with `build` (into a temporary sibling, renamed into place at the end) unless
/// it exists; concurrent tests either build it or find the finished one.
pub fn cached_dir(dir: &Path, build: impl FnOnce(&Path)) -> PathBuf {
    if dir.exists() {
        return dir.to_path_buf();
    }
    let parent = dir.parent().expect("a cache dir has a parent");
    std::fs::create_dir_all(parent).expect("create the test cache");
    let staging = parent.join(format!(
        ".{}-{}",
        dir.file_name().and_then(|n| n.to_str()).unwrap_or("build"),
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&staging);
    build(&staging);
    if std::fs::rename(&staging, dir).is_err() {
        // Another test process finished first.
        let _ = std::fs::remove_dir_all(&staging);
    }
    assert!(dir.exists(), "`{}` was not built", dir.display());
    dir.to_path_buf()
}

/// The official `openai` Python package, installed with pip into the cache (outside the
/// repo) on first use; returns the directory to put on `PYTHONPATH`.
pub fn openai_python_package() -> PathBuf {
    python_package("openai", "3.54.0", &[])
}

/// Hugging Face's `tokenizers` Python package (the library under
/// `transformers.AutoTokenizer`, built with its own regex engine), the version of the crate
/// we build with, without its dependencies (`huggingface_hub` only downloads); returns the
/// directory to put on `PYTHONPATH`.
pub fn tokenizers_python_package() -> PathBuf {
    python_package("tokenizers", "0.22.2", &["--no-deps"])
}

/// `name==version` (whose import directory is `name`) installed with pip, with `pip_args`,
/// into the cache on first use; returns the directory to put on `PYTHONPATH`.
fn python_package(name: &str, version: &str, pip_args: &[&str]) -> PathBuf {
    let dir = infer::model::default::cache_dir()
        .expect("cache dir")
        .join("python")
        .join(format!("{name}-{version}"));
    if !dir.join(name).is_dir() {
        let staging = dir.with_extension(format!("partial-{}", std::process::id()));
        let status = std::process::Command::new("python3")
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
            ])
            .args(pip_args)
            .arg("--target")
            .arg(&staging)
            .arg(format!("{name}=={version}"))
            .stdout(Stdio::null())
            .status()
            .expect("python3 -m pip (install python3-pip)");
        assert!(status.success(), "pip could not install {name}=={version}");
        // Another test process may have won the race; either copy is complete.
        if std::fs::rename(&staging, &dir).is_err() {
            let _ = std::fs::remove_dir_all(&staging);
        }
    }
    dir
}

/// A venv cached as `dir_name` in the test cache, with `pip install --quiet
/// --disable-pip-version-check PIP_ARGS` run in it; its scripts name the staging path, so
/// run its tools as `bin/python -m TOOL`.
pub fn pip_venv(dir_name: &str, pip_args: &[&std::ffi::OsStr]) -> PathBuf {
    cached_dir(&test_cache().join(dir_name), |staging| {
        let status = std::process::Command::new("python3")
            .args(["-m", "venv"])
            .arg(staging)
            .status()
            .expect("run python3 -m venv");
        assert!(status.success(), "python3 -m venv failed");
        let status = std::process::Command::new(staging.join("bin/pip"))
            .args(["install", "--quiet", "--disable-pip-version-check"])
            .args(pip_args)
            .status()
            .expect("run pip");
        assert!(status.success(), "pip install {pip_args:?} failed");
    })
}
