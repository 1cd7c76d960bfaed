//! Compiling the kernels with NVRTC to a CUBIN for one exact architecture (never PTX: PTX
//! from a newer NVRTC does not load on an older driver — ../shared/FACTS.md), with what
//! ptxas reports about each kernel's resources, cached on disk by source, NVRTC version,
//! architecture and options.

use std::collections::HashMap;
use std::ffi::CString;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use sha2::{Digest, Sha256};

use cudarc::nvrtc::{result, sys};

/// Options every kernel is compiled with (besides the architecture): ptxas reports each
/// kernel's registers, spills and shared memory in the log.
pub const OPTIONS: &[&str] = &["--ptxas-options=--verbose", "--std=c++17"];

/// NVRTC, opened from where it is installed ([`super::libraries::open_nvrtc`]).
pub struct Nvrtc {
    /// Where the library came from (`None`: the system loader's paths).
    pub path: Option<PathBuf>,
    /// `major.minor`.
    pub version: (i32, i32),
}

/// What ptxas reports about one kernel.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Resources {
    pub registers: u32,
    pub spill_store_bytes: u32,
    pub spill_load_bytes: u32,
    pub stack_frame_bytes: u32,
    /// Static shared memory, bytes.
    pub shared_bytes: u32,
}

/// One family compiled for one architecture.
pub struct Compiled {
    /// The CUBIN (an ELF the driver loads with `cuModuleLoadData`).
    pub cubin: Vec<u8>,
    /// The PTX of the same compilation (its `.entry` lines name the parameters).
    pub ptx: String,
    /// Per kernel name.
    pub resources: HashMap<String, Resources>,
    /// NVRTC's log (ptxas' lines included).
    pub log: String,
}

impl Nvrtc {
    /// Opens NVRTC from `dirs` (then the system loader's paths).
    ///
    /// Errors: NVRTC is not installed (the message names the pip package).
    pub fn open(dirs: &[PathBuf]) -> Result<Nvrtc> {
        let path = super::libraries::open_nvrtc(dirs)?;
        let (mut major, mut minor) = (0, 0);
        // SAFETY: NVRTC is loaded (above); the out-pointers are valid.
        unsafe { sys::nvrtcVersion(&mut major, &mut minor) }
            .result()
            .map_err(|e| anyhow::anyhow!("nvrtcVersion failed: {e:?}"))?;
        Ok(Nvrtc {
            path,
            version: (major, minor),
        })
    }

    /// Compiles `source` (named `name` in messages) for `sm_<arch>` (`80`, `90`).
    ///
    /// Errors: a compilation error (NVRTC's log in the message), an architecture this NVRTC
    /// does not know.
    pub fn compile(&self, name: &str, source: &str, arch: u32) -> Result<Compiled> {
        let source_c = CString::new(source).context("a kernel source has a NUL byte")?;
        let name_c = CString::new(name).context("a kernel name has a NUL byte")?;
        let program = result::create_program(&source_c, Some(&name_c))
            .map_err(|e| anyhow::anyhow!("nvrtcCreateProgram({name}) failed: {e:?}"))?;
        let mut options: Vec<String> = vec![format!("--gpu-architecture=sm_{arch}")];
        options.extend(OPTIONS.iter().map(|o| o.to_string()));
        // SAFETY: `program` was created above and is destroyed below, once.
        let compiled = unsafe { result::compile_program(program, &options) };
        let log = unsafe { result::get_program_log(program) }
            .map(|chars| c_chars_to_string(&chars))
            .unwrap_or_default();
        let outputs = compiled
            .map_err(|e| anyhow::anyhow!("{e:?}"))
            .and_then(|()| {
                let ptx = unsafe { result::get_ptx(program) }
                    .map(|chars| c_chars_to_string(&chars))
                    .map_err(|e| anyhow::anyhow!("nvrtcGetPTX failed: {e:?}"))?;
                let mut size = 0usize;
                unsafe { sys::nvrtcGetCUBINSize(program, &mut size) }
                    .result()
                    .map_err(|e| anyhow::anyhow!("nvrtcGetCUBINSize failed: {e:?}"))?;
                let mut cubin = vec![0u8; size];
                unsafe { sys::nvrtcGetCUBIN(program, cubin.as_mut_ptr().cast()) }
                    .result()
                    .map_err(|e| anyhow::anyhow!("nvrtcGetCUBIN failed: {e:?}"))?;
                Ok((ptx, cubin))
            });
        // SAFETY: created above, not destroyed before.
        let _ = unsafe { result::destroy_program(program) };
        let (ptx, cubin) = match outputs {
            Ok(outputs) => outputs,
            Err(error) => bail!("NVRTC could not compile `{name}` for sm_{arch} ({error}):\n{log}"),
        };
        Ok(Compiled {
            cubin,
            ptx,
            resources: parse_ptxas_log(&log),
            log,
        })
    }

