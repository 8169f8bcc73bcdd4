//! Found by testing from outside: an import is all or nothing on every
//! backend, and a secret used as a JSON key never reaches the disk.

use std::path::Path;

use agentstate::{
    Entry, FileStore, MemoryStore, RecordKey, RunKey, RunRecord, SessionKey, SessionRecord,
    StateError, StateStore, Store, StoreAdmin, ToolCall,
};

fn run_entry(i: u64) -> Entry {
    let mut r = RunRecord::new(RunKey::new("bulk", format!("run-{i:05}")), "planner");
    (r.version, r.seq, r.created_at, r.updated_at) = (1, i + 1, 7, 7);
    Entry::Run(r)
}

/// Everything a store shows: its export and stats.
fn snapshot(s: &dyn Store) -> (Vec<Entry>, String) {
    let export = s
        .iter_export()
        .collect::<agentstate::Result<Vec<_>>>()
        .unwrap();
    let mut stats = s.stats().unwrap();
    stats.disk_bytes = 0;
    (export, format!("{stats:?}"))
}

/// Imports that fail at entry `at` of 1,600 (more than one group of 1,000) — by an iterator error, by an
/// entry failing its checks, by a duplicate — leave `s` as it was; a
/// record given twice is a `Conflict` naming it.
fn failed_imports_change_nothing(s: &dyn Store, what: &str) {
    let before = snapshot(s);
    for at in [0u64, 999, 1000, 1599] {
        let mut iter_err = (0..1_600).map(|i| {
            if i == at {
                Err(StateError::Invalid {
                    what: format!("line {i}: bad"),
                })
            } else {
                Ok(run_entry(i))
            }
        });
        let e = s.import(&mut iter_err).unwrap_err();
        assert!(matches!(e, StateError::Invalid { .. }), "{what}: {e:?}");
        assert_eq!(
            snapshot(s),
            before,
            "{what}: an import failing at {at} left entries"
        );

        let mut bad_id = (0..1_600).map(|i| {
            let mut e = run_entry(i);
            if i == at
                && let Entry::Run(r) = &mut e
            {
                r.key.run_id = String::new();
            }
            Ok(e)
        });
        assert!(s.import(&mut bad_id).is_err(), "{what}");
        assert_eq!(snapshot(s), before, "{what}: a bad id at {at} left entries");

        let mut dup = (0..1_600).map(|i| Ok(run_entry(if i == at { 0 } else { i })));
        if at > 0 {
            assert!(s.import(&mut dup).is_err(), "{what}: a duplicate at {at}");
            assert_eq!(
                snapshot(s),
                before,
                "{what}: a duplicate at {at} left entries"
            );
        }
    }
    // A record given twice is a Conflict naming it.
    let session = SessionKey::new("bulk", "s1");
    let mut twice = (0..2).map(|_| {
        let mut r = SessionRecord::new(session.clone());
        (r.version, r.created_at, r.updated_at) = (1, 7, 7);
        Ok(Entry::Session(r))
    });
    let e = s.import(&mut twice).unwrap_err();
    assert!(
        matches!(
            &e,
            StateError::Conflict { record, expected: 0, actual: 1 }
                if *record == RecordKey::Session(session.clone())
        ),
        "{what}: {e:?}"
    );
    assert!(e.to_string().contains("session bulk/s1"), "{what}: {e}");
    assert_eq!(
        snapshot(s),
        before,
        "{what}: a session given twice left entries"
    );
    assert!(s.verify().unwrap().is_ok(), "{what}");
    // And the store still takes a whole import, and new runs after it.
    let mut all = (0..1_600).map(|i| Ok(run_entry(i)));
    assert_eq!(s.import(&mut all).unwrap(), 1_600, "{what}");
    let fresh = s
        .put_run(RunRecord::new(RunKey::new("bulk", "fresh"), "planner"))
        .unwrap();
    assert_eq!(
        fresh.seq, 1_601,
        "{what}: a new run's seq follows the import"
    );
    assert!(s.verify().unwrap().is_ok(), "{what}");
}

