"""The gateway's error mapping: what reaches the log."""

from __future__ import annotations

import logging

import pytest

from web_gateway.errors import WithdrawalLog


def test_clients_leaving_are_summed_into_a_line_every_few_seconds(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A client, or a load tool stopping, can leave thousands of requests a second: one line
    each flooded the log."""
    now = [100.0]
    withdrawals = WithdrawalLog(every_s=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="microbatch.gateway"):
        for _ in range(4000):  # one second of a client opening, asking and leaving
            withdrawals.note("/v1/models/mlp/predict")
            now[0] += 0.00025
        now[0] += 10
        withdrawals.note("/v2/models/mlp/infer")
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 2
    assert lines[0].startswith("clients left before their answers: 1 request(s) withdrawn")
    assert "4000 request(s) withdrawn" in lines[1] and "latest to /v2/models/mlp/infer" in lines[1]
