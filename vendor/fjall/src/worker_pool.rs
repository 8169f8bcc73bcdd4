// Copyright (c) 2024-present, fjall-rs
// This source code is licensed under both the Apache 2.0 and MIT License
// (found in the LICENSE-* files in the repository)

use crate::{
    compaction::worker::run as run_compaction, flush::worker::run as run_flush, poison::PoisonDart,
    stats::Stats, supervisor::Supervisor, Keyspace,
};
use lsm_tree::MemtableId;
use std::{
    borrow::Cow,
    sync::{
        atomic::{
            AtomicBool, AtomicUsize,
            Ordering::{Relaxed, SeqCst},
        },
        Arc, Mutex,
    },
    thread::JoinHandle,
};

pub enum WorkerMessage {
    Flush,
    Compact(Keyspace),
    Close,
    RotateMemtable(Keyspace, MemtableId),
    /// agentstate patch: write the spare journal file if there is none.
    PrepareSpareJournal,
}

impl std::fmt::Debug for WorkerMessage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}",
            match self {
                Self::Flush => Cow::Borrowed("WorkerMessage:Flush"),
                Self::Compact(k) => Cow::Owned(format!("WorkerMessage:Compact({:?})", k.name)),
                Self::Close => Cow::Borrowed("WorkerMessage:Close"),
                Self::RotateMemtable(k, memtable_id) =>
                    Cow::Owned(format!("WorkerMessage:Rotate({:?}, {memtable_id})", k.name)),
                Self::PrepareSpareJournal => Cow::Borrowed("WorkerMessage:PrepareSpareJournal"),
            }
        )
    }
}

type WorkerHandle = JoinHandle<Result<(), crate::Error>>;

pub struct WorkerPool {
    start: Arc<Start>,
    pub(crate) rx: flume::Receiver<WorkerMessage>,
    pub(crate) sender: flume::Sender<WorkerMessage>,
}

/// agentstate patch: what sends messages to the workers from outside them
/// (the keyspaces, an ingestion). The first message sent starts the pool:
/// an open that has nothing for the workers to do starts no thread. A
/// thread's spawn cost the opener 30–100 µs on a 2-core VM, where the new
/// thread mostly ran on the opener's core before the open was over.
#[derive(Clone)]
pub struct WorkerMessager {
    sender: flume::Sender<WorkerMessage>,
    start: Arc<Start>,
}

impl WorkerMessager {
    /// Sends `message`, the pool started first if it was not.
    pub fn send(&self, message: WorkerMessage) -> Result<(), flume::SendError<WorkerMessage>> {
        self.start.ensure();
        self.sender.send(message)
    }

    /// Sends `message` if the queue has room, the pool started first if
    /// it was not.
    pub fn try_send(
        &self,
        message: WorkerMessage,
    ) -> Result<(), flume::TrySendError<WorkerMessage>> {
        self.start.ensure();
        self.sender.try_send(message)
    }
}

/// The pool's start, deferred to its first message (agentstate patch).
#[derive(Default)]
struct Start {
    /// True once the pool started, failed to, or was closed.
    done: AtomicBool,
    /// What starts the workers: set by `WorkerPool::start`, taken by the
    /// first message or by the close.
    spawner: Mutex<Option<Spawner>>,
    /// The workers, once started.
    handles: Mutex<Vec<WorkerHandle>>,
}

impl Start {
    fn ensure(&self) {
        if self.done.load(SeqCst) {
            return;
        }
        let mut slot = self.spawner.lock().expect("lock is poisoned");
        // None: not armed yet (the database is still opening), or started
        // or closed meanwhile.
        let Some(spawner) = slot.take() else {
            return;
        };
        let mut handles = Vec::with_capacity(spawner.pool_size);
        let spawned = claim_and_spawn(spawner.pool_size, &spawner.thread_counter, |i| {
            spawner.spawn(i).map(|handle| handles.push(handle))
        });
        if let Err(e) = spawned {
            if handles.is_empty() {
                // Nothing would flush or compact: writes must fail, not
                // pile up in memtables that never leave.
                log::error!("Could not start a fjall worker: {e:?}");
                spawner.poison_dart.poison();
            } else {
                // One worker runs every kind of task.
                log::warn!("Could not start every fjall worker: {e:?}");
            }
        }
        *self.handles.lock().expect("lock is poisoned") = handles;
        self.done.store(true, SeqCst);
    }

