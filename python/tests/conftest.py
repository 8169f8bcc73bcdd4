from __future__ import annotations

import os
import sys
from typing import Iterator

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from servers import PgServer, RedisServer  # noqa: E402


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    server = PgServer()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def pg_dsn(pg_server: PgServer) -> str:
    return pg_server.dsn("postgres")


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url(0)

pytest_plugins = ["pytester"]
