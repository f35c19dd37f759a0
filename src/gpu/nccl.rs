//! NCCL, the collectives tensor parallelism needs (ARCHITECTURE.md, "Tensor parallelism"), loaded at
//! run time with dlopen and never linked, as cuBLASLt is (`blas.rs`): the library links, loads and runs
//! where NCCL is not installed, and only an engine over more than one device asks for it. Its absence
//! is then UNSUPPORTED with dlopen's reason, never a crash.
//!
//! The declarations are written by hand from `nccl.h` (NCCL 2.x keeps these signatures and values):
//! the version, a communicator per device of this process (`ncclCommInitAll`) or per process across
//! hosts (`ncclGetUniqueId` / `ncclCommInitRank`), f32 all-reduce (sum) and all-gather on a CUDA
//! stream, and group calls so one thread can queue a collective on every device.

use std::ffi::CStr;
use std::os::raw::{c_char, c_int, c_void};
use std::sync::OnceLock;

use super::blas::{first_library, symbol};
use crate::cudart::cudaStream_t;
use crate::status::Result;
use crate::{bail, err};

/// Tried in order: the soname NCCL 2 installs, then the development link.
const LIBRARY_NAMES: [&str; 2] = ["libnccl.so.2", "libnccl.so"];

// nccl.h values.
type NcclResult = c_int;
const NCCL_SUCCESS: NcclResult = 0;
const NCCL_FLOAT32: c_int = 7;
const NCCL_SUM: c_int = 0;

/// `ncclComm_t`: an opaque pointer.
type RawComm = *mut c_void;

/// `ncclUniqueId`: 128 opaque bytes one process makes and every rank's process is handed.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct UniqueId {
    pub internal: [c_char; 128],
}
const _: () = assert!(std::mem::size_of::<UniqueId>() == 128);

/// The entry points, resolved once a process.
struct Api {
    get_version: unsafe extern "C" fn(*mut c_int) -> NcclResult,
    get_error_string: unsafe extern "C" fn(NcclResult) -> *const c_char,
    get_unique_id: unsafe extern "C" fn(*mut UniqueId) -> NcclResult,
    comm_init_rank: unsafe extern "C" fn(*mut RawComm, c_int, UniqueId, c_int) -> NcclResult,
    comm_init_all: unsafe extern "C" fn(*mut RawComm, c_int, *const c_int) -> NcclResult,
    comm_destroy: unsafe extern "C" fn(RawComm) -> NcclResult,
    all_reduce:
        unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, RawComm, cudaStream_t) -> NcclResult,
    all_gather: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, RawComm, cudaStream_t) -> NcclResult,
    group_start: unsafe extern "C" fn() -> NcclResult,
    group_end: unsafe extern "C" fn() -> NcclResult,
}

/// The loaded library: its entry points, the file they came from and its version (never unloaded: its
/// communicators' threads may outlive any one engine).
pub struct Nccl {
    api: Api,
    name: String,
    version: i32,
}

// SAFETY: function pointers into a library that stays loaded; NCCL's entry points may be called from any
// thread (a communicator itself is used by one thread at a time: `Comm` is not Sync).
unsafe impl Send for Nccl {}
// SAFETY: as for Send.
unsafe impl Sync for Nccl {}

