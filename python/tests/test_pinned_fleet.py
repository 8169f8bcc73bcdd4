"""A mixed fleet on one PostgreSQL database: pinned's own
``pinned.durability.postgres.PostgresStateStore`` and agentstate's
``PostgresStateStore`` share pinned's tables (``pinned_epoch``,
``pinned_tray_index``).

Either sets the database up first (or both at once); each reads back as
the same dict what the other wrote (set_tray, apply_batch, deletes); an
epoch stored by one fences the other, both ways, with pinned's FenceLost;
``list`` with every filter answers the same rows from both; the env and
hostname each stamps land in pinned's columns; and a real pinned app
moves from one implementation to the other and back (generation 1 on
pinned's store, 2 on agentstate's, 3 on pinned's again) with the marked
trays rehydrating each time and the old epochs fenced.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from typing import Any, AsyncIterator, Awaitable, Callable, List, Tuple

import pytest
from pinned.durability.postgres import PostgresStateStore as PinnedPostgres
from pinned.testing import wake_until_ok

import agentstate_rs as A
from pinned_adapters import NS, JobsApp, close_pinned_pg, expect_fenced, fresh_database, generation, post_ok, sql, unique_id, until, until_durable

DOCS = [
    {},
    {"a": 1, "b": [1, 2, {"c": None}], "t": True, "f": False},
    {"text": "héllo ✓ \u2028 \"quoted\" \\ back", "emoji": "🦀", "nul-free": "x"},
    {"ratio": 0.1, "big": 2**53 + 1, "huge": 2**70, "neg": -7, "zero": 0.0, "one": 1.0, "small": 1.5e-7, "tiny": 5e-324},
    {"nested": {"deeper": {"deepest": [[], {}, [[1]]]}}, "~v": 3, "~inbox": [{"command": "delete"}]},
    {"z": 1, "a": 2, "m": {"y": 1, "b": 2}},
]

# Numbers PostgreSQL's jsonb writes back in another form (its numeric
# text never has an exponent, and has no -0): json.loads makes 1e300 and
# 1e16 ints, -0.0 is 0.0. Whatever each side then answers, both must
# answer the same for the same row.
JSONB_REWRITES = {"exp": 1e300, "e16": 1e16, "negzero": -0.0, "list": [1e22, -0.0, 2.5e-8]}


@pytest.fixture
def admin_dsn(pg_server: Any) -> str:
    return pg_server.dsn("postgres")


def _pair(dsn: str) -> Tuple[Any, Any]:
    return PinnedPostgres(dsn=dsn, pool_size=2), A.PostgresStateStore(dsn, pool_size=2)


async def _close(pinned: Any, mine: Any) -> None:
    await close_pinned_pg(pinned)
    await mine.close()


@contextlib.asynccontextmanager
async def _opened(dsn: str) -> AsyncIterator[Tuple[Any, Any]]:
    pinned, mine = _pair(dsn)
    try:
        yield pinned, mine
    finally:
        await _close(pinned, mine)


async def _both_read_alike(pinned: Any, mine: Any, id: str, epoch: int) -> list:
    """Every row of the instance reads the same from both, and so does the
    whole listing; answers the rows."""
    rows = await pinned.list(NS, id, epoch)
    assert await mine.list(NS, id, epoch) == rows
    for tray_ns, tray_id, marked, doc in rows:
        assert await mine.get_tray(NS, id, tray_ns, tray_id, epoch) == (marked, doc), (tray_ns, tray_id)
        assert await pinned.get_tray(NS, id, tray_ns, tray_id, epoch) == (marked, doc), (tray_ns, tray_id)
    return rows


async def _cross_check(pinned: Any, mine: Any) -> None:
    """Each writes, the other reads it back as the same dict."""
    id = unique_id("x")
    for n, doc in enumerate(DOCS):
        await pinned.set_tray(NS, id, "from_pinned", f"t{n}", n % 2 == 0, doc, 1)
        await mine.set_tray(NS, id, "from_agentstate", f"t{n}", n % 2 == 1, doc, 1)
    for n, doc in enumerate(DOCS):
        assert await mine.get_tray(NS, id, "from_pinned", f"t{n}", 1) == (n % 2 == 0, doc)
        assert await pinned.get_tray(NS, id, "from_agentstate", f"t{n}", 1) == (n % 2 == 1, doc)
        assert await mine.get_tray(NS, id, "from_agentstate", f"t{n}", 1) == (n % 2 == 1, doc)
    rows = await _both_read_alike(pinned, mine, id, 1)
    assert len(rows) == 2 * len(DOCS)


async def _setup_racing(pinned: Any, *mine: Any) -> int:
    """Sets pinned's store and agentstate's up at once. agentstate's setup
    never fails. pinned's setup (CREATE TABLE IF NOT EXISTS, no lock) can
    lose PostgreSQL's catalog race against any concurrent creator of the
    same table, its own kind included: then it raises UniqueViolation and
    a retry passes. Answers how many times pinned's setup lost."""
    import psycopg

    results = await asyncio.gather(pinned.setup(), *(m.setup() for m in mine), return_exceptions=True)
    for r in results[1:]:
        if isinstance(r, BaseException):
            raise r
    if results[0] is None:
        return 0
    assert isinstance(results[0], psycopg.errors.UniqueViolation), repr(results[0])
    await pinned.setup()
    return 1


