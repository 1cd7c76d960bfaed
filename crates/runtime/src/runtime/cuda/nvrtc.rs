//! Compiling the kernels with NVRTC to a CUBIN for one exact architecture (never PTX: PTX
//! from a newer NVRTC does not load on an older driver — ../shared/FACTS.md), with what
//! ptxas reports about each kernel's resources, cached on disk by source, NVRTC version,
//! architecture and options.

use std::collections::HashMap;
use std::ffi::{CString, c_char, c_int, c_void};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use sha2::{Digest, Sha256};

use crate::runtime::libraries::{self, Found};

/// Options every kernel is compiled with (besides the architecture): ptxas reports each
/// kernel's registers, spills and shared memory in the log.
pub(crate) const OPTIONS: &[&str] = &["--ptxas-options=--verbose", "--std=c++17"];

/// `nvrtcResult` (nvrtc.h): 0 is `NVRTC_SUCCESS`.
type NvrtcResult = c_int;
/// `nvrtcProgram`: an opaque handle.
type Program = *mut c_void;

/// The entry points we call, with their nvrtc.h signatures; every one exists in NVRTC 12.0
/// through 13.0 (CUDA 13 removed only `nvrtcGetNVVM*`, which we do not use).
struct Api {
    version: unsafe extern "C" fn(*mut c_int, *mut c_int) -> NvrtcResult,
    get_error_string: unsafe extern "C" fn(NvrtcResult) -> *const c_char,
    create_program: unsafe extern "C" fn(
        *mut Program,
        *const c_char,
        *const c_char,
        c_int,
        *const *const c_char,
        *const *const c_char,
    ) -> NvrtcResult,
    destroy_program: unsafe extern "C" fn(*mut Program) -> NvrtcResult,
    compile_program: unsafe extern "C" fn(Program, c_int, *const *const c_char) -> NvrtcResult,
    get_program_log_size: unsafe extern "C" fn(Program, *mut usize) -> NvrtcResult,
    get_program_log: unsafe extern "C" fn(Program, *mut c_char) -> NvrtcResult,
    get_ptx_size: unsafe extern "C" fn(Program, *mut usize) -> NvrtcResult,
    get_ptx: unsafe extern "C" fn(Program, *mut c_char) -> NvrtcResult,
    get_cubin_size: unsafe extern "C" fn(Program, *mut usize) -> NvrtcResult,
    get_cubin: unsafe extern "C" fn(Program, *mut c_char) -> NvrtcResult,
}

/// NVRTC, opened from where it is installed (CUDA 13's `libnvrtc.so.13` or CUDA 12's
/// `libnvrtc.so.12`, [`crate::runtime::libraries`]) and bound by our own code.
pub struct Nvrtc {
    /// Where the library came from (`None`: the system loader's paths).
    pub path: Option<PathBuf>,
    /// The soname found (`libnvrtc.so.13`).
    pub soname: String,
    /// `libnvrtc-builtins.so.<major>.<minor>`, opened from NVRTC's own directory before any
    /// compile (CUDA 13's wheel has no RUNPATH, and NVRTC opens it by bare name), when it
    /// is there.
    pub builtins: Option<PathBuf>,
    /// `major.minor`.
    pub version: (i32, i32),
    api: Api,
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

/// Frees an NVRTC program when dropped.
struct ProgramGuard<'a>(&'a Api, Program);

impl Drop for ProgramGuard<'_> {
    fn drop(&mut self) {
        // SAFETY: the program was created by this API and is destroyed once, here.
        let _ = unsafe { (self.0.destroy_program)(&mut self.1) };
    }
}

