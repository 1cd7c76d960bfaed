//! NCCL through its C API, opened at run time from the `libnccl.so.2` that
//! [`crate::runtime::libraries`] finds (pip's `nvidia-nccl-cu12`, a CUDA toolkit, the
//! system loader's paths). cudarc's NCCL module looks for `libnccl.so` and other names but
//! never `libnccl.so.2`, the only name pip and Debian ship (cudarc 0.19's
//! `get_lib_name_candidates`), so the few entry points a TP group and a pipeline need are
//! bound here: version, unique id, communicator init and destroy, all-reduce, send and
//! receive (NCCL 2.7 and later), error strings.
//!
//! The unique id travels through our own collectives (the group's rank 0 makes it and
//! broadcasts it), as torch.distributed sends it through its store.

use std::ffi::{c_char, c_int, c_void};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result, bail};

/// `NCCL_UNIQUE_ID_BYTES` (nccl.h).
pub const UNIQUE_ID_BYTES: usize = 128;

/// `ncclUniqueId`: passed by value to `ncclCommInitRank`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct UniqueId {
    pub internal: [c_char; UNIQUE_ID_BYTES],
}

impl UniqueId {
    /// The id's bytes, to send to the other ranks.
    pub fn to_bytes(&self) -> Vec<u8> {
        self.internal.iter().map(|&c| c as u8).collect()
    }

    /// An id from the bytes rank 0 sent. Errors: not [`UNIQUE_ID_BYTES`] long.
    pub fn from_bytes(bytes: &[u8]) -> Result<UniqueId> {
        if bytes.len() != UNIQUE_ID_BYTES {
            bail!(
                "an NCCL unique id has {UNIQUE_ID_BYTES} bytes, got {}",
                bytes.len()
            );
        }
        let mut internal = [0 as c_char; UNIQUE_ID_BYTES];
        for (c, b) in internal.iter_mut().zip(bytes) {
            *c = *b as c_char;
        }
        Ok(UniqueId { internal })
    }
}

/// `ncclResult_t`: 0 is `ncclSuccess`.
type NcclResult = c_int;
/// `ncclComm_t`.
type RawComm = *mut c_void;
/// `ncclFloat32` of `ncclDataType_t` (nccl.h).
const NCCL_FLOAT32: c_int = 7;
/// `ncclSum` of `ncclRedOp_t` (nccl.h).
const NCCL_SUM: c_int = 0;

struct Api {
    _library: libloading::Library,
    get_version: unsafe extern "C" fn(*mut c_int) -> NcclResult,
    get_unique_id: unsafe extern "C" fn(*mut UniqueId) -> NcclResult,
    comm_init_rank: unsafe extern "C" fn(*mut RawComm, c_int, UniqueId, c_int) -> NcclResult,
    comm_destroy: unsafe extern "C" fn(RawComm) -> NcclResult,
    all_reduce: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        RawComm,
        *mut c_void,
    ) -> NcclResult,
    send: unsafe extern "C" fn(
        *const c_void,
        usize,
        c_int,
        c_int,
        RawComm,
        *mut c_void,
    ) -> NcclResult,
    recv:
        unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, RawComm, *mut c_void) -> NcclResult,
    get_error_string: unsafe extern "C" fn(NcclResult) -> *const c_char,
}

/// The NCCL library, loaded.
#[derive(Clone)]
pub struct Nccl {
    api: Arc<Api>,
    /// Where it was loaded from (`None`: by the system loader's search).
    pub path: Option<PathBuf>,
}

