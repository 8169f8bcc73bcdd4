"""The package's own surface: the seeds' examples verbatim, errors, repr,
clocks, the blocking facade and the GIL, closing, fork."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time

import pytest

import agentstate_rs as A
from agentstate_rs import (
    FileStateStore,
    ManualClock,
    MemoryStateStore,
    PostgresStateStore,
    RedisStateStore,
    RunRecord,
    RunState,
    StateDelta,
    StateQuery,
)


def test_the_seeds_example_verbatim() -> None:
    async def main() -> None:
        store = MemoryStateStore()
        run = await store.put_run(RunRecord(run_id="run_1", tenant="acme", agent_name="planner"))
        assert run.version == 1
        await store.patch_run(run.key, StateDelta(iterations=1, cost_micros=1_200))
        stale = run
        try:
            await store.put_run(stale)
        except A.StateConflictError as refused:
            assert refused.expected_version == 1
            assert refused.actual_version == 2
        else:
            raise AssertionError("no conflict")
        for i in range(250):
            await store.put_run(RunRecord(run_id=f"r{i}", tenant="acme", agent_name="p", state=RunState.RUNNING if i % 2 else RunState.PAUSED))
        seen = []
        page = await store.list_runs(StateQuery(tenant="acme", state=RunState.RUNNING, limit=100))
        seen += page.items
        while page.cursor is not None:
            page = await store.list_runs(StateQuery(tenant="acme", cursor=page.cursor))
            seen += page.items
        assert len(seen) == 125 and all(r.state == RunState.RUNNING for r in seen)
        walked = [r async for r in A.iter_runs(store, StateQuery("acme", state=RunState.PAUSED, limit=7))]
        assert len(walked) == 125

    asyncio.run(main())


def test_errors_share_a_base_and_carry_the_rust_message() -> None:
    store = MemoryStateStore().sync()
    run = store.put_run(RunRecord(run_id="r", tenant="t", agent_name="p"))
    with pytest.raises(A.StateError) as e:
        store.put_run(RunRecord(run_id="r", tenant="t", agent_name="p"))
    assert isinstance(e.value, A.StateConflictError)
    assert str(e.value) == "version conflict on run t/r: expected 0, stored 1"
    assert e.value.what == "run" and e.value.key == A.RunKey("t", "r")
    with pytest.raises(A.StateNotFoundError) as nf:
        store.patch_run(A.RunKey("t", "ghost"), StateDelta(iterations=1))
    assert nf.value.what == "run" and nf.value.key == A.RunKey("t", "ghost")
    with pytest.raises(A.StateInvalidError):
        store.patch_run_idempotent(run.key, StateDelta(), "")
    assert issubclass(A.StateInvalidError, ValueError)
    big = RunRecord(run_id="big", tenant="t", agent_name="p", pending_tool_calls=[A.ToolCall("c", "n", "x" * 2_000_000)])
    with pytest.raises(A.StatePersistenceError) as tl:
        store.put_run(big)
    assert tl.value.reason == "too_large" and not tl.value.retryable
    inst = A.InstanceKey("ns", "i")
    store.write_tray(inst.tray("t", "a"), 5, A.Tray(b"x"))
    with pytest.raises(A.FenceLostError) as fl:
        store.write_tray(inst.tray("t", "a"), 4, A.Tray(b"y"))
    assert (fl.value.caller_epoch, fl.value.stored_epoch) == (4, 5)
    assert "caller epoch 4 < stored epoch 5" in str(fl.value)


def test_sessions_in_use_names_the_runs() -> None:
    store = MemoryStateStore().sync()
    store.put_session(A.SessionRecord("s", "t"))
    store.put_run(RunRecord(run_id="live", tenant="t", agent_name="p", session_id="s", state=RunState.RUNNING))
    with pytest.raises(A.StateInUseError) as e:
        store.delete_session(A.SessionKey("t", "s"))
    assert e.value.runs == [A.RunKey("t", "live")]
    assert store.delete_session(A.SessionKey("t", "s"), cascade=True) == [A.RunKey("t", "live")]


def test_repr_never_shows_a_password(pg_dsn: str, redis_url: str) -> None:
    pg = PostgresStateStore("postgres://admin:Pw-s3cret-Xq7@127.0.0.1:5999/db", pool_size=3, lazy=True)
    assert "Pw-s3cret-Xq7" not in repr(pg) and "127.0.0.1:5999" in repr(pg) and "pool_size=3" in repr(pg)
    assert "Pw-s3cret-Xq7" not in repr(pg.sync())
    pg2 = PostgresStateStore("host=127.0.0.1 port=5999 user=a password=Pw-s3cret-Xq7 dbname=db", lazy=True)
    assert "Pw-s3cret-Xq7" not in repr(pg2)
    # Not lazy, the store dials at once: the unreachable server is the
    # constructor's error, and the password is in none of it.
    with pytest.raises(A.StatePersistenceError) as e:
        PostgresStateStore("postgres://admin:Pw-s3cret-Xq7@127.0.0.1:5999/db", connect_timeout=1)
    assert "Pw-s3cret-Xq7" not in str(e.value) and "Pw-s3cret-Xq7" not in repr(e.value)
    with pytest.raises(A.StatePersistenceError) as e:
        RedisStateStore("redis://:Pw-s3cret-Xq7@127.0.0.1:1/0", connect_timeout=2)
    assert "Pw-s3cret-Xq7" not in str(e.value) and "Pw-s3cret-Xq7" not in repr(e.value)
    assert "127.0.0.1" in repr(RedisStateStore(redis_url))
    run = RunRecord(run_id="r", tenant="t", agent_name="p", pending_tool_calls=[A.ToolCall("c", "n", '{"password": "hunter2"}')])
    assert "hunter2" not in repr(run) and "hunter2" not in repr(run.pending_tool_calls[0])
    assert repr(MemoryStateStore()) == "MemoryStateStore()"
    assert A.redact_connection_string("redis://u:pw@h:1/0") == "redis://u:***@h:1/0"


def test_redis_wait_replicas_refuses_a_master_without_replicas(redis_url: str) -> None:
    with pytest.raises(A.StatePersistenceError) as e:
        RedisStateStore(redis_url, wait_replicas=1, wait_timeout=0.5)
    assert "connected_slaves:0" in str(e.value)
    RedisStateStore(redis_url, wait_replicas=0)


def test_clocks_manual_and_callable(tmp_path) -> None:
    clock = ManualClock(5_000)
    store = MemoryStateStore(clock=clock).sync()
    r = store.put_run(RunRecord(run_id="r", tenant="t", agent_name="p"))
    assert (r.created_at, r.updated_at) == (5_000, 5_000)
    clock.advance(250)
    r = store.patch_run(r.key, StateDelta(iterations=1))
    assert (r.created_at, r.updated_at) == (5_000, 5_250)
    now = [42_000]
    fs = FileStateStore(str(tmp_path / "s"), clock=lambda: now[0]).sync()
    assert fs.put_run(RunRecord(run_id="r", tenant="t", agent_name="p")).created_at == 42_000
    fs.close()
    with pytest.raises(A.StateInvalidError):
        MemoryStateStore(clock=42)


def test_closed_store_raises_and_file_store_reopens(tmp_path) -> None:
    async def main() -> None:
        path = str(tmp_path / "s")
        async with FileStateStore(path) as store:
            await store.put_run(RunRecord(run_id="r", tenant="t", agent_name="p"))
        with pytest.raises(A.StateClosedError):
            await store.get_run(A.RunKey("t", "r"))
        again = FileStateStore(path)
        got = await again.get_run(A.RunKey("t", "r"))
        assert got is not None and got.version == 1
        with pytest.raises(A.StateLockedError):
            FileStateStore(path)
        await again.close()

    asyncio.run(main())


def test_blocking_calls_release_the_gil() -> None:
    """A blocking call that waits on the network lets other Python threads run."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)  # accepts connections, never answers
    port = silent.getsockname()[1]
    store = PostgresStateStore(f"postgres://u@127.0.0.1:{port}/db", pool_size=1, connect_timeout=1.5, lazy=True).sync()
    ticks = [0]
    done = threading.Event()

    def call() -> None:
        try:
            store.get_run(A.RunKey("t", "r"))
        except A.StateError:
            pass
        finally:
            done.set()

    th = threading.Thread(target=call)
    start = time.monotonic()
    th.start()
    while not done.is_set():
        ticks[0] += 1
    th.join()
    silent.close()
    assert time.monotonic() - start >= 1.0, "the call did not wait on the silent server"
    # Holding the GIL for 1.5 s would leave this thread a handful of
    # switch intervals; released, it counts freely.
    assert ticks[0] > 100_000, ticks[0]


