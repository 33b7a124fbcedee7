"""The load generator of the namespace tests, run on a client host:
``python -m tests.hosts.load CONFIG.json``.

Open loop: call ``i`` is sent at ``i / rate`` seconds whatever the answers do, one item
``[i, tag]`` of :class:`tests.models.HostTagged` each, to ``targets[i % len(targets)]``: the
word ``redis`` (a :class:`broker.Streamer` on ``redis_url``) or a gateway's base URL (``POST
/v1/models/<model>/predict`` over keep-alive HTTP/1.1). Every call is bounded (its timeout plus
5 s, then it is recorded as ``hung``) and so is the run. It writes ``started_path`` (the
monotonic time of the first call) when it starts sending, and ``out``: one record per call
(target, sent, done, output or error type) and the number of duplicate replies its Streamer
dropped. Times are ``time.monotonic()``, which every namespace shares with the test.

Config keys: redis_url, prefix, model, targets, rate, seconds, timeout, tag, started_path, out.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from broker import Streamer
from broker.client import ClientCore
from broker.errors import MicrobatchError

GRACE_S = 5.0  # a call still open this long past its timeout is "hung"
MAX_CONNECTIONS = 256  # per gateway


def count_duplicate_replies() -> Counter[str]:
    """Count every reply that reaches a Streamer's inbox, by request id (the client drops a
    duplicate silently; the count tells how many there were)."""
    seen: Counter[str] = Counter()
    resolve = getattr(ClientCore, "_resolve", None)
    if resolve is not None:

        def counting(self: ClientCore, reply: Any) -> None:
            seen[reply.request_id] += 1
            resolve(self, reply)

        ClientCore._resolve = counting  # type: ignore[method-assign]
    return seen


class Gateway:
    """Keep-alive HTTP/1.1 connections to one gateway, opened as the load needs them.

    The gateway closes a connection idle for 5 s (gunicorn's keepalive), so one idle for
    ``IDLE_S`` is not reused; a request that finds its reused connection closed before any
    byte of an answer (the server never read it) is sent again once, on a new connection.
    """

    IDLE_S = 3.0

    def __init__(self, base: str, model: str, timeout: float) -> None:
        parts = urlsplit(base)
        self.host, self.port = parts.hostname or "", parts.port or 80
        self.path = f"/v1/models/{model}/predict"
        self.timeout = timeout
        self.idle: list[tuple[float, asyncio.StreamReader, asyncio.StreamWriter]] = []
        self.slots = asyncio.Semaphore(MAX_CONNECTIONS)

    async def _connection(self) -> tuple[bool, asyncio.StreamReader, asyncio.StreamWriter]:
        """(reused, reader, writer): a recently used idle connection, or a new one."""
        while self.idle:
            last_used, reader, writer = self.idle.pop()
            if time.monotonic() - last_used < self.IDLE_S:
                return True, reader, writer
            writer.close()
        reader, writer = await asyncio.open_connection(self.host, self.port)
        return False, reader, writer

    async def call(self, item: list[float]) -> tuple[Any, str | None, str]:
        """(output, error type, message) of one predict call."""
        body = json.dumps({"inputs": [item]}).encode()
        request = (
            f"POST {self.path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"X-Request-Timeout: {self.timeout}\r\n\r\n"
        ).encode() + body
        async with self.slots:
            while True:
                reused, reader, writer = await self._connection()
                try:
                    writer.write(request)
                    status_line = await reader.readline()
                except (ConnectionError, asyncio.IncompleteReadError):
                    status_line = b""
                if status_line or not reused:
                    break
                writer.close()  # closed by the server while idle: send it again, afresh
            try:
                if not status_line:
                    raise ConnectionError("the gateway closed a new connection unanswered")
                headers = {}
                while (line := await reader.readline()) not in (b"\r\n", b""):
                    name, _, value = line.decode("latin-1").partition(":")
                    headers[name.strip().lower()] = value.strip()
                data = await reader.readexactly(int(headers.get("content-length", "0")))
            except BaseException:
                writer.close()
                raise
            self.idle.append((time.monotonic(), reader, writer))
        status = int(status_line.split()[1])
        try:
            answer = json.loads(data)
        except ValueError:
            return None, f"untyped:HTTP{status}", data[:200].decode("latin-1")
        if status == 200:
            return answer["outputs"][0], None, ""
        error = answer.get("error") if isinstance(answer, dict) else None
        if isinstance(error, dict) and isinstance(error.get("type"), str):
            return None, error["type"], str(error.get("message", ""))
        return None, f"untyped:HTTP{status}", data[:200].decode("latin-1")

    def close(self) -> None:
        for _, _, writer in self.idle:
            writer.close()


async def one_call(
    i: int, target: str, item: list[float], streamer: Streamer, gateways: dict[str, Gateway],
    timeout: float,
) -> dict[str, Any]:  # fmt: skip
    record: dict[str, Any] = {"i": i, "target": target, "sent": time.monotonic()}
    output, error, message = None, None, ""
    try:
        if target == "redis":
            predict = streamer.apredict([np.asarray(item, dtype=np.float32)], timeout=timeout)
            [result] = await asyncio.wait_for(predict, timeout + GRACE_S)
            output = np.asarray(result).tolist()
        else:
            post = gateways[target].call(item)
            output, error, message = await asyncio.wait_for(post, timeout + GRACE_S)
    except asyncio.TimeoutError:
        error, message = "hung", f"no end {GRACE_S:g} s past the timeout"
    except MicrobatchError as exc:
        error, message = type(exc).__name__, str(exc)
    except Exception as exc:  # untyped: counts as lost
        error, message = f"untyped:{type(exc).__name__}", str(exc)
    record.update(done=time.monotonic(), output=output, error=error, message=message[:200])
    return record


async def run(config: dict[str, Any]) -> dict[str, Any]:
    targets = config["targets"]
    timeout, rate, tag = float(config["timeout"]), float(config["rate"]), float(config["tag"])
    total = int(rate * float(config["seconds"]))
    streamer = Streamer(config["model"], redis_url=config["redis_url"], prefix=config["prefix"])
    gateways = {t: Gateway(t, config["model"], timeout) for t in set(targets) if t != "redis"}
    started = time.monotonic()
    started_path = Path(config["started_path"])
    partial = started_path.with_name(started_path.name + ".partial")
    partial.write_text(json.dumps(started))
    partial.replace(started_path)  # never seen half-written
    tasks = []
    for i in range(total):
        delay = started + i / rate - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        target = targets[i % len(targets)]
        tasks.append(
            asyncio.ensure_future(one_call(i, target, [float(i), tag], streamer, gateways, timeout))
        )
    calls = list(await asyncio.gather(*tasks))  # each bounded by wait_for
    for gateway in gateways.values():
        gateway.close()
    streamer.close()
    return {"started": started, "ended": time.monotonic(), "calls": calls}


def main() -> None:
    config = json.loads(Path(sys.argv[1]).read_text())
    seen = count_duplicate_replies()
    results = asyncio.run(run(config))
    results["duplicate_replies"] = sum(count - 1 for count in seen.values() if count > 1)
    out = Path(config["out"])
    out.with_suffix(".tmp").write_text(json.dumps(results))
    out.with_suffix(".tmp").rename(out)


if __name__ == "__main__":
    main()
