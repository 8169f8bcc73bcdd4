//! Loom models of the store's own coordination: the group-commit queue,
//! the memory engine and the fence check plus write (issue 5).
//!
//! Run them (release: loom explores thousands of interleavings) with a
//! target dir of their own, since `--cfg loom` rebuilds every dependency:
//!
//! ```text
//! CARGO_TARGET_DIR=/work/target-loom RUSTFLAGS="--cfg loom" cargo test --release --lib loom
//! ```
//!
//! Each model bounds preemptions to 3 unless `LOOM_MAX_PREEMPTIONS` says
//! otherwise: all of them take about a second at 3 and half a minute at 5
//! (`LOOM_MAX_PREEMPTIONS=5` for a deeper run). Each was checked to fail
//! on a planted bug: a failed commit answering `Ok`, two concurrent
//! leaders, the fence check in its own commit, jobs drained and dropped.
//!
//! What is modelled is only what we wrote: `Committer` (queue, leader flag,
//! answer slots, the one `notify_all` per group, the leader's gathering
//! wait), `MemoryEngine` and the store's fence
//! path over the memory engine. fjall is not loom-aware and is not modelled;
//! the file store's group commit is the same `Committer`.
//!
//! A lost wake-up or a caller that never gets its answer shows up as loom's
//! deadlock report (every thread blocked), so "the model terminates" is
//! checked by running it at all.

use std::collections::BTreeSet;
use std::sync::Mutex as StdMutex;

use loom::thread;

use super::Options;
use super::commit::{Committer, Counters, Sink};
use crate::engine::memory::MemoryEngine;
use crate::engine::{Engine, Write};
use crate::sync::{Arc, AtomicBool, Ordering};
use agentstate_core::api::TrayStore;
use agentstate_core::error::{PersistenceReason, Result, StateError};
use agentstate_core::tray::{InstanceKey, Tray, TrayOp};

/// The default preemption bound; `LOOM_MAX_PREEMPTIONS` overrides it.
const PREEMPTIONS_DEFAULT: usize = 3;

/// Runs `f` under loom with a preemption bound (env first, then ours).
fn model<F: Fn() + Sync + Send + 'static>(f: F) {
    // The default scrubber compiles its rules once per process into a std
    // `LazyLock`. Build them here, on an ordinary thread: inside a model
    // the first build would run on a loom thread's small stack, and a
    // failed execution would leave the lock held for every later one.
    drop(agentstate_core::scrub::Scrubber::default());
    let mut b = loom::model::Builder::new();
    if b.preemption_bound.is_none() {
        b.preemption_bound = Some(PREEMPTIONS_DEFAULT);
    }
    b.check(f);
}

/// A sink over the memory engine that can be told to fail.
struct TestSink {
    engine: MemoryEngine,
    /// A batch holding this key fails to commit (as a failed sync would).
    fail_key: Option<&'static [u8]>,
    /// Set after a failed commit; from then on every group is refused, as
    /// the store does (D6).
    poisoned: AtomicBool,
    /// Every batch handed to `commit`, whether it failed, and its counters.
    /// Touched only under the commit lock, so a std mutex is enough and
    /// keeps loom's state space to the code under test.
    log: StdMutex<Vec<(Vec<Write>, Counters, bool)>>,
}

impl TestSink {
    fn new(fail_key: Option<&'static [u8]>) -> Self {
        TestSink {
            engine: MemoryEngine::default(),
            fail_key,
            poisoned: AtomicBool::new(false),
            log: StdMutex::new(Vec::new()),
        }
    }

    fn get(&self, key: &[u8]) -> Option<Vec<u8>> {
        self.engine.get(key).unwrap()
    }
}

impl Sink for TestSink {
    fn commit(&self, batch: Vec<Write>, counters: Counters) -> Result<()> {
        let fail = self
            .fail_key
            .is_some_and(|k| batch.iter().any(|(bk, _)| bk.as_slice() == k));
        self.log
            .lock()
            .unwrap()
            .push((batch.clone(), counters, fail));
        if fail {
            self.poisoned.store(true, Ordering::SeqCst);
            return Err(StateError::unavailable("injected sync failure", None));
        }
        self.engine.commit(batch)
    }

    fn refused(&self) -> Option<StateError> {
        self.poisoned
            .load(Ordering::SeqCst)
            .then(|| StateError::unavailable("refusing after a failed commit", None))
    }

    fn engine(&self) -> &dyn Engine {
        &self.engine
    }
}

fn is_unavailable<T>(r: &Result<T>) -> bool {
    matches!(
        r,
        Err(StateError::Persistence {
            reason: PersistenceReason::Unavailable,
            ..
        })
    )
}

fn seq_key(seq: u64) -> Vec<u8> {
    format!("seq/{seq}").into_bytes()
}

