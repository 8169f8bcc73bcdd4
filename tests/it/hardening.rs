//! Found by testing from outside: an import is all or nothing on every
//! backend, and a secret used as a JSON key never reaches the disk.

use std::path::Path;

use agentstate::{
    Entry, FileStore, MemoryStore, RunKey, RunRecord, StateError, StateStore, Store, StoreAdmin,
    ToolCall,
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
/// entry failing its checks, by a duplicate — leave `s` as it was.
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