@pytest.mark.parametrize("order", ["pinned_first", "agentstate_first", "both_at_once"])
def test_either_sets_the_database_up_first(admin_dsn: str, order: str) -> None:
    dsn = fresh_database(admin_dsn, "fleet_setup")

    async def main() -> None:
        pinned, mine = _pair(dsn)
        try:
            if order == "pinned_first":
                await pinned.setup()
                await mine.setup()
            elif order == "agentstate_first":
                await mine.setup()
                await pinned.setup()
            else:
                await _setup_racing(pinned, mine)
            # Setting up again, from either, changes nothing.
            await mine.setup()
            await pinned.setup()
            await _cross_check(pinned, mine)
        finally:
            await _close(pinned, mine)

    asyncio.run(main())
    # The tables are pinned's, as pinned makes them.
    columns = sql(
        dsn,
        "SELECT table_name, column_name, data_type, is_nullable FROM information_schema.columns "
        "WHERE table_schema = 'public' AND table_name IN ('pinned_epoch', 'pinned_tray_index') "
        "ORDER BY table_name, ordinal_position",
    )
    pinned_columns = [
        ("pinned_epoch", "ns", "text", "NO"),
        ("pinned_epoch", "id", "text", "NO"),
        ("pinned_epoch", "epoch", "bigint", "NO"),
        ("pinned_tray_index", "ns", "text", "NO"),
        ("pinned_tray_index", "id", "text", "NO"),
        ("pinned_tray_index", "tray_ns", "text", "NO"),
        ("pinned_tray_index", "tray_id", "text", "NO"),
        ("pinned_tray_index", "marked", "boolean", "NO"),
        ("pinned_tray_index", "doc", "jsonb", "NO"),
        ("pinned_tray_index", "env", "text", "NO"),
        ("pinned_tray_index", "hostname", "text", "NO"),
    ]
    assert [c for c in columns if c[1] in {p[1] for p in pinned_columns}] == pinned_columns
    # Whatever agentstate adds to pinned's table, pinned never has to write it.
    extra = [c for c in columns if c[0] == "pinned_tray_index" and c[1] not in {p[1] for p in pinned_columns}]
    assert all(c[3] == "YES" for c in extra), extra


def test_agentstates_setup_never_loses_the_race_on_a_fresh_database(admin_dsn: str) -> None:
    """A fleet's first deploy: both programs set an empty database up at
    once, many times over; agentstate's setup succeeds every time."""
    lost = 0
    for _ in range(int(os.environ.get("AGENTSTATE_PINNED_SETUP_RACES", "8"))):
        dsn = fresh_database(admin_dsn, "fleet_race")

        async def main() -> int:
            pinned, mine = _pair(dsn)
            other = A.PostgresStateStore(dsn, pool_size=1)
            try:
                n = await _setup_racing(pinned, mine, other)
                await _cross_check(pinned, mine)
                return n
            finally:
                await _close(pinned, mine)
                await other.close()

        lost += asyncio.run(main())
    print(f"pinned's own setup lost the catalog race {lost} time(s)")


