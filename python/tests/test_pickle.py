"""Every exception class of the package pickles (celery and multiprocessing
send exceptions between processes): the copy has the same class, str(),
args and attributes, whether it was made by hand, raised by a real store
call, or sent through a real process boundary."""

from __future__ import annotations

import copy
import multiprocessing
import os
import pickle
import sys
from typing import Any, Callable, Dict, Iterator, List, Set, Tuple

import pytest

import agentstate_rs as A
from agentstate_rs import errors

# --- one of each class, made by hand ---------------------------------------------


def by_hand() -> List[BaseException]:
    run, budget = A.RunKey("acme", "run_1"), A.BudgetKey("acme", "team")
    return [
        A.StateError("something failed"),
        A.StateConflictError("version conflict: expected 1, stored 2", expected_version=1, actual_version=2),
        A.StateConflictError(expected_version=0, actual_version=7),  # the default message
        A.StateNotFoundError("not found: run acme/run_1", what="run", key=run),
        A.StateNotFoundError(what="session", key=A.SessionKey("acme", "s")),
        A.StateNotFoundError(what="tray"),
        A.StatePersistenceError("timed out", reason="outcome_unknown", keyed=True),
        A.StatePersistenceError(reason="too_large"),
        A.StateInUseError("session acme/s has unfinished runs", runs=[run, A.RunKey("acme", "run_2")]),
        A.FenceLostError("fence lost: caller epoch 4 < stored epoch 5", caller_epoch=4, stored_epoch=5),
        A.BudgetExceededError(scope="budget", amount="cost_micros", max=1_000, spent=800, held=100, asked=300, budget=budget),
        A.BudgetExceededError("run cap", scope="run", amount="tokens", max=10, spent=0, held=0, asked=11, run=run),
        A.StateFeedPrunedError(
            'the feed of tenant "acme" was pruned through position 42', scope=A.FeedScope.tenant("acme"), horizon=42
        ),
        A.StateFeedPrunedError(scope=A.FeedScope.trays(env="prod"), horizon=2**100),  # the default message
        A.StateInvalidError("invalid input: limit: must be 1..=1000, got 0"),
        A.StateCorruptError("corrupt: checksum mismatch in segment 3"),
        A.StateUnsupportedFormatError("format 9, this build reads up to 4", found=9, supported=4),
        A.StateLockedError("locked: /var/lib/x", path="/var/lib/x", this_process=True),
        A.StateClosedError("MemoryStateStore() is closed"),
        A.StoreForkedError("MemoryStateStore() was opened in its parent process"),
    ]


def exported_exception_classes() -> Set[type]:
    """The classes of agentstate_rs.errors, and every exception class the
    package exports."""
    exported = [getattr(A, n) for n in A.__all__]
    return {getattr(errors, n) for n in errors.__all__} | {c for c in exported if isinstance(c, type) and issubclass(c, BaseException)}


def describe(e: BaseException) -> Tuple[Any, ...]:
    """What must survive: the class, str(), repr(), args and every attribute."""
    return (type(e), str(e), repr(e), e.args, dict(vars(e)))


def assert_same(got: BaseException, want: BaseException) -> None:
    assert type(got) is type(want), (type(got), type(want))
    assert describe(got) == describe(want)


def test_the_cases_cover_every_exported_exception_class() -> None:
    classes = exported_exception_classes()
    assert len(classes) == 14, sorted(c.__name__ for c in classes)
    assert {type(e) for e in by_hand()} == classes


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_every_class_round_trips_through_pickle(protocol: int) -> None:
    for e in by_hand():
        back = pickle.loads(pickle.dumps(e, protocol=protocol))
        assert_same(back, e)
        assert back is not e


