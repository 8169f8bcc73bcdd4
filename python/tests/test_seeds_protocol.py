"""The seeds' tray protocol (pinned's ``StateStore``) on every store of the
package: ``set_tray``, ``get_tray``, ``delete_tray``, ``list`` and
``apply_batch`` with pinned's arguments, dict docs, any int as an epoch,
and the exception pinned's ``except FenceLost`` catches. Then what makes
the memory and file stores usable on a virtual clock: their awaitables
are finished when returned, and awaiting one takes no loop iteration."""

from __future__ import annotations

import asyncio
import json
import pickle
import subprocess
import sys
import textwrap
import uuid
from typing import Any, Awaitable, Callable

import pytest

import agentstate_rs as A
from agentstate_rs import (
    FenceLostError,
    FileStateStore,
    InstanceKey,
    MemoryStateStore,
    PostgresStateStore,
    RedisStateStore,
    StateInvalidError,
    Tray,
    TrayOp,
)


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


@pytest.fixture(params=["memory", "file", "postgres", "redis"])
def store_factory(request: Any, tmp_path: Any) -> Callable[..., Any]:
    kind = request.param
    if kind == "memory":
        return MemoryStateStore
    if kind == "file":
        return lambda **kw: FileStateStore(str(tmp_path / "store"), **kw)
    if kind == "postgres":
        dsn = request.getfixturevalue("pg_dsn")
        schema = "py_seeds_" + uuid.uuid4().hex[:12]
        return lambda **kw: PostgresStateStore(dsn, schema=schema, pool_size=4, **kw)
    url = request.getfixturevalue("redis_server").url(9)
    return lambda **kw: RedisStateStore(url, **kw)


def run(factory: Callable[..., Any], body: Callable[[Any], Awaitable[None]], **kw: Any) -> None:
    async def main() -> None:
        store = factory(**kw)
        await store.setup()
        try:
            await body(store)
        finally:
            await store.close()

    asyncio.run(main())


DOC = {"step": 3, "log": [{"n": 1, "ok": True}, {"n": 2, "ok": None}], "text": "é ✓", "f": 1.5}


def test_set_get_delete_round_trip_docs_as_fresh_dicts(store_factory: Any) -> None:
    async def body(store: Any) -> None:
        ns, id = unique("ns"), "i"
        assert await store.get_tray(ns, id, "t", "a", 0) is None
        assert await store.set_tray(ns, id, "t", "a", True, DOC, 1) is None
        got = await store.get_tray(ns, id, "t", "a", 1)
        assert got == (True, DOC)
        marked, doc = got
        assert type(marked) is bool and type(doc) is dict
        doc["step"] = 99  # a fresh dict: the store's copy is untouched
        assert (await store.get_tray(ns, id, "t", "a", 1))[1] == DOC
        # set_tray upserts the whole row
        await store.set_tray(ns, id, "t", "a", False, {"step": 4}, 1)
        assert await store.get_tray(ns, id, "t", "a", 1) == (False, {"step": 4})
        # delete is idempotent and answers None in the seeds' shape
        assert await store.delete_tray(ns, id, "t", "a", 1) is None
        assert await store.delete_tray(ns, id, "t", "a", 1) is None
        assert await store.get_tray(ns, id, "t", "a", 1) is None
        # a dict subclass is a dict
        class D(dict):  # type: ignore[type-arg]
            pass

        await store.set_tray(ns, id, "t", "b", False, D(x=1), 1)
        assert await store.get_tray(ns, id, "t", "b", 1) == (False, {"x": 1})

    run(store_factory, body)


