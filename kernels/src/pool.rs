//! A small fork-join pool for the kernels: the calling thread and `n - 1`
//! workers split `tasks` indices of one job, then the call returns.
//!
//! A forward pass posts hundreds of short jobs per token, tens of
//! microseconds apart. Workers that sleep between them (as a general pool's
//! do) cost a futex wake-up per job, which dominated decode time; these
//! workers spin on the job counter for a while after each job and only then
//! park, so back-to-back jobs start at once.

use std::sync::atomic::{AtomicPtr, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// A raw pointer the tasks of one job share: each task writes a part of the
/// buffer no other task touches, and the buffer outlives the job (`run`
/// returns only when every task has).
#[derive(Clone, Copy)]
pub(crate) struct SendPtr<T>(pub(crate) *mut T);
// SAFETY: see above; whoever dereferences it keeps the parts disjoint.
unsafe impl<T> Send for SendPtr<T> {}
unsafe impl<T> Sync for SendPtr<T> {}

/// How long an idle worker spins before it parks.
const SPIN: Duration = Duration::from_millis(3);

struct Job<'a> {
    f: &'a (dyn Fn(usize) + Sync),
    tasks: usize,
    next: AtomicUsize,
    done: AtomicUsize,
}

struct Shared {
    generation: AtomicU64,
    job: AtomicPtr<Job<'static>>,
    /// Workers currently looking at `job`.
    active: AtomicUsize,
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
    stop: std::sync::atomic::AtomicBool,
}

/// The pool. Dropping it stops the workers.
pub struct Pool {
    shared: Arc<Shared>,
    workers: Vec<std::thread::JoinHandle<()>>,
    threads: usize,
    /// One job at a time: `run` is not reentrant across threads.
    busy: Mutex<()>,
}

impl Pool {
    /// A pool of `threads` threads in all (the caller counts as one).
    pub fn new(threads: usize) -> std::io::Result<Pool> {
        let threads = threads.max(1);
        let shared = Arc::new(Shared {
            generation: AtomicU64::new(0),
            job: AtomicPtr::new(std::ptr::null_mut()),
            active: AtomicUsize::new(0),
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
            stop: std::sync::atomic::AtomicBool::new(false),
        });
        let mut workers = Vec::new();
        for i in 1..threads {
            let s = shared.clone();
            workers.push(std::thread::Builder::new().name(format!("baton-cpu-{i}")).spawn(move || worker(&s))?);
        }
        Ok(Pool { shared, workers, threads, busy: Mutex::new(()) })
    }

    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Calls `f(i)` for every `i` in `0..tasks`, spread over the pool, and
    /// returns when all calls have returned.
    pub fn run(&self, tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        if tasks == 0 {
            return;
        }
        if tasks == 1 || self.workers.is_empty() {
            (0..tasks).for_each(f);
            return;
        }
        let _one = self.busy.lock().unwrap_or_else(|p| p.into_inner());
        let job = Job { f, tasks, next: AtomicUsize::new(0), done: AtomicUsize::new(0) };
        let s = &*self.shared;
        // SAFETY: the pointer is withdrawn, and every worker that may have
        // read it has let go (`active == 0`), before `job` goes out of scope.
        s.job.store(&job as *const Job as *mut Job<'static>, SeqCst);
        s.generation.fetch_add(1, SeqCst);
        if s.sleepers.load(SeqCst) > 0 {
            let _g = s.lock.lock().unwrap_or_else(|p| p.into_inner());
            s.wake.notify_all();
        }
        work_on(&job);
        while job.done.load(SeqCst) < tasks {
            std::hint::spin_loop();
        }
        s.job.store(std::ptr::null_mut(), SeqCst);
        while s.active.load(SeqCst) > 0 {
            std::hint::spin_loop();
        }
    }
}

fn work_on(job: &Job) {
    loop {
        let i = job.next.fetch_add(1, SeqCst);
        if i >= job.tasks {
            return;
        }
        (job.f)(i);
        job.done.fetch_add(1, SeqCst);
    }
}

fn worker(s: &Shared) {
    let mut seen = s.generation.load(SeqCst);
    loop {
        let spin_until = Instant::now() + SPIN;
        let mut spins = 0u32;
        while s.generation.load(SeqCst) == seen {
            if s.stop.load(SeqCst) {
                return;
            }
            std::hint::spin_loop();
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(1024) && Instant::now() > spin_until {
                let mut g = s.lock.lock().unwrap_or_else(|p| p.into_inner());
                s.sleepers.fetch_add(1, SeqCst);
                while s.generation.load(SeqCst) == seen && !s.stop.load(SeqCst) {
                    g = s.wake.wait_timeout(g, Duration::from_millis(100)).unwrap_or_else(|p| p.into_inner()).0;
                }
                s.sleepers.fetch_sub(1, SeqCst);
                break;
            }
        }
        seen = s.generation.load(SeqCst);
        s.active.fetch_add(1, SeqCst);
        let p = s.job.load(SeqCst);
        if !p.is_null() {
            // SAFETY: `run` keeps the job alive while `active > 0`.
            work_on(unsafe { &*p });
        }
        s.active.fetch_sub(1, SeqCst);
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.stop.store(true, SeqCst);
        {
            let _g = self.shared.lock.lock().unwrap_or_else(|p| p.into_inner());
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_task_runs_exactly_once() {
        let pool = Pool::new(3).unwrap();
        for tasks in [0, 1, 2, 7, 100, 1000] {
            let hits: Vec<AtomicUsize> = (0..tasks).map(|_| AtomicUsize::new(0)).collect();
            pool.run(tasks, &|i| {
                hits[i].fetch_add(1, SeqCst);
            });
            assert!(hits.iter().all(|h| h.load(SeqCst) == 1));
        }
    }

    #[test]
    fn workers_wake_after_parking() {
        let pool = Pool::new(2).unwrap();
        std::thread::sleep(SPIN * 3);
        let n = AtomicUsize::new(0);
        pool.run(64, &|_| {
            n.fetch_add(1, SeqCst);
        });
        assert_eq!(n.load(SeqCst), 64);
    }
}
