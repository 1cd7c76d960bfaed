//! A team of worker threads for the forward pass's data-parallel loops, which wait for
//! work spinning rather than sleeping.
//!
//! A batched decode step opens about a dozen parallel regions per layer (norms, activation
//! quantization, the matrix products, attention, SwiGLU), a few microseconds to a few hundred
//! each, with short serial stretches between them (RoPE, KV stores, residual adds). A rayon
//! worker that finds no work yields and soon sleeps; the next region then waits for it to be
//! woken, which on a virtual machine (a halted vCPU woken by an inter-processor interrupt)
//! costs tens of microseconds: measured here, a 5 µs serial gap before each `gate/up`
//! product at batch 16 made the product ~35 µs (25%) slower. llama.cpp's CPU backend avoids
//! this the same way (`ggml-cpu.c`): `ggml_barrier` spins between a graph's operations, and
//! between graphs `ggml_graph_compute_poll_for_work` spins `1024 · 128 · poll` rounds
//! before it waits on a condition variable.
//!
//! The team's workers spin for up to [`SPIN_SECS`] after their last job, then sleep on a
//! condition variable (an idle server burns no CPU). The thread that starts a job takes
//! part in it. Code reaches the team through [`Team::enter`]: inside it, [`for_each`],
//! [`for_each_mut`] and [`for_each_chunk_mut`] on that thread run on the team; anywhere
//! else (another thread, a job inside a job, a team busy with another caller) they fall
//! back to rayon, so the results never depend on where they ran.

use std::cell::{Cell, UnsafeCell};
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, TryLockError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rayon::prelude::*;

/// How long an idle worker spins before it sleeps, seconds: longer than the serial
/// stretches inside a forward pass (RoPE and KV stores of a batch-16 step take ~15–35 µs),
/// short enough that a worker idle between steps, or sharing the cores with other
/// processes (the test suite runs several servers at once), gives them back soon: with
/// 2 ms the integration tests took 55 s on two cores instead of 34–42 s, with 100 µs
/// 38–43 s.
pub(crate) const SPIN_SECS: f64 = 0.0001;

/// `state`'s bit that closes a job to workers not yet in it.
const CLOSED: usize = 1 << (usize::BITS - 1);

