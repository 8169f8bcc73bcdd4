"""agentstate's stores against pinned's own, through pinned's StateStore
protocol, side by side in one run.

Each instance runs ``set_tray`` then ``get_tray`` of a ~1 KB doc in a loop
(one "pair"); 1 and 8 instances run at once on one event loop. Rounds
alternate between the stores so drift hits them alike; each line is the
median round. Reported: pairs/s, and the p50/p99 latency of one pair.

    python bench/pinned_bench.py                 # memory, file, PostgreSQL (a throwaway server), Redis
    AGENTSTATE_BENCH_PAIRS=500 python bench/pinned_bench.py --only memory

The PostgreSQL and Redis servers are the tests' throwaway ones on
loopback (tests/servers.py): PostgreSQL with fsync=off, so the figures are
CPU and round trips, not the disk. The file store's line is durable (every
write synced); the disk's sync floor beside it is a loop of a 1 KB write
append and fdatasync in the same directory.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
import uuid
from typing import Any, Callable, Dict, List, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import agentstate_rs as A  # noqa: E402
from pinned.durability.store import MemoryStateStore as PinnedMemory  # noqa: E402

DOC: Dict[str, Any] = {
    "queue": [{"n": i, "payload": "x" * 24, "ok": i % 2 == 0} for i in range(12)],
    "cursor": 1234,
    "owner": "worker-7",
    "note": "a tray doc of about one kilobyte, as pinned keeps them",
}


def doc_bytes() -> int:
    import json

    return len(json.dumps(DOC))


async def pairs(store: Any, instances: int, per: int, ns: str) -> Tuple[float, List[float]]:
    """`per` set+get pairs on each of `instances` instances at once: the
    elapsed time and every pair's latency."""
    lat: List[float] = []

    async def one(i: int) -> None:
        id = f"i{i}"
        for _ in range(per):
            t = time.perf_counter()
            await store.set_tray(ns, id, "t", "a", True, DOC, 1)
            got = await store.get_tray(ns, id, "t", "a", 1)
            lat.append(time.perf_counter() - t)
            assert got is not None and got[0] is True

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(instances)))
    return time.perf_counter() - t0, lat


def sync_floor(directory: str, n: int) -> float:
    """Synced 1 KB appends per second (an append and fdatasync, `n` times):
    the least a durable write can cost on this disk, as benches/compare.rs
    measures its floor (an append grows the file, so the sync writes its
    size too; overwriting in place would not, and is not what a log does)."""
    path = os.path.join(directory, "floor")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_TRUNC, 0o600)
    block = b"x" * 1024
    try:
        t0 = time.perf_counter()
        for _ in range(n):
            os.write(fd, block)
            os.fdatasync(fd)
        return n / (time.perf_counter() - t0)
    finally:
        os.close(fd)


