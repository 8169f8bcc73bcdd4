"""Throwaway PostgreSQL and Redis servers on loopback for the tests.

PostgreSQL refuses to run as root: as root, initdb and postgres run as an
unprivileged user (``postgres`` or one made for it, ``agentstate-pg``)
through ``setpriv``, as the Rust tests do (tests/it/pg_server.rs). A missing
binary fails the tests with the command that installs it: a backend is
never skipped because its server is missing.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from typing import List, Optional

PG_INSTALL = "apt-get update && apt-get install -y postgresql-15"
REDIS_INSTALL = "apt-get update && apt-get install -y redis-server"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pg_bindir() -> str:
    initdb = shutil.which("initdb")
    if initdb:
        real = os.path.dirname(os.path.realpath(initdb))
        if os.path.isfile(os.path.join(real, "postgres")):
            return real
    dirs = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda d: int(d.split("/")[-2]))
    for d in reversed(dirs):
        if all(os.path.isfile(os.path.join(d, b)) for b in ("initdb", "postgres")):
            return d
    raise RuntimeError(f"the PostgreSQL tests need initdb and postgres; none found. Install them with: {PG_INSTALL}")


def _run(cmd: List[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True)


def _server_user() -> Optional[str]:
    if os.getuid() != 0:
        return None
    for u in ("postgres", "agentstate-pg"):
        if _run(["id", "-u", u]).returncode == 0:
            return u
    _run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", "agentstate-pg"])
    if _run(["id", "-u", "agentstate-pg"]).returncode != 0:
        raise RuntimeError("running as root, and no unprivileged user to run PostgreSQL as (useradd agentstate-pg failed)")
    return "agentstate-pg"


class PgServer:
    def __init__(self) -> None:
        self.bindir = _pg_bindir()
        self.user = _server_user()
        self.root = tempfile.mkdtemp(prefix="agentstate-py-pg-")
        os.chmod(self.root, 0o755)
        if self.user:
            subprocess.run(["chown", f"{self.user}:", self.root], check=True)
        self.data = os.path.join(self.root, "data")
        out = _run(self._as_user("initdb") + ["-U", "agentstate", "-A", "trust", "-E", "UTF8", "--locale=C", "-N", "-D", self.data])
        if out.returncode != 0:
            raise RuntimeError(f"initdb failed: {out.stdout}{out.stderr}")
        self.proc: Optional[subprocess.Popen] = None
        for _ in range(5):
            self.port = free_port()
            if self._spawn():
                return
        raise RuntimeError(f"postgres did not start; see {self.root}/log")

    def _as_user(self, binary: str) -> List[str]:
        path = os.path.join(self.bindir, binary)
        if not self.user:
            return [path]
        group = _run(["id", "-gn", self.user]).stdout.strip()
        return ["setpriv", f"--reuid={self.user}", f"--regid={group}", "--init-groups", "--", path]

    def _spawn(self) -> bool:
        log = open(os.path.join(self.root, "log"), "ab")
        self.proc = subprocess.Popen(
            self._as_user("postgres")
            + ["-D", self.data, "-p", str(self.port), "-c", "listen_addresses=127.0.0.1", "-c", f"unix_socket_directories={self.root}",
               "-c", "max_connections=300", "-c", "fsync=off"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
        )
        deadline = time.time() + 60
        while time.time() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    pass
                # The port answers; wait until it accepts a session.
                from agentstate_rs import PostgresStateStore, StateError

                try:
                    PostgresStateStore(self.dsn("postgres"), pool_size=1, connect_timeout=2).sync().setup()
                    return True
                except StateError:
                    pass
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"postgres did not answer in 60 s; see {self.root}/log")

    def dsn(self, db: str = "postgres") -> str:
        return f"postgres://agentstate@127.0.0.1:{self.port}/{db}"

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)  # fast shutdown
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        shutil.rmtree(self.root, ignore_errors=True)


class RedisServer:
    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if not binary:
            raise RuntimeError(f"the Redis tests need redis-server; none found. Install it with: {REDIS_INSTALL}")
        self.root = tempfile.mkdtemp(prefix="agentstate-py-redis-")
        for _ in range(5):
            self.port = free_port()
            self.proc = subprocess.Popen(
                [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.root, "--save", "",
                 "--appendonly", "yes", "--appendfsync", "always", "--maxmemory-policy", "noeviction"],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            )
            deadline = time.time() + 30
            while time.time() < deadline and self.proc.poll() is None:
                try:
                    with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                        s.sendall(b"PING\r\n")
                        if s.recv(64).startswith(b"+PONG"):
                            return
                except OSError:
                    pass
                time.sleep(0.05)
            self.proc.kill()
        raise RuntimeError("redis-server did not start")

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        shutil.rmtree(self.root, ignore_errors=True)