def test_attributes_and_properties_survive() -> None:
    e = pickle.loads(pickle.dumps(A.StateConflictError(expected_version=3, actual_version=4)))
    assert (e.expected_version, e.actual_version) == (3, 4)
    assert str(e) == "version conflict: expected 3, stored 4"
    p = pickle.loads(pickle.dumps(A.StatePersistenceError("x", reason="outcome_unknown", keyed=True)))
    assert (p.reason, p.keyed, p.retryable) == ("outcome_unknown", True, True)
    u = pickle.loads(pickle.dumps(A.StateInUseError(runs=[A.RunKey("t", "a")])))
    assert u.runs == [A.RunKey("t", "a")] and isinstance(u.runs[0], A.RunKey)
    f = pickle.loads(pickle.dumps(A.FenceLostError(caller_epoch=1, stored_epoch=2)))
    assert (f.caller_epoch, f.stored_epoch) == (1, 2)
    inv = pickle.loads(pickle.dumps(A.StateInvalidError("bad")))
    assert isinstance(inv, ValueError) and isinstance(inv, A.StateError)
    # An attribute set after the raise (a note, a retry count) goes along.
    e.attempt = 3
    assert pickle.loads(pickle.dumps(e)).attempt == 3


def test_copy_and_deepcopy_keep_the_attributes() -> None:
    for e in by_hand():
        assert_same(copy.copy(e), e)
        assert_same(copy.deepcopy(e), e)


def test_the_keys_they_carry_pickle() -> None:
    keys = [
        A.RunKey("t", "r"),
        A.SessionKey("t", "s"),
        A.BudgetKey("t", "b"),
        A.InstanceKey("ns", "i"),
        A.TrayKey("ns", "i", "tns", "tid"),
        A.FeedScope.tenant("t"),
        A.FeedScope.trays(),
        A.FeedScope.trays(env="prod"),
    ]
    for k in keys:
        for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
            back = pickle.loads(pickle.dumps(k, protocol=protocol))
            assert type(back) is type(k) and back == k and hash(back) == hash(k) and repr(back) == repr(k)


# --- raised by real store calls ----------------------------------------------------


def raise_from_store(kind: str, path: str = "", with_pinned: bool = False) -> None:
    """Makes the store call that raises `kind` (in whichever process runs it).
    `with_pinned`: import pinned's store module first, as the process that
    asks may have (a lost fence is then also pinned's FenceLost)."""
    if with_pinned:
        import pinned.durability.store  # noqa: F401
    store = A.MemoryStateStore().sync()
    run = store.put_run(A.RunRecord(run_id="r", tenant="t", agent_name="p", caps=A.Caps(tokens_max=10)))
    if kind == "conflict":
        store.put_run(A.RunRecord(run_id="r", tenant="t", agent_name="p"))
    elif kind == "not_found_run":
        store.patch_run(A.RunKey("t", "ghost"), A.StateDelta(iterations=1))
    elif kind == "not_found_session":
        store.delete_session(A.SessionKey("t", "ghost"))
    elif kind == "not_found_budget":
        store.put_run(A.RunRecord(run_id="r2", tenant="t", agent_name="p", budget="nob"))
    elif kind == "not_found_hold":
        store.settle(run.key, "ghost", A.StateDelta())
    elif kind == "too_large":
        store.put_run(A.RunRecord(run_id="big", tenant="t", agent_name="p", pending_tool_calls=[A.ToolCall("c", "n", "x" * 2_000_000)]))
    elif kind == "in_use":
        store.put_session(A.SessionRecord("s", "t"))
        store.put_run(A.RunRecord(run_id="live", tenant="t", agent_name="p", session_id="s", state=A.RunState.RUNNING))
        store.delete_session(A.SessionKey("t", "s"))
    elif kind == "fence_lost":
        inst = A.InstanceKey("ns", "i")
        store.write_tray(inst.tray("t", "a"), 5, A.Tray(b"x"))
        store.write_tray(inst.tray("t", "a"), 4, A.Tray(b"y"))
    elif kind == "budget_exceeded_run":
        store.reserve(run.key, A.Hold("h", 60_000, tokens=11))
    elif kind == "budget_exceeded_budget":
        store.put_budget(A.BudgetRecord("t", "team", A.Caps(cost_micros_max=1_000)))
        b = store.put_run(A.RunRecord(run_id="rb", tenant="t", agent_name="p", budget="team"))
        store.reserve(b.key, A.Hold("h1", 60_000, cost_micros=800))
        store.reserve(b.key, A.Hold("h2", 60_000, cost_micros=300))
    elif kind == "feed_pruned":
        scope = A.FeedScope.tenant("t")
        store.put_session(A.SessionRecord("gone", "t"))
        store.delete_session(A.SessionKey("t", "gone"))
        store.prune_changes(scope, store.feed_head(scope))
        store.changes(scope, 0)
    elif kind == "invalid":
        store.list_sessions("t", limit=0)
    elif kind == "closed":
        store.close()
        store.get_run(run.key)
    elif kind == "locked":
        first = A.FileStateStore(path).sync()
        try:
            A.FileStateStore(path)
        finally:
            first.close()
    else:
        raise AssertionError(f"no such case {kind}")
    raise AssertionError(f"{kind}: the call did not raise")