def pct(xs: List[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def measure(make: Callable[[], Any], instances: int, per: int, rounds: int, setup: bool) -> Dict[str, float]:
    results = []
    for _ in range(rounds):
        store = make()
        if setup:
            await store.setup()
        ns = "bench-" + uuid.uuid4().hex[:8]
        await pairs(store, instances, max(1, per // 10), ns)  # warm up
        elapsed, lat = await pairs(store, instances, per, ns)
        results.append({"pairs_s": instances * per / elapsed, "p50_us": pct(lat, 0.5) * 1e6, "p99_us": pct(lat, 0.99) * 1e6})
        close = getattr(store, "close", None)
        if close is not None:
            r = close()
            if asyncio.iscoroutine(r) or hasattr(r, "__await__"):
                await r
    results.sort(key=lambda r: r["pairs_s"])
    return results[len(results) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", choices=["memory", "file", "postgres", "redis"], action="append")
    ap.add_argument("--rounds", type=int, default=int(os.environ.get("AGENTSTATE_BENCH_ROUNDS", "5")))
    args = ap.parse_args()
    kinds = args.only or ["memory", "file", "postgres", "redis"]
    pairs_n = int(os.environ.get("AGENTSTATE_BENCH_PAIRS", "3000"))
    print(f"doc: {doc_bytes()} bytes of JSON; {args.rounds} rounds, median round shown")
    print("| store | instances | pairs/s | p50 µs | p99 µs | vs pinned |")
    print("|---|---:|---:|---:|---:|---:|")
    tmp = tempfile.mkdtemp(prefix="pinned-bench-")
    servers: List[Any] = []

    def line(name: str, n: int, r: Dict[str, float], base: Dict[str, float] | None) -> None:
        ratio = f"{r['pairs_s'] / base['pairs_s']:.2f}x" if base else "—"
        print(f"| {name} | {n} | {r['pairs_s']:,.0f} | {r['p50_us']:,.0f} | {r['p99_us']:,.0f} | {ratio} |", flush=True)

    try:
        for n in (1, 8):
            if "memory" in kinds:
                per = pairs_n
                rows: Dict[str, List[Dict[str, float]]] = {"pinned": [], "agentstate": []}
                for _ in range(args.rounds):  # alternate the two, round by round
                    rows["pinned"].append(asyncio.run(measure(PinnedMemory, n, per // n, 1, False)))
                    rows["agentstate"].append(asyncio.run(measure(A.MemoryStateStore, n, per // n, 1, False)))
                med = {k: sorted(v, key=lambda r: r["pairs_s"])[len(v) // 2] for k, v in rows.items()}
                line("pinned MemoryStateStore", n, med["pinned"], None)
                line("agentstate MemoryStateStore", n, med["agentstate"], med["pinned"])
            if "file" in kinds:
                per = max(20, pairs_n // 20)
                d = tempfile.mkdtemp(dir=tmp)
                floor = statistics.median(sync_floor(d, 200) for _ in range(3))
                r = asyncio.run(
                    measure(lambda: A.FileStateStore(os.path.join(d, uuid.uuid4().hex)), n, max(1, per // n), args.rounds, False)
                )
                line("agentstate FileStateStore (synced)", n, r, None)
                print(f"| the disk's sync floor (1 KB append + fdatasync) | 1 | {floor:,.0f} writes/s | | | file: {r['pairs_s'] / floor:.2f} of it |", flush=True)
            if "postgres" in kinds:
                from servers import PgServer
                from pinned.durability.postgres import PostgresStateStore as PinnedPg

                if not servers or not isinstance(servers[0], PgServer):
                    servers.insert(0, PgServer())
                dsn = servers[0].dsn("postgres")
                per = max(50, pairs_n // 6)
                rows = {"pinned": [], "agentstate": []}
                for _ in range(args.rounds):
                    rows["pinned"].append(asyncio.run(measure(lambda: PinnedPg(dsn=dsn, pool_size=8), n, max(1, per // n), 1, True)))
                    rows["agentstate"].append(asyncio.run(measure(lambda: A.PostgresStateStore(dsn, pool_size=8), n, max(1, per // n), 1, True)))
                med = {k: sorted(v, key=lambda r: r["pairs_s"])[len(v) // 2] for k, v in rows.items()}
                line("pinned PostgresStateStore", n, med["pinned"], None)
                line("agentstate PostgresStateStore", n, med["agentstate"], med["pinned"])
            if "redis" in kinds:
                from servers import RedisServer

                rs = next((s for s in servers if isinstance(s, RedisServer)), None)
                if rs is None:
                    rs = RedisServer()
                    servers.append(rs)
                per = max(50, pairs_n // 6)
                r = asyncio.run(measure(lambda: A.RedisStateStore(rs.url(3), require_fsync=False), n, max(1, per // n), args.rounds, False))
                line("agentstate RedisStateStore", n, r, None)
    finally:
        for s in servers:
            s.stop()


if __name__ == "__main__":
    main()
