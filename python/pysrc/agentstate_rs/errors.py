"""The exceptions every store of the package raises (and a store written in
Python should raise): one base class, ``StateError``, and one class per
failure the seeds name. Each carries the store's message as ``str(e)``.

Every class pickles (celery and multiprocessing send exceptions between
processes): the copy has the same class, ``str(e)``, ``args`` and
attributes."""

from __future__ import annotations

import sys
from typing import Any, Dict, List, Optional, Tuple, Type, TypeVar

__all__ = [
    "StateError",
    "StateConflictError",
    "StateNotFoundError",
    "StatePersistenceError",
    "StateInUseError",
    "FenceLostError",
    "BudgetExceededError",
    "StateFeedPrunedError",
    "StateInvalidError",
    "StateCorruptError",
    "StateUnsupportedFormatError",
    "StateLockedError",
    "StateClosedError",
    "StoreForkedError",
]


_E = TypeVar("_E", bound="StateError")


def _rebuild(cls: Type[_E], args: Tuple[Any, ...]) -> _E:
    """An unpickled exception: made without ``__init__`` (whose keyword
    arguments are not in ``args``); pickle then restores its attributes."""
    e = cls.__new__(cls)
    e.args = args
    return e


class StateError(Exception):
    """Every failure of a store."""

    def __init__(self, message: str = "") -> None:
        # Exception's own __init__, not the next class of the MRO: the
        # FenceLostError that pinned's FenceLost can catch (below) has
        # pinned's class after this one, with another signature.
        Exception.__init__(self, message)
        self.message = message

    def __str__(self) -> str:
        return self.message

    def __reduce__(self) -> Tuple[Any, Tuple[Type[StateError], Tuple[Any, ...]], Dict[str, Any]]:
        # Exception's own reduce calls cls(*args): a class with keyword-only
        # attributes (expected_version, ...) could not be rebuilt from it.
        return (_rebuild, (type(self), self.args), dict(self.__dict__))


class StateConflictError(StateError):
    """The version moved: re-read and decide again (not retryable as is).
    ``what`` and ``key`` name the record (as on ``StateNotFoundError``)."""

    def __init__(
        self,
        message: str = "",
        *,
        expected_version: int,
        actual_version: int,
        what: str = "run",
        key: Any = None,
    ) -> None:
        super().__init__(message or f"version conflict: expected {expected_version}, stored {actual_version}")
        self.expected_version = expected_version
        self.actual_version = actual_version
        self.what = what
        self.key = key


class StateNotFoundError(StateError):
    """The named record is not there (``what``: run, session, tray, budget, hold)."""

    def __init__(self, message: str = "", *, what: str = "run", key: Any = None) -> None:
        super().__init__(message or f"not found: {what} {key}")
        self.what = what
        self.key = key


class StatePersistenceError(StateError):
    """The store refused the write or could not be reached.

    ``reason``: ``"unavailable"`` (retryable), ``"outcome_unknown"`` (may
    have applied; retryable only when the call carried an idempotency key,
    ``keyed``), ``"too_large"``, ``"read_only"``, ``"refused"``,
    ``"invalid_path"`` (not retryable).
    """

    def __init__(self, message: str = "", *, reason: str = "unavailable", keyed: bool = False) -> None:
        super().__init__(message or f"persistence failed ({reason})")
        self.reason = reason
        self.keyed = keyed

    @property
    def retryable(self) -> bool:
        return self.reason == "unavailable" or (self.reason == "outcome_unknown" and self.keyed)


class StateInUseError(StateError):
    """Deleting the session would orphan its unfinished ``runs``."""

    def __init__(self, message: str = "", *, runs: Optional[List[Any]] = None) -> None:
        runs = list(runs or [])
        super().__init__(message or f"session has {len(runs)} unfinished run(s)")
        self.runs = runs


