"""The change feed from Python (rules F1-F9): changes, wait_changes,
feed_head, prune_changes and the watch iterator, on every backend
(memory, file, PostgreSQL, Redis)."""

from __future__ import annotations

import asyncio
import copy
import pickle
import threading
import time
import uuid
from typing import Any, Awaitable, Callable, List

import pytest

import agentstate_rs as A
from agentstate_rs import (
    Change,
    ChangePage,
    FeedScope,
    FileStateStore,
    InstanceKey,
    MemoryStateStore,
    PostgresStateStore,
    RedisStateStore,
    RunKey,
    RunRecord,
    SessionKey,
    SessionRecord,
    StateDelta,
    StateFeedPrunedError,
    StateInvalidError,
    Tray,
    TrayKey,
)


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


@pytest.fixture(params=["memory", "file", "postgres", "redis"])
def store_factory(request: Any, tmp_path: Any) -> Callable[[], Any]:
    """A store of each backend (a fresh PostgreSQL schema, a Redis database
    of this file's own)."""
    kind = request.param
    if kind == "memory":
        return MemoryStateStore
    if kind == "file":
        return lambda: FileStateStore(str(tmp_path / "store"))
    if kind == "postgres":
        dsn = request.getfixturevalue("pg_dsn")
        schema = "py_feed_" + uuid.uuid4().hex[:12]
        return lambda: PostgresStateStore(dsn, schema=schema, pool_size=4)
    url = request.getfixturevalue("redis_server").url(6)
    return lambda: RedisStateStore(url)


def run(factory: Callable[[], Any], body: Callable[[Any], Awaitable[None]]) -> None:
    async def main() -> None:
        store = factory()
        await store.setup()
        try:
            await body(store)
        finally:
            await store.close()

    asyncio.run(main())


async def read_all(store: Any, scope: FeedScope, after: Any, limit: int = 100) -> List[Change]:
    """Every change after `after`, page after page, to the end of the feed."""
    out: List[Change] = []
    while True:
        page = await store.changes(scope, after, limit)
        assert page.next >= (after or 0)
        if not page.changes:
            assert page.next == (after or 0), "an empty page moves nowhere"
            return out
        out.extend(page.changes)
        after = page.next
        assert len(out) < 10_000


# --- F1: level-triggered, tombstones ------------------------------------------


def test_a_record_written_five_times_is_read_once_at_its_latest_version(store_factory: Callable[[], Any]) -> None:
    async def body(store: Any) -> None:
        tenant = unique("feed")
        scope = FeedScope.tenant(tenant)
        head = await store.feed_head(scope)
        assert isinstance(head, int) and head >= 0
        r = await store.put_run(RunRecord(run_id="r1", tenant=tenant, agent_name="planner"))
        for _ in range(4):
            r = await store.patch_run(r.key, StateDelta(iterations=1))
        assert r.version == 5
        s = await store.put_session(SessionRecord("s1", tenant, metadata={"a": "1"}))

        page = await store.changes(scope, head)
        assert isinstance(page, ChangePage)
        assert [c.kind for c in page.changes] == ["run", "session"], page.changes
        run_change, session_change = page.changes
        assert run_change.key == RunKey(tenant, "r1") and not run_change.deleted
        assert run_change.run is not None and run_change.run.version == 5 and run_change.run.iterations == 4
        assert run_change.record is run_change.run and run_change.session is None
        assert session_change.key == s.key and session_change.session is not None
        assert session_change.session.metadata == {"a": "1"}
        assert head < run_change.position < session_change.position == page.next
        # Nothing after the last change; from the start the same two.
        assert len(await store.changes(scope, page.next)) == 0
        assert [c.key for c in await read_all(store, scope, None)] == [run_change.key, session_change.key]
        # One more write moves the run after the session, still once.
        await store.patch_run(r.key, StateDelta(iterations=1))
        again = await read_all(store, scope, head)
        assert [c.kind for c in again] == ["session", "run"]
        assert again[1].run is not None and again[1].run.version == 6
        assert again[1].position > page.next

    run(store_factory, body)


