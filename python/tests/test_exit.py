"""A process exits cleanly right after its last await: the runtime's
threads still handing results to asyncio are waited for (atexit) before
the interpreter finalizes, instead of being stopped mid-way (a crash at
exit, seen in about one exit in eight without it)."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import asyncio, sys
import agentstate_rs as a

async def main() -> None:
    store = a.FileStateStore(sys.argv[1])
    run = await store.put_run(a.RunRecord(run_id="r", tenant="t", agent_name="x"))
    for _ in range(5):
        await asyncio.gather(*(store.get_run(run.key) for _ in range(50)))
        await asyncio.gather(*(store.patch_run(run.key, a.StateDelta(iterations=1)) for _ in range(20)))
    await store.close()

asyncio.run(main())
"""


def test_processes_exit_cleanly_right_after_their_last_await(tmp_path) -> None:
    failures = []
    for i in range(24):
        p = subprocess.run(
            [sys.executable, "-c", SCRIPT, str(tmp_path / f"s{i}")],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if p.returncode != 0:
            failures.append((p.returncode, p.stderr[-400:]))
    assert not failures, failures
