//! A team of threads that stays awake through one forward step, so that a step's products are
//! split without rayon's fork and join (a wake-up costs ~10 µs or more, as much as one of m1b's
//! products takes, and a prompt's step alternates tens of products with serial work that let
//! rayon's threads fall asleep). Inside `with_team`, the caller and `threads - 1` helper threads
//! share each product's chunks through one atomic claim and the helpers spin between products;
//! the kernels split work through `chunks_mut` (the team when one is active, else rayon). The
//! decoder forms a team for every multi-row step and for one-row steps that read enough weights:
//! for the demo model's ~1 µs one-row products the claims cost what splitting saves
//! (`docs/benchmarks.md`, issue 18, third pass).
//!
//! A one-row step that runs alone may still split one large product (the demo model's LM head),
//! or spread a layer's experts (`apply_experts`), over a team of its own: between teams a helper waits awake for `SPIN_IDLE` (decode steps
//! come sooner, so it stays awake through a generation), and `prewake` wakes a sleeping one a
//! little ahead — posting a team then makes no system call.
//!
//! Owns: the helper threads (started on first use, awake for `SPIN_IDLE` after a team, then
//! asleep), the claim protocol, the prewake.
//! Must never: run a task after the `run` that posted it returned (a claim names its job's epoch,
//! a job's epoch ends only when all its tasks are done, and a new epoch opens with nothing
//! claimable before its job is written); let a helper spin longer than `SPIN_IDLE` without work,
//! in a step or between teams (then it parks or sleeps); change what a task computes — each chunk is
//! computed exactly as on one thread, so results are the same bits with or without a team.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};

/// How long a helper spins without new work before it parks: longer than the serial stretches
/// between one step's products (a prompt's routing and fixed-point sum take ~50–100 µs a layer
/// on the demo model; a count of `pause`s, 10–140 cycles each by CPU, parked inside them),
/// shorter than a disk read.
const SPIN_IDLE: std::time::Duration = std::time::Duration::from_micros(400);
/// `pause`s between looks at the clock.
const SPINS_PER_LOOK: u32 = 64;

type TaskFn<'a> = dyn Fn(usize) + Sync + 'a;

/// A claim index no job reaches: the epoch's job is being written.
const NONE_CLAIMABLE: u64 = 0xFFFF_FFFF;

pub struct Team {
    /// Which team this is (helpers join each team once).
    id: u64,
    /// Helper places not yet taken.
    seats: AtomicUsize,
    /// (epoch << 32) | next unclaimed task of the current job. A helper claims task `i` of epoch
    /// `e` by moving it from (e, i) to (e, i + 1), only while `i < tasks`.
    claim: AtomicU64,
    tasks: AtomicUsize,
    /// Points at the `run` caller's `&TaskFn` (on its stack) while the epoch lasts.
    job: AtomicPtr<()>,
    finished: AtomicUsize,
    closed: AtomicBool,
    panicked: AtomicBool,
    /// Helpers parked (not spinning): `run` wakes them.
    parked: AtomicUsize,
    park: Mutex<()>,
    wake: Condvar,
    helpers: usize,
}

thread_local! {
    static ACTIVE: Cell<Option<*const Team>> = const { Cell::new(None) };
    /// Set while this thread runs a team task: a product inside it stays on this thread (the
    /// pool's threads are asleep or busy, and the team's are already taken).
    static IN_TASK: Cell<bool> = const { Cell::new(false) };
}

/// The helper threads: started on first use, each waiting for a team to join.
struct Pool {
    started: Mutex<usize>,
    slot: Mutex<Option<Arc<Team>>>,
    posted: Condvar,
    /// The id of the last team posted, for helpers waiting awake without the slot's lock.
    last_posted: AtomicU64,
    /// Helpers asleep on `posted` (changed under the slot's lock): only then does posting a
    /// team, or a `prewake`, make a system call.
    sleepers: AtomicUsize,
    /// Bumped by `prewake`, so that a helper it woke waits awake for the team.
    prewakes: AtomicU64,
    /// Times a helper began to wait awake for a team (tests watch it).
    awake_waits: AtomicUsize,
}

