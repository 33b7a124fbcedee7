"""web_gateway.http_protocol: a response leaves in one write; order and close are kept.

Its connection limits are tested here phase by phase, and against a real gateway with 500
stalled clients in tests/web_gateway/test_limits.py.
"""

from __future__ import annotations

import asyncio
import re
import socket
from typing import Any

import pytest

from web_gateway.http_protocol import (
    IDLE,
    MAX_PIPELINED,
    REFUSED,
    CoalescingHttpToolsProtocol,
    CoalescingTransport,
    ConnectionLimits,
    GatewayHttpProtocol,
)


class RecordingTransport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False
        self.aborted = False

    def write(self, data: bytes) -> None:
        assert not self.closed, "write after close"
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = self.closed = True

    def get_write_buffer_size(self) -> int:
        return 0

    def pause_reading(self) -> None:  # a pipelined request waits
        pass

    def resume_reading(self) -> None:
        pass

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 1)}.get(name, default)


def test_writes_of_one_loop_turn_leave_together_in_order() -> None:
    async def main() -> RecordingTransport:
        raw = RecordingTransport()
        transport = CoalescingTransport(raw, asyncio.get_running_loop())  # type: ignore[arg-type]
        transport.write(b"HTTP/1.1 200 OK\r\n\r\n")
        transport.write(b"body")
        assert raw.writes == []
        assert transport.get_write_buffer_size() == len(b"HTTP/1.1 200 OK\r\n\r\nbody")
        await asyncio.sleep(0)
        transport.write(b"next")
        await asyncio.sleep(0)
        return raw

    raw = asyncio.run(main())
    assert raw.writes == [b"HTTP/1.1 200 OK\r\n\r\nbody", b"next"]


def test_close_sends_what_is_held_first_and_abort_drops_it() -> None:
    async def main() -> tuple[RecordingTransport, RecordingTransport]:
        loop = asyncio.get_running_loop()
        closed, aborted = RecordingTransport(), RecordingTransport()
        for raw in (closed, aborted):
            transport = CoalescingTransport(raw, loop)  # type: ignore[arg-type]
            transport.write(b"last words")
            transport.close() if raw is closed else transport.abort()
            assert transport.is_closing()  # forwarded to the real transport
            assert transport.get_extra_info("peername") == ("127.0.0.1", 1)
        await asyncio.sleep(0)  # the scheduled flush finds nothing left to send
        return closed, aborted

    closed, aborted = asyncio.run(main())
    assert closed.writes == [b"last words"] and closed.closed
    assert aborted.writes == [] and aborted.aborted