/// (a') Two callers that each come back with a second request as soon as
/// the first is answered: the one-wake-up hand-off (`notify_all` once per
/// group) and the new leader's wait for the last group's writers (the
/// shim's timed wait, which may end at once) never lose a wake-up, never
/// answer a request twice or not at all, never answer before the commit,
/// and keep seqs gap-free.
#[test]
fn loom_commit_queue_callers_coming_back_are_all_answered() {
    model(|| {
        let sink = Arc::new(TestSink::new(None));
        let committer = Arc::new(Committer::new(Counters {
            next_seq: 1,
            commits: 0,
            next_feed: 1,
        }));
        let caller = |id: u8| {
            let (sink, committer) = (sink.clone(), committer.clone());
            move || {
                let mut seqs = Vec::new();
                for _ in 0..2 {
                    let seq = committer
                        .submit(&*sink, move |txn| {
                            let seq = txn.next_seq;
                            txn.next_seq += 1;
                            txn.put(seq_key(seq), vec![id]);
                            Ok(seq)
                        })
                        .expect("no failure is injected");
                    // An answer comes only after its group committed: the
                    // write is there the moment the caller has its `Ok`.
                    assert_eq!(
                        sink.get(&seq_key(seq)),
                        Some(vec![id]),
                        "answered Ok before its group committed"
                    );
                    seqs.push(seq);
                }
                seqs
            }
        };
        let t1 = thread::spawn(caller(1));
        let mine = caller(0)();
        let theirs = t1.join().unwrap();
        assert!(mine[0] < mine[1] && theirs[0] < theirs[1]);
        let all: BTreeSet<u64> = mine.iter().chain(&theirs).copied().collect();
        assert_eq!(all, BTreeSet::from([1, 2, 3, 4]), "seqs not gap-free");
        for (id, seqs) in [(0u8, &mine), (1, &theirs)] {
            for &seq in seqs {
                assert_eq!(sink.get(&seq_key(seq)), Some(vec![id]));
            }
        }
        let c = committer.counters();
        assert_eq!(c.next_seq, 5);
        assert_eq!(c.commits, sink.log.lock().unwrap().len() as u64);
    });
}

/// (a) Three callers on one committer: each gets exactly its own answer,
/// the groups serialize (every job sees the counter its predecessors left),
/// seqs are handed out gap-free, and the counters count committed groups.
#[test]
fn loom_commit_queue_answers_each_caller_with_gap_free_seqs() {
    model(|| {
        let sink = Arc::new(TestSink::new(None));
        let committer = Arc::new(Committer::new(Counters {
            next_seq: 1,
            commits: 0,
            next_feed: 1,
        }));
        let submit = |id: u8| {
            let (sink, committer) = (sink.clone(), committer.clone());
            move || {
                committer.submit(&*sink, move |txn| {
                    // A read-modify-write of one counter plus a seq: what a
                    // create does, reduced to its coordination.
                    let n = txn.get(b"n")?.map_or(0, |v| v[0]);
                    txn.put(b"n".to_vec(), vec![n + 1]);
                    let seq = txn.next_seq;
                    txn.next_seq += 1;
                    txn.put(seq_key(seq), vec![id]);
                    Ok((id, seq, n))
                })
            }
        };
        let t1 = thread::spawn(submit(1));
        let t2 = thread::spawn(submit(2));
        let r0 = submit(0)();
        let answers = [
            r0.unwrap(),
            t1.join().unwrap().unwrap(),
            t2.join().unwrap().unwrap(),
        ];

        for (i, &(id, seq, n)) in answers.iter().enumerate() {
            assert_eq!(id as usize, i, "caller {i} got another caller's answer");
            // Seq and counter are taken in the same serial order.
            assert_eq!(
                seq,
                u64::from(n) + 1,
                "caller {i}: seq {seq} but saw counter {n}"
            );
            assert_eq!(
                sink.get(&seq_key(seq)),
                Some(vec![id]),
                "seq {seq} not stored for its caller"
            );
        }
        let seqs: BTreeSet<u64> = answers.iter().map(|a| a.1).collect();
        assert_eq!(
            seqs,
            BTreeSet::from([1, 2, 3]),
            "seqs not gap-free and unique"
        );
        assert_eq!(
            sink.get(b"n"),
            Some(vec![3]),
            "a committed increment was lost"
        );

        let log = sink.log.lock().unwrap();
        let c = committer.counters();
        assert_eq!(c.next_seq, 4);
        assert_eq!(
            c.commits,
            log.len() as u64,
            "one commit per non-empty group"
        );
        for (i, (_, counters, failed)) in log.iter().enumerate() {
            assert!(!failed);
            assert_eq!(
                counters.commits,
                i as u64 + 1,
                "group counters out of order"
            );
        }
    });
}

