//! Group commit: the one path every write takes.
//!
//! A caller queues a job (after doing, in its own thread, all the work that
//! needs no lock: validation, scrubbing, keys). When no group is running,
//! the caller becomes the leader: it drains the queue, runs each job against
//! the engine plus the writes of the jobs before it in the group, applies
//! the whole group as one atomic batch with one sync, writes every job's
//! answer into its slot, and then wakes every waiting caller with one
//! `notify_all`: answered callers leave, and one of the others leads the
//! next group. While a leader syncs, the next group gathers in the queue,
//! so N writers share syncs (rule D2).
//!
//! A new leader that finds fewer jobs queued than the last group held waits
//! for them a moment (at most half the last group's time, and 500 µs):
//! the callers just answered are on their way back with their next
//! requests, and without the wait the first of them would lead a group of
//! one and the rest would pay its sync.
//!
//! Invariant: a caller's job is either answered or still in the queue while
//! no group runs — never lost, never answered twice.
//! Invariant: a job's `Ok` is delivered only after its group's batch was
//! committed; a job whose own checks fail contributes no writes.

use std::collections::BTreeMap;
use std::ops::Bound;
use std::time::{Duration, Instant};

use crate::engine::{Engine, Write};
use crate::runs::SeqHints;
#[cfg(not(loom))]
use crate::sync::Arc;
use crate::sync::{Condvar, Mutex};
use agentstate_core::error::{Result, StateError};
use agentstate_core::limits::GROUP_JOBS_MAX;
// A job's handles are std's `Arc` under loom too: loom's cannot hold a
// `dyn Job`, and what the models explore is the job's mutex, not its count.
#[cfg(loom)]
use std::sync::Arc;

/// Pending writes, one per engine key (a later write of a key replaces
/// the earlier); `None` deletes.
///
/// A create writes four or five keys and a group holds a few jobs, so the
/// usual overlay is a short list: a plain `Vec` searched from its end, with
/// no node to allocate, no ordered insert, and handed to the engine as the
/// batch itself. Past [`OVERLAY_LIST_MAX`] entries (an import, a group of
/// many jobs) it becomes a `BTreeMap`, so a put or read stays O(log n).
#[derive(Debug, Clone)]
pub(crate) enum Overlay {
    /// Distinct keys in the order first written.
    List(Vec<Write>),
    /// Keyed, for overlays too long to search.
    Map(BTreeMap<Vec<u8>, Option<Vec<u8>>>),
}

/// A pending write as a scan sees it: the key, and its value (`None`:
/// deleted).
type Pending<'s> = (&'s [u8], Option<&'s Vec<u8>>);

/// The longest overlay kept as a list.
const OVERLAY_LIST_MAX: usize = 32;

impl Default for Overlay {
    fn default() -> Self {
        Overlay::List(Vec::new())
    }
}

impl Overlay {
    pub(crate) fn is_empty(&self) -> bool {
        match self {
            Overlay::List(l) => l.is_empty(),
            Overlay::Map(m) => m.is_empty(),
        }
    }

    /// The pending write of `key`: `Some(None)` when it is deleted.
    pub(crate) fn get(&self, key: &[u8]) -> Option<&Option<Vec<u8>>> {
        match self {
            Overlay::List(l) => l.iter().rev().find(|(k, _)| k == key).map(|(_, v)| v),
            Overlay::Map(m) => m.get(key),
        }
    }

    /// Sets `key`'s pending write, replacing an earlier one.
    pub(crate) fn insert(&mut self, key: Vec<u8>, value: Option<Vec<u8>>) {
        match self {
            Overlay::List(l) => {
                if let Some(slot) = l.iter_mut().rev().find(|(k, _)| *k == key) {
                    slot.1 = value;
                } else if l.len() < OVERLAY_LIST_MAX {
                    l.push((key, value));
                } else {
                    let mut m: BTreeMap<_, _> = std::mem::take(l).into_iter().collect();
                    m.insert(key, value);
                    *self = Overlay::Map(m);
                }
            }
            Overlay::Map(m) => {
                m.insert(key, value);
            }
        }
    }

    /// Applies `later`'s writes over these.
    pub(crate) fn extend(&mut self, later: Overlay) {
        if self.is_empty() {
            // Taken whole, not re-inserted.
            *self = later;
            return;
        }
        match later {
            Overlay::List(l) => {
                for (k, v) in l {
                    self.insert(k, v);
                }
            }
            Overlay::Map(m) => {
                for (k, v) in m {
                    self.insert(k, v);
                }
            }
        }
    }