    /// No start after this one.
    fn close(&self) {
        self.done.store(true, SeqCst);
        self.spawner.lock().expect("lock is poisoned").take();
    }
}

impl WorkerPool {
    /// agentstate patch: waits until every worker thread has exited.
    /// Called by the database's drop once the workers have left their
    /// loops; never by a worker.
    pub fn join(&self) {
        let handles = std::mem::take(&mut *self.start.handles.lock().expect("lock is poisoned"));
        for handle in handles {
            let _ = handle.join();
        }
    }

    /// agentstate patch: no worker starts after this (the database is
    /// closing); one starting now finishes its start first.
    pub fn close(&self) {
        self.start.close();
    }

    /// What the keyspaces send their messages through.
    pub fn messager(&self) -> WorkerMessager {
        WorkerMessager {
            sender: self.sender.clone(),
            start: self.start.clone(),
        }
    }

    pub fn prepare() -> Self {
        let (sender, rx) = flume::bounded(1_000);

        Self {
            start: Arc::default(),
            rx,
            sender,
        }
    }

    /// Makes the pool ready to start (agentstate patch): its threads start
    /// at the first message sent through a [`WorkerMessager`], or now if
    /// one is already queued.
    pub fn start(
        &self,
        pool_size: usize,
        supervisor: &Supervisor,
        stats: &Arc<Stats>,
        poison_dart: &PoisonDart,
        thread_counter: &Arc<AtomicUsize>,
    ) {
        log::debug!("Starting worker pool with {pool_size} threads");

        let spawner = Spawner {
            pool_size,
            rx: self.rx.clone(),
            sender: self.sender.clone(),
            supervisor: supervisor.clone(),
            stats: stats.clone(),
            poison_dart: poison_dart.clone(),
            thread_counter: thread_counter.clone(),
            compactions: Arc::default(),
        };
        *self.start.spawner.lock().expect("lock is poisoned") = Some(spawner);
        if !self.rx.is_empty() {
            self.start.ensure();
        }
    }
}

/// What starting the workers needs (agentstate patch), kept by the pool
/// until its first message.
struct Spawner {
    pool_size: usize,
    rx: flume::Receiver<WorkerMessage>,
    sender: flume::Sender<WorkerMessage>,
    supervisor: Supervisor,
    stats: Arc<Stats>,
    poison_dart: PoisonDart,
    thread_counter: Arc<AtomicUsize>,
    compactions: Arc<Compactions>,
}

impl Spawner {
    /// Spawns worker `i`. Its slot in the counter is claimed (by
    /// `claim_and_spawn`) before the spawn, so a close that comes first
    /// waits for it too.
    fn spawn(&self, i: usize) -> std::io::Result<WorkerHandle> {
        log::trace!("Starting fjall worker thread #{i}");

        let worker_state = WorkerState {
            pool_size: self.pool_size,
            worker_id: i,
            rx: self.rx.clone(),
            supervisor: self.supervisor.clone(),
            stats: self.stats.clone(),
            sender: self.sender.clone(),
            compactions: self.compactions.clone(),
        };
        let thread_counter = self.thread_counter.clone();
        let poison_dart = self.poison_dart.clone();

        std::thread::Builder::new()
            .name("fjall:worker".to_string())
            .spawn(move || {
                // The counter must drop on *every* way out of this
                // thread, not just the graceful one: `Database::drop`
                // spins on it (`while counter > 0`), so a worker that
                // returns an error or unwinds would keep the database
                // closing forever.
                let _counter_guard = ActiveThreadGuard(thread_counter);

                loop {
                    match worker_tick(&worker_state) {
                        Ok(should_abort) => {
                            if should_abort {
                                log::debug!("Worker #{i} closes because DB is dropping");
                                return Ok(());
                            }
                        }
                        Err(e) => {
                            log::error!("Worker #{i} crashed: {e:?}");
                            poison_dart.poison();
                            return Err(e);
                        }
                    }
                }
            })
    }
}

/// Claims one slot in the active thread counter per worker, immediately before
/// that worker is spawned, and hands the slot straight back if the spawn fails.
///
/// Claiming the whole pool up front would leak the slots of the workers that failed
/// spawn never reaches: nothing ever decrements them, because those threads do
/// not exist, and `DatabaseInner::drop` waits for the counter to reach zero.
///
/// The spawn is a parameter so the failure path can be tested without having to
/// exhaust the operating system's thread limit.
fn claim_and_spawn<H, S: FnMut(usize) -> std::io::Result<H>>(
    pool_size: usize,
    thread_counter: &Arc<AtomicUsize>,
    mut spawn: S,
) -> std::io::Result<Vec<H>> {
    (0..pool_size)
        .map(|i| {
            thread_counter.fetch_add(1, Relaxed);

            spawn(i).inspect_err(|_| {
                thread_counter.fetch_sub(1, Relaxed);
            })
        })
        .collect()
}