@pytest.fixture
def fleet_dsn(admin_dsn: str) -> str:
    dsn = fresh_database(admin_dsn, "fleet")

    async def setup() -> None:
        pinned, mine = _pair(dsn)
        await pinned.setup()
        await mine.setup()
        await _close(pinned, mine)

    asyncio.run(setup())
    return dsn


def test_both_read_every_row_alike_whatever_jsonb_does_to_numbers(fleet_dsn: str) -> None:
    async def main() -> None:
        async with _opened(fleet_dsn) as (pinned, mine):
            id = unique_id("num")
            await pinned.set_tray(NS, id, "t", "by_pinned", False, JSONB_REWRITES, 1)
            await mine.set_tray(NS, id, "t", "by_agentstate", False, JSONB_REWRITES, 1)
            await mine.apply_batch(NS, id, [("tray", "t", "by_agentstate_batch", True, JSONB_REWRITES)], 1)
            await pinned.apply_batch(NS, id, [("tray", "t", "by_pinned_batch", True, JSONB_REWRITES)], 1)
            await _both_read_alike(pinned, mine, id, 1)

    asyncio.run(main())


def test_each_reads_what_the_other_wrote(fleet_dsn: str) -> None:
    async def main() -> None:
        async with _opened(fleet_dsn) as (pinned, mine):
            await _cross_check(pinned, mine)
            id = unique_id("rw")
            # Overwrites and deletes cross too, including a mark moving.
            await pinned.set_tray(NS, id, "t", "a", True, {"v": 1}, 4)
            await mine.set_tray(NS, id, "t", "a", False, {"v": 2}, 4)
            assert await pinned.get_tray(NS, id, "t", "a", 4) == (False, {"v": 2})
            await pinned.set_tray(NS, id, "t", "a", True, {"v": 3}, 4)
            assert await mine.get_tray(NS, id, "t", "a", 4) == (True, {"v": 3})
            await mine.delete_tray(NS, id, "t", "a", 4)
            assert await pinned.get_tray(NS, id, "t", "a", 4) is None
            await pinned.set_tray(NS, id, "t", "b", True, {"v": 4}, 4)
            await pinned.delete_tray(NS, id, "t", "b", 4)
            assert await mine.get_tray(NS, id, "t", "b", 4) is None
            # Deleting what is not there is idempotent on both.
            await mine.delete_tray(NS, id, "t", "b", 4)
            await pinned.delete_tray(NS, id, "t", "b", 4)
            # The stored epoch is one number for both.
            assert await mine.epoch(A.InstanceKey(NS, id)) == 4

    asyncio.run(main())


def test_an_epoch_stored_by_one_fences_the_other(fleet_dsn: str) -> None:
    async def main() -> None:
        async with _opened(fleet_dsn) as (pinned, mine):
            for first, second, name in ((mine, pinned, "agentstate fences pinned"), (pinned, mine, "pinned fences agentstate")):
                id = unique_id("fence")
                await first.set_tray(NS, id, "t", "a", True, {"owner": name}, 5)
                calls: List[Callable[[], Awaitable[Any]]] = [
                    lambda: second.set_tray(NS, id, "t", "a", False, {"stale": True}, 4),
                    lambda: second.delete_tray(NS, id, "t", "a", 4),
                    lambda: second.get_tray(NS, id, "t", "a", 4),
                    lambda: second.list(NS, id, 4),
                    lambda: second.list(NS, id, 4, tray_ns="t", marked=True),
                    lambda: second.apply_batch(NS, id, [("tray", "t", "a", None, None)], 4),
                ]
                for call in calls:
                    fenced = await expect_fenced(call())
                    assert (fenced.key, fenced.epoch) == (f"{NS}/{id}", 4), name
                assert await first.get_tray(NS, id, "t", "a", 5) == (True, {"owner": name}), name
                # At the stored epoch the other is the owner; above it, it takes over
                # and fences the first.
                assert await second.get_tray(NS, id, "t", "a", 5) == (True, {"owner": name})
                await second.set_tray(NS, id, "t", "a", False, {"owner": "second"}, 6)
                await expect_fenced(first.set_tray(NS, id, "t", "a", True, {"owner": "first"}, 5))
                await expect_fenced(first.apply_batch(NS, id, [("tray", "t", "b", True, {})], 5))
                assert await first.list(NS, id, 6) == [("t", "a", False, {"owner": "second"})]
                assert sql(fleet_dsn, "SELECT epoch FROM pinned_epoch WHERE ns = %s AND id = %s", (NS, id)) == [(6,)]

    asyncio.run(main())