def serve_one_request(protocol_class: type[Any]) -> RecordingTransport:
    """Feed one HTTP request to a uvicorn protocol over a recording transport."""
    from uvicorn.config import Config
    from uvicorn.server import ServerState

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        headers = [(b"content-type", b"application/json"), (b"content-length", b"2")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"{}"})

    async def main() -> RecordingTransport:
        config = Config(app, lifespan="off", log_level="warning")
        config.load()
        protocol = protocol_class(config, ServerState(), {}, asyncio.get_running_loop())
        raw = RecordingTransport()
        protocol.connection_made(raw)
        protocol.data_received(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        for _ in range(20):
            await asyncio.sleep(0)
        return raw

    return asyncio.run(main())


def test_the_gateways_protocol_sends_a_response_in_one_write() -> None:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    from web_gateway.workers import GatewayWorker

    assert GatewayWorker.CONFIG_KWARGS["http"] == "web_gateway.http_protocol:GatewayHttpProtocol"
    assert issubclass(GatewayHttpProtocol, CoalescingHttpToolsProtocol)
    plain = serve_one_request(HttpToolsProtocol)
    assert len(plain.writes) == 2  # uvicorn's own: headers, then body
    for protocol in (CoalescingHttpToolsProtocol, GatewayHttpProtocol):
        raw = serve_one_request(protocol)
        assert len(raw.writes) == 1
        assert raw.writes[0].startswith(b"HTTP/1.1 200 OK\r\n")
        assert raw.writes[0].endswith(b"\r\n\r\n{}")


class Limited(GatewayHttpProtocol):
    limits = ConnectionLimits(header_timeout=1, body_timeout=1, keepalive_timeout=1)


def run_protocol(
    app: Any,
    chunks: list[bytes],
    expire: bool = True,
    protocol_class: type[GatewayHttpProtocol] = Limited,
    turns: int = 10,
) -> tuple[Any, Any]:
    """Feed ``chunks`` to a ``protocol_class`` protocol serving ``app``, letting the event loop
    turn ``turns`` times after each; then (with ``expire``) let its deadline pass."""
    from uvicorn.config import Config
    from uvicorn.server import ServerState

    async def main() -> tuple[Any, Any]:
        config = Config(app, lifespan="off", log_level="warning")
        config.load()
        protocol = protocol_class(config, ServerState(), {}, asyncio.get_running_loop())
        raw = RecordingTransport()
        protocol.connection_made(raw)  # type: ignore[arg-type]
        for chunk in chunks:
            protocol.data_received(chunk)
            for _ in range(turns):
                await asyncio.sleep(0)
        assert protocol.deadline < float("inf") or not expire
        if expire:
            protocol.expire()  # as the sweep does once the deadline has passed
        for _ in range(10):
            await asyncio.sleep(0)
        return protocol, raw

    return asyncio.run(main())


def written(raw: RecordingTransport) -> bytes:
    return b"".join(raw.writes)


async def answer_ok(send: Any) -> None:
    headers = [(b"content-length", b"2")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": b"{}"})


def test_stalled_headers_get_408_and_a_close() -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("no request reached the app")

    for chunks in ([], [b"GET / HTTP/1.1\r\nHost: x\r\nAcc"]):
        _, raw = run_protocol(app, chunks)
        assert written(raw).startswith(b"HTTP/1.1 408 Request Timeout\r\n")
        assert b"headers did not arrive within 1 s" in written(raw) and raw.closed


def test_a_stalled_body_gets_408_and_the_app_sees_the_client_gone() -> None:
    seen: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            seen.append(message["type"])
            if message["type"] == "http.disconnect":
                return

    head = b"POST /v2/models/m/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n"
    _, raw = run_protocol(app, [head, b"abc"])
    assert written(raw).startswith(b"HTTP/1.1 408 Request Timeout\r\n")
    assert b'{"error":"RequestTimeout: the request\'s body did not arrive' in written(raw)
    assert seen[-1] == "http.disconnect" and raw.closed


def test_no_408_after_a_response_the_app_already_gave() -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await answer_ok(send)  # e.g. a 413 before reading the body

    head = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n"
    protocol, raw = run_protocol(app, [head, b"abc"])
    assert written(raw).startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"408" not in written(raw) and raw.closed

    async def served(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await answer_ok(send)

    protocol, raw = run_protocol(served, [b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"])
    assert protocol.phase == IDLE  # idle after its response: closed quietly
    assert written(raw).count(b"HTTP/1.1 ") == 1 and raw.closed


class SmallHeaders(Limited):
    limits = ConnectionLimits(header_timeout=1, body_timeout=1, max_header_bytes=2048)


def serve_small_headers(
    chunks: list[bytes], turns: int = 10
) -> tuple[Any, RecordingTransport, list[bytes], list[str]]:
    """Feed ``chunks`` to a protocol allowing 2 KiB of URL and headers (as ``run_protocol``);
    the bodies its app was handed, and the paths it answered, in order."""
    bodies: list[bytes] = []
    answered: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        body, more = b"", True
        while more:
            message = await receive()
            body, more = body + message["body"], message["more_body"]
        bodies.append(body)
        await answer_ok(send)
        answered.append(scope["path"])

    protocol, raw = run_protocol(app, chunks, False, SmallHeaders, turns)
    return protocol, raw, bodies, answered


def test_headers_over_the_limit_get_431_and_a_close_and_reach_no_app() -> None:
    pad = b"X-Pad: " + b"a" * 600 + b"\r\n"  # four of them: over 2 KiB
    protocol, raw, bodies, _ = serve_small_headers([b"GET / HTTP/1.1\r\nHost: x\r\n", pad * 4, pad])
    assert written(raw).startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n")
    assert b'"HeadersTooLarge"' in written(raw) and b"2048 bytes" in written(raw)
    assert raw.closed and not bodies and protocol.phase == REFUSED
    protocol.data_received(pad)  # what follows is ignored
    assert written(raw).count(b"HTTP/1.1 ") == 1


def test_a_header_that_never_ends_is_refused_within_a_read_of_the_limit() -> None:
    endless = [b"GET / HTTP/1.1\r\nHost: x\r\nX-Pad: "] + [b"a" * 65536] * 8
    protocol, raw, bodies, _ = serve_small_headers(endless)
    assert written(raw).startswith(b"HTTP/1.1 431 ") and raw.closed and not bodies
    # refused at the first read past the limit and a read's slack (256 KiB), not at the end
    assert protocol.unparsed_header_bytes <= 2048 + 256 * 1024 + 65536


def test_headers_within_the_limit_and_a_body_far_over_it_are_served() -> None:
    body = b"b" * (600 * 1024)
    head = b"POST / HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 1900 + b"\r\n"
    head += b"Content-Length: %d\r\n\r\n" % len(body)
    for chunks in ([head + body], [head, body[:300000], body[300000:]]):
        _, raw, bodies, _ = serve_small_headers(chunks)
        assert written(raw).startswith(b"HTTP/1.1 200 OK\r\n") and bodies == [body]


def test_pipelined_requests_are_answered_in_order_up_to_the_queues_bound() -> None:
    """A connection's pipelined requests are answered in order; past MAX_PIPELINED queued
    behind the one in progress, it reads no more, answers those, and is closed."""
    for sent, answered in ((30, 30), (MAX_PIPELINED + 100, MAX_PIPELINED + 1)):
        requests = b"".join(b"GET /%d HTTP/1.1\r\nHost: x\r\n\r\n" % i for i in range(sent))
        _, raw, _, paths = serve_small_headers([requests], turns=2000)
        out = written(raw)
        assert out.count(b"HTTP/1.1 200 OK\r\n") == answered == len(paths)
        assert paths == [f"/{i}" for i in range(answered)]
        assert raw.closed == (answered < sent) and b"400" not in out


def test_one_connection_over_the_cap_is_refused() -> None:
    from uvicorn.config import Config
    from uvicorn.server import ServerState

    class Capped(GatewayHttpProtocol):
        limits = ConnectionLimits(max_connections=2, retry_after=7)

    async def main() -> list[RecordingTransport]:
        config = Config(answer_ok, lifespan="off", log_level="warning")
        config.load()
        state, loop = ServerState(), asyncio.get_running_loop()
        transports = [RecordingTransport() for _ in range(3)]
        for raw in transports:
            Capped(config, state, {}, loop).connection_made(raw)  # type: ignore[arg-type]
        await asyncio.sleep(0)
        return transports

    first, second, third = asyncio.run(main())
    assert not first.closed and not second.closed
    assert written(third).startswith(b"HTTP/1.1 503 Service Unavailable\r\n") and third.closed
    assert b"retry-after: 7\r\n" in written(third)  # the gateway's --retry-after setting


class Untaken(RecordingTransport):
    """A transport whose client takes nothing: all that is written waits in its buffer."""

    def get_write_buffer_size(self) -> int:
        return len(written(self))


class SendLimited(GatewayHttpProtocol):
    limits = ConnectionLimits(keepalive_timeout=1, send_timeout=3)


def test_a_client_that_takes_no_answers_is_aborted_after_the_send_timeout(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Writing paused (the client takes nothing) arms the send deadline and writing resumed
    clears it; past it, the connection is aborted and the app waiting to send sees it gone."""
    from uvicorn.config import Config
    from uvicorn.server import ServerState

    seen: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await answer_ok(send)  # waits while writing is paused
        seen.append("sent")
        seen.append((await receive())["type"])

    async def main() -> tuple[Any, Untaken, float]:
        config = Config(app, lifespan="off", log_level="warning")
        config.load()
        loop = asyncio.get_running_loop()
        protocol = SendLimited(config, ServerState(), {}, loop)
        raw = Untaken()
        protocol.connection_made(raw)  # type: ignore[arg-type]
        protocol.pause_writing()  # as the transport does over its high-water mark
        armed = protocol.send_deadline - loop.time()
        protocol.resume_writing()
        assert protocol.send_deadline == float("inf")
        protocol.pause_writing()
        protocol.data_received(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        for _ in range(10):
            await asyncio.sleep(0)
        assert seen == [] and not raw.aborted  # the app waits to send
        protocol.sending_expired()  # as the sweep does once the deadline has passed
        assert raw.aborted
        protocol.connection_lost(None)  # as the transport does once aborted
        for _ in range(10):
            await asyncio.sleep(0)
        return protocol, raw, armed

    protocol, raw, armed = asyncio.run(main())
    assert 2.9 < armed <= 3.0 and protocol.send_deadline == float("inf")
    assert seen == ["sent", "http.disconnect"] and written(raw) == b""
    assert "1 whose client did not take its answers" in caplog.text  # the sweeper's summary


def test_a_connection_closed_with_answers_unsent_gives_them_the_send_timeout() -> None:
    """A transport closed with data unsent waits for it to leave, however long: the send
    deadline bounds that wait; closed with nothing unsent, there is no deadline."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await answer_ok(send)

    from uvicorn.config import Config
    from uvicorn.server import ServerState

    async def main(transport_class: type[RecordingTransport]) -> tuple[Any, RecordingTransport]:
        config = Config(app, lifespan="off", log_level="warning")
        config.load()
        protocol = SendLimited(config, ServerState(), {}, asyncio.get_running_loop())
        raw = transport_class()
        protocol.connection_made(raw)  # type: ignore[arg-type]
        protocol.data_received(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        for _ in range(10):
            await asyncio.sleep(0)
        assert protocol.phase == IDLE and protocol.send_deadline == float("inf")
        protocol.expire()  # idle past the keep-alive timeout: closed
        assert raw.closed
        return protocol, raw

    for transport_class, deadline in ((Untaken, True), (RecordingTransport, False)):
        protocol, raw = asyncio.run(main(transport_class))
        assert (protocol.send_deadline < float("inf")) == deadline
        if deadline:
            protocol.sending_expired()
            assert raw.aborted


class SmallBudget(GatewayHttpProtocol):
    limits = ConnectionLimits(max_held_body_bytes=1000, retry_after=7)


def test_request_bodies_are_held_within_the_process_budget_and_released_when_answered() -> None:
    """Two connections' bodies are counted together: the one that takes the process past its
    budget is answered 503 and closed, and the app sees its client gone; answered requests,
    pipelined or answered before their body was read, release what they held."""
    from uvicorn.config import Config
    from uvicorn.server import ServerState

    seen: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["path"] == "/early":  # answered before reading its body
            await answer_ok(send)
            return
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                seen.append(f"{scope['path']} gone")
                return
            more = message["more_body"]
        await answer_ok(send)
        seen.append(f"{scope['path']} answered")

    def post(path: str, length: int, body: bytes) -> bytes:
        return b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (
            path.encode(),
            length,
            body,
        )

    async def turns() -> None:
        for _ in range(20):
            await asyncio.sleep(0)

    async def main() -> tuple[RecordingTransport, RecordingTransport, int, list[int]]:
        config = Config(app, lifespan="off", log_level="warning")
        config.load()
        state, loop = ServerState(), asyncio.get_running_loop()
        first, second = (SmallBudget(config, state, {}, loop) for _ in range(2))
        one, two = RecordingTransport(), RecordingTransport()
        first.connection_made(one)  # type: ignore[arg-type]
        second.connection_made(two)  # type: ignore[arg-type]
        first.data_received(post("/one", 900, b"a" * 600))
        await turns()
        second.data_received(post("/two", 900, b"b" * 600))  # 1200 held: over the budget
        await turns()
        held = [first._sweeper.held_body_bytes]
        second.connection_lost(None)  # as the transport does once closed
        held.append(first._sweeper.held_body_bytes)
        first.data_received(b"a" * 300)  # the rest of /one: answered
        await turns()
        held.append(first._sweeper.held_body_bytes)
        pipelined = post("/three", 400, b"c" * 400) + post("/four", 400, b"d" * 400)
        first.data_received(pipelined + post("/early", 500, b"e" * 100))
        await turns()
        first.data_received(b"e" * 400)
        await turns()
        return one, two, first._sweeper.held_body_bytes, held

    one, two, after, held = asyncio.run(main())
    assert written(two).startswith(b"HTTP/1.1 503 Service Unavailable\r\n") and two.closed
    assert b'"TooManyBodyBytes"' in written(two) and b"retry-after: 7\r\n" in written(two)
    assert held == [1200, 600, 0]
    assert seen == ["/two gone", "/one answered", "/three answered", "/four answered"]
    assert written(one).count(b"HTTP/1.1 200 OK\r\n") == 4 and not one.closed
    assert after == 0


def test_what_is_not_http_gets_a_json_400_and_upgrades_are_served_without_a_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await answer_ok(send)

    _, garbage = run_protocol(app, [b"GARBAGE\x00\r\n\r\n"], expire=False)
    refused = written(garbage)
    assert refused.startswith(b"HTTP/1.1 400 Bad Request\r\n") and garbage.closed
    assert b'{"error":{"type":"BadRequest","message":"the request is not valid HTTP: ' in refused
    upgrade = b"GET / HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n"
    _, upgraded = run_protocol(app, [upgrade, upgrade.replace(b"h2c", b"websocket")], False)
    assert written(upgraded).count(b"HTTP/1.1 200 OK\r\n") == 2 and not upgraded.closed
    said = [record.getMessage() for record in caplog.records]
    assert len(said) == 1 and "1 not valid HTTP" in said[0]  # the sweeper's summary alone


def test_what_is_not_valid_http_on_a_v2_route_gets_the_protocol_s_error_body() -> None:
    """A malformed request to a /v2 route (its Content-Length not a number) was answered in
    microbatch's error format, where every other error of a /v2 route uses the Open Inference
    Protocol's string ``error`` (which v2 clients such as the KServe SDK print)."""
    bad_length = b"POST /v2/models/m/infer HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n"
    _, raw = run_protocol(answer_app, [bad_length], expire=False)
    assert written(raw).startswith(b"HTTP/1.1 400 Bad Request\r\n") and raw.closed
    assert b'{"error":"BadRequest: the request is not valid HTTP: ' in written(raw)
    v1 = bad_length.replace(b"/v2/models/m/infer", b"/v1/models/m/predict")
    _, raw = run_protocol(answer_app, [v1], expire=False)
    v1_body = b'{"error":{"type":"BadRequest","message":"the request is not valid HTTP: '
    assert v1_body in written(raw)


def test_a_parser_callback_s_own_failure_is_logged_with_its_traceback(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fault of the protocol's own code raised in a parser callback was answered as the
    client's (400, 'not valid HTTP') and nothing was logged: a bug here looked like garbage."""
    import web_gateway.http_protocol as http_protocol

    def broken(self: Any, name: bytes, value: bytes) -> None:
        raise RuntimeError("a fault of the protocol's own")

    monkeypatch.setattr(GatewayHttpProtocol, "_note_framing", broken)
    monkeypatch.setattr(http_protocol, "_CALLBACK_FAILURES", http_protocol.Every(60.0))
    _, raw = run_protocol(answer_app, [b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"], False)
    assert written(raw).startswith(b"HTTP/1.1 400 Bad Request\r\n") and raw.closed
    failed = [r for r in caplog.records if "parser callback failed" in r.getMessage()]
    assert len(failed) == 1 and failed[0].exc_info is not None
    assert "a fault of the protocol's own" in str(failed[0].exc_info[1])


def watch_gone(chunks: list[bytes], end: str) -> list[str]:
    """Serve ``chunks`` to an app that reads the body and waits on ``when_gone`` (no task on
    ``receive``); then end the connection as ``end`` says: "lost", "expire" or "answer"."""
    from uvicorn.config import Config
    from uvicorn.server import ServerState

    from web_gateway.disconnects import when_gone

    events: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        gone = asyncio.get_running_loop().create_future()
        stop = when_gone(receive, lambda: gone.set_result(None))
        assert stop is not None
        try:
            await asyncio.wait_for(gone, 2)
            events.append("gone")
        except TimeoutError:
            events.append("answered")
            stop()
            await answer_ok(send)

    async def main() -> None:
        config = Config(app, lifespan="off", log_level="warning")
        config.load()
        protocol = Limited(config, ServerState(), {}, asyncio.get_running_loop())
        protocol.connection_made(RecordingTransport())  # type: ignore[arg-type]
        for chunk in chunks:
            protocol.data_received(chunk)
        for _ in range(10):
            await asyncio.sleep(0)
        if end == "lost":
            protocol.connection_lost(None)
        elif end == "expire":  # its body's deadline passed
            protocol.expire()
        await asyncio.sleep(0.01)
        while protocol.tasks:
            await asyncio.sleep(0.05)

    asyncio.run(main())
    return events


def test_when_gone_calls_back_once_the_client_goes_without_a_task_on_receive() -> None:
    request = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"
    assert watch_gone([request], "lost") == ["gone"]
    assert watch_gone([request[:-1]], "expire") == ["gone"]  # the body cut off
    assert watch_gone([request], "answer") == ["answered"]


def test_when_gone_is_none_where_the_server_is_not_the_gateways() -> None:
    from web_gateway.disconnects import when_gone

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    class Slotted:
        __slots__ = ()

        async def receive(self) -> dict[str, Any]:
            return {"type": "http.disconnect"}

    for plain in (receive, Slotted().receive, print):
        assert when_gone(plain, lambda: None) is None


def answer_twice(direct: bool, requests: bytes) -> tuple[Any, RecordingTransport]:
    """Two JSON answers (200, then 422) to ``requests`` by GatewayHttpProtocol, through
    ``answer_json`` or through the ASGI messages; with uvicorn's default headers set."""
    from uvicorn.config import Config
    from uvicorn.server import ServerState

    from web_gateway.responses import JSONBody

    statuses = iter((200, 422))

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        response = JSONBody(b'{"outputs":[1]}', next(statuses))
        if direct:
            assert send.__self__.answer_json(response.status_code, response.body)
        else:
            await response(scope, receive, send)

    async def main() -> tuple[Any, RecordingTransport]:
        config = Config(app, lifespan="off", log_level="warning", access_log=False)
        config.load()
        state = ServerState()
        state.default_headers = [(b"date", b"Thu, 01 Jan 2026 00:00:00 GMT")]
        state.default_headers += config.encoded_headers
        protocol = GatewayHttpProtocol(config, state, {}, asyncio.get_running_loop())
        raw = RecordingTransport()
        protocol.connection_made(raw)  # type: ignore[arg-type]
        protocol.data_received(requests)
        for _ in range(30):
            await asyncio.sleep(0)
        return protocol, raw

    return asyncio.run(main())


def test_answer_json_writes_what_the_asgi_messages_would() -> None:
    post = b"POST /v1/models/m/predict HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"
    closing = post.replace(b"Host: x", b"Host: x\r\nConnection: close")
    for requests in (post + post, post + closing, post.replace(b"1.1", b"1.0")):
        protocol, direct = answer_twice(True, requests)
        _, asgi = answer_twice(False, requests)
        assert written(direct) == written(asgi)
        assert direct.closed == asgi.closed
        assert written(direct).startswith(b"HTTP/1.1 200 OK\r\ndate: Thu, 01 Jan")
        assert b"server: uvicorn\r\ncontent-length: 15\r\ncontent-type: application/json" in (
            written(direct)
        )
        if requests == post + post:  # both answered, the connection idle and open
            assert b"HTTP/1.1 422 Unprocessable" in written(direct)
            assert protocol.phase == IDLE and not direct.closed
    _, closed = answer_twice(True, post + closing)
    assert written(closed).endswith(b"connection: close\r\n\r\n" + b'{"outputs":[1]}')


def test_http10_clients_asking_for_keep_alive_are_kept_alive() -> None:
    """ApacheBench -k sends HTTP/1.0 with Connection: keep-alive; uvicorn closed after each
    answer, so every request paid for a new connection."""
    post10 = b"POST /v1/models/m/predict HTTP/1.0\r\nContent-Length: 2\r\n\r\n{}"
    kept = post10.replace(b"HTTP/1.0\r\n", b"HTTP/1.0\r\nConnection: Keep-Alive\r\n")
    for direct in (True, False):
        protocol, transport = answer_twice(direct, kept + kept)
        answers = written(transport).split(b"HTTP/1.1 ")[1:]
        assert len(answers) == 2 and answers[1].startswith(b"422")
        assert all(b"\r\nconnection: keep-alive\r\n\r\n" in answer for answer in answers)
        assert protocol.phase == IDLE and not transport.closed
        # without the header an HTTP/1.0 request is its connection's last, as before
        _, transport = answer_twice(direct, post10 + post10)
        assert written(transport).count(b"HTTP/1.1 ") == 1 and transport.closed
        assert b"connection: close" in written(transport)


def test_an_http10_request_naming_close_with_keep_alive_is_its_connections_last() -> None:
    """``Connection: keep-alive, close`` (or the two in separate lines) on HTTP/1.0 kept the
    connection, as the parser reads keep-alive alone there: "close" says the connection ends
    after this answer (RFC 9112, 9.3), whatever else the header says."""
    post10 = b"POST /v1/models/m/predict HTTP/1.0\r\nContent-Length: 2\r\n\r\n{}"
    for connection in (
        b"Keep-Alive, close",
        b"close,keep-alive",
        b"keep-alive\r\nConnection: Close",
    ):
        asked = post10.replace(b"HTTP/1.0\r\n", b"HTTP/1.0\r\nConnection: %s\r\n" % connection)
        for direct in (True, False):
            _, transport = answer_twice(direct, asked + asked)
            assert written(transport).count(b"HTTP/1.1 ") == 1 and transport.closed, connection
            assert b"connection: keep-alive" not in written(transport)


def test_answer_json_leaves_to_send_what_it_cannot_write_as_send_would() -> None:
    from web_gateway.http_protocol import GatewayCycle

    cycle: Any = object.__new__(GatewayCycle)
    cycle.response_started = cycle.disconnected = cycle.access_log = False
    cycle.flow = type("Flow", (), {"write_paused": False})()
    cycle.scope = {"method": "POST"}
    cycle.default_headers = [(b"x-bad", b"new\nline")]  # send() refuses it: left to send()
    assert cycle.answer_json(200, b"{}") is False
    cycle.default_headers = [(b"connection", b"close")]  # one send() reads
    assert cycle.answer_json(200, b"{}") is False
    for flag in ("response_started", "disconnected", "access_log"):
        setattr(cycle, flag, True)
        assert cycle.answer_json(200, b"{}") is False
        setattr(cycle, flag, False)
    cycle.flow.write_paused = True
    assert cycle.answer_json(200, b"{}") is False
    assert cycle.response_started is False


def echo_bodies(chunks: list[bytes], whole: bool) -> tuple[list[bytes], bytes]:
    """The bodies web_gateway.reading.body read from each request in ``chunks`` (fed one by
    one) under GatewayHttpProtocol, and what was written; ``whole`` False hides
    ``whole_body`` (each body then read through receive())."""
    from web_gateway import reading
    from web_gateway.http_protocol import GatewayCycle
    from web_gateway.responses import JSONBody

    bodies: list[bytes] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        request = reading.GatewayRequest(scope, receive, send)
        assert isinstance(receive.__self__, GatewayCycle)
        if not whole:
            request._receive = lambda: receive()  # no __self__: read through receive()
        bodies.append(await reading.body(request, 1 << 20))
        await JSONBody(b"{}")(scope, receive, send)

    _, raw = run_protocol(app, chunks, expire=False)
    return bodies, written(raw)


def test_a_body_all_arrived_is_taken_from_the_cycle_as_receive_would_give_it() -> None:
    head = b"POST /v1/models/m/predict HTTP/1.1\r\nHost: x\r\n"
    whole = head + b"Content-Length: 5\r\n\r\nhello"
    empty = head + b"Content-Length: 0\r\n\r\n"
    chunked = head + b"Transfer-Encoding: chunked\r\n\r\n3\r\nhel\r\n2\r\nlo\r\n0\r\n\r\n"
    expect = head + b"Expect: 100-continue\r\nContent-Length: 5\r\n\r\n"
    cases = [
        [whole + whole],  # pipelined
        [empty],
        [whole[:-3], whole[-3:]],  # the body in two reads
        [chunked[:-12], chunked[-12:]],
        [expect, b"hello"],  # receive() answers 100 Continue first
    ]
    for chunks in cases:
        taken, answer = echo_bodies(chunks, whole=True)
        received, same_answer = echo_bodies(chunks, whole=False)
        assert taken == received and answer == same_answer
        assert set(taken) <= {b"hello", b""} and taken
    assert echo_bodies(cases[-1], whole=True)[1].startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
    # an HTTP/1.0 client cannot ask for it (RFC 9110, 10.1.1): the expectation is ignored
    expect10 = [cases[-1][0].replace(b"HTTP/1.1", b"HTTP/1.0"), b"hello"]
    taken, answer = echo_bodies(expect10, whole=True)
    assert taken == [b"hello"] and answer.startswith(b"HTTP/1.1 200 OK")


def test_a_request_asking_for_an_upgrade_is_served_with_its_body() -> None:
    """`curl --http2` asks for h2c: the parser ends such a request at its headers and takes
    what follows as the new protocol's. The body is the request's, and a body that reads as a
    request is never served as one."""
    inner = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
    head = (
        b"POST /v1/models/m/predict HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings"
        b"\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAoAAAAAIAAAAA\r\n"
    )
    upgrade = head + b"Content-Length: %d\r\n\r\n" % len(inner)
    plain = b"POST /v1/models/m/predict HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello"
    for whole in (True, False):
        for chunks in (
            [upgrade + inner],
            [upgrade, inner],  # the body in a later read
            [upgrade + inner[:7], inner[7:] + plain],  # and a request after it
            [upgrade[:-5], upgrade[-5:] + inner + plain[:20], plain[20:]],
        ):
            bodies, answers = echo_bodies(chunks, whole)
            expected = [inner, b"hello"] if plain[20:] in b"".join(chunks) else [inner]
            assert bodies == expected, chunks
            assert answers.count(b"HTTP/1.1 200 OK") == len(expected)
    empty_upgrade = head.replace(b"POST", b"GET") + b"\r\n"
    assert echo_bodies([empty_upgrade + plain], whole=True)[0] == [b"", b"hello"]
    chunked = head + b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
    bodies, answers = echo_bodies([chunked], whole=True)
    assert answers.startswith(b"HTTP/1.1 400 Bad Request") and bodies in ([], [b""])


def test_a_json_body_has_the_headers_starlette_gives_a_json_response() -> None:
    from starlette.responses import Response

    from web_gateway.responses import JSONBody

    for body, status in ((b"{}", 200), (b'{"outputs":[]}', 422), (b"", 200)):
        plain = Response(body, status, media_type="application/json")
        assert JSONBody(body, status).raw_headers == plain.raw_headers


class EqualLimits(GatewayHttpProtocol):
    limits = ConnectionLimits(max_held_body_bytes=1000, max_body_bytes=1000)


def test_a_body_over_the_request_limit_is_answered_413_when_it_also_trips_the_budget() -> None:
    """A body over --max-body-bytes that arrived with its headers took the process past its
    budget before the app could look at its Content-Length: the client got a retryable 503
    for what can never be accepted. Over the request limit (as it arrived, or as declared),
    it is 413, as the app answers; a body within it that trips the budget is still 503."""
    from uvicorn.config import Config
    from uvicorn.server import ServerState

    async def app(scope: Any, receive: Any, send: Any) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    def post(path: str, length: int, body: bytes) -> bytes:
        head = b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (
            path.encode(),
            length,
        )
        return head + body

    async def main() -> list[tuple[bytes, bool]]:
        config = Config(app, lifespan="off", log_level="warning")
        config.load()
        state, loop = ServerState(), asyncio.get_running_loop()
        transports = []
        for data in (
            post("/v1/models/m/predict", 1500, b"a" * 1500),  # over as it arrives
            post("/v2/models/m/infer", 5000, b"b" * 1100),  # declared over, v2
            post("/v1/models/m/predict", 900, b"c" * 600),  # within, held on
            post("/v1/models/m/predict", 900, b"d" * 600),  # within: the budget's 503
        ):
            protocol = EqualLimits(config, state, {}, loop)
            transport = RecordingTransport()
            protocol.connection_made(transport)  # type: ignore[arg-type]
            protocol.data_received(data)
            if transport.closed:
                protocol.connection_lost(None)  # as the transport does once closed
            transports.append(transport)
            for _ in range(5):
                await asyncio.sleep(0)
        # (read before the loop ends: it would cancel the app still reading its body)
        return [(written(transport), transport.closed) for transport in transports]

    over, declared, held, budget = asyncio.run(main())
    assert over[0].startswith(b"HTTP/1.1 413 ") and over[1]
    assert b'{"error":{"type":"PayloadTooLarge"' in over[0] and b"retry-after" not in over[0]
    assert declared[0].startswith(b"HTTP/1.1 413 ") and declared[1]
    assert b'{"error":"PayloadTooLarge: ' in declared[0]  # the v2 error shape
    assert held == (b"", False)
    assert budget[0].startswith(b"HTTP/1.1 503 ") and b'"TooManyBodyBytes"' in budget[0]


async def serving_a_socket_pair() -> tuple[Limited, socket.socket]:
    """The protocol serving one connection of a real socket pair, to an app that answers
    200 OK; the protocol, and the client's end (non-blocking)."""
    from uvicorn.config import Config
    from uvicorn.server import ServerState

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await answer_ok(send)

    config = Config(app, lifespan="off", log_level="warning")
    config.load()
    loop = asyncio.get_running_loop()
    protocol = Limited(config, ServerState(), {}, loop)
    client, server = socket.socketpair()
    client.setblocking(False)
    await loop.connect_accepted_socket(lambda: protocol, server)
    return protocol, client


def serve_on_a_socket(act: str) -> list[bytes]:
    """Serve a keep-alive connection over a real socket pair: one request answered, then a
    second sent and, before the event loop has read it, the idle connection's deadline
    passes (``act`` "expire", as the sweep finds it) or the server stops (``act``
    "shutdown", as uvicorn's graceful stop calls it). Returns what the client then reads,
    read by read, until the connection ends (b"RESET" for a reset)."""
    request = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"

    async def main() -> list[bytes]:
        loop = asyncio.get_running_loop()
        protocol, client = await serving_a_socket_pair()
        await loop.sock_sendall(client, request)
        assert (await loop.sock_recv(client, 65536)).startswith(b"HTTP/1.1 200 OK\r\n")
        assert protocol.phase == IDLE
        client.send(request)  # in the kernel's buffer, not yet read by the loop
        if act == "expire":
            protocol.expire()
        else:
            protocol.shutdown()
        reads: list[bytes] = []
        while True:
            try:
                data = await asyncio.wait_for(loop.sock_recv(client, 65536), 5)
            except ConnectionResetError:
                data = b"RESET"
            if not data:
                break
            reads.append(data)
            if data == b"RESET" or act == "expire":
                break
        client.close()
        return reads

    return asyncio.run(main())


@pytest.mark.parametrize("act", ["expire", "shutdown"])
def test_a_request_waiting_unread_on_an_idle_connection_is_served_not_reset(act: str) -> None:
    """An idle connection is closed at its keep-alive deadline and at a graceful stop, but
    not on a request its client sent before then which the event loop has not read yet (a
    stalled or busy loop): closing it would reset the request. It is served; at a stop, with
    ``connection: close``, and the connection then closed."""
    reads = serve_on_a_socket(act)
    answer = b"".join(reads)
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n"), reads
    assert (b"connection: close\r\n" in answer) == (act == "shutdown")


def stop_a_fresh_connection(send_after: float | None) -> bytes:
    """Accept a connection over a real socket pair, stop the server (uvicorn's graceful stop
    calls ``shutdown``) before any byte of a request arrives, then send one ``send_after``
    seconds later (None: never; the sweep's expiry is run by hand). Returns what the client
    read until the connection ended."""

    async def main() -> bytes:
        loop = asyncio.get_running_loop()
        protocol, client = await serving_a_socket_pair()
        stopped = loop.time()
        protocol.shutdown()
        if send_after is None:
            assert protocol.deadline <= stopped + 1.0 + 1e-3  # a short grace, not the 10 s
            protocol.expire()
        else:
            await asyncio.sleep(send_after)
            await loop.sock_sendall(client, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = b""
        while data := await asyncio.wait_for(loop.sock_recv(client, 65536), 5):
            answer += data
        client.close()
        return answer

    return asyncio.run(main())


def test_a_connection_accepted_just_before_a_stop_has_its_first_request_served() -> None:
    """A stop (SIGTERM, a `--max-requests` replacement) closed at once a connection accepted
    but whose request had not arrived yet: its client, which opened it to send one, saw it
    closed unanswered. Its first request now gets a short grace and is served, as the
    connection's last; one that never comes is not answered 408, the connection just closed."""
    answer = stop_a_fresh_connection(0.2)
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n") and b"connection: close\r\n" in answer
    assert stop_a_fresh_connection(None) == b""


def test_a_transfer_coding_other_than_chunked_is_refused_with_501() -> None:
    """The parser reads the body of `Transfer-Encoding: gzip, chunked` as chunked alone: the
    app got the compressed bytes as the body. RFC 9112, 6.1: 501 for a coding not understood."""
    head = b"POST /v1/models/m/predict HTTP/1.1\r\nHost: x\r\n"
    chunked = b"Transfer-Encoding: %s\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
    for coding in (b"gzip, chunked", b"foo ,chunked", b"Deflate,Chunked"):
        bodies, answer = echo_bodies([head + chunked % coding], whole=True)
        assert bodies == [] and answer.startswith(b"HTTP/1.1 501 Not Implemented\r\n")
        assert b'"NotImplemented"' in answer and b"only chunked" in answer
    split = head + b"Transfer-Encoding: gzip\r\n" + chunked % b"chunked"
    bodies, answer = echo_bodies([split], whole=True)  # the codings over two lines
    assert bodies == [] and answer.startswith(b"HTTP/1.1 501 ")
    for coding in (b"chunked", b"\tCHUNKED "):
        bodies, answer = echo_bodies([head + chunked % coding], whole=True)
        assert bodies == [b"hello"] and answer.startswith(b"HTTP/1.1 200 OK\r\n")


def test_an_http10_request_with_a_transfer_encoding_is_its_connections_last() -> None:
    """RFC 9112, 6.1: such a request's framing is faulty (an HTTP/1.0 hop may read its body
    otherwise), so its connection is closed after it, even where it asks for keep-alive."""
    chunked = (
        b"POST /v1/models/m/predict HTTP/1.0\r\nConnection: keep-alive\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
    )
    then = b"GET /v1/models HTTP/1.0\r\nConnection: keep-alive\r\n\r\n"
    bodies, answer = echo_bodies([chunked + then], whole=True)
    assert bodies == [b"hello"] and answer.count(b"HTTP/1.1 ") == 1
    assert b"connection: close\r\n" in answer
    length = b"POST /v1/models/m/predict HTTP/1.0\r\nConnection: keep-alive\r\n"
    length += b"Content-Length: 5\r\n\r\nhello"
    bodies, answer = echo_bodies([length + length], whole=True)  # kept alive, as before
    assert bodies == [b"hello", b"hello"] and answer.count(b"connection: keep-alive\r\n") == 2


def test_a_request_without_its_one_host_header_is_refused_with_400() -> None:
    """RFC 9112, 3.2: 400 for an HTTP/1.1 request without a Host header and for any request
    with more than one (a proxy in front may route on either of two)."""
    get = b"GET /v1/models HTTP/1.1\r\n%s\r\n"
    for headers, why in (
        (b"", b"needs a Host header"),
        (b"Accept: */*\r\n", b"needs a Host header"),
        (b"Host: a\r\nHOST: b\r\n", b"one Host header at most"),
    ):
        _, raw = run_protocol(answer_app, [get % headers + get % b"Host: x\r\n"], expire=False)
        assert written(raw).startswith(b"HTTP/1.1 400 Bad Request\r\n") and raw.closed
        assert why in written(raw) and written(raw).count(b"content-length: ") == 1
    v2 = b"GET /v2/models/m HTTP/1.0\r\nHost: a\r\nHost: b\r\n\r\n"
    _, raw = run_protocol(answer_app, [v2], expire=False)
    assert b'{"error":"BadRequest: a request has one Host header at most"' in written(raw)
    for served in (get % b"Host: x\r\n", b"GET /v1/models HTTP/1.0\r\n\r\n"):
        _, raw = run_protocol(answer_app, [served], expire=False)
        assert written(raw).startswith(b"HTTP/1.1 200 OK\r\n")


def test_a_request_of_another_http_version_is_refused_with_505() -> None:
    """The parser reads HTTP/2.0 and HTTP/0.9 request lines, and they were served as HTTP/1.x
    (RFC 9110, 15.6.6: 505 for a major version the server does not support)."""
    for version in (b"2.0", b"0.9"):
        request = b"GET /v1/models HTTP/%s\r\nHost: x\r\n\r\n" % version
        _, raw = run_protocol(answer_app, [request], expire=False)
        assert written(raw).startswith(b"HTTP/1.1 505 HTTP Version Not Supported\r\n")
        assert b"HTTP/%s is not served" % version in written(raw) and raw.closed


def test_an_unknown_method_is_refused_with_501() -> None:
    """A request line whose method is a token the server does not know (``FOO``, ``get``:
    methods are case-sensitive) was answered 400, as if it were not HTTP; RFC 9110, 9.1 and
    15.6.2: 501 Not Implemented. What is no method at all (a TLS handshake) stays a 400."""
    for method in (b"FOO", b"get", b"GETX", b"M-FOO"):
        for path in (b"/v1/models", b"/v2/models/m/infer"):
            request = b"%s %s HTTP/1.1\r\nHost: x\r\n\r\n" % (method, path)
            _, raw = run_protocol(answer_app, [request], expire=False)
            answer = written(raw)
            assert answer.startswith(b"HTTP/1.1 501 Not Implemented\r\n"), (method, answer)
            assert b"NotImplemented" in answer and raw.closed
            assert b"method '%s' is not implemented" % method in answer
            assert (b'{"error":"NotImplemented: ' in answer) == path.startswith(b"/v2")
    # a request line split after its method: still the method's fault
    _, raw = run_protocol(answer_app, [b"FOO ", b"/ HTTP/1.1\r\nHost: x\r\n\r\n"], False)
    assert written(raw).startswith(b"HTTP/1.1 501 Not Implemented\r\n")
    for garbage in (b"\x16\x03\x01\x02\x00\x01\x00", b"GARBAGE\x00\r\n\r\n", b"{}\r\n"):
        _, raw = run_protocol(answer_app, [garbage], expire=False)
        assert written(raw).startswith(b"HTTP/1.1 400 Bad Request\r\n"), garbage
    # behind a request of the same read (where the parser does not say it starts): the first
    # is answered, then the refusal (400), never a 501 judged from the first one's method
    pipelined = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n\x16\x03\x01 / HTTP/1.1\r\n\r\n"
    _, raw = run_protocol(answer_app, [pipelined], expire=False)
    assert written(raw).startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"HTTP/1.1 400 Bad Request\r\n" in written(raw) and raw.closed
    body = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 6\r\n\r\nab cd "
    _, raw = run_protocol(answer_app, [body + b"\x16\x03\x01"], expire=False)
    assert b"HTTP/1.1 400 Bad Request\r\n" in written(raw) and raw.closed


async def answer_app(scope: Any, receive: Any, send: Any) -> None:
    await receive()
    await answer_ok(send)


def test_a_request_answered_before_its_expected_body_was_asked_for_closes_its_connection() -> None:
    """A client sending `Expect: 100-continue` and answered at once (a 413 from its
    Content-Length) need not send its body; the connection was kept, and the client's next
    request was read as that body (never answered: the client waited for the body timeout)."""
    expect = b"POST /v1/models/m/predict HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
    refused = expect + b"Content-Length: 100000000\r\n\r\n"
    then = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"

    async def refuse(scope: Any, receive: Any, send: Any) -> None:
        if scope["method"] == "GET":
            await answer_ok(send)
        elif scope["path"].endswith("/direct"):
            send.__self__.access_log = False  # (answer_json leaves uvicorn's log to send())
            assert send.__self__.answer_json(413, b"{}")
        else:
            await send({"type": "http.response.start", "status": 413, "headers": []})
            await send({"type": "http.response.body", "body": b""})

    for path in (b"/direct", b"/asgi"):
        _, raw = run_protocol(refuse, [refused.replace(b" HTTP", path + b" HTTP"), then], False)
        answer = written(raw)
        assert answer.startswith(b"HTTP/1.1 413 ") and b"100 Continue" not in answer
        assert b"connection: close\r\n" in answer and raw.closed
        assert answer.count(b"HTTP/1.1 ") == 1
    # its client sending the body regardless: it is read to its end, the connection kept
    eager = refused.replace(b"100000000", b"10") + b"hello"
    _, raw = run_protocol(refuse, [eager.replace(b" HTTP", b"/asgi HTTP"), b"world" + then], False)
    assert written(raw).startswith(b"HTTP/1.1 413 ") and b"connection: close" not in written(raw)
    assert written(raw).count(b"HTTP/1.1 200 OK\r\n") == 1 and not raw.closed
    # asked for its body (100 Continue), it keeps its connection
    asked = expect + b"Content-Length: 5\r\n\r\n"
    _, raw = run_protocol(answer_app, [asked, b"hello" + then], expire=False)
    assert written(raw).startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n")
    assert written(raw).count(b"HTTP/1.1 200 OK\r\n") == 2 and not raw.closed


def test_the_protocols_own_answers_carry_the_date_as_the_apps_do() -> None:
    """RFC 9110, 6.6.1: every 4xx (and 2xx, 3xx) of a server with a clock has a Date; the
    400, 408, 431 and 501 the protocol writes itself had none."""
    from uvicorn.config import Config
    from uvicorn.server import ServerState

    date = (b"date", b"Thu, 01 Jan 2026 00:00:00 GMT")

    async def main(chunks: list[bytes]) -> bytes:
        config = Config(answer_app, lifespan="off", log_level="warning")
        config.load()
        state = ServerState()
        state.default_headers = [date]
        protocol = Limited(config, state, {}, asyncio.get_running_loop())
        raw = RecordingTransport()
        protocol.connection_made(raw)  # type: ignore[arg-type]
        for chunk in chunks:
            protocol.data_received(chunk)
        if not raw.closed:
            protocol.expire()
        return written(raw)

    head = b"POST /v1/models/m/predict HTTP/1.1\r\nHost: x\r\n"
    for chunks, status in (
        ([b"GARBAGE\r\n\r\n"], b"400"),
        ([b"GET / HTTP/1.1\r\n\r\n"], b"400"),
        ([head + b"Transfer-Encoding: gzip, chunked\r\n\r\n"], b"501"),
        ([head + b"X-Pad: " + b"a" * 70000 + b"\r\n\r\n"], b"431"),
        ([head], b"408"),
    ):
        answer = asyncio.run(main(chunks))
        assert answer.startswith(b"HTTP/1.1 %s " % status), answer
        assert b"\r\ndate: Thu, 01 Jan 2026 00:00:00 GMT\r\ncontent-type: application/json\r\n" in (
            answer
        )


def test_trailer_fields_never_join_the_requests_headers() -> None:
    """uvicorn appended a chunked body's trailer fields to the request's headers: a trailer's
    Content-Encoding had the body decompressed, its X-Request-Timeout was obeyed (a proxy
    checking the headers alone let them through). RFC 9110, 6.5.1: never merged."""
    from web_gateway import reading

    seen: list[list[tuple[bytes, bytes]]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        request = reading.GatewayRequest(scope, receive, send)
        body = await reading.body(request, 1 << 20)
        seen.append(list(scope["headers"]))
        assert body == b"hello"
        await answer_ok(send)

    head = b"POST /v1/models/m/predict HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    trailers = b"Content-Encoding: gzip\r\nX-Request-Timeout: 1\r\n\r\n"
    for chunks in (
        [head + b"5\r\nhello\r\n0\r\n" + trailers],
        [head, b"5\r\nhello\r\n0\r\nContent-Encoding: gzip\r\n", b"X-Request-Timeout: 1\r\n\r\n"],
    ):
        seen.clear()
        _, raw = run_protocol(app, chunks, expire=False)
        assert written(raw).startswith(b"HTTP/1.1 200 OK\r\n")
        assert seen[0] == [(b"host", b"x"), (b"transfer-encoding", b"chunked")]


def test_a_refused_pipelined_request_is_answered_after_the_requests_before_it() -> None:
    """RFC 9112, 9.3.2: answers go in the order of the requests. A request refused by the
    protocol (not HTTP, headers too large, no Host, a broken body) behind one still being
    served had its refusal written at once, the connection closed: the client took the 400
    for its first request, whose answer was lost."""

    async def slow_app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        for _ in range(20):  # still being served when the next request is read
            await asyncio.sleep(0)
        await answer_ok(send)

    post = b"POST /v1/models/m/predict HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"
    for refused, status in (
        (b"GARBAGE\r\n\r\n", b"400"),
        (b"GET / HTTP/1.1\r\nX-Pad: " + b"a" * 70000 + b"\r\n\r\n", b"431"),
        (b"GET / HTTP/1.1\r\n\r\n", b"400"),
        (b"GET / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", b"501"),
        (b"PUT / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", b"400"),
    ):
        for chunks in ([post + refused], [post + post + refused], [post, post + refused]):
            _, raw = run_protocol(slow_app, chunks, expire=False, turns=100)
            answers = re.findall(rb"HTTP/1\.1 (\d{3}) ", written(raw))
            served = b"".join(chunks).count(b"POST ")
            assert answers == [b"200"] * served + [status] and raw.closed, chunks


def test_a_request_answered_early_gets_no_second_answer_when_its_body_is_refused() -> None:
    """A request answered before its body was read (a 401, a 413) whose chunked body then
    broke, or whose trailers grew past the header limit, got a 400 or 431 after its answer:
    two answers to one request, the second taken for the client's next request's."""

    async def early(scope: Any, receive: Any, send: Any) -> None:
        await answer_ok(send)

    head = b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    for rest in (b"zz\r\n", b"5\r\nhello\r\n0\r\nX-Pad: " + b"a" * 70000 + b"\r\n\r\n"):
        _, raw = run_protocol(early, [head, rest], expire=False)
        assert written(raw) == b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}" and raw.closed


def test_a_request_target_that_is_no_url_path_is_refused_saying_so() -> None:
    """CONNECT's `host:port` target failed in uvicorn's callback: the 400 said "User callback
    error"."""
    connect = b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n"
    _, raw = run_protocol(answer_app, [connect], expire=False)
    assert written(raw).startswith(b"HTTP/1.1 400 Bad Request\r\n") and raw.closed
    assert b"not valid HTTP: invalid url b'example.com:443'" in written(raw)


def test_a_pipelined_request_s_header_timeout_lets_the_answer_before_it_go_first() -> None:
    """The headers of a request pipelined behind one still being computed timed out: the
    connection was closed at once, the earlier request told its client was gone, its answer
    lost. It is now answered, then the 408, then the connection is closed (RFC 9112, 9.3.2)."""
    seen: list[str] = []

    async def slow(scope: Any, receive: Any, send: Any) -> None:
        for _ in range(15):  # past the 10 turns after the data, when the deadline passes
            await asyncio.sleep(0)
        seen.append(scope["path"])
        await answer_ok(send)

    first = b"GET /first HTTP/1.1\r\nHost: x\r\n\r\n"
    _, raw = run_protocol(slow, [first + b"GET /second HTTP/1.1\r\nHo"])
    answers = written(raw)
    assert seen == ["/first"]
    assert answers.startswith(b"HTTP/1.1 200 OK\r\n")
    assert answers.count(b"HTTP/1.1 ") == 2
    assert b"HTTP/1.1 408 Request Timeout\r\n" in answers and raw.closed
