"""Embeddings per second: examples.embedder through gateway + Redis + worker, against
sentence-transformers' own ``encode`` on batches in one process.

    .venv/bin/python bench/embed_bench.py [--duration 20] [--concurrency 64] [--rounds 2]

On one machine, one after the other (never two at once), ``--rounds`` times:

1. **in-process**: a fresh process loads all-MiniLM-L6-v2 with sentence-transformers and calls
   ``model.encode(chunk, batch_size=64)`` on consecutive chunks of 64 sentences of the corpus for
   ``--duration`` seconds: the batched rate with nothing in between.
2. **served, tokenized caller-side** (examples.embedder:Embedder, as shipped): a private
   redis-server, ``worker start`` (one process), ``gateway start`` (one gunicorn worker), and wrk
   with ``--concurrency`` connections, each request one sentence (the corpus in turn), for
   ``--duration`` seconds after a warm-up; requests/s = embeddings/s.
3. **served, tokenized in the worker** (WorkerTokenizedEmbedder below: the same tokenizer code,
   run in ``predict`` instead of ``preprocess``), the same way.

Prints a Markdown table (and writes JSON with ``--json``). ``wrk`` must be on PATH.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.http_bench import process, run_wrk, wait_http, wait_workers  # noqa: E402
from broker.devserver import RedisServer, free_port  # noqa: E402
from broker.keys import ModelKeys  # noqa: E402
from examples.embedder import Embedder, as_text  # noqa: E402
from gpu_worker import TensorSpec  # noqa: E402

CORPUS_SIZE = 1024


class WorkerTokenizedEmbedder(Embedder):
    """The embedder with its tokenizer run in the worker (the alternative that was measured)."""

    name = "embedder_wt"
    inputs = [TensorSpec("text", "BYTES", [])]

    def preprocess(self, item: Any) -> Any:
        return as_text(item)  # the same checks, no tokenization

    def predict(self, batch: list[Any]) -> list[Any]:
        return self.embed_ids(self.tokenizer.encode_batch([as_text(item) for item in batch]))


def corpus(size: int = CORPUS_SIZE, seed: int = 0) -> list[str]:
    """English-like sentences of 4 to 40 words (about 20 word pieces on average)."""
    rng = random.Random(seed)
    subjects = [
        "the model", "a new user", "our team", "the gateway", "every worker", "the customer",
        "a small dog", "the old bridge", "this paper", "the city council", "my neighbour",
        "the weather service", "a GPU", "the database", "the river", "her brother",
    ]  # fmt: skip
    verbs = [
        "answers", "describes", "reads", "improves", "crosses", "rejects", "builds", "finds",
        "predicts", "explains", "collects", "ignores", "measures", "follows", "repairs",
    ]  # fmt: skip
    objects = [
        "the request", "a long report", "every question", "the red car", "three new ideas",
        "the results of the experiment", "a batch of images", "the morning news",
        "the price of bread", "an unusual signal", "the quarterly budget", "the mountain path",
    ]  # fmt: skip
    tails = [
        "before noon", "with great care", "in less than a second", "after the storm",
        "because nobody else would", "during the long winter", "without any help",
        "while the others were sleeping", "at the end of the street", "for the third time",
    ]  # fmt: skip
    sentences = []
    for _ in range(size):
        parts = [rng.choice(subjects), rng.choice(verbs), rng.choice(objects)]
        for _ in range(rng.choice([0, 0, 1, 1, 2, 3, 4])):
            parts.append(rng.choice(tails))
        sentence = " ".join(parts)
        sentences.append(sentence[0].upper() + sentence[1:] + ".")
    return sentences


IN_PROCESS = """
import json, os, sys, time
os.environ.setdefault("HF_HUB_OFFLINE", "1")
from sentence_transformers import SentenceTransformer
from examples.embedder import model_path
sentences = json.loads(sys.stdin.read())
duration = float(sys.argv[1])
model = SentenceTransformer(str(model_path()), device="cpu")
chunks = [sentences[i:i + 64] for i in range(0, len(sentences), 64)]
for chunk in chunks[:2]:
    model.encode(chunk, batch_size=64)
done, start, i = 0, time.perf_counter(), 0
while time.perf_counter() - start < duration:
    model.encode(chunks[i % len(chunks)], batch_size=64)
    done += len(chunks[i % len(chunks)])
    i += 1
