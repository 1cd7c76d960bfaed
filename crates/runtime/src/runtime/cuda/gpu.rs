//! The kernels on a real GPU through cudarc: every family's CUBIN (NVRTC, cached) loaded
//! into a context on one device, and a [`Runner`] that copies a check's buffers to the
//! device, launches, and copies the results back. What `infer smoke` runs the op checks
//! with. Never run on silicon where this was written (no GPU there): the same checks run
//! on the host harness in the tests.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result, anyhow};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg,
};

use super::checks::{Arg, Runner};
use super::kernels::FAMILIES;
use super::nvrtc::Nvrtc;

/// Every kernel loaded on one GPU.
pub struct GpuRunner {
    _context: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    functions: HashMap<&'static str, CudaFunction>,
    /// The TP group's NCCL communicator, once joined ([`GpuRunner::join_nccl`]).
    nccl: Option<crate::runtime::collectives::nccl::Comm>,
    /// The pipeline's NCCL communicator (members in stage order), once joined.
    pp_nccl: Option<crate::runtime::collectives::nccl::Comm>,
    /// cuBLAS and a handle on this GPU's stream, once loaded ([`GpuRunner::load_cublas`]).
    blas: Option<(super::cublas::Cublas, super::cublas::Handle)>,
    /// What [`GpuRunner::load_cublas`] said ("" before it ran).
    gemm_line: String,
    /// Per-kernel GPU time, when `INFER_CUDA_PROFILE` is set ([`GpuRunner::profile`]).
    profile: Option<std::sync::Mutex<Profile>>,
}

/// GPU time per kernel, measured with a pair of CUDA events around each launch (and each
/// GEMM): the events pending, and the totals of those already read.
#[derive(Default)]
struct Profile {
    pending: Vec<(String, cudarc::driver::CudaEvent, cudarc::driver::CudaEvent)>,
    /// Name → (launches, milliseconds).
    totals: HashMap<String, (u64, f64)>,
}

impl Profile {
    /// Reads every pending pair's elapsed time into the totals (waiting for them).
    fn settle(&mut self) -> Result<()> {
        for (name, start, end) in self.pending.drain(..) {
            let ms = start
                .elapsed_ms(&end)
                .map_err(|e| anyhow!("cannot time `{name}`: {e:?}"))?;
            let entry = self.totals.entry(name).or_insert((0, 0.0));
            entry.0 += 1;
            entry.1 += f64::from(ms);
        }
        Ok(())
    }
}

impl GpuRunner {
    /// Compiles (or takes from `cache_dir`) every family for `sm_<arch>` and loads it on
    /// GPU `ordinal`. The driver must have been opened ([`super::device::probe`]).
    ///
    /// Errors: a compilation, module or function that fails to load (the driver's error).
    pub(crate) fn new(
        ordinal: usize,
        arch: u32,
        nvrtc: &Nvrtc,
        cache_dir: &Path,
    ) -> Result<GpuRunner> {
        let context = CudaContext::new(ordinal)
            .map_err(|e| anyhow!("cannot create a context on GPU {ordinal}: {e:?}"))?;
        // SAFETY: one stream — the context's default stream — carries every kernel, copy,
        // GEMM and NCCL call on this GPU, so stream order alone orders every use of every
        // buffer: cudarc's per-allocation events (two per buffer) add nothing but calls.
        unsafe { context.disable_event_tracking() };
        keep_freed_memory(&context);
        let stream = context.default_stream();
        let mut functions = HashMap::new();
        for family in FAMILIES {
            let (cubin, _) =
                nvrtc.compile_cached(cache_dir, family.file, &family.full_source(), arch)?;
            let module = context
                .load_module(cudarc::nvrtc::Ptx::from_binary(cubin))
                .map_err(|e| {
                    anyhow!(
                        "the driver cannot load {} for sm_{arch}: {e:?}",
                        family.file
                    )
                })?;
            for kernel in family.kernels {
                let function = module.load_function(kernel.name).map_err(|e| {
                    anyhow!("`{}` is not in {}'s CUBIN: {e:?}", kernel.name, family.file)
                })?;
                functions.insert(kernel.name, function);
            }
        }
        Ok(GpuRunner {
            _context: context,
            stream,
            functions,
            nccl: None,
            pp_nccl: None,
            blas: None,
            gemm_line: String::new(),
            profile: std::env::var_os(crate::envvars::CUDA_PROFILE)
                .filter(|v| !v.is_empty() && v != "0")
                .map(|_| std::sync::Mutex::new(Profile::default())),
        })
    }