fn pool() -> &'static Pool {
    static POOL: OnceLock<Pool> = OnceLock::new();
    POOL.get_or_init(|| Pool {
        started: Mutex::new(0),
        slot: Mutex::new(None),
        posted: Condvar::new(),
        last_posted: AtomicU64::new(0),
        sleepers: AtomicUsize::new(0),
        prewakes: AtomicU64::new(0),
        awake_waits: AtomicUsize::new(0),
    })
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Wakes the helper threads ahead of a team that is about to form (`with_team` soon after), so
/// that they are awake when it is posted instead of paying a wake-up then (a futex wake costs
/// ~10 µs or more on these virtual machines, as much as the product it would split). A helper
/// still waiting awake after its last team (it does for `SPIN_IDLE`) needs nothing: then this
/// makes no system call. Does nothing before the helpers exist.
pub fn prewake() {
    let p = pool();
    if p.sleepers.load(Ordering::SeqCst) == 0 {
        return;
    }
    p.prewakes.fetch_add(1, Ordering::SeqCst);
    let _slot = lock(&p.slot);
    p.posted.notify_all();
}

/// A helper's life: join each new team, and between teams wait awake for `SPIN_IDLE` (a
/// decode step's next team comes sooner than that), then asleep until a team or a `prewake`.
fn helper_main() {
    let p = pool();
    let mut last = 0u64;
    loop {
        let team = {
            // Awake first: the team that ended may be followed by another soon.
            let mut awake = true;
            let mut slot = lock(&p.slot);
            loop {
                match slot.as_ref() {
                    Some(t) if t.id != last => break t.clone(),
                    _ => {}
                }
                if awake {
                    // Read under the lock: a team posted before this was in the slot above.
                    let posted_before = p.last_posted.load(Ordering::Acquire);
                    drop(slot);
                    p.awake_waits.fetch_add(1, Ordering::SeqCst);
                    let since = std::time::Instant::now();
                    let mut spins = 0u32;
                    while p.last_posted.load(Ordering::Acquire) == posted_before && (!spins.is_multiple_of(SPINS_PER_LOOK) || since.elapsed() < SPIN_IDLE) {
                        spins = spins.wrapping_add(1);
                        std::hint::spin_loop();
                    }
                    awake = false;
                    slot = lock(&p.slot);
                    continue;
                }
                let prewakes = p.prewakes.load(Ordering::SeqCst);
                p.sleepers.fetch_add(1, Ordering::SeqCst);
                slot = p.posted.wait(slot).unwrap_or_else(|e| e.into_inner());
                p.sleepers.fetch_sub(1, Ordering::SeqCst);
                // Woken for a coming team: wait for it awake.
                awake = p.prewakes.load(Ordering::SeqCst) != prewakes;
            }
        };
        last = team.id;
        // A helper started for a larger team than this one sits it out.
        if team.seats.fetch_update(Ordering::AcqRel, Ordering::Acquire, |s| s.checked_sub(1)).is_ok() {
            team.help();
        }
    }
}

/// Runs `f` with a team of `threads` (the caller and `threads - 1` helpers) active on this
/// thread. With fewer than two threads, inside another team, or while another thread's team is
/// active, `f` runs alone (the kernels then use rayon as before).
pub fn with_team<R>(threads: usize, f: impl FnOnce() -> R) -> R {
    if threads < 2 || active().is_some() {
        return f();
    }
    static IDS: AtomicU64 = AtomicU64::new(1);
    let p = pool();
    let team = Arc::new(Team {
        id: IDS.fetch_add(1, Ordering::Relaxed),
        seats: AtomicUsize::new(threads - 1),
        claim: AtomicU64::new(0),
        tasks: AtomicUsize::new(0),
        job: AtomicPtr::new(std::ptr::null_mut()),
        finished: AtomicUsize::new(0),
        closed: AtomicBool::new(false),
        panicked: AtomicBool::new(false),
        parked: AtomicUsize::new(0),
        park: Mutex::new(()),
        wake: Condvar::new(),
        helpers: threads - 1,
    });
    {
        let mut slot = lock(&p.slot);
        if slot.is_some() {
            drop(slot);
            return f();
        }
        let mut started = lock(&p.started);
        while *started < team.helpers {
            if std::thread::Builder::new().name(format!("team-{started}")).spawn(helper_main).is_err() {
                break;
            }
            *started += 1;
        }
        *slot = Some(team.clone());
        p.last_posted.store(team.id, Ordering::Release);
        // Helpers awake see `last_posted`; only sleeping ones need the system call.
        if p.sleepers.load(Ordering::SeqCst) > 0 {
            p.posted.notify_all();
        }
    }
    struct Close(Arc<Team>);
    impl Drop for Close {
        fn drop(&mut self) {
            ACTIVE.with(|a| a.set(None));
            self.0.closed.store(true, Ordering::Release);
            {
                // Helpers park under this lock; one spinning sees `closed` by itself.
                let _g = lock(&self.0.park);
                if self.0.parked.load(Ordering::SeqCst) > 0 {
                    self.0.wake.notify_all();
                }
            }
            let mut slot = lock(&pool().slot);
            if slot.as_ref().is_some_and(|t| Arc::ptr_eq(t, &self.0)) {
                *slot = None;
            }
        }
    }
    let _close = Close(team.clone());
    ACTIVE.with(|a| a.set(Some(Arc::as_ptr(&team))));
    f()
}