print(json.dumps({"eps": done / (time.perf_counter() - start), "embeddings": done}))
"""


def in_process(sentences: list[str], duration: float) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, "-c", IN_PROCESS, str(duration)],
        input=json.dumps(sentences),
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def wrk_script(directory: Path, path: str, sentences: list[str]) -> Path:
    bodies = ",\n".join(json.dumps(json.dumps({"inputs": [s]})) for s in sentences)
    script = directory / f"{path.strip('/').replace('/', '_')}.lua"
    script.write_text(
        f"local bodies = {{\n{bodies}\n}}\n"
        "local i = 0\n"
        "request = function()\n"
        "  i = i % #bodies + 1\n"
        f'  return wrk.format("POST", "{path}", '
        '{["Content-Type"] = "application/json"}, bodies[i])\n'
        "end\n"
    )
    return script


def served(
    model: str,
    name: str,
    sentences: list[str],
    args: argparse.Namespace,
    tmp: Path,
) -> dict[str, float]:
    with ExitStack() as stack:
        server = stack.enter_context(RedisServer())
        prefix = "bench"
        worker = [sys.executable, "-m", "gpu_worker.cli", "start", "--model", model]
        worker += ["--redis", server.url, "--prefix", prefix, "--workers", "1"]
        worker += ["--batch-size", str(args.batch_size), "--log-level", "WARNING"]
        stack.enter_context(process(worker))
        port = free_port()
        gateway = [sys.executable, "-m", "web_gateway.cli", "start", "--model", model]
        gateway += ["--redis", server.url, "--prefix", prefix, "--port", str(port)]
        gateway += ["--workers", str(args.gateway_workers), "--log-level", "warning"]
        stack.enter_context(process(gateway))
        wait_workers(server.url, ModelKeys(name, prefix), 1, timeout=120)
        wait_http(f"http://127.0.0.1:{port}/healthz")
        path = f"/v1/models/{name}/predict"
        url = f"http://127.0.0.1:{port}{path}"
        script = wrk_script(tmp, path, sentences)
        run_wrk(url, script, args.concurrency, 3)  # warm up
        return run_wrk(url, script, args.concurrency, args.duration)


def check_answers(sentences: list[str]) -> None:
    """Both served models answer what sentence-transformers answers (checked in-process)."""
    from sentence_transformers import SentenceTransformer

    from examples.embedder import model_path

    texts = sentences[:16]
    want = SentenceTransformer(str(model_path()), device="cpu").encode(texts, batch_size=64)
    for cls in (Embedder, WorkerTokenizedEmbedder):
        model = cls()
        model.init_model()
        items = [model.preprocess(text) for text in texts]
        np.testing.assert_allclose(np.stack(model.predict(items)), want, atol=1e-5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=int, default=20, help="seconds per measurement")
    parser.add_argument("--concurrency", type=int, default=64, help="wrk connections")
    parser.add_argument("--rounds", type=int, default=2, help="times to repeat everything")
    parser.add_argument("--gateway-workers", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--modes", default="caller,worker", help="served modes to measure")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        sys.exit("wrk is not on PATH: apt-get install wrk")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sentences = corpus()
    check_answers(sentences)
    tokens = [len(Embedder().preprocess(s)) for s in sentences]
    models = {
        "caller": ("examples.embedder:Embedder", "embedder"),
        "worker": ("bench.embed_bench:WorkerTokenizedEmbedder", "embedder_wt"),
    }
    modes = [mode for mode in args.modes.split(",") if mode]
    results: dict[str, list[dict[str, float]]] = {"in-process": []}
    results.update({mode: [] for mode in modes})
    tmp = Path(tempfile.mkdtemp(prefix="microbatch-embed-bench-"))
    try:
        for round_ in range(args.rounds):
            row = in_process(sentences, args.duration)
            results["in-process"].append(row)
            print(f"round {round_ + 1}: in-process {row['eps']:.1f} embeddings/s", flush=True)
            for mode in modes:
                model, name = models[mode]
                row = served(model, name, sentences, args, tmp)
                results[mode].append(row)
                print(f"round {round_ + 1}: {mode} {row}", flush=True)
                time.sleep(2)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    def best(rows: list[dict[str, float]], key: str) -> float:
        return max(row[key] for row in rows)

    baseline = best(results["in-process"], "eps")
    print()
    print(
        f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"torch {_version('torch')}, sentence-transformers {_version('sentence-transformers')}; "
        f"{len(sentences)} sentences, {np.mean(tokens):.1f} word pieces on average "
        f"(4 to {max(tokens)}); {args.rounds} rounds of {args.duration} s, best of each shown"
    )
    print()
    print("| what | embeddings/s | vs in-process | p50 (ms) | p99 (ms) | errors |")
    print("|---|---:|---:|---:|---:|---:|")
    print(
        f"| sentence-transformers `encode`, batches of 64, one process | {baseline:.1f} | 100% | | | |"
    )
    labels = {
        "caller": "gateway + Redis + worker, tokenized caller-side (shipped)",
        "worker": "gateway + Redis + worker, tokenized in the worker",
    }
    for mode in modes:
        rows = results[mode]
        top = max(rows, key=lambda row: row["rps"])
        errors = sum(int(row["non_2xx"]) + (1 if row["socket_errors"] else 0) for row in rows)
        print(
            f"| {labels[mode]}, concurrency {args.concurrency} | {top['rps']:.1f} | "
            f"{top['rps'] / baseline:.0%} | {top['p50_ms']:.0f} | {top['p99_ms']:.0f} | {errors} |"
        )
    print(
        "\nevery round:",
        json.dumps(
            {k: [round(r.get("eps", r.get("rps", 0)), 1) for r in v] for k, v in results.items()}
        ),
    )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


if __name__ == "__main__":
    main()