    /// [`Nvrtc::compile`] through a cache in `dir`: the CUBIN is stored under the hash of the
    /// source, this NVRTC's version, the architecture and the options; a hit skips NVRTC.
    /// Returns the CUBIN and whether it came from the cache.
    ///
    /// Errors: as [`Nvrtc::compile`]; an unwritable cache directory.
    pub fn compile_cached(
        &self,
        dir: &Path,
        name: &str,
        source: &str,
        arch: u32,
    ) -> Result<(Vec<u8>, bool)> {
        let key = cache_key(source, self.version, arch);
        let path = dir.join(format!("{key}.cubin"));
        if let Ok(cubin) = std::fs::read(&path) {
            return Ok((cubin, true));
        }
        let compiled = self.compile(name, source, arch)?;
        std::fs::create_dir_all(dir)
            .with_context(|| format!("cannot create the kernel cache `{}`", dir.display()))?;
        let temporary = dir.join(format!("{key}.cubin.tmp{}", std::process::id()));
        std::fs::write(&temporary, &compiled.cubin)
            .and_then(|()| std::fs::rename(&temporary, &path))
            .with_context(|| format!("cannot write `{}`", path.display()))?;
        Ok((compiled.cubin, false))
    }
}

/// The cache key of `source` compiled by NVRTC `version` for `sm_<arch>` with [`OPTIONS`].
pub fn cache_key(source: &str, version: (i32, i32), arch: u32) -> String {
    let mut hash = Sha256::new();
    hash.update(source.as_bytes());
    hash.update(format!(
        "\0nvrtc {}.{}\0sm_{arch}\0{}",
        version.0,
        version.1,
        OPTIONS.join(" ")
    ));
    hash.finalize()
        .iter()
        .take(16)
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn c_chars_to_string(chars: &[std::ffi::c_char]) -> String {
    let bytes: Vec<u8> = chars
        .iter()
        .map(|&c| c as u8)
        .take_while(|&b| b != 0)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Each kernel's resources from ptxas' verbose lines:
/// `Compiling entry function 'NAME' for 'sm_80'`, `N bytes stack frame, N bytes spill
/// stores, N bytes spill loads`, `Used N registers, … N bytes smem, …`.
pub fn parse_ptxas_log(log: &str) -> HashMap<String, Resources> {
    let mut out: HashMap<String, Resources> = HashMap::new();
    let mut current: Option<String> = None;
    let number_before = |line: &str, unit: &str| -> Option<u32> {
        let at = line.find(unit)?;
        line[..at].split_whitespace().last()?.parse().ok()
    };
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let name = rest.split('\'').next().unwrap_or_default().to_string();
            out.entry(name.clone()).or_default();
            current = Some(name);
            continue;
        }
        let Some(entry) = current.as_ref().and_then(|name| out.get_mut(name)) else {
            continue;
        };
        if line.contains("bytes stack frame") {
            entry.stack_frame_bytes = number_before(line, "bytes stack frame").unwrap_or(0);
            entry.spill_store_bytes = number_before(line, "bytes spill stores").unwrap_or(0);
            entry.spill_load_bytes = number_before(line, "bytes spill loads").unwrap_or(0);
        }
        if line.contains("Used ") && line.contains(" registers") {
            entry.registers = number_before(line, "registers").unwrap_or(0);
            entry.shared_bytes = number_before(line, "bytes smem").unwrap_or(0);
        }
    }
    out
}

/// The parameter types of every `.entry` in `ptx`, by kernel name (`u64`, `u32`, `f32`).
pub fn ptx_entries(ptx: &str) -> HashMap<String, Vec<String>> {
    let mut out = HashMap::new();
    let mut lines = ptx.lines();
    while let Some(line) = lines.next() {
        let Some(rest) = line.trim().strip_prefix(".visible .entry ") else {
            continue;
        };
        let name = rest
            .split('(')
            .next()
            .unwrap_or_default()
            .trim()
            .to_string();
        let mut params = Vec::new();
        for line in lines.by_ref() {
            let line = line.trim();
            if let Some(param) = line.strip_prefix(".param .") {
                params.push(
                    param
                        .split_whitespace()
                        .next()
                        .unwrap_or_default()
                        .to_string(),
                );
            }
            if line.starts_with(')') || line.ends_with(')') {
                break;
            }
        }
        out.insert(name, params);
    }
    out
}
