//! The store's calls as `async fn`s ([`AsyncCore`]): each in its span and
//! counted (`agentstate_core::observe`), tenant named where the call has one. The
//! synchronous traits are generated from these (`sync_over_async!`), and
//! [`AsyncStore`](agentstate_core::AsyncStore) awaits them in the caller's task.

use agentstate_core::budget::{
    BudgetKey, BudgetRecord, BudgetStatus, Hold, HoldRecord, RunSpend, Settled,
};
use agentstate_core::error::Result;
use agentstate_core::idempotency::IdempotencyKey;
use agentstate_core::native::{AsyncCore, Bridge};
use agentstate_core::observe::call;
use agentstate_core::page::{Page, PageRequest};
use agentstate_core::record::{
    Millis, RunKey, RunRecord, SessionKey, SessionRecord, StateDelta, StateQuery,
};
use agentstate_core::tray::{Alarm, InstanceKey, MarkedTray, Tray, TrayFilter, TrayKey, TrayOp};

use super::PostgresStore;

const PG: &str = "postgres";

impl AsyncCore for PostgresStore {
    fn bridge(&self) -> &Bridge {
        &self.bridge
    }

    async fn put_run(&self, record: RunRecord) -> Result<RunRecord> {
        let tenant = record.key.tenant.clone();
        call(PG, "put_run", Some(&tenant), self.do_put_run(record)).await
    }

    async fn get_run(&self, key: &RunKey) -> Result<Option<RunRecord>> {
        call(PG, "get_run", Some(&key.tenant), self.do_get_run(key)).await
    }

    async fn patch_run(&self, key: &RunKey, delta: StateDelta) -> Result<RunRecord> {
        call(
            PG,
            "patch_run",
            Some(&key.tenant),
            self.do_patch_run(key, delta),
        )
        .await
    }

    async fn put_run_idempotent(
        &self,
        record: RunRecord,
        key: &IdempotencyKey,
    ) -> Result<RunRecord> {
        let tenant = record.key.tenant.clone();
        call(
            PG,
            "put_run_idempotent",
            Some(&tenant),
            self.do_put_run_idempotent(record, key),
        )
        .await
    }

    async fn patch_run_idempotent(
        &self,
        key: &RunKey,
        delta: StateDelta,
        idempotency_key: &IdempotencyKey,
    ) -> Result<RunRecord> {
        call(
            PG,
            "patch_run_idempotent",
            Some(&key.tenant),
            self.do_patch_run_idempotent(key, delta, idempotency_key),
        )
        .await
    }

    async fn delete_run(&self, key: &RunKey, expected_version: Option<u64>) -> Result<RunRecord> {
        call(
            PG,
            "delete_run",
            Some(&key.tenant),
            self.do_delete_run(key, expected_version),
        )
        .await
    }

    async fn list_runs(&self, query: &StateQuery, page: &PageRequest) -> Result<Page<RunRecord>> {
        call(
            PG,
            "list_runs",
            Some(&query.tenant),
            self.do_list_runs(query, page),
        )
        .await
    }

    async fn put_session(&self, record: SessionRecord) -> Result<SessionRecord> {
        let tenant = record.key.tenant.clone();
        call(
            PG,
            "put_session",
            Some(&tenant),
            self.do_put_session(record),
        )
        .await
    }

    async fn get_session(&self, key: &SessionKey) -> Result<Option<SessionRecord>> {
        call(
            PG,
            "get_session",
            Some(&key.tenant),
            self.do_get_session(key),
        )
        .await
    }

    async fn delete_session(&self, key: &SessionKey, cascade: bool) -> Result<Vec<RunKey>> {
        call(
            PG,
            "delete_session",
            Some(&key.tenant),
            self.do_delete_session(key, cascade),
        )
        .await
    }

    async fn list_sessions(&self, tenant: &str, page: &PageRequest) -> Result<Page<SessionRecord>> {
        call(
            PG,
            "list_sessions",
            Some(tenant),
            self.do_list_sessions(tenant, page),
        )
        .await
    }

    async fn changes(
        &self,
        scope: &agentstate_core::feed::FeedScope,
        after: agentstate_core::feed::Position,
        limit: usize,
    ) -> Result<agentstate_core::feed::ChangePage> {
        let tenant = agentstate_core::feed::tenant_of(scope);
        call(PG, "changes", tenant, self.do_changes(scope, after, limit)).await
    }

    async fn wait_changes(
        &self,
        scope: &agentstate_core::feed::FeedScope,
        after: agentstate_core::feed::Position,
        limit: usize,
        timeout: std::time::Duration,
    ) -> Result<agentstate_core::feed::ChangePage> {
        let tenant = agentstate_core::feed::tenant_of(scope);
        let fut = self.do_wait_changes(scope, after, limit, timeout);
        call(PG, "wait_changes", tenant, fut).await
    }

    async fn feed_head(
        &self,
        scope: &agentstate_core::feed::FeedScope,
    ) -> Result<agentstate_core::feed::Position> {
        let tenant = agentstate_core::feed::tenant_of(scope);
        call(PG, "feed_head", tenant, self.do_feed_head(scope)).await
    }

    async fn prune_changes(
        &self,
        scope: &agentstate_core::feed::FeedScope,
        through: agentstate_core::feed::Position,
    ) -> Result<u64> {
        let tenant = agentstate_core::feed::tenant_of(scope);
        call(
            PG,
            "prune_changes",
            tenant,
            self.do_prune_changes(scope, through),
        )
        .await
    }

    async fn read_tray(&self, key: &TrayKey, epoch: u64) -> Result<Option<Tray>> {
        call(PG, "read_tray", None, self.do_read_tray(key, epoch)).await
    }