impl Nvrtc {
    /// Opens NVRTC from `dirs` (then the system loader's paths): the newest soname that the
    /// driver, supporting CUDA `driver_cuda` (`None`: not known), can run
    /// ([`libraries::sonames_for_driver`]); binds its entry points; reads its version; and
    /// opens its builtins library from the same directory.
    ///
    /// Errors: NVRTC is not installed (the message names the pip package), an entry point
    /// missing (named).
    pub fn open(dirs: &[PathBuf], driver_cuda: Option<(i32, i32)>) -> Result<Nvrtc> {
        let (opened, shown) = libraries::open_for_driver(
            "NVRTC",
            "nvidia-cuda-nvrtc-cu12",
            libraries::NVRTC,
            dirs,
            driver_cuda,
            &|_| Vec::new(),
        )?;
        let library = opened.library;
        macro_rules! symbol {
            ($name:literal) => {
                // SAFETY: the type is the entry point's signature in nvrtc.h (12.0-13.0).
                *unsafe { library.get(concat!($name, "\0").as_bytes()) }
                    .with_context(|| format!("`{shown}` has no `{}`", $name))?
            };
        }
        let api = Api {
            version: symbol!("nvrtcVersion"),
            get_error_string: symbol!("nvrtcGetErrorString"),
            create_program: symbol!("nvrtcCreateProgram"),
            destroy_program: symbol!("nvrtcDestroyProgram"),
            compile_program: symbol!("nvrtcCompileProgram"),
            get_program_log_size: symbol!("nvrtcGetProgramLogSize"),
            get_program_log: symbol!("nvrtcGetProgramLog"),
            get_ptx_size: symbol!("nvrtcGetPTXSize"),
            get_ptx: symbol!("nvrtcGetPTX"),
            get_cubin_size: symbol!("nvrtcGetCUBINSize"),
            get_cubin: symbol!("nvrtcGetCUBIN"),
        };
        let (mut major, mut minor) = (0, 0);
        // SAFETY: bound above; the out-pointers are valid.
        let status = unsafe { (api.version)(&mut major, &mut minor) };
        if status != 0 {
            bail!("nvrtcVersion of `{shown}` failed (nvrtcResult {status})");
        }
        let builtins = open_builtins(opened.path.as_deref(), (major, minor))?;
        Ok(Nvrtc {
            path: opened.path,
            soname: opened.soname,
            builtins,
            version: (major, minor),
            api,
        })
    }

    /// Where NVRTC and its builtins came from, for `infer smoke`'s report.
    pub fn found(&self) -> Vec<Found> {
        let mut found = vec![Found {
            library: "NVRTC".into(),
            soname: self.soname.clone(),
            path: self.path.clone(),
        }];
        if let Some(path) = &self.builtins {
            found.push(Found {
                library: "NVRTC builtins".into(),
                soname: builtins_name(self.version),
                path: Some(path.clone()),
            });
        }
        found
    }

    /// NVRTC's text for `status`, with the code.
    fn error(&self, status: NvrtcResult) -> String {
        // SAFETY: NVRTC returns a static string (or null) for every result code.
        let text = unsafe { libraries::error_text((self.api.get_error_string)(status)) };
        format!("{text} (nvrtcResult {status})")
    }

    /// Reads one of a program's outputs through its size and copy entry points.
    fn output(
        &self,
        program: Program,
        what: &str,
        size: unsafe extern "C" fn(Program, *mut usize) -> NvrtcResult,
        copy: unsafe extern "C" fn(Program, *mut c_char) -> NvrtcResult,
    ) -> Result<Vec<u8>> {
        let mut len = 0usize;
        // SAFETY: `program` is live (the caller holds its guard); the out-pointer is valid.
        let status = unsafe { size(program, &mut len) };
        if status != 0 {
            bail!("nvrtcGet{what}Size failed: {}", self.error(status));
        }
        let mut bytes = vec![0u8; len.max(1)];
        // SAFETY: `bytes` holds the size NVRTC just reported.
        let status = unsafe { copy(program, bytes.as_mut_ptr().cast()) };
        if status != 0 {
            bail!("nvrtcGet{what} failed: {}", self.error(status));
        }
        bytes.truncate(len);
        Ok(bytes)
    }