#[test]
fn import_is_all_or_nothing_on_the_memory_store() {
    failed_imports_change_nothing(&MemoryStore::new(), "memory");
}

#[test]
fn import_is_all_or_nothing_on_the_file_store() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("db");
    {
        let s = FileStore::open(&path).unwrap();
        let before = snapshot(&s);
        let mut failing = (0..1_500).map(|i| {
            if i == 1_400 {
                Err(StateError::Invalid { what: "cut".into() })
            } else {
                Ok(run_entry(i))
            }
        });
        assert!(s.import(&mut failing).is_err());
        drop(s);
        // Nothing after a reopen either.
        let s = FileStore::open(&path).unwrap();
        assert_eq!(snapshot(&s), before);
        failed_imports_change_nothing(&s, "file");
    }
    let s = FileStore::open(&path).unwrap();
    assert_eq!(s.iter_export().count(), 1_601);
}

/// Every file below `dir`, read whole.
fn all_bytes(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(all_bytes(&p));
        } else {
            out.push((p.display().to_string(), std::fs::read(&p).unwrap()));
        }
    }
    out
}

#[test]
fn x3_a_secret_used_as_a_key_never_reaches_the_disk() {
    let stripe = format!("sk_live_{}", "aB3dE5fG7hJ9kL1mN2pQ4rS6");
    let github = format!("ghp_{}", "aB3dE5fG7hJ9kL1mN2pQ4rS6tU8vW0xY2zA4");
    let args = serde_json::json!({
        stripe.clone(): "value",
        "headers": { "x": { github.clone(): "repo" } },
    })
    .to_string();
    let dir = tempfile::tempdir().unwrap();
    for (i, via_import) in [false, true].into_iter().enumerate() {
        let path = dir.path().join(format!("db{i}"));
        {
            let s = FileStore::open(&path).unwrap();
            let mut r = RunRecord::new(RunKey::new("acme", "r"), "planner");
            r.pending_tool_calls = vec![ToolCall {
                id: "c".into(),
                name: "http".into(),
                arguments: args.clone(),
            }];
            if via_import {
                (r.version, r.seq) = (1, 1);
                s.import(&mut std::iter::once(Ok(Entry::Run(r)))).unwrap();
            } else {
                s.put_run(r).unwrap();
            }
            let got = s.get_run(&RunKey::new("acme", "r")).unwrap().unwrap();
            let v: serde_json::Value =
                serde_json::from_str(&got.pending_tool_calls[0].arguments).unwrap();
            assert_eq!(v["[REDACTED]"], "value", "{v}");
            assert_eq!(v["headers"]["x"]["[REDACTED]"], "repo", "{v}");
        }
        for (file, bytes) in all_bytes(&path) {
            for secret in [&stripe, &github] {
                assert!(
                    !bytes.windows(secret.len()).any(|w| w == secret.as_bytes()),
                    "{secret} is in {file} (import: {via_import})"
                );
            }
        }
    }
}

mod cursors {
    use agentstate::{
        Cursor, InstanceKey, MemoryStore, PageRequest, RunKey, RunRecord, SessionKey,
        SessionRecord, StateError, StateQuery, StateStore, StoreAdmin, Tray, TrayOp, TrayStore,
    };
    use proptest::prelude::*;

    /// A store with `n` of everything, and a first-page cursor of every
    /// listing with the call that continues it.
    type Continue<'a> = Box<dyn Fn(&Cursor) -> agentstate::Result<usize> + 'a>;