def test_rows_carry_the_stores_env_and_hostname(store_factory: Any) -> None:
    async def body(store: Any) -> None:
        ns = unique("ns")
        await store.set_tray(ns, "i", "t", "a", True, {}, 1)
        await store.apply_batch(ns, "i", [("tray", "t", "b", True, {"b": 1})], 1)
        page = await store.list_trays(InstanceKey(ns, "i"), 1)
        assert [(k.tray_id, t.env, t.hostname) for k, t in page.items] == [
            ("a", "prod", "w1"),
            ("b", "prod", "w1"),
        ]
        assert json.loads(page.items[1][1].doc) == {"b": 1}

    run(store_factory, body, env="prod", hostname="w1")


def test_list_orders_filters_and_fences(store_factory: Any) -> None:
    async def body(store: Any) -> None:
        ns, id = unique("ns"), "i"
        await store.apply_batch(
            ns,
            id,
            [
                ("tray", "b", "2", True, {"v": "b2"}),
                ("tray", "a", "9", False, {"v": "a9"}),
                ("tray", "b", "1", False, {"v": "b1"}),
                ("tray", "a", "10", True, {"v": "a10"}),
            ],
            1,
        )
        await store.set_tray(unique("other"), id, "a", "x", True, {}, 1)
        everything = await store.list(ns, id, 1)
        assert [(r[0], r[1]) for r in everything] == [("a", "10"), ("a", "9"), ("b", "1"), ("b", "2")]
        assert everything[0] == ("a", "10", True, {"v": "a10"})
        assert [r[1] for r in await store.list(ns, id, 1, marked=True)] == ["10", "2"]
        assert [r[1] for r in await store.list(ns, id, 1, marked=False)] == ["9", "1"]
        assert [r[1] for r in await store.list(ns, id, 1, tray_ns="b")] == ["1", "2"]
        assert await store.list(ns, id, 1, tray_ns="b", marked=False) == [("b", "1", False, {"v": "b1"})]
        assert await store.list(ns, id, 1, tray_ns="c") == []
        assert await store.list(unique("empty"), id, 1) == []
        for bad in ({"marked": 1}, {"marked": "yes"}, {"tray_ns": 3}, {"tray_ns": b"b"}):
            with pytest.raises(TypeError):
                await store.list(ns, id, 1, **bad)
        # list moves the epoch up as every tray call does; below it is fenced
        assert await store.list(ns, id, 5) != []
        assert await store.epoch(InstanceKey(ns, id)) == 5
        with pytest.raises(FenceLostError):
            await store.list(ns, id, 4)

    run(store_factory, body)


def test_apply_batch_is_atomic_and_checks_every_op_first(store_factory: Any) -> None:
    async def body(store: Any) -> None:
        ns, id = unique("ns"), "i"
        await store.set_tray(ns, id, "t", "keep", True, {"k": 1}, 1)
        await store.apply_batch(ns, id, [("tray", "t", "keep", None, None), ("tray", "t", "new", False, {"n": 1})], 2)
        assert await store.list(ns, id, 2) == [("t", "new", False, {"n": 1})]
        assert await store.epoch(InstanceKey(ns, id)) == 2
        bad_batches = [
            ([("tray", "t", "x", True, {}), ("row", "t", "y", True, {})], ValueError),
            ([("tray", "t", "x", True, {}), ("tray", "t", "y")], ValueError),
            ([("tray", "t", "x", True, {}), "tray"], ValueError),
            ([("tray", "t", "x", True, {}), ("tray", "t", "y", 1, {})], TypeError),
            ([("tray", "t", "x", True, {}), ("tray", "t", "y", True, [1])], ValueError),
        ]
        for ops, exc in bad_batches:
            with pytest.raises(exc):
                await store.apply_batch(ns, id, ops, 3)
        # nothing applied, and the fence did not move
        assert await store.list(ns, id, 2) == [("t", "new", False, {"n": 1})]
        assert await store.epoch(InstanceKey(ns, id)) == 2
        # a batch past the limit (K4) changes nothing either
        with pytest.raises(StateInvalidError):
            await store.apply_batch(ns, id, [("tray", "t", f"x{i}", False, {}) for i in range(10_001)], 3)
        assert await store.list(ns, id, 2) == [("t", "new", False, {"n": 1})]
        # the crate's shape still works beside the seeds'
        await store.apply_batch(InstanceKey(ns, id), 2, [TrayOp.put("t", "op", Tray(b'{"o": 1}'))])
        assert await store.get_tray(ns, id, "t", "op", 2) == (False, {"o": 1})
        assert await store.delete_tray(InstanceKey(ns, id).tray("t", "op"), 2) is True

    run(store_factory, body)