/// Decrements the pool's active thread counter when a worker thread leaves,
/// whatever the reason: graceful close, error return or unwinding panic.
///
/// `DatabaseInner::drop` waits for this counter to reach zero, so a leaked
/// increment makes closing the database hang forever.
struct ActiveThreadGuard(Arc<AtomicUsize>);

impl Drop for ActiveThreadGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Relaxed);
    }
}

struct WorkerState {
    pool_size: usize,
    worker_id: usize,
    supervisor: Supervisor,
    rx: flume::Receiver<WorkerMessage>,
    sender: flume::Sender<WorkerMessage>,
    stats: Arc<Stats>,
    compactions: Arc<Compactions>,
}

/// agentstate patch: the pool's compactions, shared by its workers. The
/// first worker of a pool of several leaves a request to a worker that is
/// compacting (it runs the request when it is done), so one worker stays
/// free for flushes without sending requests round the queue.
#[derive(Default)]
struct Compactions {
    /// Compactions running now.
    running: AtomicUsize,
    /// Requests left for a running compaction's worker, one per keyspace.
    left: Mutex<Vec<Keyspace>>,
}

impl Compactions {
    /// Leaves `keyspace`'s request to a running compaction's worker; false
    /// when none runs any more (the request is then the caller's).
    fn leave(&self, keyspace: &Keyspace) -> bool {
        {
            let mut left = self.left.lock().expect("lock is poisoned");
            if !left.iter().any(|k| k.name == keyspace.name) {
                left.push(keyspace.clone());
            }
        }
        // A worker that finishes lowers `running` before it looks at
        // `left`: if it is still above zero here, that worker sees the
        // request; if not, take it back (whoever removes it runs it).
        if self.running.load(SeqCst) > 0 {
            return true;
        }
        !self.take(keyspace)
    }

    /// Removes `keyspace`'s request if it is still left; true if it was.
    fn take(&self, keyspace: &Keyspace) -> bool {
        let mut left = self.left.lock().expect("lock is poisoned");
        let before = left.len();
        left.retain(|k| k.name != keyspace.name);
        left.len() != before
    }

    /// The next request left, if any.
    fn next(&self) -> Option<Keyspace> {
        self.left.lock().expect("lock is poisoned").pop()
    }
}

/// Runs `keyspace`'s compaction, then every request left meanwhile.
fn compact(ctx: &WorkerState, keyspace: &Keyspace) -> crate::Result<()> {
    let mut next = Some(keyspace.clone());
    while let Some(keyspace) = next {
        ctx.compactions.running.fetch_add(1, SeqCst);
        let result = run_compaction(&keyspace, &ctx.supervisor.snapshot_tracker, &ctx.stats);
        ctx.compactions.running.fetch_sub(1, SeqCst);
        result?;
        next = ctx.compactions.next();
    }
    Ok(())
}

