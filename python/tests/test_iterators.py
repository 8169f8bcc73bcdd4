"""The async iterators over every paged listing (iter_sessions, iter_trays,
iter_marked_trays, iter_due_alarms, iter_budgets): each walks every page to
the end, visits each record once, yields what paging by hand yields, and
stops after the last page. On every backend, with more records than a page."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable, Dict, List, Optional, Tuple

import pytest

import agentstate_rs as A
from agentstate_rs import (
    BudgetRecord,
    Caps,
    FileStateStore,
    InstanceKey,
    MemoryStateStore,
    PostgresStateStore,
    RedisStateStore,
    SessionRecord,
    Tray,
    TrayOp,
)

N = 10  # records of each listing
LIMIT = 3  # a page: N is more than three pages
NOW = 1_000_000


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


async def drain(it: AsyncIterator[Any]) -> List[Any]:
    """Every item, then proof the iterator is finished: one more step
    raises StopAsyncIteration (a walk that never ends times out)."""
    out: List[Any] = []

    async def go() -> None:
        async for x in it:
            out.append(x)
            assert len(out) < 10_000, "the walk does not end"

    await asyncio.wait_for(go(), timeout=60)
    with pytest.raises(StopAsyncIteration):
        await it.__anext__()
    return out


async def by_hand(fetch: Callable[[Optional[str]], Awaitable[Any]]) -> Tuple[List[Any], int]:
    """The listing paged by hand: its items and how many pages it took."""
    items: List[Any] = []
    page = await fetch(None)
    pages = 1
    items.extend(page.items)
    while page.cursor is not None:
        page = await fetch(page.cursor)
        pages += 1
        items.extend(page.items)
        assert pages < 1_000
    return items, pages


class Scene:
    """N records of each listing, in names no other test uses, and a few
    records beside them that the listings must leave out."""

    def __init__(self) -> None:
        self.tenant = unique("it")
        self.instance = InstanceKey(unique("it-ns"), "worker")
        self.env = unique("it-env")
        self.alarm_ns = unique("it-alarm")

    async def write(self, store: Any) -> None:
        other_tenant = unique("it-other")
        for i in range(N):
            await store.put_session(SessionRecord(f"s{i:02}", self.tenant, metadata={"i": str(i)}))
            await store.put_budget(BudgetRecord(self.tenant, f"b{i:02}", Caps(cost_micros_max=1_000 + i)))
        await store.put_session(SessionRecord("s00", other_tenant))
        await store.put_budget(BudgetRecord(other_tenant, "b00", Caps(cost_micros_max=1)))
        # The instance's trays: half of them marked, in this scene's env.
        ops = [TrayOp.put("t", f"tray{i:02}", Tray(b"doc%d" % i, marked=i % 2 == 0, env=self.env, hostname="h")) for i in range(N)]
        await store.apply_batch(self.instance, 1, ops)
        self.marked = {(self.instance.ns, self.instance.id, f"tray{i:02}") for i in range(0, N, 2)}
        # N marked trays in all: five more on other instances of the env.
        for i in range(N // 2):
            other = InstanceKey(unique("it-ns"), f"w{i}")
            self.marked.add((other.ns, other.id, "m"))
            await store.write_tray(other.tray("t", "m"), 1, Tray(b"x", marked=True, env=self.env, hostname="h"))
            # Unmarked, and marked in another env: never in the env's walk.
            await store.write_tray(other.tray("t", "clean"), 1, Tray(b"x", marked=False, env=self.env))
            await store.write_tray(other.tray("t", "far"), 1, Tray(b"x", marked=True, env=unique("it-env")))
        await store.write_tray(InstanceKey(unique("it-ns"), "other").tray("t", "x"), 1, Tray(b"x"))
        # N alarms due at NOW, out of order, and one due later.
        for i in range(N):
            await store.set_alarm(InstanceKey(self.alarm_ns, f"a{i:02}"), 1, NOW - 1_000 + (i * 7) % N)
        await store.set_alarm(InstanceKey(self.alarm_ns, "later"), 1, NOW + 1)

    async def check(self, store: Any) -> None:
        """Every iterator against the listing paged by hand, on a store that
        holds this scene alone (due_alarms lists every instance's alarms)."""
        # Sessions.
        sessions = await drain(A.iter_sessions(store, self.tenant, limit=LIMIT))
        hand, pages = await by_hand(lambda c: store.list_sessions(self.tenant, limit=LIMIT, cursor=c))
        assert pages >= 4, pages
        assert [s.session_id for s in sessions] == [s.session_id for s in hand]
        assert sorted(s.session_id for s in sessions) == [f"s{i:02}" for i in range(N)]
        assert all(s.tenant == self.tenant and s.metadata == {"i": str(int(s.session_id[1:]))} for s in sessions)

        # Trays of the instance.
        trays = await drain(A.iter_trays(store, self.instance, 1, limit=LIMIT))
        hand, pages = await by_hand(lambda c: store.list_trays(self.instance, 1, limit=LIMIT, cursor=c))
        assert pages >= 4, pages
        assert [k for k, _ in trays] == [k for k, _ in hand]
        assert sorted(k.tray_id for k, _ in trays) == [f"tray{i:02}" for i in range(N)]
        assert all(k.instance == self.instance and t.doc == b"doc%d" % int(k.tray_id[4:]) for k, t in trays)

        # Marked trays of the env.
        marked = await drain(A.iter_marked_trays(store, self.env, limit=LIMIT))
        hand, pages = await by_hand(lambda c: store.marked_trays(self.env, limit=LIMIT, cursor=c))
        assert pages >= 4, pages
        assert [m.key for m in marked] == [m.key for m in hand]
        got = [(m.key.ns, m.key.id, m.key.tray_id) for m in marked]
        assert len(got) == len(set(got)) == N, got
        assert set(got) == self.marked
        assert all(m.env == self.env and m.hostname == "h" for m in marked)

        # Budgets.
        budgets = await drain(A.iter_budgets(store, self.tenant, limit=LIMIT))
        hand, pages = await by_hand(lambda c: store.list_budgets(self.tenant, limit=LIMIT, cursor=c))
        assert pages >= 4, pages
        assert [b.record.key for b in budgets] == [b.record.key for b in hand]
        assert sorted(b.record.key.name for b in budgets) == [f"b{i:02}" for i in range(N)]
        assert all(b.record.caps.cost_micros_max == 1_000 + int(b.record.key.name[1:]) for b in budgets)

        # Due alarms.
        alarms = await drain(A.iter_due_alarms(store, NOW, limit=LIMIT))
        hand, pages = await by_hand(lambda c: store.due_alarms(NOW, limit=LIMIT, cursor=c))
        assert [(a.instance, a.due_at) for a in alarms] == [(a.instance, a.due_at) for a in hand]
        ours = [a for a in alarms if a.instance.ns == self.alarm_ns]
        assert sorted(a.instance.id for a in ours) == [f"a{i:02}" for i in range(N)]
        assert len(alarms) == N and pages >= 4, (len(alarms), pages)
        assert all(a.due_at <= NOW for a in alarms)
        keys = [(a.due_at, a.instance.ns, a.instance.id) for a in alarms]
        assert keys == sorted(keys), "due alarms come in (due_at, ns, id) order"


# --- the stores ----------------------------------------------------------------


def memory() -> Any:
    return MemoryStateStore()


@pytest.fixture(params=["memory", "file", "postgres", "redis"])
def store_factory(request: Any, tmp_path: Any) -> Callable[[], Any]:
    """A store of each backend, holding nothing but what the test writes."""
    kind = request.param
    if kind == "memory":
        return memory
    if kind == "file":
        return lambda: FileStateStore(str(tmp_path / "store"))
    if kind == "postgres":
        dsn = request.getfixturevalue("pg_dsn")
        schema = "py_iter_" + uuid.uuid4().hex[:12]
        return lambda: PostgresStateStore(dsn, schema=schema, pool_size=2)
    server = request.getfixturevalue("redis_server")
    # A database no other test uses (the server is this session's): no
    # other test's alarms in the due listing.
    url = server.url(5)
    return lambda: RedisStateStore(url)


def test_every_iterator_walks_every_page_on_every_backend(store_factory: Callable[[], Any]) -> None:
    async def main() -> None:
        store = store_factory()
        await store.setup()
        scene = Scene()
        await scene.write(store)
        await scene.check(store)
        await store.close()

    asyncio.run(main())


# --- what a walk reads ---------------------------------------------------------


class Counting:
    """A store that counts the pages each listing reads (duck-typed like
    the stores the conformance suite checks)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: Dict[str, List[Optional[str]]] = {}

    def __getattr__(self, name: str) -> Any:
        call = getattr(self.inner, name)
        if not name.startswith(("list_", "marked_", "due_")):
            return call

        def counted(*args: Any, **kw: Any) -> Any:
            self.calls.setdefault(name, []).append(kw.get("cursor"))
            return call(*args, **kw)

        return counted


@pytest.mark.parametrize("n", [0, 1, 3, 9, 10])
def test_each_walk_reads_each_page_once_and_stops(n: int) -> None:
    """n records, 3 a page: the walk reads the first page without a cursor,
    then each cursor once, never one twice, and ends after the page without
    one; the iterator then stays finished."""

    async def main() -> None:
        store = MemoryStateStore()
        tenant, inst, env = unique("t"), InstanceKey(unique("ns"), "i"), unique("env")
        for i in range(n):
            await store.put_session(SessionRecord(f"s{i}", tenant))
            await store.put_budget(BudgetRecord(tenant, f"b{i}", Caps(tokens_max=5)))
            await store.write_tray(inst.tray("t", f"x{i}"), 1, Tray(b"d", marked=True, env=env))
            await store.set_alarm(InstanceKey(env, f"i{i}"), 1, 10 + i)
        walks: Dict[str, Callable[[Any], AsyncIterator[Any]]] = {
            "list_sessions": lambda s: A.iter_sessions(s, tenant, limit=LIMIT),
            "list_budgets": lambda s: A.iter_budgets(s, tenant, limit=LIMIT),
            "list_trays": lambda s: A.iter_trays(s, inst, 1, limit=LIMIT),
            "marked_trays": lambda s: A.iter_marked_trays(s, env, limit=LIMIT),
            "due_alarms": lambda s: A.iter_due_alarms(s, 100, limit=LIMIT),
        }
        for name, walk in walks.items():
            counting = Counting(store)
            items = await drain(walk(counting))
            assert len(items) == n, (name, len(items))
            cursors = counting.calls[name]
            assert cursors[0] is None, (name, cursors)
            assert None not in cursors[1:] and len(set(cursors[1:])) == len(cursors) - 1, (name, cursors)
            # ceil(n / 3) pages, and perhaps one empty page after a full last one.
            assert -(-n // LIMIT) <= len(cursors) <= max(1, -(-n // LIMIT) + 1), (name, n, len(cursors))
            # The finished iterator reads nothing more.
            before = len(cursors)
            it = walk(counting)
            await drain(it)
            with pytest.raises(StopAsyncIteration):
                await it.__anext__()
            assert len(counting.calls[name]) == 2 * before

    asyncio.run(main())


def test_the_default_page_is_a_hundred_and_the_walk_goes_past_it() -> None:
    async def main() -> None:
        store = MemoryStateStore()
        tenant = unique("t")
        for i in range(250):
            await store.put_session(SessionRecord(f"s{i:03}", tenant))
        counting = Counting(store)
        seen = [s.session_id for s in await drain(A.iter_sessions(counting, tenant))]
        assert sorted(seen) == [f"s{i:03}" for i in range(250)] and len(counting.calls["list_sessions"]) == 3

    asyncio.run(main())


def test_a_session_walk_while_others_write_sees_each_record_once() -> None:
    async def main() -> None:
        store = MemoryStateStore()
        tenant = unique("t")
        for i in range(N):
            await store.put_session(SessionRecord(f"m{i:02}", tenant))
        seen: List[str] = []
        async for s in A.iter_sessions(store, tenant, limit=LIMIT):
            seen.append(s.session_id)
            # Writes between the pages: new sessions on both sides of the
            # walk's position, and updates of ones already seen.
            await store.put_session(SessionRecord(f"a{len(seen):02}", tenant))
            await store.put_session(SessionRecord(f"z{len(seen):02}", tenant))
            got = await store.get_session(A.SessionKey(tenant, seen[0]))
            assert got is not None
            got.metadata = {"n": str(len(seen))}
            await store.put_session(got)
        originals = [x for x in seen if x.startswith("m")]
        assert sorted(originals) == [f"m{i:02}" for i in range(N)], seen
        assert len(seen) == len(set(seen)), "a session was visited twice"

    asyncio.run(main())


def test_a_tray_walk_by_a_fenced_holder_stops_with_fence_lost() -> None:
    async def main() -> None:
        store = MemoryStateStore()
        inst = InstanceKey(unique("ns"), "i")
        await store.apply_batch(inst, 1, [TrayOp.put("t", f"x{i:02}", Tray(b"d")) for i in range(N)])
        it = A.iter_trays(store, inst, 1, limit=LIMIT)
        first = [await it.__anext__() for _ in range(LIMIT)]
        assert [k.tray_id for k, _ in first] == ["x00", "x01", "x02"]
        await store.write_tray(inst.tray("t", "x00"), 2, Tray(b"new holder"))
        with pytest.raises(A.FenceLostError) as e:
            await it.__anext__()
        assert (e.value.caller_epoch, e.value.stored_epoch) == (1, 2)

    asyncio.run(main())


def test_iterators_are_exported() -> None:
    for name in ("iter_runs", "iter_sessions", "iter_trays", "iter_marked_trays", "iter_due_alarms", "iter_budgets"):
        assert name in A.__all__ and callable(getattr(A, name))