    fn listings<'a>(
        s: &'a MemoryStore,
        tenant: &str,
        limit: usize,
    ) -> Vec<(&'static str, Cursor, Continue<'a>)> {
        let t = tenant.to_string();
        let i = InstanceKey::new(format!("ns-{tenant}"), "i");
        let req = move |c: Option<&Cursor>| PageRequest::new(limit).after(c);
        let mut out: Vec<(&'static str, Cursor, Continue<'a>)> = Vec::new();
        let q = StateQuery::new(&t);
        let first = s.list_runs(&q, &req(None)).unwrap();
        let (q2, t2, t3, i2) = (q.clone(), t.clone(), t.clone(), i.clone());
        out.push((
            "runs",
            first.cursor().unwrap().clone(),
            Box::new(move |c| s.list_runs(&q2, &req(Some(c))).map(|p| p.items().len())),
        ));
        let qa = StateQuery::new(&t).agent("planner");
        let first = s.list_runs(&qa, &req(None)).unwrap();
        out.push((
            "runs by agent",
            first.cursor().unwrap().clone(),
            Box::new(move |c| s.list_runs(&qa, &req(Some(c))).map(|p| p.items().len())),
        ));
        let first = s.list_sessions(&t, &req(None)).unwrap();
        out.push((
            "sessions",
            first.cursor().unwrap().clone(),
            Box::new(move |c| s.list_sessions(&t2, &req(Some(c))).map(|p| p.items().len())),
        ));
        let first = s.list_trays(&i, 1, &req(None)).unwrap();
        out.push((
            "trays",
            first.cursor().unwrap().clone(),
            Box::new(move |c| s.list_trays(&i2, 1, &req(Some(c))).map(|p| p.items().len())),
        ));
        let env = format!("env-{t3}");
        let first = s.marked_trays(Some(&env), &req(None)).unwrap();
        out.push((
            "marked",
            first.cursor().unwrap().clone(),
            Box::new(move |c| {
                s.marked_trays(Some(&env), &req(Some(c)))
                    .map(|p| p.items().len())
            }),
        ));
        let first = s.due_alarms(u64::MAX, &req(None)).unwrap();
        out.push((
            "alarms",
            first.cursor().unwrap().clone(),
            Box::new(move |c| {
                s.due_alarms(u64::MAX, &req(Some(c)))
                    .map(|p| p.items().len())
            }),
        ));
        let first = s.export_page(&req(None)).unwrap();
        out.push((
            "export",
            first.cursor().unwrap().clone(),
            Box::new(move |c| s.export_page(&req(Some(c))).map(|p| p.items().len())),
        ));
        out
    }

    fn store(tenant: &str, n: usize) -> MemoryStore {
        let s = MemoryStore::new();
        for k in 0..n {
            s.put_session(SessionRecord::new(SessionKey::new(tenant, format!("s{k}"))))
                .unwrap();
            s.put_run(RunRecord::new(
                RunKey::new(tenant, format!("r{k}")),
                "planner",
            ))
            .unwrap();
            s.set_alarm(
                &InstanceKey::new(format!("ns-{tenant}"), format!("a{k}")),
                1,
                k as u64,
            )
            .unwrap();
        }
        let ops = (0..n)
            .map(|k| TrayOp::Put {
                tray_ns: "t".into(),
                tray_id: format!("{k}"),
                tray: Tray {
                    marked: true,
                    doc: vec![1, 2, 3],
                    env: format!("env-{tenant}"),
                    hostname: "h".into(),
                },
            })
            .collect();
        s.apply_batch(&InstanceKey::new(format!("ns-{tenant}"), "i"), 1, ops)
            .unwrap();
        s
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]
        /// L6: a real cursor of every listing, altered by one byte, one
        /// character, a cut or an extension, is `Invalid`; the untouched
        /// cursor still pages on; no cursor shows its tenant.
        #[test]
        fn l6_every_alteration_of_a_real_cursor_is_invalid(
            tenant in "[a-z]{8,16}",
            n in 3usize..12,
            limit in 1usize..3,
            edits in proptest::collection::vec((any::<usize>(), 0x20u8..0x7f, any::<u8>()), 8),
        ) {
            let s = store(&tenant, n);
            for (what, cur, next) in listings(&s, &tenant, limit) {
                let text = cur.as_str();
                prop_assert!(!text.contains(&tenant), "{what}: {text} shows the tenant");
                let hex: String = tenant.bytes().map(|b| format!("{b:02x}")).collect();
                prop_assert!(!text.to_lowercase().contains(&hex), "{what}: {text} shows the tenant as hex");
                prop_assert!(next(&cur).is_ok(), "{what}: the untouched cursor");
                for &(at, ch, byte) in &edits {
                    let mut bytes = text.as_bytes().to_vec();
                    let i = at % bytes.len();
                    let mut altered = Vec::new();
                    // One character replaced.
                    if bytes[i] != ch {
                        let mut b = bytes.clone();
                        b[i] = ch;
                        altered.push(String::from_utf8(b).unwrap());
                    }
                    // One byte (of the text) flipped, kept valid UTF-8.
                    bytes[i] ^= 1 << (byte % 7);
                    altered.push(String::from_utf8_lossy(&bytes).into_owned());
                    // Cut and extended.
                    altered.push(text[..i].to_string());
                    altered.push(format!("{}{}{}", &text[..i], ch as char, &text[i..]));
                    for bad in altered.into_iter().filter(|b| b != text) {
                        match next(&Cursor::from_text(bad.clone())) {
                            Err(StateError::Invalid { .. }) => {}
                            other => prop_assert!(false, "{what}: {bad:?} (from {text}) gave {other:?}"),
                        }
                    }
                }
            }
        }
    }
}