def test_deletes_are_tombstones(store_factory: Callable[[], Any]) -> None:
    async def body(store: Any) -> None:
        tenant = unique("feed")
        scope = FeedScope.tenant(tenant)
        head = await store.feed_head(scope)
        await store.put_session(SessionRecord("s1", tenant))
        await store.put_run(RunRecord(run_id="r1", tenant=tenant, agent_name="p", session_id="s1"))
        deleted = await store.delete_session(SessionKey(tenant, "s1"), cascade=True)
        assert deleted == [RunKey(tenant, "r1")]
        changes = await read_all(store, scope, head)
        assert sorted(c.kind for c in changes) == ["run_deleted", "session_deleted"], changes
        for c in changes:
            assert c.deleted and c.record is None and c.run is None and c.session is None
        assert {c.key for c in changes} == {RunKey(tenant, "r1"), SessionKey(tenant, "s1")}

        # Trays and alarms: the trays feed (one env's, and the whole store's).
        env, ns = unique("env"), unique("ns")
        tscope, all_trays = FeedScope.trays(env=env), FeedScope.trays()
        thead, ahead = await store.feed_head(tscope), await store.feed_head(all_trays)
        inst = InstanceKey(ns, "i1")
        await store.write_tray(inst.tray("t", "x"), 1, Tray(b"doc", marked=True, env=env))
        await store.set_alarm(inst, 1, 1_000)
        tray_changes = await read_all(store, tscope, thead)
        assert [c.kind for c in tray_changes] == ["tray"]
        assert tray_changes[0].key == TrayKey(ns, "i1", "t", "x")
        assert tray_changes[0].tray is not None and tray_changes[0].tray.doc == b"doc" and tray_changes[0].tray.marked
        await store.delete_tray(inst.tray("t", "x"), 1)
        assert await store.ack_alarm(inst, 1, 1_000)
        tray_changes = await read_all(store, tscope, thead)
        assert [(c.kind, c.deleted) for c in tray_changes] == [("tray_deleted", True)]
        mine = [c for c in await read_all(store, all_trays, ahead) if c.key in (inst, inst.tray("t", "x"))]
        assert sorted(c.kind for c in mine) == ["alarm_deleted", "tray_deleted"], mine

    run(store_factory, body)


def test_alarm_changes_carry_the_alarm(store_factory: Callable[[], Any]) -> None:
    async def body(store: Any) -> None:
        scope = FeedScope.trays()
        head = await store.feed_head(scope)
        inst = InstanceKey(unique("ns"), "i")
        await store.set_alarm(inst, 1, 4_242)
        mine = [c for c in await read_all(store, scope, head) if c.key == inst]
        assert [c.kind for c in mine] == ["alarm"]
        assert mine[0].alarm is not None and mine[0].alarm.due_at == 4_242 and mine[0].alarm.instance == inst

    run(store_factory, body)


# --- F2: paging ----------------------------------------------------------------


def test_paging_with_next_reads_every_change_once(store_factory: Callable[[], Any]) -> None:
    async def body(store: Any) -> None:
        tenant = unique("feed")
        scope = FeedScope.tenant(tenant)
        head = await store.feed_head(scope)
        for i in range(7):
            await store.put_run(RunRecord(run_id=f"r{i}", tenant=tenant, agent_name="p"))
        sizes, seen, after = [], [], head
        while True:
            page = await store.changes(scope, after, limit=3)
            if not page.changes:
                assert page.next == after
                break
            sizes.append(len(page))
            assert page.next == page.changes[-1].position
            seen.extend(page)
            after = page.next
        assert sizes == [3, 3, 1]
        positions = [c.position for c in seen]
        assert positions == sorted(set(positions)) and positions[0] > head
        assert [c.key.run_id for c in seen if isinstance(c.key, RunKey)] == [f"r{i}" for i in range(7)]
        # Any page size reads the same changes.
        assert [c.position for c in await read_all(store, scope, head, limit=100)] == positions
        assert [c.position for c in await read_all(store, scope, head, limit=1)] == positions

    run(store_factory, body)


