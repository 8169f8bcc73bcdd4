"""Checked by mypy (python/ci.sh): the stubs cover what users write."""

from __future__ import annotations

import asyncio
import pickle
from typing import Any, AsyncIterator, Dict, List, Optional, Tuple

from agentstate_rs import (
    Alarm,
    BudgetStatus,
    Change,
    ChangePage,
    ChangeStream,
    FeedScope,
    FenceLostError,
    FileStateStore,
    InstanceKey,
    ManualClock,
    MemoryStateStore,
    Page,
    PostgresStateStore,
    RedisStateStore,
    RunKey,
    RunRecord,
    RunState,
    SessionRecord,
    StateConflictError,
    StateDelta,
    StateFeedPrunedError,
    StateQuery,
    StateStore,
    SyncChangeStream,
    Tray,
    TrayKey,
    TrayOp,
    iter_budgets,
    iter_due_alarms,
    iter_marked_trays,
    iter_runs,
    iter_sessions,
    iter_trays,
)
from agentstate_rs.testing import StateStoreConformance


async def main(store: StateStore) -> int:
    run: RunRecord = await store.put_run(RunRecord(run_id="run_1", tenant="acme", agent_name="planner"))
    version: int = run.version
    await store.patch_run(run.key, StateDelta(iterations=1, cost_micros=1_200))
    try:
        await store.put_run(run)
    except StateConflictError as refused:
        version = refused.actual_version - refused.expected_version
    page: Page[RunRecord] = await store.list_runs(StateQuery(tenant="acme", state=RunState.RUNNING, limit=100))
    while page.cursor is not None:
        page = await store.list_runs(StateQuery(tenant="acme", cursor=page.cursor))
    got: Optional[RunRecord] = await store.get_run(RunKey("acme", "run_1"))
    if got is not None and got.mid_tool_call:
        got = got.scrubbed()
    inst = InstanceKey("ns", "id")
    await store.apply_batch(inst, 1, [TrayOp.put("t", "a", Tray(b"doc", marked=True))])
    marked = await store.marked_trays("default", limit=10)
    keys: List[str] = [m.key.tray_id for m in marked.items]
    async for r in iter_runs(store, StateQuery("acme")):
        keys.append(r.run_id)
    tagged = RunRecord(run_id="run_2", tenant="acme", agent_name="planner", labels={"user": "u-1", "n": 3})
    tagged.labels = {**tagged.labels, "trace": "t-9"}
    await store.put_run(tagged)
    by_user = await store.list_runs(StateQuery("acme", label=("user", "u-1")))
    keys.extend(r.run_id for r in by_user.items)
    return version + len(keys) + await walks(store, inst)


async def walks(store: StateStore, inst: InstanceKey) -> int:
    sessions: AsyncIterator[SessionRecord] = iter_sessions(store, "acme", limit=50)
    ids: List[str] = [s.session_id async for s in sessions]
    async for key, tray in iter_trays(store, inst, 1):
        k: TrayKey = key
        ids.append(k.tray_id + tray.doc.decode())
    async for m in iter_marked_trays(store, "default"):
        ids.append(m.key.tray_id)
    async for m in iter_marked_trays(store, limit=10):
        ids.append(m.hostname)
    due: List[Alarm] = [a async for a in iter_due_alarms(store, 1_000, limit=10)]
    spend: List[Tuple[str, int]] = []
    async for b in iter_budgets(store, "acme"):
        status: BudgetStatus = b
        spend.append((status.record.key.name, status.spent.cost_micros))
    try:
        await store.write_tray(inst.tray("t", "a"), 0, Tray(b"stale"))
    except FenceLostError as lost:
        copy: FenceLostError = pickle.loads(pickle.dumps(lost))
        ids.append(str(copy.stored_epoch - copy.caller_epoch))
    return len(ids) + len(due) + len(spend)


async def feed(store: StateStore) -> Optional[int]:
    scope = FeedScope.tenant("acme")
    at: int = await store.feed_head(scope)
    try:
        page: ChangePage = await store.changes(scope, at, 100)
    except StateFeedPrunedError as pruned:
        horizon: int = pruned.horizon
        page = await store.changes(scope, after=horizon)
    runs: List[RunRecord] = [c.run for c in page.changes if c.run is not None]
    page = await store.wait_changes(FeedScope.trays(env="prod"), page.next, limit=10, timeout=1.5)
    dropped: int = await store.prune_changes(scope, through=page.next)
    feed: ChangeStream = store.watch(FeedScope.trays(), after=None)
    async for change in feed:
        c: Change = change
        if c.kind == "alarm_deleted" and isinstance(c.key, InstanceKey) and not c.deleted:
            return c.position + len(runs) + dropped
        if c.tray is not None:
            return feed.position
    blocking: SyncChangeStream = store.sync().watch(scope)
    for change in blocking:
        return change.position
    return None


async def seeds(store: StateStore) -> int:
    """pinned's StateStore protocol, as pinned calls it."""
    await store.set_tray("ns", "i", "t", "a", True, {"step": 1}, 3)
    got: Optional[Tuple[bool, Dict[str, Any]]] = await store.get_tray("ns", "i", "t", "a", 3)
    rows: List[Tuple[str, str, bool, Dict[str, Any]]] = await store.list("ns", "i", 3, tray_ns="t", marked=True)
    await store.apply_batch("ns", "i", [("tray", "t", "b", None, None), ("tray", "t", "c", False, {})], 3)
    await store.delete_tray("ns", "i", "t", "c", 3)
    existed: bool = await store.delete_tray(InstanceKey("ns", "i").tray("t", "a"), 3)
    s = store.sync()
    s.set_tray("ns", "i", "t", "a", False, {}, 3)
    again: Optional[Tuple[bool, Dict[str, Any]]] = s.get_tray("ns", "i", "t", "a", 3)
    try:
        await store.set_tray("ns", "i", "t", "a", True, {}, 1)
    except FenceLostError as e:
        key: str = e.key
        epoch: int = e.epoch
        return len(key) + epoch
    MemoryStateStore(env="prod", hostname="w1")
    return len(rows) + int(existed) + int(got is None) + int(again is None)


class TestMine(StateStoreConformance):
    def make_store(self) -> StateStore:
        return MemoryStateStore(clock=self.clock)


def scripts() -> None:
    s = FileStateStore("/tmp/x", clock=ManualClock(5)).sync()
    r: RunRecord = s.put_run(RunRecord(run_id="r", tenant="t", agent_name="p"))
    s.patch_run(r.key, StateDelta(messages_read=1))
    head: int = s.feed_head(FeedScope("tenant", "acme"))
    for c in s.changes(FeedScope.tenant("acme"), head).changes:
        print(c.kind, c.key, c.record)
    s.close()
    PostgresStateStore("postgres://u@h/db", pool_size=8)
    RedisStateStore("redis://h:6379/0", clock=lambda: 0)
    asyncio.run(main(MemoryStateStore()))
    asyncio.run(feed(MemoryStateStore()))
