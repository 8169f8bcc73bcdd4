"""The shipped conformance suite against every store of the package."""

from __future__ import annotations

import shutil
import tempfile
from typing import Any

import pytest

from agentstate_rs import FileStateStore, MemoryStateStore, PostgresStateStore, RedisStateStore
from agentstate_rs.testing import StateStoreConformance


class TestMemoryStateStore(StateStoreConformance):
    def make_store(self) -> Any:
        return MemoryStateStore(clock=self.clock)


class TestFileStateStore(StateStoreConformance):
    def make_store(self) -> Any:
        self.dir = tempfile.mkdtemp(prefix="agentstate-py-file-")
        return FileStateStore(self.dir + "/store", clock=self.clock)

    async def close_store(self, store: Any) -> None:
        await store.close()
        shutil.rmtree(self.dir, ignore_errors=True)


class TestPostgresStateStore(StateStoreConformance):
    @pytest.fixture(autouse=True)
    def _server(self, pg_dsn: str) -> None:
        self.dsn = pg_dsn

    def make_store(self) -> Any:
        return PostgresStateStore(self.dsn, pool_size=8, clock=self.clock)


class TestRedisStateStore(StateStoreConformance):
    @pytest.fixture(autouse=True)
    def _server(self, redis_url: str) -> None:
        self.url = redis_url

    def make_store(self) -> Any:
        return RedisStateStore(self.url, clock=self.clock)