# --- F3: scopes ----------------------------------------------------------------


def test_tenants_feeds_are_separate(store_factory: Callable[[], Any]) -> None:
    async def body(store: Any) -> None:
        t1, t2 = unique("feed-a"), unique("feed-b")
        s1, s2, trays = FeedScope.tenant(t1), FeedScope.tenant(t2), FeedScope.trays()
        h1, h2, ht = await store.feed_head(s1), await store.feed_head(s2), await store.feed_head(trays)
        await store.put_run(RunRecord(run_id="same", tenant=t1, agent_name="p"))
        await store.put_run(RunRecord(run_id="same", tenant=t2, agent_name="p"))
        await store.put_session(SessionRecord("only-b", t2))
        one = await read_all(store, s1, h1)
        two = await read_all(store, s2, h2)
        assert [c.key for c in one] == [RunKey(t1, "same")]
        assert [c.key for c in two] == [RunKey(t2, "same"), SessionKey(t2, "only-b")]
        assert all(isinstance(c.key, (TrayKey, InstanceKey)) for c in await read_all(store, trays, ht))

    run(store_factory, body)


# --- F5: waiting ---------------------------------------------------------------


def test_wait_changes_is_woken_by_a_write_and_empty_at_its_timeout(store_factory: Callable[[], Any]) -> None:
    async def body(store: Any) -> None:
        tenant = unique("feed")
        scope = FeedScope.tenant(tenant)
        head = await store.feed_head(scope)

        # Empty at the timeout, next == after.
        t0 = time.monotonic()
        page = await store.wait_changes(scope, head, timeout=0.3)
        waited = time.monotonic() - t0
        assert len(page) == 0 and page.next == head
        assert 0.2 <= waited < 10, waited

        # Woken by a write from another task, long before its timeout.
        async def write_later() -> None:
            await asyncio.sleep(0.3)
            await store.put_run(RunRecord(run_id="wake", tenant=tenant, agent_name="p"))

        writer = asyncio.create_task(write_later())
        t0 = time.monotonic()
        page = await store.wait_changes(scope, head, timeout=30)
        waited = time.monotonic() - t0
        await writer
        assert [c.key for c in page.changes] == [RunKey(tenant, "wake")]
        assert waited < 15, f"woken after {waited:.1f}s"
        # Answers at once when something is already after `after`.
        t0 = time.monotonic()
        again = await store.wait_changes(scope, head, timeout=30)
        assert [c.position for c in again.changes] == [c.position for c in page.changes]
        assert time.monotonic() - t0 < 5

    run(store_factory, body)


# --- watch ---------------------------------------------------------------------


def test_watch_yields_changes_and_a_cancelled_async_for_stops_cleanly(store_factory: Callable[[], Any]) -> None:
    async def body(store: Any) -> None:
        tenant = unique("feed")
        scope = FeedScope.tenant(tenant)
        head = await store.feed_head(scope)
        feed = store.watch(scope, head)
        assert feed.position == head and feed.scope == scope
        got: List[Change] = []
        three = asyncio.Event()

        async def consume() -> None:
            async for change in feed:
                got.append(change)
                if len(got) == 3:
                    three.set()

        consumer = asyncio.create_task(consume())
        await asyncio.sleep(0.2)  # the consumer is waiting
        for i in range(3):
            await store.put_run(RunRecord(run_id=f"w{i}", tenant=tenant, agent_name="p"))
        await asyncio.wait_for(three.wait(), timeout=30)
        assert [c.key for c in got] == [RunKey(tenant, f"w{i}") for i in range(3)]
        assert feed.position == got[-1].position

        # Cancelled while it waits for the next change: it stops, at once.
        await asyncio.sleep(0.2)
        consumer.cancel()
        t0 = time.monotonic()
        with pytest.raises(asyncio.CancelledError):
            await consumer
        assert time.monotonic() - t0 < 2
        assert feed.position == got[-1].position, "a cancelled watch lost or skipped nothing"

        # The same watch goes on from where it was; so does a new one from its position.
        await store.put_run(RunRecord(run_id="w3", tenant=tenant, agent_name="p"))
        nxt = await asyncio.wait_for(feed.__anext__(), timeout=30)
        assert nxt.key == RunKey(tenant, "w3") and nxt.position > got[-1].position
        resumed = store.watch(scope, after=got[-1].position)
        again = await asyncio.wait_for(resumed.__anext__(), timeout=30)
        assert again.key == nxt.key and again.position == nxt.position

    run(store_factory, body)