/// (a) A job whose own checks fail contributes nothing: no writes, no seq,
/// and a later job of the same group does not see its writes.
#[test]
fn loom_commit_queue_failed_job_contributes_no_writes() {
    model(|| {
        let sink = Arc::new(TestSink::new(None));
        let committer = Arc::new(Committer::new(Counters {
            next_seq: 1,
            commits: 0,
            next_feed: 1,
        }));
        let failing = {
            let (sink, committer) = (sink.clone(), committer.clone());
            thread::spawn(move || {
                committer.submit(&*sink, |txn| -> Result<()> {
                    txn.put(b"x".to_vec(), b"leaked".to_vec());
                    txn.next_seq += 1;
                    Err(StateError::Conflict {
                        record: agentstate_core::error::RecordKey::Run(
                            agentstate_core::record::RunKey::new("t", "r"),
                        ),
                        expected: 1,
                        actual: 2,
                    })
                })
            })
        };
        let ok = committer.submit(&*sink, |txn| {
            let seen = txn.get(b"x")?;
            let seq = txn.next_seq;
            txn.next_seq += 1;
            txn.put(b"y".to_vec(), vec![1]);
            Ok((seen, seq))
        });
        let failed = failing.join().unwrap();

        assert!(
            matches!(
                failed,
                Err(StateError::Conflict {
                    expected: 1,
                    actual: 2,
                    ..
                })
            ),
            "{failed:?}"
        );
        assert_eq!(
            ok.unwrap(),
            (None, 1),
            "a failed job's write or seq leaked into its group"
        );
        assert_eq!(sink.get(b"x"), None);
        assert_eq!(sink.get(b"y"), Some(vec![1]));
        assert_eq!(committer.counters().next_seq, 2);
        for (batch, _, _) in sink.log.lock().unwrap().iter() {
            assert!(
                batch.iter().all(|(k, _)| k.as_slice() != b"x"),
                "failed job's write reached a batch"
            );
        }
    });
}

/// (a) A failed group commit fails every `Ok` job of its group with
/// `Unavailable` and writes nothing; its seqs are not consumed; and once
/// refused, later groups are refused too (D6). A job that was answered `Ok`
/// is exactly a job whose writes are in the engine.
#[test]
fn loom_commit_queue_failed_commit_fails_whole_group() {
    model(|| {
        let sink = Arc::new(TestSink::new(Some(b"poison")));
        let committer = Arc::new(Committer::new(Counters {
            next_seq: 1,
            commits: 0,
            next_feed: 1,
        }));
        let doomed = {
            let (sink, committer) = (sink.clone(), committer.clone());
            thread::spawn(move || {
                committer.submit(&*sink, |txn| {
                    txn.put(b"poison".to_vec(), vec![1]);
                    let seq = txn.next_seq;
                    txn.next_seq += 1;
                    Ok(seq)
                })
            })
        };
        let other = committer.submit(&*sink, |txn| {
            txn.put(b"b".to_vec(), vec![1]);
            let seq = txn.next_seq;
            txn.next_seq += 1;
            Ok(seq)
        });
        let doomed = doomed.join().unwrap();

        assert!(
            is_unavailable(&doomed),
            "the failing group's job was answered {doomed:?}"
        );
        assert!(doomed.unwrap_err().is_retryable());
        assert_eq!(sink.get(b"poison"), None, "a failed batch left writes");
        let log = sink.log.lock().unwrap();
        let failed_batches: Vec<_> = log.iter().filter(|(_, _, f)| *f).collect();
        assert_eq!(
            failed_batches.len(),
            1,
            "exactly one commit failed, then the sink refused"
        );
        let grouped_with_failure = failed_batches[0]
            .0
            .iter()
            .any(|(k, _)| k.as_slice() == b"b");
        match &other {
            Ok(seq) => {
                assert!(!grouped_with_failure, "Ok for a job of the failed group");
                assert_eq!(*seq, 1, "the committed job's seq is the first one");
                assert_eq!(sink.get(b"b"), Some(vec![1]), "Ok but its write is missing");
                assert_eq!(committer.counters().next_seq, 2);
                assert_eq!(committer.counters().commits, 1);
            }
            Err(_) => {
                assert!(is_unavailable(&other), "{other:?}");
                assert_eq!(sink.get(b"b"), None, "an Unavailable job's write landed");
                assert_eq!(
                    committer.counters().next_seq,
                    1,
                    "a failed group consumed seqs"
                );
                assert_eq!(committer.counters().commits, 0);
            }
        }
    });
}

