//! How the CPU backend spreads work over threads (as many as the engine's `Tuning::cpu_threads`):
//! `Pool`, the threads a model keeps between its steps, and `run_parts`, which hands independent parts
//! to the pool installed on this thread (or to scoped threads where none is). A part always computes
//! the same outputs in the same order, whichever thread takes it, so results never depend on the count.
//!
//! A decode step is a few hundred short products, each split across the threads: starting threads for
//! each would cost more than the product, so a pool's workers wait for the next one, spinning for a
//! moment (the next product is usually microseconds away) and then asleep.

use std::cell::Cell;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The most threads the CPU backend starts; each holds scratch the plan counts.
pub const MAX_THREADS: usize = crate::tuning::MAX_CPU_THREADS;

/// Multiply-adds below which a second thread costs more than it saves: a pool's worker wakes in
/// microseconds, about what one core takes for this many.
pub(super) const MIN_THREAD_WORK: u64 = 1 << 15;

/// Threads worth starting for `work` multiply-adds split into `parts` parts, with `threads` allowed.
pub(super) fn threads_for(work: u64, parts: usize, threads: usize) -> usize {
    let worth = (work / MIN_THREAD_WORK).max(1);
    threads.min(parts).min(usize::try_from(worth).unwrap_or(usize::MAX)).max(1)
}

/// How long an idle worker spins for the next job before it sleeps.
const SPIN: Duration = Duration::from_micros(50);

/// A job as the workers see it: a borrowed closure with its lifetime erased (see `Pool::run`).
type Job = *const (dyn Fn(usize) + Sync);

/// What the caller and the workers share.
struct Shared {
    /// The current job, written only while no worker runs one (the protocol in `Pool::run`).
    slot: Mutex<Slot>,
    /// The slot's epoch, for the workers to watch without the lock.
    epoch: AtomicU64,
    /// Workers still running the current job.
    pending: AtomicUsize,
    /// A worker's job panicked; the caller panics once every worker is done.
    panicked: AtomicBool,
    stop: AtomicBool,
    /// Workers asleep (or about to be) on `wake`.
    sleepers: AtomicUsize,
    sleep: Mutex<()>,
    wake: Condvar,
}

/// A job, its epoch (bumped for each) and the workers that take part: indexes 1..=helpers.
struct Slot {
    epoch: u64,
    helpers: usize,
    job: Option<Job>,
}

// SAFETY: the job's pointee is `Sync`, and `Pool::run` keeps it alive until every worker is done with it.
unsafe impl Send for Slot {}

/// Threads kept between steps: `threads - 1` workers, started on the first job that wants them, and
/// the calling thread. Dropping the pool stops and joins them.
pub(super) struct Pool {
    threads: usize,
    shared: Arc<Shared>,
    /// Held while a job runs: a second caller at the same time runs its job alone.
    busy: Mutex<Vec<JoinHandle<()>>>,
}

impl Pool {
    pub(super) fn new(threads: usize) -> Pool {
        let shared = Arc::new(Shared {
            slot: Mutex::new(Slot { epoch: 0, helpers: 0, job: None }),
            epoch: AtomicU64::new(0),
            pending: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            sleep: Mutex::new(()),
            wake: Condvar::new(),
        });
        Pool { threads: threads.clamp(1, MAX_THREADS), shared, busy: Mutex::new(Vec::new()) }
    }

    pub(super) fn threads(&self) -> usize {
        self.threads
    }

