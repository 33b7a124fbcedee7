"""web_gateway.http_protocol: a response leaves in one write; order and close are kept.

Its connection limits are tested against a real gateway in tests/test_gateway_limits.py.
"""

from __future__ import annotations

import asyncio
from typing import Any

from web_gateway.http_protocol import (
    CoalescingHttpToolsProtocol,
    CoalescingTransport,
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
