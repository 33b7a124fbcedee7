"""A delaying, counting TCP relay: ``python -m tests.hosts.relay --listen A:P --target B:Q``.

It forwards each accepted connection to the target and holds every chunk of data for
``--delay-ms`` in each direction before passing it on (order kept), which stands in for link
delay on kernels without ``netem``. The event loop only does I/O; a timer thread with
sub-millisecond sleeps says when data is due (the loop's own timers round up to whole ms).

It counts, per client address: connections, bytes each way, RESP commands by name (parsed from
the client's stream, so pipelined commands count one by one) and round trips (turnarounds: the
server sending after the client sent, so a pipeline or a blocking read is one). Counters go to
``--stats`` as JSON (written atomically every 0.2 s, and at exit), with the monotonic time it
was written (``written_at``). :class:`RelayProcess` starts one on a host and reads them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import heapq
import itertools
import json
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import subprocess

    from tests.hosts.netns import Host

PR_SET_TIMERSLACK = 29
_libc = ctypes.CDLL(None, use_errno=True)
MAX_NAME = 32  # command names longer than this are not recorded by name


class RespCounter:
    """Counts the RESP commands in a client's byte stream, fed in arbitrary chunks."""

    def __init__(self, commands: Counter[str] | None = None) -> None:
        self.commands: Counter[str] = Counter() if commands is None else commands
        self._first = False  # the next bulk string is the command's name
        self.broken = False
        self._line = bytearray()
        self._args_left = 0  # bulk strings still to come in the current command
        self._skip = 0  # bytes of the current bulk string (and its CRLF) still to pass
        self._name: bytearray | None = None  # the command's name, while it is being read

    def feed(self, data: bytes) -> None:
        if self.broken:
            return
        try:
            self._feed(data)
        except ValueError:  # not RESP after all: stop counting this stream
            self.broken = True

    def _feed(self, data: bytes) -> None:
        pos, end = 0, len(data)
        while pos < end:
            if self._skip:
                take = min(self._skip, end - pos)
                if self._name is not None and len(self._name) <= MAX_NAME + 2:
                    self._name += data[pos : pos + take]
                self._skip -= take
                pos += take
                if not self._skip:
                    self._end_bulk()
                continue
            newline = data.find(b"\n", pos)
            if newline < 0:
                self._line += data[pos:]
                return
            self._line += data[pos : newline + 1]
            pos = newline + 1
            line = bytes(self._line).rstrip(b"\r\n")
            self._line.clear()
            self._on_line(line)

    def _on_line(self, line: bytes) -> None:
        if self._args_left == 0:
            if line.startswith(b"*"):
                count = int(line[1:])
                if count > 0:
                    self._args_left, self._first = count, True
            elif line.strip():  # an inline command
                self.commands[line.split()[0].decode("latin-1").upper()] += 1
        elif line.startswith(b"$"):
            self._skip = int(line[1:]) + 2
            self._name = bytearray() if self._first else None

    def _end_bulk(self) -> None:
        if self._name is not None:
            name = bytes(self._name[:-2])
            label = name.decode("latin-1").upper() if len(name) <= MAX_NAME else "?"
            self.commands[label] += 1
            self._name = None
        self._first = False
        self._args_left -= 1


@dataclass
class PeerStats:
    """What one client address did through the relay."""

    connections: int = 0
    open: int = 0
    round_trips: int = 0
    bytes_up: int = 0  # client -> target
    bytes_down: int = 0
    commands: Counter[str] = field(default_factory=Counter)

    def as_json(self) -> dict[str, Any]:
        return {
            "connections": self.connections, "open": self.open,
            "round_trips": self.round_trips, "bytes_up": self.bytes_up,
            "bytes_down": self.bytes_down, "commands": dict(sorted(self.commands.items())),
            "command_count": sum(self.commands.values()),
        }  # fmt: skip