    /// Runs `enqueue` between two timing events when profiling (`INFER_CUDA_PROFILE`), and
    /// books the pair under `name`.
    fn timed(&self, name: &str, enqueue: impl FnOnce() -> Result<()>) -> Result<()> {
        let Some(profile) = &self.profile else {
            return enqueue();
        };
        let event = || {
            self.stream
                .record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(|e| anyhow!("cannot record a timing event: {e:?}"))
        };
        let start = event()?;
        enqueue()?;
        let end = event()?;
        let mut profile = profile.lock().unwrap_or_else(|e| e.into_inner());
        profile.pending.push((name.to_string(), start, end));
        if profile.pending.len() >= 4096 {
            profile.settle()?;
        }
        Ok(())
    }

    /// GPU time per kernel since the runner was made, when `INFER_CUDA_PROFILE` was set:
    /// `(kernel, launches, milliseconds)`, the longest total first; `None` without it.
    ///
    /// Errors: the driver's (it waits for every timed launch).
    pub(crate) fn profile(&self) -> Result<Option<Vec<(String, u64, f64)>>> {
        let Some(profile) = &self.profile else {
            return Ok(None);
        };
        let mut profile = profile.lock().unwrap_or_else(|e| e.into_inner());
        profile.settle()?;
        let mut rows: Vec<(String, u64, f64)> = profile
            .totals
            .iter()
            .map(|(name, (calls, ms))| (name.clone(), *calls, *ms))
            .collect();
        rows.sort_by(|a, b| b.2.total_cmp(&a.2));
        Ok(Some(rows))
    }

    /// Joins an NCCL communicator with the other GPUs of `group` (whose host collectives
    /// carry the decision and the unique id; `host_key` tells this rank's host apart from
    /// the others'): for a TP group ([`GroupKind::Tp`]),
    /// [`super::backend::Device::all_reduce_sum_in_place`] then sums on the GPUs; for a
    /// pipeline ([`GroupKind::Pipeline`], members in stage order),
    /// [`super::backend::Device::send_to_stage`] and `recv_from_stage` pass hidden states
    /// between the GPUs. When NCCL cannot be used — a member found none in `lib_dirs` (or the
    /// loader's paths), two members share a GPU, or a member's init failed — every member
    /// keeps the host collectives. Returns the line that says which, a warning when NCCL is
    /// missing or failed.
    ///
    /// Errors: a lost member of `group`.
    ///
    /// [`GroupKind::Tp`]: crate::runtime::collectives::nccl::GroupKind::Tp
    /// [`GroupKind::Pipeline`]: crate::runtime::collectives::nccl::GroupKind::Pipeline
    pub(crate) fn join_nccl(
        &mut self,
        kind: crate::runtime::collectives::nccl::GroupKind,
        group: &mut dyn crate::runtime::collectives::Comm,
        lib_dirs: &[std::path::PathBuf],
        host_key: u64,
    ) -> Result<String> {
        let device = self._context.cu_device();
        let attribute = |a| {
            // SAFETY: `device` is this context's device.
            unsafe { cudarc::driver::result::device::get_attribute(device, a) }.unwrap_or(-1) as u32
        };
        use cudarc::driver::sys::CUdevice_attribute as A;
        let pci = (
            attribute(A::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID),
            attribute(A::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID),
            attribute(A::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID),
        );
        let context = Arc::clone(&self._context);
        let (comm, line) = crate::runtime::collectives::nccl::negotiate(
            kind,
            group,
            crate::runtime::collectives::nccl::Nccl::open(lib_dirs),
            host_key,
            pci,
            &mut |nccl, id, size, rank| {
                context.bind_to_thread().map_err(|e| anyhow!("{e:?}"))?;
                // SAFETY: this GPU's context is current on this thread.
                unsafe { nccl.init_rank(size, id, rank) }
            },
        )?;
        match kind {
            crate::runtime::collectives::nccl::GroupKind::Tp => self.nccl = comm,
            crate::runtime::collectives::nccl::GroupKind::Pipeline => self.pp_nccl = comm,
        }
        Ok(line)
    }
}

