//! cuBLAS, bound by our own code (libloading) from CUDA 13's `libcublas.so.13` or CUDA 12's
//! `libcublas.so.12`, whichever [`crate::runtime::libraries`] finds first for this driver: prefill's
//! GEMMs (`cublasGemmEx`). cudarc's cuBLAS binding is not used: its loader knows only CUDA
//! 12 names and panics when none loads, and its handle's drop unwraps `cublasDestroy`.
//!
//! Every entry point used exists in cuBLAS 11.0 through 13.1 with the same signature and
//! enum values (cublas_api.h, library_types.h); `cublasGetStatusString` since 11.4.2.

use std::ffi::{c_char, c_int, c_void};
use std::path::PathBuf;

use anyhow::{Context, Result, bail};

use crate::runtime::libraries::{self, Found};

/// `cublasStatus_t`: 0 is `CUBLAS_STATUS_SUCCESS`.
type Status = c_int;
/// `cublasHandle_t`: an opaque handle.
type RawHandle = *mut c_void;

/// `cublasOperation_t` (cublas_api.h): `CUBLAS_OP_N`.
pub const OP_N: c_int = 0;
/// `CUBLAS_OP_T`.
pub const OP_T: c_int = 1;
/// `cudaDataType_t` (library_types.h): `CUDA_R_32F`.
pub const R_32F: c_int = 0;
/// `CUDA_R_16F`.
pub const R_16F: c_int = 2;
/// `CUDA_R_16BF`.
pub const R_16BF: c_int = 14;
/// `cublasComputeType_t`: `CUBLAS_COMPUTE_32F`.
pub(crate) const COMPUTE_32F: c_int = 68;
/// `cublasGemmAlgo_t`: `CUBLAS_GEMM_DEFAULT`.
pub(crate) const GEMM_DEFAULT: c_int = -1;

/// `cublasGemmEx`'s signature (cublas_api.h).
type GemmEx = unsafe extern "C" fn(
    RawHandle,
    c_int,
    c_int,
    c_int,
    c_int,
    c_int,
    *const c_void,
    *const c_void,
    c_int,
    c_int,
    *const c_void,
    c_int,
    c_int,
    *const c_void,
    *mut c_void,
    c_int,
    c_int,
    c_int,
    c_int,
) -> Status;

#[derive(Clone, Copy)]
struct Api {
    create: unsafe extern "C" fn(*mut RawHandle) -> Status,
    destroy: unsafe extern "C" fn(RawHandle) -> Status,
    set_stream: unsafe extern "C" fn(RawHandle, *mut c_void) -> Status,
    gemm_ex: GemmEx,
    get_property: unsafe extern "C" fn(c_int, *mut c_int) -> Status,
    get_status_string: unsafe extern "C" fn(Status) -> *const c_char,
}

/// cuBLAS, opened and bound.
#[derive(Clone)]
pub struct Cublas {
    /// Where it came from (`None`: the system loader's paths).
    pub path: Option<PathBuf>,
    /// The soname found (`libcublas.so.13`).
    pub soname: String,
    /// `(major, minor, patch)` (`cublasGetProperty`, which needs no GPU).
    pub version: (i32, i32, i32),
    api: Api,
}

/// One cuBLAS handle bound to a stream; destroyed on drop (an error there, after a sticky
/// CUDA error, is ignored: never a panic).
pub struct Handle {
    raw: RawHandle,
    api: Api,
}

// SAFETY: a cuBLAS handle may move between host threads; it is used by one at a time (the
// owner's `&mut`/`&self` on one stream), which cuBLAS allows (cuBLAS guide, "Thread Safety").
unsafe impl Send for Handle {}

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: created by `cublasCreate_v2` and destroyed once, here.
        let _ = unsafe { (self.api.destroy)(self.raw) };
    }
}

/// The libraries to load before `libcublas.so.<major>` from its directory.
fn companions(soname: &str) -> Vec<String> {
    vec![soname.replace("libcublas.", "libcublasLt.")]
}

