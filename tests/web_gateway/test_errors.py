"""The gateway's error mapping: what reaches the log."""

from __future__ import annotations

import logging

import pytest

from web_gateway import errors
from web_gateway.errors import ClientGone


def test_clients_leaving_are_summed_into_a_line_every_few_seconds(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client, or a load tool stopping, can leave thousands of requests a second: one line
    each flooded the log."""
    now = [100.0]
    monkeypatch.setattr(errors.withdrawals, "clock", lambda: now[0])
    monkeypatch.setattr(errors.withdrawals, "count", 0)  # whatever other tests noted
    monkeypatch.setattr(errors.withdrawals, "_next", float("-inf"))
    with caplog.at_level(logging.INFO, logger="microbatch.gateway"):
        for _ in range(4000):  # one second of a client opening, asking and leaving
            response = errors.to_response(ClientGone(), "POST", "/v1/models/mlp/predict")
            assert response.status_code == errors.CLIENT_CLOSED
            now[0] += 0.00025
        now[0] += 10
        errors.to_response(ClientGone(), "POST", "/v2/models/mlp/infer")
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 2
    assert lines[0].startswith("clients left before their answers: 1 request(s) withdrawn")
    assert "4000 request(s) withdrawn" in lines[1] and "latest to /v2/models/mlp/infer" in lines[1]


@pytest.mark.parametrize(
    "path, v2",
    [("/v2", True), ("/v2/", True), ("/v2/models/m/infer", True), ("/v1/models/m", False),
     ("/v2x", False), ("/healthz", False)],
)  # fmt: skip
def test_the_open_inference_protocol_routes_answer_errors_in_its_format(
    path: str, v2: bool
) -> None:
    # /v2 itself (its server metadata) is one of them, as nginx's error pages take it too
    assert errors.is_v2(path) is v2
