"""The embedder feeding classifier heads, end to end on this machine, in one command.

    python -m examples.pipeline_demo                            # embedder -> classifier
    python -m examples.pipeline_demo --pipeline sentiment-topic # embedder -> sentiment + topic
    python -m examples.pipeline_demo --serve                    # and keep serving (Ctrl-C)

(or ``make demo-pipeline``). Uses the Redis at ``--redis``, else at ``$REDIS_URL`` when one
answers there, else a private redis-server on a free port. Starts one ``worker start`` per stage
of the pipeline (``examples.pipelines``) and one ``gateway start`` on ``--port`` (default
``$MICROBATCH_GATEWAY_PORT``, else 8000), waits until every stage has a live worker, then asks
the gateway what ``curl`` would (KServe v1 and v2) and prints each command with the answer as it
came. It checks the answers against the
embedder and the heads called one after the other in this process, and exits (0 when they
match), or with ``--serve`` keeps the services up for your own requests.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from contextlib import ExitStack
from typing import Any

import numpy as np

from broker.connections import sync_client
from broker.devserver import RedisServer
from broker.liveness import live_consumers
from broker.logs import redact_url
from examples.demo import redis_answers, stop_worker
from examples.embedder import Embedder
from examples.pipelines import Sentiment, SentimentTopic
from examples.text_classifier import TextClassifierHead, embed_texts
from gpu_worker.pipeline import Pipeline, Stage

PIPELINES: dict[str, type[Pipeline]] = {p.name: p for p in (Sentiment, SentimentTopic)}
SENTENCES = [
    "The soup was delicious and the staff were lovely.",
    "My new laptop crashed twice today, what a waste of money.",
]
MODULES = {"worker": "gpu_worker.cli", "gateway": "web_gateway.cli"}
STARTUP_S = 300.0  # a cold start of torch and the MiniLM weights in several processes at once


def curl_json(url: str, body: dict[str, Any]) -> str:
    """The curl command line that POSTs ``body`` as JSON to ``url``."""
    return f"curl -s {url} -H 'Content-Type: application/json' -d '{json.dumps(body)}'"


def post(url: str, body: dict[str, Any]) -> tuple[int, bytes]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def in_process(pipeline: type[Pipeline], texts: list[str]) -> list[Any]:
    """The answers of the embedder and then the heads, called in this process (one embedder;
    each head trained as its worker trains it, on that embedder's vectors of its sentences)."""
    embedder = Embedder()
    embedder.init_model()
    vectors = list(embedder.predict([embedder.preprocess(text) for text in texts]))
    answers: dict[str, list[Any]] = {}
    for leaf in pipeline.leaves():
        head = pipeline.stage(leaf).model_class()()
        if not isinstance(head, TextClassifierHead):
            raise TypeError(f"stage {leaf!r} is not a classifier head")
        head.fit(embed_texts(head.training_set()[0], embedder))  # what init_model does
        answers[leaf] = head.predict(vectors)
    model = pipeline()
    if len(answers) == 1:
        return [model.postprocess(out) for out in next(iter(answers.values()))]
    return [
        model.postprocess(dict(zip(answers, outs, strict=True)))
        for outs in zip(*answers.values(), strict=True)
    ]


def same(served: list[Any], expected: list[Any]) -> bool:
    """Labels equal, scores within 1e-4 (a batch pads its texts differently in each process)."""
    if len(served) != len(expected):
        return False
    for got, want in zip(served, expected, strict=True):
        for key, value in want.items():
            if isinstance(value, str):
                if got[key] != value:
                    return False
            elif not np.allclose(np.asarray(got[key], dtype=np.float32), value, atol=1e-4):
                return False
    return True


def stage_names(pipeline: type[Pipeline]) -> list[str]:
    """The pipeline's stages, in declaration order."""
    return [stage.name for stage in pipeline.stages if isinstance(stage, Stage)]


def v2_items(document: dict[str, Any]) -> list[dict[str, Any]]:
    """A v2 answer's tensors as one object per item (``{output name: value}``)."""
    items: list[dict[str, Any]] = []
    for tensor in document["outputs"]:
        rows = np.asarray(tensor["data"], dtype=object).reshape(tensor["shape"])
        for index, row in enumerate(rows):
            if index == len(items):
                items.append({})
            items[index][tensor["name"]] = (
                row if tensor["datatype"] == "BYTES" else row.astype(np.float32)
            )
    return items


def wait_ready(
    url: str, pipeline: type[Pipeline], prefix: str, processes: list[subprocess.Popen[bytes]]
) -> None:
    """Until every stage has a live worker; SystemExit if a process exits first."""
    client = sync_client(url)
    deadline = time.monotonic() + STARTUP_S
    stages = stage_names(pipeline)
    try:
        while True:
            for process in processes:
                if process.poll() is not None:
                    raise SystemExit(f"{' '.join(map(str, process.args))} exited")  # type: ignore[arg-type]
            waiting = [s for s in stages if not live_consumers(client, pipeline.keys(s, prefix))]
            if not waiting:
                return
            if time.monotonic() > deadline:
                raise SystemExit(f"no live worker for stages {waiting} after {STARTUP_S:g} s")
            time.sleep(0.5)
    finally:
        client.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m examples.pipeline_demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--pipeline", choices=sorted(PIPELINES), default="sentiment")
    parser.add_argument("--serve", action="store_true", help="keep serving until Ctrl-C")
    parser.add_argument(
        "--port",
        type=int,
        default=int(os.environ.get("MICROBATCH_GATEWAY_PORT", "8000")),
        help="the gateway's port (default: $MICROBATCH_GATEWAY_PORT, else 8000)",
    )
    parser.add_argument(
        "--redis", help="a Redis URL (default: $REDIS_URL if it answers, else a private one)"
    )
    args = parser.parse_args(argv)
    pipeline = PIPELINES[args.pipeline]
    path = f"examples.pipelines:{pipeline.__name__}"
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # keep order with logs
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    with ExitStack() as cleanup:
        url = args.redis or os.environ.get("REDIS_URL", "")
        if url and redis_answers(url):
            print(f"Using the Redis at {redact_url(url)}")
        else:
            url = cleanup.enter_context(RedisServer()).url
            print(f"Started a private redis-server at {url}")
        # our own keys in a shared Redis, unless serving (then callers use the default prefix)
        prefix = "default" if args.serve else f"demo-{uuid.uuid4().hex[:8]}"
        commands = [
            ["worker", "start", "--model", path, "--stage", stage]
            for stage in stage_names(pipeline)
        ]
        commands.append(["gateway", "start", "--model", path, "--port", str(args.port)])
        # their logs: warnings and errors only, so that the answers below stand out
        quiet = {
            "MICROBATCH_WORKER_LOG_LEVEL": "WARNING",
            "MICROBATCH_GATEWAY_LOG_LEVEL": "warning",
        }
        env = {**os.environ, **quiet}
        processes = []
        for command in commands:
            print("Starting:", " ".join(command))
            full = [sys.executable, "-m", MODULES[command[0]], *command[1:], "--redis", url]
            full += ["--prefix", prefix]
            if command[0] == "gateway":
                full += ["--host", "127.0.0.1", "--workers", "1"]
            process = subprocess.Popen(full, env=env, start_new_session=True)
            cleanup.callback(stop_worker, process)
            processes.append(process)
        print("Waiting until every stage has a live worker (they load torch and the weights)")
        wait_ready(url, pipeline, prefix, processes)

        base = f"http://localhost:{args.port}"
        v1 = f"{base}/v1/models/{pipeline.name}/predict"
        v2 = f"{base}/v2/models/{pipeline.name}/infer"
        v1_body = {"inputs": SENTENCES}
        v2_body = {
            "inputs": [
                {"name": "text", "datatype": "BYTES", "shape": [len(SENTENCES)], "data": SENTENCES}
            ]
        }
        answers = []
        for endpoint, body in ((v1, v1_body), (v2, v2_body)):
            status, raw = post(endpoint, body)
            print(f"\n$ {curl_json(endpoint, body)}\n{raw.decode(errors='replace')}")
            if status != 200:
                print(f"HTTP {status}", file=sys.stderr)
                return 1
            answers.append(json.loads(raw))
        expected = in_process(pipeline, SENTENCES)
        matches = same(answers[0]["outputs"], expected) and same(v2_items(answers[1]), expected)
        print(f"\nMatches the embedder and then the heads called in this process: {matches}")
        if not args.serve:
            return 0 if matches else 1
        print(
            f"\nServing pipeline {pipeline.name!r} on {base}, Redis at {redact_url(url)} "
            "(Ctrl-C stops it)."
        )
        try:
            while all(process.poll() is None for process in processes):
                time.sleep(0.5)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
