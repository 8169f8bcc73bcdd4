//! The paging and backend API: `Pages` and the `iter_*` walks,
//! `StateStoreExt::update_run`, and both backends used as `dyn Store`.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};

use agentstate::Clock as _;
use agentstate::{
    Cursor, Durability, Entry, FileStore, InstanceKey, MemoryStore, Missing, Options, Page,
    PageRequest, Pages, RetryPolicy, RunKey, RunRecord, RunState, SessionKey, SessionRecord,
    StateDelta, StateError, StateQuery, StateStoreExt, Store, StoreAdmin, Tray, TrayOp,
};

// ---------------------------------------------------------------------------
// Pages.

/// A listing of `0..n` over a fetch that counts its calls: the cursor is
/// the offset the next page starts at, and the last page has none.
fn numbers<'a>(n: usize, size: usize, calls: &'a AtomicUsize) -> Pages<'a, usize> {
    Pages::new(move |req: &PageRequest| {
        calls.fetch_add(1, Ordering::SeqCst);
        assert_eq!(req.limit, size, "every page asks for the page size");
        let from: usize = req
            .cursor
            .as_ref()
            .map_or(0, |c| c.as_str().parse().expect("a cursor this fetch made"));
        let to = (from + req.limit).min(n);
        let next = (to < n).then(|| Cursor::from_text(to.to_string()));
        Page::new((from..to).collect(), next)
    })
    .page_size(size)
}

#[test]
fn pages_walk_every_item_once_and_stop_after_the_last_page() {
    for n in [0, 1, 6, 7, 8, 99, 100, 101, 250] {
        for size in [1, 7, 100] {
            let calls = AtomicUsize::new(0);
            let mut pages = numbers(n, size, &calls);
            let got: Vec<usize> = pages.by_ref().collect::<agentstate::Result<_>>().unwrap();
            assert_eq!(got, (0..n).collect::<Vec<_>>(), "n {n}, page size {size}");
            let want_calls = n.div_ceil(size).max(1);
            assert_eq!(
                calls.load(Ordering::SeqCst),
                want_calls,
                "n {n}, size {size}"
            );
            // Done for good: no further fetch.
            assert!(pages.next().is_none());
            assert!(pages.next().is_none());
            assert_eq!(calls.load(Ordering::SeqCst), want_calls);
        }
    }
}