/// Sets the release threshold of `context`'s device's default memory pool to the maximum,
/// so that memory freed with `cuMemFreeAsync` stays in the pool for the next allocation
/// instead of going back to the driver at every synchronisation (the default threshold is
/// 0: CUDA Programming Guide, "Stream Ordered Memory Allocator", physical page caching
/// behavior). Best effort: a driver that refuses keeps its default.
fn keep_freed_memory(context: &Arc<CudaContext>) {
    use cudarc::driver::result::{device, mem_pool};
    use cudarc::driver::sys::CUmemPool_attribute;
    let mut threshold: u64 = u64::MAX;
    // SAFETY: the device is this context's; the attribute's value is a cuuint64_t.
    unsafe {
        if let Ok(pool) = device::get_default_mem_pool(context.cu_device()) {
            let _ = mem_pool::set_attribute(
                pool,
                CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut threshold as *mut u64).cast(),
            );
        }
    }
}

impl GpuRunner {
    /// Loads cuBLAS (CUDA 13's `libcublas.so.13` or CUDA 12's `.so.12`, whichever a driver
    /// supporting CUDA `driver_cuda` runs, from `lib_dirs` first, then the loader's paths)
    /// on this GPU's stream, for the GEMMs of prefill and batches above
    /// [`super::backend::MAX_MATVEC_TOKENS`] tokens. Returns the line that says where those
    /// products run: a `warning: ` line, naming the pip package, when cuBLAS is missing or
    /// does not start, and the matrix-vector kernels then run every product.
    pub(crate) fn load_cublas(
        &mut self,
        lib_dirs: &[std::path::PathBuf],
        driver_cuda: (i32, i32),
    ) -> String {
        let line = self.open_cublas(lib_dirs, driver_cuda);
        self.gemm_line = line.clone();
        line
    }

    /// Where products over [`super::backend::MAX_MATVEC_TOKENS`] tokens run, as
    /// [`GpuRunner::load_cublas`] said ("" before it ran).
    pub(crate) fn gemm_line(&self) -> &str {
        &self.gemm_line
    }

    /// Where cuBLAS came from, once loaded.
    pub(crate) fn cublas_found(&self) -> Option<crate::runtime::libraries::Found> {
        self.blas.as_ref().map(|(cublas, _)| cublas.found())
    }

    fn open_cublas(&mut self, lib_dirs: &[std::path::PathBuf], driver_cuda: (i32, i32)) -> String {
        let cublas = match super::cublas::Cublas::open(lib_dirs, Some(driver_cuda)) {
            Ok(cublas) => cublas,
            Err(error) => {
                return format!(
                    "warning: {error:#}; prefill runs on the matrix-vector kernels, more slowly"
                );
            }
        };
        let version = cublas.version_string();
        let handle = self
            ._context
            .bind_to_thread()
            .map_err(|e| anyhow!("cannot bind the GPU's context: {e:?}"))
            // SAFETY: the stream is this context's, bound to this thread just above.
            .and_then(|()| unsafe {
                cublas.create(self.stream.cu_stream() as *mut std::ffi::c_void)
            });
        match handle {
            Ok(handle) => {
                let from = cublas.path.as_ref().map_or_else(
                    || "the loader's paths".to_string(),
                    |p| p.display().to_string(),
                );
                self.blas = Some((cublas, handle));
                format!(
                    "prefill and batches over {} tokens run on cuBLAS {version} ({from})",
                    super::backend::MAX_MATVEC_TOKENS
                )
            }
            Err(error) => format!(
                "warning: cuBLAS {version} does not start on {}: {error:#}; prefill runs on the matrix-vector kernels, more slowly",
                super::backend::Device::name(self)
            ),
        }
    }
}