def test_list_with_filters_agrees(fleet_dsn: str) -> None:
    async def main() -> None:
        async with _opened(fleet_dsn) as (pinned, mine):
            id = unique_id("list")
            rows = [
                ("jobs", "b", True), ("jobs", "a", False), ("jobs", "B", True), ("jobs", "é", False),
                ("notes", "~", False), ("kwork", "k2", True), ("kwork", "k10", True), ("Jobs", "a", True),
            ]
            for n, (tray_ns, tray_id, marked) in enumerate(rows):
                writer = pinned if n % 2 else mine
                await writer.set_tray(NS, id, tray_ns, tray_id, marked, {"n": n}, 2)
            filters = [{}] + [
                {k: v for k, v in (("tray_ns", t), ("marked", m)) if v is not None}
                for t in (None, "jobs", "kwork", "Jobs", "absent")
                for m in (None, True, False)
            ]
            for f in filters:
                theirs = await pinned.list(NS, id, 2, **f)
                ours = await mine.list(NS, id, 2, **f)
                assert ours == theirs, f
                assert [r[:2] for r in ours] == sorted(r[:2] for r in ours), f
            assert len(await mine.list(NS, id, 2)) == len(rows)
            for bad in ({"tray_ns": 1}, {"marked": 1}, {"marked": "yes"}):
                with pytest.raises(TypeError):
                    await pinned.list(NS, id, 2, **bad)
                with pytest.raises(TypeError):
                    await mine.list(NS, id, 2, **bad)

    asyncio.run(main())


def test_apply_batch_from_each(fleet_dsn: str) -> None:
    async def main() -> None:
        async with _opened(fleet_dsn) as (pinned, mine):
            for writer, reader in ((pinned, mine), (mine, pinned)):
                id = unique_id("batch")
                await writer.set_tray(NS, id, "t", "gone", True, {"x": 0}, 1)
                await writer.apply_batch(
                    NS,
                    id,
                    [
                        ("tray", "t", "a", True, {"a": [1]}),
                        ("tray", "t", "b", False, {"b": {"c": "d"}}),
                        ("tray", "t", "gone", None, None),
                        ("tray", "t", "a", False, {"a": [1, 2]}),  # the last write of a row wins
                    ],
                    2,
                )
                assert await reader.list(NS, id, 2) == [("t", "a", False, {"a": [1, 2]}), ("t", "b", False, {"b": {"c": "d"}})]
                assert await mine.epoch(A.InstanceKey(NS, id)) == 2
                # An unknown op is refused, and on PostgreSQL nothing of the batch lands.
                for store in (pinned, mine):
                    with pytest.raises(ValueError):
                        await store.apply_batch(NS, id, [("tray", "t", "c", True, {}), ("alarm", 1)], 2)
                    assert await reader.get_tray(NS, id, "t", "c", 2) is None
                # A batch at a stale epoch is fenced, whoever stored the epoch.
                await expect_fenced(reader.apply_batch(NS, id, [("tray", "t", "d", True, {})], 1))

    asyncio.run(main())