/// A job's tasks, as the workers see it (the borrow's lifetime erased: the thread that
/// posted the job waits until every worker in it is done before it returns).
type Job = *const (dyn Fn(usize) + Sync + 'static);

/// What the team's threads share.
struct Shared {
    /// Bumped when a job is posted (and at shutdown).
    epoch: AtomicU64,
    /// Workers in the current job, plus [`CLOSED`] once its poster stops admitting them.
    state: AtomicUsize,
    /// Workers of the current job that are done with it.
    finished: AtomicUsize,
    /// The next task index to claim.
    next: AtomicUsize,
    /// The current job and its task count; written only while no worker is in a job.
    job: UnsafeCell<(Job, usize)>,
    /// Whether a worker's task panicked in the current job.
    panicked: AtomicBool,
    shutdown: AtomicBool,
    /// Workers asleep, and what they sleep on.
    sleepers: Mutex<usize>,
    wake: Condvar,
    /// Held by the thread running a job, so two callers never share the job slot.
    submit: Mutex<()>,
}

// SAFETY: `job` is written only by the holder of `submit` while no worker is inside a job
// (the `state`/`finished` protocol), and read only by workers inside one; the closure it
// points to is `Sync`, so calling it from any thread is sound.
unsafe impl Sync for Shared {}
// SAFETY: as above; the pointer is only dereferenced under that protocol.
unsafe impl Send for Shared {}

/// A fixed team of `threads − 1` worker threads plus the thread that runs each job.
pub(crate) struct Team {
    shared: Arc<Shared>,
    threads: usize,
    handles: Vec<JoinHandle<()>>,
}

thread_local! {
    /// The team [`Team::enter`] made current on this thread, and whether a job of it is
    /// running here.
    static CURRENT: Cell<Option<*const Team>> = const { Cell::new(None) };
    static IN_JOB: Cell<bool> = const { Cell::new(false) };
}

impl Team {
    /// Starts `threads − 1` workers (none for one thread). Errors: the OS refuses a thread.
    pub(crate) fn new(threads: usize) -> std::io::Result<Team> {
        let threads = threads.max(1);
        let noop: &(dyn Fn(usize) + Sync) = &|_| {};
        let shared = Arc::new(Shared {
            epoch: AtomicU64::new(0),
            state: AtomicUsize::new(CLOSED),
            finished: AtomicUsize::new(0),
            next: AtomicUsize::new(0),
            // SAFETY: a `'static` closure; only its lifetime is spelled out.
            job: UnsafeCell::new((noop as Job, 0)),
            panicked: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            sleepers: Mutex::new(0),
            wake: Condvar::new(),
            submit: Mutex::new(()),
        });
        let handles = (1..threads)
            .map(|i| {
                let shared = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name(format!("infer-team-{i}"))
                    .spawn(move || work(&shared))
            })
            .collect::<std::io::Result<Vec<_>>>()?;
        Ok(Team {
            shared,
            threads,
            handles,
        })
    }

    /// Threads a job runs on (the workers and the caller).
    pub(crate) fn threads(&self) -> usize {
        self.threads
    }

    /// Runs `f` with this team current on this thread (see the module documentation).
    pub(crate) fn enter<T>(&self, f: impl FnOnce() -> T) -> T {
        struct Restore(Option<*const Team>);
        impl Drop for Restore {
            fn drop(&mut self) {
                CURRENT.with(|c| c.set(self.0));
            }
        }
        let _restore = Restore(CURRENT.with(|c| c.replace(Some(self as *const Team))));
        f()
    }

    /// Runs `f(i)` for every `i < n_tasks` on the team, each index once; returns when all
    /// are done. A panic in any task is re-raised here once every thread has left the job.
    fn run(&self, n_tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        let s = &*self.shared;
        let _guard = match s.submit.try_lock() {
            Ok(guard) => guard,
            // A job that panicked held it; it guards no data.
            Err(TryLockError::Poisoned(e)) => e.into_inner(),
            // Another thread's job is running on the team: share rayon instead.
            Err(TryLockError::WouldBlock) => {
                (0..n_tasks).into_par_iter().for_each(f);
                return;
            }
        };
        // SAFETY: we hold `submit` and `state` is CLOSED with every joined worker finished
        // (the previous job waited for them), so no worker reads `job` now.
        unsafe {
            *s.job.get() = (
                std::mem::transmute::<&(dyn Fn(usize) + Sync), Job>(f),
                n_tasks,
            );
        }
        s.next.store(0, Ordering::Relaxed);
        s.finished.store(0, Ordering::Relaxed);
        s.state.store(0, Ordering::Release);
        s.epoch.fetch_add(1, Ordering::SeqCst);
        if *lock(&s.sleepers) > 0 {
            s.wake.notify_all();
        }
        IN_JOB.with(|j| j.set(true));
        let mine = catch_unwind(AssertUnwindSafe(|| claim(s, f, n_tasks)));
        IN_JOB.with(|j| j.set(false));
        let joined = s.state.fetch_or(CLOSED, Ordering::AcqRel) & !CLOSED;
        // The workers in the job are running its last tasks: spin, yielding the core only
        // if one of them was descheduled mid-task.
        let start = Instant::now();
        let mut spins = 0u32;
        while s.finished.load(Ordering::Acquire) < joined {
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(64) && start.elapsed() > Duration::from_micros(200) {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        if let Err(payload) = mine {
            resume_unwind(payload);
        }
        if s.panicked.swap(false, Ordering::Relaxed) {
            panic!("a task of the engine's thread team panicked");
        }
    }
}

impl Drop for Team {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        self.shared.epoch.fetch_add(1, Ordering::SeqCst);
        {
            let _sleepers = lock(&self.shared.sleepers);
            self.shared.wake.notify_all();
        }
        for handle in self.handles.drain(..) {
            let _ = handle.join();
        }
    }
}

/// A poisoned lock's data is still a plain counter: take it.
fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

/// Claims and runs task indices until none are left.
fn claim(s: &Shared, f: &(dyn Fn(usize) + Sync), n_tasks: usize) {
    loop {
        let i = s.next.fetch_add(1, Ordering::Relaxed);
        if i >= n_tasks {
            return;
        }
        f(i);
    }
}

/// A worker: wait for a job (spinning, then asleep), join it if still open, run tasks.
fn work(s: &Shared) {
    let mut seen = s.epoch.load(Ordering::Acquire);
    loop {
        let mut idle_since = Instant::now();
        let mut spins = 0u32;
        loop {
            let epoch = s.epoch.load(Ordering::Acquire);
            if s.shutdown.load(Ordering::Relaxed) {
                return;
            }
            if epoch != seen {
                seen = epoch;
                break;
            }
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(1024) && idle_since.elapsed().as_secs_f64() > SPIN_SECS {
                let mut sleepers = lock(&s.sleepers);
                *sleepers += 1;
                while s.epoch.load(Ordering::SeqCst) == seen && !s.shutdown.load(Ordering::SeqCst) {
                    sleepers = s.wake.wait(sleepers).unwrap_or_else(|e| e.into_inner());
                }
                *sleepers -= 1;
                idle_since = Instant::now();
            } else {
                std::hint::spin_loop();
            }
        }
        // Join unless the poster has closed the job (it is then finishing without us).
        let mut state = s.state.load(Ordering::Acquire);
        let joined = loop {
            if state & CLOSED != 0 {
                break false;
            }
            match s.state.compare_exchange_weak(
                state,
                state + 1,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => break true,
                Err(now) => state = now,
            }
        };
        if !joined {
            continue;
        }
        // SAFETY: we are in the job, so the poster waits for us before it returns; `job`
        // stays as written until then.
        let (job, n_tasks) = unsafe { *s.job.get() };
        // SAFETY: the job's closure outlives the job (the poster waits for every worker, as above).
        let job = unsafe { &*job };
        if catch_unwind(AssertUnwindSafe(|| claim(s, job, n_tasks))).is_err() {
            s.panicked.store(true, Ordering::Relaxed);
        }
        s.finished.fetch_add(1, Ordering::Release);
    }
}

/// The current team of this thread, unless it is already running a job here.
fn current() -> Option<&'static Team> {
    if IN_JOB.with(|j| j.get()) {
        return None;
    }
    // SAFETY: `enter` keeps the team current only while its borrow of the team lives.
    CURRENT.with(|c| c.get()).map(|team| unsafe { &*team })
}

/// Threads a parallel loop here runs on: the current team's, else rayon's.
pub(crate) fn current_threads() -> usize {
    current().map_or_else(rayon::current_num_threads, Team::threads)
}

/// `f(i)` for every `i < n_tasks`, in parallel: on the current team, else on rayon. The
/// caller must not depend on which thread runs which index.
pub(crate) fn for_each(n_tasks: usize, f: impl Fn(usize) + Sync) {
    match current() {
        Some(team) if n_tasks > 1 && team.threads > 1 => team.run(n_tasks, &f),
        _ if n_tasks > 1 => (0..n_tasks).into_par_iter().for_each(&f),
        _ => (0..n_tasks).for_each(f),
    }
}

/// `f(i, &mut items[i])` for every item, in parallel (see [`for_each`]).
pub(crate) fn for_each_mut<T: Send>(items: &mut [T], f: impl Fn(usize, &mut T) + Sync) {
    for_each_chunk_mut(items, 1, |i, item| f(i, &mut item[0]));
}

/// `f(i, chunk)` for the `i`-th `chunk_len`-sized chunk of `items` (the last may be
/// shorter), in parallel (see [`for_each`]): `items.chunks_mut(chunk_len)` without
/// collecting the chunks first.
///
/// Panics (a bug, not input): `chunk_len == 0`.
pub(crate) fn for_each_chunk_mut<T: Send>(
    items: &mut [T],
    chunk_len: usize,
    f: impl Fn(usize, &mut [T]) + Sync,
) {
    assert!(chunk_len > 0, "chunks of zero items");
    struct Items<T>(*mut T);
    // SAFETY: each chunk index is handed to exactly one task, and chunks do not overlap.
    unsafe impl<T: Send> Sync for Items<T> {}
    let len = items.len();
    let base = Items(items.as_mut_ptr());
    let base = &base;
    for_each(len.div_ceil(chunk_len), move |i| {
        let start = i * chunk_len;
        // SAFETY: `start < len` (i < the chunk count), the chunk ends within `items`, and
        // chunk `i` is this task's alone (above).
        let chunk = unsafe {
            std::slice::from_raw_parts_mut(base.0.add(start), chunk_len.min(len - start))
        };
        f(i, chunk)
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every index (and every chunk, the last one short) runs exactly once, on several
    /// threads, job after job (with pauses longer than the spin so the workers sleep and
    /// are woken), and results match a serial loop.
    #[test]
    fn every_task_runs_once_across_many_jobs() {
        let team = Team::new(3).expect("threads");
        team.enter(|| {
            for round in 0..200usize {
                let n = round % 37;
                let mut out = vec![0usize; n];
                for_each_mut(&mut out, |i, v| *v = i * i + round);
                let want: Vec<usize> = (0..n).map(|i| i * i + round).collect();
                assert_eq!(out, want, "round {round}");
                let mut chunked = vec![0usize; n];
                for_each_chunk_mut(&mut chunked, 5, |c, chunk| {
                    for (j, v) in chunk.iter_mut().enumerate() {
                        *v = (5 * c + j) * (5 * c + j) + round;
                    }
                });
                assert_eq!(chunked, want, "chunks, round {round}");
                if round % 50 == 0 {
                    std::thread::sleep(Duration::from_secs_f64(SPIN_SECS * 3.0));
                }
            }
            // Each task waits until a second thread has taken one (or 10 s have passed, on
            // a machine too loaded to schedule the workers, where the assert then fails).
            let threads = Mutex::new(std::collections::HashSet::new());
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            for_each(200, |_| {
                lock(&threads).insert(std::thread::current().id());
                while lock(&threads).len() < 2 && std::time::Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(1));
                }
            });
            assert!(lock(&threads).len() > 1, "the workers took part");
        });
    }

    /// A job inside a job runs (on rayon) instead of deadlocking, and outside `enter` the
    /// same calls still work.
    #[test]
    fn nested_and_outside_jobs_fall_back() {
        let team = Team::new(2).expect("threads");
        let total = AtomicUsize::new(0);
        team.enter(|| {
            for_each(4, |_| {
                for_each(5, |_| {
                    total.fetch_add(1, Ordering::Relaxed);
                });
            })
        });
        assert_eq!(total.load(Ordering::Relaxed), 20);
        for_each(3, |_| {
            total.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(total.load(Ordering::Relaxed), 23);
    }

    /// A panicking task reaches the caller, and the team keeps working afterwards.
    #[test]
    fn a_task_panic_reaches_the_caller() {
        let team = Team::new(2).expect("threads");
        team.enter(|| {
            let caught = catch_unwind(|| {
                for_each(16, |i| {
                    if i == 11 {
                        panic!("task 11");
                    }
                })
            });
            assert!(caught.is_err());
            let mut out = vec![0; 8];
            for_each_mut(&mut out, |i, v| *v = i);
            assert_eq!(out, (0..8).collect::<Vec<_>>());
        });
    }
}
