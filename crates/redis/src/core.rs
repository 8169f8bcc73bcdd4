//! The store's calls as [`AsyncCore`]: each one the async body in
//! `runs.rs`, `trays.rs` or `budgets.rs` inside its tracing span and
//! metrics (`observe::call`). The synchronous traits are generated from
//! these (`sync_over_async!`), and `AsyncStore` awaits them natively.

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

use super::RedisStore;

const B: &str = "redis";

impl AsyncCore for RedisStore {
    fn bridge(&self) -> &Bridge {
        &self.bridge
    }

    async fn put_run(&self, record: RunRecord) -> Result<RunRecord> {
        let tenant = record.key.tenant.clone();
        call(B, "put_run", Some(&tenant), self.put_run_impl(record)).await
    }
    async fn get_run(&self, key: &RunKey) -> Result<Option<RunRecord>> {
        call(B, "get_run", Some(&key.tenant), self.get_run_impl(key)).await
    }
    async fn patch_run(&self, key: &RunKey, delta: StateDelta) -> Result<RunRecord> {
        call(
            B,
            "patch_run",
            Some(&key.tenant),
            self.patch_run_impl(key, delta),
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
            B,
            "put_run_idempotent",
            Some(&tenant),
            self.put_run_idempotent_impl(record, key),
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
            B,
            "patch_run_idempotent",
            Some(&key.tenant),
            self.patch_run_idempotent_impl(key, delta, idempotency_key),
        )
        .await
    }
    async fn delete_run(&self, key: &RunKey, expected_version: Option<u64>) -> Result<RunRecord> {
        call(
            B,
            "delete_run",
            Some(&key.tenant),
            self.delete_run_impl(key, expected_version),
        )
        .await
    }
    async fn list_runs(&self, query: &StateQuery, page: &PageRequest) -> Result<Page<RunRecord>> {
        call(
            B,
            "list_runs",
            Some(&query.tenant),
            self.list_runs_impl(query, page),
        )
        .await
    }
    async fn put_session(&self, record: SessionRecord) -> Result<SessionRecord> {
        let tenant = record.key.tenant.clone();
        call(
            B,
            "put_session",
            Some(&tenant),
            self.put_session_impl(record),
        )
        .await
    }
    async fn get_session(&self, key: &SessionKey) -> Result<Option<SessionRecord>> {
        call(
            B,
            "get_session",
            Some(&key.tenant),
            self.get_session_impl(key),
        )
        .await
    }
    async fn delete_session(&self, key: &SessionKey, cascade: bool) -> Result<Vec<RunKey>> {
        call(
            B,
            "delete_session",
            Some(&key.tenant),
            self.delete_session_impl(key, cascade),
        )
        .await
    }
    async fn list_sessions(&self, tenant: &str, page: &PageRequest) -> Result<Page<SessionRecord>> {
        call(
            B,
            "list_sessions",
            Some(tenant),
            self.list_sessions_impl(tenant, page),
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
        call(B, "changes", tenant, self.changes_impl(scope, after, limit)).await
    }

    async fn wait_changes(
        &self,
        scope: &agentstate_core::feed::FeedScope,
        after: agentstate_core::feed::Position,
        limit: usize,
        timeout: std::time::Duration,
    ) -> Result<agentstate_core::feed::ChangePage> {
        let tenant = agentstate_core::feed::tenant_of(scope);
        let fut = self.wait_changes_impl(scope, after, limit, timeout);
        call(B, "wait_changes", tenant, fut).await
    }

    async fn feed_head(
        &self,
        scope: &agentstate_core::feed::FeedScope,
    ) -> Result<agentstate_core::feed::Position> {
        let tenant = agentstate_core::feed::tenant_of(scope);
        call(B, "feed_head", tenant, self.feed_head_impl(scope)).await
    }

    async fn prune_changes(
        &self,
        scope: &agentstate_core::feed::FeedScope,
        through: agentstate_core::feed::Position,
    ) -> Result<u64> {
        let tenant = agentstate_core::feed::tenant_of(scope);
        call(
            B,
            "prune_changes",
            tenant,
            self.prune_changes_impl(scope, through),
        )
        .await
    }

    async fn read_tray(&self, key: &TrayKey, epoch: u64) -> Result<Option<Tray>> {
        call(B, "read_tray", None, self.read_tray_impl(key, epoch)).await
    }
    async fn write_tray(&self, key: &TrayKey, epoch: u64, tray: Tray) -> Result<()> {
        call(
            B,
            "write_tray",
            None,
            self.write_tray_impl(key, epoch, tray),
        )
        .await
    }
    async fn delete_tray(&self, key: &TrayKey, epoch: u64) -> Result<bool> {
        call(B, "delete_tray", None, self.delete_tray_impl(key, epoch)).await
    }
    async fn apply_batch(
        &self,
        instance: &InstanceKey,
        epoch: u64,
        ops: Vec<TrayOp>,
    ) -> Result<()> {
        call(
            B,
            "apply_batch",
            None,
            self.apply_batch_impl(instance, epoch, ops),
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
            B,
            "apply_batch_idempotent",
            None,
            self.apply_batch_idempotent_impl(instance, epoch, ops, key),
        )
        .await
    }
    async fn release(&self, instance: &InstanceKey, epoch: u64) -> Result<()> {
        call(B, "release", None, self.release_impl(instance, epoch)).await
    }
    async fn list_trays(
        &self,
        instance: &InstanceKey,
        epoch: u64,
        page: &PageRequest,
    ) -> Result<Page<(TrayKey, Tray)>> {
        call(
            B,
            "list_trays",
            None,
            self.list_trays_impl(instance, epoch, page),
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
            B,
            "instance_trays",
            None,
            self.instance_trays_impl(instance, epoch, filter),
        )
        .await
    }
    async fn marked_trays(
        &self,
        env: Option<&str>,
        page: &PageRequest,
    ) -> Result<Page<MarkedTray>> {
        call(B, "marked_trays", None, self.marked_trays_impl(env, page)).await
    }
    async fn epoch(&self, instance: &InstanceKey) -> Result<u64> {
        call(B, "epoch", None, self.epoch_impl(instance)).await
    }
    async fn set_alarm(&self, instance: &InstanceKey, epoch: u64, due_at: Millis) -> Result<()> {
        call(
            B,
            "set_alarm",
            None,
            self.set_alarm_impl(instance, epoch, due_at),
        )
        .await
    }
    async fn due_alarms(&self, now: Millis, page: &PageRequest) -> Result<Page<Alarm>> {
        call(B, "due_alarms", None, self.due_alarms_impl(now, page)).await
    }
    async fn ack_alarm(&self, instance: &InstanceKey, epoch: u64, due_at: Millis) -> Result<bool> {
        call(
            B,
            "ack_alarm",
            None,
            self.ack_alarm_impl(instance, epoch, due_at),
        )
        .await
    }

    async fn put_budget(&self, record: BudgetRecord) -> Result<BudgetRecord> {
        let tenant = record.key.tenant.clone();
        call(B, "put_budget", Some(&tenant), self.put_budget_impl(record)).await
    }
    async fn get_budget(&self, key: &BudgetKey) -> Result<Option<BudgetStatus>> {
        call(
            B,
            "get_budget",
            Some(&key.tenant),
            self.get_budget_impl(key),
        )
        .await
    }
    async fn list_budgets(&self, tenant: &str, page: &PageRequest) -> Result<Page<BudgetStatus>> {
        call(
            B,
            "list_budgets",
            Some(tenant),
            self.list_budgets_impl(tenant, page),
        )
        .await
    }
    async fn reserve(&self, run: &RunKey, hold: Hold) -> Result<HoldRecord> {
        call(
            B,
            "reserve",
            Some(&run.tenant),
            self.reserve_impl(run, hold),
        )
        .await
    }
    async fn settle(&self, run: &RunKey, hold_id: &str, spent: StateDelta) -> Result<Settled> {
        call(
            B,
            "settle",
            Some(&run.tenant),
            self.settle_impl(run, hold_id, spent),
        )
        .await
    }
    async fn release_hold(&self, run: &RunKey, hold_id: &str) -> Result<()> {
        call(
            B,
            "release_hold",
            Some(&run.tenant),
            self.release_hold_impl(run, hold_id),
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
            B,
            "reserve_idempotent",
            Some(&run.tenant),
            self.reserve_idempotent_impl(run, hold, key),
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
            B,
            "settle_idempotent",
            Some(&run.tenant),
            self.settle_idempotent_impl(run, hold_id, spent, key),
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
            B,
            "release_hold_idempotent",
            Some(&run.tenant),
            self.release_hold_idempotent_impl(run, hold_id, key),
        )
        .await
    }
    async fn run_spend(&self, run: &RunKey) -> Result<Option<RunSpend>> {
        call(B, "run_spend", Some(&run.tenant), self.run_spend_impl(run)).await
    }
}

agentstate_core::native::sync_over_async!(RedisStore);