    async fn write_tray(&self, key: &TrayKey, epoch: u64, tray: Tray) -> Result<()> {
        call(PG, "write_tray", None, self.do_write_tray(key, epoch, tray)).await
    }

    async fn delete_tray(&self, key: &TrayKey, epoch: u64) -> Result<bool> {
        call(PG, "delete_tray", None, self.do_delete_tray(key, epoch)).await
    }

    async fn apply_batch(
        &self,
        instance: &InstanceKey,
        epoch: u64,
        ops: Vec<TrayOp>,
    ) -> Result<()> {
        call(
            PG,
            "apply_batch",
            None,
            self.do_apply_batch(instance, epoch, ops),
        )
        .await
    }

    async fn apply_batch_idempotent(
        &self,
        instance: &InstanceKey,
        epoch: u64,
        ops: Vec<TrayOp>,
        key: &IdempotencyKey,
    ) -> Result<()> {
        call(
            PG,
            "apply_batch_idempotent",
            None,
            self.do_apply_batch_idempotent(instance, epoch, ops, key),
        )
        .await
    }

    async fn release(&self, instance: &InstanceKey, epoch: u64) -> Result<()> {
        call(PG, "release", None, self.do_release(instance, epoch)).await
    }

    async fn list_trays(
        &self,
        instance: &InstanceKey,
        epoch: u64,
        page: &PageRequest,
    ) -> Result<Page<(TrayKey, Tray)>> {
        call(
            PG,
            "list_trays",
            None,
            self.do_list_trays(instance, epoch, page),
        )
        .await
    }

    async fn instance_trays(
        &self,
        instance: &InstanceKey,
        epoch: u64,
        filter: &TrayFilter,
    ) -> Result<Vec<(TrayKey, Tray)>> {
        call(
            PG,
            "instance_trays",
            None,
            self.do_instance_trays(instance, epoch, filter),
        )
        .await
    }

    async fn marked_trays(
        &self,
        env: Option<&str>,
        page: &PageRequest,
    ) -> Result<Page<MarkedTray>> {
        call(PG, "marked_trays", None, self.do_marked_trays(env, page)).await
    }

    async fn epoch(&self, instance: &InstanceKey) -> Result<u64> {
        call(PG, "epoch", None, self.do_epoch(instance)).await
    }

    async fn set_alarm(&self, instance: &InstanceKey, epoch: u64, due_at: Millis) -> Result<()> {
        call(
            PG,
            "set_alarm",
            None,
            self.do_set_alarm(instance, epoch, due_at),
        )
        .await
    }

    async fn due_alarms(&self, now: Millis, page: &PageRequest) -> Result<Page<Alarm>> {
        call(PG, "due_alarms", None, self.do_due_alarms(now, page)).await
    }

    async fn ack_alarm(&self, instance: &InstanceKey, epoch: u64, due_at: Millis) -> Result<bool> {
        call(
            PG,
            "ack_alarm",
            None,
            self.do_ack_alarm(instance, epoch, due_at),
        )
        .await
    }

    async fn put_budget(&self, record: BudgetRecord) -> Result<BudgetRecord> {
        let tenant = record.key.tenant.clone();
        call(PG, "put_budget", Some(&tenant), self.do_put_budget(record)).await
    }

    async fn get_budget(&self, key: &BudgetKey) -> Result<Option<BudgetStatus>> {
        call(PG, "get_budget", Some(&key.tenant), self.do_get_budget(key)).await
    }

    async fn list_budgets(&self, tenant: &str, page: &PageRequest) -> Result<Page<BudgetStatus>> {
        call(
            PG,
            "list_budgets",
            Some(tenant),
            self.do_list_budgets(tenant, page),
        )
        .await
    }

    async fn reserve(&self, run: &RunKey, hold: Hold) -> Result<HoldRecord> {
        call(PG, "reserve", Some(&run.tenant), self.do_reserve(run, hold)).await
    }

    async fn settle(&self, run: &RunKey, hold_id: &str, spent: StateDelta) -> Result<Settled> {
        call(
            PG,
            "settle",
            Some(&run.tenant),
            self.do_settle(run, hold_id, spent),
        )
        .await
    }

    async fn release_hold(&self, run: &RunKey, hold_id: &str) -> Result<()> {
        call(
            PG,
            "release_hold",
            Some(&run.tenant),
            self.do_release_hold(run, hold_id),
        )
        .await
    }

    async fn reserve_idempotent(
        &self,
        run: &RunKey,
        hold: Hold,
        key: &IdempotencyKey,
    ) -> Result<HoldRecord> {
        call(
            PG,
            "reserve_idempotent",
            Some(&run.tenant),
            self.do_reserve_idempotent(run, hold, key),
        )
        .await
    }

    async fn settle_idempotent(
        &self,
        run: &RunKey,
        hold_id: &str,
        spent: StateDelta,
        key: &IdempotencyKey,
    ) -> Result<Settled> {
        call(
            PG,
            "settle_idempotent",
            Some(&run.tenant),
            self.do_settle_idempotent(run, hold_id, spent, key),
        )
        .await
    }

    async fn release_hold_idempotent(
        &self,
        run: &RunKey,
        hold_id: &str,
        key: &IdempotencyKey,
    ) -> Result<()> {
        call(
            PG,
            "release_hold_idempotent",
            Some(&run.tenant),
            self.do_release_hold_idempotent(run, hold_id, key),
        )
        .await
    }

    async fn run_spend(&self, run: &RunKey) -> Result<Option<RunSpend>> {
        call(PG, "run_spend", Some(&run.tenant), self.do_run_spend(run)).await
    }
}

agentstate_core::native::sync_over_async!(PostgresStore);