    /// Compiles `source` (named `name` in messages) for `sm_<arch>` (`80`, `90`).
    ///
    /// Errors: a compilation error (NVRTC's log in the message), an architecture this NVRTC
    /// does not know.
    pub fn compile(&self, name: &str, source: &str, arch: u32) -> Result<Compiled> {
        let source_c = CString::new(source).context("a kernel source has a NUL byte")?;
        let name_c = CString::new(name).context("a kernel name has a NUL byte")?;
        let mut program: Program = std::ptr::null_mut();
        // SAFETY: the strings are NUL-terminated and outlive the call; no headers.
        let status = unsafe {
            (self.api.create_program)(
                &mut program,
                source_c.as_ptr(),
                name_c.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            )
        };
        if status != 0 {
            bail!("nvrtcCreateProgram({name}) failed: {}", self.error(status));
        }
        let guard = ProgramGuard(&self.api, program);
        let mut options: Vec<String> = vec![format!("--gpu-architecture=sm_{arch}")];
        options.extend(OPTIONS.iter().map(|o| o.to_string()));
        let options_c: Vec<CString> = options
            .iter()
            .map(|o| CString::new(o.as_str()))
            .collect::<std::result::Result<_, _>>()
            .context("an NVRTC option has a NUL byte")?;
        let pointers: Vec<*const c_char> = options_c.iter().map(|o| o.as_ptr()).collect();
        // SAFETY: the program is live; `pointers` holds `options_c.len()` valid C strings.
        let compiled = unsafe {
            (self.api.compile_program)(guard.1, pointers.len() as c_int, pointers.as_ptr())
        };
        let log = self
            .output(
                guard.1,
                "ProgramLog",
                self.api.get_program_log_size,
                self.api.get_program_log,
            )
            .map(|bytes| c_bytes_to_string(&bytes))
            .unwrap_or_default();
        if compiled != 0 {
            bail!(
                "NVRTC could not compile `{name}` for sm_{arch} ({}):\n{log}",
                self.error(compiled)
            );
        }
        let ptx = c_bytes_to_string(&self.output(
            guard.1,
            "PTX",
            self.api.get_ptx_size,
            self.api.get_ptx,
        )?);
        let cubin = self.output(
            guard.1,
            "CUBIN",
            self.api.get_cubin_size,
            self.api.get_cubin,
        )?;
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
pub(crate) fn cache_key(source: &str, version: (i32, i32), arch: u32) -> String {
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

/// The text of a NUL-terminated byte buffer from NVRTC.
fn c_bytes_to_string(bytes: &[u8]) -> String {
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    String::from_utf8_lossy(&bytes[..end]).into_owned()
}

/// `libnvrtc-builtins.so.<major>.<minor>`, the library NVRTC `version` opens by bare name
/// during a compile.
fn builtins_name(version: (i32, i32)) -> String {
    format!("libnvrtc-builtins.so.{}.{}", version.0, version.1)
}

/// Opens NVRTC's builtins from the directory of `nvrtc` (when NVRTC came from a directory
/// and the builtins are there), so that NVRTC's own `dlopen` of the bare name finds them
/// loaded (glibc matches a loaded library by its soname). `None`: NVRTC came from the
/// system loader's paths, which find its builtins too, or its directory has none (the
/// first compile then says what NVRTC could not open).
///
/// Errors: the builtins exist but do not load.
fn open_builtins(nvrtc: Option<&Path>, version: (i32, i32)) -> Result<Option<PathBuf>> {
    let Some(dir) = nvrtc.and_then(Path::parent) else {
        return Ok(None);
    };
    let path = dir.join(builtins_name(version));
    if !path.is_file() {
        return Ok(None);
    }
    libraries::open_first(&[&builtins_name(version)], &[dir.to_path_buf()], &|_| {
        Vec::new()
    })
    .map(|opened| opened.path)
}

/// Each kernel's resources from ptxas' verbose lines:
/// `Compiling entry function 'NAME' for 'sm_80'`, `N bytes stack frame, N bytes spill
/// stores, N bytes spill loads`, `Used N registers, … N bytes smem, …`.
pub(crate) fn parse_ptxas_log(log: &str) -> HashMap<String, Resources> {
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
