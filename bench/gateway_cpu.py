"""The gateway's CPU per request on its hot path, in process, for v1 predict and v2 infer.

Two measures: ``path`` runs JSON body -> prepared items -> encoded stream entries -> JSON
response (pure CPU); ``asgi`` sends each request through the whole ASGI app (dispatch, body
reading, checks, metrics, the Streamer's encoding, the disconnect watch, the response), with
the Redis round trip replaced by a stand-in that answers at once, so what is left is the
gateway's own work (no network, no Redis, no worker).

    PYTHONPATH=. .venv/bin/python -m bench.gateway_cpu [--repeats 7] [--requests 2000]

Prints, per case, the median (over repeats) of process CPU microseconds per request, measured
with ``time.process_time`` so that other load on the machine does not count. With
``PROMETHEUS_MULTIPROC_DIR`` set to an empty directory, the metrics are written to
memory-mapped files as under ``gateway start`` (gunicorn); without it, to in-process values.
The app's lifespan is not run: its metrics are written every ``MAX_PENDING`` requests.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import orjson

from broker import codec
from gpu_worker import ManagedModel, TensorSpec
from web_gateway import v1, v2
from web_gateway.responses import json_response
from web_gateway.serving import ServedModel
from web_gateway.settings import GatewaySettings


class Identity(ManagedModel):
    """An identity-like model: one FP32 vector of any length."""

    name = "identity"
    inputs = [TensorSpec("x", "FP32", [-1])]
    outputs = [TensorSpec("y", "FP32", [-1])]

    def predict(self, batch: list[Any]) -> list[Any]:
        return batch


def _served(cls: type[ManagedModel]) -> ServedModel:
    settings = GatewaySettings(model=["examples.mlp:MLP"], redis_url="redis://127.0.0.1:1/0")
    return ServedModel(cls, settings)


def _v1_case(served: ServedModel, width: int, items: int, out_width: int) -> Callable[[], Any]:
    rng = np.random.default_rng(0)
    body = orjson.dumps({"inputs": rng.standard_normal((items, width)).round(6).tolist()})
    outputs = list(rng.standard_normal((items, out_width)).astype(np.float32))

    def one() -> Any:
        prepared = v1.parse_and_prepare(served, body, 1024)
        payloads = [codec.encode(item) for item in prepared]
        return payloads, json_response({"outputs": outputs}).body

    return one


def _v2_case(served: ServedModel, width: int, items: int, out_width: int) -> Callable[[], Any]:
    rng = np.random.default_rng(0)
    name = served.inputs[0].name
    data = rng.standard_normal((items, width)).round(6)
    body = orjson.dumps(
        {
            "inputs": [
                {
                    "name": name,
                    "datatype": "FP32",
                    "shape": [items, width],
                    "data": data.ravel().tolist(),
                }
            ]
        }
    )
    outputs = list(rng.standard_normal((items, out_width)).astype(np.float32))

    def one() -> Any:
        parsed, prepared = v2.parse_and_prepare(served, body, None, 1024)
        payloads = [codec.encode(item) for item in prepared]
        return payloads, v2.finish(served, parsed, outputs)

    return one


class _InstantCore:
    """Stands in for the Streamer's Redis client: answers each call with ``outputs`` at once."""

    def __init__(self, outputs: list[Any]) -> None:
        self.outputs = outputs

    async def call(
        self, payloads: list[bytes], timeout: float, traceparent: Any, level: int = 0
    ) -> list[Any]:
        return self.outputs[: len(payloads)]

    def start_call(
        self,
        payloads: list[bytes],
        timeout: float,
        traceparent: Any,
        post: Any = None,
        level: int = 0,
    ) -> asyncio.Future[list[Any]]:
        future = asyncio.get_running_loop().create_future()
        future.set_result(self.outputs[: len(payloads)])
        return future


def _asgi_case(
    app: Any, path: str, body: bytes, loop: asyncio.AbstractEventLoop
) -> Callable[[], Any]:
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"bench"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 8000),
    }
    statuses: list[int] = []

    async def one() -> None:
        sent = False

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.Future()  # the client stays connected
            raise AssertionError

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                statuses.append(message["status"])

        await app(dict(scope), receive, send)
        if statuses.pop() != 200:
            raise RuntimeError(f"{path} did not answer 200")

    return lambda: loop.run_until_complete(one())


def asgi_app() -> Any:
    """The gateway app the ASGI cases run (the MLP and Identity; its lifespan is not run)."""
    from web_gateway.app import create_app

    settings = GatewaySettings(
        model=["examples.mlp:MLP", "bench.gateway_cpu:Identity"],
        redis_url="redis://127.0.0.1:1/0",
    )
    return create_app(settings)


def asgi_cases(loop: asyncio.AbstractEventLoop, app: Any = None) -> dict[str, Callable[[], Any]]:
    app = asgi_app() if app is None else app
    rng = np.random.default_rng(0)
    outputs = {"mlp": (256, 16), "identity": (64, 64)}
    cases = {}
    for name, (width, out_width) in outputs.items():
        served = app.gateway.models[name]
        core = _InstantCore(list(rng.standard_normal((8, out_width)).astype(np.float32)))
        served.streamer._get_loop_core = lambda core=core: core
        row = rng.standard_normal(width).round(6).tolist()
        v1_body = orjson.dumps({"inputs": [row]})
        tensor = {"name": served.inputs[0].name, "datatype": "FP32", "shape": [1, width]}
        v2_body = orjson.dumps({"inputs": [{**tensor, "data": row}]})
        cases[f"asgi v1 {name} 1 item"] = _asgi_case(
            app, f"/v1/models/{name}/predict", v1_body, loop
        )
        cases[f"asgi v2 {name} 1 item"] = _asgi_case(app, f"/v2/models/{name}/infer", v2_body, loop)
    return cases


def _cpu_us(func: Callable[[], Any], requests: int) -> float:
    start = time.process_time()
    for _ in range(requests):
        func()
    return (time.process_time() - start) / requests * 1e6


def cases() -> dict[str, Callable[[], Any]]:
    from examples.mlp import MLP

    mlp, identity = _served(MLP), _served(Identity)
    return {
        "v1 mlp 1 item": _v1_case(mlp, 256, 1, 16),
        "v1 mlp 8 items": _v1_case(mlp, 256, 8, 16),
        "v1 identity 1 item (64)": _v1_case(identity, 64, 1, 64),
        "v2 mlp 1 item": _v2_case(mlp, 256, 1, 16),
        "v2 mlp 8 items": _v2_case(mlp, 256, 8, 16),
        "v2 identity 1 item (64)": _v2_case(identity, 64, 1, 64),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--requests", type=int, default=2000)
    args = parser.parse_args()
    loop = asyncio.new_event_loop()
    for label, func in {**cases(), **asgi_cases(loop)}.items():
        func()  # warm
        runs = [_cpu_us(func, args.requests) for _ in range(args.repeats)]
        print(
            f"{label:28s} {statistics.median(runs):8.1f} us CPU/request (median of {args.repeats})"
        )


if __name__ == "__main__":
    main()