/// `with_team` with as many threads as the current rayon pool has (the `--threads` a model
/// runs with).
pub fn with_pool_team<R>(f: impl FnOnce() -> R) -> R {
    with_team(pool_threads(), f)
}

/// Threads of the current rayon pool (the `--threads` a model runs with): a pool team's size.
pub fn pool_threads() -> usize {
    rayon::current_num_threads()
}

/// How a step's team shares `len` items of elementwise or per-row work (norms, the routers'
/// choices, the expert sums' conversion): pieces of about two a thread, each a multiple of
/// `unit` items — or `None`, to do it on this thread, when no team is active or `len` is below
/// `min` (below it the claims cost what the split saves).
pub fn piece_len(len: usize, unit: usize, min: usize) -> Option<usize> {
    let team = active().filter(|_| len >= min)?;
    let unit = unit.max(1);
    Some(len.div_ceil(2 * unit * team.threads()).max(1) * unit)
}

/// The team active on this thread, if any.
pub fn active() -> Option<&'static Team> {
    // SAFETY: the pointer is set only inside `with_team`, which holds the Arc for as long as it
    // is set, and cleared before that Arc is dropped; the reference is used within that call.
    ACTIVE.with(|a| a.get()).map(|t| unsafe { &*t })
}

impl Team {
    /// Threads that take part (the caller and its helpers).
    pub fn threads(&self) -> usize {
        self.helpers + 1
    }

    /// Calls `f(i)` for every `i < tasks`, spread over the team; returns when all are done.
    pub fn run(&self, tasks: usize, f: &TaskFn<'_>) {
        if tasks == 0 {
            return;
        }
        // The caller's own tasks see no team: a product inside a task runs on its thread rather
        // than posting a second job over this one.
        struct Hidden(Option<*const Team>);
        impl Drop for Hidden {
            fn drop(&mut self) {
                ACTIVE.with(|a| a.set(self.0));
            }
        }
        let _hidden = Hidden(ACTIVE.with(|a| a.replace(None)));
        assert!(tasks < NONE_CLAIMABLE as usize, "too many tasks for one job");
        let f_ref: &TaskFn<'_> = f;
        let epoch = (self.claim.load(Ordering::Relaxed) >> 32) + 1;
        // First the new epoch with nothing claimable: a helper that read the old epoch's claim
        // (and may read the new tasks and job below) can no longer win its claim, and one that
        // reads this value claims nothing.
        self.claim.store((epoch << 32) | NONE_CLAIMABLE, Ordering::SeqCst);
        self.finished.store(0, Ordering::Relaxed);
        self.tasks.store(tasks, Ordering::Relaxed);
        self.job.store(&f_ref as *const &TaskFn<'_> as *mut (), Ordering::Relaxed);
        // Publishes the job: a claim of this epoch sees tasks and job.
        // SeqCst with the helper's `parked` increment and claim load: one of the two sees the
        // other (no lost wake-up; a 5 ms timeout bounds one anyway).
        self.claim.store(epoch << 32, Ordering::SeqCst);
        if self.parked.load(Ordering::SeqCst) > 0 {
            let _g = lock(&self.park);
            self.wake.notify_all();
        }
        while self.work_once() {}
        let mut spins = 0u32;
        while self.finished.load(Ordering::Acquire) < tasks {
            // A helper descheduled mid-task (a busy machine) is waited for without taking the
            // core it needs for a whole time slice.
            spins += 1;
            if spins < 1024 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        if self.panicked.swap(false, Ordering::Relaxed) {
            panic!("a task run by the team panicked");
        }
    }

    /// Claims and runs one task of the current job; false when none is left.
    fn work_once(&self) -> bool {
        let c = self.claim.load(Ordering::Acquire);
        let (i, tasks) = ((c & 0xFFFF_FFFF) as usize, self.tasks.load(Ordering::Relaxed));
        if i >= tasks {
            return false;
        }
        let job = self.job.load(Ordering::Relaxed);
        if self.claim.compare_exchange(c, c + 1, Ordering::AcqRel, Ordering::Relaxed).is_err() {
            return true; // another thread claimed it (or a new job began): look again
        }
        // SAFETY: the claim succeeded in the epoch whose claim value we read with task i
        // unfinished, so that epoch's `run` is still waiting; `tasks` and `job` read after that
        // value are that epoch's (a later epoch writes them only after storing a new claim value,
        // which would have made this claim fail), so `job` points at its live `&TaskFn`.
        let f: &TaskFn<'_> = unsafe { *(job as *const &TaskFn<'_>) };
        // A panicking task still counts as finished (its `run` must not return while others
        // run tasks of the same job); `run` raises it once every task is done.
        let outer = IN_TASK.with(|t| t.replace(true));
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(i)));
        IN_TASK.with(|t| t.set(outer));
        if result.is_err() {
            self.panicked.store(true, Ordering::Relaxed);
        }
        self.finished.fetch_add(1, Ordering::Release);
        true
    }

    fn help(&self) {
        let mut idle = 0u32;
        let mut idle_since = std::time::Instant::now();
        while !self.closed.load(Ordering::Acquire) {
            if self.work_once() {
                idle = 0;
                continue;
            }
            if idle == 0 {
                idle_since = std::time::Instant::now();
            }
            idle += 1;
            if !idle.is_multiple_of(SPINS_PER_LOOK) || idle_since.elapsed() < SPIN_IDLE {
                std::hint::spin_loop();
                continue;
            }
            // Park until the next job or the end of the step.
            let g = lock(&self.park);
            self.parked.fetch_add(1, Ordering::SeqCst);
            let seen = self.claim.load(Ordering::SeqCst);
            let pending = (seen & 0xFFFF_FFFF) < self.tasks.load(Ordering::Relaxed) as u64;
            if !pending && !self.closed.load(Ordering::Acquire) {
                drop(self.wake.wait_timeout(g, std::time::Duration::from_millis(5)).unwrap_or_else(|e| e.into_inner()));
            }
            self.parked.fetch_sub(1, Ordering::AcqRel);
            idle = 0;
        }
    }
}