/// The first of `names` that opens and has every entry point, or every reason why none did.
fn load_from(names: &[&str]) -> std::result::Result<Nccl, String> {
    first_library(names, |lib, name| {
        // SAFETY: each type below is the signature nccl.h declares for that name.
        let api = unsafe {
            Api {
                get_version: symbol(lib, c"ncclGetVersion")?,
                get_error_string: symbol(lib, c"ncclGetErrorString")?,
                get_unique_id: symbol(lib, c"ncclGetUniqueId")?,
                comm_init_rank: symbol(lib, c"ncclCommInitRank")?,
                comm_init_all: symbol(lib, c"ncclCommInitAll")?,
                comm_destroy: symbol(lib, c"ncclCommDestroy")?,
                all_reduce: symbol(lib, c"ncclAllReduce")?,
                all_gather: symbol(lib, c"ncclAllGather")?,
                group_start: symbol(lib, c"ncclGroupStart")?,
                group_end: symbol(lib, c"ncclGroupEnd")?,
            }
        };
        let mut version: c_int = 0;
        // SAFETY: ncclGetVersion writes one int through a valid pointer.
        let status = unsafe { (api.get_version)(&mut version) };
        if status != NCCL_SUCCESS {
            return Err(format!("ncclGetVersion returned {status}"));
        }
        Ok(Nccl { api, name: name.to_string(), version })
    })
}

/// NCCL, loaded once a process, for an engine over `devices` devices; UNSUPPORTED with the reason when
/// it cannot be loaded.
pub fn load(devices: usize) -> Result<&'static Nccl> {
    static LOADED: OnceLock<std::result::Result<Nccl, String>> = OnceLock::new();
    LOADED.get_or_init(|| load_from(&LIBRARY_NAMES)).as_ref().map_err(|why| {
        err!(
            Unsupported,
            "tensor parallelism over {devices} devices needs NCCL ({}), which did not load: {why}",
            LIBRARY_NAMES[0]
        )
    })
}

impl Nccl {
    /// The file it was loaded from.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// `ncclGetVersion`'s code: major × 10000 + minor × 100 + patch (2.19.3 is 21903).
    pub fn version(&self) -> i32 {
        self.version
    }

    fn check(&self, status: NcclResult, what: &str) -> Result<()> {
        if status == NCCL_SUCCESS {
            return Ok(());
        }
        // SAFETY: ncclGetErrorString returns a static NUL-terminated string for any code.
        let text = unsafe { (self.api.get_error_string)(status) };
        let text = if text.is_null() {
            "unknown error".into()
        } else {
            // SAFETY: non-NULL and NUL-terminated (above).
            unsafe { CStr::from_ptr(text) }.to_string_lossy()
        };
        bail!(CudaError, "{what}: NCCL error {status} ({text})")
    }

    /// One communicator a device of this process, rank i on `devices[i]`.
    pub fn init_all(&'static self, devices: &[i32]) -> Result<Vec<Comm>> {
        let n = c_int::try_from(devices.len()).map_err(|_| err!(InvalidArgument, "{} devices", devices.len()))?;
        let mut raw = vec![std::ptr::null_mut(); devices.len()];
        // SAFETY: room for one communicator a device, and the device list of that length.
        let status = unsafe { (self.api.comm_init_all)(raw.as_mut_ptr(), n, devices.as_ptr()) };
        self.check(status, &format!("ncclCommInitAll over devices {devices:?}"))?;
        Ok(raw.into_iter().map(|raw| Comm { nccl: self, raw }).collect())
    }

    /// A new id for `init_rank`, made by one process and handed to the others (past one host).
    pub fn unique_id(&self) -> Result<UniqueId> {
        let mut id = UniqueId { internal: [0; 128] };
        // SAFETY: ncclGetUniqueId writes 128 bytes through a valid pointer.
        self.check(unsafe { (self.api.get_unique_id)(&mut id) }, "ncclGetUniqueId")?;
        Ok(id)
    }

    /// Rank `rank` of `ranks` of the communicator `id` names, on the current device.
    pub fn init_rank(&'static self, id: UniqueId, ranks: i32, rank: i32) -> Result<Comm> {
        let mut raw = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; the id is passed by value as nccl.h declares.
        let status = unsafe { (self.api.comm_init_rank)(&mut raw, ranks, id, rank) };
        self.check(status, &format!("ncclCommInitRank (rank {rank} of {ranks})"))?;
        Ok(Comm { nccl: self, raw })
    }

