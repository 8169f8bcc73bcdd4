"""agentstate-rs: durable state for AI-agent runtimes, on memory, an embedded
file store, PostgreSQL or Redis (the Rust crate ``agentstate``).

    store = MemoryStateStore()
    run = await store.put_run(RunRecord(run_id="run_1", tenant="acme", agent_name="planner"))
    run.version  # 1
    await store.patch_run(run.key, StateDelta(iterations=1, cost_micros=1_200))

Every paged listing also walks as an async iterator, page after page to the
end: ``iter_runs``, ``iter_sessions``, ``iter_trays``, ``iter_marked_trays``,
``iter_due_alarms``, ``iter_budgets``.

The change feed (rules F1-F9): what changed since a position, each record
once in its current state (or its tombstone), in commit order::

    scope = FeedScope.tenant("acme")      # or FeedScope.trays(), FeedScope.trays(env="prod")
    at = await store.feed_head(scope)     # positions are opaque ints of their scope and store; None is the start
    page = await store.changes(scope, at, limit=100)   # ChangePage: .changes, .next
    page = await store.wait_changes(scope, page.next, timeout=30.0)
    async for change in store.watch(scope, after=page.next):   # without end
        change.kind, change.key, change.run  # "run", RunKey(...), RunRecord(...)
"""

from __future__ import annotations

import atexit as _atexit
from typing import AsyncIterator, Awaitable, Callable, Optional, Tuple, TypeVar

from . import _native
from ._native import (
    REDACTED,
    Alarm,
    Approval,
    BudgetKey,
    BudgetRecord,
    BudgetStatus,
    Caps,
    Change,
    ChangePage,
    ChangeStream,
    FeedScope,
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
    SyncChangeStream,
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
    StateFeedPrunedError,
    StateInUseError,
    StateInvalidError,
    StateLockedError,
    StateNotFoundError,
    StatePersistenceError,
    StateUnsupportedFormatError,
    StoreForkedError,
)


# At exit, before the interpreter finalizes, wait (up to 5 s, GIL
# released) for the runtime's tasks still handing results to asyncio: a
# thread that needs the GIL once finalization has begun is stopped mid-way
# and crashes the process.
_atexit.register(_native._quiesce, 5.0)

__all__ = [
    "REDACTED",
    "Alarm",
    "Approval",
    "BudgetExceededError",
    "BudgetKey",
    "BudgetRecord",
    "BudgetStatus",
    "Caps",
    "Change",
    "ChangePage",
    "ChangeStream",
    "FeedScope",
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
    "StateFeedPrunedError",
    "StateInUseError",
    "StateInvalidError",
    "StateLockedError",
    "StateNotFoundError",
    "StatePersistenceError",
    "StateQuery",
    "StateStore",
    "StateUnsupportedFormatError",
    "StoreForkedError",
    "SyncChangeStream",
    "SyncStateStore",
    "ToolCall",
    "Tray",
    "TrayKey",
    "TrayOp",
    "Usage",
    "iter_budgets",
    "iter_due_alarms",
    "iter_marked_trays",
    "iter_runs",
    "iter_sessions",
    "iter_trays",
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


_T = TypeVar("_T")


async def _walk(fetch: Callable[[Optional[str]], Awaitable[Page[_T]]]) -> AsyncIterator[_T]:
    """Every item of a cursor listing: ``fetch(cursor)`` reads one page, the
    first with no cursor; the walk ends after the page without one."""
    cursor: Optional[str] = None
    while True:
        page = await fetch(cursor)
        for item in page.items:
            yield item
        if page.cursor is None:
            return
        cursor = page.cursor


def iter_sessions(store: StateStore, tenant: str, *, limit: int = 100) -> AsyncIterator[SessionRecord]:
    """Every session of the tenant (``list_sessions``), ``limit`` a page."""
    return _walk(lambda cursor: store.list_sessions(tenant, limit=limit, cursor=cursor))


def iter_trays(store: StateStore, instance: InstanceKey, epoch: int, *, limit: int = 100) -> AsyncIterator[Tuple[TrayKey, Tray]]:
    """Every tray of the instance as ``(TrayKey, Tray)`` (``list_trays``);
    each page is read at ``epoch``, so a fenced holder's walk stops with
    FenceLostError."""
    return _walk(lambda cursor: store.list_trays(instance, epoch, limit=limit, cursor=cursor))


def iter_marked_trays(store: StateStore, env: Optional[str] = None, *, limit: int = 100) -> AsyncIterator[MarkedTray]:
    """Every marked tray, of one env or all (``marked_trays``, the sweeper's walk)."""
    return _walk(lambda cursor: store.marked_trays(env, limit=limit, cursor=cursor))


def iter_due_alarms(store: StateStore, now: int, *, limit: int = 100) -> AsyncIterator[Alarm]:
    """Every alarm due at ``now`` (``due_alarms``), in (due_at, ns, id) order."""
    return _walk(lambda cursor: store.due_alarms(now, limit=limit, cursor=cursor))


def iter_budgets(store: StateStore, tenant: str, *, limit: int = 100) -> AsyncIterator[BudgetStatus]:
    """Every budget of the tenant with its spend and holds (``list_budgets``)."""
    return _walk(lambda cursor: store.list_budgets(tenant, limit=limit, cursor=cursor))
