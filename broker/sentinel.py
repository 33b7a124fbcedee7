"""Where a Sentinel service's master is now, for the lean connections (:mod:`broker.resp_lane`).

A :class:`SentinelMaster` asks the sentinels of a ``redis+sentinel://`` URL, one after the other,
with ``SENTINEL MASTERS`` and accepts the first answer that names the service's master and does
not flag it as down: the same question and the same check as redis-py's
:class:`redis.sentinel.Sentinel`, which serves the rest of microbatch's connections, so both
always agree on where the master is (and a Sentinel ACL user needs one command,
``+sentinel|masters``). The sentinel that answered is asked first the next time. A lane asks at
each (re)connect, and about once a second while connected (dropping the connection when the
master moved); when no sentinel names a master that is up (during a failover), connecting fails
at once with :class:`MasterNotFound`, a connection error, and callers see ``BrokerUnavailable``.
"""

from __future__ import annotations

import time
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .redis_url import SentinelURL
from .resp_lane import LaneTarget, RespLane


class MasterNotFound(RedisConnectionError):
    """No sentinel names a master of the service that is up (now)."""


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
        errors = []
        for entry in list(self._sentinels):  # (a concurrent call may reorder the list)
            name, lane = entry
            try:
                masters = await lane.execute("SENTINEL", "MASTERS")
            except (RedisConnectionError, RedisTimeoutError, ResponseError, OSError) as exc:
                errors.append(f"{name}: {exc}")
                continue
            state = next(
                (s for s in map(_state, masters or []) if s.get("name") == self.service), None
            )
            if state is None:
                errors.append(f"{name}: monitors no service {self.service!r}")
            elif not master_up(state):
                errors.append(f"{name}: its master is {state.get('flags', '?')}")
            else:
                if self._sentinels[0] is not entry:  # ask this one first next time
                    self._sentinels.remove(entry)
                    self._sentinels.insert(0, entry)
                address = state["ip"], int(state["port"])
                self._known = time.monotonic(), address
                return address
        raise MasterNotFound(
            f"no sentinel names an up master of service {self.service!r} ({'; '.join(errors)})"
        )

    def close(self) -> None:
        for _, lane in self._sentinels:
            lane.close()