REAL: Dict[str, Tuple[type, Callable[[Any], bool]]] = {
    "conflict": (A.StateConflictError, lambda e: (e.expected_version, e.actual_version) == (0, 1)),
    "not_found_run": (A.StateNotFoundError, lambda e: (e.what, e.key) == ("run", A.RunKey("t", "ghost"))),
    "not_found_session": (A.StateNotFoundError, lambda e: (e.what, e.key) == ("session", A.SessionKey("t", "ghost"))),
    "not_found_budget": (A.StateNotFoundError, lambda e: (e.what, e.key) == ("budget", A.BudgetKey("t", "nob"))),
    "not_found_hold": (A.StateNotFoundError, lambda e: (e.what, e.key) == ("hold", A.RunKey("t", "r"))),
    "too_large": (A.StatePersistenceError, lambda e: (e.reason, e.keyed, e.retryable) == ("too_large", False, False)),
    "in_use": (A.StateInUseError, lambda e: e.runs == [A.RunKey("t", "live")]),
    "fence_lost": (A.FenceLostError, lambda e: (e.caller_epoch, e.stored_epoch) == (4, 5)),
    "budget_exceeded_run": (
        A.BudgetExceededError,
        lambda e: (e.scope, e.amount, e.max, e.spent, e.held, e.asked, e.run, e.budget) == ("run", "tokens", 10, 0, 0, 11, A.RunKey("t", "r"), None),
    ),
    "budget_exceeded_budget": (
        A.BudgetExceededError,
        lambda e: (e.scope, e.amount, e.max, e.held, e.asked, e.budget, e.run) == ("budget", "cost_micros", 1_000, 800, 300, A.BudgetKey("t", "team"), None),
    ),
    "feed_pruned": (A.StateFeedPrunedError, lambda e: e.scope == A.FeedScope.tenant("t") and e.horizon > 0),
    "invalid": (A.StateInvalidError, lambda e: "limit" in str(e)),
    "closed": (A.StateClosedError, lambda e: "closed" in str(e)),
    "locked": (A.StateLockedError, lambda e: e.this_process is True and e.path.endswith("locked-store")),
}


def raised(kind: str, path: str = "") -> BaseException:
    cls, _ = real(kind)
    with pytest.raises(cls) as info:
        raise_from_store(kind, path)
    return info.value



def real(kind: str) -> Tuple[type, Any]:
    """The class a store call raises for `kind` here, and its check: a lost
    fence is also pinned's FenceLost once pinned's store module is imported
    (another test of this run may have imported it)."""
    cls, check = REAL[kind]
    if kind == "fence_lost":
        cls = A.errors._fence_lost_class()
    return cls, check