def test_epochs_are_any_int(store_factory: Any) -> None:
    async def body(store: Any) -> None:
        ns, id = unique("ns"), "i"
        # a negative epoch is below the stored one (0 when none), and fenced
        for call in (
            lambda e: store.set_tray(ns, id, "t", "a", True, {}, e),
            lambda e: store.get_tray(ns, id, "t", "a", e),
            lambda e: store.delete_tray(ns, id, "t", "a", e),
            lambda e: store.list(ns, id, e),
            lambda e: store.apply_batch(ns, id, [("tray", "t", "a", True, {})], e),
        ):
            with pytest.raises(FenceLostError) as info:
                await call(-1)
            assert info.value.caller_epoch == -1 and info.value.stored_epoch == 0
            assert info.value.epoch == -1 and info.value.key == f"{ns}/{id}"
            with pytest.raises(FenceLostError):
                await call(-(2**80))
        assert await store.list(ns, id, 0) == []
        # the largest epoch the seeds' bigint holds works; one past it is invalid
        top = 2**63 - 1
        await store.set_tray(ns, id, "t", "a", True, {}, top)
        assert await store.epoch(InstanceKey(ns, id)) == top
        for e in (2**63, 2**64, 2**100):
            with pytest.raises(StateInvalidError, match="epoch"):
                await store.get_tray(ns, id, "t", "a", e)
        with pytest.raises(TypeError):
            await store.get_tray(ns, id, "t", "a", 1.0)
        with pytest.raises(TypeError):
            await store.get_tray(ns, id, "t", "a", "3")
        with pytest.raises(FenceLostError) as info:
            await store.set_tray(ns, id, "t", "a", True, {}, top - 1)
        assert info.value.stored_epoch == top

    run(store_factory, body)


def test_bad_docs_and_rows_are_clear_errors(store_factory: Any) -> None:
    async def body(store: Any) -> None:
        ns, id = unique("ns"), "i"
        for doc in ([1], "x", None, b"{}", 3):
            with pytest.raises(ValueError, match="dict"):
                await store.set_tray(ns, id, "t", "a", True, doc, 1)
        for doc in ({"n": float("nan")}, {"n": float("inf")}):
            with pytest.raises(ValueError, match="JSON"):
                await store.set_tray(ns, id, "t", "a", True, doc, 1)
        with pytest.raises(TypeError, match="not JSON serializable"):
            await store.set_tray(ns, id, "t", "a", True, {"s": {1, 2}}, 1)
        with pytest.raises(TypeError):
            await store.set_tray(ns, id, "t", "a", "yes", {}, 1)
        assert await store.get_tray(ns, id, "t", "a", 1) is None
        # a tray written as bytes that are not JSON names its key when read as a dict
        await store.write_tray(InstanceKey(ns, id).tray("t", "raw"), 1, Tray(b"\x00\xffnot json"))
        with pytest.raises(StateInvalidError, match="raw"):
            await store.get_tray(ns, id, "t", "raw", 1)
        # a doc past the store's limit (K2)
        with pytest.raises(A.StatePersistenceError) as info:
            await store.set_tray(ns, id, "t", "big", True, {"x": "y" * 5000}, 1)
        assert info.value.reason == "too_large"

    run(store_factory, body, record_bytes_max=4096)