def test_watch_cancelled_by_a_timeout_many_times_loses_nothing(store_factory: Callable[[], Any]) -> None:
    """Steps cancelled half-way, while writes land: every change is handed
    out once, in order."""

    async def body(store: Any) -> None:
        tenant = unique("feed")
        scope = FeedScope.tenant(tenant)
        feed = store.watch(scope, await store.feed_head(scope))
        seen: List[str] = []
        n = 8
        for i in range(n):
            await store.put_run(RunRecord(run_id=f"c{i}", tenant=tenant, agent_name="p"))
            for _ in range(3):
                try:
                    c = await asyncio.wait_for(feed.__anext__(), timeout=0.01)
                except asyncio.TimeoutError:
                    continue
                seen.append(c.key.run_id)
        while len(seen) < n:
            c = await asyncio.wait_for(feed.__anext__(), timeout=30)
            seen.append(c.key.run_id)
        assert seen == [f"c{i}" for i in range(n)]

    run(store_factory, body)


# --- F6: pruning ---------------------------------------------------------------


def test_a_position_before_the_pruned_tombstones_is_feed_pruned(store_factory: Callable[[], Any]) -> None:
    async def body(store: Any) -> None:
        tenant = unique("feed")
        scope = FeedScope.tenant(tenant)
        head = await store.feed_head(scope)
        await store.put_session(SessionRecord("gone", tenant))
        await store.put_session(SessionRecord("kept", tenant))
        await store.delete_session(SessionKey(tenant, "gone"))
        changes = await read_all(store, scope, head)
        through = changes[-1].position
        assert changes[-1].kind == "session_deleted"
        assert await store.prune_changes(scope, through) == 1

        with pytest.raises(StateFeedPrunedError) as e:
            await store.changes(scope, head)
        assert isinstance(e.value, A.StateError)
        assert e.value.scope == scope and e.value.horizon == through
        assert str(through) in str(e.value)
        # Re-list, then follow on from the horizon.
        assert len(await store.changes(scope, e.value.horizon)) == 0
        # So is the start; the re-listing finds the record that exists.
        with pytest.raises(StateFeedPrunedError):
            await store.changes(scope)
        assert [x.session_id for x in (await store.list_sessions(tenant)).items] == ["kept"]
        # A watch from before the horizon raises it once, then ends.
        feed = store.watch(scope, head)
        with pytest.raises(StateFeedPrunedError):
            await asyncio.wait_for(feed.__anext__(), timeout=30)
        with pytest.raises(StopAsyncIteration):
            await feed.__anext__()
        # The error pickles with its scope and horizon.
        back = pickle.loads(pickle.dumps(e.value))
        assert type(back) is StateFeedPrunedError and (back.scope, back.horizon) == (scope, through)

    run(store_factory, body)


# --- the blocking facade -------------------------------------------------------


def test_the_sync_facade_reads_waits_and_watches(store_factory: Callable[[], Any]) -> None:
    store = store_factory()
    s = store.sync()
    try:
        s.setup()
        tenant = unique("feed")
        scope = FeedScope.tenant(tenant)
        head = s.feed_head(scope)
        s.put_run(RunRecord(run_id="r", tenant=tenant, agent_name="p"))
        page = s.changes(scope, head)
        assert [c.kind for c in page.changes] == ["run"]
        assert len(s.wait_changes(scope, page.next, timeout=0.1)) == 0

        def write_later() -> None:
            time.sleep(0.5)
            store.sync().put_session(SessionRecord("s", tenant))

        feed = s.watch(scope, head)
        assert next(feed).key == RunKey(tenant, "r")
        writer = threading.Thread(target=write_later)
        writer.start()
        change = next(feed)
        writer.join()
        assert change.key == SessionKey(tenant, "s") and feed.position == change.position
        assert s.prune_changes(scope, change.position) == 0
    finally:
        s.close()