impl Nccl {
    /// Opens `libnccl.so.2` from the first of `dirs` that has it, else through the system
    /// loader, and binds its entry points.
    ///
    /// Errors: no NCCL (with the pip package that provides it), a library without the
    /// entry points (named).
    pub fn open(dirs: &[PathBuf]) -> Result<Nccl> {
        use crate::runtime::libraries::{NCCL, open};
        let path = open(NCCL, dirs).map_err(|error| {
            anyhow::anyhow!(
                "NCCL ({NCCL}) is not installed: `pip install nvidia-nccl-cu13` (CUDA 13) or `pip install nvidia-nccl-cu12`; the loader said: {error}"
            )
        })?;
        let target: &Path = path.as_deref().unwrap_or(Path::new(NCCL));
        // SAFETY: NCCL is designed to be dlopen'ed (PyTorch does); `libraries::open` has
        // loaded it already, so this only takes another reference.
        let library = unsafe { libloading::Library::new(target) }
            .with_context(|| format!("cannot load `{}`", target.display()))?;
        macro_rules! symbol {
            ($name:literal) => {
                // SAFETY: the type is the entry point's signature in nccl.h (2.x).
                *unsafe { library.get(concat!($name, "\0").as_bytes()) }
                    .with_context(|| format!("`{}` has no `{}`", target.display(), $name))?
            };
        }
        let api = Api {
            get_version: symbol!("ncclGetVersion"),
            get_unique_id: symbol!("ncclGetUniqueId"),
            comm_init_rank: symbol!("ncclCommInitRank"),
            comm_destroy: symbol!("ncclCommDestroy"),
            all_reduce: symbol!("ncclAllReduce"),
            send: symbol!("ncclSend"),
            recv: symbol!("ncclRecv"),
            get_error_string: symbol!("ncclGetErrorString"),
            _library: library,
        };
        Ok(Nccl {
            api: Arc::new(api),
            path,
        })
    }

    fn check(&self, what: &str, result: NcclResult) -> Result<()> {
        if result == 0 {
            return Ok(());
        }
        // SAFETY: NCCL returns a static string for every result code.
        let text =
            unsafe { crate::runtime::libraries::error_text((self.api.get_error_string)(result)) };
        bail!("{what} failed: {text} (ncclResult_t {result})")
    }

    /// `(major, minor, patch)` of the loaded NCCL (`ncclGetVersion`; the code is
    /// `major·10000 + minor·100 + patch` since 2.9, `major·1000 + minor·100 + patch` before).
    ///
    /// Errors: NCCL's.
    pub fn version(&self) -> Result<(u32, u32, u32)> {
        let mut code: c_int = 0;
        // SAFETY: the out-pointer is valid.
        self.check("ncclGetVersion", unsafe {
            (self.api.get_version)(&mut code)
        })?;
        let code = code as u32;
        Ok(if code >= 10000 {
            (code / 10000, code % 10000 / 100, code % 100)
        } else {
            (code / 1000, code % 1000 / 100, code % 100)
        })
    }

    /// A new unique id (what the group's rank 0 makes and sends to the others). Needs no
    /// GPU.
    ///
    /// Errors: NCCL's (no usable network interface for its bootstrap).
    pub fn unique_id(&self) -> Result<UniqueId> {
        let mut id = UniqueId {
            internal: [0; UNIQUE_ID_BYTES],
        };
        // SAFETY: the out-pointer is valid for one `ncclUniqueId`.
        self.check("ncclGetUniqueId", unsafe {
            (self.api.get_unique_id)(&mut id)
        })?;
        Ok(id)
    }

    /// Joins the communicator `id` of `n_ranks` as `rank` on the calling thread's current
    /// CUDA device (every member calls it at once; it returns when all have joined).
    ///
    /// Errors: NCCL's (no CUDA device: "unhandled cuda error"; a peer that never joins).
    ///
    /// # Safety
    /// The calling thread's current CUDA context must be the rank's GPU.
    pub unsafe fn init_rank(&self, n_ranks: usize, id: &UniqueId, rank: usize) -> Result<Comm> {
        let mut comm: RawComm = std::ptr::null_mut();
        // SAFETY: the out-pointer is valid; `id` is passed by value as nccl.h declares.
        self.check("ncclCommInitRank", unsafe {
            (self.api.comm_init_rank)(&mut comm, n_ranks as c_int, *id, rank as c_int)
        })?;
        Ok(Comm {
            nccl: self.clone(),
            raw: comm,
        })
    }
}

/// One rank's NCCL communicator; destroyed when dropped.
pub struct Comm {
    nccl: Nccl,
    raw: RawComm,
}