def test_a_tray_written_as_json_bytes_reads_as_a_dict_and_back(store_factory: Any) -> None:
    async def body(store: Any) -> None:
        ns, id = unique("ns"), "i"
        key = InstanceKey(ns, id).tray("t", "a")
        await store.write_tray(key, 1, Tray(b'{"b": [1, 2], "a": "x"}'))
        assert await store.get_tray(ns, id, "t", "a", 1) == (False, {"a": "x", "b": [1, 2]})
        await store.set_tray(ns, id, "t", "a", True, {"z": 1}, 1)
        tray = await store.read_tray(key, 1)
        assert json.loads(tray.doc) == {"z": 1} and tray.marked

    run(store_factory, body)


def test_pinned_catches_what_a_fenced_call_raises(tmp_path: Any) -> None:
    """pinned's ``except FenceLost`` catches the store's exception once
    pinned's store module is imported; without pinned the class is plain
    FenceLostError, and the package imports nothing of pinned's."""
    pytest.importorskip  # (pinned is a test dependency: no skip below)
    from pinned.durability.store import FenceLost

    async def body() -> None:
        store = MemoryStateStore()
        await store.set_tray("n", "i", "t", "a", True, {}, 2)
        try:
            await store.set_tray("n", "i", "t", "a", True, {}, 1)
        except FenceLost as e:
            assert isinstance(e, FenceLostError) and isinstance(e, A.StateError)
            assert (e.key, e.epoch, e.caller_epoch, e.stored_epoch) == ("n/i", 1, 1, 2)
            copy = pickle.loads(pickle.dumps(e))
            assert type(copy) is type(e) and str(copy) == str(e)
            assert (copy.key, copy.epoch, copy.stored_epoch) == ("n/i", 1, 2)
        else:
            raise AssertionError("a stale write was accepted")
        # the sync facade raises the same class
        with pytest.raises(FenceLost):
            store.sync().get_tray("n", "i", "t", "a", 1)

    asyncio.run(body())
    script = textwrap.dedent(
        """
        import asyncio, sys
        import agentstate_rs as A
        async def main():
            s = A.MemoryStateStore()
            await s.set_tray("n", "i", "t", "a", True, {}, 2)
            try:
                await s.get_tray("n", "i", "t", "a", 1)
            except A.FenceLostError as e:
                assert type(e) is A.FenceLostError, type(e).__mro__
            assert not any(m.startswith("pinned") for m in sys.modules), "pinned was imported"
            print("ok")
        asyncio.run(main())
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_sync_facade_has_the_seeds_protocol(tmp_path: Any) -> None:
    for store in (MemoryStateStore(), FileStateStore(str(tmp_path / "s"))):
        s = store.sync()
        s.set_tray("n", "i", "t", "a", True, {"a": 1}, 1)
        s.apply_batch("n", "i", [("tray", "t", "b", False, {"b": 2})], 1)
        assert s.get_tray("n", "i", "t", "a", 1) == (True, {"a": 1})
        assert s.list("n", "i", 1, marked=False) == [("t", "b", False, {"b": 2})]
        assert s.delete_tray("n", "i", "t", "a", 1) is None
        assert s.delete_tray(InstanceKey("n", "i").tray("t", "b"), 1) is True
        assert s.list("n", "i", 1) == []
        with pytest.raises(FenceLostError):
            s.list("n", "i", 0)
        s.close()


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_embedded_calls_take_no_loop_iteration(kind: str, tmp_path: Any) -> None:
    """An awaited call of a memory or file store returns without yielding
    to the event loop: a task that is ready to run does not run in between
    (which is what keeps a virtual-time simulation the same every run)."""

    async def body() -> None:
        store = MemoryStateStore() if kind == "memory" else FileStateStore(str(tmp_path / "s"))
        ran = []
        loop = asyncio.get_running_loop()
        loop.call_soon(ran.append, "other")
        await store.set_tray("n", "i", "t", "a", True, {"x": 1}, 1)
        await store.get_tray("n", "i", "t", "a", 1)
        await store.list("n", "i", 1)
        await store.apply_batch("n", "i", [("tray", "t", "b", False, {})], 1)
        await store.delete_tray("n", "i", "t", "b", 1)
        await store.epoch(InstanceKey("n", "i"))
        await store.read_tray(InstanceKey("n", "i").tray("t", "a"), 1)
        with pytest.raises(FenceLostError):
            await store.get_tray("n", "i", "t", "a", 0)
        assert ran == [], "a call yielded to the event loop"
        await asyncio.sleep(0)
        assert ran == ["other"]
        # the awaitables are coroutines as asyncio knows them
        assert await asyncio.create_task(store.get_tray("n", "i", "t", "a", 1)) == (True, {"x": 1})
        got = await asyncio.gather(store.list("n", "i", 1), store.epoch(InstanceKey("n", "i")))
        assert got == [[("t", "a", True, {"x": 1})], 1]
        await store.close()

    asyncio.run(body())
    # outside a loop, asyncio.run takes a call as its main coroutine
    store = MemoryStateStore()
    asyncio.run(store.set_tray("n", "i", "t", "a", True, {}, 1))
    assert asyncio.run(store.get_tray("n", "i", "t", "a", 1)) == (True, {})


def test_an_awaitable_is_awaited_once() -> None:
    async def body() -> None:
        store = MemoryStateStore()
        call = store.get_tray("n", "i", "t", "a", 1)
        assert await call is None
        with pytest.raises(RuntimeError, match="already awaited"):
            await call

    asyncio.run(body())


def test_numbers_read_back_as_the_same_python_values(store_factory: Any) -> None:
    """A float stays a float and an int an int on every store, PostgreSQL's
    jsonb included (which prints numbers without an exponent: a float
    written as ``1e+16`` would come back an int there)."""
    doc = {
        "e16": 1e16,
        "exp": 1e300,
        "tiny": 2.5e-08,
        "half": 0.5,
        "neg": -3.0,
        "negzero": -0.0,
        "big": 10**30,
        "small": -(2**70),
        "n": 7,
        "t": (1, 2.0, "x"),
        1: "int key",
        "nested": {"a": [1e22, {"b": 1e-7}]},
        "esc": 'q"\\\n\t\x01é',
    }
    want = {
        "e16": 1e16,
        "exp": 1e300,
        "tiny": 2.5e-08,
        "half": 0.5,
        "neg": -3.0,
        "negzero": 0.0,
        "big": 10**30,
        "small": -(2**70),
        "n": 7,
        "t": [1, 2.0, "x"],
        "1": "int key",
        "nested": {"a": [1e22, {"b": 1e-7}]},
        "esc": 'q"\\\n\t\x01é',
    }

    async def body(store: Any) -> None:
        ns = unique("ns")
        await store.set_tray(ns, "i", "t", "a", True, doc, 1)
        await store.apply_batch(ns, "i", [("tray", "t", "b", True, doc)], 1)
        for got in ((await store.get_tray(ns, "i", "t", "a", 1))[1], (await store.list(ns, "i", 1))[1][3]):
            assert got == want
            for k, v in want.items():
                assert type(got[k]) is type(v), (k, got[k])
            assert type(got["nested"]["a"][0]) is float
        # the text is JSON any reader takes
        tray = await store.read_tray(InstanceKey(ns, "i").tray("t", "a"), 1)
        assert json.loads(tray.doc) == want

    run(store_factory, body)


def test_close_twice_is_a_no_op(tmp_path: Any) -> None:
    async def body() -> None:
        for store in (MemoryStateStore(), FileStateStore(str(tmp_path / "s"))):
            await store.close()
            await store.close()
            with pytest.raises(A.StateClosedError):
                await store.get_tray("n", "i", "t", "a", 1)
            store.sync().close()

    asyncio.run(body())