#[test]
fn pages_yield_a_fetch_error_then_stop() {
    let calls = AtomicUsize::new(0);
    let mut pages = Pages::new(
        |req: &PageRequest| match calls.fetch_add(1, Ordering::SeqCst) {
            0 => {
                assert!(req.cursor.is_none());
                Page::new(vec![1, 2, 3], Some(Cursor::from_text("3")))
            }
            1 => {
                assert_eq!(req.cursor.as_ref().map(Cursor::as_str), Some("3"));
                Err(StateError::Invalid {
                    what: "the second page fails".into(),
                })
            }
            n => panic!("fetch called again after an error (call {n})"),
        },
    )
    .page_size(3);
    for want in [1, 2, 3] {
        assert_eq!(pages.next().unwrap().unwrap(), want);
    }
    match pages.next() {
        Some(Err(StateError::Invalid { what })) => assert_eq!(what, "the second page fails"),
        other => panic!("{other:?}"),
    }
    assert!(pages.next().is_none());
    assert!(pages.next().is_none());
    assert_eq!(calls.load(Ordering::SeqCst), 2);

    // Collected, the walk is the error.
    let calls = AtomicUsize::new(0);
    let walk = Pages::new(|_: &PageRequest| {
        if calls.fetch_add(1, Ordering::SeqCst) == 0 {
            Page::new(vec![1], Some(Cursor::from_text("1")))
        } else {
            Err(StateError::Invalid {
                what: "second".into(),
            })
        }
    });
    assert!(matches!(
        walk.collect::<agentstate::Result<Vec<i32>>>(),
        Err(StateError::Invalid { .. })
    ));
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

/// A file store in a temp dir (buffered: these tests are about logic).
fn file_store(dir: &tempfile::TempDir, name: &str) -> FileStore {
    FileStore::open_with(
        dir.path().join(name),
        Options::new().durability(Durability::Buffered),
    )
    .unwrap()
}

#[test]
fn iter_walks_of_both_backends_visit_every_record_once() {
    const RUNS: usize = 150;
    const TRAYS: usize = 30;
    let dir = tempfile::tempdir().unwrap();
    let backends: Vec<(&str, Box<dyn Store>)> = vec![
        ("memory", Box::new(MemoryStore::new())),
        ("file", Box::new(file_store(&dir, "db"))),
    ];
    for (name, store) in &backends {
        for i in 0..RUNS {
            let mut r = RunRecord::new(RunKey::new("acme", format!("run-{i:03}")), "planner");
            if i % 3 == 0 {
                r.state = RunState::Running;
            }
            store.put_run(r).unwrap();
            if i < 20 {
                store
                    .put_session(SessionRecord::new(SessionKey::new(
                        "acme",
                        format!("s-{i:02}"),
                    )))
                    .unwrap();
            }
        }
        let inst = InstanceKey::new("chat", "room-1");
        let ops = (0..TRAYS)
            .map(|t| TrayOp::Put {
                tray_ns: "state".into(),
                tray_id: format!("{t:02}"),
                tray: tray(t % 2 == 0),
            })
            .collect();
        store.apply_batch(&inst, 1, ops).unwrap();
        for a in 0..12 {
            let inst = InstanceKey::new("alarm", format!("a{a:02}"));
            store.set_alarm(&inst, 1, 1_000 + a).unwrap();
        }

        let all: Vec<String> = (0..RUNS).map(|i| format!("run-{i:03}")).collect();
        let running: Vec<String> = (0..RUNS)
            .filter(|i| i % 3 == 0)
            .map(|i| format!("run-{i:03}"))
            .collect();
        let export_len = store.iter_export().count();
        for size in [1, 7, 100] {
            let ids: Vec<String> = store
                .iter_runs(&StateQuery::new("acme"))
                .page_size(size)
                .map(|r| r.unwrap().key.run_id)
                .collect();
            assert_eq!(ids, all, "{name}, page size {size}");
            let ids: Vec<String> = store
                .iter_runs(&StateQuery::new("acme").state(RunState::Running))
                .page_size(size)
                .map(|r| r.unwrap().key.run_id)
                .collect();
            assert_eq!(ids, running, "{name}, page size {size}");
            let trays: Vec<String> = store
                .iter_trays(&inst, 1)
                .page_size(size)
                .map(|t| t.unwrap().0.tray_id)
                .collect();
            assert_eq!(
                trays,
                (0..TRAYS).map(|t| format!("{t:02}")).collect::<Vec<_>>()
            );
            let marked = store
                .iter_marked_trays(Some("prod"))
                .page_size(size)
                .collect::<agentstate::Result<Vec<_>>>()
                .unwrap();
            assert_eq!(marked.len(), TRAYS / 2, "{name}, page size {size}");
            let due: Vec<u64> = store
                .iter_due_alarms(1_005)
                .page_size(size)
                .map(|a| a.unwrap().due_at)
                .collect();
            assert_eq!(due, (1_000..=1_005).collect::<Vec<_>>());
            let sessions: Vec<String> = store
                .iter_sessions("acme")
                .page_size(size)
                .map(|s| s.unwrap().key.session_id)
                .collect();
            assert_eq!(
                sessions,
                (0..20).map(|i| format!("s-{i:02}")).collect::<Vec<_>>()
            );
            let export = store
                .iter_export()
                .page_size(size)
                .collect::<agentstate::Result<Vec<_>>>()
                .unwrap();
            assert_eq!(export.len(), export_len, "{name}, page size {size}");
            assert_eq!(
                export.len(),
                RUNS + 20 + (1 + 12) + TRAYS + 12,
                "runs, sessions, epochs (the tray and alarm instances), trays, alarms"
            );
        }
        // A walk of a fenced holder stops with FenceLost.
        store.read_tray(&inst.tray("state", "00"), 2).unwrap();
        let mut stale = store.iter_trays(&inst, 1);
        assert!(matches!(
            stale.next(),
            Some(Err(StateError::FenceLost {
                caller: 1,
                stored: 2,
                ..
            }))
        ));
        assert!(stale.next().is_none());
        // A bad page size is the walk's error, once.
        let acme = StateQuery::new("acme");
        let mut bad = store.iter_runs(&acme).page_size(0);
        assert!(matches!(bad.next(), Some(Err(StateError::Invalid { .. }))));
        assert!(bad.next().is_none());
    }
}

// ---------------------------------------------------------------------------
// update_run.

const THREADS: usize = 8;
const INCREMENTS: usize = 50;

/// 8 threads × 50 read-modify-writes of one run with the default retry
/// policy, each incrementing a counter kept in `agent_name`: every call
/// succeeds, and the counter and the version count every update once.
fn contended_updates(name: &str, store: &dyn Store) {
    let key = RunKey::new("acme", "counter");
    store.put_run(RunRecord::new(key.clone(), "0")).unwrap();
    let start = Barrier::new(THREADS);
    let most_attempts = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let (key, start, most_attempts) = (&key, &start, &most_attempts);
            s.spawn(move || {
                start.wait();
                for i in 0..INCREMENTS {
                    let mut attempts = 0;
                    store
                        .update_run(key, |run| {
                            attempts += 1;
                            let n: u64 = run.agent_name.parse().unwrap();
                            run.agent_name = (n + 1).to_string();
                            Ok(())
                        })
                        .unwrap_or_else(|e| {
                            panic!("{name}: thread {t}, update {i}, {attempts} attempts: {e:?}")
                        });
                    most_attempts.fetch_max(attempts, Ordering::Relaxed);
                }
            });
        }
    });
    eprintln!(
        "{name}: {} updates, at most {} attempts for one",
        THREADS * INCREMENTS,
        most_attempts.into_inner()
    );
    let run = store.get_run(&key).unwrap().unwrap();
    let n = THREADS * INCREMENTS;
    assert_eq!(run.agent_name, n.to_string(), "{name}: an update was lost");
    assert_eq!(
        run.version,
        1 + n as u64,
        "{name}: every update committed once"
    );
    assert!(store.verify().unwrap().is_ok());
}

