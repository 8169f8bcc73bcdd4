//! The change feed's soak (issue 42): a consumer that stops, falls behind
//! by many writes (creates, patches, deletes and re-creates from several
//! threads, over a tenth as many records), resumes from its last position
//! and ends with exactly the store's final state, record by record — on
//! every backend.
//!
//! `AGENTSTATE_FEED_BEHIND` sets how many writes it falls behind by
//! (default: 100,000 on memory, 20,000 on the file engines, 10,000 on the
//! servers; the figure is `AGENTSTATE_FEED_BEHIND=1000000`).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use agentstate::{
    Changed, Durability, FeedScope, FileEngine, FileStore, MemoryStore, Options, Position, RunKey,
    RunRecord, StateDelta, StateError, StateQuery, Store,
};

fn behind(default: u64) -> u64 {
    std::env::var("AGENTSTATE_FEED_BEHIND")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Reads every change after `at` into `model`; returns the new position
/// and how many changes were read.
fn catch_up(
    s: &dyn Store,
    scope: &FeedScope,
    mut at: Position,
    model: &mut BTreeMap<RunKey, RunRecord>,
) -> (Position, u64) {
    let mut n = 0;
    loop {
        let page = s.changes(scope, at, 1000).expect("changes");
        if page.changes.is_empty() {
            return (at, n);
        }
        for c in page.changes {
            assert!(c.position > at, "positions increase");
            match c.item {
                Changed::Run { run } => {
                    model.insert(run.key.clone(), run);
                }
                Changed::RunDeleted { key } => {
                    model.remove(&key);
                }
                other => panic!("a tenant of runs only shows {other:?}"),
            }
            n += 1;
        }
        at = page.next;
    }
}

fn soak(name: &str, store: Arc<dyn Store>, writes: u64) {
    let tenant = format!(
        "soak-{name}-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    );
    let scope = FeedScope::tenant(&tenant);
    let records = (writes / 10).max(10);
    let mut model = BTreeMap::new();
    // The consumer reads what there is (nothing), then stops.
    let (stopped_at, _) = catch_up(&*store, &scope, Position::START, &mut model);
    let writers = 4u64;
    let done = AtomicU64::new(0);
    let began = Instant::now();
    std::thread::scope(|sc| {
        for w in 0..writers {
            let (store, tenant, done) = (&store, &tenant, &done);
            sc.spawn(move || {
                let mut i = w;
                while i < writes {
                    // Each writer owns the records r ≡ w (mod writers): no
                    // conflicts between writers, every write lands.
                    let r = (i / writers) % (records / writers).max(1) * writers + w;
                    let k = RunKey::new(tenant, format!("r{r:07}"));
                    let res = if i / writers < records / writers {
                        store.put_run(RunRecord::new(k, "agent")).map(|_| ())
                    } else if i % 97 == w {
                        store.delete_run(&k, None).map(|_| ()).or_else(|e| match e {
                            // Unfinished runs are deleted by version.
                            StateError::InUse { .. } => {
                                let v = store.get_run(&k)?.map(|r| r.version);
                                store.delete_run(&k, v).map(|_| ())
                            }
                            StateError::NotFound(_) => store
                                .put_run(RunRecord::new(k.clone(), "agent"))
                                .map(|_| ()),
                            e => Err(e),
                        })
                    } else {
                        let d = StateDelta {
                            iterations: 1,
                            ..StateDelta::default()
                        };
                        store.patch_run(&k, d).map(|_| ()).or_else(|e| match e {
                            StateError::NotFound(_) => store
                                .put_run(RunRecord::new(k.clone(), "agent"))
                                .map(|_| ()),
                            e => Err(e),
                        })
                    };
                    res.unwrap_or_else(|e| panic!("{name}: write {i}: {e}"));
                    done.fetch_add(1, Ordering::Relaxed);
                    i += writers;
                }
            });
        }
    });
    let wrote = began.elapsed();
    // Back: from where it stopped.
    let t = Instant::now();
    let (_, read) = catch_up(&*store, &scope, stopped_at, &mut model);
    let caught = t.elapsed();
    let mut listed = BTreeMap::new();
    let t = Instant::now();
    for r in store.iter_runs(&StateQuery::new(&tenant)) {
        let r = r.expect("list");
        listed.insert(r.key.clone(), r);
    }
    let list = t.elapsed();
    eprintln!(
        "{name}: {} writes over {records} records in {:.1} s; the consumer read {read} changes in {:.0} ms (a listing of the {} runs: {:.0} ms)",
        done.load(Ordering::Relaxed),
        wrote.as_secs_f64(),
        caught.as_secs_f64() * 1000.0,
        listed.len(),
        list.as_secs_f64() * 1000.0
    );
    assert!(
        read <= records + records / 5,
        "{name}: level-triggered: {read} changes for {records} records"
    );
    assert_eq!(model.len(), listed.len(), "{name}: the same runs");
    for (k, r) in &listed {
        assert_eq!(model.get(k), Some(r), "{name}: run {k} differs");
    }
}

#[test]
fn a_consumer_far_behind_ends_with_the_final_state_memory() {
    soak("memory", Arc::new(MemoryStore::new()), behind(100_000));
}

fn file(engine: FileEngine) -> (tempfile::TempDir, Arc<dyn Store>) {
    let dir = tempfile::tempdir().unwrap();
    let store = FileStore::open_with(
        dir.path().join("s"),
        Options::new()
            .engine(engine)
            .durability(Durability::Buffered),
    )
    .expect("open");
    (dir, Arc::new(store))
}

#[test]
fn a_consumer_far_behind_ends_with_the_final_state_file() {
    let (_dir, store) = file(FileEngine::Fjall);
    soak("file", store, behind(20_000));
}

#[cfg(feature = "sled")]
#[test]
fn a_consumer_far_behind_ends_with_the_final_state_sled() {
    let (_dir, store) = file(FileEngine::Sled);
    soak("sled", store, behind(20_000));
}

#[cfg(feature = "postgres")]
#[test]
fn a_consumer_far_behind_ends_with_the_final_state_postgres() {
    let store = crate::postgres::store(Options::new());
    soak("postgres", Arc::new(store), behind(10_000));
}

#[cfg(feature = "redis")]
#[test]
fn a_consumer_far_behind_ends_with_the_final_state_redis() {
    let url = crate::redis_server::shared_url(0);
    let store =
        agentstate::RedisStore::connect_with(&url, agentstate::RedisOptions::new().pool_size(8))
            .expect("connect");
    soak("redis", Arc::new(store), behind(10_000));
}

/// Every call that takes a position, with one `store` did not hand out
/// for `scope`: each is `Invalid` (F9).
fn refused(store: &dyn Store, scope: &FeedScope, p: Position, ctx: &str) {
    for (call, r) in [
        ("changes", store.changes(scope, p, 10).map(|_| ())),
        (
            "wait_changes",
            store
                .wait_changes(scope, p, 10, std::time::Duration::from_millis(50))
                .map(|_| ()),
        ),
        ("prune_changes", store.prune_changes(scope, p).map(|_| ())),
    ] {
        match r {
            Err(StateError::Invalid { what }) => assert!(
                what.contains("not one this store handed out"),
                "{ctx}: {call}: {what}"
            ),
            other => panic!("{ctx}: {call} after {p}: expected Invalid, got {other:?}"),
        }
    }
}

/// F9 across stores (the conformance check asks it only of factories
/// that hand out distinct stores): a position of one memory or file store
/// is `Invalid` on another, for the same tenant and the same ordinal, and
/// a file store's positions stay valid when it is opened again (its
/// secret is kept with its data).
#[test]
fn f9_a_position_of_one_store_is_invalid_on_another() {
    use agentstate::FeedStore;
    let scope = FeedScope::tenant("acme");
    let put = |s: &dyn Store, id: &str| {
        s.put_run(RunRecord::new(RunKey::new("acme", id), "agent"))
            .expect("put");
    };
    let (m1, m2) = (MemoryStore::new(), MemoryStore::new());
    // The same writes: the same ordinals, and still each store's own.
    for s in [&m1, &m2] {
        put(s, "a");
        put(s, "b");
    }
    let p1 = m1.changes(&scope, Position::START, 10).expect("changes");
    let p2 = m2.changes(&scope, Position::START, 10).expect("changes");
    assert_eq!(p1.changes.len(), 2);
    for (c1, c2) in p1.changes.iter().zip(&p2.changes) {
        assert_ne!(c1.position, c2.position, "positions of two stores differ");
    }
    let head1 = m1.feed_head(&scope).expect("head");
    for p in [p1.changes[0].position, p1.next, head1] {
        refused(&m2, &scope, p, "a memory store's position on another");
        assert!(m1.changes(&scope, p, 10).is_ok(), "its own store takes it");
    }
    assert_eq!(
        m2.changes(&scope, Position::START, 10)
            .expect("m2 untouched")
            .changes
            .len(),
        2
    );

    let dir = tempfile::tempdir().unwrap();
    let open = |name: &str| {
        FileStore::open_with(
            dir.path().join(name),
            Options::new().durability(Durability::Buffered),
        )
        .expect("open")
    };
    let (f1, f2) = (open("one"), open("two"));
    for s in [&f1, &f2] {
        put(s, "a");
    }
    let at = f1.changes(&scope, Position::START, 10).expect("changes");
    let first = at.changes[0].position;
    refused(&f2, &scope, first, "a file store's position on another");
    refused(
        &f1,
        &scope,
        p1.changes[0].position,
        "a memory store's position on a file store",
    );
    refused(
        &m1,
        &scope,
        first,
        "a file store's position on a memory store",
    );
    put(&f1, "b");
    drop(f1);
    let f1 = open("one");
    let page = f1
        .changes(&scope, first, 10)
        .expect("positions survive a reopen");
    assert_eq!(page.changes.len(), 1, "{page:?}");
    refused(&f2, &scope, page.next, "a file store's position on another");
}

/// A tenant's positions of one store refused on another, both ways, and
/// taken by their own (F9): the servers' stores, each with its own secret.
#[cfg(any(feature = "postgres", feature = "redis"))]
fn across(one: &dyn Store, two: &dyn Store) {
    let tenant = format!(
        "f9-{}-{:x}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    );
    let scope = FeedScope::tenant(&tenant);
    for s in [one, two] {
        s.put_run(RunRecord::new(RunKey::new(&tenant, "a"), "agent"))
            .expect("put");
    }
    for (from, to) in [(one, two), (two, one)] {
        let page = from
            .wait_changes(
                &scope,
                Position::START,
                10,
                std::time::Duration::from_secs(30),
            )
            .expect("changes");
        assert_eq!(page.changes.len(), 1, "{page:?}");
        let head = from.feed_head(&scope).expect("head");
        for p in [page.changes[0].position, page.next, head] {
            refused(to, &scope, p, "another store's position");
            from.changes(&scope, p, 10).expect("its own store takes it");
        }
    }
}

/// F9 on PostgreSQL: two schemas are two stores (each keeps its secret in
/// its `agentstate_meta`).
#[cfg(feature = "postgres")]
#[test]
fn f9_a_position_of_one_postgres_schema_is_invalid_in_another() {
    use agentstate::{PgOptions, PostgresStore};
    let one = crate::postgres::store(Options::new());
    let schema = format!(
        "f9_{}_{:x}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
            & 0xffff_ffff
    );
    let two = PostgresStore::connect_with(
        crate::pg_server::shared_dsn(),
        PgOptions::new().schema(&schema),
    )
    .expect("connect");
    two.setup().expect("setup");
    across(&one, &two);
}

/// F9 on Redis: two databases are two stores (each keeps its secret under
/// its `{meta}` key); database 13 is this test's.
#[cfg(feature = "redis")]
#[test]
fn f9_a_position_of_one_redis_database_is_invalid_in_another() {
    let connect = |db| {
        agentstate::RedisStore::connect(&crate::redis_server::shared_url(db)).expect("connect")
    };
    across(&connect(0), &connect(13));
}
