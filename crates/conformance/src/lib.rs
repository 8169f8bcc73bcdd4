//! The public conformance suite: every numbered rule of the contract
//! (R runs, S sessions, L listings, X scrubbing, E errors, T trays, A alarms,
//! B spend caps, K limits, and the project's I idempotency, P erasure and F
//! change feed) as one function that checks it against a backend.
//!
//! The `agentstate-conformance` crate, re-exported as
//! `agentstate::conformance` by the facade's `conformance` feature. A backend is done when every
//! function in [`RULES`] passes against it; each panics with a message that
//! names the rule and what broke it.
//!
//! # Running the suite against your own backend
//!
//! Write a [`Factory`]: a function that builds your store over the
//! [`ManualClock`] it is given (the store must read `created_at` and
//! `updated_at` from that clock). Then one line adopts the whole suite:
//! [`conformance_tests!`](crate::conformance_tests) expands to one `#[test]`
//! per rule, named after the rule's function (`r1_run_key_names_every_read_and_write`,
//! …), so failures are named after their rule and a rule added to the suite
//! later shows up in your tests without a change on your side:
//!
//! ```
//! # fn main() {} // the tests below compile here; `cargo test` runs them
//! use std::sync::Arc;
//! use agentstate::conformance::ConformanceStore;
//! use agentstate::{ManualClock, MemoryStore, Options};
//!
//! fn factory(clock: Arc<ManualClock>) -> Arc<dyn ConformanceStore> {
//!     // Your backend here; it may hand out one shared store (say, one
//!     // PostgreSQL server) to every call: the checks never assume an
//!     // empty store.
//!     Arc::new(MemoryStore::with_options(Options::new().clock(clock)))
//! }
//!
//! agentstate::conformance_tests!(factory);
//! ```
//!
//! Or walk [`RULES`] (each entry is `(rule id, check)`):
//!
//! ```
//! use std::sync::Arc;
//! use agentstate::conformance::{ConformanceStore, RULES};
//! use agentstate::{ManualClock, MemoryStore, Options};
//!
//! let factory = |clock: Arc<ManualClock>| -> Arc<dyn ConformanceStore> {
//!     Arc::new(MemoryStore::with_options(Options::new().clock(clock)))
//! };
//! for (id, check) in RULES.iter().filter(|(id, _)| id.starts_with('a')) {
//!     println!("checking {id}");
//!     check(&factory);
//! }
//! ```
//!
//! The concurrency rules (R3, R5, L2, T5, T6, B6) run real threads for many
//! rounds; the environment variable `AGENTSTATE_ROUNDS` multiplies their
//! rounds (default 1; e.g. `AGENTSTATE_ROUNDS=10` for a soak run).
//!
//! Every check uses its own fresh tenants, session ids, instances and envs
//! (a process-wide counter behind a prefix made of the process id and the
//! time), so a store shared between checks, test processes or machines
//! works, and nothing assumes the store is otherwise empty.

// The example above shows a backend's `#[test]` functions; in the doctest
// they only compile, which is all it needs to show.
#![allow(clippy::test_attr_in_doctest)]
// No unsafe code in this crate.
#![forbid(unsafe_code)]
// Every public item is documented; the docs are part of the contract.
#![warn(missing_docs)]

use std::sync::Arc;

use agentstate_core::ManualClock;

/// Checks that `$res` is an `Err` matching `$pat` and returns the error.
// Defined before the rule modules, so that they all see it.
macro_rules! expect_err {
    ($res:expr, $pat:pat $(if $guard:expr)?, $($ctx:tt)+) => {{
        match $res {
            Ok(v) => panic!(
                "{}: expected Err({}), got Ok({:?})",
                format_args!($($ctx)+),
                stringify!($pat),
                v
            ),
            Err(e) => {
                if !matches!(e, $pat $(if $guard)?) {
                    panic!(
                        "{}: expected Err({}), got Err({:?})",
                        format_args!($($ctx)+),
                        stringify!($pat),
                        e
                    );
                }
                e
            }
        }
    }};
}

mod helpers;

