"""Helpers for the pinned-as-judge tests (test_pinned_*.py).

pinned (the Python framework the seeds describe) is the first judge of
this package: its real worker, host, trays and simulation harness run
over agentstate's stores. This module holds what those tests share, at
module level so that processes the tests spawn can import it:

* ``JobsApp``: a small PinnedAPI with a keyed tray of durable work
  (``persistent_queue`` admitted through an ``@inbox``, a ``persistent``
  counter, a log in the tray's storage) and an always-open singleton tray
  holding a note; ``generation`` hosts it on a ``PinnedWorker`` over a
  store at one placement epoch.
* ``AgentstateMemoryDisk`` and ``AgentstateFileDisk``: the "disk image"
  ``pinned.sim.harness.run_scenario(store=...)`` and ``sweep(store=...)``
  build, shaped like pinned's ``MemoryStateStore`` (the async protocol,
  ``ops``, ``epochs``, ``trays``), with the protocol answered by
  agentstate's stores and the two views read back from them.
* PostgreSQL helpers: a fresh database per test, closing pinned's store.
* ``python -m pinned_adapters work|recover ...``: the child process of the
  kill -9 test (test_pinned_kill.py).

pinned is a test dependency only: nothing here copies its code.
"""

from __future__ import annotations

import asyncio
import collections.abc
import collections
import contextlib
import json
import os
import shutil
import sys
import tempfile
import uuid
import weakref
from typing import Any, AsyncIterator, Iterator, Optional

from pinned import PinnedAPI, PinnedWorker, route
from pinned.durability.store import FenceLost
from pinned.pinboard.wire import EPOCH_HEADER
from pinned.testing import client_for, pinned_app, pinned_host, wake_until_ok
from pinned.trays import Tray, TrayCtx, inbox, persistent, persistent_queue, tray

import agentstate_rs as A

NS = "/jobs"


# --------------------------------------------------------------------------
# The app


class JobTray(Tray):
    """A keyed lane of durable work: admission marks the row and appends to
    the queue in one segment; each delivery logs its item with its
    attempt count, then the ack pops it."""

    queue = persistent_queue()
    done = persistent(0)

    async def lifecycle(self) -> AsyncIterator[None]:
        self.idle = asyncio.Event()
        if not self.queue.value:
            self.idle.set()
        yield

    def items(self) -> Iterator[Any]:
        while self.queue.value:
            yield self.queue.peek()
            self.queue.popleft()
        self.idle.set()

    @inbox
    def add(self, item: dict) -> None:
        self.idle.clear()
        self.kick()
        self.queue.append(item)


class NoteTray(Tray):
    """An always-open singleton holding one durable value (never marked)."""

    note = persistent(None)

    def items(self) -> Iterator[Any]:
        yield from ()

    @inbox
    def put(self, value: Any) -> None:
        self.note.value = value


