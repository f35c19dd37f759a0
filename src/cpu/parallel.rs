//! How the CPU backend spreads work over threads: the thread count (HOSTEMBED_CPU_THREADS or every
//! core), and `run_parts`, which hands independent parts to scoped threads. A part always computes the
//! same outputs in the same order, whichever thread takes it, so results never depend on the count.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};

/// The environment variable that sets the CPU backend's thread count (a positive number).
pub const THREADS_ENV: &str = "HOSTEMBED_CPU_THREADS";

/// The most threads the CPU backend starts; each holds scratch the plan counts.
pub const MAX_THREADS: usize = 256;

/// Multiply-adds below which a second thread costs more to start than it saves.
pub(super) const MIN_THREAD_WORK: u64 = 1 << 18;

/// Threads the CPU backend splits its work over: HOSTEMBED_CPU_THREADS when it is a positive number,
/// else the cores this process may use; at most `MAX_THREADS`.
pub fn thread_count() -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    threads_from(std::env::var(THREADS_ENV).ok().as_deref(), cores)
}

/// The thread count for a setting of HOSTEMBED_CPU_THREADS (anything but a positive number is no
/// setting) on a host with `cores` cores.
fn threads_from(setting: Option<&str>, cores: usize) -> usize {
    let set = setting.and_then(|v| v.trim().parse::<usize>().ok()).filter(|&n| n > 0);
    set.unwrap_or(cores).clamp(1, MAX_THREADS)
}

/// Threads worth starting for `work` multiply-adds split into `parts` parts, with `threads` allowed.
pub(super) fn threads_for(work: u64, parts: usize, threads: usize) -> usize {
    let worth = (work / MIN_THREAD_WORK).max(1);
    threads.min(parts).min(usize::try_from(worth).unwrap_or(usize::MAX)).max(1)
}

/// Runs `work` on every part, each with the scratch of the thread that takes it: this thread takes
/// `scratch[0]`, and a scoped thread is started for each further entry (while there are parts for
/// it). Threads take parts in order as they finish others, so uneven parts even out. A thread the OS
/// refuses leaves its share to the rest.
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
    std::thread::scope(|scope| {
        for s in others.iter_mut().take(helpers) {
            let drain = &drain;
            // A refused thread is no error: the parts it would have taken are drained by the others.
            let _ = std::thread::Builder::new().spawn_scoped(scope, move || drain(s));
        }
        drain(mine);
    });
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
    fn the_setting_overrides_the_cores_when_it_is_a_positive_number() {
        assert_eq!(threads_from(Some("3"), 8), 3);
        assert_eq!(threads_from(Some(" 12 "), 2), 12);
        assert_eq!(threads_from(None, 8), 8);
        for ignored in ["0", "-2", "two", ""] {
            assert_eq!(threads_from(Some(ignored), 6), 6, "{ignored:?}");
        }
        assert_eq!(threads_from(Some("100000"), 2), MAX_THREADS);
        assert_eq!(threads_from(None, 0), 1);
    }

    #[test]
    fn small_work_stays_on_one_thread() {
        assert_eq!(threads_for(10, 8, 8), 1);
        assert_eq!(threads_for(MIN_THREAD_WORK * 3, 8, 8), 3);
        assert_eq!(threads_for(u64::MAX, 2, 8), 2);
    }
}