class FenceLostError(StateError):
    """The caller's epoch is older than the stored one; nothing changed.

    ``key`` is the instance as ``"ns/id"`` and ``epoch`` the caller's epoch
    (the attributes of pinned's ``FenceLost``); ``caller_epoch`` and
    ``stored_epoch`` are the two epochs. When the ``pinned`` framework's
    ``pinned.durability.store`` is imported, a store raises a subclass of
    both this class and pinned's ``FenceLost``, so ``except FenceLost:`` in
    pinned's worker catches it too (the package does not depend on
    pinned)."""

    def __init__(
        self, message: str = "", *, caller_epoch: int, stored_epoch: int, key: str = ""
    ) -> None:
        super().__init__(message or f"fence lost: caller epoch {caller_epoch} < stored epoch {stored_epoch}")
        self.caller_epoch = caller_epoch
        self.stored_epoch = stored_epoch
        self.key = key
        self.epoch = caller_epoch

    def __reduce__(self) -> Tuple[Any, Tuple[Any, ...], Dict[str, Any]]:
        if type(self) in _PINNED_FENCE_LOST.values():
            # The class pinned's FenceLost also catches is made again where
            # the copy is made: it exists only where pinned is imported.
            return (_rebuild_fence_lost, (self.args,), dict(self.__dict__))
        return super().__reduce__()


# pinned's FenceLost class -> the subclass of it and FenceLostError.
_PINNED_FENCE_LOST: Dict[type, type] = {}


def _fence_lost_class() -> type:
    """FenceLostError, or (when pinned's store module is imported) the
    class that both it and pinned's FenceLost catch. Looked up at each
    raise, in sys.modules only: nothing is imported, and a program that
    never imports pinned cannot be catching pinned's class."""
    mod = sys.modules.get("pinned.durability.store")
    theirs = getattr(mod, "FenceLost", None) if mod is not None else None
    if not (isinstance(theirs, type) and issubclass(theirs, BaseException)):
        return FenceLostError
    cls = _PINNED_FENCE_LOST.get(theirs)
    if cls is None:
        cls = type(
            "FenceLostError",
            (FenceLostError, theirs),
            {
                "__module__": __name__,
                "__qualname__": "FenceLostError",
                "__doc__": FenceLostError.__doc__,
            },
        )
        _PINNED_FENCE_LOST[theirs] = cls
    return cls


def _fence_lost(message: str, caller_epoch: int, stored_epoch: int, key: str) -> FenceLostError:
    """The exception a store raises for a lost fence (see FenceLostError)."""
    cls = _fence_lost_class()
    e: FenceLostError = cls(message, caller_epoch=caller_epoch, stored_epoch=stored_epoch, key=key)
    return e


def _rebuild_fence_lost(args: Tuple[Any, ...]) -> FenceLostError:
    cls = _fence_lost_class()
    e: FenceLostError = cls.__new__(cls)
    e.args = args
    return e


class BudgetExceededError(StateError):
    """A reserve would take spend past a cap; nothing changed."""

    def __init__(
        self,
        message: str = "",
        *,
        scope: str,
        amount: str,
        max: int,
        spent: int,
        held: int,
        asked: int,
        run: Any = None,
        budget: Any = None,
    ) -> None:
        super().__init__(message or f"{scope} {amount} cap {max} exceeded")
        self.scope = scope
        self.amount = amount
        self.max = max
        self.spent = spent
        self.held = held
        self.asked = asked
        self.run = run
        self.budget = budget


class StateFeedPrunedError(StateError):
    """The feed position is before what ``prune_changes`` dropped (or
    before a tenant purge): deletes may be missing after it. Re-list the
    ``scope`` (a ``FeedScope``), then follow on from ``horizon`` (an int
    position)."""

    def __init__(self, message: str = "", *, scope: Any = None, horizon: int = 0) -> None:
        super().__init__(message or f"the feed of {scope} was pruned through position {horizon}")
        self.scope = scope
        self.horizon = horizon


class StateInvalidError(StateError, ValueError):
    """Bad input: which input, and why."""


class StateCorruptError(StateError):
    """The store's files are damaged; nothing was changed."""


class StateUnsupportedFormatError(StateError):
    """The store was written by a newer release."""

    def __init__(self, message: str = "", *, found: int = 0, supported: int = 0) -> None:
        super().__init__(message)
        self.found = found
        self.supported = supported


class StateLockedError(StateError):
    """The file store at ``path`` is open elsewhere."""

    def __init__(self, message: str = "", *, path: str = "", this_process: bool = False) -> None:
        super().__init__(message)
        self.path = path
        self.this_process = this_process


class StateClosedError(StateError):
    """The store was closed."""


class StoreForkedError(StateError):
    """A store opened before ``os.fork()`` was used in the child: open a new one there."""