    /// The pending writes with `start <= key < end`, in no order.
    fn range<'s>(
        &'s self,
        start: &'s [u8],
        end: &'s [u8],
    ) -> Box<dyn Iterator<Item = Pending<'s>> + 's> {
        match self {
            Overlay::List(l) => Box::new(
                l.iter()
                    .filter(move |(k, _)| k.as_slice() >= start && k.as_slice() < end)
                    .map(|(k, v)| (k.as_slice(), v.as_ref())),
            ),
            Overlay::Map(m) => Box::new(
                m.range::<[u8], _>((Bound::Included(start), Bound::Excluded(end)))
                    .map(|(k, v)| (k.as_slice(), v.as_ref())),
            ),
        }
    }

    /// Calls `f` with every pending write (`None`: deleted), in no order.
    pub(crate) fn for_each(&self, mut f: impl FnMut(&[u8], Option<&Vec<u8>>)) {
        match self {
            Overlay::List(l) => l.iter().for_each(|(k, v)| f(k, v.as_ref())),
            Overlay::Map(m) => m.iter().for_each(|(k, v)| f(k, v.as_ref())),
        }
    }

    /// The writes as one batch, in key order.
    pub(crate) fn into_batch(self) -> Vec<Write> {
        match self {
            Overlay::List(mut l) => {
                l.sort_unstable_by(|a, b| a.0.cmp(&b.0));
                l
            }
            Overlay::Map(m) => m.into_iter().collect(),
        }
    }
}

/// KvStore-wide counters owned by the commit lock.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Counters {
    /// The next run `seq` to hand out.
    pub(crate) next_seq: u64,
    /// Groups committed so far (the high-water mark's unit).
    pub(crate) commits: u64,
    /// The next change-feed position (see `kv::feed`).
    pub(crate) next_feed: u64,
}

/// A job's view of the store: engine, then group, then its own writes.
pub(crate) struct Txn<'a> {
    engine: &'a dyn Engine,
    group: &'a Overlay,
    writes: Overlay,
    /// The next `seq`; a job that creates a run takes it and bumps it.
    pub(crate) next_seq: u64,
    /// When set, every key this job reads or writes is moved into the
    /// import's staging table (see `kv::transfer`): the job sees and
    /// builds the staged records, and nothing of the live tables.
    pub(crate) staged: bool,
    /// Where runs were last found (see `runs::SeqHints`), when the sink
    /// keeps them.
    hints: Option<&'a SeqHints>,
}

impl<'a> Txn<'a> {
    /// The seq a run was last found at, by its id-map key: a hint to check
    /// (see `runs::SeqHints`); none for a staged job, whose keys are not
    /// the live ones.
    pub(crate) fn seq_hint(&self, id_key: &[u8]) -> Option<u64> {
        self.hints.filter(|_| !self.staged)?.get(id_key)
    }

    /// Notes where a run was found (through its id-map entry).
    pub(crate) fn note_seq(&self, id_key: &[u8], seq: u64) {
        if let Some(h) = self.hints.filter(|_| !self.staged) {
            h.note(id_key.to_vec(), seq);
        }
    }

    /// The key as stored: under the staging table when `staged`.
    fn at(&self, key: &[u8]) -> Vec<u8> {
        if self.staged {
            crate::key::staged(key)
        } else {
            key.to_vec()
        }
    }

    pub(crate) fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        let staged;
        let key = if self.staged {
            staged = self.at(key);
            staged.as_slice()
        } else {
            key
        };
        if let Some(v) = self.writes.get(key) {
            return Ok(v.clone());
        }
        if let Some(v) = self.group.get(key) {
            return Ok(v.clone());
        }
        self.engine.get(key)
    }

    /// Forgets every write this job made (the engine and the group's are
    /// untouched): an idempotent call that is refused keeps only the
    /// record of its refusal.
    pub(crate) fn discard_writes(&mut self) {
        self.writes = Overlay::default();
    }

    pub(crate) fn put(&mut self, key: Vec<u8>, value: Vec<u8>) {
        let key = if self.staged { self.at(&key) } else { key };
        self.writes.insert(key, Some(value));
    }

    pub(crate) fn delete(&mut self, key: Vec<u8>) {
        let key = if self.staged { self.at(&key) } else { key };
        self.writes.insert(key, None);
    }

    /// Up to `limit` live pairs with `start <= key < end`, as this job sees
    /// them.
    pub(crate) fn scan(
        &self,
        start: &[u8],
        end: &[u8],
        limit: usize,
    ) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
        if self.staged {
            let (start, end) = (self.at(start), self.at(end));
            let unstaged = Txn {
                engine: self.engine,
                group: self.group,
                writes: self.writes.clone(),
                next_seq: self.next_seq,
                staged: false,
                hints: None,
            };
            return Ok(unstaged
                .scan(&start, &end, limit)?
                .into_iter()
                .map(|(k, v)| (k[1..].to_vec(), v))
                .collect());
        }
        if start >= end {
            return Ok(Vec::new());
        }
        // Each pending entry hides at most one engine entry, so asking the
        // engine for that many more is always enough.
        let mut pending: BTreeMap<&[u8], Option<&Vec<u8>>> = BTreeMap::new();
        for layer in [self.group, &self.writes] {
            for (k, v) in layer.range(start, end) {
                pending.insert(k, v);
            }
        }
        let base = self
            .engine
            .scan(start, end, limit.saturating_add(pending.len()))?;
        let mut merged: BTreeMap<Vec<u8>, Vec<u8>> = base.into_iter().collect();
        for (k, v) in pending {
            match v {
                Some(v) => merged.insert(k.to_vec(), v.clone()),
                None => merged.remove(k),
            };
        }
        Ok(merged.into_iter().take(limit).collect())
    }
}

