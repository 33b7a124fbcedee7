"""RedisTransport's hand-packed XADDs: byte for byte what hiredis packs from the fields."""

from __future__ import annotations

import hiredis
import pytest

from broker.protocol import CallRequests, request_fields
from broker.redis_transport import XaddPacker

TRACE = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def packed_by_hiredis(stream: str, call: CallRequests) -> bytes:
    commands = []
    for request_id, data in zip(call.request_ids, call.payloads, strict=True):
        fields = request_fields(request_id, call.reply_key, call.timeout_ms, data, TRACE)
        if call.traceparent is None:
            del fields["traceparent"]
        args = ["XADD", stream, "*"]
        for name, value in fields.items():
            args += [name, value]
        commands.append(hiredis.pack_command(tuple(args)))
    return b"".join(commands)


@pytest.mark.parametrize("trace", [None, TRACE])
def test_xadds_match_hiredis_packing(trace: str | None) -> None:
    packer = XaddPacker()
    calls = [
        CallRequests("mb:inbox:a", 30_000, ["a.1"], [b"\x93\x01\x02\x03"], trace),
        CallRequests("mb:inbox:a", 30_000, ["a.2", "a.3"], [b"", b"x" * 70_000], trace),
        CallRequests("mb:inbox:b", 5, ["b.1"], [b"\r\n$3\r\n"], trace),  # RESP-like bytes
        CallRequests("mb:inbox:\u00e9", 1, ["\u00e9.1"], [b"\x00"], trace),  # non-ASCII
    ]
    for stream in ("mb:stream:m", "mb:stream:other"):
        for call in calls:  # twice each: a template made, then one reused
            assert packer.pack(stream, call) == packed_by_hiredis(stream, call)
            assert packer.pack(stream, call) == packed_by_hiredis(stream, call)


def test_invalid_traceparent_is_dropped_not_sent() -> None:
    call = CallRequests("mb:inbox:a", 1000, ["a.1"], [b"x"], "not-a-trace\r\n")
    assert call.traceparent is None
    assert b"traceparent" not in XaddPacker().pack("mb:stream:m", call)


def test_templates_are_bounded() -> None:
    packer = XaddPacker()
    for timeout_ms in range(1, 3 * XaddPacker.MAX_TEMPLATES):
        call = CallRequests("mb:inbox:a", timeout_ms, ["a.1"], [b"x"])
        assert packer.pack("mb:stream:m", call) == packed_by_hiredis("mb:stream:m", call)
    assert len(packer._templates) <= XaddPacker.MAX_TEMPLATES