class JobsApp(PinnedAPI):
    """Items whose ``hold`` is true wait on ``JobsApp.gate`` (when one is
    set) before they run, their ``n`` noted in ``JobsApp.held`` once their
    delivery started; every delivery sleeps ``JobsApp.delay`` first."""

    gate: Optional[asyncio.Event] = None
    delay: float = 0.0
    # The held items whose delivery started (and waits on the gate).
    held: list = []

    @tray.map(JobTray)
    async def jobs(self, item: dict, ctx: TrayCtx) -> None:
        gate = type(self).gate
        if item.get("hold") and gate is not None:
            type(self).held.append(item["n"])
            await gate.wait()
        if type(self).delay:
            await self.domain.sleep(type(self).delay)
        log = ctx.tray.storage.get("log", [])
        ctx.tray.storage.set("log", [*log, {"n": item["n"], "attempts": ctx.attempts}])
        ctx.tray.done.value = ctx.tray.done.value + 1
        await self.frontier.wait()

    @tray(NoteTray)
    async def notes(self, item: Any, ctx: TrayCtx) -> None:
        raise AssertionError("the note tray never dispatches")

    @route.post("/enqueue")
    async def enqueue(self, body: dict) -> dict:
        lane = await self.jobs.get_or_create(body["key"])
        await lane.add({k: v for k, v in body.items() if k != "key"})
        return {"admitted": body["n"]}

    @route.post("/note")
    async def set_note(self, body: dict) -> dict:
        await (await self.notes.get()).put(body["value"])
        return {}

    @route.get("/note")
    async def get_note(self) -> dict:
        return {"note": (await self.notes.get()).note.value}

    @route.post("/lane")
    async def lane(self, body: dict) -> dict:
        """One lane as it stands (reopened if passivated): log, done, queue."""
        try:
            lane = await self.jobs.get(body["key"])
        except KeyError:
            return {"exists": False}
        return {
            "exists": True,
            "log": lane.storage.get("log", []),
            "done": lane.done.value,
            "queued": [item["n"] for item in lane.queue.value],
            "marked": lane.storage.marked,
        }

    @route.post("/join")
    async def join(self, body: dict) -> dict:
        """Resolves once every named lane that exists has drained and every
        effect is durable."""
        for key in body["keys"]:
            try:
                lane = await self.jobs.get(key)
            except KeyError:
                continue
            await lane.idle.wait()
        await self.frontier.wait()
        return {}

    @route.get("/live")
    async def live(self) -> dict:
        return {"lanes": sorted(self.jobs.instances)}


@contextlib.asynccontextmanager
async def generation(store: Any, epoch: int, cls: type = JobsApp, namespace: str = NS) -> AsyncIterator[Any]:
    """One process generation: a PinnedWorker over ``store``, the host and
    its FastAPI app running, and an in-process client sending ``epoch`` as
    the placement epoch. Yields ``(host, client)``; leaving it shuts the
    app down gracefully (the store stays open)."""
    host = pinned_host(cls, namespace=namespace, worker=PinnedWorker(state_store=store))
    async with pinned_app(host) as app:
        async with client_for(app, {EPOCH_HEADER: str(epoch)}) as client:
            yield host, client


async def post_ok(client: Any, path: str, body: Any = None) -> Any:
    res = await client.post(path, json=body)
    assert res.status_code == 200, (path, res.status_code, res.text)
    return res.json()


async def get_ok(client: Any, path: str) -> Any:
    res = await client.get(path)
    assert res.status_code == 200, (path, res.status_code, res.text)
    return res.json()


async def expect_fenced(call: Any) -> FenceLost:
    """Awaits ``call`` (an awaitable) and answers the FenceLost it raised;
    fails when it raised nothing."""
    try:
        await call
    except FenceLost as fenced:
        return fenced
    raise AssertionError("a call at a superseded epoch was accepted")


async def until(check: Any, timeout: float = 10.0) -> None:
    """Waits (polling the loop) until ``check()`` is true."""
    async with asyncio.timeout(timeout):
        while not check():
            await asyncio.sleep(0.005)


async def until_durable(store: Any, id: str, key: str, epoch: int, attempts: int) -> None:
    """Waits until the store holds lane ``key``'s delivery count at
    ``attempts``. (pinned writes the count in the background and a
    graceful stop does not wait for that write to land: on a store that
    answers over the network, pinned's own PostgreSQL store as well as
    agentstate's, a stop right after a delivery started can leave the
    count unwritten, and the redelivery counts from there.)"""

    async def landed() -> bool:
        row = await store.get_tray(NS, id, "jobs", key, epoch)
        return row is not None and row[1].get("~attempts") == attempts

    async with asyncio.timeout(10):
        while not await landed():
            await asyncio.sleep(0.005)


def unique_id(prefix: str = "i") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