#[cfg(feature = "postgres")]
#[test]
fn import_is_all_or_nothing_on_postgres() {
    use agentstate::{PgOptions, PostgresStore};
    // An empty store of its own: a fresh schema on the shared test server.
    let schema = format!(
        "imp{}_{:x}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() & 0xffff_ffff)
            .unwrap_or(0)
    );
    let s = PostgresStore::connect_with(
        crate::pg_server::shared_dsn(),
        PgOptions::new().schema(&schema),
    )
    .unwrap();
    s.setup().unwrap();
    failed_imports_change_nothing(&s, "postgres");
}

#[cfg(feature = "redis")]
#[test]
fn import_checks_everything_before_writing_on_redis() {
    // Database 10 of the shared test server, emptied first: a store of its
    // own. A bad line, a bad entry or a duplicate anywhere writes nothing.
    let url = crate::redis_server::shared_url(10);
    crate::redis_server::flush(&url);
    let s = agentstate::RedisStore::connect(&url).unwrap();
    failed_imports_change_nothing(&s, "redis");
}

/// P1 on disk: after `purge_tenant` and `FileStore::compact`, no file
/// under the store's directory holds any byte string of the tenant (its
/// name, which every key of it starts with, nor its ids, labels or
/// session metadata); before the purge they are all there, and the other
/// tenant's stay, across a reopen.
#[test]
fn purge_then_compact_leaves_no_byte_of_the_tenant_on_disk() {
    use agentstate::{
        BudgetKey, BudgetRecord, Caps, FileStore, Hold, RunKey, RunRecord, SessionKey,
        SessionRecord, Store,
    };
    fn files_holding(dir: &Path, needle: &[u8]) -> Vec<String> {
        let mut found = Vec::new();
        let mut todo = vec![dir.to_path_buf()];
        while let Some(d) = todo.pop() {
            for e in std::fs::read_dir(&d).unwrap() {
                let p = e.unwrap().path();
                if p.is_dir() {
                    todo.push(p);
                } else if std::fs::read(&p)
                    .unwrap()
                    .windows(needle.len())
                    .any(|w| w == needle)
                {
                    found.push(p.display().to_string());
                }
            }
        }
        found
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f");
    // Distinct strings no engine file holds by chance.
    let names = |t: &str| {
        [
            format!("tenant-{t}-q7w"),
            format!("run-of-{t}-x9"),
            format!("meta-of-{t}-k3"),
            format!("label-of-{t}-p2"),
        ]
    };
    let fill = |s: &dyn Store, t: &str| {
        let [tenant, run, meta, label] = names(t);
        let mut session = SessionRecord::new(SessionKey::new(&tenant, "s"));
        session.metadata.insert("title".into(), meta.clone());
        s.put_session(session).unwrap();
        s.put_budget(BudgetRecord::new(
            BudgetKey::new(&tenant, "b"),
            Caps::new().cost_micros(1_000),
        ))
        .unwrap();
        for i in 0..50 {
            s.put_run(
                RunRecord::new(RunKey::new(&tenant, format!("{run}{i}")), "a")
                    .with_session("s")
                    .with_budget("b")
                    .with_label("k", label.as_str()),
            )
            .unwrap();
        }
        s.reserve(
            &RunKey::new(&tenant, format!("{run}3")),
            Hold::new("h", 60_000).cost_micros(5),
        )
        .unwrap();
    };
    {
        let s = FileStore::open(&path).unwrap();
        fill(&s, "gone");
        fill(&s, "kept");
    }
    for n in names("gone").iter().chain(&names("kept")) {
        assert!(
            !files_holding(&path, n.as_bytes()).is_empty(),
            "{n} is on disk before the purge (else this test proves nothing)"
        );
    }
    {
        let s = FileStore::open(&path).unwrap();
        assert_eq!(s.purge_tenant(&names("gone")[0]).unwrap(), 53);
        // The purge deletes; the bytes stay until the files are rewritten.
        assert!(!files_holding(&path, names("gone")[0].as_bytes()).is_empty());
        s.compact().unwrap();
        // Gone while the store is still open, not only after its close.
        for n in names("gone") {
            let left = files_holding(&path, n.as_bytes());
            assert!(left.is_empty(), "{n} is still in {left:?}");
        }
        fill(&s, "later");
    }
    for n in names("gone") {
        let left = files_holding(&path, n.as_bytes());
        assert!(left.is_empty(), "{n} is back in {left:?} after the close");
    }
    let s = FileStore::open(&path).unwrap();
    let report = s.verify().unwrap();
    assert!(report.is_ok(), "{:?}", report.problems);
    let kept = &names("kept")[0];
    let run = s
        .get_run(&RunKey::new(kept, format!("{}7", names("kept")[1])))
        .unwrap()
        .expect("the other tenant's run");
    assert_eq!(
        run.labels.get("k"),
        Some(&serde_json::json!(names("kept")[3]))
    );
    assert_eq!(s.purge_tenant(kept).unwrap(), 53);
}

/// P1 on a quiet embedded store: after a purge `verify` is clean and the
/// export holds no entry of the tenant (another tenant's all there).
#[test]
fn purge_leaves_verify_clean_and_nothing_to_export() {
    use agentstate::{
        BudgetKey, BudgetRecord, Caps, Entry, FileStore, Hold, MemoryStore, RunKey, RunRecord,
        SessionKey, SessionRecord, Store,
    };
    let dir = tempfile::tempdir().unwrap();
    let stores: Vec<Box<dyn Store>> = vec![
        Box::new(MemoryStore::new()),
        Box::new(FileStore::open(dir.path().join("f")).unwrap()),
    ];
    for s in stores {
        for t in ["gone", "kept"] {
            s.put_session(SessionRecord::new(SessionKey::new(t, "s")))
                .unwrap();
            s.put_budget(BudgetRecord::new(
                BudgetKey::new(t, "b"),
                Caps::new().cost_micros(100),
            ))
            .unwrap();
            for i in 0..20 {
                s.put_run(
                    RunRecord::new(RunKey::new(t, format!("r{i}")), "a")
                        .with_session("s")
                        .with_budget("b"),
                )
                .unwrap();
            }
            s.reserve(&RunKey::new(t, "r3"), Hold::new("h", 60_000).cost_micros(5))
                .unwrap();
        }
        assert_eq!(s.purge_tenant("gone").unwrap(), 23);
        let report = s.verify().unwrap();
        assert!(report.is_ok(), "{:?}", report.problems);
        let tenant_of = |e: &Entry| match e {
            Entry::Run(r) => Some(r.key.tenant.clone()),
            Entry::Session(s) => Some(s.key.tenant.clone()),
            Entry::Budget { budget, .. } => Some(budget.key.tenant.clone()),
            Entry::Hold { run, .. } => Some(run.tenant.clone()),
            _ => None,
        };
        let tenants: Vec<String> = s
            .iter_export()
            .filter_map(|e| tenant_of(&e.unwrap()))
            .collect();
        assert!(!tenants.iter().any(|t| t == "gone"));
        assert_eq!(tenants.len(), 23, "the other tenant's 23 records stay");
    }
}