impl Runner for GpuRunner {
    fn launch(
        &self,
        kernel: &str,
        grid: [u32; 3],
        block: [u32; 3],
        args: &mut [Arg<'_>],
    ) -> Result<()> {
        let function = self
            .functions
            .get(kernel)
            .with_context(|| format!("no kernel `{kernel}`"))?;
        let device = |e: cudarc::driver::DriverError| anyhow!("`{kernel}`: {e:?}");
        // Device copies of the buffers, in argument order.
        let mut buffers: Vec<CudaSlice<u8>> = Vec::new();
        for arg in args.iter() {
            match arg {
                Arg::In(bytes) => buffers.push(self.stream.clone_htod(*bytes).map_err(device)?),
                Arg::Out(bytes) => buffers.push(self.stream.clone_htod(&**bytes).map_err(device)?),
                Arg::U32(_) | Arg::F32(_) => {}
            }
        }
        let values: Vec<(u32, f32)> = args
            .iter()
            .map(|arg| match arg {
                Arg::U32(v) => (*v, 0.0),
                Arg::F32(v) => (0, *v),
                _ => (0, 0.0),
            })
            .collect();
        {
            let mut builder = self.stream.launch_builder(function);
            let mut next = 0;
            for (arg, value) in args.iter().zip(&values) {
                match arg {
                    Arg::In(_) | Arg::Out(_) => {
                        builder.arg(&buffers[next]);
                        next += 1;
                    }
                    Arg::U32(_) => {
                        builder.arg(&value.0);
                    }
                    Arg::F32(_) => {
                        builder.arg(&value.1);
                    }
                }
            }
            let config = LaunchConfig {
                grid_dim: (grid[0], grid[1], grid[2]),
                block_dim: (block[0], block[1], block[2]),
                shared_mem_bytes: 0,
            };
            // SAFETY: the arguments follow the kernel's launch description (the checks are
            // written against it; the tests compare it with the PTX), and every buffer is
            // sized for the grid.
            unsafe { builder.launch(config) }.map_err(device)?;
        }
        self.stream.synchronize().map_err(device)?;
        let mut next = 0;
        for arg in args.iter_mut() {
            match arg {
                Arg::In(_) => next += 1,
                Arg::Out(bytes) => {
                    self.stream
                        .memcpy_dtoh(&buffers[next], &mut **bytes)
                        .map_err(device)?;
                    next += 1;
                }
                Arg::U32(_) | Arg::F32(_) => {}
            }
        }
        Ok(())
    }
}

/// An NCCL operation on f32 in place on this GPU ([`GpuRunner::nccl_enqueue`]).
#[derive(Clone, Copy)]
enum NcclOp {
    /// Sum across the TP group.
    AllReduceSum,
    /// To this pipeline stage.
    Send(usize),
    /// From this pipeline stage.
    Recv(usize),
}

impl GpuRunner {
    fn driver_error(what: &str) -> impl Fn(cudarc::driver::DriverError) -> anyhow::Error + '_ {
        move |e| anyhow!("{what}: {e:?}")
    }
}

impl GpuRunner {
    /// Enqueues `op` on `n` f32 of `buffer` on this GPU's stream, through the TP group's
    /// communicator (all-reduces) or the pipeline's (hand-offs); `false`: this GPU has no
    /// such communicator, and the caller goes through host memory.
    ///
    /// Errors: a buffer shorter than `n` f32, the driver's or NCCL's.
    fn nccl_enqueue(&self, op: NcclOp, buffer: &CudaSlice<u8>, n: usize) -> Result<bool> {
        use cudarc::driver::DevicePtr;
        let (comm, what) = match op {
            NcclOp::AllReduceSum => (&self.nccl, "an all-reduce"),
            NcclOp::Send(_) | NcclOp::Recv(_) => (&self.pp_nccl, "a pipeline hand-off"),
        };
        let Some(comm) = comm else {
            return Ok(false);
        };
        if buffer.len() < n * 4 {
            anyhow::bail!("{what} of {n} f32 over a {}-byte buffer", buffer.len());
        }
        self._context
            .bind_to_thread()
            .map_err(Self::driver_error("cannot bind the GPU's context"))?;
        let (pointer, _synced) = buffer.device_ptr(&self.stream);
        let stream = self.stream.cu_stream() as *mut std::ffi::c_void;
        // SAFETY: the buffer holds `n` f32 on this GPU and outlives the enqueued operation
        // (`_synced` records it on the stream); the stream is this context's.
        unsafe {
            match op {
                NcclOp::AllReduceSum => comm.all_reduce_sum_f32(pointer, n, stream),
                NcclOp::Send(stage) => comm.send_f32(pointer, n, stage, stream),
                NcclOp::Recv(stage) => comm.recv_f32(pointer, n, stage, stream),
            }
        }?;
        Ok(true)
    }