mod alarms;
mod budgets;
mod errors;
mod feed;
mod idempotency;
mod limits;
mod listings;
mod purge;
mod runs;
mod scrubbing;
mod sessions;
mod trays;

// The rule checks, each at `agentstate::conformance::<rule fn>`. Only the
// checks are public in these modules; their helpers stay private.
pub use alarms::*;
pub use budgets::*;
pub use errors::*;
pub use feed::*;
pub use idempotency::*;
pub use limits::*;
pub use listings::*;
pub use purge::*;
pub use runs::*;
pub use scrubbing::*;
pub use sessions::*;
pub use trays::*;

/// What the suite needs of a backend: everything a backend is
/// ([`Store`](agentstate_core::Store)). Every `Store` is one.
pub trait ConformanceStore: agentstate_core::Store {}
impl<T: agentstate_core::Store + ?Sized> ConformanceStore for T {}

/// Makes a store whose clock is the given manual clock.
///
/// The store may be shared with other checks (a PostgreSQL backend runs the
/// suite on one server): every check uses its own fresh tenants, ids,
/// instances and envs, and never assumes the store is otherwise empty.
pub type Factory<'a> = &'a dyn Fn(Arc<ManualClock>) -> Arc<dyn ConformanceStore>;

/// One rule check: panics, naming the rule, when the store breaks it.
pub type Check = for<'a> fn(Factory<'a>);

/// Builds [`RULES`] from the rule list.
macro_rules! rule_table {
    ($($id:ident $rule:ident),* $(,)?) => {
        &[$((stringify!($id), $rule)),*]
    };
}

/// Every rule check, by rule id, in spec order (R, S, L, X, E, T, A, B, K,
/// then the project's own families: I, F).
pub const RULES: &[(&str, Check)] = crate::__conformance_rules!([rule_table]);

