"""What the gateway's buffered metrics and indexed headers save, in one process, A/B.

Runs ``bench.gateway_cpu``'s ASGI cases with the gateway as shipped ("now") and with the two
per-request costs it no longer pays swapped back in ("per-request"): every metric written to
prometheus-client by each request (six writes, as before buffering) and starlette's own
``Headers``. The two alternate, repeat by repeat, in the same process, so the machine's noise
between processes (tens of percent on a shared 2-core VM) does not enter the difference; the
saving printed is the median of the back-to-back pairs' differences.

    PROMETHEUS_MULTIPROC_DIR=$(mktemp -d) PYTHONPATH=. .venv/bin/python -m bench.gateway_cpu_ab

(with ``PROMETHEUS_MULTIPROC_DIR`` set to an empty directory, the metrics are memory-mapped
files, as under ``gateway start``; without it, prometheus-client's in-process values).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
from typing import Any

from starlette.requests import Request

from bench.gateway_cpu import _cpu_us, asgi_app, asgi_cases
from web_gateway import metrics, reading


class PerRequestMetrics:
    """The gateway's metrics written to prometheus-client by every request (before buffering)."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.in_flight = metrics.IN_FLIGHT.labels(model)
        self.items = metrics.ITEMS.labels(model)
        self.requests: dict[tuple[str, str], Any] = {}
        self.latency: dict[str, Any] = {}

    def begin(self) -> None:
        self.in_flight.inc()

    def submitted(self, items: int) -> None:
        self.items.inc(items)

    def answered(self, route: str, outcome: str, seconds: float) -> None:
        self.in_flight.dec()
        requests = self.requests.get((route, outcome))
        if requests is None:
            requests = self.requests[route, outcome] = metrics.REQUESTS.labels(
                self.model, route, outcome
            )
        requests.inc()
        latency = self.latency.get(route)
        if latency is None:
            latency = self.latency[route] = metrics.LATENCY.labels(self.model, route)
        latency.observe(seconds)

    def flush(self) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=31)
    parser.add_argument("--requests", type=int, default=500)
    args = parser.parse_args()
    loop = asyncio.new_event_loop()
    app = asgi_app()
    cases = asgi_cases(loop, app)
    app_gateway = app.gateway
    buffered = {name: served.metrics for name, served in app_gateway.models.items()}
    per_request = {name: PerRequestMetrics(name) for name in app_gateway.models}
    shipped = reading.GatewayRequest

    def use(now: bool) -> None:
        for name, served in app_gateway.models.items():
            served.metrics = buffered[name] if now else per_request[name]
        setattr(reading, "GatewayRequest", shipped if now else Request)  # noqa: B010

    mode = (
        "memory-mapped (multiprocess)"
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        else "in-process"
    )
    print(f"prometheus-client values: {mode}")
    for label, func in cases.items():
        runs: dict[bool, list[float]] = {True: [], False: []}
        for now in (True, False):
            use(now)
            func()  # warm
        for _ in range(args.repeats):
            for now in (False, True):
                use(now)
                runs[now].append(_cpu_us(func, args.requests))
        before, after = statistics.median(runs[False]), statistics.median(runs[True])
        # each pair ran back to back: their difference carries less of the machine's drift
        saved = statistics.median(b - a for b, a in zip(runs[False], runs[True], strict=True))
        print(
            f"{label:26s} per-request {before:6.1f}  now {after:6.1f} us CPU/request "
            f"(medians of {args.repeats}); saved {saved:5.1f} (median of the pairs)"
        )
    use(True)


if __name__ == "__main__":
    main()
