//! The public conformance suite (`agentstate::conformance`) on every
//! backend: `memory::<rule>`, `file::<rule>`, and with their features
//! `sled::<rule>`, `postgres::<rule>` and `redis::<rule>`, one test per rule
//! (made by `agentstate::conformance_tests!`, as a third-party backend adopts the
//! suite), so the test list reads as the rule list.

use std::sync::Arc;

use agentstate::ManualClock;
use agentstate::conformance::ConformanceStore;

mod memory {
    use super::*;
    use agentstate::conformance::RULES;

    /// A fresh in-memory store over the suite's clock.
    fn factory(clock: Arc<ManualClock>) -> Arc<dyn ConformanceStore> {
        Arc::new(agentstate::MemoryStore::with_options(
            agentstate::Options::new().clock(clock),
        ))
    }

    agentstate::conformance_tests!(factory);

    /// `RULES` names every rule of the contract the suite covers (R, S, L,
    /// X, E, T, A, B, K — D and W live in other harnesses), once each, in spec
    /// order; and every entry passes on the memory store.
    #[test]
    fn rules_cover_every_rule_and_pass() {
        // How many rules each family has, in spec order: the one table to
        // change when a rule is added (say R10: ("r", 10)).
        const FAMILIES: &[(&str, usize)] = &[
            ("r", 11),
            ("s", 4),
            ("l", 7),
            ("x", 4),
            ("e", 6),
            ("t", 7),
            ("a", 4),
            ("b", 6),
            ("k", 7),
            ("i", 6),
            ("p", 1),
            ("f", 9),
        ];
        let want: Vec<String> = FAMILIES
            .iter()
            .flat_map(|(letter, n)| (1..=*n).map(move |i| format!("{letter}{i}")))
            .collect();
        let got: Vec<String> = RULES.iter().map(|(id, _)| id.to_string()).collect();
        assert_eq!(
            got, want,
            "RULES must list every rule id once, in spec order"
        );
        // Every rule runs even when one fails, so one run reports them all.
        let failed: Vec<&str> = RULES
            .iter()
            .filter(|(_, check)| std::panic::catch_unwind(|| check(&factory)).is_err())
            .map(|(id, _)| *id)
            .collect();
        assert!(
            failed.is_empty(),
            "rules failing on the memory store: {failed:?} (their panics are printed above)"
        );
    }
}

/// File stores for the suite, one directory each, under the target's temp
/// dir; shared by the `file` and `sled` modules.
pub(crate) mod file_stores {
    use std::sync::atomic::{AtomicU64, Ordering};

    use super::*;

    /// A fresh file store on `engine` in its own directory.
    pub fn open(
        clock: Arc<ManualClock>,
        engine: agentstate::FileEngine,
    ) -> Arc<dyn ConformanceStore> {
        Arc::new(open_file(clock, engine))
    }

    /// [`open`], as the file store itself.
    pub fn open_file(
        clock: Arc<ManualClock>,
        engine: agentstate::FileEngine,
    ) -> agentstate::FileStore {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        static SWEEP: std::sync::Once = std::sync::Once::new();
        let root = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("conformance");
        // The stores are left behind (the suite holds no handle to close);
        // each run sweeps those of processes that are gone, so they do not
        // pile up.
        SWEEP.call_once(|| sweep_dead(&root));
        let dir = root.join(format!(
            "{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        // A directory left by an earlier process with the same pid.
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&root).expect("create the temp dir");
        agentstate::FileStore::open_with(
            &dir,
            agentstate::Options::new().clock(clock).engine(engine),
        )
        .expect("open")
    }

    /// Removes the store directories (`<pid>-<n>`) of processes that no
    /// longer run. Where `/proc` is missing, nothing is removed.
    fn sweep_dead(root: &std::path::Path) {
        let proc = std::path::Path::new("/proc");
        let (Ok(entries), true) = (std::fs::read_dir(root), proc.is_dir()) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(pid) = name.split('-').next().filter(|p| p.parse::<u32>().is_ok()) else {
                continue;
            };
            if pid != std::process::id().to_string() && !proc.join(pid).exists() {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
    }
}

mod file {
    use super::*;

    /// A fresh file store on the default engine (fjall).
    fn factory(clock: Arc<ManualClock>) -> Arc<dyn ConformanceStore> {
        super::file_stores::open(clock, agentstate::FileEngine::Fjall)
    }

    agentstate::conformance_tests!(factory);
}

#[cfg(feature = "sled")]
mod sled {
    use super::*;

    /// A fresh file store on the sled engine.
    fn factory(clock: Arc<ManualClock>) -> Arc<dyn ConformanceStore> {
        super::file_stores::open(clock, agentstate::FileEngine::Sled)
    }

    agentstate::conformance_tests!(factory);
}

#[cfg(feature = "postgres")]
mod postgres {
    use super::*;

    /// A store on the tests' PostgreSQL server (started on first use, see
    /// `pg_server`), over the suite's clock. Every store of this process
    /// shares one schema: the suite never assumes an empty store.
    fn factory(clock: Arc<ManualClock>) -> Arc<dyn ConformanceStore> {
        Arc::new(crate::postgres::store(
            agentstate::Options::new().clock(clock),
        ))
    }

    agentstate::conformance_tests!(factory);
}

#[cfg(feature = "redis")]
mod redis {
    use super::*;

    /// A store on the shared test server (database 0): the suite's checks
    /// use fresh tenants and instances, so one server serves them all.
    fn factory(clock: Arc<ManualClock>) -> Arc<dyn ConformanceStore> {
        let url = crate::redis_server::shared_url(0);
        Arc::new(
            agentstate::RedisStore::connect_with(
                &url,
                agentstate::RedisOptions::new()
                    .options(agentstate::Options::new().clock(clock))
                    .pool_size(16),
            )
            .expect("connect to the test redis-server"),
        )
    }

    agentstate::conformance_tests!(factory);
}