    /// `f` between ncclGroupStart and ncclGroupEnd: one thread's collectives on several devices' communicators
    /// are then queued as one operation (without the group, the first would wait for the others).
    pub fn group<T>(&self, f: impl FnOnce() -> Result<T>) -> Result<T> {
        // SAFETY: no arguments; pairs with the ncclGroupEnd below on every path.
        self.check(unsafe { (self.api.group_start)() }, "ncclGroupStart")?;
        let out = f();
        // SAFETY: closes the group opened above.
        let end = self.check(unsafe { (self.api.group_end)() }, "ncclGroupEnd");
        let out = out?;
        end.map(|()| out)
    }
}

/// A communicator of one rank; destroyed on drop.
pub struct Comm {
    nccl: &'static Nccl,
    raw: RawComm,
}

// SAFETY: a communicator may move to another thread; it is used by one at a time (no Sync).
unsafe impl Send for Comm {}

impl Comm {
    /// `recv` = the sum over every rank of its `send`, `count` f32 values, queued on `stream`
    /// (in place when the two are the same).
    ///
    /// # Safety
    /// `send` and `recv` are device addresses of `count` f32 values on this communicator's device, and
    /// `stream` is a stream of that device; they stay valid until the stream has run the collective.
    pub unsafe fn all_reduce_sum(
        &self,
        send: *const f32,
        recv: *mut f32,
        count: usize,
        stream: cudaStream_t,
    ) -> Result<()> {
        // SAFETY: the caller vouches for the addresses and the stream.
        let status = unsafe {
            (self.nccl.api.all_reduce)(send.cast(), recv.cast(), count, NCCL_FLOAT32, NCCL_SUM, self.raw, stream)
        };
        self.nccl.check(status, "ncclAllReduce")
    }

    /// `recv` = every rank's `count` f32 values of `send`, rank 0's first, queued on `stream`.
    ///
    /// # Safety
    /// `send` holds `count` f32 values and `recv` ranks × `count`, both device addresses on this
    /// communicator's device, and `stream` is a stream of that device; they stay valid until the stream
    /// has run the collective.
    pub unsafe fn all_gather(
        &self,
        send: *const f32,
        recv: *mut f32,
        count: usize,
        stream: cudaStream_t,
    ) -> Result<()> {
        // SAFETY: the caller vouches for the addresses and the stream.
        let status =
            unsafe { (self.nccl.api.all_gather)(send.cast(), recv.cast(), count, NCCL_FLOAT32, self.raw, stream) };
        self.nccl.check(status, "ncclAllGather")
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        // SAFETY: a communicator this owner made and nothing else destroys; its status has nowhere to go.
        unsafe { (self.nccl.api.comm_destroy)(self.raw) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::Status;

    /// Where NCCL is installed it loads with a 2.x version; elsewhere (this library's CPU machines) the
    /// refusal is UNSUPPORTED, names the file and the device count, and nothing crashes.
    #[test]
    fn loading_gives_nccl_or_a_clear_refusal() {
        match load(2) {
            Ok(nccl) => {
                assert!((20000..30000).contains(&nccl.version()), "version {}", nccl.version());
                assert!(nccl.name().contains("libnccl"), "{}", nccl.name());
            }
            Err(e) => {
                assert_eq!(e.status, Status::Unsupported);
                assert!(e.message.contains("over 2 devices needs NCCL (libnccl.so.2)"), "{}", e.message);
            }
        }
    }

    #[test]
    fn a_missing_file_or_entry_point_is_named() {
        let Err(why) = load_from(&["libnccl-not-installed.so.2"]) else { panic!("loaded a file that is not there") };
        assert!(why.contains("libnccl-not-installed.so.2"), "{why}");
        // A library that opens but is not NCCL: the first missing entry point is named.
        let Err(why) = load_from(&["libc.so.6"]) else { panic!("libc loaded as NCCL") };
        assert!(why.contains("libc.so.6: no ncclGetVersion in it"), "{why}");
    }
}