/// (b) Two overlapping batches and a reader on the memory engine: the
/// reader sees each batch whole, and the last batch wins whole.
#[test]
fn loom_memory_engine_overlapping_batches_stay_whole() {
    model(|| {
        let e = Arc::new(MemoryEngine::default());
        let writer = |v: u8| {
            let e = e.clone();
            thread::spawn(move || {
                e.commit(vec![
                    (b"a".to_vec(), Some(vec![v])),
                    (b"b".to_vec(), Some(vec![v])),
                    (b"c".to_vec(), None),
                ])
                .unwrap();
            })
        };
        e.commit(vec![(b"c".to_vec(), Some(vec![0]))]).unwrap();
        let (w1, w2) = (writer(1), writer(2));
        let seen = e.scan(b"a", b"d", 10).unwrap();
        let values: Vec<&[u8]> = seen.iter().map(|(_, v)| v.as_slice()).collect();
        assert!(
            values == [[0u8].as_slice()]
                || values == [[1u8].as_slice(), &[1]]
                || values == [[2u8].as_slice(), &[2]],
            "saw a torn state: {seen:?}"
        );
        w1.join().unwrap();
        w2.join().unwrap();
        let a = e.get(b"a").unwrap();
        assert_eq!(a, e.get(b"b").unwrap(), "batches interleaved key by key");
        assert_eq!(e.get(b"c").unwrap(), None);
    });
}

fn tray(doc: &str, marked: bool) -> Tray {
    Tray {
        marked,
        doc: doc.as_bytes().to_vec(),
        env: "env".into(),
        hostname: "host".into(),
    }
}

/// (c) T6 through the store itself (memory engine, real commit path, real
/// fence): holders with epochs 1 and 2 write the same tray. Epoch 2 always
/// wins; epoch 1 either landed first (and was overwritten) or gets
/// `FenceLost { caller: 1, stored: 2 }` — it never lands after 2 was stored.
#[test]
fn loom_fence_check_and_write_are_one_step() {
    model(|| {
        let store = Arc::new(crate::MemoryStore::with_options(Options::default()));
        let key = InstanceKey::new("ns", "w").tray("t", "1");
        let old = {
            let (store, key) = (store.clone(), key.clone());
            thread::spawn(move || store.write_tray(&key, 1, tray("e1", true)))
        };
        let new = store.write_tray(&key, 2, tray("e2", false));
        let old = old.join().unwrap();

        assert!(new.is_ok(), "the newest holder was refused: {new:?}");
        match old {
            Ok(()) => {}
            Err(StateError::FenceLost {
                caller: 1,
                stored: 2,
                ..
            }) => {}
            other => panic!("the stale holder got {other:?}"),
        }
        assert_eq!(store.epoch(&key.instance()).unwrap(), 2);
        let stored = store.read_tray(&key, 2).unwrap().expect("tray written");
        assert_eq!(
            stored.doc, b"e2",
            "a stale write landed after the newer epoch was stored"
        );
        // The marked index follows the tray: e2 unmarked it or never marked.
        assert!(
            store
                .marked_trays(None, &agentstate_core::PageRequest::new(10))
                .unwrap()
                .items()
                .is_empty(),
            "stale marked index entry"
        );
    });
}

/// (c) T3 + T6: a batch at epoch 1 racing a write at epoch 2 on one of its
/// trays is all or nothing: both of its trays, or neither and `FenceLost`.
#[test]
fn loom_fenced_batch_is_all_or_nothing() {
    model(|| {
        let store = Arc::new(crate::MemoryStore::with_options(Options::default()));
        let inst = InstanceKey::new("ns", "w");
        let batch = {
            let (store, inst) = (store.clone(), inst.clone());
            thread::spawn(move || {
                let ops = ["a", "b"]
                    .map(|id| TrayOp::Put {
                        tray_ns: "t".into(),
                        tray_id: id.into(),
                        tray: tray("e1", false),
                    })
                    .to_vec();
                store.apply_batch(&inst, 1, ops)
            })
        };
        let new = store.write_tray(&inst.tray("t", "a"), 2, tray("e2", false));
        let batch = batch.join().unwrap();

        assert!(new.is_ok(), "{new:?}");
        let a = store
            .read_tray(&inst.tray("t", "a"), 2)
            .unwrap()
            .map(|t| t.doc);
        let b = store
            .read_tray(&inst.tray("t", "b"), 2)
            .unwrap()
            .map(|t| t.doc);
        assert_eq!(
            a.as_deref(),
            Some(&b"e2"[..]),
            "the stale batch overwrote the newer write"
        );
        match batch {
            Ok(()) => assert_eq!(
                b.as_deref(),
                Some(&b"e1"[..]),
                "batch acknowledged but half applied"
            ),
            Err(StateError::FenceLost {
                caller: 1,
                stored: 2,
                ..
            }) => assert_eq!(b, None, "fenced batch half applied"),
            other => panic!("the stale batch got {other:?}"),
        }
    });
}