class Backing:
    """Where a store keeps its state, and how a new process opens it:
    ``open()`` answers a store over that state, set up (a new object each
    time, except the memory store, whose state is the object);
    ``close(store)`` closes it (not the memory store)."""

    def __init__(self, kind: str, where: str = "", **kwargs: Any) -> None:
        self.kind = kind
        self.where = where
        self.kwargs = kwargs
        self._memory: Any = None

    def make(self) -> Any:
        if self.kind == "memory":
            if self._memory is None:
                self._memory = A.MemoryStateStore(**self.kwargs)
            return self._memory
        if self.kind == "file":
            return A.FileStateStore(self.where, **self.kwargs)
        if self.kind == "postgres":
            return A.PostgresStateStore(self.where, **self.kwargs)
        if self.kind == "redis":
            return A.RedisStateStore(self.where, **self.kwargs)
        raise ValueError(self.kind)

    async def open(self) -> Any:
        store = self.make()
        await store.setup()
        return store

    async def close(self, store: Any) -> None:
        if self.kind != "memory":
            await store.close()


def backing_for(kind: str, tmp_path: Any, request: Any) -> Backing:
    """The Backing of a parametrized test: a new file under ``tmp_path``, a
    fresh database on the session's PostgreSQL server, the session's Redis
    server (the tests use unique instance ids there)."""
    if kind == "memory":
        return Backing("memory")
    if kind == "file":
        return Backing("file", os.path.join(str(tmp_path), "store"))
    if kind == "postgres":
        server = request.getfixturevalue("pg_server")
        return Backing("postgres", fresh_database(server.dsn("postgres"), "pinned_judge"))
    if kind == "redis":
        return Backing("redis", request.getfixturevalue("redis_url"))
    raise ValueError(kind)


BACKENDS = ["memory", "file", "postgres", "redis"]


# --------------------------------------------------------------------------
# The simulation's disk image over agentstate's stores


class _Epochs(collections.abc.Mapping):
    """``disk.epochs``: (ns, id) -> the stored epoch, read from the store."""

    def __init__(self, disk: "_AgentstateDisk") -> None:
        self._disk = disk

    def __getitem__(self, key: Any) -> int:
        ns, id = key
        epoch = self._disk._epoch(ns, id)
        if epoch == 0 and (ns, id) not in self._disk._seen:
            raise KeyError(key)
        return epoch

    def get(self, key: Any, default: Any = None) -> Any:
        try:
            return self[key]
        except KeyError:
            return default

    def __iter__(self) -> Iterator[tuple]:
        return iter(sorted(self._disk._seen))

    def __len__(self) -> int:
        return len(self._disk._seen)


class _Trays(collections.abc.Mapping):
    """``disk.trays``: (ns, id, tray_ns, tray_id) -> (marked, doc), each read
    from the store at the instance's stored epoch (which moves nothing)."""

    def __init__(self, disk: "_AgentstateDisk") -> None:
        self._disk = disk

    def __getitem__(self, key: Any) -> tuple:
        ns, id, tray_ns, tray_id = key
        if (ns, id) not in self._disk._seen:
            raise KeyError(key)
        sync = self._disk._sync
        row = sync.get_tray(ns, id, tray_ns, tray_id, self._disk._epoch(ns, id))
        if row is None:
            raise KeyError(key)
        marked, doc = row
        return (marked, doc)

    def get(self, key: Any, default: Any = None) -> Any:
        try:
            return self[key]
        except KeyError:
            return default

    def items(self) -> list:  # type: ignore[override]
        out = []
        sync = self._disk._sync
        for ns, id in sorted(self._disk._seen):
            for tray_ns, tray_id, marked, doc in sync.list(ns, id, self._disk._epoch(ns, id)):
                out.append(((ns, id, tray_ns, tray_id), (marked, doc)))
        return out

    def values(self) -> list:  # type: ignore[override]
        return [row for _key, row in self.items()]

    def __iter__(self) -> Iterator[tuple]:
        return iter([key for key, _row in self.items()])

    def __len__(self) -> int:
        return len(self.items())


