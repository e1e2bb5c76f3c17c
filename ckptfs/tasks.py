"""Small trio helpers shared by the store's tasks."""
from __future__ import annotations

import trio


async def gather(calls: list[tuple]) -> None:
    """Run `(afn, *args)` calls concurrently; raise the first failure itself (not a group)."""
    errors: list[BaseException] = []

    async def one(afn, *args) -> None:
        try:
            await afn(*args)
        except Exception as e:  # noqa: BLE001 - collected and re-raised below
            errors.append(e)

    async with trio.open_nursery() as n:
        for call in calls:
            n.start_soon(one, *call)
    if errors:
        raise errors[0]
