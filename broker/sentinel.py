"""Where a Sentinel service's master is now, for the lean connections (:mod:`broker.resp_lane`).

A :class:`SentinelMaster` asks all the sentinels of a ``redis+sentinel://`` URL at once with
``SENTINEL MASTERS`` and accepts the first answer that names the service's master and does not
flag it as down: the same question and the same check as redis-py's
:class:`redis.sentinel.Sentinel`, which serves the rest of microbatch's connections (made to ask
all at once too, in :mod:`broker.connections`), so both always agree on where the master is (and
a Sentinel ACL user needs one command, ``+sentinel|masters``). Asked one after the other, a
sentinel on a host that died silently would cost every reconnect its connect timeout before the
next one is asked. Of answers that arrive together, the sentinel that answered last time wins.
A lane asks at each (re)connect, and about once a second while connected (dropping the
connection when the master moved); when no sentinel names a master that is up (during a
failover), connecting fails at once with :class:`MasterNotFound`, a connection error, and
callers see ``BrokerUnavailable``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from typing import Any, TypeVar

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .redis_url import SentinelURL
from .resp_lane import LaneTarget, RespLane, ServerDown


class MasterNotFound(RedisConnectionError):
    """No sentinel names a master of the service that is up (now)."""


class MasterDown(MasterNotFound, ServerDown):
    """No sentinel names a master that is up, and some see the master down."""


class NoAnswer(Exception):
    """A sentinel names no usable master (the message says why)."""


class SeenDown(NoAnswer):
    """A sentinel flags the service's master as down."""


T = TypeVar("T")


async def first_answer(
    asks: Sequence[Awaitable[T]],
) -> tuple[int, T | None, list[tuple[int, BaseException]]]:
    """Run ``asks`` at once: (the index and result of the first to succeed, the failures seen
    until then as (index, exception)); (-1, None, all failures) if none succeeds. Of asks that
    finish together, the lowest index wins; the rest are cancelled."""
    tasks = [asyncio.ensure_future(ask) for ask in asks]
    failures: list[tuple[int, BaseException]] = []
    pending = set(tasks)
    try:
        while pending:
            _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            won = _first_success(tasks, pending, failures)
            if won is not None:
                return won[0], won[1], failures
        return -1, None, failures
    finally:
        for task in tasks:
            # retrieved, even when it fails after the cancel: not logged as unhandled
            task.add_done_callback(_retrieve)
            task.cancel()


def error_text(exc: BaseException) -> str:
    """An exception's message, or its type's name when it has none."""
    return str(exc) or type(exc).__name__


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


_askers = ThreadPoolExecutor(max_workers=8, thread_name_prefix="microbatch-sentinel")


def first_answer_sync(
    asks: Sequence[Callable[[], T]],
) -> tuple[int, T | None, list[tuple[int, BaseException]]]:
    """:func:`first_answer` for blocking calls, each run on a thread of a shared pool (those
    still running when one succeeds finish in the background, within their socket timeout)."""
    futures = [_askers.submit(ask) for ask in asks]
    failures: list[tuple[int, BaseException]] = []
    pending = set(futures)
    while pending:
        _, pending = wait(pending, return_when=FIRST_COMPLETED)
        won = _first_success(futures, pending, failures)
        if won is not None:
            return won[0], won[1], failures
    return -1, None, failures


def _first_success(
    outcomes: Sequence[Any], pending: set[Any], failures: list[tuple[int, BaseException]]
) -> tuple[int, Any] | None:
    """Of ``outcomes`` (asyncio or concurrent futures), those done and not seen before, in
    index order: each failure added to ``failures``; the index and result of the first
    success, if there is one."""
    failed = {index for index, _ in failures}
    for index, outcome in enumerate(outcomes):
        if outcome in pending or index in failed:
            continue
        exc = outcome.exception()
        if exc is None:
            return index, outcome.result()
        failures.append((index, exc))
    return None


def _state(flat: Any) -> dict[str, str]:
    """One master's state from SENTINEL MASTERS' flat [field, value, ...] list."""
    it = iter(flat if isinstance(flat, list) else [])
    return {_text(k): _text(v) for k, v in zip(it, it, strict=False)}


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def master_up(state: dict[str, str]) -> bool:
    """Whether a sentinel sees this master as a master, and up (redis-py's check)."""
    flags = set(state.get("flags", "").split(","))
    return "master" in flags and not flags & {"s_down", "o_down"}


class SentinelMaster:
    """The :class:`~broker.resp_lane.AddressSource` of a Sentinel URL's master."""

    def __init__(self, url: SentinelURL, connect_timeout_s: float, tls: Any = None) -> None:
        """``tls``: the TLS context for the sentinels (a rediss+sentinel URL's)."""
        self.service = url.service
        self._sentinels = [
            (
                str(address),
                RespLane(
                    LaneTarget(
                        host=address.host, port=address.port, ssl=tls,
                        username=url.sentinel_username, password=url.sentinel_password,
                        label=f"sentinel {address}",
                    ),
                    connect_timeout_s,
                    reply_timeout_s=connect_timeout_s,
                ),
            )
            for address in url.sentinels
        ]  # fmt: skip
        self._known: tuple[float, tuple[str, int]] | None = None  # (when, address)

    async def address(self, max_age_s: float = 0.0) -> tuple[str, int]:
        known = self._known
        if known is not None and time.monotonic() - known[0] <= max_age_s:
            return known[1]
        self._known = None
        entries = list(self._sentinels)  # (a concurrent call may reorder the list)
        index, address, errors = await first_answer([self._ask(lane) for _, lane in entries])
        if address is None:
            failures = "; ".join(f"{entries[i][0]}: {error_text(exc)}" for i, exc in errors)
            seen_down = any(isinstance(exc, SeenDown) for _, exc in errors)
            raise (MasterDown if seen_down else MasterNotFound)(
                f"no sentinel names an up master of service {self.service!r} ({failures})"
            )
        entry = entries[index]
        if entry in self._sentinels and self._sentinels[0] is not entry:
            self._sentinels.remove(entry)  # ask this one first next time
            self._sentinels.insert(0, entry)
        self._known = time.monotonic(), address
        return address

    async def _ask(self, lane: RespLane) -> tuple[str, int]:
        """The master one sentinel names; raises NoAnswer saying why it names none."""
        try:
            masters = await lane.execute("SENTINEL", "MASTERS")
        except (RedisConnectionError, RedisTimeoutError, ResponseError, OSError) as exc:
            raise NoAnswer(str(exc)) from exc
        state = next((s for s in map(_state, masters or []) if s.get("name") == self.service), None)
        if state is None:
            raise NoAnswer(f"monitors no service {self.service!r}")
        if not master_up(state):
            raise SeenDown(f"its master is {state.get('flags', '?')}")
        return state["ip"], int(state["port"])

    def close(self) -> None:
        for _, lane in self._sentinels:
            lane.close()