class Timer(threading.Thread):
    """Calls callbacks on the event loop at given monotonic times.

    A thread sleeps until the first is due, then hands everything due to the loop. Waking a
    thread and then the loop costs ~0.1 ms here, so the thread wakes that much early: it learns
    how late callbacks actually ran and steers that towards zero.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, max_early: float) -> None:
        super().__init__(daemon=True, name="relay-timer")
        self.loop = loop
        self.max_early = max_early
        self.early = 0.0  # how much earlier than due the thread wakes
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()

    def at(self, when: float, callback: Callable[[], None]) -> None:
        with self._cond:
            heapq.heappush(self._heap, (when, next(self._seq), callback))
            if self._heap[0][2] is callback:
                self._cond.notify()

    def run(self) -> None:
        _libc.prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0)  # wake on time, not up to 50 us late
        while True:
            with self._cond:
                while not self._heap:
                    self._cond.wait()
                wait = self._heap[0][0] - self.early - time.monotonic()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                first = self._heap[0][0]
                due = []
                horizon = time.monotonic() + self.early
                while self._heap and self._heap[0][0] <= horizon:
                    due.append(heapq.heappop(self._heap)[2])
            self.loop.call_soon_threadsafe(self._run_all, first, due)

    def _run_all(self, first: float, callbacks: list[Callable[[], None]]) -> None:
        late = time.monotonic() - first
        self.early = min(max(self.early + 0.2 * late, 0.0), self.max_early)
        for callback in callbacks:
            callback()


class Side(asyncio.Protocol):
    """One TCP connection of a relayed pair: the client's, or ours to the target."""

    def __init__(self, pair: Pair, upstream: bool) -> None:
        self.pair, self.upstream = pair, upstream
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass
        self.pair.made(self)

    def data_received(self, data: bytes) -> None:
        self.pair.data(self, data)

    def eof_received(self) -> bool:
        self.pair.closed(self)
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.pair.closed(self)

    # the other side's reading follows this side's write buffer (backpressure)
    def pause_writing(self) -> None:
        other = self.pair.other(self)
        if other is not None:
            other.pause_reading()

    def resume_writing(self) -> None:
        other = self.pair.other(self)
        if other is not None:
            other.resume_reading()


