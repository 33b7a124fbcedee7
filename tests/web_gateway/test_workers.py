"""web_gateway.workers: the client address a forwarded request is taken from."""

from __future__ import annotations

import asyncio
from typing import Any

from web_gateway.workers import ForwardedClient


def client_seen(trusted: str, peer: str, *forwarded: bytes) -> Any:
    """The ``client`` the app sees of a request from ``peer`` with these X-Forwarded-For."""
    seen: list[Any] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(scope["client"])

    scope = {
        "type": "http",
        "client": (peer, 50000),
        "headers": [(b"x-forwarded-for", value) for value in forwarded],
    }
    asyncio.run(ForwardedClient(app, trusted)(scope, None, None))
    return seen[0]


def test_a_trusted_proxy_names_the_client_by_an_ip_address() -> None:
    local = "127.0.0.1,::1"
    assert client_seen(local, "127.0.0.1", b"203.0.113.7") == ("203.0.113.7", 0)
    assert client_seen(local, "127.0.0.1", b"203.0.113.7:4242") == ("203.0.113.7", 4242)
    assert client_seen(local, "::1", b"[2001:db8::1]:80") == ("2001:db8::1", 80)
    assert client_seen(local, "127.0.0.1", b"198.51.100.1, 127.0.0.1") == ("198.51.100.1", 0)
    assert client_seen("*", "10.0.0.5", b"203.0.113.7") == ("203.0.113.7", 0)
    # an untrusted peer's header is not read
    assert client_seen(local, "10.0.0.5", b"203.0.113.7") == ("10.0.0.5", 50000)


def test_a_forwarded_address_that_is_no_ip_address_leaves_the_peer_s() -> None:
    """uvicorn took any text as the client's address (``not-an-ip``, ``<script>``, ``unknown``
    as some proxies write): the access log named a client that does not exist, as the sender
    of the header chose. The peer, the proxy itself, is the one address known then."""
    for forwarded in (b"not-an-ip", b"unknown", b"<script>", b"999.1.1.1", b"[::1", b""):
        for trusted in ("127.0.0.1", "*"):
            seen = client_seen(trusted, "127.0.0.1", forwarded)
            assert seen == ("127.0.0.1", 50000), (forwarded, trusted)
    # the address taken is the nearest one not of a trusted proxy: garbage there is no client
    assert client_seen("127.0.0.1", "127.0.0.1", b"1.2.3.4, <script>") == ("127.0.0.1", 50000)


def test_lifespan_and_other_scopes_pass_through() -> None:
    passed: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        passed.append(scope["type"])

    asyncio.run(ForwardedClient(app, "*")({"type": "lifespan"}, None, None))
    assert passed == ["lifespan"]