class _AgentstateDisk:
    """The disk image ``SimStateStore`` wraps: the StateStore protocol
    answered by an agentstate store (in place, so the simulation stays
    deterministic), ``ops`` (the op counter that outlives a simulated
    kill), and the ``epochs`` / ``trays`` views that pinned's contract
    checks read, both read back from the store."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self._sync = store.sync()
        self.ops = 0
        self._seen: set = set()
        self.epochs = _Epochs(self)
        self.trays = _Trays(self)

    def _epoch(self, ns: str, id: str) -> int:
        return self._sync.epoch(A.InstanceKey(ns, id))

    async def _call(self, ns: str, id: str, awaitable: Any) -> Any:
        try:
            answer = await awaitable
        except FenceLost:
            self._seen.add((ns, id))
            raise
        self._seen.add((ns, id))
        return answer

    async def set_tray(self, ns: str, id: str, tray_ns: str, tray_id: str, marked: bool, doc: dict, epoch: int) -> None:
        await self._call(ns, id, self.store.set_tray(ns, id, tray_ns, tray_id, marked, doc, epoch))

    async def delete_tray(self, ns: str, id: str, tray_ns: str, tray_id: str, epoch: int) -> None:
        await self._call(ns, id, self.store.delete_tray(ns, id, tray_ns, tray_id, epoch))

    async def get_tray(self, ns: str, id: str, tray_ns: str, tray_id: str, epoch: int) -> Any:
        return await self._call(ns, id, self.store.get_tray(ns, id, tray_ns, tray_id, epoch))

    async def list(self, ns: str, id: str, epoch: int, *, tray_ns: Optional[str] = None, marked: Optional[bool] = None) -> Any:
        return await self._call(ns, id, self.store.list(ns, id, epoch, tray_ns=tray_ns, marked=marked))

    async def apply_batch(self, ns: str, id: str, ops: list, epoch: int) -> None:
        await self._call(ns, id, self.store.apply_batch(ns, id, ops, epoch))


class AgentstateMemoryDisk(_AgentstateDisk):
    """The simulation's disk on agentstate's MemoryStateStore."""

    def __init__(self) -> None:
        super().__init__(A.MemoryStateStore())


def _drop_file_store(store: Any, root: str) -> None:
    with contextlib.suppress(Exception):
        store.sync().close()
    shutil.rmtree(root, ignore_errors=True)


def _sim_dir() -> Optional[str]:
    """Where the simulation's file stores go: AGENTSTATE_PINNED_SIM_DIR, else
    /dev/shm when it is there (the simulation's crashes are simulated, the
    store object outliving them, so what it judges is the store's
    semantics, not the device's fsync: on a RAM disk a store opens in 10 ms
    instead of 300 and a sweep takes minutes less; the kill -9 test judges
    real files), else the system's temporary directory."""
    chosen = os.environ.get("AGENTSTATE_PINNED_SIM_DIR")
    if chosen:
        return chosen
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        return "/dev/shm"
    return None


class AgentstateFileDisk(_AgentstateDisk):
    """The simulation's disk on agentstate's FileStateStore in a temporary
    directory of its own (see ``_sim_dir``), closed and removed when the
    disk is dropped, at exit, or once ``KEEP`` newer file disks were made
    in the process, whichever comes first.

    The last rule is for the sweep: its worker processes run hundreds of
    scenarios each, and a finished run's disk stays referenced (FastAPI's
    dependency caches keep each generation's worker, and with it the
    store wrapper and the disk, alive; pinned's own disks stay too), so
    without it a worker would hold hundreds of stores open. A run uses one
    disk; a disk is read right after its run."""

    KEEP = 8
    _recent: "collections.deque[AgentstateFileDisk]" = collections.deque()

    def __init__(self) -> None:
        root = tempfile.mkdtemp(prefix="agentstate-pinned-sim-", dir=_sim_dir())
        super().__init__(A.FileStateStore(os.path.join(root, "store")))
        self.root = root
        self._finalizer = weakref.finalize(self, _drop_file_store, self.store, root)
        recent = AgentstateFileDisk._recent
        recent.append(self)
        while len(recent) > self.KEEP:
            recent.popleft()._finalizer()

    @property
    def dropped(self) -> bool:
        return not self._finalizer.alive


