//! The host harness: the same kernel sources ([`super::kernels::FAMILIES`]) compiled by the
//! system's C++ compiler against `host_prelude.h` (CUDA's built-ins on the CPU: a block's
//! threads as fibers that switch at `__syncthreads` on x86-64, or as OS threads meeting at a
//! barrier under the sanitizers and elsewhere; `__dp4a` and friends in plain C++), so the
//! kernels' arithmetic is checked against the CPU backend here, without a GPU. It checks what
//! a kernel computes, not how fast or how it uses the memory hierarchy (`infer smoke` runs
//! them on the GPU).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

use anyhow::{Context, Result, bail};
use sha2::{Digest, Sha256};

use super::kernels::{FAMILIES, Kernel, Param};

const PRELUDE: &str = include_str!("host_prelude.h");

/// The harness library's file name.
const LIBRARY: &str = "libinfer_host_kernels.so";

/// One kernel argument.
#[derive(Clone, Copy, Debug)]
pub enum HostArg {
    /// A pointer to host memory standing for device memory.
    Ptr(*mut u8),
    U32(u32),
    F32(f32),
}

/// A sanitizer the harness can be built with: AddressSanitizer finds reads and writes
/// outside a kernel's buffers, ThreadSanitizer races between a block's threads (a missing
/// `__syncthreads`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sanitizer {
    Address,
    Thread,
}

impl Sanitizer {
    fn flag(self) -> &'static str {
        match self {
            Sanitizer::Address => "-fsanitize=address",
            Sanitizer::Thread => "-fsanitize=thread",
        }
    }

    /// The runtime library a process must preload to load a library built with it (GCC's
    /// name; `c++ -print-file-name=<it>` gives its path).
    pub fn runtime(self) -> &'static str {
        match self {
            Sanitizer::Address => "libasan.so",
            Sanitizer::Thread => "libtsan.so",
        }
    }
}

/// The kernels compiled for the host and loaded.
pub struct HostKernels {
    library: libloading::Library,
    /// Where the sources and the library were written.
    pub dir: PathBuf,
}

/// One grid at a time: `__shared__` arrays are function statics in the harness.
static LAUNCH: Mutex<()> = Mutex::new(());

type Launcher = unsafe extern "C" fn(*const u32, *const u32, *const *mut std::ffi::c_void);

impl HostKernels {
    /// Writes every family with its launchers into `dir`, compiles them with `compiler`
    /// (`c++`, or the caller's `$CXX`) as C++20 into one shared library and loads it.
    ///
    /// Errors: no C++ compiler, a kernel source the harness cannot compile (the compiler's
    /// output), a library that does not load.
    pub fn build(dir: &Path, compiler: &str) -> Result<HostKernels> {
        let sources: Vec<(&str, String)> =
            FAMILIES.iter().map(|f| (f.file, f.full_source())).collect();
        HostKernels::build_from(dir, compiler, None, &sources)
    }

    /// [`HostKernels::build`] from given sources (`(family file, full source)`: the tests
    /// plant bugs this way) and, with `sanitizer`, instrumented by it: such a library loads
    /// only into a process that starts with the sanitizer's runtime
    /// ([`Sanitizer::runtime`], `LD_PRELOAD`).
    ///
    /// Errors: those of [`HostKernels::build`], a file that is not a kernel family.
    pub fn build_from(
        dir: &Path,
        compiler: &str,
        sanitizer: Option<Sanitizer>,
        sources: &[(&str, String)],
    ) -> Result<HostKernels> {
        let library = HostKernels::compile(dir, compiler, sanitizer, sources)?;
        HostKernels::load(dir, &library)
    }

