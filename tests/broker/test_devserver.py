"""The development Redis the tests, the demo and the benchmarks start: a port taken between
being picked and being bound is traded for another, a restart keeps its port."""

from __future__ import annotations

import pytest

from broker.devserver import RedisServer


def test_a_picked_port_taken_meanwhile_is_traded_for_another_and_a_restart_keeps_it() -> None:
    with RedisServer() as first:
        second = RedisServer()
        second.port = first.port  # as if another process bound the port picked for it
        with second:
            assert second.port != first.port
            assert second.client().info("server")["process_id"] == second.process.pid  # type: ignore[union-attr]
            assert first.client().info("server")["process_id"] == first.process.pid  # type: ignore[union-attr]
            port = second.port
            second.kill()
            second.start()
            assert second.port == port
            assert second.client().ping()


def test_a_port_given_and_taken_is_an_error_naming_it() -> None:
    with RedisServer() as first:
        with pytest.raises(RuntimeError, match=f"did not start on port {first.port}"):
            RedisServer(port=first.port).start()
        assert first.client().ping()  # the server that holds the port is left alone