/// `f(chunk index, chunk)` for each `chunk`-long piece of `out`, over the active team.
pub fn for_each_chunk_mut<T: Send>(team: &Team, out: &mut [T], chunk: usize, f: impl Fn(usize, &mut [T]) + Sync) {
    let chunk = chunk.max(1);
    let (len, base) = (out.len(), out.as_mut_ptr() as usize);
    team.run(len.div_ceil(chunk), &|c| {
        let start = c * chunk;
        let n = chunk.min(len - start);
        // SAFETY: chunk c covers [start, start + n) of `out`, disjoint from every other chunk,
        // and `out` is borrowed mutably for the whole `run`.
        let piece = unsafe { std::slice::from_raw_parts_mut((base as *mut T).add(start), n) };
        f(c, piece);
    });
}

/// Whether this thread is running a team's task.
pub fn in_task() -> bool {
    IN_TASK.with(|t| t.get())
}

/// `f(chunk index, chunk)` for each `chunk`-long piece of `out`: over the active team, else over
/// the rayon pool when `pool` (the caller found enough work to wake it), else on this thread —
/// always on this thread inside a team's task. Each piece is computed alike every way.
pub fn chunks_mut<T: Send>(out: &mut [T], chunk: usize, pool: bool, f: impl Fn(usize, &mut [T]) + Sync + Send) {
    use rayon::prelude::*;
    let chunk = chunk.max(1);
    match active() {
        Some(team) => for_each_chunk_mut(team, out, chunk, f),
        None if pool && !in_task() => out.par_chunks_mut(chunk).enumerate().for_each(|(c, o)| f(c, o)),
        None => out.chunks_mut(chunk).enumerate().for_each(|(c, o)| f(c, o)),
    }
}

/// `f(chunk index, a's chunk, b's chunk)` for matching `chunk`-long pieces of two outputs of one
/// length (a gate's and an up's rows), spread as `chunks_mut` spreads chunks.
pub fn chunk_pairs_mut<T: Send>(a: &mut [T], b: &mut [T], chunk: usize, pool: bool, f: impl Fn(usize, &mut [T], &mut [T]) + Sync + Send) {
    assert_eq!(a.len(), b.len(), "paired outputs differ in length");
    let chunk = chunk.max(1);
    let mut pieces: Vec<(&mut [T], &mut [T])> = a.chunks_mut(chunk).zip(b.chunks_mut(chunk)).collect();
    chunks_mut(&mut pieces, 1, pool, |c, p| {
        let (pa, pb) = &mut p[0];
        f(c, pa, pb)
    })
}