def arun(call):
    """asyncio.run over a call made inside the loop (the store's awaitables
    are bound to the loop running when the call is made)."""

    async def main():
        return await call()

    return asyncio.run(main())


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_store_used_after_fork_raises_and_a_new_one_works(tmp_path) -> None:
    store = MemoryStateStore()
    arun(lambda: store.put_run(RunRecord(run_id="r", tenant="t", agent_name="p")))
    pid = os.fork()
    if pid == 0:  # the child: exit codes say what happened
        code = 0
        try:
            try:
                arun(lambda: store.get_run(A.RunKey("t", "r")))
                code = 10
            except A.StoreForkedError:
                pass
            try:
                store.sync().get_run(A.RunKey("t", "r"))
                code = 11
            except A.StoreForkedError:
                pass
            fresh = MemoryStateStore()
            r = arun(lambda: fresh.put_run(RunRecord(run_id="c", tenant="t", agent_name="p")))
            if r.version != 1:
                code = 12
            fs = FileStateStore(str(tmp_path / "child")).sync()
            if fs.put_run(RunRecord(run_id="c", tenant="t", agent_name="p")).version != 1:
                code = 13
            fs.close()
        except BaseException:
            code = 20
        os._exit(code)
    deadline = time.time() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.time() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            raise AssertionError("the forked child hung")
        time.sleep(0.05)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"child exit {status >> 8}"
    # The parent's store is untouched.
    got = arun(lambda: store.get_run(A.RunKey("t", "r")))
    assert got is not None


