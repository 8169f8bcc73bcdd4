//! The async wrapper (W1–W3): every call mirrored, blocking work off the
//! executor, and dropped futures never leaving a partial write.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use agentstate::{
    Approval, AsyncStore, Clock, Durability, Entry, FileStore, InstanceKey, MemoryStore, Options,
    PageRequest, RunKey, RunRecord, RunState, SessionKey, SessionRecord, StateDelta, StateError,
    StateQuery, Store, ToolCall, Tray, TrayOp, Usage,
};

fn tray(doc: &str, marked: bool) -> Tray {
    Tray {
        marked,
        doc: doc.as_bytes().to_vec(),
        env: "prod".into(),
        hostname: "h".into(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn w1_every_method_answers_like_the_sync_store() {
    // Kept as a `MemoryStore` too, for its commit count.
    let memory = Arc::new(MemoryStore::new());
    let store = AsyncStore::from(memory.clone() as Arc<dyn Store>);
    assert!(store.path().is_none());
    assert!(store.is_empty().await.unwrap());
    let sk = SessionKey::new("acme", "s1");
    let session = store
        .put_session(SessionRecord::new(sk.clone()))
        .await
        .unwrap();
    assert_eq!(store.get_session(&sk).await.unwrap(), Some(session));
    assert_eq!(
        store
            .list_sessions("acme", &PageRequest::new(10))
            .await
            .unwrap()
            .items()
            .len(),
        1
    );
    let key = RunKey::new("acme", "r1");
    let run = store
        .put_run(RunRecord::new(key.clone(), "planner").with_session("s1"))
        .await
        .unwrap();
    assert_eq!(run.version, 1);
    let run = store
        .patch_run(
            &key,
            StateDelta {
                iterations: 2,
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!((run.version, run.iterations), (2, 2));
    assert_eq!(store.get_run(&key).await.unwrap(), Some(run.clone()));
    let page = store
        .list_runs(&StateQuery::new("acme"), &PageRequest::default())
        .await
        .unwrap();
    assert_eq!(page.items(), [run]);
    // Errors come back as the sync store's errors.
    match store.put_run(RunRecord::new(key.clone(), "planner")).await {
        Err(StateError::Conflict {
            expected: 0,
            actual: 2,
            ..
        }) => {}
        other => panic!("{other:?}"),
    }
    match store.delete_session(&sk, false).await {
        Err(StateError::InUse { runs, .. }) => assert_eq!(runs, vec![key.clone()]),
        other => panic!("{other:?}"),
    }

    let inst = InstanceKey::new("chat", "room-1");
    let t = inst.tray("state", "main");
    store.write_tray(&t, 1, tray("a", true)).await.unwrap();
    assert_eq!(store.read_tray(&t, 1).await.unwrap(), Some(tray("a", true)));
    let ops = vec![
        TrayOp::Put {
            tray_ns: "state".into(),
            tray_id: "aux".into(),
            tray: tray("b", false),
        },
        TrayOp::Delete {
            tray_ns: "state".into(),
            tray_id: "gone".into(),
        },
    ];
    store.apply_batch(&inst, 2, ops).await.unwrap();
    assert_eq!(store.epoch(&inst).await.unwrap(), 2);
    assert_eq!(
        store
            .list_trays(&inst, 2, &PageRequest::new(10))
            .await
            .unwrap()
            .items()
            .len(),
        2
    );
    assert_eq!(
        store
            .marked_trays(Some("prod"), &PageRequest::new(10))
            .await
            .unwrap()
            .items()
            .len(),
        1
    );
    store.release(&inst, 2).await.unwrap();
    assert!(
        store
            .marked_trays(None, &PageRequest::new(10))
            .await
            .unwrap()
            .items()
            .is_empty()
    );
    assert!(
        store
            .delete_tray(&inst.tray("state", "aux"), 2)
            .await
            .unwrap()
    );
    store.set_alarm(&inst, 2, 500).await.unwrap();
    let due = store
        .due_alarms(1_000, &PageRequest::new(10))
        .await
        .unwrap();
    assert_eq!(due.items().len(), 1);
    assert!(store.ack_alarm(&inst, 2, 500).await.unwrap());

    let report = store.verify().await.unwrap();
    assert!(report.is_ok(), "{:?}", report.problems);
    let stats = store.stats().await.unwrap();
    assert_eq!(stats.trays, 1);
    let exported = store.export_page(&PageRequest::new(100)).await.unwrap();
    let copy = AsyncStore::memory();
    copy.import(exported.items().to_vec()).await.unwrap();
    assert_eq!(
        copy.export_page(&PageRequest::new(100))
            .await
            .unwrap()
            .items(),
        exported.items()
    );
    let mut done = store.get_run(&key).await.unwrap().unwrap();
    done.state = RunState::Completed;
    store.put_run(done).await.unwrap();
    assert_eq!(store.prune("acme", u64::MAX).await.unwrap(), 1);
    assert_eq!(
        store.delete_session(&sk, false).await.unwrap(),
        Vec::<RunKey>::new()
    );
    assert!(memory.commits() > 0);
    // The sync store underneath sees the same records.
    assert!(store.sync_store().get_run(&key).unwrap().is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn w1_concurrent_patches_add_up_exactly() {
    const TASKS: u64 = 64;
    const PATCHES: u64 = 25;
    let store = AsyncStore::memory();
    let key = RunKey::new("acme", "spend");
    store
        .put_run(RunRecord::new(key.clone(), "planner"))
        .await
        .unwrap();
    let tasks: Vec<_> = (0..TASKS)
        .map(|t| {
            let (store, key) = (store.clone(), key.clone());
            tokio::spawn(async move {
                for _ in 0..PATCHES {
                    let delta = StateDelta {
                        usage: Usage {
                            input_tokens: t,
                            output_tokens: 1,
                        },
                        cost_micros: 1_250,
                        iterations: 1,
                        messages_read: 2,
                    };
                    store.patch_run(&key, delta).await.unwrap();
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let run = store.get_run(&key).await.unwrap().unwrap();
    let n = TASKS * PATCHES;
    assert_eq!(run.cost_micros, n * 1_250);
    assert_eq!(run.iterations, n);
    assert_eq!(run.messages_read, 2 * n);
    assert_eq!(run.usage.input_tokens, PATCHES * (0..TASKS).sum::<u64>());
    assert_eq!(run.usage.output_tokens, n);
    assert_eq!(
        run.version,
        1 + n,
        "every committed patch bumps the version once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn w1_fencing_through_async() {
    let store = AsyncStore::memory();
    let inst = InstanceKey::new("chat", "room-9");
    let t = inst.tray("state", "main");
    store
        .write_tray(&t, 1, tray("epoch 1", true))
        .await
        .unwrap();
    assert_eq!(
        store.read_tray(&t, 2).await.unwrap().unwrap().doc,
        b"epoch 1"
    );
    store
        .write_tray(&t, 2, tray("epoch 2", true))
        .await
        .unwrap();
    // Many stale writers at once: every one is refused, nothing changes.
    let stale: Vec<_> = (0..16)
        .map(|i| {
            let (store, t) = (store.clone(), t.clone());
            tokio::spawn(async move {
                store
                    .write_tray(&t, 1, tray(&format!("stale {i}"), false))
                    .await
            })
        })
        .collect();
    for s in stale {
        match s.await.unwrap() {
            Err(StateError::FenceLost {
                caller: 1,
                stored: 2,
                ..
            }) => {}
            other => panic!("{other:?}"),
        }
    }
    match store
        .apply_batch(
            &inst,
            1,
            vec![TrayOp::Delete {
                tray_ns: "state".into(),
                tray_id: "main".into(),
            }],
        )
        .await
    {
        Err(StateError::FenceLost {
            caller: 1,
            stored: 2,
            ..
        }) => {}
        other => panic!("{other:?}"),
    }
    store.release(&inst, 1).await.unwrap(); // a no-op against the newer holder
    assert_eq!(
        store.read_tray(&t, 2).await.unwrap(),
        Some(tray("epoch 2", true))
    );
}

fn full_run(i: usize) -> RunRecord {
    let mut r = RunRecord::new(RunKey::new("acme", format!("run-{i:03}")), "planner");
    r.state = RunState::AwaitingApproval;
    r.pending_tool_calls = (0..3)
        .map(|c| ToolCall {
            id: format!("c{c}"),
            name: "tool".into(),
            arguments: format!("{{\"n\":{c}}}"),
        })
        .collect();
    r.approval = Some(Approval {
        id: format!("ap-{i}"),
        prompt: "go?".into(),
    });
    r
}

const TRAYS_PER_BATCH: usize = 10;

fn batch() -> Vec<TrayOp> {
    (0..TRAYS_PER_BATCH)
        .map(|t| TrayOp::Put {
            tray_ns: "t".into(),
            tray_id: format!("{t:02}"),
            tray: tray("x", t % 2 == 0),
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn w3_dropped_futures_leave_whole_writes_or_none() {
    const RUNS: usize = 48;
    let dir = tempfile::tempdir().unwrap();
    let store = AsyncStore::open(dir.path().join("db")).await.unwrap();
    // Half the futures are dropped after one poll (a zero timeout), the
    // other half by a select! that another branch wins at once. They run
    // on a runtime of their own, which is dropped afterwards: dropping a
    // runtime waits for every blocking call it started (and cancels the
    // ones it never started), so afterwards the store is quiet.
    let inner = store.clone();
    tokio::task::spawn_blocking(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_time()
            .build()
            .unwrap();
        rt.block_on(async {
            let mut tasks = Vec::new();
            for i in 0..RUNS {
                let store = inner.clone();
                tasks.push(tokio::spawn(async move {
                    let inst = InstanceKey::new("w", format!("{i:03}"));
                    if i % 2 == 0 {
                        let _ =
                            tokio::time::timeout(Duration::ZERO, store.put_run(full_run(i))).await;
                        let _ = tokio::time::timeout(
                            Duration::ZERO,
                            store.apply_batch(&inst, 1, batch()),
                        )
                        .await;
                    } else {
                        // The store branch is polled first (the call is
                        // handed over), then the ready branch wins.
                        tokio::select! {
                            biased;
                            _ = store.put_run(full_run(i)) => {}
                            _ = std::future::ready(()) => {}
                        }
                        tokio::select! {
                            biased;
                            _ = store.apply_batch(&inst, 1, batch()) => {}
                            _ = std::future::ready(()) => {}
                        }
                    }
                }));
            }
            for t in tasks {
                t.await.unwrap();
            }
        });
        drop(rt);
    })
    .await
    .unwrap();

    let (mut runs, mut batches) = (0, 0);
    for i in 0..RUNS {
        let want = full_run(i);
        if let Some(got) = store.get_run(&want.key).await.unwrap() {
            runs += 1;
            assert_eq!(got.version, 1);
            assert_eq!(got.state, want.state);
            assert_eq!(got.pending_tool_calls, want.pending_tool_calls);
            assert_eq!(got.approval, want.approval);
        }
        let inst = InstanceKey::new("w", format!("{i:03}"));
        let n = store
            .list_trays(&inst, 1, &PageRequest::new(100))
            .await
            .unwrap()
            .items()
            .len();
        assert!(
            n == 0 || n == TRAYS_PER_BATCH,
            "instance {i}: {n} of {TRAYS_PER_BATCH} trays"
        );
        batches += usize::from(n > 0);
    }
    let report = store.verify().await.unwrap();
    assert!(report.is_ok(), "{:?}", report.problems);
    // A dropped future's write may still land: the count is whatever landed.
    let marked = store
        .marked_trays(None, &PageRequest::new(1000))
        .await
        .unwrap()
        .items()
        .len();
    assert_eq!(marked, batches * TRAYS_PER_BATCH / 2);
    eprintln!(
        "dropped futures: {runs} of {RUNS} runs and {batches} of {RUNS} batches landed, whole"
    );
}

/// A clock that records the threads it is read on: the store reads it on
/// the thread that runs each write.
#[derive(Default)]
struct ThreadClock(std::sync::Mutex<Vec<std::thread::ThreadId>>);

impl Clock for ThreadClock {
    fn now_millis(&self) -> u64 {
        self.0.lock().unwrap().push(std::thread::current().id());
        1_000
    }
}

#[tokio::test(flavor = "current_thread")]
async fn w2_durable_writes_leave_the_executor_free() {
    const WRITES: u64 = 200;
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ThreadClock::default());
    let opts = Options::new()
        .clock(clock.clone())
        .durability(Durability::Immediate);
    let store = AsyncStore::open_with(dir.path().join("db"), opts)
        .await
        .unwrap();
    let key = RunKey::new("acme", "r1");
    store
        .put_run(RunRecord::new(key.clone(), "planner"))
        .await
        .unwrap();

    // A ticker on the one executor thread counts how often it gets to run
    // while the writer's 200 synced writes are in flight. If a write ran on
    // the executor thread, the writer would never yield and the ticker
    // would not run at all until the writer finished.
    let ticks = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let ticker = {
        let (ticks, stop) = (ticks.clone(), stop.clone());
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                ticks.fetch_add(1, Ordering::Relaxed);
                tokio::task::yield_now().await;
            }
        })
    };
    let executor = std::thread::current().id();
    let before = ticks.load(Ordering::Relaxed);
    for _ in 0..WRITES {
        store
            .patch_run(
                &key,
                StateDelta {
                    iterations: 1,
                    ..Default::default()
                },
            )
            .await
            .unwrap();
    }
    let during = ticks.load(Ordering::Relaxed) - before;
    stop.store(true, Ordering::Relaxed);
    ticker.await.unwrap();

    assert_eq!(
        store.get_run(&key).await.unwrap().unwrap().iterations,
        WRITES
    );
    assert!(
        during >= WRITES / 2,
        "the ticker ran {during} times during {WRITES} writes"
    );
    let threads = clock.0.lock().unwrap().clone();
    assert!(
        threads.len() as u64 > WRITES,
        "the clock is read on every write"
    );
    assert!(
        !threads.contains(&executor),
        "a store call ran on the executor thread"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn w2_a_held_store_fails_to_open_and_the_wrapper_shares_one_handle() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("db");
    let store = AsyncStore::open(&path).await.unwrap();
    match AsyncStore::open(&path).await {
        Err(StateError::Locked {
            path: p,
            this_process,
        }) => assert_eq!((p, this_process), (path.clone(), true)),
        other => panic!("{other:?}"),
    }
    // Clones share the one handle; the store closes with the last clone.
    let clone = store.clone();
    clone
        .put_run(RunRecord::new(RunKey::new("a", "r"), "x"))
        .await
        .unwrap();
    assert_eq!(store.path(), Some(path.as_path()));
    assert!(!clone.close().await.unwrap(), "another handle is alive");
    assert!(
        store.close().await.unwrap(),
        "the last handle closes the store"
    );
    let reopened = AsyncStore::from(FileStore::open(&path).unwrap());
    assert!(
        reopened
            .get_run(&RunKey::new("a", "r"))
            .await
            .unwrap()
            .is_some()
    );
    let copy = AsyncStore::from(Arc::new(MemoryStore::new()) as Arc<dyn Store>);
    let entries: Vec<Entry> = reopened
        .export_page(&PageRequest::new(10))
        .await
        .unwrap()
        .items()
        .to_vec();
    copy.import(entries).await.unwrap();
    assert!(!copy.is_empty().await.unwrap());
}

/// W1 for the keyed writes: each `*_idempotent` method answers like the
/// sync one, and a repeat through the wrapper applies nothing again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn w1_keyed_writes_through_async_apply_once() {
    use agentstate::{Caps, Hold, IdempotencyKey, InstanceKey, TrayOp};
    let store = AsyncStore::from(Arc::new(MemoryStore::new()) as Arc<dyn Store>);
    let key = RunKey::new("acme", "keyed");
    let k = |s: &str| IdempotencyKey::new(s).unwrap();
    let rec = RunRecord::new(key.clone(), "planner").with_caps(Caps::new().cost_micros(100));
    let created = store
        .put_run_idempotent(rec.clone(), &k("c"))
        .await
        .unwrap();
    assert_eq!(
        store.put_run_idempotent(rec, &k("c")).await.unwrap(),
        created
    );
    let d = StateDelta {
        cost_micros: 3,
        ..Default::default()
    };
    let p = store.patch_run_idempotent(&key, d, &k("p")).await.unwrap();
    assert_eq!(
        store.patch_run_idempotent(&key, d, &k("p")).await.unwrap(),
        p
    );
    let hold = || Hold::new("h", 60_000).cost_micros(10);
    let h = store
        .reserve_idempotent(&key, hold(), &k("r"))
        .await
        .unwrap();
    assert_eq!(
        store
            .reserve_idempotent(&key, hold(), &k("r"))
            .await
            .unwrap(),
        h
    );
    let s1 = store
        .settle_idempotent(&key, "h", d, &k("s"))
        .await
        .unwrap();
    assert_eq!(
        store
            .settle_idempotent(&key, "h", d, &k("s"))
            .await
            .unwrap(),
        s1
    );
    store
        .reserve(&key, Hold::new("h2", 60_000).cost_micros(1))
        .await
        .unwrap();
    store
        .release_hold_idempotent(&key, "h2", &k("x"))
        .await
        .unwrap();
    store
        .release_hold_idempotent(&key, "h2", &k("x"))
        .await
        .unwrap();
    let inst = InstanceKey::new("ns", "w");
    let ops = vec![TrayOp::Delete {
        tray_ns: "a".into(),
        tray_id: "b".into(),
    }];
    store
        .apply_batch_idempotent(&inst, 1, ops.clone(), &k("b"))
        .await
        .unwrap();
    store
        .apply_batch_idempotent(&inst, 1, ops, &k("b"))
        .await
        .unwrap();
    assert_eq!(store.get_run(&key).await.unwrap().unwrap().cost_micros, 6);
}

/// W3 over a server store: the last `AsyncStore` over a `PostgresStore`
/// dropped inside a multi-thread and a current-thread runtime, a future
/// dropped mid-call, and a store dropped outside any runtime: no panic,
/// and the writes that answered are there.
#[cfg(feature = "postgres")]
#[test]
fn w3_postgres_stores_and_futures_drop_inside_and_outside_runtimes() {
    use agentstate::{PostgresStore, StateStore};
    let dsn = crate::pg_server::fresh_db("w3");
    let connect = {
        let dsn = dsn.clone();
        move || {
            let s = PostgresStore::connect(&dsn).expect("connect");
            s.setup().expect("setup");
            s
        }
    };
    let key = RunKey::new("acme", "w3");
    for flavor in ["multi", "current"] {
        let rt = match flavor {
            "multi" => tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap(),
            _ => tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap(),
        };
        let connect = connect.clone();
        let key = key.clone();
        rt.block_on(async move {
            // Made on the blocking pool: the sync client's connect runs a
            // runtime of its own.
            let pg = tokio::task::spawn_blocking(connect).await.unwrap();
            let store = AsyncStore::new(pg);
            let clone = store.clone();
            let run = RunRecord::new(RunKey::new("acme", format!("w3-{flavor}")), "planner");
            store.put_run(run).await.unwrap();
            if flavor == "multi" && store.get_run(&key).await.unwrap().is_none() {
                store
                    .put_run(RunRecord::new(key.clone(), "planner"))
                    .await
                    .unwrap();
            }
            // A future dropped before it is polled to the end.
            let pending = clone.patch_run(
                &key,
                StateDelta {
                    iterations: 1,
                    ..Default::default()
                },
            );
            drop(pending);
            drop(clone);
            // The last handle, inside the runtime.
            drop(store);
        });
        drop(rt);
    }
    // Outside any runtime.
    let pg = connect();
    let store = AsyncStore::new(pg);
    drop(store);
    let pg = connect();
    assert!(
        pg.get_run(&RunKey::new("acme", "w3-multi"))
            .unwrap()
            .is_some()
    );
    assert!(
        pg.get_run(&RunKey::new("acme", "w3-current"))
            .unwrap()
            .is_some()
    );
}

/// The walks as `Stream`s: every item once, in listing order, across
/// pages, while another task writes; `after` resumes where a page ended.
#[tokio::test(flavor = "current_thread")]
async fn w1_walks_are_streams_that_visit_every_item_once() {
    let store = AsyncStore::memory();
    for i in 0..25 {
        store
            .put_run(RunRecord::new(
                RunKey::new("acme", format!("run-{i:02}")),
                "planner",
            ))
            .await
            .unwrap();
    }
    let mut walk = store.iter_runs(&StateQuery::new("acme")).page_size(4);
    let mut seen = Vec::new();
    while let Some(run) = walk.next().await {
        let run = run.unwrap();
        // Writes between pages (new runs land after the walk's end, as L2
        // allows; stored ones move on in version only).
        if seen.len() % 5 == 0 {
            store
                .patch_run(&run.key, StateDelta::default())
                .await
                .unwrap();
        }
        seen.push(run.key.run_id);
    }
    let want: Vec<String> = (0..25).map(|i| format!("run-{i:02}")).collect();
    assert_eq!(seen, want);

    // Resuming after a page's cursor continues the same walk.
    let first = store
        .list_runs(&StateQuery::new("acme"), &PageRequest::new(10))
        .await
        .unwrap();
    let rest = store
        .iter_runs(&StateQuery::new("acme"))
        .after(first.cursor())
        .collect_all()
        .await
        .unwrap();
    assert_eq!(rest.len(), 15);
    assert_eq!(rest[0].key.run_id, "run-10");

    // Trays, marked trays, sessions and budgets walk the same way.
    let inst = InstanceKey::new("chat", "room-1");
    for i in 0..7 {
        store
            .write_tray(
                &inst.tray("state", format!("t{i}")),
                1,
                tray("{}", i % 2 == 0),
            )
            .await
            .unwrap();
    }
    let trays = store
        .iter_trays(&inst, 1)
        .page_size(3)
        .collect_all()
        .await
        .unwrap();
    assert_eq!(trays.len(), 7);
    let marked = store
        .iter_marked_trays(Some("prod"))
        .collect_all()
        .await
        .unwrap();
    assert_eq!(marked.len(), 4);
    assert!(
        store
            .iter_sessions("acme")
            .collect_all()
            .await
            .unwrap()
            .is_empty()
    );
    assert!(
        store
            .iter_budgets("acme")
            .collect_all()
            .await
            .unwrap()
            .is_empty()
    );
    // A fenced holder's walk stops with FenceLost.
    store.epoch(&inst).await.unwrap();
    store.release(&inst, 5).await.unwrap();
    let mut fenced = store.iter_trays(&inst, 1);
    assert!(matches!(
        fenced.next().await,
        Some(Err(StateError::FenceLost { .. }))
    ));
    assert!(fenced.next().await.is_none(), "nothing after an error");
}

/// `update_run` under contention, on both runtimes: every edit lands once,
/// the conflicts retried on the runtime's timer.
#[test]
fn w1_update_run_retries_conflicts_on_the_runtime_timer() {
    for multi in [false, true] {
        let rt = if multi {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
        } else {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
        }
        .unwrap();
        let dir = tempfile::tempdir().unwrap();
        rt.block_on(async {
            let opts = Options::new().durability(Durability::Buffered);
            let store = AsyncStore::open_with(dir.path(), opts).await.unwrap();
            let key = RunKey::new("acme", "counter");
            store
                .put_run(RunRecord::new(key.clone(), "planner"))
                .await
                .unwrap();
            let tasks: Vec<_> = (0..16)
                .map(|_| {
                    let (store, key) = (store.clone(), key.clone());
                    tokio::spawn(async move {
                        for _ in 0..5 {
                            store
                                .update_run(&key, |run| {
                                    run.agent_name.push('+');
                                    Ok(())
                                })
                                .await
                                .unwrap();
                        }
                    })
                })
                .collect();
            for t in tasks {
                t.await.unwrap();
            }
            let run = store.get_run(&key).await.unwrap().unwrap();
            assert_eq!(
                run.agent_name.len(),
                "planner".len() + 80,
                "multi_thread: {multi}"
            );
            assert_eq!(run.version, 81);
            store.close().await.unwrap();
        });
    }
}
