"""A small async agent loop on the file store.

It creates a run (or resumes the one a previous process left), and each
pass round the loop makes three "tool calls" in concurrent tasks, each
adding what it spent with patch_run (patches add, so no task overwrites
another's spend). At the end it marks the run completed with a versioned
write while a "supervisor" writes the same run: the loser of that race
gets StateConflictError, re-reads and decides again.

    python examples/agent_loop.py /tmp/agent-store --crash-after 3   # dies mid-run
    python examples/agent_loop.py /tmp/agent-store                   # resumes, finishes
"""

from __future__ import annotations

import argparse
import asyncio
import os
from typing import Callable

from agentstate_rs import (
    FileStateStore,
    RunKey,
    RunRecord,
    RunState,
    StateConflictError,
    StateDelta,
    StateStore,
    Usage,
)

ITERATIONS = 6
KEY = RunKey("acme", "run_1")


async def update(store: StateStore, key: RunKey, edit: Callable[[RunRecord], None]) -> RunRecord:
    """Read, edit, write at the version read; on a conflict, re-read and decide again."""
    while True:
        run = await store.get_run(key)
        assert run is not None
        edit(run)
        try:
            return await store.put_run(run)
        except StateConflictError as refused:
            print(f"conflict: wrote at {refused.expected_version}, store is at {refused.actual_version}; re-reading")


async def tool_call(store: StateStore, i: int) -> None:
    await asyncio.sleep(0.001 * i)  # the model / tool call
    await store.patch_run(KEY, StateDelta(cost_micros=100 * (i + 1), usage=Usage(input_tokens=50, output_tokens=10)))


async def main(path: str, crash_after: int | None) -> None:
    store = FileStateStore(path)
    run = await store.get_run(KEY)
    if run is None:
        run = await store.put_run(RunRecord(run_id="run_1", tenant="acme", agent_name="planner", state=RunState.RUNNING))
        print("started run_1")
    else:
        print(f"resumed run_1 at iteration {run.iterations}, message {run.messages_read}, spent {run.cost_micros} micros")

    while run.iterations < ITERATIONS:
        await asyncio.gather(*(tool_call(store, i) for i in range(3)))
        run = await store.patch_run(KEY, StateDelta(iterations=1, messages_read=2))
        print(f"iteration {run.iterations}: spent {run.cost_micros} micros (version {run.version})")
        if crash_after is not None and run.iterations == crash_after:
            print("crash")
            os._exit(3)  # no close, no cleanup: every patch so far was synced

    # Finish while a supervisor renames the run from another task: both
    # write at the version they read; one of them re-reads.
    mine = await store.get_run(KEY)
    assert mine is not None

    def complete(r: RunRecord) -> None:
        r.state = RunState.COMPLETED

    async def supervisor() -> None:
        await update(store, KEY, lambda r: setattr(r, "agent_name", "planner-v2"))

    async def finish() -> RunRecord:
        complete(mine)
        try:
            return await store.put_run(mine)  # the version read before the supervisor wrote
        except StateConflictError as refused:
            print(f"conflict: wrote at {refused.expected_version}, store is at {refused.actual_version}; re-reading")
            return await update(store, KEY, complete)

    await supervisor()
    run = await finish()
    print(f"done: state={run.state.value} agent={run.agent_name} iterations={run.iterations} cost_micros={run.cost_micros} version={run.version}")
    await store.close()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("path")
    p.add_argument("--crash-after", type=int)
    a = p.parse_args()
    asyncio.run(main(a.path, a.crash_after))