    /// [`HostKernels::build`] once per set of kernels: the library is kept in
    /// `cache_dir/host-<key>/`, the key hashing the prelude, every family's source and the
    /// compiler's name, and later processes load it from there. Processes building at once
    /// (the ranks of one gang) each build in a directory of their own; the first rename wins
    /// and the others load the winner's.
    ///
    /// Errors: those of [`HostKernels::build`], an unwritable cache directory.
    pub fn build_cached(cache_dir: &Path, compiler: &str) -> Result<HostKernels> {
        let sources: Vec<(&str, String)> =
            FAMILIES.iter().map(|f| (f.file, f.full_source())).collect();
        let mut hash = Sha256::new();
        hash.update(PRELUDE.as_bytes());
        for (file, source) in &sources {
            hash.update(format!("\0{file}\0").as_bytes());
            hash.update(source.as_bytes());
        }
        hash.update(format!("\0{compiler}").as_bytes());
        let key: String = hash
            .finalize()
            .iter()
            .take(16)
            .map(|b| format!("{b:02x}"))
            .collect();
        let dir = cache_dir.join(format!("host-{key}"));
        let library = dir.join(LIBRARY);
        if !library.is_file() {
            let scratch = cache_dir.join(format!("host-{key}.tmp{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&scratch);
            HostKernels::compile(&scratch, compiler, None, &sources)?;
            // Another process's rename may have won: its library is the same.
            if std::fs::rename(&scratch, &dir).is_err() {
                let _ = std::fs::remove_dir_all(&scratch);
            }
        }
        HostKernels::load(&dir, &library)
    }

    /// Loads a library [`HostKernels::compile`] built in `dir`.
    fn load(dir: &Path, library: &Path) -> Result<HostKernels> {
        // SAFETY: the library was built from our sources; loading runs no user code.
        let library = unsafe { libloading::Library::new(library) }
            .with_context(|| format!("cannot load `{}`", library.display()))?;
        Ok(HostKernels {
            library,
            dir: dir.to_path_buf(),
        })
    }

    /// Writes the sources with their launchers into `dir` and compiles them into
    /// [`LIBRARY`] there; returns its path.
    fn compile(
        dir: &Path,
        compiler: &str,
        sanitizer: Option<Sanitizer>,
        sources: &[(&str, String)],
    ) -> Result<PathBuf> {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("cannot create `{}`", dir.display()))?;
        std::fs::write(dir.join("host_prelude.h"), PRELUDE)?;
        let mut units = Vec::new();
        for (file, source) in sources {
            let family = FAMILIES
                .iter()
                .find(|f| f.file == *file)
                .with_context(|| format!("`{file}` is not a kernel family"))?;
            let mut unit = format!("#include \"host_prelude.h\"\n{source}\n");
            for kernel in family.kernels {
                unit.push_str(&launcher(kernel));
            }
            let path = dir.join(format!("{}.cpp", family.file.trim_end_matches(".cu")));
            std::fs::write(&path, unit)?;
            units.push(path);
        }
        let library = dir.join(LIBRARY);
        let mut command = Command::new(compiler);
        // A process that preloads a sanitizer's runtime (to load the library this builds)
        // must not hand it to the compiler, which it slows several times over.
        command.env_remove("LD_PRELOAD");
        command.args(["-std=c++20", "-O2", "-shared", "-fPIC", "-pthread"]);
        if let Some(sanitizer) = sanitizer {
            // Real threads a block, which the sanitizers follow (they do not follow the
            // fibers' stack switches).
            command.args([
                sanitizer.flag(),
                "-g",
                "-fno-omit-frame-pointer",
                "-DHARNESS_OS_THREADS",
            ]);
        }
        let output = command
            .arg("-o")
            .arg(&library)
            .args(&units)
            .output()
            .with_context(|| {
                format!("the host harness needs a C++20 compiler: `{compiler}` did not run (`apt-get install g++`)")
            })?;
        if !output.status.success() {
            bail!(
                "`{compiler}` could not compile the kernels for the host:\n{}",
                String::from_utf8_lossy(&output.stderr)
            );
        }
        Ok(library)
    }

    /// Runs kernel `name` over `grid` × `block` threads with `args`.
    ///
    /// Errors: an unknown kernel, arguments that are not its parameters (count and kinds).
    ///
    /// # Safety
    /// Every pointer must point at memory large enough for what the kernel reads and
    /// writes at these grid and block sizes, as on a GPU.
    pub unsafe fn launch(
        &self,
        name: &str,
        grid: [u32; 3],
        block: [u32; 3],
        args: &[HostArg],
    ) -> Result<()> {
        let kernel = FAMILIES
            .iter()
            .flat_map(|f| f.kernels)
            .find(|k| k.name == name)
            .with_context(|| format!("no kernel `{name}`"))?;
        let kinds: Vec<Param> = args
            .iter()
            .map(|a| match a {
                HostArg::Ptr(_) => Param::Ptr,
                HostArg::U32(_) => Param::U32,
                HostArg::F32(_) => Param::F32,
            })
            .collect();
        if kinds != kernel.params {
            bail!("`{name}` takes {:?}, given {kinds:?}", kernel.params);
        }
        // Each argument's value, addressed as the launcher reads it (CUDA's `void** args`).
        let mut values: Vec<[u8; 8]> = args
            .iter()
            .map(|a| {
                let mut v = [0u8; 8];
                match *a {
                    HostArg::Ptr(p) => v.copy_from_slice(&(p as usize as u64).to_ne_bytes()),
                    HostArg::U32(x) => v[..4].copy_from_slice(&x.to_ne_bytes()),
                    HostArg::F32(x) => v[..4].copy_from_slice(&x.to_ne_bytes()),
                }
                v
            })
            .collect();
        let pointers: Vec<*mut std::ffi::c_void> =
            values.iter_mut().map(|v| v.as_mut_ptr().cast()).collect();
        let symbol = format!("infer_host_launch_{name}");
        // SAFETY: the symbol was generated by `launcher` with this signature.
        let launch: libloading::Symbol<Launcher> =
            unsafe { self.library.get(symbol.as_bytes()) }
                .with_context(|| format!("`{symbol}` is missing from the harness"))?;
        let _one_at_a_time = LAUNCH.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: the arguments match the kernel's parameters (checked above); the caller
        // vouches for the memory.
        unsafe { launch(grid.as_ptr(), block.as_ptr(), pointers.as_ptr()) };
        Ok(())
    }
}

/// The C++ launcher of `kernel`: reads each argument from CUDA-style `void** args` and runs
/// the kernel over the grid.
fn launcher(kernel: &Kernel) -> String {
    let args: Vec<String> = kernel
        .params
        .iter()
        .enumerate()
        .map(|(i, p)| match p {
            Param::Ptr => format!("InferHostPtr{{*(void**)args[{i}]}}"),
            Param::U32 => format!("*(unsigned int*)args[{i}]"),
            Param::F32 => format!("*(float*)args[{i}]"),
        })
        .collect();
    format!(
        "extern \"C\" void infer_host_launch_{name}(const unsigned int* grid, const unsigned int* block, void** args) {{\n    \
         infer_host_run(grid, block, [&] {{ {name}({args}); }});\n}}\n",
        name = kernel.name,
        args = args.join(", ")
    )
}

impl super::checks::Runner for HostKernels {
    fn launch(
        &self,
        kernel: &str,
        grid: [u32; 3],
        block: [u32; 3],
        args: &mut [super::checks::Arg<'_>],
    ) -> Result<()> {
        use super::checks::Arg;
        // Each buffer copied into host memory aligned as device memory is (the kernels'
        // 16-byte vector loads assume it), and the outputs copied back after.
        let mut copies = Vec::new();
        for arg in args.iter() {
            let bytes: &[u8] = match arg {
                Arg::In(bytes) => bytes,
                Arg::Out(bytes) => bytes,
                Arg::U32(_) | Arg::F32(_) => continue,
            };
            copies.push(super::backend::Device::upload(self, bytes)?);
        }
        let mut next = 0;
        let host_args: Vec<HostArg> = args
            .iter()
            .map(|arg| match arg {
                Arg::In(_) | Arg::Out(_) => {
                    next += 1;
                    HostArg::Ptr(copies[next - 1].ptr.as_ptr())
                }
                Arg::U32(v) => HostArg::U32(*v),
                Arg::F32(v) => HostArg::F32(*v),
            })
            .collect();
        // SAFETY: every buffer is a live copy sized by the check for its grid, as device
        // buffers would be.
        unsafe { HostKernels::launch(self, kernel, grid, block, &host_args)? };
        let mut copied = copies.iter();
        for arg in args.iter_mut() {
            match arg {
                Arg::In(_) => {
                    copied.next();
                }
                Arg::Out(bytes) => {
                    if let Some(copy) = copied.next() {
                        bytes.copy_from_slice(&copy.bytes()[..bytes.len()]);
                    }
                }
                Arg::U32(_) | Arg::F32(_) => {}
            }
        }
        Ok(())
    }
}

/// Host memory standing for device memory: 64-byte aligned, zeroed, written by the kernels
/// through its pointer.
pub struct HostBuffer {
    ptr: std::ptr::NonNull<u8>,
    layout: std::alloc::Layout,
}

impl HostBuffer {
    /// A zeroed buffer of `len_bytes` (at least one byte is allocated).
    pub(crate) fn zeroed(len_bytes: usize) -> Result<HostBuffer> {
        let layout = std::alloc::Layout::from_size_align(len_bytes.max(1), 64)
            .with_context(|| format!("cannot lay out {len_bytes} bytes"))?;
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = std::ptr::NonNull::new(raw)
            .with_context(|| format!("out of memory allocating {len_bytes} bytes"))?;
        Ok(HostBuffer { ptr, layout })
    }

