//! The collectives one rank of a tensor-parallel model queues in its passes (ARCHITECTURE.md, "Tensor
//! parallelism"): an in-place f32 sum over the ranks, and an all-gather of equal pieces, on the rank's
//! stream. `NcclRank` is a rank on a device of its own (NCCL's communicator, capturable into the decode
//! graphs); `SharedDevice` is a rank of several that share one device, summed in rank order with the
//! host waiting between steps: what lets a one-GPU machine run a split model and check it against the
//! unsplit one (its passes are not captured into graphs).

use std::os::raw::c_void;
use std::sync::{Arc, Barrier, Mutex};

use super::nccl;
use crate::cuda::{self, DeviceBuffer};
use crate::cudart::{self as rt, cudaStream_t};
use crate::kernels as kn;
use crate::status::Result;

/// One rank's side of the collectives (see the module note).
pub trait Collectives: Send {
    fn world(&self) -> usize;
    fn rank(&self) -> usize;
    /// Whether the collectives may be captured into a CUDA graph.
    fn capturable(&self) -> bool;

    /// `buf[0..len)` becomes the sum over the ranks of theirs, queued on `stream`.
    ///
    /// # Safety
    /// `buf` holds `len` f32 values on the rank's device and `stream` is a stream of that device; both
    /// stay valid until the stream has run the collective. Every rank makes the same calls in the same
    /// order.
    unsafe fn all_reduce_sum(&self, buf: *mut f32, len: usize, stream: cudaStream_t) -> Result<()>;

    /// `recv[r * len..(r + 1) * len)` becomes rank r's `send[0..len)`, queued on `stream`.
    ///
    /// # Safety
    /// As `all_reduce_sum`'s, with `recv` holding world × `len` values.
    unsafe fn all_gather(&self, send: *const f32, recv: *mut f32, len: usize, stream: cudaStream_t) -> Result<()>;
}

/// A rank on a device of its own: NCCL's communicator for it.
pub struct NcclRank {
    comm: nccl::Comm,
    rank: usize,
    world: usize,
}

impl NcclRank {
    /// A communicator a device over `devices` (ordinals, rank order), from one `ncclCommInitAll`.
    pub fn all(devices: &[i32]) -> Result<Vec<NcclRank>> {
        let nccl = nccl::load(devices.len())?;
        let world = devices.len();
        Ok(nccl.init_all(devices)?.into_iter().enumerate().map(|(rank, comm)| NcclRank { comm, rank, world }).collect())
    }
}

impl Collectives for NcclRank {
    fn world(&self) -> usize {
        self.world
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn capturable(&self) -> bool {
        true
    }

    unsafe fn all_reduce_sum(&self, buf: *mut f32, len: usize, stream: cudaStream_t) -> Result<()> {
        // SAFETY: the caller vouches for the buffer and the stream (this trait's contract).
        unsafe { self.comm.all_reduce_sum(buf, buf, len, stream) }
    }

    unsafe fn all_gather(&self, send: *const f32, recv: *mut f32, len: usize, stream: cudaStream_t) -> Result<()> {
        // SAFETY: the caller vouches for the buffers and the stream (this trait's contract).
        unsafe { self.comm.all_gather(send, recv, len, stream) }
    }
}

/// What the ranks sharing a device meet at: a barrier and each rank's published buffer address.
struct Meeting {
    barrier: Barrier,
    slots: Mutex<Vec<usize>>,
}

/// A rank of several on one device, each rank's passes run by a thread of its own (see the module note).
pub struct SharedDevice {
    meeting: Arc<Meeting>,
    rank: usize,
    world: usize,
    /// The rank's sum before it replaces its buffer (others still read that buffer meanwhile).
    sum: Mutex<Option<DeviceBuffer>>,
}

impl SharedDevice {
    /// `world` ranks that meet on the current device.
    pub fn ranks(world: usize) -> Vec<SharedDevice> {
        let meeting = Arc::new(Meeting { barrier: Barrier::new(world), slots: Mutex::new(vec![0; world]) });
        (0..world).map(|rank| SharedDevice { meeting: meeting.clone(), rank, world, sum: Mutex::new(None) }).collect()
    }

    /// Waits for `stream`'s work, publishes `ptr`, and returns every rank's once all have published.
    /// Every rank reaches the barrier whatever failed first, so none waits forever.
    fn meet(&self, ptr: usize, stream: cudaStream_t) -> Result<Vec<usize>> {
        // SAFETY: waits on a stream the caller owns.
        let synced = cuda::check(unsafe { rt::cudaStreamSynchronize(stream) }, "cudaStreamSynchronize");
        self.meeting.slots.lock().expect("no rank panics holding the slots")[self.rank] = ptr;
        self.meeting.barrier.wait();
        let all = self.meeting.slots.lock().expect("no rank panics holding the slots").clone();
        synced.map(|()| all)
    }

    /// Waits for `stream`'s reads of the other ranks' buffers, then for every rank's.
    fn part(&self, stream: cudaStream_t) -> Result<()> {
        // SAFETY: waits on a stream the caller owns.
        let done = cuda::check(unsafe { rt::cudaStreamSynchronize(stream) }, "cudaStreamSynchronize");
        self.meeting.barrier.wait();
        done
    }
}

fn copy(dst: *mut c_void, src: *const c_void, bytes: usize, stream: cudaStream_t) -> Result<()> {
    // SAFETY: both are device addresses of `bytes` bytes on the current device (the callers' contract).
    let code = unsafe { rt::cudaMemcpyAsync(dst, src, bytes, rt::cudaMemcpyDeviceToDevice, stream) };
    cuda::check(code, "cudaMemcpyAsync")
}

impl Collectives for SharedDevice {
    fn world(&self) -> usize {
        self.world
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn capturable(&self) -> bool {
        false
    }

    unsafe fn all_reduce_sum(&self, buf: *mut f32, len: usize, stream: cudaStream_t) -> Result<()> {
        let bytes = len * 4;
        let mut sum = self.sum.lock().expect("one thread a rank");
        let room = match sum.as_ref() {
            Some(b) if b.bytes() >= bytes => Ok(()),
            _ => DeviceBuffer::new(bytes).map(|b| *sum = Some(b)),
        };
        let at = sum.as_ref().map_or(std::ptr::null_mut(), |b| b.ptr() as *mut f32);
        // Every rank meets twice, failed or not, so none waits forever.
        let queued = room.and(self.meet(buf as usize, stream)).and_then(|all| {
            // Every rank adds in rank order, so every rank's sum has the same bits.
            copy(at.cast(), all[0] as *const c_void, bytes, stream)?;
            for &other in &all[1..] {
                // SAFETY: `at` and every published buffer hold `len` values on this device, and no rank
                // writes its buffer before `part` below has seen every rank's reads finish.
                cuda::check(unsafe { kn::hostembed_add(at, other as *const f32, at, len, stream) }, "hostembed_add")?;
            }
            Ok(())
        });
        let parted = self.part(stream);
        queued.and(parted)?;
        copy(buf.cast(), at as *const c_void, bytes, stream)
    }

    unsafe fn all_gather(&self, send: *const f32, recv: *mut f32, len: usize, stream: cudaStream_t) -> Result<()> {
        let bytes = len * 4;
        let queued = self.meet(send as usize, stream).and_then(|all| {
            for (r, &from) in all.iter().enumerate() {
                copy(recv.wrapping_add(r * len).cast(), from as *const c_void, bytes, stream)?;
            }
            Ok(())
        });
        let parted = self.part(stream);
        queued.and(parted)
    }
}
