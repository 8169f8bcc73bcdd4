"""pinned's simulation harness as the judge of agentstate's embedded stores.

``pinned.sim.harness.run_scenario`` runs pinned's real host, worker and
trays on a seeded virtual-time kernel over a "disk image", crashing the
process before chosen store ops and checking pinned's durability contract
on the disk after every step; ``sweep`` crashes once before every op (and
after the last) and on a sample of double-crash pairs, on both store
lanes (atomic ``apply_batch`` and ordered single ops).

Here the disk image is agentstate's MemoryStateStore or FileStateStore
(``pinned_adapters.AgentstateMemoryDisk`` / ``AgentstateFileDisk``):

* a run on agentstate's store is the very run pinned's own
  MemoryStateStore gives (same ops count, same trace, same final virtual
  time, same disk at the end), every time;
* the crash-point sweep passes on both stores;
* a process that ran the simulation on them exits with nothing on stderr.

AGENTSTATE_PINNED_SEEDS (default 1) sets how many seeds the sweeps run.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap
import time
from typing import Any, Callable, List, Tuple

import pytest
from pinned.durability import MemoryStateStore
from pinned.durability.store import FenceLost
from pinned.sim.harness import run_scenario

import agentstate_rs as A
from pinned_adapters import AgentstateFileDisk, AgentstateMemoryDisk

HERE = os.path.dirname(os.path.abspath(__file__))
SEEDS = int(os.environ.get("AGENTSTATE_PINNED_SEEDS", "1"))
DISKS = {"memory": AgentstateMemoryDisk, "file": AgentstateFileDisk}


def _recording(factory: Callable[[], Any], made: List[Any]) -> Callable[[], Any]:
    def make() -> Any:
        disk = factory()
        made.append(disk)
        return disk

    return make


def _image(disk: Any) -> tuple:
    """The disk as plain data: every tray row and every epoch."""
    trays = {key: (marked, doc) for key, (marked, doc) in disk.trays.items()}
    epochs = {key: disk.epochs[key] for key in disk.epochs}
    return trays, epochs, disk.ops


def _crash_plans(ops: int) -> List[tuple]:
    """The baseline and a few crash plans spread over a lane's run: early,
    middle, after the last op, and a double crash."""
    return [(), (3,), (ops // 2,), (ops + 1,), (2, 5)]


@functools.lru_cache(maxsize=None)
def _reference(seed: int, points: tuple, singles: bool) -> Tuple[Any, tuple]:
    """pinned's own run on its MemoryStateStore, and its disk at the end."""
    made: List[Any] = []
    run = run_scenario(seed, points, singles=singles, store=_recording(MemoryStateStore, made))
    return run, _image(made[-1])


@pytest.mark.parametrize("disk", sorted(DISKS))
def test_runs_on_agentstate_are_the_runs_on_pinneds_memory_store(disk: str) -> None:
    for seed in range(3):
        for singles in (False, True):
            for points in _crash_plans(_reference(seed, (), singles)[0].ops):
                reference, ref_image = _reference(seed, points, singles)
                for attempt in range(2):
                    mine: List[Any] = []
                    got = run_scenario(seed, points, singles=singles, store=_recording(DISKS[disk], mine))
                    where = f"seed={seed} singles={singles} crash_points={points} run {attempt + 1}"
                    assert got.ops == reference.ops, where
                    assert got.trace[-1][0] == reference.trace[-1][0], f"final virtual time differs: {where}"
                    assert got.trace == reference.trace, f"trace differs: {where}"
                    assert got == reference, where
                    assert _image(mine[-1]) == ref_image, f"the disk differs at the end: {where}"


