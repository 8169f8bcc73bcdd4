"""A Rust process and this Python process race on one run of one
PostgreSQL database: each round both write it at the same version, and
exactly one of them wins.

The Rust side is python/examples/race.rs; python/ci.sh builds it and
names it in AGENTSTATE_RACE_BIN (otherwise this test builds it with cargo).
"""

from __future__ import annotations

import os
import subprocess
import threading
from typing import List

import agentstate_rs as A
import agentstate_rs.testing  # noqa: F401  (A.testing.unique)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def race_binary() -> str:
    path = os.environ.get("AGENTSTATE_RACE_BIN")
    if path:
        assert os.access(path, os.X_OK), f"AGENTSTATE_RACE_BIN={path} is not an executable"
        return path
    subprocess.run(
        ["cargo", "build", "--release", "-p", "agentstate-py", "--example", "race"],
        cwd=ROOT, check=True,
    )
    return os.path.join(ROOT, "target", "release", "examples", "race")


def test_rust_and_python_race_one_winner_per_round(pg_dsn: str) -> None:
    tenant, run_id = A.testing.unique("xlang"), "contested"
    store = A.PostgresStateStore(pg_dsn, pool_size=2).sync()
    store.setup()
    store.put_run(A.RunRecord(run_id=run_id, tenant=tenant, agent_name="start"))
    rust = subprocess.Popen(
        [race_binary(), pg_dsn, tenant, run_id], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
    )
    try:
        assert rust.stdout is not None and rust.stdin is not None
        assert rust.stdout.readline().strip() == "ready"
        rounds = 40
        wins = {"rust": 0, "python": 0}
        for r in range(rounds):
            version = r + 1
            python_answer: List[str] = []

            def python_put() -> None:
                run = store.get_run(A.RunKey(tenant, run_id))
                assert run is not None
                run.version = version
                run.agent_name = f"python-{version}"
                try:
                    python_answer.append(f"won {store.put_run(run).version}")
                except A.StateConflictError as e:
                    python_answer.append(f"lost {e.expected_version} {e.actual_version}")

            t = threading.Thread(target=python_put)
            rust.stdin.write(f"put {version}\n")
            rust.stdin.flush()
            t.start()
            rust_answer = rust.stdout.readline().strip()
            t.join()
            answers = {"rust": rust_answer, "python": python_answer[0]}
            won = [who for who, a in answers.items() if a.startswith("won")]
            assert len(won) == 1, f"round {r}: {answers}"
            assert answers[won[0]] == f"won {version + 1}"
            loser = "python" if won[0] == "rust" else "rust"
            assert answers[loser] == f"lost {version} {version + 1}", answers
            wins[won[0]] += 1
            final = store.get_run(A.RunKey(tenant, run_id))
            assert final is not None and final.version == version + 1
            assert final.agent_name == f"{won[0]}-{version}", "the stored record is the winner's"
        assert sum(wins.values()) == rounds
        print("wins", wins)
    finally:
        if rust.stdin:
            rust.stdin.close()
        rust.wait(timeout=30)
    assert rust.returncode == 0
