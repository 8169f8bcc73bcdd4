"""A store call made outside a running event loop (``asyncio.run(store.get_run(k))``)
returns this coroutine: it makes the call when a loop awaits it."""

from __future__ import annotations

from typing import Any, Dict


async def defer(store: Any, name: str, kwargs: Dict[str, Any]) -> Any:
    return await getattr(store, name)(**kwargs)