@pytest.mark.parametrize("kind", sorted(REAL))
def test_an_exception_raised_by_a_store_call_round_trips(kind: str, tmp_path: Any) -> None:
    e = raised(kind, str(tmp_path / "locked-store"))
    cls, check = real(kind)
    assert type(e) is cls and check(e), vars(e)
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        back = pickle.loads(pickle.dumps(e, protocol=protocol))
        assert_same(back, e)
        assert check(back), vars(back)


# --- across a real process boundary ------------------------------------------------


def describe_in_child(e: BaseException) -> Tuple[str, str, str, str, Tuple[Any, ...], Dict[str, Any], int]:
    """Runs in the child: what it unpickled, described in plain values
    (and keys, which pickle back)."""
    return (type(e).__module__, type(e).__qualname__, str(e), repr(e), e.args, dict(vars(e)), os.getpid())


@pytest.fixture
def pool() -> Iterator[Any]:
    # spawn: a fresh interpreter that imports the package itself, as a
    # celery worker or a ProcessPoolExecutor on macOS does. One per test:
    # a result that fails to unpickle kills the pool's result thread (the
    # call then times out instead of hanging), and the next test gets a
    # working pool.
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as p:
        yield p


TIMEOUT = 60


@pytest.mark.parametrize("kind", sorted(REAL))
def test_an_exception_raised_in_a_worker_process_arrives_whole(pool: Any, kind: str, tmp_path: Any) -> None:
    """multiprocessing pickles the worker's exception and raises it here:
    the same class and attributes as the same call raised in this process."""
    path = str(tmp_path / "locked-store")
    here = raised(kind, path)
    cls, check = real(kind)
    with pytest.raises(cls) as info:
        pool.apply_async(raise_from_store, (kind, path, "pinned.durability.store" in sys.modules)).get(timeout=TIMEOUT)
    there = info.value
    if kind == "feed_pruned":
        # A position carries a tag of its store (F9): the two stores'
        # horizons differ in it, and only in it.
        mask = 2**96 - 1
        assert here.horizon != there.horizon and here.horizon & mask == there.horizon & mask
        assert type(there) is type(here)
        assert repr(describe(there)).replace(str(there.horizon), "H") == repr(describe(here)).replace(
            str(here.horizon), "H"
        )
    else:
        assert_same(there, here)
    assert check(there), vars(there)
    # multiprocessing attached the worker's traceback: it did come from there.
    assert "raise_from_store" in str(there.__cause__)


def test_exceptions_sent_to_a_worker_process_arrive_whole(pool: Any) -> None:
    cases = by_hand()
    got = pool.map_async(describe_in_child, cases).get(timeout=TIMEOUT)
    for e, (module, qualname, text, rep, args, attrs, pid) in zip(cases, got):
        assert pid != os.getpid()
        assert (module, qualname) == (type(e).__module__, type(e).__qualname__)
        assert (text, rep, args, attrs) == (str(e), repr(e), e.args, dict(vars(e)))


def _forked_child(store: Any, q: Any) -> None:
    try:
        store.sync().get_run(A.RunKey("t", "r"))
        q.put("no error")
    except BaseException as e:  # sent back through the queue: pickled
        q.put(e)


@pytest.mark.skipif(sys.platform == "win32" or not hasattr(os, "fork"), reason="no fork on this platform")
def test_store_forked_error_from_a_forked_child_crosses_back() -> None:
    """A real StoreForkedError: the parent's store used in a forked child,
    the exception sent back to the parent through a multiprocessing queue."""
    store = A.MemoryStateStore()
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_forked_child, args=(store, q))
    p.start()
    try:
        e = q.get(timeout=60)
    finally:
        p.join(timeout=60)
    assert p.exitcode == 0
    assert type(e) is A.StoreForkedError, e
    assert "forked child" in str(e) and "MemoryStateStore()" in str(e)
    assert e.args == (str(e),) and vars(e) == {"message": str(e)}