/// The rule list — the one place every rule of the suite is named, in spec
/// order, as `id fn_name` pairs. Both [`RULES`] and
/// [`conformance_tests!`](crate::conformance_tests) are built from it, so a
/// rule added here reaches both (and every backend's tests) at once.
///
/// `__conformance_rules!([callback path] args…)` expands to
/// `callback path! { args… r1 r1_…, r2 r2_…, … }`.
#[doc(hidden)]
#[macro_export]
macro_rules! __conformance_rules {
    ([$($callback:tt)*] $($args:tt)*) => {
        $($callback)*! {
            $($args)*
            r1 r1_run_key_names_every_read_and_write,
            r2 r2_put_run_versions_and_conflicts,
            r3 r3_racing_writers_exactly_one_wins,
            r4 r4_patch_adds_amounts_and_never_creates,
            r5 r5_patches_commute,
            r6 r6_put_never_moves_amounts,
            r7 r7_record_holds_what_resumes_a_run,
            r8 r8_run_session_must_exist,
            r9 r9_finished_run_stays_finished,
            r10 r10_delete_run_versioned_and_whole,
            r11 r11_labels_stored_scrubbed_limited_and_filterable,
            s1 s1_sessions_versioned_like_runs,
            s2 s2_delete_refuses_unfinished_runs,
            s3 s3_cascade_deletes_session_and_runs_atomically,
            s4 s4_session_runs_listed,
            l1 l1_list_runs_in_seq_order_with_filters,
            l2 l2_walk_sees_stable_records_exactly_once,
            l3 l3_last_page_has_no_cursor,
            l4 l4_updated_before_filters_never_orders,
            l5 l5_page_limit_and_default,
            l6 l6_cursor_bound_to_listing_and_untampered,
            l7 l7_cursor_carries_its_walks_filters,
            x1 x1_every_write_stores_scrubbed_record,
            x2 x2_secret_keys_redacted,
            x3 x3_secret_shapes_redacted_anywhere,
            x4 x4_scrubbing_idempotent_no_secret_persists,
            e1 e1_conflict_not_retryable,
            e2 e2_not_found_names_what_is_missing,
            e3 e3_only_unavailable_is_retryable,
            e4 e4_in_use_names_every_blocking_run,
            e5 e5_fence_lost_carries_both_epochs,
            e6 e6_errors_change_nothing_and_invalid_says_what,
            t1 t1_tray_holds_marked_doc_env_hostname,
            t2 t2_epoch_fences_every_tray_operation,
            t3 t3_batch_all_or_nothing,
            t4 t4_release_unmarks_and_stale_release_is_noop,
            t5 t5_sweeper_pages_marked_trays_exactly_once,
            t6 t6_fence_check_and_write_are_atomic,
            t7 t7_instance_trays_one_fenced_call,
            a1 a1_one_alarm_per_instance,
            a2 a2_due_alarms_in_order,
            a3 a3_alarm_stays_due_until_acked,
            a4 a4_the_alarm_tray_name_is_reserved,
            b1 b1_caps_and_budget_fixed_at_create,
            b2 b2_reserve_within_every_cap_or_changes_nothing,
            b3 b3_settle_records_actual_spend_and_overshoot,
            b4 b4_release_and_unknown_holds,
            b5 b5_expired_holds_free_their_amount,
            b6 b6_caps_hold_under_concurrency,
            k1 k1_ids_are_1_to_256_bytes,
            k2 k2_records_and_docs_past_limit_too_large,
            k3 k3_page_limit_1_to_1000,
            k4 k4_batch_at_most_10000_ops,
            k5 k5_at_most_1024_pending_tool_calls,
            k6 k6_key_encoding_injective,
            k7 k7_epochs_at_most_epoch_max,
            i1 i1_keyed_writes_apply_once_and_repeats_answer_the_first_outcome,
            i2 i2_a_repeated_put_answers_its_own_write_not_a_conflict,
            i3 i3_a_key_reused_for_other_arguments_is_invalid,
            i4 i4_keys_are_scoped_by_tenant_and_namespace,
            i5 i5_keys_are_kept_for_the_window_then_forgotten,
            i6 i6_racing_calls_with_one_key_apply_once,
            p1 p1_purge_tenant_erases_every_record,
            f1 f1_every_change_once_in_its_latest_state,
            f2 f2_pages_continue_in_position_order,
            f3 f3_feeds_are_scoped,
            f4 f4_no_commit_is_ever_skipped,
            f5 f5_a_commit_wakes_a_waiter,
            f6 f6_pruned_feeds_say_so,
            f7 f7_the_head_splits_before_from_after,
            f8 f8_bad_feed_arguments_are_invalid,
            f9 f9_positions_belong_to_their_scope_and_store,
        }
    };
}

/// Adopts the whole conformance suite: one `#[test]` per rule in
/// [`RULES`](crate::RULES), each handing the rule `factory`
/// (a [`Factory`](crate::Factory): anything that is
/// `Fn(Arc<ManualClock>) -> Arc<dyn ConformanceStore>`).
///
/// ```
/// # fn main() {} // the tests below compile here; `cargo test` runs them
/// mod my_backend {
///     use std::sync::Arc;
///     use agentstate::conformance::ConformanceStore;
///     use agentstate::{ManualClock, MemoryStore, Options};
///
///     fn factory(clock: Arc<ManualClock>) -> Arc<dyn ConformanceStore> {
///         Arc::new(MemoryStore::with_options(Options::new().clock(clock)))
///     }
///
///     agentstate::conformance_tests!(factory);
/// }
/// ```
///
/// The tests are named after the rule functions
/// (`my_backend::r3_racing_writers_exactly_one_wins`, …), so
/// `cargo test my_backend::t` runs the tray rules.
#[macro_export]
macro_rules! conformance_tests {
    ($factory:expr $(,)?) => {
        $crate::__conformance_rules! { [$crate::__conformance_test_fns] ($factory) }
    };
}

/// `conformance_tests!`'s callback: the `#[test]` functions.
#[doc(hidden)]
#[macro_export]
macro_rules! __conformance_test_fns {
    (($factory:expr) $($id:ident $rule:ident),* $(,)?) => {
        $(
            #[test]
            fn $rule() {
                $crate::$rule(&$factory)
            }
        )*
    };
}
