"""uvicorn's httptools protocol, writing each response with one system call instead of two.

uvicorn writes a response's status line and headers, then its body, as two ``transport.write``
calls: two ``send`` system calls (and two TCP segments) per response, about a sixth of the
gateway's CPU at high request rates. Here the connection's transport holds back what is written
during one turn of the event loop and sends it together at the end of that turn, so a response
goes out in one ``send``. Order is kept, and closing the connection sends what is held first.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class CoalescingTransport:
    """Wraps an asyncio transport: writes made in one loop turn leave in one ``write``."""

    __slots__ = ("_held", "_loop", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: list[bytes] | None = None

    def write(self, data: bytes) -> None:
        if self._held is None:
            self._held = [data]
            self._loop.call_soon(self.flush)
        else:
            self._held.append(data)

    def writelines(self, lines: Any) -> None:
        for data in lines:
            self.write(data)

    def flush(self) -> None:
        """Send what is held now."""
        held, self._held = self._held, None
        if held and not self._transport.is_closing():
            self._transport.write(held[0] if len(held) == 1 else b"".join(held))

    def get_write_buffer_size(self) -> int:
        held = sum(len(data) for data in self._held) if self._held else 0
        return self._transport.get_write_buffer_size() + held

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self._held = None
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:  # is_closing, get_extra_info, pause_reading, ...
        return getattr(self._transport, name)


class CoalescingHttpToolsProtocol(HttpToolsProtocol):
    """HttpToolsProtocol over a :class:`CoalescingTransport`."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        coalescing: Any = CoalescingTransport(transport, self.loop)
        super().connection_made(coalescing)
