"""Checked by mypy (python/ci.sh): the stubs cover what users write."""

from __future__ import annotations

import asyncio
from typing import List, Optional

from agentstate_rs import (
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
    StateConflictError,
    StateDelta,
    StateQuery,
    StateStore,
    Tray,
    TrayOp,
    iter_runs,
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
    return version + len(keys)


class TestMine(StateStoreConformance):
    def make_store(self) -> StateStore:
        return MemoryStateStore(clock=self.clock)


def scripts() -> None:
    s = FileStateStore("/tmp/x", clock=ManualClock(5)).sync()
    r: RunRecord = s.put_run(RunRecord(run_id="r", tenant="t", agent_name="p"))
    s.patch_run(r.key, StateDelta(messages_read=1))
    s.close()
    PostgresStateStore("postgres://u@h/db", pool_size=8)
    RedisStateStore("redis://h:6379/0", clock=lambda: 0)
    asyncio.run(main(MemoryStateStore()))