    /// Device memory in use on this GPU (every process's), bytes: `total − free` of
    /// `cuMemGetInfo`.
    ///
    /// Errors: the driver's.
    pub(crate) fn memory_used_bytes(&self) -> Result<u64> {
        // `cuMemGetInfo` reads the calling thread's current context.
        self._context
            .bind_to_thread()
            .map_err(Self::driver_error("cannot bind the GPU's context"))?;
        let (free, total) = cudarc::driver::result::mem_get_info()
            .map_err(|e| anyhow!("cannot read the GPU's memory use: {e:?}"))?;
        Ok((total - free) as u64)
    }
}

impl super::backend::Device for GpuRunner {
    type Buffer = CudaSlice<u8>;

    fn name(&self) -> String {
        format!("cuda:{}", self._context.ordinal())
    }

    fn alloc(&self, len_bytes: usize) -> Result<CudaSlice<u8>> {
        self.stream
            .alloc_zeros::<u8>(len_bytes.max(1))
            .map_err(Self::driver_error("cannot allocate GPU memory"))
    }

    fn upload(&self, bytes: &[u8]) -> Result<CudaSlice<u8>> {
        if bytes.is_empty() {
            return self.alloc(1);
        }
        self.stream
            .clone_htod(bytes)
            .map_err(Self::driver_error("cannot copy to the GPU"))
    }

    fn download(&self, buffer: &CudaSlice<u8>, len_bytes: usize) -> Result<Vec<u8>> {
        self.stream
            .synchronize()
            .map_err(Self::driver_error("a kernel failed"))?;
        let mut bytes = vec![0u8; buffer.len()];
        self.stream
            .memcpy_dtoh(buffer, &mut bytes)
            .map_err(Self::driver_error("cannot copy from the GPU"))?;
        if len_bytes > bytes.len() {
            anyhow::bail!("{len_bytes} bytes asked of a {}-byte buffer", bytes.len());
        }
        bytes.truncate(len_bytes);
        Ok(bytes)
    }

    fn all_reduce_sum_in_place(&self, buffer: &CudaSlice<u8>, n: usize) -> Result<bool> {
        self.nccl_enqueue(NcclOp::AllReduceSum, buffer, n)
    }

    fn send_to_stage(&self, buffer: &CudaSlice<u8>, n: usize, stage: usize) -> Result<bool> {
        self.nccl_enqueue(NcclOp::Send(stage), buffer, n)
    }

    fn recv_from_stage(&self, buffer: &CudaSlice<u8>, n: usize, stage: usize) -> Result<bool> {
        self.nccl_enqueue(NcclOp::Recv(stage), buffer, n)
    }

    fn has_gemm(&self) -> bool {
        self.blas.is_some()
    }