class Pair:
    """A client's connection and ours to the target, with its counters."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.client = Side(self, upstream=False)
        self.target = Side(self, upstream=True)
        self.stats = PeerStats()
        self.resp = RespCounter()
        self.client_spoke = False
        self.done = False
        self.early: list[bytes] = []  # client data that came before the target connected
        self.connecting: asyncio.Future[None] | None = None

    def made(self, side: Side) -> None:
        assert side.transport is not None
        if side is self.client:
            peer = side.transport.get_extra_info("peername")[0]
            self.stats = self.relay.peers.setdefault(peer, PeerStats())
            self.resp = RespCounter(self.stats.commands)
            self.stats.connections += 1
            self.stats.open += 1
            side.transport.pause_reading()  # until the target answers the connect
            self.connecting = asyncio.ensure_future(self.connect())
        else:
            for data in self.early:
                self.relay.later(side.transport.write, data)
            self.early.clear()
            self.client.transport.resume_reading()  # type: ignore[union-attr]

    async def connect(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            await loop.create_connection(lambda: self.target, *self.relay.target)
        except OSError:
            self.closed(self.target)

    def other(self, side: Side) -> asyncio.Transport | None:
        peer = self.target if side is self.client else self.client
        return peer.transport

    def data(self, side: Side, data: bytes) -> None:
        stats = self.stats
        if side is self.client:
            stats.bytes_up += len(data)
            self.resp.feed(data)
            self.client_spoke = True
        else:
            stats.bytes_down += len(data)
            if self.client_spoke:
                stats.round_trips += 1
                self.client_spoke = False
        other = self.other(side)
        if other is None:
            self.early.append(data)
        else:
            self.relay.later(other.write, data)

    def closed(self, side: Side) -> None:
        """One side closed: close both once what is in flight has been delivered."""
        if self.done:
            return
        self.done = True
        self.stats.open -= 1
        for each in (self.client, self.target):
            if each.transport is not None:
                self.relay.later(_close, each.transport)


def _close(transport: asyncio.Transport) -> None:
    if not transport.is_closing():
        transport.close()


class Relay:
    def __init__(self, target: tuple[str, int], delay_s: float, stats_path: Path | None) -> None:
        self.target = target
        self.delay_s = delay_s
        self.stats_path = stats_path
        self.peers: dict[str, PeerStats] = {}
        self.timer: Timer | None = None

    def later(self, fn: Callable[..., object], arg: Any) -> None:
        """Call ``fn(arg)`` after the delay (now, without one); calls keep their order."""
        if self.timer is None:
            fn(arg)
        else:
            self.timer.at(time.monotonic() + self.delay_s, lambda: _safe(fn, arg))

    def write_stats(self) -> None:
        if self.stats_path is None:
            return
        peers = {peer: stats.as_json() for peer, stats in self.peers.items()}
        commands: Counter[str] = Counter()
        total: dict[str, Any] = {}
        for stats in peers.values():
            for key, value in stats.items():
                if key == "commands":
                    commands.update(value)
                else:
                    total[key] = total.get(key, 0) + value
        body = {
            "written_at": time.monotonic(), "delay_s": self.delay_s, "peers": peers,
            "total": {**total, "commands": dict(sorted(commands.items()))},
        }  # fmt: skip
        tmp = self.stats_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(body))
        os.replace(tmp, self.stats_path)


def _safe(fn: Callable[..., object], arg: Any) -> None:
    with contextlib.suppress(RuntimeError, OSError):  # the transport closed meanwhile
        fn(arg)


async def serve(listen: tuple[str, int], relay: Relay) -> None:
    loop = asyncio.get_running_loop()
    if relay.delay_s > 0:
        relay.timer = Timer(loop, max_early=relay.delay_s / 2)
        relay.timer.start()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server = await loop.create_server(lambda: Pair(relay).client, *listen, reuse_address=True)
    relay.write_stats()  # "listening"
    async with server:
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.2)
            relay.write_stats()
    relay.write_stats()


class RelayProcess:
    """A relay running on ``host``: accepts on ``host.addr:port``, forwards to ``target``."""

    def __init__(
        self, host: Host, port: int, target: tuple[str, int], delay_s: float, label: str
    ) -> None:
        self.host, self.port, self.target, self.delay_s = host, port, target, delay_s
        self.stats_path = host.network.workdir / f"{host.name}-{label}.json"
        self.label = label
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> RelayProcess:
        self.process = self.host.python(
            "tests.hosts.relay", "--listen", f"{self.host.addr}:{self.port}",
            "--target", f"{self.target[0]}:{self.target[1]}",
            "--delay-ms", f"{self.delay_s * 1000:g}", "--stats", str(self.stats_path),
            log=self.label,
        )  # fmt: skip
        deadline = time.monotonic() + timeout
        while not self.stats_path.exists():  # written once it listens
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"relay {self.label} on {self.host} did not start")
            time.sleep(0.05)
        return self

    def stats(self, fresh_after: float | None = None, timeout: float = 5.0) -> dict[str, Any]:
        """The relay's counters; with ``fresh_after`` (a monotonic time), as written after it."""
        deadline = time.monotonic() + timeout
        while True:
            stats: dict[str, Any] = json.loads(self.stats_path.read_text())
            if fresh_after is None or stats["written_at"] >= fresh_after:
                return stats
            if time.monotonic() > deadline:
                raise TimeoutError(f"relay {self.label} wrote no counters after {fresh_after}")
            time.sleep(0.05)


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", type=_address, required=True, help="ADDR:PORT to accept on")
    parser.add_argument("--target", type=_address, required=True, help="ADDR:PORT to forward to")
    parser.add_argument("--delay-ms", type=float, default=0.25, help="per direction (0: none)")
    parser.add_argument("--stats", type=Path, help="JSON file of the counters")
    args = parser.parse_args()
    relay = Relay(args.target, args.delay_ms / 1000, args.stats)
    try:
        import uvloop

        uvloop.run(serve(args.listen, relay))
    except ImportError:
        asyncio.run(serve(args.listen, relay))


if __name__ == "__main__":
    main()
