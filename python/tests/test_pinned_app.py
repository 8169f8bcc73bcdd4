"""A real pinned app on agentstate's stores: ``PinnedWorker(state_store=store)``
with a ``PinnedHost`` serving ``JobsApp`` (pinned_adapters), where the
store is agentstate's memory, file, PostgreSQL or Redis store passed as it
is (one constructor changes, nothing else).

Generation 1 serves requests at placement epoch 1: a note in an
always-open tray, a lane of work that drains, and a lane whose work is
held mid-delivery when the app stops. Generation 2 opens the same state
(a new store object on the same file, database or server) at epoch 2:
the held lane comes back on its own from its marked row, its first item
redelivered with its attempt counted, the drained lane stays passivated
until asked for, the note is there, and every call at epoch 1 is fenced
with pinned's FenceLost.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from pinned.durability.store import FenceLost
from pinned.testing import wake_until_ok

import agentstate_rs as A
from pinned_adapters import BACKENDS, NS, Backing, JobsApp, backing_for, expect_fenced, generation, get_ok, post_ok, unique_id, until, until_durable

NOTE = {"owner": "ada", "tags": ["x", "y"], "ratio": 1.5, "nested": {"ok": True, "none": None}, "text": "héllo ✓"}


@pytest.fixture(params=BACKENDS)
def backing(request: Any, tmp_path: Any) -> Backing:
    return backing_for(request.param, tmp_path, request)


async def _scenario(backing: Backing) -> None:
    id = unique_id("acct")
    base = f"{NS}/{id}"

    # Generation 1, epoch 1.
    store = await backing.open()
    JobsApp.gate = asyncio.Event()  # closed: held items wait at delivery
    try:
        async with generation(store, 1) as (host, client):
            await post_ok(client, f"{base}/note", {"value": NOTE})
            assert await get_ok(client, f"{base}/note") == {"note": NOTE}
            for n in range(1, 6):
                assert await post_ok(client, f"{base}/enqueue", {"key": "a", "n": n}) == {"admitted": n}
            await post_ok(client, f"{base}/join", {"keys": ["a"]})
            lane_a = await post_ok(client, f"{base}/lane", {"key": "a"})
            assert lane_a == {
                "exists": True,
                "log": [{"n": n, "attempts": 1} for n in range(1, 6)],
                "done": 5,
                "queued": [],
                "marked": False,
            }
            JobsApp.held = []
            for n in (6, 7, 8):
                await post_ok(client, f"{base}/enqueue", {"key": "b", "n": n, "hold": True})
            await until(lambda: JobsApp.held == [6])  # 6's delivery started
            await until_durable(store, id, "b", 1, attempts=1)  # and is counted
            assert "b" in (await get_ok(client, f"{base}/live"))["lanes"]
            # What the store holds now, read at the owner's epoch.
            marked = await store.list(NS, id, 1, marked=True)
            assert [(t, i, m) for t, i, m, _d in marked] == [("jobs", "b", True)]
            queued = [item["n"] for item in marked[0][3]["queue"]]
            assert queued == [6, 7, 8]
    finally:
        JobsApp.gate = None
    # Stopped gracefully: b's work is still marked, a rests unmarked.
    rows = {(t, i): (m, d) for t, i, m, d in await store.list(NS, id, 1)}
    assert set(rows) == {("jobs", "a"), ("jobs", "b"), ("notes", "~")}, sorted(rows)
    assert rows[("jobs", "a")][0] is False and rows[("jobs", "b")][0] is True
    assert rows[("notes", "~")] == (False, {"note": NOTE})
    assert rows[("jobs", "b")][1].get("~attempts") == 1, rows[("jobs", "b")][1]
    await backing.close(store)

    # Generation 2, epoch 2, a new store object on the same state.
    store = await backing.open()
    JobsApp.gate = asyncio.Event()
    try:
        async with generation(store, 2) as (host, client):
            JobsApp.held = []
            await wake_until_ok(client, f"{base}/_wake")
            record = await host.directory.get(id)
            # Rehydrated from the marked row alone; a stays passivated.
            assert sorted(record.instance.jobs.instances) == ["b"]
            assert record.instance.placement_epoch == 2
            assert await get_ok(client, f"{base}/note") == {"note": NOTE}
            # Every call at the superseded epoch is fenced, through the
            # store the live generation writes with.
            fenced = await expect_fenced(store.set_tray(NS, id, "probe", "p", False, {"x": 1}, 1))
            assert isinstance(fenced, A.FenceLostError)
            assert (fenced.key, fenced.epoch) == (f"{NS}/{id}", 1)
            await expect_fenced(store.get_tray(NS, id, "jobs", "b", 1))
            await expect_fenced(store.list(NS, id, 1))
            await expect_fenced(store.list(NS, id, 1, marked=True))
            await expect_fenced(store.delete_tray(NS, id, "jobs", "b", 1))
            await expect_fenced(store.apply_batch(NS, id, [("tray", "probe", "p", True, {})], 1))
            await until(lambda: JobsApp.held == [6])  # redelivered on its own
            JobsApp.gate.set()
            await post_ok(client, f"{base}/join", {"keys": ["a", "b"]})
            lane_b = await post_ok(client, f"{base}/lane", {"key": "b"})
            # 6 was mid-delivery when generation 1 stopped: redelivered,
            # its delivery count carried over; 7 and 8 run once.
            assert lane_b["log"] == [{"n": 6, "attempts": 2}, {"n": 7, "attempts": 1}, {"n": 8, "attempts": 1}], lane_b
            assert lane_b["queued"] == [] and lane_b["done"] == 3
            lane_a = await post_ok(client, f"{base}/lane", {"key": "a"})
            assert [e["n"] for e in lane_a["log"]] == [1, 2, 3, 4, 5]
            for n in (9, 10):
                await post_ok(client, f"{base}/enqueue", {"key": "a", "n": n})
            await post_ok(client, f"{base}/join", {"keys": ["a"]})
            lane_a = await post_ok(client, f"{base}/lane", {"key": "a"})
            assert [e["n"] for e in lane_a["log"]] == [1, 2, 3, 4, 5, 9, 10] and lane_a["done"] == 7
    finally:
        JobsApp.gate = None
    assert await store.list(NS, id, 2, marked=True) == []
    assert await store.get_tray(NS, id, "probe", "p", 2) is None, "a fenced write landed"
    assert store.sync().epoch(A.InstanceKey(NS, id)) == 2
    with pytest.raises(FenceLost):
        await store.set_tray(NS, id, "probe", "p", False, {}, 1)
    await backing.close(store)


def test_a_pinned_app_restarts_on_agentstate(backing: Backing) -> None:
    asyncio.run(_scenario(backing))


def test_the_stores_answer_pinned_calls_outside_a_running_loop(tmp_path: Any) -> None:
    """pinned awaits every call inside its loop; a call made before a loop
    runs is awaited later (as every call of the package)."""
    store = A.MemoryStateStore()
    asyncio.run(store.set_tray("/n", "i", "t", "a", True, {"k": [1]}, 3))
    assert asyncio.run(store.get_tray("/n", "i", "t", "a", 3)) == (True, {"k": [1]})
    pending = store.list("/n", "i", 3)
    assert asyncio.run(_await(pending)) == [("t", "a", True, {"k": [1]})]


async def _await(x: Any) -> Any:
    return await x
