"""pinned's StateStore protocol, verbatim, on every agentstate store:
the same seeded sequence of calls (``set_tray``, ``delete_tray``,
``get_tray``, ``list`` with and without filters, ``apply_batch`` with
puts, deletes and repeated rows) at epochs that climb, repeat and fall
behind, made on pinned's own ``MemoryStateStore`` and on agentstate's
store, answers the same every time (the same rows, the same docs, the
same FenceLost with the same key and epoch), and leaves the same state;
wrong arguments raise what pinned raises, before anything is written.
"""

from __future__ import annotations

import asyncio
import os
import random
from typing import Any, List, Tuple

import pytest
from pinned.durability import MemoryStateStore
from pinned.durability.store import FenceLost

import agentstate_rs as A
from pinned_adapters import BACKENDS, Backing, backing_for, unique_id

CALLS = int(os.environ.get("AGENTSTATE_PINNED_PROTOCOL_CALLS", "400"))


@pytest.fixture(params=BACKENDS)
def backing(request: Any, tmp_path: Any) -> Backing:
    return backing_for(request.param, tmp_path, request)


def _doc(rng: random.Random) -> dict:
    pool: List[Any] = [0, 1, -3, 2**40, 0.5, "", "x", "héllo ✓", True, False, None, [], {}, [1, "a", None], {"k": [1, {"z": 0.25}]}]
    return {rng.choice(["a", "b", "~v", "~inbox", "queue", "é"]): rng.choice(pool) for _ in range(rng.randrange(0, 4))}


async def _outcome(call: Any) -> Tuple[str, Any]:
    try:
        return "ok", await call
    except FenceLost as fenced:
        return "fenced", (fenced.key, fenced.epoch)


async def _differential(mine: Any, seed: int) -> None:
    rng = random.Random(seed)
    ref = MemoryStateStore()
    instances = [("/p", unique_id("a")), ("/p", unique_id("b"))]
    top = {key: 0 for key in instances}
    for step in range(CALLS):
        ns, id = rng.choice(instances)
        epoch = max(0, top[(ns, id)] + rng.choice([-2, -1, 0, 0, 0, 0, 1]))
        tray_ns = rng.choice(["jobs", "notes", "kwork"])
        tray_id = rng.choice(["~", "k1", "k2"])
        kind = rng.choice(["set", "set", "set", "delete", "get", "get", "list", "batch", "batch"])
        if kind == "set":
            args: Tuple[Any, ...] = (ns, id, tray_ns, tray_id, rng.random() < 0.5, _doc(rng), epoch)
            calls = (ref.set_tray(*args), mine.set_tray(*args))
        elif kind == "delete":
            args = (ns, id, tray_ns, tray_id, epoch)
            calls = (ref.delete_tray(*args), mine.delete_tray(*args))
        elif kind == "get":
            args = (ns, id, tray_ns, tray_id, epoch)
            calls = (ref.get_tray(*args), mine.get_tray(*args))
        elif kind == "list":
            filters = {}
            if rng.random() < 0.5:
                filters["tray_ns"] = tray_ns
            if rng.random() < 0.5:
                filters["marked"] = rng.random() < 0.5
            calls = (ref.list(ns, id, epoch, **filters), mine.list(ns, id, epoch, **filters))
        else:
            ops = []
            for _ in range(rng.randrange(0, 5)):
                t_ns, t_id = rng.choice(["jobs", "notes"]), rng.choice(["~", "k1"])
                if rng.random() < 0.25:
                    ops.append(("tray", t_ns, t_id, None, None))
                else:
                    ops.append(("tray", t_ns, t_id, rng.random() < 0.5, _doc(rng)))
            calls = (ref.apply_batch(ns, id, ops, epoch), mine.apply_batch(ns, id, ops, epoch))
        want = await _outcome(calls[0])
        got = await _outcome(calls[1])
        assert got == want, f"step {step} (seed {seed}): {kind} at epoch {epoch} on {id}: agentstate {got!r}, pinned {want!r}"
        if want[0] == "ok":
            top[(ns, id)] = max(top[(ns, id)], epoch)
    for ns, id in instances:
        assert await mine.list(ns, id, top[(ns, id)]) == await ref.list(ns, id, top[(ns, id)])
        assert mine.sync().epoch(A.InstanceKey(ns, id)) == ref.epochs[(ns, id)]


def test_agentstate_answers_every_call_as_pinneds_memory_store(backing: Backing) -> None:
    async def main() -> None:
        store = await backing.open()
        try:
            for seed in range(3):
                await _differential(store, seed)
        finally:
            await backing.close(store)

    asyncio.run(main())


def test_wrong_arguments_raise_what_pinned_raises(backing: Backing) -> None:
    async def main() -> None:
        mine = await backing.open()
        ref = MemoryStateStore()
        ns, id = "/p", unique_id("bad")
        try:
            for store in (ref, mine):
                await store.set_tray(ns, id, "t", "a", True, {"keep": 1}, 3)
            wrong = [
                (TypeError, lambda s: s.set_tray(ns, id, "t", "a", 1, {}, 4)),
                (TypeError, lambda s: s.set_tray(ns, id, "t", "a", None, {}, 4)),
                (ValueError, lambda s: s.set_tray(ns, id, "t", "a", True, [1], 4)),
                (ValueError, lambda s: s.set_tray(ns, id, "t", "a", True, "{}", 4)),
                (TypeError, lambda s: s.list(ns, id, 4, tray_ns=1)),
                (TypeError, lambda s: s.list(ns, id, 4, marked=1)),
                (TypeError, lambda s: s.list(ns, id, 4, marked="true")),
            ]
            for exc, call in wrong:
                for store in (ref, mine):
                    with pytest.raises(exc):
                        await call(store)
            # Refused before the fence: nothing moved, nothing written.
            assert mine.sync().epoch(A.InstanceKey(ns, id)) == ref.epochs[(ns, id)] == 3
            assert await mine.list(ns, id, 3) == await ref.list(ns, id, 3) == [("t", "a", True, {"keep": 1})]
            # An unknown batch op raises ValueError; agentstate's batch is
            # all or nothing (pinned's memory store applies the ops before
            # the bad one; its PostgreSQL store, like agentstate, none).
            with pytest.raises(ValueError):
                await ref.apply_batch(ns, id, [("alarm", "x")], 3)
            for bad in ([("tray", "t", "b", True, {}), ("alarm", "x")], [("tray", "t", "b", True, {}), ("tray", "t", "c")], [("tray", "t", "b", 1, {})]):
                with pytest.raises((ValueError, TypeError)):
                    await mine.apply_batch(ns, id, bad, 3)
            assert await mine.list(ns, id, 3) == [("t", "a", True, {"keep": 1})]
            # A doc is copied in and out: changing it after the call or
            # changing what a read answered changes nothing stored.
            doc = {"l": [1]}
            await mine.set_tray(ns, id, "t", "d", False, doc, 3)
            doc["l"].append(2)
            got = await mine.get_tray(ns, id, "t", "d", 3)
            assert got == (False, {"l": [1]})
            got[1]["l"].append(3)
            assert await mine.get_tray(ns, id, "t", "d", 3) == (False, {"l": [1]})
        finally:
            await backing.close(mine)

    asyncio.run(main())