# --- arguments (F8), positions (F9), the classes -------------------------------


def test_closing_the_store_ends_its_watches_with_closed() -> None:
    async def main() -> None:
        store = MemoryStateStore()
        scope = FeedScope.tenant(unique("feed"))
        feed = store.watch(scope)
        await store.put_session(SessionRecord("s", scope.name or ""))
        assert (await asyncio.wait_for(feed.__anext__(), timeout=30)).kind == "session"
        await store.close()
        with pytest.raises(A.StateClosedError):
            await feed.__anext__()
        with pytest.raises(A.StateClosedError):
            store.watch(scope)

    asyncio.run(main())


def test_bad_arguments_are_invalid() -> None:
    async def main() -> None:
        store = MemoryStateStore()
        scope = FeedScope.tenant("acme")
        for bad in (
            lambda: store.changes(scope, None, 0),
            lambda: store.changes(scope, None, 1_001),
            lambda: store.changes(scope, -1),
            lambda: store.changes(scope, 2**128),
            lambda: store.changes(scope, "12"),
            lambda: store.wait_changes(scope, timeout=-1.0),
            lambda: store.wait_changes(scope, timeout=601.0),
            lambda: store.changes(FeedScope.tenant("")),
            lambda: store.prune_changes(FeedScope.trays(env="prod"), 1),
        ):
            with pytest.raises(StateInvalidError):
                await bad()
        with pytest.raises(StateInvalidError):
            store.watch(scope, after=-5)
        with pytest.raises(StateInvalidError):
            FeedScope("tenant")
        with pytest.raises(StateInvalidError):
            FeedScope("runs", "x")

    asyncio.run(main())


def test_positions_are_exact_ints_past_two_to_the_64() -> None:
    async def main() -> None:
        store = MemoryStateStore()
        scope = FeedScope.tenant("acme")
        await store.put_run(RunRecord(run_id="r", tenant="acme", agent_name="p"))
        # A position carries its scope's tag in its top bits (F9): an int
        # past 2**96, exact, and taken back as it was handed out.
        page = await store.changes(scope)
        far = page.next
        assert type(far) is int and 2**96 < far < 2**128
        assert far == page.changes[0].position == await store.feed_head(scope)
        again = await store.changes(scope, far)
        assert len(again) == 0 and again.next == far and type(again.next) is int
        other = FeedScope.tenant("other")
        assert (await store.changes(other, 0)).next == 0 == (await store.changes(other)).next
        assert (await store.changes(scope, 0)).next == far

    asyncio.run(main())


# --- F9: positions belong to their scope and store -----------------------------


def test_f9_a_foreign_position_is_invalid(store_factory: Callable[[], Any]) -> None:
    async def body(store: Any) -> None:
        a, b = unique("feed-a"), unique("feed-b")
        sa, sb = FeedScope.tenant(a), FeedScope.tenant(b)
        env_a, env_b = FeedScope.trays(env=unique("env-a")), FeedScope.trays(env=unique("env-b"))
        await store.put_run(RunRecord(run_id="r", tenant=a, agent_name="p"))
        await store.put_run(RunRecord(run_id="r", tenant=b, agent_name="p"))
        page = await store.changes(sa)
        theirs = [page.changes[0].position, page.next, await store.feed_head(sa)]
        foreign = [(p, sb) for p in theirs] + [
            (p, s) for p in [await store.feed_head(FeedScope.trays()), await store.feed_head(env_a)] for s in (sa, env_b)
        ]
        # Forged: hand-made ints, and a real position with a bit of its
        # tag (its top 32 bits) flipped.
        foreign += [(p, sa) for p in (1, 2**64, 2**100 + 7, 2**128 - 1, theirs[0] ^ (1 << 127))]
        for position, scope in foreign:
            for call in (
                lambda: store.changes(scope, position),
                lambda: store.wait_changes(scope, position, timeout=0.1),
            ):
                with pytest.raises(StateInvalidError) as e:
                    await call()
                assert isinstance(e.value, A.StateError)
                assert "not one this store handed out" in str(e.value)
            # (An env's feed is never pruned on its own: Invalid either way.)
            with pytest.raises(StateInvalidError):
                await store.prune_changes(scope, position)
        # A watch from a foreign position raises it, then ends.
        feed = store.watch(sb, theirs[0])
        with pytest.raises(StateInvalidError):
            await asyncio.wait_for(feed.__anext__(), timeout=30)
        # Nothing was read past or pruned; the start and a feed's own
        # positions work everywhere.
        assert [c.key for c in (await store.changes(sb)).changes] == [RunKey(b, "r")]
        for scope in (sa, sb, env_a, env_b, FeedScope.trays()):
            await store.changes(scope, 0)
        assert len(await store.changes(sa, theirs[0])) == 0

    run(store_factory, body)


