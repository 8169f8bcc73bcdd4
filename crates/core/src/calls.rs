//! The one list of the store's calls, and what is generated from it.
//!
//! Every call a backend answers (the four data traits, and
//! `list_sessions`) is written once, in `for_each_call!`: its trait, its
//! name, its arguments, what it answers and the tenant its span names. The
//! layers that used to repeat each signature are generated from that list:
//!
//! - `native::AsyncCore` (the async calls a server backend implements) and
//!   `native::DynCore` (the same as a trait object, for `AsyncStore`);
//! - `impl_async_core!`: a server backend's `AsyncCore`, each call its
//!   inherent `async fn` of the same name inside a span and metrics
//!   (`observe`);
//! - `sync_over_async!`: a server backend's synchronous traits, each call
//!   the async one driven on the calling thread;
//! - `forward_sync!`: an embedded handle's synchronous traits, each call
//!   its inner store's inside a span and metrics.
//!
//! So adding a call touches its trait, this list, each backend's
//! implementation (and `AsyncStore`'s method): the compiler names every
//! backend that lacks it. Reference arguments carry the lifetime `'a` of
//! the call, so one list serves the sync traits, the `impl Future`s and the
//! boxed futures alike.

/// Hands the list of calls to `$callback!`, after `$args` (any tokens the
/// callback wants first, in brackets):
///
/// `$callback! { [$args] $Trait { $name($arg: $type, …) -> $answer, tenant: $expr; … } … }`
///
/// `$expr` is the call's tenant as an `Option<&str>`, written over the
/// arguments (`None` for store-wide calls). Not part of the API.
#[doc(hidden)]
#[macro_export]
macro_rules! for_each_call {
    ($callback:path, [$($args:tt)*]) => {
        $callback! {
            [$($args)*]
            StateStore {
                put_run(record: $crate::RunRecord) -> $crate::RunRecord,
                    tenant: Some(&record.key.tenant);
                get_run(key: &'a $crate::RunKey) -> Option<$crate::RunRecord>,
                    tenant: Some(&key.tenant);
                patch_run(key: &'a $crate::RunKey, delta: $crate::StateDelta) -> $crate::RunRecord,
                    tenant: Some(&key.tenant);
                put_run_idempotent(
                    record: $crate::RunRecord,
                    key: &'a $crate::IdempotencyKey
                ) -> $crate::RunRecord,
                    tenant: Some(&record.key.tenant);
                patch_run_idempotent(
                    key: &'a $crate::RunKey,
                    delta: $crate::StateDelta,
                    idempotency_key: &'a $crate::IdempotencyKey
                ) -> $crate::RunRecord,
                    tenant: Some(&key.tenant);
                delete_run(key: &'a $crate::RunKey, expected_version: Option<u64>)
                    -> $crate::RunRecord,
                    tenant: Some(&key.tenant);
                list_runs(query: &'a $crate::StateQuery, page: &'a $crate::PageRequest)
                    -> $crate::Page<$crate::RunRecord>,
                    tenant: Some(&query.tenant);
                put_session(record: $crate::SessionRecord) -> $crate::SessionRecord,
                    tenant: Some(&record.key.tenant);
                get_session(key: &'a $crate::SessionKey) -> Option<$crate::SessionRecord>,
                    tenant: Some(&key.tenant);
                delete_session(key: &'a $crate::SessionKey, cascade: bool)
                    -> Vec<$crate::RunKey>,
                    tenant: Some(&key.tenant);
            }
            FeedStore {
                changes(scope: &'a $crate::FeedScope, after: $crate::Position, limit: usize)
                    -> $crate::ChangePage,
                    tenant: $crate::feed::tenant_of(scope);
                wait_changes(
                    scope: &'a $crate::FeedScope,
                    after: $crate::Position,
                    limit: usize,
                    timeout: std::time::Duration
                ) -> $crate::ChangePage,
                    tenant: $crate::feed::tenant_of(scope);
                feed_head(scope: &'a $crate::FeedScope) -> $crate::Position,
                    tenant: $crate::feed::tenant_of(scope);
                prune_changes(scope: &'a $crate::FeedScope, through: $crate::Position) -> u64,
                    tenant: $crate::feed::tenant_of(scope);
            }
            TrayStore {
                read_tray(key: &'a $crate::TrayKey, epoch: u64) -> Option<$crate::Tray>,
                    tenant: None;
                write_tray(key: &'a $crate::TrayKey, epoch: u64, tray: $crate::Tray) -> (),
                    tenant: None;
                delete_tray(key: &'a $crate::TrayKey, epoch: u64) -> bool,
                    tenant: None;
                apply_batch(
                    instance: &'a $crate::InstanceKey,
                    epoch: u64,
                    ops: Vec<$crate::TrayOp>
                ) -> (),
                    tenant: None;
                apply_batch_idempotent(
                    instance: &'a $crate::InstanceKey,
                    epoch: u64,
                    ops: Vec<$crate::TrayOp>,
                    key: &'a $crate::IdempotencyKey
                ) -> (),
                    tenant: None;
                release(instance: &'a $crate::InstanceKey, epoch: u64) -> (),
                    tenant: None;
                list_trays(
                    instance: &'a $crate::InstanceKey,
                    epoch: u64,
                    page: &'a $crate::PageRequest
                ) -> $crate::Page<($crate::TrayKey, $crate::Tray)>,
                    tenant: None;
                instance_trays(
                    instance: &'a $crate::InstanceKey,
                    epoch: u64,
                    filter: &'a $crate::TrayFilter
                ) -> Vec<($crate::TrayKey, $crate::Tray)>,
                    tenant: None;
                marked_trays(env: Option<&'a str>, page: &'a $crate::PageRequest)
                    -> $crate::Page<$crate::MarkedTray>,
                    tenant: None;
                epoch(instance: &'a $crate::InstanceKey) -> u64,
                    tenant: None;
                set_alarm(instance: &'a $crate::InstanceKey, epoch: u64, due_at: $crate::Millis)
                    -> (),
                    tenant: None;
                due_alarms(now: $crate::Millis, page: &'a $crate::PageRequest)
                    -> $crate::Page<$crate::Alarm>,
                    tenant: None;
                ack_alarm(instance: &'a $crate::InstanceKey, epoch: u64, due_at: $crate::Millis)
                    -> bool,
                    tenant: None;
            }
            BudgetStore {
                put_budget(record: $crate::BudgetRecord) -> $crate::BudgetRecord,
                    tenant: Some(&record.key.tenant);
                get_budget(key: &'a $crate::BudgetKey) -> Option<$crate::BudgetStatus>,
                    tenant: Some(&key.tenant);
                list_budgets(tenant: &'a str, page: &'a $crate::PageRequest)
                    -> $crate::Page<$crate::BudgetStatus>,
                    tenant: Some(tenant);
                reserve(run: &'a $crate::RunKey, hold: $crate::Hold) -> $crate::HoldRecord,
                    tenant: Some(&run.tenant);
                settle(run: &'a $crate::RunKey, hold_id: &'a str, spent: $crate::StateDelta)
                    -> $crate::Settled,
                    tenant: Some(&run.tenant);
                release_hold(run: &'a $crate::RunKey, hold_id: &'a str) -> (),
                    tenant: Some(&run.tenant);
                reserve_idempotent(
                    run: &'a $crate::RunKey,
                    hold: $crate::Hold,
                    key: &'a $crate::IdempotencyKey
                ) -> $crate::HoldRecord,
                    tenant: Some(&run.tenant);
                settle_idempotent(
                    run: &'a $crate::RunKey,
                    hold_id: &'a str,
                    spent: $crate::StateDelta,
                    key: &'a $crate::IdempotencyKey
                ) -> $crate::Settled,
                    tenant: Some(&run.tenant);
                release_hold_idempotent(
                    run: &'a $crate::RunKey,
                    hold_id: &'a str,
                    key: &'a $crate::IdempotencyKey
                ) -> (),
                    tenant: Some(&run.tenant);
                run_spend(run: &'a $crate::RunKey) -> Option<$crate::RunSpend>,
                    tenant: Some(&run.tenant);
            }
            StoreAdmin {
                list_sessions(tenant: &'a str, page: &'a $crate::PageRequest)
                    -> $crate::Page<$crate::SessionRecord>,
                    tenant: Some(tenant);
            }
        }
    };
}

/// The synchronous data traits of an embedded handle `$handle` whose
/// inner store (`self.$inner`) implements them: each call the inner
/// store's, inside its span and metrics as backend `$backend`.
/// (`StoreAdmin` stays the handle's own.) Not part of the API.
#[doc(hidden)]
#[macro_export]
macro_rules! forward_sync {
    ($handle:ty, $backend:literal, $inner:tt) => {
        $crate::for_each_call!($crate::__data_traits, [forward, $handle, $backend, $inner]);
    };
}

/// The four synchronous data traits (`StateStore`, `FeedStore`,
/// `TrayStore`, `BudgetStore`) of a type, from the list of calls; each
/// call's body by `$mode`: `forward` (an embedded handle, `forward_sync!`)
/// or `bridge` (a server backend, `impl_async_core!`).
#[doc(hidden)]
#[macro_export]
macro_rules! __data_traits {
    (
        [$mode:ident, $t:ty $(, $extra:tt)*]
        StateStore { $($state:tt)* }
        FeedStore { $($feed:tt)* }
        TrayStore { $($tray:tt)* }
        BudgetStore { $($budget:tt)* }
        StoreAdmin { $($admin:tt)* }
    ) => {
        $crate::__data_traits!(@impl $mode, StateStore, $t, [$($extra),*] $($state)*);
        $crate::__data_traits!(@impl $mode, FeedStore, $t, [$($extra),*] $($feed)*);
        $crate::__data_traits!(@impl $mode, TrayStore, $t, [$($extra),*] $($tray)*);
        $crate::__data_traits!(@impl $mode, BudgetStore, $t, [$($extra),*] $($budget)*);
    };
    (@impl $mode:ident, $trait:ident, $t:ty, $extra:tt
        $(
            $name:ident ( $($arg:ident : $ty:ty),* $(,)? ) -> $answer:ty, tenant: $tenant:expr;
        )*
    ) => {
        impl $crate::$trait for $t {
            $(
                fn $name<'a>(&'a self, $($arg: $ty),*) -> $crate::Result<$answer> {
                    $crate::__data_traits!(
                        @body $mode, $trait, $extra, $name, ($($arg),*), $tenant, self
                    )
                }
            )*
        }
    };
    (@body forward, $trait:ident, [$backend:literal, $inner:tt], $name:ident,
        ($($arg:ident),*), $tenant:expr, $self:ident) => {{
        let span = $crate::observe::span($backend, stringify!($name), $tenant);
        $crate::observe::call_sync(span, $backend, stringify!($name), || {
            <_ as $crate::$trait>::$name(&$self.$inner, $($arg),*)
        })
    }};
    (@body bridge, $trait:ident, [], $name:ident,
        ($($arg:ident),*), $tenant:expr, $self:ident) => {{
        use $crate::native::AsyncCore as C;
        C::bridge($self).block_on(C::$name($self, $($arg),*))
    }};
}
