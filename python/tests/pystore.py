"""A store written in Python, with switchable faults: the conformance suite
must pass it when it keeps the rules and fail it when it breaks one.

Runs and sessions are kept here; trays, alarms, idempotency keys and
spend caps are handed to a MemoryStateStore (``__getattr__``).
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any, Callable, Dict, List, Optional

from agentstate_rs import (
    MemoryStateStore,
    RunKey,
    RunRecord,
    StateConflictError,
    StateDelta,
    StateInUseError,
    StateInvalidError,
    StateNotFoundError,
    StateQuery,
    Usage,
)


class _Page:
    def __init__(self, items: List[Any], cursor: Optional[str]) -> None:
        self.items = items
        self.cursor = cursor


class PyStateStore:
    def __init__(self, clock: Callable[[], int], *, scrub: bool = True, order: str = "seq") -> None:
        self.clock = clock
        self.scrub = scrub
        self.order = order  # "seq" (right) or "updated_at" (pages by clock: wrong)
        self.runs: Dict[RunKey, RunRecord] = {}
        self.sessions: Dict[Any, Any] = {}
        self.seq = 0
        self.lock = threading.Lock()
        self.other = MemoryStateStore()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.other, name)

    async def close(self) -> None:
        await self.other.close()

    async def put_run(self, record: RunRecord) -> RunRecord:
        await asyncio.sleep(0)
        with self.lock:
            cur = self.runs.get(record.key)
            actual = cur.version if cur else 0
            if record.version != actual:
                raise StateConflictError(expected_version=record.version, actual_version=actual)
            stored = record.scrubbed() if self.scrub else record.copy()
            stored.version = actual + 1
            if cur is None:
                self.seq += 1
                seqs = self.seq
                created = self.clock()
            else:
                seqs, created, _ = cur_meta(cur)
            self.runs[record.key] = stored
            set_meta(stored, seqs, created, self.clock())
            return stored.copy()

    async def get_run(self, key: RunKey) -> Optional[RunRecord]:
        await asyncio.sleep(0)
        with self.lock:
            r = self.runs.get(key)
            return r.copy() if r else None

    async def patch_run(self, key: RunKey, delta: StateDelta) -> RunRecord:
        await asyncio.sleep(0)
        with self.lock:
            cur = self.runs.get(key)
            if cur is None:
                raise StateNotFoundError(what="run", key=key)
            meta = cur_meta(cur)
            new = cur.copy()
            new.cost_micros += delta.cost_micros
            new.iterations += delta.iterations
            new.messages_read += delta.messages_read
            new.usage = Usage(cur.usage.input_tokens + delta.usage.input_tokens, cur.usage.output_tokens + delta.usage.output_tokens)
            new.version = cur.version + 1
            self.runs[key] = new
            set_meta(new, meta[0], meta[1], self.clock())
            return new.copy()

    async def list_runs(self, q: StateQuery) -> _Page:
        await asyncio.sleep(0)
        filters = {
            "state": q.state.value if q.state else None,
            "session": q.session,
            "agent": q.agent,
            "updated_before": q.updated_before,
            "label": list(q.label) if q.label else None,
        }
        after = None
        if q.cursor is not None:
            try:
                c = json.loads(q.cursor)
            except ValueError:
                raise StateInvalidError("cursor: not one of this store's") from None
            if c["tenant"] != q.tenant:
                raise StateInvalidError("cursor: another tenant's")
            given = {k: v for k, v in filters.items() if v is not None}
            if given and given != {k: v for k, v in c["filters"].items() if v is not None}:
                raise StateInvalidError("cursor: other filters")
            filters, after = c["filters"], c["after"]
        with self.lock:
            rows = [r for r in self.runs.values() if r.tenant == q.tenant]
        sort_key = (lambda r: cur_meta(r)[0]) if self.order == "seq" else (lambda r: META[id(r)][2])
        rows.sort(key=sort_key)
        out = []
        for r in rows:
            if after is not None and sort_key(r) <= after:
                continue
            if filters["state"] and r.state.value != filters["state"]:
                continue
            if filters["updated_before"] is not None and META[id(r)][2] >= filters["updated_before"]:
                continue
            label = filters.get("label")
            if label and (label[0] not in r.labels or r.labels[label[0]] != label[1]):
                continue
            out.append(r)
        page, more = out[: q.limit], len(out) > q.limit
        cursor = json.dumps({"tenant": q.tenant, "filters": filters, "after": sort_key(page[-1])}) if more and page else None
        return _Page([r.copy() for r in page], cursor)

    async def put_session(self, record: Any) -> Any:
        with self.lock:
            cur = self.sessions.get(record.key)
            actual = cur.version if cur else 0
            if record.version != actual:
                raise StateConflictError(expected_version=record.version, actual_version=actual)
            record.version = actual + 1
            self.sessions[record.key] = record
            return record

    async def get_session(self, key: Any) -> Any:
        return self.sessions.get(key)

    async def delete_session(self, key: Any, cascade: bool = False) -> List[RunKey]:
        with self.lock:
            runs = [r for r in self.runs.values() if r.tenant == key.tenant and r.session_id == key.session_id]
            live = [r.key for r in runs if not r.state.is_finished]
            if live and not cascade:
                raise StateInUseError(runs=live)
            for r in runs:
                del self.runs[r.key]
            self.sessions.pop(key, None)
            return [r.key for r in runs]


# (seq, created_at, updated_at) of stored records, by object id: RunRecord
# keeps its store-set fields read-only.
META: Dict[int, tuple] = {}


def set_meta(r: RunRecord, seq: int, created: int, updated: int) -> None:
    META[id(r)] = (seq, created, updated)


def cur_meta(r: RunRecord) -> tuple:
    return META[id(r)]