fn worker_tick(ctx: &WorkerState) -> crate::Result<bool> {
    let Ok(item) = ctx.rx.recv() else {
        return Ok(true);
    };

    log::trace!("Worker #{} got message: {item:?}", ctx.worker_id);

    match item {
        WorkerMessage::Close => {
            return Ok(true);
        }
        WorkerMessage::RotateMemtable(keyspace, memtable_id) => {
            log::trace!("acquiring journal lock");
            let journal_writer = keyspace.supervisor.journal.get_writer()?;
            keyspace.inner_rotate_memtable(journal_writer, memtable_id)?;
        }
        WorkerMessage::PrepareSpareJournal => prepare_spare_journal(ctx),
        WorkerMessage::Flush => {
            let Some(task) = ctx.supervisor.flush_manager.dequeue() else {
                return Ok(false);
            };

            let mut rotated = false;
            {
                log::trace!("acquiring journal lock to maybe rotate journal");
                let mut journal_writer = ctx.supervisor.journal.get_writer()?;

                // agentstate patch: or when asked to
                // (`Database::rotate_journal_at_next_flush`).
                let asked = ctx
                    .supervisor
                    .rotate_journal_asked
                    .swap(false, std::sync::atomic::Ordering::AcqRel);
                if asked
                    || journal_writer.pos()?
                        > ctx.supervisor.db_config.journal_rotation_size_in_bytes
                {
                    #[expect(clippy::expect_used)]
                    let mut journal_manager = ctx
                        .supervisor
                        .journal_manager
                        .write()
                        .expect("lock is poisoned");

                    let seqno_map = {
                        #[expect(clippy::expect_used)]
                        let keyspaces = ctx.supervisor.keyspaces.write().expect("lock is poisoned");

                        ctx.supervisor.build_seqno_map(&keyspaces)
                    };

                    journal_manager.rotate_journal(&mut journal_writer, seqno_map)?;
                    rotated = true;

                    if journal_manager.disk_space_used()
                        >= ctx.supervisor.db_config.max_journaling_size_in_bytes
                    {
                        let stragglers =
                            journal_manager.get_keyspaces_to_flush_for_oldest_journal_eviction();

                        for keyspace in stragglers {
                            log::info!(
                                "Rotating {:?} to try to reduce journal size",
                                keyspace.name,
                            );
                            keyspace.request_rotation();
                        }
                    }
                } else {
                    // https://github.com/fjall-rs/fjall/issues/329
                    journal_writer.persist(crate::PersistMode::SyncAll)?;
                }
            }

            if rotated {
                // The rotation took the spare (if there was one): write the
                // next one in the background, not under the journal lock.
                ctx.sender.try_send(WorkerMessage::PrepareSpareJournal).ok();
            }

            run_flush(
                &task,
                &ctx.supervisor.write_buffer_size,
                &ctx.supervisor.snapshot_tracker,
                &ctx.stats,
            )?;

            for _ in 0..ctx.pool_size {
                ctx.sender
                    .try_send(WorkerMessage::Compact(task.keyspace.clone()))
                    .ok();
            }

            ctx.supervisor
                .journal_manager
                .write()
                .expect("lock is poisoned")
                .maintenance()?;
        }
        WorkerMessage::Compact(keyspace) => {
            // agentstate patch: upstream's first worker (of a pool of
            // several) sent every compaction request back to the queue, to
            // stay free for flushes, and took it again at once while the
            // other workers were busy: it spun on the queue for as long as
            // a compaction ran elsewhere (915k re-sends in a probe of 4,000
            // creates on two cores), a core taken from the callers. It now
            // sends a request back only behind a queued flush, leaves it to
            // a worker that is compacting, and runs it itself otherwise.
            if ctx.pool_size > 1 && ctx.worker_id == 0 {
                if ctx.supervisor.flush_manager.len() > 0 {
                    ctx.sender.try_send(WorkerMessage::Compact(keyspace)).ok();
                    return Ok(false);
                }
                if ctx.compactions.leave(&keyspace) {
                    return Ok(false);
                }
            }
            compact(ctx, &keyspace)?;
        }
    }

    Ok(false)
}

