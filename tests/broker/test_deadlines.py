"""Deadlines: shared timers that expire each item once, never early, and forget settled ones."""

from __future__ import annotations

import asyncio

from broker.deadlines import SLICE_S, Deadlines


def test_items_expire_once_after_their_timeout_never_before() -> None:
    async def main() -> list[tuple[str, float]]:
        loop = asyncio.get_running_loop()
        expired: list[tuple[str, float]] = []
        started = loop.time()
        deadlines: Deadlines[str] = Deadlines(
            loop, lambda item: expired.append((item, loop.time()))
        )
        deadlines.add("late", 0.06)
        deadlines.add("early", 0.02)
        deadlines.add("early-too", 0.02)  # same slice as "early": one timer for both
        assert len(deadlines._slices) == 2
        await asyncio.sleep(0.2)
        assert len(deadlines) == 0 and not deadlines._slices
        return [(item, at - started) for item, at in expired]

    expired = asyncio.run(main())
    assert sorted(item for item, _ in expired) == ["early", "early-too", "late"]
    for item, after_s in expired:
        assert after_s >= (0.06 if item == "late" else 0.02)


def test_discarded_items_do_not_expire_and_free_their_timer() -> None:
    async def main() -> tuple[list[str], int, int]:
        loop = asyncio.get_running_loop()
        expired: list[str] = []
        deadlines: Deadlines[str] = Deadlines(loop, expired.append)
        keys = {item: deadlines.add(item, 0.03) for item in ("a", "b", "c")}
        deadlines.discard("a", keys["a"])
        deadlines.discard("a", keys["a"])  # twice: harmless
        deadlines.discard("b", keys["b"])
        watched = len(deadlines)
        deadlines.discard("c", keys["c"])
        slices_left = len(deadlines._slices)
        await asyncio.sleep(0.03 + 3 * SLICE_S)
        return expired, watched, slices_left

    expired, watched, slices_left = asyncio.run(main())
    assert expired == []
    assert watched == 1
    assert slices_left == 0