def test_f9_a_position_of_one_store_is_invalid_on_another(tmp_path: Any) -> None:
    async def main() -> None:
        one, two = MemoryStateStore(), FileStateStore(str(tmp_path / "two"))
        scope = FeedScope.tenant("acme")
        for s in (one, two):
            await s.put_run(RunRecord(run_id="r", tenant="acme", agent_name="p"))
        mine = (await one.changes(scope)).next
        with pytest.raises(StateInvalidError):
            await two.changes(scope, mine)
        with pytest.raises(StateInvalidError):
            await MemoryStateStore().changes(scope, mine)
        assert len(await one.changes(scope, mine)) == 0
        await two.close()

    asyncio.run(main())


def test_calls_made_outside_a_running_loop_are_deferred() -> None:
    store = MemoryStateStore()
    scope = FeedScope.tenant("acme")
    asyncio.run(store.put_run(RunRecord(run_id="r", tenant="acme", agent_name="p")))
    page = asyncio.run(store.changes(scope, after=None, limit=10))
    assert [c.kind for c in page.changes] == ["run"]
    assert asyncio.run(store.feed_head(scope)) >= page.next


def test_scopes_changes_and_pages_have_readable_reprs_and_scopes_pickle() -> None:
    t, trays, env = FeedScope.tenant("acme"), FeedScope.trays(), FeedScope.trays(env="prod")
    assert (repr(t), repr(trays), repr(env)) == ('FeedScope.tenant("acme")', "FeedScope.trays()", 'FeedScope.trays(env="prod")')
    assert (t.kind, t.name, trays.kind, trays.name, env.kind, env.name) == ("tenant", "acme", "trays", None, "trays", "prod")
    assert str(t) == 'tenant "acme"'
    assert FeedScope("tenant", "acme") == t and FeedScope("trays") == trays and FeedScope("trays", "prod") == env
    assert len({t, FeedScope.tenant("acme"), trays, env}) == 3
    for scope in (t, trays, env):
        assert pickle.loads(pickle.dumps(scope)) == scope and copy.deepcopy(scope) == scope

    async def main() -> None:
        store = MemoryStateStore()
        await store.put_run(RunRecord(run_id="r", tenant="acme", agent_name="p"))
        page = await store.changes(t)
        c = page.changes[0]
        assert repr(c) == f'Change(position={c.position}, kind="run", key=RunKey(tenant="acme", run_id="r"), version=1)'
        assert repr(page) == f"ChangePage(changes=<1 changes>, next={page.next})"
        assert "ChangeStream(scope=FeedScope.tenant(\"acme\"), position=0)" == repr(store.watch(t))
        assert list(page) == page.changes

    asyncio.run(main())


def test_the_feed_names_are_exported() -> None:
    for name in ("FeedScope", "Change", "ChangePage", "ChangeStream", "SyncChangeStream", "StateFeedPrunedError"):
        assert name in A.__all__ and getattr(A, name) is not None
    assert issubclass(StateFeedPrunedError, A.StateError)