def test_env_and_hostname_stamps_land_in_pinneds_columns(fleet_dsn: str) -> None:
    async def main() -> None:
        pinned = PinnedPostgres(dsn=fleet_dsn, pool_size=1, env="prod", hostname="pod-p")
        mine = A.PostgresStateStore(fleet_dsn, pool_size=1, env="prod", hostname="pod-a")
        try:
            await _stamps(pinned, mine)
        finally:
            await _close(pinned, mine)

    async def _stamps(pinned: Any, mine: Any) -> None:
        id = unique_id("stamp")
        await pinned.set_tray(NS, id, "t", "p", True, {}, 1)
        await mine.set_tray(NS, id, "t", "a", True, {}, 1)
        await mine.apply_batch(NS, id, [("tray", "t", "b", True, {})], 1)
        got = sql(fleet_dsn, "SELECT tray_id, env, hostname FROM pinned_tray_index WHERE id = %s ORDER BY tray_id", (id,))
        assert got == [("a", "prod", "pod-a"), ("b", "prod", "pod-a"), ("p", "prod", "pod-p")]
        # agentstate's sweeper view sees pinned's marked rows with pinned's stamps.
        marked = {m.key.tray_id: (m.env, m.hostname) async for m in A.iter_marked_trays(mine, "prod") if m.key.id == id}
        assert marked == {"a": ("prod", "pod-a"), "b": ("prod", "pod-a"), "p": ("prod", "pod-p")}

    asyncio.run(main())


async def _generation(store: Any, id: str, epoch: int, *, expect_live: List[str], previous: Any, stale: int) -> None:
    """One generation of JobsApp at ``epoch``: the lanes marked by the
    previous generation come back on their own, work drains, a lane is
    left held (marked) for the next generation, and the previous owner's
    store is fenced at its epoch."""
    base = f"{NS}/{id}"
    JobsApp.gate = asyncio.Event()
    try:
        async with generation(store, epoch) as (host, client):
            await wake_until_ok(client, f"{base}/_wake")
            record = await host.directory.get(id)
            assert sorted(record.instance.jobs.instances) == expect_live, epoch
            if previous is not None:
                await expect_fenced(previous.set_tray(NS, id, "probe", "p", False, {}, stale))
                await expect_fenced(previous.list(NS, id, stale))
            JobsApp.gate.set()
            await post_ok(client, f"{base}/join", {"keys": expect_live})
            for n in range(epoch * 10, epoch * 10 + 3):
                await post_ok(client, f"{base}/enqueue", {"key": "done", "n": n})
            await post_ok(client, f"{base}/join", {"keys": ["done"]})
            JobsApp.gate = asyncio.Event()
            JobsApp.held = []
            await post_ok(client, f"{base}/enqueue", {"key": f"held{epoch}", "n": epoch * 10 + 9, "hold": True})
            await until(lambda: JobsApp.held == [epoch * 10 + 9])  # its delivery started
            await until_durable(store, id, f"held{epoch}", epoch, attempts=1)  # and is counted
    finally:
        JobsApp.gate = None


def test_a_pinned_app_moves_between_the_two_stores(fleet_dsn: str) -> None:
    async def main() -> None:
        id = unique_id("move")
        async with _opened(fleet_dsn) as (pinned, mine):
            await _generation(pinned, id, 1, expect_live=[], previous=None, stale=0)
            await _generation(mine, id, 2, expect_live=["held1"], previous=pinned, stale=1)
            await _generation(pinned, id, 3, expect_live=["held2"], previous=mine, stale=2)
            await _generation(mine, id, 4, expect_live=["held3"], previous=pinned, stale=3)
            # What the four generations did, read by both.
            rows = await mine.list(NS, id, 4)
            assert rows == await pinned.list(NS, id, 4)
            by = {(t, i): (m, d) for t, i, m, d in rows}
            assert [e["n"] for e in by[("jobs", "done")][1]["log"]] == [10, 11, 12, 20, 21, 22, 30, 31, 32, 40, 41, 42]
            for epoch in (1, 2, 3):
                marked, doc = by[("jobs", f"held{epoch}")]
                assert not marked and doc["log"] == [{"n": epoch * 10 + 9, "attempts": 2}], doc
            assert by[("jobs", "held4")][0] is True

    asyncio.run(main())