# --------------------------------------------------------------------------
# PostgreSQL


def fresh_database(admin_dsn: str, prefix: str = "pinned") -> str:
    """Creates an empty database on the server ``admin_dsn`` reaches and
    answers its DSN."""
    import psycopg

    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return admin_dsn.rsplit("/", 1)[0] + "/" + name


async def close_pinned_pg(store: Any) -> None:
    """Closes the connections pinned's PostgresStateStore pooled (it has no
    close(); its pool is the queue of slots its docstring describes)."""
    slots = store._slots
    while not slots.empty():
        conn = slots.get_nowait()
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close()


def sql(dsn: str, query: str, params: Any = None) -> list:
    """Runs one statement on ``dsn`` and answers its rows."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        cur = conn.execute(query, params)
        return cur.fetchall() if cur.description else []


# --------------------------------------------------------------------------
# The kill -9 test's child process


def open_store(backend: str, where: str) -> Any:
    if backend == "file":
        return A.FileStateStore(where)
    if backend == "postgres":
        return A.PostgresStateStore(where)
    raise ValueError(backend)


KEYS = ("k0", "k1", "k2")


async def _work(backend: str, where: str, id: str, epoch: int) -> None:
    """Enqueues items on three lanes from four concurrent clients until
    killed: ``SENT n`` before each request, ``ACK n`` once it answered
    (its admission durable), deliveries lagging behind admissions."""
    store = open_store(backend, where)
    await store.setup()
    JobsApp.delay = 0.002
    async with generation(store, epoch) as (_host, client):
        print("READY", flush=True)
        counter = iter(range(1, 1_000_000))

        async def pump() -> None:
            for n in counter:
                print(f"SENT {n}", flush=True)
                await post_ok(client, f"{NS}/{id}/enqueue", {"key": KEYS[n % 3], "n": n})
                print(f"ACK {n}", flush=True)

        await asyncio.gather(*(pump() for _ in range(4)))


async def _recover(backend: str, where: str, id: str, epoch: int, stale: int) -> None:
    """A new process at a higher epoch: the lanes whose rows were marked at
    the kill come back on their own; every lane drains; prints what the
    store holds, which lanes were live right after the wake, and whether
    a write at the stale epoch was fenced."""
    store = open_store(backend, where)
    await store.setup()
    async with generation(store, epoch) as (host, client):
        await wake_until_ok(client, f"{NS}/{id}/_wake", timeout=30.0)
        live = sorted((await host.directory.get(id)).instance.jobs.instances)
        async with asyncio.timeout(60):
            await post_ok(client, f"{NS}/{id}/join", {"keys": list(KEYS)})
        lanes = {key: await post_ok(client, f"{NS}/{id}/lane", {"key": key}) for key in KEYS}
        try:
            await store.set_tray(NS, id, "probe", "p", False, {}, stale)
            fenced = False
        except FenceLost:
            fenced = True
    rows = await store.list(NS, id, epoch)
    await store.close()
    print(
        "RESULT "
        + json.dumps(
            {
                "live_after_wake": live,
                "lanes": lanes,
                "rows": [[t_ns, t_id, marked, doc] for t_ns, t_id, marked, doc in rows],
                "fenced": fenced,
            }
        ),
        flush=True,
    )


def child_main(argv: list) -> None:
    mode, backend, where, id, epoch = argv[:5]
    if mode == "work":
        asyncio.run(_work(backend, where, id, int(epoch)))
    elif mode == "recover":
        asyncio.run(_recover(backend, where, id, int(epoch), int(argv[5])))
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    child_main(sys.argv[1:])