impl Cublas {
    /// Opens cuBLAS from `dirs` (then the system loader's paths): the newest soname that a
    /// driver supporting CUDA `driver_cuda` (`None`: not known) can run, with its
    /// `libcublasLt` from the same directory; binds the entry points and reads the version.
    ///
    /// Errors: not installed (naming the pip package), an entry point missing (named).
    pub fn open(dirs: &[PathBuf], driver_cuda: Option<(i32, i32)>) -> Result<Cublas> {
        let (opened, shown) = libraries::open_for_driver(
            "cuBLAS",
            "nvidia-cublas-cu12",
            libraries::CUBLAS,
            dirs,
            driver_cuda,
            &companions,
        )?;
        let library = opened.library;
        macro_rules! symbol {
            ($name:literal) => {
                // SAFETY: the type is the entry point's signature in cublas_api.h.
                *unsafe { library.get(concat!($name, "\0").as_bytes()) }
                    .with_context(|| format!("`{shown}` has no `{}`", $name))?
            };
        }
        let api = Api {
            create: symbol!("cublasCreate_v2"),
            destroy: symbol!("cublasDestroy_v2"),
            set_stream: symbol!("cublasSetStream_v2"),
            gemm_ex: symbol!("cublasGemmEx"),
            get_property: symbol!("cublasGetProperty"),
            get_status_string: symbol!("cublasGetStatusString"),
        };
        let mut parts = [0; 3];
        for (property, part) in parts.iter_mut().enumerate() {
            // SAFETY: bound above; `MAJOR_VERSION`, `MINOR_VERSION`, `PATCH_LEVEL` are 0, 1,
            // 2 (library_types.h); the out-pointer is valid.
            let status = unsafe { (api.get_property)(property as c_int, part) };
            if status != 0 {
                bail!("cublasGetProperty of `{shown}` failed (cublasStatus_t {status})");
            }
        }
        Ok(Cublas {
            path: opened.path,
            soname: opened.soname,
            version: (parts[0], parts[1], parts[2]),
            api,
        })
    }

    /// Where cuBLAS came from, for `infer smoke`'s report.
    pub fn found(&self) -> Found {
        Found {
            library: "cuBLAS".into(),
            soname: self.soname.clone(),
            path: self.path.clone(),
        }
    }

    /// The version as `major.minor.patch`.
    pub fn version_string(&self) -> String {
        format!("{}.{}.{}", self.version.0, self.version.1, self.version.2)
    }

    /// cuBLAS's text for `status`, with the code.
    fn error(&self, status: Status) -> String {
        // SAFETY: cuBLAS returns a static string (or null) for every status.
        let text = unsafe { libraries::error_text((self.api.get_status_string)(status)) };
        format!("{text} (cublasStatus_t {status})")
    }

    /// A handle on `stream`.
    ///
    /// Errors: cuBLAS's (no GPU, no context current).
    ///
    /// # Safety
    /// `stream` is null (the default stream) or a live `CUstream` of the context current on
    /// this thread.
    pub unsafe fn create(&self, stream: *mut c_void) -> Result<Handle> {
        let mut raw: RawHandle = std::ptr::null_mut();
        // SAFETY: the out-pointer is valid.
        let status = unsafe { (self.api.create)(&mut raw) };
        if status != 0 {
            bail!("cublasCreate failed: {}", self.error(status));
        }
        let handle = Handle { raw, api: self.api };
        // SAFETY: `handle` is live; the caller passes a stream of the current context.
        let status = unsafe { (self.api.set_stream)(handle.raw, stream) };
        if status != 0 {
            bail!("cublasSetStream failed: {}", self.error(status));
        }
        Ok(handle)
    }

    /// `cublasGemmEx` in column-major terms: C (m × n, ld `ldc`) = op(A) · op(B) with f32
    /// `alpha` = 1 and `beta` = 0, inputs of `input_type` (`R_32F`, `R_16F`, `R_16BF`),
    /// output f32, computed in f32 ([`COMPUTE_32F`]).
    ///
    /// Errors: cuBLAS's status, named.
    ///
    /// # Safety
    /// `a`, `b` and `c` are device pointers on the handle's GPU holding the sizes the
    /// dimensions and leading dimensions imply, alive until the stream reaches the GEMM.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gemm_ex(
        &self,
        handle: &Handle,
        (trans_a, trans_b): (c_int, c_int),
        (m, n, k): (c_int, c_int, c_int),
        (a, lda): (*const c_void, c_int),
        (b, ldb): (*const c_void, c_int),
        input_type: c_int,
        (c, ldc): (*mut c_void, c_int),
    ) -> Result<()> {
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: the caller's contract; alpha and beta are f32, as COMPUTE_32F reads them.
        let status = unsafe {
            (self.api.gemm_ex)(
                handle.raw,
                trans_a,
                trans_b,
                m,
                n,
                k,
                (&alpha as *const f32).cast(),
                a,
                input_type,
                lda,
                b,
                input_type,
                ldb,
                (&beta as *const f32).cast(),
                c,
                R_32F,
                ldc,
                COMPUTE_32F,
                GEMM_DEFAULT,
            )
        };
        if status != 0 {
            bail!("cublasGemmEx failed: {}", self.error(status));
        }
        Ok(())
    }
}
