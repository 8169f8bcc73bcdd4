"""``StateStoreConformance``: the conformance suite as a pytest base class.

Subclass it, return the store under test from ``make_store``, and inherit
the suite::

    class TestMyStore(StateStoreConformance):
        def make_store(self):
            return MyStore(clock=self.clock)

Every test opens a store of its own with ``make_store`` (``self.clock`` is a
fresh ``ManualClock`` the store may be given), works under tenants and
namespaces no other test uses (so stores on one shared server are fine),
and closes the store at the end (``close_store``). The tests are plain
functions that drive asyncio themselves: no pytest plugin is needed.

It covers the version rules, patch commutativity under concurrency (asyncio
tasks and threads), scrubbing, cursor paging that visits every record
exactly once while others write, tenant isolation on reads and listings,
sessions, and the tray rules (fencing, batches, release, the sweeper's
listing), alarms, idempotency keys, spend caps and the change feed.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from typing import Any, Awaitable, Callable, Dict, List, Optional, Type

from ._native import (
    Caps,
    FeedScope,
    Hold,
    InstanceKey,
    ManualClock,
    RunKey,
    RunRecord,
    RunState,
    SessionKey,
    SessionRecord,
    StateDelta,
    StateQuery,
    ToolCall,
    Tray,
    TrayOp,
    Usage,
)
from .errors import (
    BudgetExceededError,
    FenceLostError,
    StateConflictError,
    StateError,
    StateInUseError,
    StateInvalidError,
    StateNotFoundError,
    StatePersistenceError,
)

__all__ = ["StateStoreConformance", "unique"]

#: A secret of each kind the scrubber knows, in tool-call arguments.
SECRETS = {
    "api_key": "sk-live-4f9c2a7e1b8d6053aa",
    "password": "hunter2-Xq7-correct-horse",
}
SECRET_ARGUMENTS = (
    '{"api_key": "%s", "city": "Paris", "password": "%s"}' % (SECRETS["api_key"], SECRETS["password"])
)


def unique(prefix: str) -> str:
    """A name no other test uses."""
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


async def _expect(exc: Type[BaseException], aw: Awaitable[Any], why: str) -> Any:
    try:
        got = await aw
    except exc as e:
        return e
    except StateError as e:  # another failure than the one the rule names
        raise AssertionError(f"{why}: expected {exc.__name__}, got {type(e).__name__}: {e}") from e
    raise AssertionError(f"{why}: expected {exc.__name__}, the call returned {got!r}")


class StateStoreConformance:
    """The suite. Subclasses define ``make_store``."""

    #: How many concurrent writers the commutativity tests use.
    tasks: int = 24
    threads: int = 4

    clock: ManualClock

    def make_store(self) -> Any:
        raise NotImplementedError("return the store under test")

    async def close_store(self, store: Any) -> None:
        close = getattr(store, "close", None)
        if close is not None:
            await close()

    # --- machinery -----------------------------------------------------

    def _run(self, body: Callable[[Any], Awaitable[None]]) -> None:
        self.clock = ManualClock(1_700_000_000_000)
        store = self.make_store()

        async def main() -> None:
            try:
                await body(store)
            finally:
                await self.close_store(store)

        asyncio.run(main())

    @staticmethod
    async def _create(store: Any, tenant: str, n: int, prefix: str = "r", **kw: Any) -> List[RunRecord]:
        return [await store.put_run(RunRecord(run_id=f"{prefix}{i:03}", tenant=tenant, agent_name="planner", **kw)) for i in range(n)]

    @staticmethod
    async def _walk(store: Any, query: StateQuery, between: Optional[Callable[[], Awaitable[None]]] = None) -> List[RunRecord]:
        """The seeds' loop: the next page sends only the tenant and the cursor."""
        seen: List[RunRecord] = []
        page = await store.list_runs(query)
        seen.extend(page.items)
        pages = 1
        while page.cursor is not None:
            assert len(page.items) > 0, "a page that carries a cursor is never empty"
            if between is not None:
                await between()
            page = await store.list_runs(StateQuery(query.tenant, limit=query.limit, cursor=page.cursor))
            seen.extend(page.items)
            pages += 1
            assert pages < 10_000, "the walk does not end"
        return seen

    # --- versions (R) ------------------------------------------------------

    def test_r1_create_at_zero_commits_at_one(self) -> None:
        async def body(store: Any) -> None:
            t = unique("r1")
            run = await store.put_run(RunRecord(run_id="run_1", tenant=t, agent_name="planner"))
            assert run.version == 1, "a create (version 0) commits at version 1"
            assert run.key == RunKey(t, "run_1")
            got = await store.get_run(run.key)
            assert got is not None and got.version == 1 and got.agent_name == "planner"
            assert await store.get_run(RunKey(t, "nope")) is None

        self._run(body)

    def test_r2_update_at_n_commits_at_n_plus_one(self) -> None:
        async def body(store: Any) -> None:
            t = unique("r2")
            run = await store.put_run(RunRecord(run_id="run_1", tenant=t, agent_name="planner"))
            for n in range(1, 5):
                run.state = RunState.RUNNING
                run.agent_name = f"planner-{n}"
                run = await store.put_run(run)
                assert run.version == n + 1, f"an update at {n} commits at {n + 1}, got {run.version}"
            got = await store.get_run(run.key)
            assert got is not None and got.version == 5 and got.agent_name == "planner-4"

        self._run(body)

    def test_r2_stale_write_raises_conflict_with_both_versions(self) -> None:
        async def body(store: Any) -> None:
            t = unique("r2s")
            run = await store.put_run(RunRecord(run_id="run_1", tenant=t, agent_name="planner"))
            stale = run.copy()
            await store.patch_run(run.key, StateDelta(iterations=1))
            stale.agent_name = "stale-writer"
            e = await _expect(StateConflictError, store.put_run(stale), "a write at a stale version")
            assert (e.expected_version, e.actual_version) == (1, 2), (e.expected_version, e.actual_version)
            got = await store.get_run(run.key)
            assert got is not None and got.version == 2 and got.agent_name == "planner", "a refused write changed the run"
            again = RunRecord(run_id="run_1", tenant=t, agent_name="other")
            e = await _expect(StateConflictError, store.put_run(again), "a create of a run that exists")
            assert (e.expected_version, e.actual_version) == (0, 2)

        self._run(body)

    def test_r2_create_race_has_one_winner(self) -> None:
        async def body(store: Any) -> None:
            t = unique("r2r")

            async def create(i: int) -> Any:
                try:
                    return await store.put_run(RunRecord(run_id="same", tenant=t, agent_name=f"w{i}"))
                except StateConflictError as e:
                    return e

            out = await asyncio.gather(*(create(i) for i in range(self.tasks)))
            wins = [o for o in out if isinstance(o, RunRecord)]
            losses = [o for o in out if isinstance(o, StateConflictError)]
            assert len(wins) == 1, f"{len(wins)} creates of one run succeeded"
            assert len(losses) == self.tasks - 1
            assert all((e.expected_version, e.actual_version) == (0, 1) for e in losses)
            got = await store.get_run(RunKey(t, "same"))
            assert got is not None and got.agent_name == wins[0].agent_name

        self._run(body)

    def test_r2_versioned_race_one_winner_per_round_across_threads(self) -> None:
        async def body(store: Any) -> None:
            t = unique("r2t")
            key = (await store.put_run(RunRecord(run_id="run", tenant=t, agent_name="p"))).key
            for round_ in range(3):
                current = await store.get_run(key)
                assert current is not None
                results: List[Any] = []
                lock = threading.Lock()

                def worker(i: int) -> None:
                    mine = current.copy()
                    mine.agent_name = f"t{i}"

                    async def go() -> Any:
                        try:
                            return await store.put_run(mine)
                        except StateConflictError as e:
                            return e

                    r = asyncio.run(go())
                    with lock:
                        results.append(r)

                threads = [threading.Thread(target=worker, args=(i,)) for i in range(self.threads)]
                for th in threads:
                    th.start()
                for th in threads:
                    th.join()
                wins = [r for r in results if isinstance(r, RunRecord)]
                assert len(wins) == 1, f"round {round_}: {len(wins)} writers at one version won"
                assert wins[0].version == current.version + 1

        self._run(body)

    # --- patches (R4) ---------------------------------------------------------

    def test_r4_patch_adds_and_bumps_the_version(self) -> None:
        async def body(store: Any) -> None:
            t = unique("r4")
            run = await store.put_run(RunRecord(run_id="run_1", tenant=t, agent_name="planner"))
            d = StateDelta(usage=Usage(input_tokens=10, output_tokens=5), cost_micros=1_200, iterations=1, messages_read=2)
            run = await store.patch_run(run.key, d)
            run = await store.patch_run(run.key, d)
            assert run.version == 3
            assert (run.cost_micros, run.iterations, run.messages_read) == (2_400, 2, 4)
            assert (run.usage.input_tokens, run.usage.output_tokens) == (20, 10)
            await _expect(StateNotFoundError, store.patch_run(RunKey(t, "ghost"), d), "a patch of a missing run")
            assert await store.get_run(RunKey(t, "ghost")) is None, "a patch invented a run"

        self._run(body)

    def test_r4_negative_amounts_are_refused(self) -> None:
        makers: List[Callable[[], Any]] = [
            lambda: StateDelta(cost_micros=-1),
            lambda: StateDelta(iterations=-2),
            lambda: StateDelta(messages_read=-3),
            lambda: Usage(input_tokens=-1),
        ]
        for i, make in enumerate(makers):
            try:
                make()
            except (StateInvalidError, ValueError, OverflowError):
                continue
            raise AssertionError(f"negative amount {i} was accepted")

    def test_r4_patches_commute_across_tasks(self) -> None:
        async def body(store: Any) -> None:
            t = unique("r4c")
            run = await store.put_run(RunRecord(run_id="run", tenant=t, agent_name="p"))
            per = 5

            async def spend(i: int) -> None:
                for _ in range(per):
                    await store.patch_run(run.key, StateDelta(cost_micros=i + 1, iterations=1))

            await asyncio.gather(*(spend(i) for i in range(self.tasks)))
            got = await store.get_run(run.key)
            n = self.tasks * per
            assert got is not None
            assert got.iterations == n, f"{n} patches added {got.iterations} iterations"
            assert got.cost_micros == per * sum(range(1, self.tasks + 1)), got.cost_micros
            assert got.version == 1 + n

        self._run(body)

    def test_r4_patches_commute_across_threads(self) -> None:
        async def body(store: Any) -> None:
            t = unique("r4t")
            run = await store.put_run(RunRecord(run_id="run", tenant=t, agent_name="p"))
            per, tasks = 5, 3
            errors: List[BaseException] = []

            def worker() -> None:
                async def go() -> None:
                    async def one() -> None:
                        for _ in range(per):
                            await store.patch_run(run.key, StateDelta(cost_micros=7, usage=Usage(output_tokens=3)))

                    await asyncio.gather(*(one() for _ in range(tasks)))

                try:
                    asyncio.run(go())
                except BaseException as e:  # reported below
                    errors.append(e)

            ths = [threading.Thread(target=worker) for _ in range(self.threads)]
            for th in ths:
                th.start()
            for th in ths:
                th.join()
            assert not errors, errors
            n = self.threads * tasks * per
            got = await store.get_run(run.key)
            assert got is not None
            assert (got.cost_micros, got.usage.output_tokens, got.version) == (7 * n, 3 * n, 1 + n)

        self._run(body)

    # --- scrubbing (X) ------------------------------------------------------

    def test_x1_tool_call_arguments_are_scrubbed_on_write(self) -> None:
        async def body(store: Any) -> None:
            t = unique("x1")
            call = ToolCall("call_1", "weather", SECRET_ARGUMENTS)
            rec = RunRecord(run_id="run_1", tenant=t, agent_name="p", pending_tool_calls=[call])
            assert rec.mid_tool_call
            stored = await store.put_run(rec)
            want = rec.scrubbed().pending_tool_calls[0].arguments
            for label, r in (("the returned record", stored), ("the stored record", await store.get_run(rec.key))):
                assert r is not None and r.mid_tool_call, f"{label} lost its pending tool call"
                args = r.pending_tool_calls[0].arguments
                for name, secret in SECRETS.items():
                    assert secret not in args, f"{label} holds the {name} unscrubbed"
                assert args == want, f"{label} is not record.scrubbed(): {args!r} != {want!r}"
                assert "Paris" in args, "scrubbing removed more than the secrets"
            page = await store.list_runs(StateQuery(t))
            assert all(s not in page.items[0].pending_tool_calls[0].arguments for s in SECRETS.values()), "a listing shows a secret"
            again = stored.copy()
            again.pending_tool_calls = [call, ToolCall("call_2", "search", SECRET_ARGUMENTS)]
            updated = await store.put_run(again)
            assert all(s not in c.arguments for c in updated.pending_tool_calls for s in SECRETS.values()), "an update wrote a secret"

        self._run(body)

    def test_r11_labels_are_stored_scrubbed_and_filterable(self) -> None:
        async def body(store: Any) -> None:
            t = unique("r11")
            labels = {"user": "u-1", "n": 3, "nested": {"b": [1, None], "a": "é"}, "api_key": SECRETS["api_key"]}
            stored = await store.put_run(RunRecord(run_id="run_1", tenant=t, agent_name="p", labels=labels))
            for what, r in (("the returned record", stored), ("the stored record", await store.get_run(stored.key))):
                assert r is not None
                got = r.labels
                assert got["user"] == "u-1" and got["n"] == 3 and got["nested"] == labels["nested"], f"{what}: {got!r}"
                assert SECRETS["api_key"] not in repr(got), f"{what} holds a label unscrubbed"
            patched = await store.patch_run(stored.key, StateDelta(iterations=1))
            assert patched.labels == stored.labels, "a patch changed the labels"
            for i in range(10):
                await store.put_run(
                    RunRecord(run_id=f"r{i:02}", tenant=t, agent_name="p", labels={"team": "a" if i % 3 == 0 else "b"})
                )
            seen = await self._walk(store, StateQuery(t, label=("team", "a"), limit=2))
            assert [r.run_id for r in seen] == [f"r{i:02}" for i in range(0, 10, 3)], [r.run_id for r in seen]
            none = await store.list_runs(StateQuery(t, label=("team", "c")))
            assert len(none.items) == 0 and none.cursor is None, "a label value no run holds"

        self._run(body)

    # --- listings (L) ------------------------------------------------------

    def test_l1_walk_visits_every_record_once_in_insertion_order(self) -> None:
        async def body(store: Any) -> None:
            t = unique("l1")
            made = await self._create(store, t, 23)
            seen = await self._walk(store, StateQuery(t, limit=5))
            assert [r.run_id for r in seen] == [r.run_id for r in made], "the walk is not the insertion order, each run once"
            end = await store.list_runs(StateQuery(unique("empty")))
            assert len(end.items) == 0 and end.cursor is None, "an empty listing carries a cursor"

        self._run(body)

    def test_l2_walk_while_others_write_sees_each_record_once(self) -> None:
        async def body(store: Any) -> None:
            t = unique("l2")
            made = await self._create(store, t, 20)
            counter = [0]

            async def write_more() -> None:
                # Others create runs and update old ones while the walk goes on.
                counter[0] += 1
                await store.put_run(RunRecord(run_id=f"new{counter[0]:03}", tenant=t, agent_name="late"))
                old = await store.get_run(made[counter[0] % len(made)].key)
                assert old is not None
                old.state = RunState.RUNNING
                await store.put_run(old)
                await store.patch_run(made[0].key, StateDelta(iterations=1))

            seen = await self._walk(store, StateQuery(t, limit=3), between=write_more)
            ids = [r.run_id for r in seen]
            assert len(ids) == len(set(ids)), f"the walk returned a run twice: {sorted(i for i in ids if ids.count(i) > 1)}"
            missing = {r.run_id for r in made} - set(ids)
            assert not missing, f"the walk skipped runs that existed before it began: {sorted(missing)}"

        self._run(body)

    def test_l3_order_is_the_stores_counter_never_the_clock(self) -> None:
        async def body(store: Any) -> None:
            t = unique("l3")
            made = []
            # The clock goes backwards between writes (workers' clocks disagree).
            for i in range(9):
                self.clock.set(1_700_000_000_000 - i * 60_000)
                made.append(await store.put_run(RunRecord(run_id=f"z{8 - i}", tenant=t, agent_name="p")))
            seen = await self._walk(store, StateQuery(t, limit=2))
            assert [r.run_id for r in seen] == [r.run_id for r in made], (
                "listings are ordered by the store's insertion counter, not by a timestamp or an id: "
                f"{[r.run_id for r in seen]}"
            )
            before = await store.list_runs(StateQuery(t, updated_before=1_700_000_000_000 - 4 * 60_000 + 1))
            assert sorted(r.run_id for r in before.items) == sorted(f"z{8 - i}" for i in range(4, 9)), "updated_before filters"

        self._run(body)

    def test_l7_next_page_with_only_the_cursor_keeps_the_filters(self) -> None:
        async def body(store: Any) -> None:
            t = unique("l7")
            for i in range(18):
                await store.put_run(
                    RunRecord(run_id=f"r{i:02}", tenant=t, agent_name="p", state=RunState.RUNNING if i % 3 == 0 else RunState.PAUSED)
                )
            seen = await self._walk(store, StateQuery(t, state=RunState.RUNNING, limit=2))
            assert [r.run_id for r in seen] == [f"r{i:02}" for i in range(0, 18, 3)], [r.run_id for r in seen]
            assert all(r.state == RunState.RUNNING for r in seen)

        self._run(body)

    def test_l6_cursor_with_another_tenant_or_filters_is_invalid(self) -> None:
        async def body(store: Any) -> None:
            ta, tb = unique("l6a"), unique("l6b")
            await self._create(store, ta, 6, state=RunState.RUNNING)
            await self._create(store, tb, 6, state=RunState.RUNNING)
            first = await store.list_runs(StateQuery(ta, state=RunState.RUNNING, limit=2))
            assert first.cursor is not None
            await _expect(
                StateInvalidError, store.list_runs(StateQuery(tb, cursor=first.cursor)), "a cursor presented with another tenant"
            )
            await _expect(
                StateInvalidError,
                store.list_runs(StateQuery(ta, state=RunState.COMPLETED, cursor=first.cursor)),
                "a cursor presented with other filters",
            )
            tampered = first.cursor[:-1] + ("A" if first.cursor[-1] != "A" else "B")
            await _expect(StateInvalidError, store.list_runs(StateQuery(ta, cursor=tampered)), "an altered cursor")

        self._run(body)

    # --- tenants -------------------------------------------------------------

    def test_tenant_isolation_on_reads_and_listings(self) -> None:
        async def body(store: Any) -> None:
            ta, tb = unique("ta"), unique("tb")
            a = await store.put_run(RunRecord(run_id="shared_id", tenant=ta, agent_name="a"))
            assert await store.get_run(RunKey(tb, "shared_id")) is None, "tenant B reads tenant A's run"
            b = await store.put_run(RunRecord(run_id="shared_id", tenant=tb, agent_name="b"))
            assert b.version == 1, "the same id under another tenant is another run"
            await store.patch_run(a.key, StateDelta(cost_micros=5))
            got_b = await store.get_run(b.key)
            assert got_b is not None and got_b.cost_micros == 0 and got_b.agent_name == "b"
            await self._create(store, ta, 4, prefix="only_a")
            listed_b = await self._walk(store, StateQuery(tb, limit=2))
            assert [(r.tenant, r.run_id) for r in listed_b] == [(tb, "shared_id")], "tenant B's listing shows another tenant's runs"
            await store.put_session(SessionRecord("s", ta))
            assert await store.get_session(SessionKey(tb, "s")) is None

        self._run(body)

    # --- sessions (S) -------------------------------------------------------

    def test_s2_delete_session_with_live_runs_raises_in_use_cascade_deletes(self) -> None:
        async def body(store: Any) -> None:
            t = unique("s2")
            s = await store.put_session(SessionRecord("sess", t, metadata={"user": "u1"}))
            assert s.version == 1
            live = await store.put_run(RunRecord(run_id="live", tenant=t, agent_name="p", session_id="sess", state=RunState.RUNNING))
            done = await store.put_run(RunRecord(run_id="done", tenant=t, agent_name="p", session_id="sess", state=RunState.COMPLETED))
            e = await _expect(StateInUseError, store.delete_session(s.key), "deleting a session with an unfinished run")
            assert [k.run_id for k in e.runs] == ["live"], f"StateInUseError names the unfinished runs: {e.runs}"
            assert await store.get_session(s.key) is not None, "a refused delete deleted"
            deleted = await store.delete_session(s.key, cascade=True)
            assert sorted(k.run_id for k in deleted) == ["done", "live"]
            assert await store.get_session(s.key) is None
            assert await store.get_run(live.key) is None and await store.get_run(done.key) is None

        self._run(body)

    # --- trays (T) -----------------------------------------------------------

    def test_t2_epoch_fences_every_tray_operation(self) -> None:
        async def body(store: Any) -> None:
            ns = unique("t2")
            inst = InstanceKey(ns, "i")
            k = inst.tray("t", "a")
            assert await store.epoch(inst) == 0
            await store.write_tray(k, 2, Tray(b"v2", marked=True, env="e"))
            assert await store.epoch(inst) == 2
            e = await _expect(FenceLostError, store.write_tray(k, 1, Tray(b"stale")), "a write at an older epoch")
            assert (e.caller_epoch, e.stored_epoch) == (1, 2)
            await _expect(FenceLostError, store.read_tray(k, 1), "a read at an older epoch")
            await _expect(FenceLostError, store.delete_tray(k, 1), "a delete at an older epoch")
            got = await store.read_tray(k, 2)
            assert got is not None and got.doc == b"v2" and got.marked, "a fenced write changed the tray"
            await store.write_tray(k, 3, Tray(b"v3"))
            assert await store.epoch(inst) == 3
            assert await store.delete_tray(k, 3) is True
            assert await store.read_tray(k, 3) is None

        self._run(body)

    def test_t3_batch_all_or_nothing(self) -> None:
        async def body(store: Any) -> None:
            ns, env = unique("t3"), unique("t3env")
            inst = InstanceKey(ns, "i")

            async def state() -> Dict[str, bytes]:
                page = await store.list_trays(inst, 3, limit=100)
                return {k.tray_id: t.doc for k, t in page.items}

            await store.apply_batch(inst, 1, [TrayOp.put("t", "a", Tray(b"a0", env=env)), TrayOp.put("t", "b", Tray(b"b0", marked=True, env=env))])
            await store.apply_batch(
                inst,
                1,
                [TrayOp.put("t", "c", Tray(b"c1", marked=True, env=env)), TrayOp.delete("t", "a"), TrayOp.put("t", "b", Tray(b"b1", env=env)), TrayOp.delete("t", "never")],
            )
            assert await state() == {"b": b"b1", "c": b"c1"}
            before = await state()
            big = TrayOp.put("t", "big", Tray(b"\x01" * 1_100_000, env=env))
            e = await _expect(
                StatePersistenceError,
                store.apply_batch(inst, 2, [TrayOp.put("t", "d", Tray(b"d", env=env)), TrayOp.delete("t", "b"), big]),
                "a batch whose last op is too large",
            )
            assert e.reason == "too_large", e.reason
            assert await state() == before, "a refused batch applied part of itself"
            await store.write_tray(inst.tray("t", "c"), 3, Tray(b"c3", marked=True, env=env))
            before = await state()
            await _expect(FenceLostError, store.apply_batch(inst, 2, [TrayOp.delete("t", "b")]), "a fenced batch")
            assert await state() == before, "a fenced batch applied part of itself"

        self._run(body)

    def test_t4_release_unmarks_and_a_stale_release_is_a_noop(self) -> None:
        async def body(store: Any) -> None:
            ns, env = unique("t4"), unique("t4env")
            inst = InstanceKey(ns, "i")
            await store.apply_batch(inst, 5, [TrayOp.put("t", x, Tray(x.encode(), marked=True, env=env)) for x in "abc"])
            await store.release(inst, 4)
            assert len((await store.marked_trays(env)).items) == 3, "a release at an older epoch unmarked trays"
            await store.release(inst, 5)
            assert len((await store.marked_trays(env)).items) == 0, "a release left trays marked"
            page = await store.list_trays(inst, 5)
            assert sorted(t.doc for _, t in page.items) == [b"a", b"b", b"c"], "a release changed docs"

        self._run(body)

    def test_t5_sweeper_lists_marked_trays_once_per_walk(self) -> None:
        async def body(store: Any) -> None:
            env, other = unique("t5env"), unique("t5other")
            want = set()
            for n in range(4):
                inst = InstanceKey(unique("t5"), f"i{n}")
                ops = [TrayOp.put("t", f"m{j}", Tray(b"x", marked=True, env=env, hostname="h")) for j in range(3)]
                ops.append(TrayOp.put("t", "clean", Tray(b"x", marked=False, env=env)))
                await store.apply_batch(inst, 1, ops)
                await store.write_tray(inst.tray("t", "elsewhere"), 1, Tray(b"x", marked=True, env=other))
                want |= {(inst.ns, inst.id, f"m{j}") for j in range(3)}
            seen: List[Any] = []
            page = await store.marked_trays(env, limit=5)
            seen += page.items
            while page.cursor is not None:
                page = await store.marked_trays(env, limit=5, cursor=page.cursor)
                seen += page.items
            got = [(m.key.ns, m.key.id, m.key.tray_id) for m in seen]
            assert len(got) == len(set(got)), "the sweeper saw a tray twice"
            assert set(got) == want, f"the sweeper's listing: missing {want - set(got)}, extra {set(got) - want}"
            assert all(m.env == env and m.hostname == "h" for m in seen)

        self._run(body)

    # --- alarms (A) -------------------------------------------------------

    def test_a_alarms_set_due_ack(self) -> None:
        async def body(store: Any) -> None:
            inst = InstanceKey(unique("a"), "i")
            await store.set_alarm(inst, 1, 5_000)
            await store.set_alarm(inst, 1, 6_000)  # replaces
            def mine(page: Any) -> List[Any]:
                return [a for a in page.items if a.instance == inst]

            assert mine(await store.due_alarms(5_999, limit=1000)) == [], "a replaced alarm fired"
            due = mine(await store.due_alarms(6_000, limit=1000))
            assert [a.due_at for a in due] == [6_000]
            assert await store.ack_alarm(inst, 1, 5_000) is False, "an ack of another due time removed the alarm"
            assert await store.ack_alarm(inst, 1, 6_000) is True
            assert mine(await store.due_alarms(10_000, limit=1000)) == []

        self._run(body)

    # --- idempotency (I) ---------------------------------------------------

    def test_i1_idempotent_patch_applies_once(self) -> None:
        async def body(store: Any) -> None:
            t = unique("i1")
            run = await store.put_run(RunRecord(run_id="run", tenant=t, agent_name="p"))
            first = await store.patch_run_idempotent(run.key, StateDelta(cost_micros=500), "call-1")
            again = await store.patch_run_idempotent(run.key, StateDelta(cost_micros=500), "call-1")
            assert first.cost_micros == again.cost_micros == 500 and first.version == again.version == 2
            got = await store.get_run(run.key)
            assert got is not None and got.cost_micros == 500, "a repeated key added twice"
            other = await store.patch_run_idempotent(run.key, StateDelta(cost_micros=500), "call-2")
            assert other.cost_micros == 1_000

        self._run(body)

    # --- spend caps (B) ----------------------------------------------------

    def test_b_reserve_settle_release_under_caps(self) -> None:
        async def body(store: Any) -> None:
            t = unique("b")
            run = await store.put_run(RunRecord(run_id="run", tenant=t, agent_name="p", caps=Caps(cost_micros_max=1_000)))
            await store.reserve(run.key, Hold("h1", 60_000, cost_micros=600))
            e = await _expect(BudgetExceededError, store.reserve(run.key, Hold("h2", 60_000, cost_micros=500)), "a reserve past the cap")
            assert (e.scope, e.amount, e.max, e.held, e.asked) == ("run", "cost_micros", 1_000, 600, 500)
            settled = await store.settle(run.key, "h1", StateDelta(cost_micros=300))
            assert settled.record.cost_micros == 300 and settled.overshoot.is_zero()
            await store.reserve(run.key, Hold("h3", 60_000, cost_micros=700))
            await store.release_hold(run.key, "h3")
            spend = await store.run_spend(run.key)
            assert spend is not None and spend.spent.cost_micros == 300 and spend.held.cost_micros == 0

            # Racing reserves: never more held than the cap allows.
            async def grab(i: int) -> bool:
                try:
                    await store.reserve(run.key, Hold(f"r{i}", 60_000, cost_micros=100))
                    return True
                except BudgetExceededError:
                    return False

            won = sum(await asyncio.gather(*(grab(i) for i in range(12))))
            assert won == 7, f"{won} holds of 100 fit under 1000 - 300 spent"

        self._run(body)

    # --- the change feed (F) -----------------------------------------------

    def test_f_feed_reads_each_record_once_then_its_tombstone(self) -> None:
        async def body(store: Any) -> None:
            t = unique("f")
            scope = FeedScope.tenant(t)
            other = FeedScope.tenant(unique("f-other"))
            head, other_head = await store.feed_head(scope), await store.feed_head(other)

            async def read(after: int, limit: int) -> List[Any]:
                """The feed after `after`, `limit` a page, to its end (F2)."""
                out: List[Any] = []
                while True:
                    page = await store.changes(scope, after, limit)
                    if not page.changes:
                        assert page.next == after, "an empty page moves the position"
                        return out
                    positions = [c.position for c in page.changes]
                    assert positions == sorted(set(positions)) and positions[0] > after, f"positions not increasing: {positions}"
                    assert len(page.changes) <= limit and page.next == positions[-1]
                    out.extend(page.changes)
                    after = page.next
                    assert len(out) < 10_000, "the feed does not end"

            await store.put_session(SessionRecord("s", t))
            run = await store.put_run(RunRecord(run_id="r", tenant=t, agent_name="p", session_id="s"))
            for _ in range(4):
                run = await store.patch_run(run.key, StateDelta(iterations=1))
            await store.put_run(RunRecord(run_id="r2", tenant=t, agent_name="p"))
            changes = await read(head, 1)
            # F1: each record once, in its current state, at its last write.
            assert [(c.kind, c.key) for c in changes] == [
                ("session", SessionKey(t, "s")),
                ("run", run.key),
                ("run", RunKey(t, "r2")),
            ], f"the feed is not one change per record in commit order: {changes}"
            assert changes[1].run.version == 5 and changes[1].run.iterations == 4, "a change holds the record as it is now"
            assert [c.position for c in await read(head, 100)] == [c.position for c in changes], "page sizes read different feeds"
            # Deletes are tombstones (the cascaded run's too).
            await store.delete_session(SessionKey(t, "s"), cascade=True)
            gone = await read(changes[-1].position, 100)
            assert sorted((c.kind, c.deleted, c.record is None) for c in gone) == [
                ("run_deleted", True, True),
                ("session_deleted", True, True),
            ], f"deletes are not tombstones: {gone}"
            # F3: another tenant's feed holds none of it.
            assert len(await store.changes(other, other_head)) == 0, "another tenant's feed shows this tenant's writes"

        self._run(body)
