//! The NCCL library a process on this host would load, and its version: `libnccl.so.2`
//! found as the dynamic loader finds it (`LD_LIBRARY_PATH`, then the directories of
//! `/etc/ld.so.conf` and its includes, then the default `/lib` and `/usr/lib` trees), else
//! a pip wheel's `nvidia/nccl/lib` (which PyTorch preloads), and `ncclGetVersion` read by
//! loading it.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The library's file name: what `libnccl.so` links against and what pip ships.
pub(crate) const LIBRARY: &str = "libnccl.so.2";

/// Where NCCL was found and what it says it is.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NcclLibrary {
    /// The file found.
    pub path: String,
    /// `major.minor.patch` from `ncclGetVersion`; `None` when it could not be read.
    pub version: Option<String>,
    /// Why the version could not be read.
    pub error: Option<String>,
}

/// The NCCL library this host would load, if any.
pub(crate) fn find() -> Option<NcclLibrary> {
    let path = search_path()
        .into_iter()
        .map(|d| d.join(LIBRARY))
        .find(|p| p.is_file())?;
    let (version, error) = match read_version(&path) {
        Ok(version) => (Some(version), None),
        Err(error) => (None, Some(error)),
    };
    Some(NcclLibrary {
        path: path.display().to_string(),
        version,
        error,
    })
}

/// `ncclGetVersion`'s code as `major.minor.patch` (codes ≥ 2.9 are
/// `major·10000 + minor·100 + patch`, older ones `major·1000 + minor·100 + patch`; NCCL's
/// `nccl.h`, `NCCL_VERSION_CODE`).
pub(crate) fn decode_version(code: i32) -> String {
    if code >= 10000 {
        format!("{}.{}.{}", code / 10000, (code % 10000) / 100, code % 100)
    } else {
        format!("{}.{}.{}", code / 1000, (code % 1000) / 100, code % 100)
    }
}

fn read_version(path: &Path) -> Result<String, String> {
    // SAFETY: loading a library runs its initialisers; this is the library every NCCL
    // program on this host would load, so loading it is what those programs do.
    // `ncclGetVersion(int*)` only writes the version code.
    unsafe {
        let library = libloading::Library::new(path).map_err(|e| e.to_string())?;
        let get: libloading::Symbol<unsafe extern "C" fn(*mut i32) -> i32> = library
            .get(b"ncclGetVersion\0")
            .map_err(|e| format!("no `ncclGetVersion`: {e}"))?;
        let mut code = 0i32;
        match get(&mut code) {
            0 => Ok(decode_version(code)),
            status => Err(format!("`ncclGetVersion` returned {status}")),
        }
    }
}

/// The directories searched, in order.
fn search_path() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::env::var("LD_LIBRARY_PATH")
        .unwrap_or_default()
        .split(':')
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
        .collect();
    let mut seen = Vec::new();
    ld_so_conf(Path::new("/etc/ld.so.conf"), &mut dirs, &mut seen);
    for default in ["/lib", "/usr/lib", "/lib64", "/usr/lib64"] {
        dirs.push(default.into());
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_default();
    let mut site: Vec<PathBuf> = Vec::new();
    for root in [
        home.join(".local/lib"),
        "/usr/local/lib".into(),
        "/usr/lib".into(),
    ] {
        if let Ok(entries) = std::fs::read_dir(&root) {
            for entry in entries.flatten() {
                if entry.file_name().to_string_lossy().starts_with("python3") {
                    site.push(entry.path().join("site-packages/nvidia/nccl/lib"));
                    site.push(entry.path().join("dist-packages/nvidia/nccl/lib"));
                }
            }
        }
    }
    site.sort();
    dirs.extend(site);
    dirs
}

/// The directories of an `ld.so.conf`, following `include` globs (`*` in the file name).
fn ld_so_conf(file: &Path, dirs: &mut Vec<PathBuf>, seen: &mut Vec<PathBuf>) {
    if seen.contains(&file.to_path_buf()) || seen.len() > 64 {
        return;
    }
    seen.push(file.to_path_buf());
    let Ok(text) = std::fs::read_to_string(file) else {
        return;
    };
    for line in text
        .lines()
        .map(|l| l.split('#').next().unwrap_or("").trim())
    {
        if let Some(pattern) = line.strip_prefix("include").map(str::trim) {
            let pattern = Path::new(pattern);
            let (Some(parent), Some(name)) = (pattern.parent(), pattern.file_name()) else {
                continue;
            };
            let name = name.to_string_lossy();
            let (prefix, suffix) = name.split_once('*').unwrap_or((&name, ""));
            let mut matches: Vec<PathBuf> = std::fs::read_dir(parent)
                .map(|entries| {
                    entries
                        .flatten()
                        .map(|e| e.path())
                        .filter(|p| {
                            p.file_name().is_some_and(|n| {
                                let n = n.to_string_lossy();
                                n.starts_with(prefix) && n.ends_with(suffix)
                            })
                        })
                        .collect()
                })
                .unwrap_or_default();
            matches.sort();
            for included in matches {
                ld_so_conf(&included, dirs, seen);
            }
        } else if line.starts_with('/') {
            dirs.push(PathBuf::from(line));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_codes_decode_both_ways() {
        assert_eq!(decode_version(22105), "2.21.5");
        assert_eq!(decode_version(21803), "2.18.3");
        assert_eq!(decode_version(2804), "2.8.4");
    }

    #[test]
    fn ld_so_conf_includes_are_followed() {
        let dir = tempfile::tempdir().expect("temp dir");
        let conf_d = dir.path().join("conf.d");
        std::fs::create_dir(&conf_d).expect("mkdir");
        std::fs::write(conf_d.join("b.conf"), "/opt/b\n# comment\n").expect("write");
        std::fs::write(conf_d.join("a.conf"), "/opt/a # trailing\n").expect("write");
        std::fs::write(conf_d.join("skip.txt"), "/opt/never\n").expect("write");
        let main = dir.path().join("ld.so.conf");
        std::fs::write(
            &main,
            format!("include {}/*.conf\n/opt/main\n", conf_d.display()),
        )
        .expect("write");
        let (mut dirs, mut seen) = (Vec::new(), Vec::new());
        ld_so_conf(&main, &mut dirs, &mut seen);
        assert_eq!(
            dirs,
            [PathBuf::from("/opt/a"), "/opt/b".into(), "/opt/main".into()]
        );
    }
}
