"""python/examples/agent_loop.py: it dies mid-run, a new process resumes
it from the file store, and the spend adds up exactly."""

from __future__ import annotations

import os
import subprocess
import sys

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "agent_loop.py")


def test_agent_loop_crashes_resumes_and_adds_up(tmp_path) -> None:
    path = str(tmp_path / "agent-store")
    first = subprocess.run([sys.executable, EXAMPLE, path, "--crash-after", "3"], capture_output=True, text=True, timeout=60)
    assert first.returncode == 3, first.stdout + first.stderr
    assert "started run_1" in first.stdout and "crash" in first.stdout
    second = subprocess.run([sys.executable, EXAMPLE, path], capture_output=True, text=True, timeout=60)
    assert second.returncode == 0, second.stdout + second.stderr
    out = second.stdout
    assert "resumed run_1 at iteration 3, message 6, spent 1800 micros" in out, out
    assert "conflict: wrote at" in out, out
    # 6 passes x (100 + 200 + 300); the supervisor's rename and the
    # completion both landed; version = 1 create + 6*(3+1) patches + 2 writes.
    assert "done: state=completed agent=planner-v2 iterations=6 cost_micros=3600 version=27" in out, out
