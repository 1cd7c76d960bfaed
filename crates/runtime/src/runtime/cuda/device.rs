//! The GPUs this host's driver sees, through the driver API (opened only after
//! [`crate::runtime::libraries::open_driver`] found `libcuda.so.1`: without a driver this is an error,
//! never a panic).
//!
//! Driver support: cudarc is built against the CUDA 12.2 driver API (`cuda-12020`), and
//! every driver entry point we call — `cuInit`, `cuDriverGetVersion`, `cuDeviceGet*`,
//! `cuDeviceTotalMem_v2`, `cuDevicePrimaryCtxRetain`, `cuCtxSetCurrent`, `cuModuleLoadData`,
//! `cuModuleGetFunction`, `cuLaunchKernel`, `cuMemAllocAsync`/`cuMemFreeAsync` (CUDA 11.2),
//! `cuMemcpy*Async_v2`, `cuMemsetD8Async`, `cuStreamSynchronize`, `cuEvent*`,
//! `cuMemGetInfo_v2` — exists in every driver from R535 (CUDA 12.2) through R580 (CUDA 13.x),
//! under the same versioned names. The libraries add their own floor: CUDA 12 NVRTC and
//! cuBLAS run from R525, CUDA 13's need R580 ([`crate::runtime::libraries::sonames_for_driver`]).
//! Kernels load as CUBIN for the GPU's exact architecture, never PTX, so no JIT needs a
//! driver newer than the NVRTC that compiled them.

use anyhow::{Result, bail};
use cudarc::driver::{result, sys};
use serde::Serialize;

/// One GPU as the driver reports it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Gpu {
    /// CUDA ordinal (after `CUDA_VISIBLE_DEVICES`).
    pub ordinal: usize,
    pub name: String,
    /// `(major, minor)`: 8.0 is sm_80.
    pub compute_capability: (i32, i32),
    pub memory_bytes: u64,
}

impl Gpu {
    /// The CUBIN architecture number (`80` for 8.0, `90` for 9.0).
    pub fn arch(&self) -> u32 {
        (self.compute_capability.0 * 10 + self.compute_capability.1) as u32
    }
}

/// What the driver says.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Driver {
    /// The CUDA version the driver supports, `(major, minor)` (`cuDriverGetVersion`).
    pub cuda_version: (i32, i32),
    pub gpus: Vec<Gpu>,
    /// The `libcuda.so.1` opened (`None`: the system loader's paths).
    pub library: Option<std::path::PathBuf>,
}

/// The driver's CUDA version and every visible GPU; the driver is looked for in `dirs`
/// first ([`crate::runtime::libraries::search_dirs`]).
///
/// Errors: no driver on this host ("use --device cpu"), a driver that fails to initialise
/// (its error), no GPU visible.
pub fn probe(dirs: &[std::path::PathBuf]) -> Result<Driver> {
    let library = crate::runtime::libraries::open_driver(dirs)?;
    let check = |what: &str, outcome: std::result::Result<(), result::DriverError>| -> Result<()> {
        outcome.map_err(|e| anyhow::anyhow!("the NVIDIA driver failed at {what}: {e:?}"))
    };
    check("cuInit", result::init())?;
    let mut version = 0;
    check(
        "cuDriverGetVersion",
        // SAFETY: the driver is loaded and initialised; the out-pointer is valid.
        unsafe { sys::cuDriverGetVersion(&mut version) }.result(),
    )?;
    let count = result::device::get_count()
        .map_err(|e| anyhow::anyhow!("the NVIDIA driver cannot count GPUs: {e:?}"))?;
    if count <= 0 {
        bail!(
            "the NVIDIA driver sees no GPU (check CUDA_VISIBLE_DEVICES and `nvidia-smi`); use --device cpu"
        );
    }
    let mut gpus = Vec::new();
    for ordinal in 0..count {
        let device =
            result::device::get(ordinal).map_err(|e| anyhow::anyhow!("GPU {ordinal}: {e:?}"))?;
        let name = result::device::get_name(device).unwrap_or_else(|_| "unknown GPU".into());
        let attribute = |a| {
            // SAFETY: `device` is a valid handle from `cuDeviceGet`.
            unsafe { result::device::get_attribute(device, a) }.unwrap_or(0)
        };
        let major =
            attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR);
        let minor =
            attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR);
        // SAFETY: as above.
        let memory_bytes = unsafe { result::device::total_mem(device) }.unwrap_or(0) as u64;
        gpus.push(Gpu {
            ordinal: ordinal as usize,
            name,
            compute_capability: (major, minor),
            memory_bytes,
        });
    }
    Ok(Driver {
        cuda_version: (version / 1000, version % 1000 / 10),
        gpus,
        library,
    })
}