/// `f(item)` for each item, spread as `chunks_mut` spreads chunks.
pub fn each_mut<T: Send>(items: &mut [T], pool: bool, f: impl Fn(&mut T) + Sync + Send) {
    chunks_mut(items, 1, pool, |_, one| one.iter_mut().for_each(&f))
}

/// One team at a time per process: tests that need a team take turns (a second concurrent
/// `with_team` would run alone, which they would take for a failure).
#[cfg(test)]
pub(crate) fn test_turn() -> std::sync::MutexGuard<'static, ()> {
    static TURN: Mutex<()> = Mutex::new(());
    lock(&TURN)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
        test_turn()
    }

    #[test]
    fn every_task_runs_once_and_results_do_not_depend_on_the_team() {
        let _turn = one_at_a_time();
        let value = |i: usize| (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left(17);
        let alone: Vec<u64> = (0..10_007).map(value).collect();
        for threads in [2, 3, 4] {
            let got = with_team(threads, || {
                let team = active().expect("a team is active inside with_team");
                assert_eq!(team.threads(), threads);
                let mut all = Vec::new();
                // Many small jobs back to back, of every size around the chunk.
                for len in [0usize, 1, 7, 64, 65, 1000, 10_007] {
                    let mut out = vec![0u64; len];
                    for_each_chunk_mut(team, &mut out, 64, |c, piece| {
                        for (k, o) in piece.iter_mut().enumerate() {
                            *o = value(c * 64 + k);
                        }
                    });
                    all.push(out);
                }
                let counts: Vec<AtomicUsize> = (0..500).map(|_| AtomicUsize::new(0)).collect();
                for _ in 0..200 {
                    team.run(counts.len(), &|i| {
                        counts[i].fetch_add(1, Ordering::Relaxed);
                    });
                }
                assert!(counts.iter().all(|c| c.load(Ordering::Relaxed) == 200), "every task exactly once per run");
                all
            });
            for out in got {
                assert_eq!(out[..], alone[..out.len()]);
            }
            assert!(active().is_none(), "the team ends with with_team");
        }
    }

    #[test]
    fn a_panicking_task_is_raised_by_run_after_every_task_finished() {
        let _turn = one_at_a_time();
        let done = AtomicUsize::new(0);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            with_team(2, || {
                active().unwrap().run(64, &|i| {
                    if i == 5 {
                        panic!("task 5 fails");
                    }
                    done.fetch_add(1, Ordering::Relaxed);
                })
            })
        }));
        assert!(r.is_err());
        assert_eq!(done.load(Ordering::Relaxed), 63, "every other task ran before run returned");
    }

    /// `chunks_mut` spreads over the active team, and inside a team's task stays on the task's
    /// thread (the pool is not woken under a team); every chunk is visited once either way.
    #[test]
    fn chunks_mut_uses_the_team_and_stays_on_a_tasks_thread() {
        let _turn = test_turn();
        let mut out = vec![0usize; 64];
        let (threads, nested) = with_team(2, || {
            assert!(active().is_some() && !in_task());
            let seen = Mutex::new(std::collections::HashSet::new());
            let nested_elsewhere = AtomicUsize::new(0);
            chunks_mut(&mut out, 4, true, |c, o| {
                lock(&seen).insert(std::thread::current().id());
                assert!(in_task() && active().is_none(), "a task sees no team");
                let me = std::thread::current().id();
                let mut inner = vec![0u8; 32];
                chunks_mut(&mut inner, 1, true, |_, _| {
                    if std::thread::current().id() != me {
                        nested_elsewhere.fetch_add(1, Ordering::Relaxed);
                    }
                });
                o.iter_mut().enumerate().for_each(|(i, v)| *v += 4 * c + i + 1);
            });
            let n = lock(&seen).len();
            (n, nested_elsewhere.load(Ordering::Relaxed))
        });
        assert!(!in_task());
        assert_eq!(out, (1..=64).collect::<Vec<_>>(), "each chunk once, at its place");
        assert!((1..=2).contains(&threads));
        assert_eq!(nested, 0, "a product inside a task ran on another thread");
    }

    /// Many tiny jobs back to back, so that helpers often read a job's claim while the next one
    /// is being posted: every task must run in its own job (a task of a finished job run again
    /// — the race the claim's "nothing claimable" step closes — would count twice, or crash).
    #[test]
    fn tiny_jobs_back_to_back_run_each_task_in_its_own_job() {
        let _turn = one_at_a_time();
        with_team(2, || {
            let team = active().unwrap();
            let counts: Vec<AtomicUsize> = (0..3).map(|_| AtomicUsize::new(0)).collect();
            let total = AtomicUsize::new(0);
            for round in 0..50_000usize {
                let tasks = 1 + round % 3;
                let mine: Vec<AtomicUsize> = (0..tasks).map(|_| AtomicUsize::new(0)).collect();
                team.run(tasks, &|i| {
                    mine[i].fetch_add(1, Ordering::Relaxed);
                    counts[i].fetch_add(1, Ordering::Relaxed);
                    total.fetch_add(1, Ordering::Relaxed);
                });
                assert!(mine.iter().all(|m| m.load(Ordering::Relaxed) == 1), "round {round}: a task ran twice or not at all");
            }
            assert_eq!(total.load(Ordering::Relaxed), (0..50_000usize).map(|r| 1 + r % 3).sum::<usize>());
        });
    }

    /// A task that asks for the team (a product inside an expert's task) finds none and runs
    /// alone, on the caller's thread as on a helper.
    #[test]
    fn tasks_see_no_team() {
        let _turn = one_at_a_time();
        let seen = with_team(2, || {
            let team = active().unwrap();
            let any = AtomicUsize::new(0);
            team.run(200, &|_| {
                if active().is_some() {
                    any.fetch_add(1, Ordering::Relaxed);
                }
            });
            assert!(active().is_some(), "the team is back after run");
            any.into_inner()
        });
        assert_eq!(seen, 0);
    }

    #[test]
    fn helpers_wait_awake_between_teams_then_sleep_and_a_prewake_wakes_them() {
        let _turn = one_at_a_time();
        let p = pool();
        let until = |what: &str, done: &dyn Fn() -> bool| {
            let start = std::time::Instant::now();
            while !done() {
                assert!(start.elapsed() < std::time::Duration::from_secs(10), "{what}");
                std::thread::yield_now();
            }
        };
        let every_task_once = |round: usize| {
            let counts: Vec<AtomicUsize> = (0..64).map(|_| AtomicUsize::new(0)).collect();
            with_team(2, || {
                active().unwrap().run(counts.len(), &|i| {
                    counts[i].fetch_add(1, Ordering::Relaxed);
                })
            });
            assert!(counts.iter().all(|c| c.load(Ordering::Relaxed) == 1), "round {round}");
        };
        every_task_once(0);
        // After its team a helper waits awake for a while, then sleeps.
        until("a helper falls asleep after waiting awake", &|| p.sleepers.load(Ordering::SeqCst) > 0);
        for round in 1..20usize {
            let before = p.awake_waits.load(Ordering::SeqCst);
            if p.sleepers.load(Ordering::SeqCst) > 0 {
                prewake();
                until("a prewake wakes a sleeping helper with no team posted", &|| p.awake_waits.load(Ordering::SeqCst) > before);
            }
            // Teams back to back find their helper awake, or wake it; every task runs once.
            every_task_once(round);
            every_task_once(round);
        }
        // A prewake that no team follows ends in sleep, not a spin.
        until("the helper sleeps again", &|| p.sleepers.load(Ordering::SeqCst) > 0);
        let before = p.awake_waits.load(Ordering::SeqCst);
        prewake();
        until("the last prewake wakes a helper", &|| p.awake_waits.load(Ordering::SeqCst) > before);
        until("the helper stops waiting for a team that does not come", &|| p.sleepers.load(Ordering::SeqCst) > 0);
    }

    #[test]
    fn a_team_inside_a_team_runs_alone_and_a_panic_ends_the_team() {
        let _turn = one_at_a_time();
        let inner = with_team(2, || with_team(2, || active().is_some()));
        assert!(inner, "the outer team stays active for a nested call");
        let r = std::panic::catch_unwind(|| with_team(2, || panic!("a task's caller fails")));
        assert!(r.is_err());
        assert!(active().is_none());
        // A later team still forms and works after a step that failed.
        let sum = with_team(2, || {
            let total = AtomicUsize::new(0);
            active().unwrap().run(100, &|i| {
                total.fetch_add(i, Ordering::Relaxed);
            });
            total.into_inner()
        });
        assert_eq!(sum, 4950);
    }
}
