"""A store call made outside a running event loop (``asyncio.run(store.get_run(k))``)
returns this coroutine: it makes the call when a loop awaits it."""

from __future__ import annotations

from typing import Any, Dict, Tuple


async def defer(store: Any, name: str, kwargs: Dict[str, Any]) -> Any:
    return await getattr(store, name)(**kwargs)


async def defer_call(store: Any, name: str, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    return await getattr(store, name)(*args, **kwargs)


async def next_change(stream: Any) -> Any:
    """One step of ``store.watch(...)``: the next change the watch holds,
    reading until it holds one. Handing a change out is one step after the
    read, so a cancelled step loses nothing (the watch keeps what it read)."""
    while True:
        change = stream._pop()  # StopAsyncIteration once the watch has ended
        if change is not None:
            return change
        await stream._read()