    /// The allocation's size in bytes.
    pub fn len(&self) -> usize {
        self.layout.size()
    }

    /// Whether the buffer is empty (never: at least one byte is allocated).
    pub fn is_empty(&self) -> bool {
        false
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: `ptr` owns `layout.size()` initialised bytes; no kernel runs while the
        // caller holds this slice (launches are synchronous on the host).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.layout.size()) }
    }
}

// SAFETY: the buffer owns its allocation outright (no aliasing handle escapes but through
// `&self` launches, which the harness runs one at a time).
unsafe impl Send for HostBuffer {}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with this layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

impl super::backend::Device for HostKernels {
    type Buffer = HostBuffer;

    fn name(&self) -> String {
        "the host harness (CUDA kernels on CPU threads)".into()
    }

    fn alloc(&self, len_bytes: usize) -> Result<HostBuffer> {
        HostBuffer::zeroed(len_bytes)
    }

    fn upload(&self, bytes: &[u8]) -> Result<HostBuffer> {
        let buffer = HostBuffer::zeroed(bytes.len())?;
        // SAFETY: the buffer holds at least `bytes.len()` bytes and is not shared yet.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), buffer.ptr.as_ptr(), bytes.len()) };
        Ok(buffer)
    }

    fn download(&self, buffer: &HostBuffer, len_bytes: usize) -> Result<Vec<u8>> {
        match buffer.bytes().get(..len_bytes) {
            Some(bytes) => Ok(bytes.to_vec()),
            None => bail!("{len_bytes} bytes asked of a {}-byte buffer", buffer.len()),
        }
    }