// SAFETY: an NCCL communicator may be used from any thread (one at a time), as PyTorch's
// process groups do; `Comm` is not `Sync`.
unsafe impl Send for Comm {}

impl Comm {
    /// Sums `count` f32 values at device address `buffer` across the communicator, in place,
    /// enqueued on `stream` (`cudaStream_t`; it runs in stream order with the kernels).
    ///
    /// Errors: NCCL's.
    ///
    /// # Safety
    /// `buffer` must hold `count` f32 on this rank's GPU, valid until the stream passes the
    /// all-reduce; `stream` must belong to the current context.
    pub unsafe fn all_reduce_sum_f32(
        &self,
        buffer: u64,
        count: usize,
        stream: *mut c_void,
    ) -> Result<()> {
        let pointer = buffer as *mut c_void;
        // SAFETY: the caller's guarantees.
        self.nccl.check("ncclAllReduce", unsafe {
            (self.nccl.api.all_reduce)(
                pointer,
                pointer,
                count,
                NCCL_FLOAT32,
                NCCL_SUM,
                self.raw,
                stream,
            )
        })
    }
}

impl Comm {
    /// Sends `count` f32 values at device address `buffer` to member `peer`, enqueued on
    /// `stream` (the peer's matching [`Comm::recv_f32`] completes it).
    ///
    /// Errors: NCCL's.
    ///
    /// # Safety
    /// As [`Comm::all_reduce_sum_f32`].
    pub unsafe fn send_f32(
        &self,
        buffer: u64,
        count: usize,
        peer: usize,
        stream: *mut c_void,
    ) -> Result<()> {
        // SAFETY: the caller's guarantees.
        self.nccl.check("ncclSend", unsafe {
            (self.nccl.api.send)(
                buffer as *const c_void,
                count,
                NCCL_FLOAT32,
                peer as c_int,
                self.raw,
                stream,
            )
        })
    }

    /// Receives `count` f32 values from member `peer` into device address `buffer`,
    /// enqueued on `stream` (the kernels after it in stream order see them).
    ///
    /// Errors: NCCL's.
    ///
    /// # Safety
    /// As [`Comm::all_reduce_sum_f32`].
    pub unsafe fn recv_f32(
        &self,
        buffer: u64,
        count: usize,
        peer: usize,
        stream: *mut c_void,
    ) -> Result<()> {
        // SAFETY: the caller's guarantees.
        self.nccl.check("ncclRecv", unsafe {
            (self.nccl.api.recv)(
                buffer as *mut c_void,
                count,
                NCCL_FLOAT32,
                peer as c_int,
                self.raw,
                stream,
            )
        })
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        // SAFETY: `raw` came from `ncclCommInitRank` and is destroyed once.
        let _ = unsafe { (self.nccl.api.comm_destroy)(self.raw) };
    }
}

/// What a group's NCCL communicator carries, for its messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GroupKind {
    /// A TP group's all-reduces.
    Tp,
    /// A pipeline's hand-offs of hidden states from each stage to the next.
    Pipeline,
}

impl GroupKind {
    /// What the members are called ("TP ranks").
    fn members(self) -> &'static str {
        match self {
            GroupKind::Tp => "TP ranks",
            GroupKind::Pipeline => "pipeline stages",
        }
    }

    /// What travels ("TP all-reduces").
    fn traffic(self) -> &'static str {
        match self {
            GroupKind::Tp => "TP all-reduces",
            GroupKind::Pipeline => "pipeline hand-offs",
        }
    }

    /// How it travels without NCCL.
    fn host_memory(self) -> String {
        format!(
            "{} go through host memory (TCP, shared memory inside a host)",
            self.traffic()
        )
    }
}

/// Whether a group can use NCCL: every member found it, and no two members share a GPU
/// (NCCL refuses a communicator with two ranks on one device). `gpus`: each member's
/// `(host, PCI domain, bus, device)`; `missing`: members without NCCL. `Err` says why not.
pub fn usable(
    kind: GroupKind,
    gpus: &[(u64, u32, u32, u32)],
    missing: usize,
) -> std::result::Result<(), String> {
    if missing > 0 {
        return Err(format!(
            "{missing} of the group's {} ranks found no NCCL",
            gpus.len()
        ));
    }
    for (i, a) in gpus.iter().enumerate() {
        if let Some(j) = gpus[..i].iter().position(|b| b == a) {
            return Err(format!(
                "{} {j} and {i} share one GPU (PCI {:04x}:{:02x}:{:02x}), which NCCL does not allow",
                kind.members(),
                a.1,
                a.2,
                a.3
            ));
        }
    }
    Ok(())
}

