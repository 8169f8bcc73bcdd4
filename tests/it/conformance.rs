//! The public conformance suite (`agentstate::conformance`) on both
//! backends: `memory::<rule>` and `file::<rule>`, one test per rule, so the
//! test list reads as the rule list.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use agentstate::ManualClock;
use agentstate::conformance::{ConformanceStore, RULES};

/// Calls `$m!` with every rule check's name, in spec order.
macro_rules! for_each_rule {
    ($m:ident) => {
        $m!(
            r1_run_key_names_every_read_and_write,
            r2_put_run_versions_and_conflicts,
            r3_racing_writers_exactly_one_wins,
            r4_patch_adds_amounts_and_never_creates,
            r5_patches_commute,
            r6_put_never_moves_amounts,
            r7_record_holds_what_resumes_a_run,
            r8_run_session_must_exist,
            s1_sessions_versioned_like_runs,
            s2_delete_refuses_unfinished_runs,
            s3_cascade_deletes_session_and_runs_atomically,
            s4_session_runs_listed,
            l1_list_runs_in_seq_order_with_filters,
            l2_walk_sees_stable_records_exactly_once,
            l3_last_page_has_no_cursor,
            l4_updated_before_filters_never_orders,
            l5_page_limit_and_default,
            l6_cursor_bound_to_listing_and_untampered,
            x1_every_write_stores_scrubbed_record,
            x2_secret_keys_redacted,
            x3_secret_shapes_redacted_anywhere,
            x4_scrubbing_idempotent_no_secret_persists,
            e1_conflict_not_retryable,
            e2_not_found_names_what_is_missing,
            e3_only_unavailable_is_retryable,
            e4_in_use_names_every_blocking_run,
            e5_fence_lost_carries_both_epochs,
            e6_errors_change_nothing_and_invalid_says_what,
            t1_tray_holds_marked_doc_env_hostname,
            t2_epoch_fences_every_tray_operation,
            t3_batch_all_or_nothing,
            t4_release_unmarks_and_stale_release_is_noop,
            t5_sweeper_pages_marked_trays_exactly_once,
            t6_fence_check_and_write_are_atomic,
            a1_one_alarm_per_instance,
            a2_due_alarms_in_order,
            a3_alarm_stays_due_until_acked,
            k1_ids_are_1_to_256_bytes,
            k2_records_and_docs_past_limit_too_large,
            k3_page_limit_1_to_1000,
            k4_batch_at_most_10000_ops,
            k5_at_most_1024_pending_tool_calls,
            k6_key_encoding_injective,
        );
    };
}

/// One `#[test]` per rule, each handing the rule this module's `factory`.
macro_rules! rule_tests {
    ($($rule:ident),* $(,)?) => {
        $(
            #[test]
            fn $rule() {
                agentstate::conformance::$rule(&factory)
            }
        )*
    };
}

mod memory {
    use super::*;

    /// A fresh in-memory store over the suite's clock.
    fn factory(clock: Arc<ManualClock>) -> Arc<dyn ConformanceStore> {
        Arc::new(agentstate::MemoryStore::with_options(
            agentstate::Options::new().clock(clock),
        ))
    }

    for_each_rule!(rule_tests);

    /// `RULES` names every rule of the contract the suite covers (R, S, L,
    /// X, E, T, A, K — D and W live in other harnesses), once each, in spec
    /// order; and every entry passes on the memory store.
    #[test]
    fn rules_cover_every_rule_and_pass() {
        let want: Vec<String> = [
            ("r", 8),
            ("s", 4),
            ("l", 6),
            ("x", 4),
            ("e", 6),
            ("t", 6),
            ("a", 3),
            ("k", 6),
        ]
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

mod file {
    use super::*;

    /// A fresh file store in its own directory under the target's temp dir.
    fn factory(clock: Arc<ManualClock>) -> Arc<dyn ConformanceStore> {
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
        Arc::new(
            agentstate::FileStore::open_with(&dir, agentstate::Options::new().clock(clock))
                .expect("open"),
        )
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

    for_each_rule!(rule_tests);
}
