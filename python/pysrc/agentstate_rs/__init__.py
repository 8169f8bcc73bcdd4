"""agentstate-rs: durable state for AI-agent runtimes, on memory, an embedded
file store, PostgreSQL or Redis (the Rust crate ``agentstate``).

    store = MemoryStateStore()
    run = await store.put_run(RunRecord(run_id="run_1", tenant="acme", agent_name="planner"))
    run.version  # 1
    await store.patch_run(run.key, StateDelta(iterations=1, cost_micros=1_200))
"""

from __future__ import annotations

from typing import AsyncIterator

from ._native import (
    REDACTED,
    Alarm,
    Approval,
    BudgetKey,
    BudgetRecord,
    BudgetStatus,
    Caps,
    FileStateStore,
    Hold,
    HoldRecord,
    InstanceKey,
    ManualClock,
    MarkedTray,
    MemoryStateStore,
    Page,
    PostgresStateStore,
    RedisStateStore,
    RunKey,
    RunRecord,
    RunSpend,
    RunState,
    SessionKey,
    SessionRecord,
    Settled,
    Spend,
    StateDelta,
    StateQuery,
    StateStore,
    SyncStateStore,
    ToolCall,
    Tray,
    TrayKey,
    TrayOp,
    Usage,
    redact_connection_string,
    scrub_arguments,
)
from .errors import (
    BudgetExceededError,
    FenceLostError,
    StateClosedError,
    StateConflictError,
    StateCorruptError,
    StateError,
    StateInUseError,
    StateInvalidError,
    StateLockedError,
    StateNotFoundError,
    StatePersistenceError,
    StateUnsupportedFormatError,
    StoreForkedError,
)

__all__ = [
    "REDACTED",
    "Alarm",
    "Approval",
    "BudgetExceededError",
    "BudgetKey",
    "BudgetRecord",
    "BudgetStatus",
    "Caps",
    "FenceLostError",
    "FileStateStore",
    "Hold",
    "HoldRecord",
    "InstanceKey",
    "ManualClock",
    "MarkedTray",
    "MemoryStateStore",
    "Page",
    "PostgresStateStore",
    "RedisStateStore",
    "RunKey",
    "RunRecord",
    "RunSpend",
    "RunState",
    "SessionKey",
    "SessionRecord",
    "Settled",
    "Spend",
    "StateClosedError",
    "StateConflictError",
    "StateCorruptError",
    "StateDelta",
    "StateError",
    "StateInUseError",
    "StateInvalidError",
    "StateLockedError",
    "StateNotFoundError",
    "StatePersistenceError",
    "StateQuery",
    "StateStore",
    "StateUnsupportedFormatError",
    "StoreForkedError",
    "SyncStateStore",
    "ToolCall",
    "Tray",
    "TrayKey",
    "TrayOp",
    "Usage",
    "iter_runs",
    "redact_connection_string",
    "scrub_arguments",
]


async def iter_runs(store: StateStore, query: StateQuery) -> AsyncIterator[RunRecord]:
    """Every run the query matches, page after page (the seeds' listing loop)."""
    page = await store.list_runs(query)
    while True:
        for run in page.items:
            yield run
        if page.cursor is None:
            return
        page = await store.list_runs(StateQuery(query.tenant, limit=query.limit, cursor=page.cursor))