@pytest.mark.parametrize("disk", sorted(DISKS))
def test_reading_the_disk_views_moves_nothing(disk: str) -> None:
    made: List[Any] = []
    run_scenario(1, (4,), store=_recording(DISKS[disk], made))
    d = made[-1]
    sync = d.store.sync()
    scope = A.FeedScope.trays()
    head = sync.feed_head(scope)
    (key,) = list(d.epochs)
    epoch = d.epochs[key]
    assert epoch == 2  # one crash: generations 1 and 2
    for _ in range(3):
        first = _image(d)
        assert first == _image(d)
    assert sync.feed_head(scope) == head, "reading the views wrote to the store"
    assert sync.epoch(A.InstanceKey(*key)) == epoch
    assert d.trays.get(key + ("nope", "~")) is None
    assert d.epochs.get(("/elsewhere", "x"), 0) == 0
    assert d.epochs.get(("/elsewhere", "x")) is None


class _ForgetsFencing(AgentstateMemoryDisk):
    """Sabotage: a disk that swallows the fence on writes."""

    async def set_tray(self, *args: Any) -> None:
        try:
            await super().set_tray(*args)
        except FenceLost:
            pass


def test_the_harness_has_teeth_on_these_adapters() -> None:
    with pytest.raises(AssertionError, match="stale-epoch write was accepted"):
        run_scenario(0, (5,), store=_ForgetsFencing)


SWEEP = textwrap.dedent(
    """
    import hashlib, json, sys, time
    sys.path.insert(0, {here!r})
    from pinned.sim.harness import sweep
    import pinned_adapters

    start = time.monotonic()
    runs = sweep(range({seeds}), store=getattr(pinned_adapters, {disk!r}))
    print("SUMMARY " + json.dumps({{
        "runs": len(runs),
        "crashes": sum(r.crashes for r in runs),
        "resumed": sum(r.resumed for r in runs),
        "digest": hashlib.sha256(repr(runs).encode()).hexdigest(),
        "seconds": round(time.monotonic() - start, 1),
    }}))
    """
)


@pytest.mark.parametrize("disk", ["AgentstateMemoryDisk", "AgentstateFileDisk"])
def test_the_crash_point_sweep_passes(disk: str) -> None:
    """pinned's crash-point sweep over both lanes, in a process of its own
    (the sweep spawns a process pool that imports the disk by name), which
    must exit 0 with nothing on stderr."""
    started = time.monotonic()
    p = subprocess.run(
        [sys.executable, "-c", SWEEP.format(here=HERE, seeds=SEEDS, disk=disk)],
        capture_output=True,
        text=True,
        timeout=3600,
        cwd=HERE,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    assert p.stderr == "", p.stderr[-6000:]
    line = [l for l in p.stdout.splitlines() if l.startswith("SUMMARY ")]
    assert line, p.stdout
    summary = json.loads(line[-1][len("SUMMARY ") :])
    assert summary["runs"] > 100 * SEEDS and summary["crashes"] > 100 * SEEDS, summary
    # Every run of the sweep (crash points, ops, trace) is the same on both stores.
    _SWEEPS[disk] = summary.pop("digest")
    assert len(set(_SWEEPS.values())) == 1, _SWEEPS
    print(f"{disk}: {SEEDS} seed(s), {summary} in {time.monotonic() - started:.1f} s")


_SWEEPS: dict = {}


EXIT = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {here!r})
    from pinned.sim.harness import run_scenario
    from pinned_adapters import AgentstateFileDisk, AgentstateMemoryDisk

    keep = []
    for disk in (AgentstateMemoryDisk, AgentstateFileDisk):
        for singles in (False, True):
            run_scenario({seed}, singles=singles, store=disk)
            run_scenario({seed}, (2, 6), singles=singles, store=lambda: keep.append(disk()) or keep[-1])
    print("DONE", len(keep))
    """
)


def test_a_process_that_simulated_on_agentstate_exits_quietly() -> None:
    """No 'Event loop is closed', no unraisable exception, no crash at exit,
    also with file stores still open when the interpreter finalizes."""
    failures = []
    for seed in range(4):
        p = subprocess.run(
            [sys.executable, "-c", EXIT.format(here=HERE, seed=seed)],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=HERE,
        )
        if p.returncode != 0 or p.stderr != "" or "DONE 4" not in p.stdout:
            failures.append((seed, p.returncode, p.stdout[-500:], p.stderr[-3000:]))
    assert not failures, failures