#[test]
fn update_run_under_contention_on_memory() {
    contended_updates("memory", &MemoryStore::new());
}

#[test]
fn update_run_under_contention_on_file() {
    // Synced commits (`Durability::Immediate`): every attempt costs a
    // real fdatasync, the case where giving up too early hurt most.
    let dir = tempfile::tempdir().unwrap();
    contended_updates("file", &FileStore::open(dir.path().join("db")).unwrap());
}

/// The other cases of `update_run`, on one backend.
fn update_run_cases(store: &dyn Store) {
    let key = RunKey::new("acme", "r1");
    let before = store
        .put_run(RunRecord::new(key.clone(), "planner"))
        .unwrap();

    // One attempt, and a writer that lands between the read and the write:
    // the conflict is returned, and only the racing write is stored.
    let calls = AtomicUsize::new(0);
    let once = RetryPolicy {
        attempts: 1,
        ..RetryPolicy::default()
    };
    let got = store.update_run_with(&key, once, |run| {
        calls.fetch_add(1, Ordering::SeqCst);
        store
            .patch_run(
                &key,
                StateDelta {
                    iterations: 1,
                    ..Default::default()
                },
            )
            .unwrap();
        run.state = RunState::Running;
        Ok(())
    });
    match got {
        Err(StateError::Conflict {
            expected, actual, ..
        }) => {
            assert_eq!((expected, actual), (before.version, before.version + 1));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    let stored = store.get_run(&key).unwrap().unwrap();
    assert_eq!(
        (stored.version, stored.iterations, stored.state),
        (before.version + 1, 1, RunState::Pending)
    );

    // With two attempts the same race is retried: the edit runs again on
    // the fresh record and commits.
    let calls = AtomicUsize::new(0);
    let twice = RetryPolicy {
        attempts: 2,
        ..RetryPolicy::default()
    };
    let run = store
        .update_run_with(&key, twice, |run| {
            if calls.fetch_add(1, Ordering::SeqCst) == 0 {
                store
                    .patch_run(
                        &key,
                        StateDelta {
                            iterations: 1,
                            ..Default::default()
                        },
                    )
                    .unwrap();
            }
            run.state = RunState::Running;
            Ok(())
        })
        .unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    assert_eq!(
        (run.version, run.iterations, run.state),
        (stored.version + 2, 2, RunState::Running)
    );

    // The edit's error is returned as is, and nothing is written.
    let stored = store.get_run(&key).unwrap().unwrap();
    let got = store.update_run(&key, |run| {
        run.state = RunState::Failed;
        Err(StateError::InUse {
            record: agentstate::RecordKey::Run(RunKey::new("acme", "why")),
            runs: vec![RunKey::new("acme", "why")],
        })
    });
    match got {
        Err(StateError::InUse { runs, .. }) => assert_eq!(runs, [RunKey::new("acme", "why")]),
        other => panic!("{other:?}"),
    }
    assert_eq!(store.get_run(&key).unwrap().unwrap(), stored);

    // A missing run is NotFound, and the edit never runs.
    let missing = RunKey::new("acme", "nobody");
    match store.update_run(&missing, |_| panic!("edit called for a missing run")) {
        Err(StateError::NotFound(Missing::Run(k))) => assert_eq!(k, missing),
        other => panic!("{other:?}"),
    }
    assert!(store.get_run(&missing).unwrap().is_none());
}

#[test]
fn update_run_conflict_edit_error_and_missing_run() {
    update_run_cases(&MemoryStore::new());
    let dir = tempfile::tempdir().unwrap();
    update_run_cases(&file_store(&dir, "db"));
}

// ---------------------------------------------------------------------------
// Both backends as `dyn Store`.

fn tray(marked: bool) -> Tray {
    Tray {
        marked,
        doc: b"doc".to_vec(),
        env: "prod".into(),
        hostname: "h".into(),
    }
}

/// Every method of every trait, through a `dyn Store`.
fn every_trait(store: &dyn Store) {
    assert!(store.is_empty().unwrap());

    // StateStore.
    let sk = SessionKey::new("acme", "s1");
    let session = store.put_session(SessionRecord::new(sk.clone())).unwrap();
    assert_eq!(store.get_session(&sk).unwrap(), Some(session));
    assert!(!store.is_empty().unwrap());
    let mut keys = Vec::new();
    for i in 0..5 {
        let r = RunRecord::new(RunKey::new("acme", format!("r{i}")), "planner").with_session("s1");
        keys.push(store.put_run(r).unwrap().key);
    }
    let run = store
        .patch_run(
            &keys[0],
            StateDelta {
                cost_micros: 7,
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!((run.version, run.cost_micros), (2, 7));
    assert_eq!(store.get_run(&keys[0]).unwrap(), Some(run));
    let first = store
        .list_runs(&StateQuery::new("acme"), &PageRequest::new(3))
        .unwrap();
    assert_eq!(first.items().len(), 3);
    let rest = store
        .list_runs(
            &StateQuery::new("acme"),
            &PageRequest::new(3).after(first.cursor()),
        )
        .unwrap();
    assert_eq!(rest.items().len(), 2);
    assert!(rest.cursor().is_none());
    assert_eq!(
        store
            .iter_runs(&StateQuery::new("acme").session("s1"))
            .count(),
        5
    );
    let updated = store
        .update_run(&keys[1], |r| {
            r.state = RunState::Completed;
            Ok(())
        })
        .unwrap();
    assert_eq!(updated.version, 2);
    match store.delete_session(&sk, false) {
        Err(StateError::InUse { runs, .. }) => assert_eq!(runs.len(), 4),
        other => panic!("{other:?}"),
    }

    // TrayStore.
    let inst = InstanceKey::new("chat", "room-1");
    let main = inst.tray("state", "main");
    store.write_tray(&main, 1, tray(true)).unwrap();
    assert_eq!(store.read_tray(&main, 1).unwrap(), Some(tray(true)));
    store
        .apply_batch(
            &inst,
            2,
            vec![TrayOp::Put {
                tray_ns: "state".into(),
                tray_id: "aux".into(),
                tray: tray(false),
            }],
        )
        .unwrap();
    assert_eq!(store.epoch(&inst).unwrap(), 2);
    assert!(matches!(
        store.write_tray(&main, 1, tray(false)),
        Err(StateError::FenceLost {
            caller: 1,
            stored: 2,
            ..
        })
    ));
    assert_eq!(
        store
            .list_trays(&inst, 2, &PageRequest::new(10))
            .unwrap()
            .items()
            .len(),
        2
    );
    assert_eq!(store.iter_trays(&inst, 2).page_size(1).count(), 2);
    assert_eq!(
        store
            .marked_trays(None, &PageRequest::new(10))
            .unwrap()
            .items()
            .len(),
        1
    );
    assert_eq!(store.iter_marked_trays(Some("prod")).count(), 1);
    store.set_alarm(&inst, 2, 500).unwrap();
    assert_eq!(
        store
            .due_alarms(1_000, &PageRequest::new(10))
            .unwrap()
            .items()
            .len(),
        1
    );
    assert_eq!(store.iter_due_alarms(499).count(), 0);
    assert_eq!(store.iter_due_alarms(500).count(), 1);

    // StoreAdmin.
    assert_eq!(
        store
            .list_sessions("acme", &PageRequest::new(10))
            .unwrap()
            .items()
            .len(),
        1
    );
    assert_eq!(store.iter_sessions("acme").count(), 1);
    let stats = store.stats().unwrap();
    assert!(!stats.backend.is_empty());
    assert_eq!(stats.trays, 2);
    assert_eq!(stats.marked_trays, 1);
    assert_eq!(stats.alarms, 1);
    let acme = &stats.tenants["acme"];
    assert_eq!(acme.sessions, 1);
    assert_eq!(acme.runs_by_state.values().sum::<u64>(), 5);
    let report = store.verify().unwrap();
    assert!(report.is_ok(), "{:?}", report.problems);
    assert_eq!((report.runs, report.sessions), (5, 1));
    let page = store.export_page(&PageRequest::new(1000)).unwrap();
    assert!(page.cursor().is_none());
    // 5 runs, 1 session, 1 epoch, 2 trays, 1 alarm.
    assert_eq!(page.items().len(), 10);
    assert_eq!(store.iter_export().page_size(3).count(), 10);

    // Tidy up through the same traits; prune is tried last.
    assert!(store.ack_alarm(&inst, 2, 500).unwrap());
    store.release(&inst, 2).unwrap();
    assert_eq!(store.iter_marked_trays(None).count(), 0);
    assert!(store.delete_tray(&inst.tray("state", "aux"), 2).unwrap());
    assert_eq!(
        store.prune("acme", u64::MAX).unwrap(),
        1,
        "the completed run"
    );
}

/// `import` through `dyn Store`: into an empty store of either backend it
/// copies everything; into a non-empty one it is refused and changes
/// nothing.
fn import_between(from: &dyn Store, to: &dyn Store) {
    let entries = from
        .iter_export()
        .collect::<agentstate::Result<Vec<Entry>>>()
        .unwrap();
    assert!(!entries.is_empty());
    assert!(to.is_empty().unwrap());
    let n = to.import(&mut entries.clone().into_iter().map(Ok)).unwrap();
    assert_eq!(n, entries.len() as u64);
    let copied = to
        .iter_export()
        .collect::<agentstate::Result<Vec<Entry>>>()
        .unwrap();
    assert_eq!(copied, entries);
    match to.import(&mut entries.clone().into_iter().map(Ok)) {
        Err(StateError::Invalid { .. }) => {}
        other => panic!("import into a non-empty store: {other:?}"),
    }
    // Refused before reading anything: an empty batch is refused too.
    match to.import(&mut std::iter::empty()) {
        Err(StateError::Invalid { .. }) => {}
        other => panic!("import into a non-empty store: {other:?}"),
    }
    let after = to
        .iter_export()
        .collect::<agentstate::Result<Vec<Entry>>>()
        .unwrap();
    assert_eq!(after, entries, "a refused import changed the store");
}

#[test]
fn both_backends_work_as_box_dyn_store() {
    let dir = tempfile::tempdir().unwrap();
    let memory: Box<dyn Store> = Box::new(MemoryStore::new());
    let file: Box<dyn Store> = Box::new(file_store(&dir, "file"));
    every_trait(&*memory);
    every_trait(&*file);
    // The two backends' exports agree, apart from timestamps.
    let strip = |s: &dyn Store| -> Vec<String> {
        s.iter_export()
            .map(|e| match e.unwrap() {
                Entry::Run(r) => format!("run {} v{} {:?}", r.key.run_id, r.version, r.state),
                Entry::Session(s) => format!("session {} v{}", s.key.session_id, s.version),
                other => format!("{other:?}"),
            })
            .collect()
    };
    assert_eq!(strip(&*memory), strip(&*file));

    // Import across backends, every direction.
    let targets: [(&str, Box<dyn Store>); 4] = [
        ("memory → memory", Box::new(MemoryStore::new())),
        ("memory → file", Box::new(file_store(&dir, "m2f"))),
        ("file → memory", Box::new(MemoryStore::new())),
        ("file → file", Box::new(file_store(&dir, "f2f"))),
    ];
    for (name, to) in &targets {
        eprintln!("import {name}");
        let from = if name.starts_with("memory") {
            &memory
        } else {
            &file
        };
        import_between(&**from, &**to);
    }
}

#[test]
fn both_backends_work_as_arc_dyn_store_across_threads() {
    let dir = tempfile::tempdir().unwrap();
    let stores: [Arc<dyn Store>; 2] = [
        Arc::new(MemoryStore::new()),
        Arc::new(file_store(&dir, "db")),
    ];
    for store in &stores {
        every_trait(&**store);
        let key = RunKey::new("beta", "spend");
        store
            .put_run(RunRecord::new(key.clone(), "planner"))
            .unwrap();
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let (store, key) = (Arc::clone(store), key.clone());
                std::thread::spawn(move || {
                    for _ in 0..25 {
                        store
                            .patch_run(
                                &key,
                                StateDelta {
                                    cost_micros: 10,
                                    ..Default::default()
                                },
                            )
                            .unwrap();
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        let run = store.get_run(&key).unwrap().unwrap();
        assert_eq!((run.cost_micros, run.version), (1_000, 101));
        // A non-empty store refuses an import, through the Arc too.
        let entries: Vec<Entry> = store.iter_export().map(Result::unwrap).collect();
        assert!(matches!(
            store.import(&mut entries.into_iter().map(Ok)),
            Err(StateError::Invalid { .. })
        ));
        let mut by_tenant: BTreeMap<String, u64> = BTreeMap::new();
        for (tenant, t) in store.stats().unwrap().tenants {
            by_tenant.insert(tenant, t.runs_by_state.values().sum());
        }
        assert_eq!(by_tenant["beta"], 1);
    }
}

// ---------------------------------------------------------------------------
// A reaper's query on the key-value stores: `state(unfinished)` with
// `updated_before` is answered from the touch index when every match fits
// in one bounded read, and from the state index otherwise; both answer the
// same pages, also while the walk's runs are rewritten.

fn stale_walks(store: &dyn Store, clock: &agentstate::ManualClock) {
    let t = "reaper";
    // 300 runs: every 3rd running (100), the rest completed; the first 150
    // written at T0, the rest at T1.
    let t1 = clock.now_millis() + 1_000_000;
    let mut running = Vec::new();
    for i in 0..300u32 {
        if i == 150 {
            clock.set(t1);
        }
        let mut r = RunRecord::new(RunKey::new(t, format!("r{i:03}")), "agent");
        r.state = if i % 3 == 0 {
            RunState::Running
        } else {
            RunState::Completed
        };
        let r = store.put_run(r).unwrap();
        clock.advance(1);
        if r.state == RunState::Running {
            running.push(r);
        }
    }
    clock.set(t1 + 1_000);
    let q = StateQuery::new(t)
        .state(RunState::Running)
        .updated_before(t1);
    let stale: Vec<&RunRecord> = running.iter().filter(|r| r.updated_at < t1).collect();
    assert_eq!(stale.len(), 50);
    // Limits below, at and above the number of matches (the state index
    // answers: more than 16 are stale).
    for limit in [1, 7, 48, 49, 50, 51, 100, 1000] {
        let got: Vec<RunRecord> = store
            .iter_runs(&q)
            .page_size(limit)
            .collect::<agentstate::Result<_>>()
            .unwrap();
        assert_eq!(got.iter().collect::<Vec<_>>(), stale, "limit {limit}");
    }
    // A moment with 10 stale runs: the touch index answers (16 at most),
    // at limits below, at and above 10.
    let ten = stale[9].updated_at;
    let few: Vec<&RunRecord> = running.iter().filter(|r| r.updated_at <= ten).collect();
    assert!(!few.is_empty() && few.len() <= 16, "{}", few.len());
    let q_few = StateQuery::new(t)
        .state(RunState::Running)
        .updated_before(ten + 1);
    for limit in [1, 3, few.len() - 1, few.len(), few.len() + 1, 100] {
        let got: Vec<RunRecord> = store
            .iter_runs(&q_few)
            .page_size(limit.max(1))
            .collect::<agentstate::Result<_>>()
            .unwrap();
        assert_eq!(got.iter().collect::<Vec<_>>(), few, "limit {limit}");
    }
    // No match at all: one empty page without a cursor.
    let none = store
        .list_runs(
            &StateQuery::new(t)
                .state(RunState::Running)
                .updated_before(1),
            &PageRequest::new(10),
        )
        .unwrap();
    assert!(none.items().is_empty() && none.cursor().is_none());

    // A walk while runs change under it: after every page, one stale run
    // ahead of the cursor and one behind it are rewritten (no longer
    // stale), and one fresh run ahead becomes completed. Every run that
    // stayed stale for the whole walk is seen exactly once, in seq order,
    // and nothing that did not match when read.
    let mut clock_at = t1 + 2_000;
    for (q, before, limit) in [
        (&q, t1, 4),
        (&q, t1, 60),
        (&q_few, ten + 1, 2),
        (&q_few, ten + 1, 60),
    ] {
        let stale_now: Vec<RunRecord> = store
            .iter_runs(q)
            .collect::<agentstate::Result<_>>()
            .unwrap();
        let mut touched = std::collections::HashSet::new();
        let mut seen = Vec::new();
        let mut page = PageRequest::new(limit);
        loop {
            let got = store.list_runs(q, &page).unwrap();
            let (items, cursor) = got.into_parts();
            for r in &items {
                assert!(
                    r.state == RunState::Running && r.updated_at < before,
                    "{r:?}"
                );
            }
            let last = items.last().map(|r| r.seq).unwrap_or(0);
            seen.extend(items);
            let Some(c) = cursor else { break };
            clock.set(clock_at);
            clock_at += 1;
            let ahead = stale_now
                .iter()
                .find(|r| r.seq > last && !touched.contains(&r.key));
            let behind = stale_now
                .iter()
                .find(|r| r.seq <= last && !touched.contains(&r.key));
            for r in [ahead, behind].into_iter().flatten() {
                touched.insert(r.key.clone());
                store.update_run(&r.key, |_| Ok(())).unwrap();
            }
            page = page.with_cursor(Some(c));
        }
        let seqs: Vec<u64> = seen.iter().map(|r| r.seq).collect();
        assert!(
            seqs.windows(2).all(|w| w[0] < w[1]),
            "limit {limit}: {seqs:?}"
        );
        for r in stale_now.iter().filter(|r| !touched.contains(&r.key)) {
            assert!(
                seen.iter().any(|s| s.key == r.key),
                "limit {limit}: {} missed",
                r.key.run_id
            );
        }
        // The next round starts from what is stale now.
        let _ = seen;
    }
}

#[test]
fn stale_running_walks_agree_on_memory_and_file() {
    let clock = Arc::new(agentstate::ManualClock::new(1_700_000_000_000));
    let mem = MemoryStore::with_options(Options::new().clock(clock.clone()));
    stale_walks(&mem, &clock);
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(agentstate::ManualClock::new(1_700_000_000_000));
    let file = FileStore::open_with(
        dir.path().join("f"),
        Options::new()
            .durability(Durability::Buffered)
            .clock(clock.clone()),
    )
    .unwrap();
    stale_walks(&file, &clock);
}

// ---------------------------------------------------------------------------
// The marked-tray indexes under rewrites (the key-value store writes them
// only when they change, and `release` finds the trays through them).

/// What `marked_trays` lists, for no env and for `env`: (tray id, env, host).
fn marked_now(store: &dyn Store, env: &str) -> (Vec<(String, String, String)>, Vec<String>) {
    let all = store
        .iter_marked_trays(None)
        .map(|m| {
            let m = m.unwrap();
            (m.key.tray_id, m.env, m.hostname)
        })
        .collect();
    let in_env = store
        .iter_marked_trays(Some(env))
        .map(|m| m.unwrap().key.tray_id)
        .collect();
    (all, in_env)
}

fn marked_index_follows_rewrites(store: &dyn Store) {
    let i = InstanceKey::new("workers", "w1");
    let other = InstanceKey::new("workers", "w2");
    let t = |marked: bool, env: &str, host: &str| Tray {
        marked,
        doc: format!("{marked}-{env}-{host}").into_bytes(),
        env: env.into(),
        hostname: host.into(),
    };
    let s = |v: &[(&str, &str, &str)]| -> Vec<(String, String, String)> {
        v.iter()
            .map(|(a, b, c)| (a.to_string(), b.to_string(), c.to_string()))
            .collect()
    };
    let key = |id: &str| i.tray("tray", id);
    store
        .write_tray(&key("a"), 1, t(true, "prod", "h1"))
        .unwrap();
    store
        .write_tray(&key("b"), 1, t(false, "prod", "h1"))
        .unwrap();
    store
        .write_tray(&other.tray("tray", "z"), 1, t(true, "prod", "h9"))
        .unwrap();
    // The same mark again, then another host, then another env.
    store
        .write_tray(&key("a"), 1, t(true, "prod", "h1"))
        .unwrap();
    assert_eq!(
        marked_now(store, "prod").0,
        s(&[("a", "prod", "h1"), ("z", "prod", "h9")])
    );
    store
        .write_tray(&key("a"), 1, t(true, "prod", "h2"))
        .unwrap();
    assert_eq!(
        marked_now(store, "prod").0,
        s(&[("a", "prod", "h2"), ("z", "prod", "h9")]),
        "a new host of a marked tray reaches its index entry"
    );
    store
        .write_tray(&key("a"), 1, t(true, "dev", "h2"))
        .unwrap();
    let (all, prod) = marked_now(store, "prod");
    assert_eq!(all, s(&[("a", "dev", "h2"), ("z", "prod", "h9")]));
    assert_eq!(prod, vec!["z".to_string()], "the old env lists it no more");
    assert_eq!(marked_now(store, "dev").1, vec!["a".to_string()]);
    // Unmarked, marked again, and b marked in a batch.
    store
        .write_tray(&key("a"), 1, t(false, "dev", "h2"))
        .unwrap();
    assert_eq!(marked_now(store, "dev").1, Vec::<String>::new());
    store
        .apply_batch(
            &i,
            1,
            vec![
                TrayOp::Put {
                    tray_ns: "tray".into(),
                    tray_id: "a".into(),
                    tray: t(true, "prod", "h3"),
                },
                TrayOp::Put {
                    tray_ns: "tray".into(),
                    tray_id: "b".into(),
                    tray: t(true, "prod", "h3"),
                },
            ],
        )
        .unwrap();
    assert_eq!(
        marked_now(store, "prod").0,
        s(&[
            ("a", "prod", "h3"),
            ("b", "prod", "h3"),
            ("z", "prod", "h9")
        ])
    );
    assert!(store.verify().unwrap().is_ok(), "{:?}", store.verify());
    // Release unmarks both of w1's trays, keeps their docs, leaves w2's.
    store.release(&i, 1).unwrap();
    assert_eq!(marked_now(store, "prod").0, s(&[("z", "prod", "h9")]));
    for id in ["a", "b"] {
        let got = store.read_tray(&key(id), 1).unwrap().unwrap();
        assert!(!got.marked, "release unmarked {id}");
        assert_eq!(got.doc, b"true-prod-h3".to_vec(), "release kept {id}'s doc");
        assert_eq!(got.hostname, "h3");
    }
    // A marked tray deleted takes its index entries with it.
    store.delete_tray(&other.tray("tray", "z"), 1).unwrap();
    assert_eq!(marked_now(store, "prod").0, s(&[]));
    let report = store.verify().unwrap();
    assert!(report.is_ok(), "{report:?}");
    assert_eq!(report.trays, 2);
}

#[test]
fn marked_index_follows_rewrites_on_memory() {
    marked_index_follows_rewrites(&MemoryStore::new());
}

#[test]
fn marked_index_follows_rewrites_on_file() {
    let dir = tempfile::tempdir().unwrap();
    let store = file_store(&dir, "store");
    marked_index_follows_rewrites(&store);
    drop(store);
    // And after a reopen.
    let store = file_store(&dir, "store");
    assert!(store.verify().unwrap().is_ok());
    assert_eq!(marked_now(&store, "prod").0, Vec::new());
}