/// A queued request: runs inside a group, answers after the commit.
trait Job: Send + Sync {
    /// Runs the request; returns its writes when it succeeded.
    fn run(&self, txn: &mut Txn<'_>) -> bool;
    /// Delivers the answer; `failed` is the group's commit error, if any.
    fn finish(&self, failed: Option<&dyn Fn() -> StateError>);
}

/// A request and its answer, shared by the caller (who reads the answer)
/// and the queue (whose leader runs it): one allocation per request, and
/// the answer written once, where the caller takes it.
struct TypedJob<T, F> {
    cell: Mutex<JobCell<T, F>>,
}

struct JobCell<T, F> {
    /// The request, until it runs.
    f: Option<F>,
    /// What it returned; final (and the caller's to take) once `answered`.
    out: Option<Result<T>>,
    /// Set by `finish`, after the group's commit.
    answered: bool,
}

impl<T, F> Job for TypedJob<T, F>
where
    T: Send + 'static,
    F: FnOnce(&mut Txn<'_>) -> Result<T> + Send + 'static,
{
    #[allow(clippy::expect_used, reason = "a job runs once")]
    fn run(&self, txn: &mut Txn<'_>) -> bool {
        let f = self.cell.lock().f.take().expect("a job runs once");
        let out = f(txn);
        let ok = out.is_ok();
        self.cell.lock().out = Some(out);
        ok
    }

    fn finish(&self, failed: Option<&dyn Fn() -> StateError>) {
        let mut cell = self.cell.lock();
        debug_assert!(!cell.answered, "a job is answered once");
        match (&cell.out, failed) {
            (Some(Ok(_)), Some(err)) => cell.out = Some(Err(err())),
            (Some(_), _) => {}
            // Never ran: its group failed before it (the store is poisoned).
            (None, Some(err)) => cell.out = Some(Err(err())),
            (None, None) => {
                cell.out = Some(Err(StateError::unavailable("request was not run", None)));
            }
        }
        cell.answered = true;
    }
}

/// What the leader does with a group's batch.
pub(crate) trait Sink: Send + Sync {
    /// Commits the batch (atomic, durable); called only for non-empty groups.
    fn commit(&self, batch: Vec<Write>, counters: Counters) -> Result<()>;
    /// The error every caller gets once the store refuses writes.
    fn refused(&self) -> Option<StateError>;
    /// The engine jobs read through.
    fn engine(&self) -> &dyn Engine;
    /// Where jobs note and look up the seqs runs were found at, if the
    /// sink keeps them.
    fn seq_hints(&self) -> Option<&SeqHints> {
        None
    }
}

/// What the queue mutex guards.
struct Queue {
    jobs: Vec<Arc<dyn Job>>,
    /// An empty list to swap with `jobs` when a leader takes them all, so
    /// a group costs no allocation of its own.
    spare: Vec<Arc<dyn Job>>,
    /// A leader is running a group (from draining it to answering it).
    leading: bool,
    /// Jobs in the last group: the writers expected back for the next one.
    last_group: usize,
    /// How long the last group took from drain to answers.
    last_took: Duration,
    /// While a leader gathers: the queue length it waits for (0: none).
    gather_until: usize,
}

/// The commit queue, the leader's flag and the counters.
pub(crate) struct Committer {
    queue: Mutex<Queue>,
    /// Notified once per answered group: every waiter then looks at its
    /// own slot (answered ones leave, one of the others leads next).
    answered: Condvar,
    /// Notified when a gathering leader's group is full.
    arrived: Condvar,
    /// Held by the leader while it runs a group.
    counters: Mutex<Counters>,
}

/// The longest a leader waits for the writers of the last group to queue
/// again; never more than half the time the last group took.
const GATHER_MAX: Duration = Duration::from_micros(500);

impl Committer {
    pub(crate) fn new(counters: Counters) -> Self {
        Committer {
            queue: Mutex::new(Queue {
                jobs: Vec::new(),
                spare: Vec::new(),
                leading: false,
                last_group: 0,
                last_took: Duration::ZERO,
                gather_until: 0,
            }),
            answered: Condvar::new(),
            arrived: Condvar::new(),
            counters: Mutex::new(counters),
        }
    }

    pub(crate) fn counters(&self) -> Counters {
        *self.counters.lock()
    }

    /// Runs `f` in a group and returns its answer once the group committed.
    #[allow(clippy::expect_used, reason = "an answered job holds its answer")]
    pub(crate) fn submit<T, F>(&self, sink: &dyn Sink, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut Txn<'_>) -> Result<T> + Send + 'static,
    {
        let job = Arc::new(TypedJob {
            cell: Mutex::new(JobCell {
                f: Some(f),
                out: None,
                answered: false,
            }),
        });
        let mut q = self.queue.lock();
        q.jobs.push(job.clone());
        if q.gather_until != 0 && q.jobs.len() >= q.gather_until {
            self.arrived.notify_one();
        }
        loop {
            // Answers are written before the group's `answered` notice,
            // under no lock but the job's own.
            {
                let mut cell = job.cell.lock();
                if cell.answered {
                    return cell.out.take().expect("an answered job holds its answer");
                }
            }
            if q.leading {
                q = self.answered.wait(q);
                continue;
            }
            // Our job is still queued (see the invariant): lead a group.
            q.leading = true;
            // The writers just answered are coming back with their next
            // requests; a group that waits a moment for them shares one
            // sync instead of paying one of its own.
            let want = q.last_group.min(GROUP_JOBS_MAX);
            if q.jobs.len() < want && !q.last_took.is_zero() {
                q.gather_until = want;
                let window = (q.last_took / 2).min(GATHER_MAX);
                q = self.arrived.wait_timeout(&self.queue, q, window);
                q.gather_until = 0;
            }
            let n = q.jobs.len().min(GROUP_JOBS_MAX);
            let mut group = if n == q.jobs.len() {
                let spare = std::mem::take(&mut q.spare);
                std::mem::replace(&mut q.jobs, spare)
            } else {
                q.jobs.drain(..n).collect()
            };
            drop(q);
            let started = Instant::now();
            {
                let mut counters = self.counters.lock();
                Self::run_group(sink, &mut counters, &mut group);
            }
            let took = started.elapsed();
            q = self.queue.lock();
            if q.spare.capacity() < group.capacity() {
                q.spare = group;
            }
            q.leading = false;
            q.last_group = n;
            q.last_took = took;
            // One wake-up for the whole group.
            self.answered.notify_all();
        }
    }

    /// Runs and answers the jobs of `group`, leaving it empty.
    fn run_group(sink: &dyn Sink, counters: &mut Counters, group: &mut Vec<Arc<dyn Job>>) {
        if let Some(err) = sink.refused() {
            let make = move || err.replicate();
            for job in group.drain(..) {
                job.finish(Some(&make));
            }
            return;
        }
        debug_assert!(!group.is_empty(), "a group holds at least its leader's job");
        let mut overlay = Overlay::default();
        let mut next_seq = counters.next_seq;
        let jobs = group;
        for job in jobs.iter() {
            let mut txn = Txn {
                engine: sink.engine(),
                group: &overlay,
                writes: Overlay::default(),
                next_seq,
                staged: false,
                hints: sink.seq_hints(),
            };
            if job.run(&mut txn) {
                debug_assert!(txn.next_seq >= next_seq, "a job never hands a seq back");
                next_seq = txn.next_seq;
                overlay.extend(txn.writes);
            }
        }
        if overlay.is_empty() {
            for job in jobs.drain(..) {
                job.finish(None);
            }
            return;
        }
        let mut next_feed = counters.next_feed;
        if let Err(e) = crate::feed::note(
            sink.engine(),
            &mut overlay,
            &mut next_feed,
            counters.next_seq,
        ) {
            let make = move || e.replicate();
            for job in jobs.drain(..) {
                job.finish(Some(&make));
            }
            return;
        }
        debug_assert!(
            next_feed >= counters.next_feed,
            "feed positions only move forward"
        );
        let next = Counters {
            next_seq,
            commits: counters.commits + 1,
            next_feed,
        };
        agentstate_core::observe::group_commit(jobs.len());
        match sink.commit(overlay.into_batch(), next) {
            Ok(()) => {
                *counters = next;
                for job in jobs.drain(..) {
                    job.finish(None);
                }
            }
            Err(e) => {
                // Each caller gets the error itself (variant, text, source),
                // not its text wrapped again.
                let make = move || e.replicate();
                for job in jobs.drain(..) {
                    job.finish(Some(&make));
                }
            }
        }
    }
}