    fn launch(
        &self,
        kernel: &str,
        grid: [u32; 3],
        block: [u32; 3],
        args: &[super::backend::DeviceArg<'_, HostBuffer>],
    ) -> Result<()> {
        use super::backend::DeviceArg;
        let host_args: Vec<HostArg> = args
            .iter()
            .map(|arg| match arg {
                DeviceArg::Buffer(buffer) => HostArg::Ptr(buffer.ptr.as_ptr()),
                DeviceArg::U32(v) => HostArg::U32(*v),
                DeviceArg::F32(v) => HostArg::F32(*v),
            })
            .collect();
        // SAFETY: the backend sizes every buffer for the grid it launches, as on a GPU.
        unsafe { HostKernels::launch(self, kernel, grid, block, &host_args) }
    }

    fn has_gemm(&self) -> bool {
        true
    }

    /// cuBLAS does not run without a GPU: the harness's GEMM is a plain loop with what
    /// `cublasGemmEx` is asked for on one (inputs of `ty`, f32 accumulation and output),
    /// so the dequantize and convert kernels and the backend's GEMM path are checked here.
    fn gemm(&self, gemm: super::backend::Gemm<'_, HostBuffer>) -> Result<()> {
        use super::backend::GemmType;
        gemm.check_sizes(HostBuffer::len)?;
        let decode = |bytes: &[u8], n: usize| -> Vec<f32> {
            match gemm.ty {
                GemmType::F32 => bytes[..n * 4]
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect(),
                GemmType::F16 => bytes[..n * 2]
                    .chunks_exact(2)
                    .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                    .collect(),
                GemmType::Bf16 => bytes[..n * 2]
                    .chunks_exact(2)
                    .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                    .collect(),
            }
        };
        let (n_tokens, n_rows, n_cols) = (gemm.n_tokens, gemm.n_rows, gemm.n_cols);
        let w = decode(gemm.w.bytes(), n_rows * n_cols);
        let x = decode(gemm.x.bytes(), n_tokens * n_cols);
        let y: Vec<f32> = x
            .chunks_exact(n_cols.max(1))
            .take(n_tokens)
            .flat_map(|xt| {
                w.chunks_exact(n_cols.max(1))
                    .take(n_rows)
                    .map(move |row| row.iter().zip(xt).map(|(a, b)| a * b).sum::<f32>())
            })
            .collect();
        // SAFETY: `y` holds at least n_tokens × n_rows f32 (checked above) and no kernel
        // runs while this writes (the harness's launches are synchronous).
        unsafe {
            std::ptr::copy_nonoverlapping(y.as_ptr().cast::<u8>(), gemm.y.ptr.as_ptr(), y.len() * 4)
        };
        Ok(())
    }
}