/// Decides with the other members of `group` (a TP group or a pipeline, `kind`; over its
/// host collectives) whether the group uses NCCL, and joins the communicator if so: every member brings `nccl` (the
/// library, or why it is missing), `host_key` (telling its host from the others') and the
/// PCI address of its GPU; rank 0 makes the unique id and broadcasts it; `init` joins (a
/// GPU rank binds its context and calls [`Nccl::init_rank`] with the id, size and rank).
/// All members agree: NCCL for all, or the host collectives for all — when a member lacks
/// NCCL, two share a GPU, rank 0 cannot make an id, or any member's init fails. Returns the
/// communicator (`None`: the host collectives) and the line that says which; it starts with
/// "warning: " when NCCL is not used.
///
/// Errors: a lost member of `group`.
pub fn negotiate(
    kind: GroupKind,
    group: &mut dyn super::Comm,
    nccl: Result<Nccl>,
    host_key: u64,
    pci: (u32, u32, u32),
    init: &mut dyn FnMut(&Nccl, &UniqueId, usize, usize) -> Result<Comm>,
) -> Result<(Option<Comm>, String)> {
    // Every value below 2^24 is exact in f32.
    let mine = [
        (host_key % (1 << 24)) as f32,
        pci.0 as f32,
        pci.1 as f32,
        pci.2 as f32,
        if nccl.is_ok() { 1.0 } else { 0.0 },
    ];
    let mut all = vec![0.0f32; mine.len() * group.size()];
    group.all_gather(&mine, &mut all)?;
    let gpus: Vec<(u64, u32, u32, u32)> = all
        .chunks_exact(mine.len())
        .map(|m| (m[0] as u64, m[1] as u32, m[2] as u32, m[3] as u32))
        .collect();
    let missing = all.chunks_exact(mine.len()).filter(|m| m[4] == 0.0).count();
    let host_memory = kind.host_memory();
    if let Err(why) = usable(kind, &gpus, missing) {
        let this_rank = match &nccl {
            Err(error) => format!("; this rank: {error:#}"),
            Ok(_) => String::new(),
        };
        return Ok((None, format!("warning: {host_memory}: {why}{this_rank}")));
    }
    // Usable: no member is missing NCCL, this one (whose `Err` counts in `missing`) included.
    let nccl = nccl?;
    // Rank 0 makes the id and sends it (empty: it could not).
    let mut id = if group.rank() == 0 {
        nccl.unique_id().map(|id| id.to_bytes()).unwrap_or_default()
    } else {
        Vec::new()
    };
    group.broadcast(&mut id, 0)?;
    if id.is_empty() {
        return Ok((
            None,
            format!("warning: {host_memory}: the group's rank 0 could not make an NCCL unique id"),
        ));
    }
    let id = UniqueId::from_bytes(&id)?;
    let joined = init(&nccl, &id, group.size(), group.rank());
    let mut failed = [if joined.is_err() { 1.0f32 } else { 0.0 }];
    group.all_reduce_sum(&mut failed)?;
    Ok(match joined {
        Ok(comm) if failed[0] == 0.0 => {
            let (major, minor, patch) = nccl.version().unwrap_or_default();
            (
                Some(comm),
                format!(
                    "{} through NCCL {major}.{minor}.{patch} on the GPUs",
                    kind.traffic()
                ),
            )
        }
        Ok(_) => (
            None,
            format!(
                "warning: {host_memory}: NCCL failed to start on {} of the group's {} ranks",
                failed[0],
                group.size()
            ),
        ),
        Err(error) => (
            None,
            format!("warning: {host_memory}: NCCL failed to start here: {error:#}"),
        ),
    })
}