    /// Runs `job(i)` for i in 0..=helpers, i = 0 on this thread and each other on a worker of its own;
    /// returns when all are done. Fewer run (never 0) where the OS refuses threads or another caller
    /// holds the pool: then this thread runs the indexes no worker took, in order.
    fn run(&self, helpers: usize, job: &(dyn Fn(usize) + Sync)) {
        let helpers = helpers.min(self.threads - 1);
        let mut workers = match self.busy.try_lock() {
            Ok(workers) if helpers > 0 => workers,
            _ => return (0..=helpers).for_each(job),
        };
        while workers.len() < helpers {
            let (shared, index) = (self.shared.clone(), workers.len() + 1);
            // The epoch before this job's: a worker that starts late still sees the job as new.
            let seen = shared.epoch.load(Ordering::SeqCst);
            match std::thread::Builder::new().name("hostembed-cpu".into()).spawn(move || work(&shared, index, seen)) {
                Ok(handle) => workers.push(handle),
                Err(_) => break,
            }
        }
        let started = helpers.min(workers.len());
        let shared = &*self.shared;
        // SAFETY: only the lifetime is erased; this function does not return (or unwind) before
        // `pending` is back to 0, i.e. before the last worker is done with the job.
        let erased: Job = unsafe { std::mem::transmute::<*const (dyn Fn(usize) + Sync + '_), Job>(job) };
        shared.pending.store(started, Ordering::SeqCst);
        {
            let mut slot = shared.slot.lock().unwrap_or_else(PoisonError::into_inner);
            *slot = Slot { epoch: slot.epoch + 1, helpers: started, job: Some(erased) };
            shared.epoch.store(slot.epoch, Ordering::SeqCst);
        }
        if shared.sleepers.load(Ordering::SeqCst) > 0 {
            let _lock = shared.sleep.lock().unwrap_or_else(PoisonError::into_inner);
            shared.wake.notify_all();
        }
        let mine = catch_unwind(AssertUnwindSafe(|| (0..=helpers).filter(|&i| i == 0 || i > started).for_each(job)));
        let spin_until = Instant::now() + SPIN;
        while shared.pending.load(Ordering::Acquire) > 0 {
            if Instant::now() < spin_until {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        shared.slot.lock().unwrap_or_else(PoisonError::into_inner).job = None;
        if let Err(panic) = mine {
            resume_unwind(panic);
        }
        if shared.panicked.swap(false, Ordering::SeqCst) {
            panic!("a CPU backend thread panicked");
        }
    }

    /// Runs `f` with this pool installed on this thread: `run_parts` inside it uses the pool.
    pub(super) fn install<T>(&self, f: impl FnOnce() -> T) -> T {
        struct Restore(*const Pool);
        impl Drop for Restore {
            fn drop(&mut self) {
                CURRENT.with(|c| c.set(self.0));
            }
        }
        let _restore = Restore(CURRENT.with(|c| c.replace(self)));
        f()
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        {
            let mut slot = self.shared.slot.lock().unwrap_or_else(PoisonError::into_inner);
            *slot = Slot { epoch: slot.epoch + 1, helpers: 0, job: None };
            self.shared.epoch.store(slot.epoch, Ordering::SeqCst);
        }
        {
            let _lock = self.shared.sleep.lock().unwrap_or_else(PoisonError::into_inner);
            self.shared.wake.notify_all();
        }
        let workers = std::mem::take(self.busy.get_mut().unwrap_or_else(PoisonError::into_inner));
        for worker in workers {
            // A worker catches its jobs' panics, so joining cannot fail in a way worth reporting.
            let _ = worker.join();
        }
    }
}

/// A worker's loop: wait for an epoch past `seen`, run the job if its index takes part, repeat.
fn work(shared: &Shared, index: usize, mut seen: u64) {
    loop {
        let spin_until = Instant::now() + SPIN;
        let mut spins = 0u32;
        while shared.epoch.load(Ordering::Acquire) == seen {
            spins = spins.wrapping_add(1);
            if !spins.is_multiple_of(64) || Instant::now() < spin_until {
                std::hint::spin_loop();
                continue;
            }
            let lock = shared.sleep.lock().unwrap_or_else(PoisonError::into_inner);
            shared.sleepers.fetch_add(1, Ordering::SeqCst);
            let lock = shared
                .wake
                .wait_while(lock, |_| shared.epoch.load(Ordering::SeqCst) == seen)
                .unwrap_or_else(PoisonError::into_inner);
            shared.sleepers.fetch_sub(1, Ordering::SeqCst);
            drop(lock);
        }
        // The slot, not the watched epoch, says which job this is and whether this worker is in it:
        // a worker late for one job sees the next one whole.
        let (epoch, job) = {
            let slot = shared.slot.lock().unwrap_or_else(PoisonError::into_inner);
            (slot.epoch, slot.job.filter(|_| index <= slot.helpers))
        };
        // Checked after the slot, not before: a worker late for the last job may read the slot `drop`
        // wrote, and would otherwise sleep on its epoch, the last there will be, while drop joins it.
        if shared.stop.load(Ordering::SeqCst) {
            return;
        }
        seen = epoch;
        if let Some(job) = job {
            // SAFETY: `Pool::run` keeps the job alive until `pending` reaches 0, which this worker's
            // decrement below is part of.
            let job = unsafe { &*job };
            if catch_unwind(AssertUnwindSafe(|| job(index))).is_err() {
                shared.panicked.store(true, Ordering::SeqCst);
            }
            shared.pending.fetch_sub(1, Ordering::Release);
        }
    }
}

thread_local! {
    /// The pool `run_parts` uses on this thread (null: none; scoped threads instead).
    static CURRENT: Cell<*const Pool> = const { Cell::new(std::ptr::null()) };
}

/// Runs `work` on every part, each with the scratch of the thread that takes it: this thread takes
/// `scratch[0]`, and another thread each further entry (while there are parts for it): the installed
/// pool's workers, else scoped threads started for this call. Threads take parts in order as they
/// finish others, so uneven parts even out. A thread the OS refuses leaves its share to the rest.
pub(super) fn run_parts<P: Send, S: Send>(parts: Vec<P>, scratch: &mut [S], work: impl Fn(P, &mut S) + Sync) {
    let (mine, others) = scratch.split_first_mut().expect("run_parts: no scratch for this thread");
    let slots: Vec<Mutex<Option<P>>> = parts.into_iter().map(|p| Mutex::new(Some(p))).collect();
    let next = AtomicUsize::new(0);
    let drain = |s: &mut S| {
        while let Some(slot) = slots.get(next.fetch_add(1, Ordering::Relaxed)) {
            // Each slot is taken once: the counter hands every index to one thread only.
            if let Some(part) = slot.lock().unwrap_or_else(PoisonError::into_inner).take() {
                work(part, s);
            }
        }
    };
    let helpers = others.len().min(slots.len().saturating_sub(1));
    if helpers == 0 {
        drain(mine);
        return;
    }
    let pool = CURRENT.with(Cell::get);
    if !pool.is_null() {
        let scratch = ScratchSlots(scratch.as_mut_ptr());
        // SAFETY: the installed pool outlives `install`'s closure, which this call runs inside.
        let pool = unsafe { &*pool };
        pool.run(helpers, &|i| {
            // SAFETY: `Pool::run` gives each index in 0..=helpers to one thread only, and
            // helpers < scratch.len(): no two threads hold the same entry.
            let s = unsafe { &mut *scratch.at(i) };
            drain(s)
        });
        return;
    }
    std::thread::scope(|scope| {
        for s in others.iter_mut().take(helpers) {
            let drain = &drain;
            // A refused thread is no error: the parts it would have taken are drained by the others.
            let _ = std::thread::Builder::new().spawn_scoped(scope, move || drain(s));
        }
        drain(mine);
    });
}

/// Each thread's scratch entry, reached by index from the pool's threads.
struct ScratchSlots<S>(*mut S);
// SAFETY: entries are `Send`, and each index is used by one thread at a time (see `run_parts`).
unsafe impl<S: Send> Sync for ScratchSlots<S> {}

impl<S> ScratchSlots<S> {
    fn at(&self, i: usize) -> *mut S {
        self.0.wrapping_add(i)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_part_runs_once_whatever_the_thread_count() {
        for threads in [1, 2, 5] {
            let mut scratch = vec![0usize; threads];
            let seen: Vec<AtomicUsize> = (0..37).map(|_| AtomicUsize::new(0)).collect();
            run_parts((0..37).collect(), &mut scratch, |i: usize, ran: &mut usize| {
                seen[i].fetch_add(1, Ordering::Relaxed);
                *ran += 1;
            });
            assert!(seen.iter().all(|n| n.load(Ordering::Relaxed) == 1), "{threads} threads");
            assert_eq!(scratch.iter().sum::<usize>(), 37);
        }
    }

    #[test]
    fn a_pool_runs_each_index_once_a_job_awake_or_asleep() {
        let pool = Pool::new(3);
        for job in 0..300 {
            let counts: Vec<AtomicUsize> = (0..3).map(|_| AtomicUsize::new(0)).collect();
            pool.run(2, &|i| {
                counts[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(counts.iter().all(|c| c.load(Ordering::Relaxed) == 1), "job {job}");
            if job % 60 == 0 {
                // Past the spin: the next job has to wake the workers.
                std::thread::sleep(SPIN * 3);
            }
        }
    }

    #[test]
    fn run_parts_runs_every_part_once_on_an_installed_pool() {
        let pool = Pool::new(4);
        pool.install(|| {
            for _ in 0..50 {
                let mut scratch = vec![0usize; 4];
                let seen: Vec<AtomicUsize> = (0..37).map(|_| AtomicUsize::new(0)).collect();
                run_parts((0..37).collect(), &mut scratch, |i: usize, ran: &mut usize| {
                    seen[i].fetch_add(1, Ordering::Relaxed);
                    *ran += 1;
                });
                assert!(seen.iter().all(|n| n.load(Ordering::Relaxed) == 1));
                assert_eq!(scratch.iter().sum::<usize>(), 37);
            }
        });
    }

    #[test]
    fn a_panic_on_a_worker_reaches_the_caller_and_the_pool_goes_on() {
        let pool = Pool::new(2);
        let caught = std::panic::catch_unwind(AssertUnwindSafe(|| {
            pool.run(1, &|i| {
                if i == 1 {
                    panic!("worker part fails");
                }
            })
        }));
        assert!(caught.is_err());
        let ran = AtomicUsize::new(0);
        pool.run(1, &|_| {
            ran.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(ran.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn a_pool_dropped_right_after_a_job_its_idle_workers_watched_joins_them() {
        // Workers outside a one-helper job still wake for its epoch; dropping the pool while they read
        // its slot once left one asleep on drop's epoch, and drop joined it for ever.
        let (done, finished) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for _ in 0..3000 {
                let pool = Pool::new(8);
                pool.run(7, &|_| {});
                pool.run(1, &|_| {});
                drop(pool);
            }
            let _ = done.send(());
        });
        assert!(finished.recv_timeout(Duration::from_secs(120)).is_ok(), "a pool's drop never returned");
    }

    #[test]
    fn small_work_stays_on_one_thread() {
        assert_eq!(threads_for(10, 8, 8), 1);
        assert_eq!(threads_for(MIN_THREAD_WORK * 3, 8, 8), 3);
        assert_eq!(threads_for(u64::MAX, 2, 8), 2);
    }
}