    fn gemm(&self, gemm: super::backend::Gemm<'_, CudaSlice<u8>>) -> Result<()> {
        use super::backend::GemmType;
        use super::cublas::{OP_N, OP_T, R_16BF, R_16F, R_32F};
        use cudarc::driver::DevicePtr;
        let Some((cublas, handle)) = &self.blas else {
            anyhow::bail!("cuBLAS is not loaded on {}", self.name());
        };
        gemm.check_sizes(CudaSlice::len)?;
        let int = |n: usize, what: &str| {
            i32::try_from(n).map_err(|_| anyhow!("{what} {n} does not fit cuBLAS's 32 bits"))
        };
        let (m, n, k) = (
            int(gemm.n_rows, "rows")?,
            int(gemm.n_tokens, "tokens")?,
            int(gemm.n_cols, "columns")?,
        );
        let input = match gemm.ty {
            GemmType::F32 => R_32F,
            GemmType::F16 => R_16F,
            GemmType::Bf16 => R_16BF,
        };
        let (y, _y_synced) = gemm.y.device_ptr(&self.stream);
        let (w, _w_synced) = gemm.w.device_ptr(&self.stream);
        let (x, _x_synced) = gemm.x.device_ptr(&self.stream);
        // Column-major, as cuBLAS sees row-major buffers: y [n_tokens, n_rows] is
        // yᵀ (n_rows × n_tokens, ld n_rows) = op(w) (n_rows × n_cols: w's row-major
        // [n_rows, n_cols] is its n_cols × n_rows transpose, ld n_cols) · xᵀ (n_cols ×
        // n_tokens, ld n_cols).
        // SAFETY: the handle is on this GPU's stream; the three buffers hold the sizes
        // checked above and stay alive until the GEMM is done (`_synced` records it on the
        // stream).
        self.timed("cublasGemmEx", || unsafe {
            cublas.gemm_ex(
                handle,
                (OP_T, OP_N),
                (m, n, k),
                (w as *const std::ffi::c_void, k),
                (x as *const std::ffi::c_void, k),
                input,
                (y as *mut std::ffi::c_void, m),
            )
        })
        .with_context(|| {
            format!(
                "cuBLAS GEMM of {} tokens × {} rows × {} columns",
                gemm.n_tokens, gemm.n_rows, gemm.n_cols
            )
        })
    }

    fn launch(
        &self,
        kernel: &str,
        grid: [u32; 3],
        block: [u32; 3],
        args: &[super::backend::DeviceArg<'_, CudaSlice<u8>>],
    ) -> Result<()> {
        use super::backend::DeviceArg;
        let function = self
            .functions
            .get(kernel)
            .with_context(|| format!("no kernel `{kernel}`"))?;
        let mut builder = self.stream.launch_builder(function);
        for arg in args {
            match arg {
                DeviceArg::Buffer(buffer) => {
                    builder.arg(*buffer);
                }
                DeviceArg::U32(v) => {
                    builder.arg(v);
                }
                DeviceArg::F32(v) => {
                    builder.arg(v);
                }
            }
        }
        let config = LaunchConfig {
            grid_dim: (grid[0], grid[1], grid[2]),
            block_dim: (block[0], block[1], block[2]),
            shared_mem_bytes: 0,
        };
        self.timed(kernel, || {
            // SAFETY: `KernelBackend` passes each kernel's parameters in its documented order
            // (the tests compare the descriptions with the PTX) with buffers sized for the
            // grid.
            unsafe { builder.launch(config) }
                .map(|_| ())
                .map_err(|e| anyhow!("`{kernel}` failed to launch: {e:?}"))
        })
    }
}

/// The first visible GPU (after `CUDA_VISIBLE_DEVICES`) with every kernel loaded for its
/// architecture (compiled, or taken from `cache_dir`) and cuBLAS when it is installed
/// ([`GpuRunner::gemm_line`] says), and what the driver says of it.
///
/// Errors: no driver or GPU (the probe's message), no NVRTC (naming the pip package), a
/// kernel that does not compile or load.
pub fn open_first(
    dirs: &[std::path::PathBuf],
    cache_dir: &Path,
) -> Result<(GpuRunner, super::device::Gpu)> {
    let driver = super::device::probe(dirs)?;
    let gpu = driver.gpus[0].clone();
    let nvrtc = Nvrtc::open(dirs, Some(driver.cuda_version))?;
    let mut runner = GpuRunner::new(gpu.ordinal, gpu.arch(), &nvrtc, cache_dir)?;
    runner.load_cublas(dirs, driver.cuda_version);
    Ok((runner, gpu))
}