/// agentstate patch: writes the spare journal (see
/// `Builder::journal_spare_size`); a failure (a full disk, say) only means
/// the next rotation starts a sparse journal, as upstream does.
fn prepare_spare_journal(ctx: &WorkerState) {
    let config = &ctx.supervisor.db_config;
    if let Err(e) =
        crate::journal::writer::prepare_spare(&config.path, config.journal_spare_size_in_bytes)
    {
        log::warn!("Could not write the spare journal: {e:?}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{AbstractTree, Database, KeyspaceCreateOptions};
    use test_log::test;

    // https://github.com/fjall-rs/fjall/pull/303; agentstate patch: the
    // request is queued only when the keyspace's compaction strategy has
    // something to do (the message would start the workers).
    #[test]
    fn keyspace_compact_after_startup() -> crate::Result<()> {
        let folder = tempfile::tempdir()?;
        let queued_at_open = |tables: u8| -> crate::Result<bool> {
            {
                let db = Database::builder(&folder)
                    .worker_threads_unchecked(0)
                    .open()?;
                let ks = db.keyspace("default", KeyspaceCreateOptions::default)?;
                let _ = db.worker_pool.rx.drain().count();
                while ks.tree.l0_run_count() < usize::from(tables) {
                    // Overlapping tables, so the L0 runs add up.
                    ks.insert("a", "a")?;
                    ks.insert("z", "z")?;
                    ks.tree.flush_active_memtable(0)?;
                }
                assert_eq!(usize::from(tables), ks.tree.l0_run_count());
            }
            let db = Database::builder(&folder)
                .worker_threads_unchecked(0)
                .open()?;
            let ks = db.keyspace("default", KeyspaceCreateOptions::default)?;
            let due = ks.tree.compaction_due(&*ks.config.compaction_strategy);
            let queued = match db.worker_pool.rx.try_recv() {
                Ok(WorkerMessage::Compact(_)) => true,
                Ok(other) => panic!("unexpected message {other:?}"),
                Err(_) => false,
            };
            assert_eq!(due, queued, "{tables} L0 runs");
            assert!(db.worker_pool.rx.is_empty());
            Ok(queued)
        };
        // fjall's leveled strategy merges L0 at four runs.
        assert!(!queued_at_open(3)?, "below the threshold: nothing to do");
        assert!(queued_at_open(4)?, "at the threshold: a merge");
        Ok(())
    }

    /// agentstate patch: a database whose open finds nothing for the
    /// workers to do starts none; the first message sent starts them, and
    /// a close before any message returns.
    #[test]
    fn the_workers_start_at_the_first_message() -> crate::Result<()> {
        use std::sync::atomic::Ordering::Relaxed;
        let folder = tempfile::tempdir()?;
        {
            let db = Database::builder(&folder).worker_threads(2).open()?;
            assert_eq!(
                0,
                db.active_thread_counter.load(Relaxed),
                "none at the open"
            );
            let ks = db.keyspace("default", KeyspaceCreateOptions::default)?;
            ks.insert("a", "a")?;
            assert_eq!(
                0,
                db.active_thread_counter.load(Relaxed),
                "none for a write"
            );
        }
        let db = Database::builder(&folder).worker_threads(2).open()?;
        let ks = db.keyspace("default", KeyspaceCreateOptions::default)?;
        assert_eq!(
            0,
            db.active_thread_counter.load(Relaxed),
            "none at a reopen"
        );
        ks.insert("b", "b")?;
        // A rotation's flush is the first message: the workers start and
        // flush it.
        ks.rotate_memtable_and_wait()?;
        assert_eq!(2, db.active_thread_counter.load(Relaxed), "both started");
        assert_eq!(1, ks.tree.table_count());
        assert_eq!(Some(b"b".as_slice().into()), ks.get("b")?);
        Ok(())
    }

    /// A worker state for driving `worker_tick` by hand on a database opened
    /// without workers.
    fn hand_worker(db: &Database, pool_size: usize, worker_id: usize) -> WorkerState {
        WorkerState {
            pool_size,
            worker_id,
            supervisor: db.supervisor.clone(),
            rx: db.worker_pool.rx.clone(),
            sender: db.worker_pool.sender.clone(),
            stats: db.stats.clone(),
            compactions: Arc::default(),
        }
    }

    /// agentstate patch: the first worker of two runs a compaction request
    /// itself when no flush waits. Upstream sent it back to the queue, where
    /// the same worker took it again: with the other worker busy, a loop.
    #[test]
    fn first_worker_compacts_when_no_flush_waits() -> crate::Result<()> {
        let folder = tempfile::tempdir()?;
        let db = Database::builder(&folder)
            .worker_threads_unchecked(0)
            .open()?;
        let ks = db.keyspace("default", KeyspaceCreateOptions::default)?;
        let _ = db.worker_pool.rx.drain().count();

        db.worker_pool
            .sender
            .send(WorkerMessage::Compact(ks.clone()))
            .expect("queue");
        let first = hand_worker(&db, 2, 0);
        assert!(!worker_tick(&first)?);
        assert!(
            db.worker_pool.rx.is_empty(),
            "the request was run, not sent back: {:?}",
            db.worker_pool.rx.try_recv().ok()
        );
        Ok(())
    }

    /// agentstate patch: while a flush waits, the first worker sends a
    /// compaction request back (behind the flush), as upstream meant.
    #[test]
    fn first_worker_leaves_compaction_while_a_flush_waits() -> crate::Result<()> {
        let folder = tempfile::tempdir()?;
        let db = Database::builder(&folder)
            .worker_threads_unchecked(0)
            .open()?;
        let ks = db.keyspace("default", KeyspaceCreateOptions::default)?;
        ks.insert("a", "a")?;
        ks.rotate_memtable()?;
        assert_eq!(db.supervisor.flush_manager.len(), 1, "a flush is queued");
        let _ = db.worker_pool.rx.drain().count();

        db.worker_pool
            .sender
            .send(WorkerMessage::Compact(ks.clone()))
            .expect("queue");
        assert!(!worker_tick(&hand_worker(&db, 2, 0))?);
        assert!(matches!(
            db.worker_pool.rx.try_recv(),
            Ok(WorkerMessage::Compact(_))
        ));
        Ok(())
    }

    /// agentstate patch: while another worker compacts, the first worker
    /// leaves a request to it (nothing goes back to the queue), and that
    /// worker runs it when its own compaction is done.
    #[test]
    fn first_worker_leaves_compaction_to_a_compacting_worker() -> crate::Result<()> {
        let folder = tempfile::tempdir()?;
        let db = Database::builder(&folder)
            .worker_threads_unchecked(0)
            .open()?;
        let ks = db.keyspace("default", KeyspaceCreateOptions::default)?;
        let _ = db.worker_pool.rx.drain().count();
        let first = hand_worker(&db, 2, 0);
        let second = WorkerState {
            compactions: first.compactions.clone(),
            ..hand_worker(&db, 2, 1)
        };

        // The second worker is compacting.
        second.compactions.running.fetch_add(1, Relaxed);
        db.worker_pool
            .sender
            .send(WorkerMessage::Compact(ks.clone()))
            .expect("queue");
        assert!(!worker_tick(&first)?);
        assert!(db.worker_pool.rx.is_empty(), "nothing sent back");
        assert_eq!(first.compactions.left.lock().expect("lock").len(), 1);

        // Its compaction ends: it runs the request left to it.
        second.compactions.running.fetch_sub(1, Relaxed);
        compact(&second, &ks)?;
        assert!(second.compactions.left.lock().expect("lock").is_empty());
        assert_eq!(second.compactions.running.load(Relaxed), 0);

        // With no compaction running, a request left is the caller's.
        assert!(!first.compactions.leave(&ks));
        assert!(first.compactions.left.lock().expect("lock").is_empty());
        Ok(())
    }

    /// Every worker that is actually spawned holds exactly one slot.
    #[test]
    fn claim_and_spawn_claims_one_slot_per_worker() {
        let counter = Arc::new(AtomicUsize::new(0));

        let handles = claim_and_spawn(3, &counter, |i| Ok::<_, std::io::Error>(i))
            .expect("all spawns succeed");

        assert_eq!(handles, vec![0, 1, 2]);
        assert_eq!(counter.load(Relaxed), 3);
    }

    /// A failed spawn releases its own slot and never claims one for the workers
    /// it did not get to. `DatabaseInner::drop` spins until the counter reaches
    /// zero, so a slot held by a thread that does not exist hangs the close
    /// forever.
    #[test]
    fn claim_and_spawn_counts_live_workers_only() {
        let counter = Arc::new(AtomicUsize::new(0));

        let result = claim_and_spawn(4, &counter, |i| {
            if i == 2 {
                Err(std::io::Error::other("cannot spawn thread"))
            } else {
                Ok(i)
            }
        });

        assert!(result.is_err());
        assert_eq!(
            counter.load(Relaxed),
            2,
            "only the two workers that started should hold a slot",
        );
    }

    /// A worker leaving normally releases its slot in the counter.
    #[test]
    fn active_thread_guard_decrements_on_scope_exit() {
        let counter = Arc::new(AtomicUsize::new(1));
        {
            let _guard = ActiveThreadGuard(counter.clone());
            assert_eq!(counter.load(Relaxed), 1);
        }
        assert_eq!(counter.load(Relaxed), 0);
    }

    /// A worker that returns an error releases its slot too: `Database::drop`
    /// spins until the counter reaches zero, so a leaked slot would hang the
    /// close forever.
    #[test]
    fn active_thread_guard_decrements_on_early_return() {
        let counter = Arc::new(AtomicUsize::new(1));

        fn failing_worker(counter: Arc<AtomicUsize>) -> Result<(), ()> {
            let _guard = ActiveThreadGuard(counter);
            Err(())
        }

        assert!(failing_worker(counter.clone()).is_err());
        assert_eq!(counter.load(Relaxed), 0);
    }

    /// A panicking worker releases its slot as well.
    #[test]
    fn active_thread_guard_decrements_on_panic() {
        let counter = Arc::new(AtomicUsize::new(1));
        let counter_in_thread = counter.clone();

        let outcome = std::thread::spawn(move || {
            let _guard = ActiveThreadGuard(counter_in_thread);
            panic!("worker crashed");
        })
        .join();

        assert!(outcome.is_err());
        assert_eq!(counter.load(Relaxed), 0);
    }
}