def test_postgres_setup_from_many_workers_at_once(pg_server) -> None:
    dsn = pg_server.dsn("postgres")

    async def main() -> None:
        stores = [PostgresStateStore(dsn, schema="py_setup_race", pool_size=2) for _ in range(4)]
        await asyncio.gather(*(s.setup() for s in stores))
        r = await stores[0].put_run(RunRecord(run_id="r", tenant="setup", agent_name="p"))
        got = await stores[3].get_run(r.key)
        assert got is not None and got.version == 1
        for s in stores:
            await s.close()

    asyncio.run(main())


def test_budgets_and_idempotent_calls_sync() -> None:
    store = MemoryStateStore().sync()
    store.put_budget(A.BudgetRecord("t", "team", A.Caps(cost_micros_max=1_000)))
    run = store.put_run(RunRecord(run_id="r", tenant="t", agent_name="p", budget="team"))
    h = store.reserve_idempotent(run.key, A.Hold("h1", 60_000, cost_micros=800), "k1")
    assert store.reserve_idempotent(run.key, A.Hold("h1", 60_000, cost_micros=800), "k1").id == h.id
    with pytest.raises(A.BudgetExceededError) as e:
        store.reserve(run.key, A.Hold("h2", 60_000, cost_micros=300))
    assert e.value.scope == "budget" and e.value.budget == A.BudgetKey("t", "team")
    s = store.settle_idempotent(run.key, "h1", StateDelta(cost_micros=900), "k2")
    assert s.record.cost_micros == 900 and s.overshoot.cost_micros == 100
    assert store.settle_idempotent(run.key, "h1", StateDelta(cost_micros=900), "k2").record.cost_micros == 900
    status = store.get_budget(A.BudgetKey("t", "team"))
    assert status is not None and status.spent.cost_micros == 900
    inst = A.InstanceKey("ns", "i")
    ops = [A.TrayOp.put("t", "a", A.Tray(b"1", marked=True))]
    store.apply_batch_idempotent(inst, 1, ops, "b1")
    store.apply_batch_idempotent(inst, 1, ops, "b1")
    assert [m.key.tray_id for m in store.marked_trays().items] == ["a"]


def test_calls_made_outside_a_running_loop_are_awaitable_later(tmp_path) -> None:
    store = MemoryStateStore()
    run = asyncio.run(store.put_run(RunRecord(run_id="r", tenant="t", agent_name="p")))
    assert run.version == 1
    page = asyncio.run(store.list_runs(StateQuery("t", limit=1)))
    assert [r.run_id for r in page.items] == ["r"]
    asyncio.run(store.setup())
    asyncio.run(store.close())
    with pytest.raises(A.StateClosedError):
        asyncio.run(store.get_run(run.key))
