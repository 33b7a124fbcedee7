"""Embeddings per second: examples.embedder through gateway + Redis + worker, against
sentence-transformers' own ``encode`` on batches in one process.

    .venv/bin/python bench/embed_bench.py [--duration 10] [--rounds 6] [--concurrency 64]

Everything runs on this machine and stays up for the whole run (idle while not measured):

- **in-process**: a process with all-MiniLM-L6-v2 loaded by sentence-transformers; measuring
  it calls ``model.encode(chunk, batch_size=64)`` on consecutive chunks of 64 sentences of the
  corpus for ``--duration`` seconds: the batched rate with nothing in between.
- **served, tokenized caller-side** (examples.embedder:Embedder, as shipped): a private
  redis-server, ``worker start`` (one process), ``gateway start`` (one gunicorn worker);
  measuring it runs wrk with ``--concurrency`` connections, each request one sentence (the
  corpus in turn), for ``--duration`` seconds; requests/s = embeddings/s.
- **served, tokenized in the worker** (WorkerTokenizedEmbedder below: the same tokenizer code,
  run in ``predict`` instead of ``preprocess``), the same way.

The measurements alternate, ``--rounds`` times, so that a busy neighbour on a shared machine
hits all of them alike; the summary gives medians and the median of each round's ratio. Besides
wall-clock rates it reports the CPU seconds each side spends per 1000 embeddings (every process
of the served stack, from /proc; the load generator is not counted), which a busy neighbour
disturbs much less. It also reads the worker's /metrics for the mean batch size and the model's
time per item. Prints a Markdown table (and writes JSON with ``--json``). ``wrk`` must be on
PATH (apt-get install wrk).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import resource
import shutil
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.http_bench import ENV, run_wrk, wait_http, wait_workers  # noqa: E402
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
sentences = json.loads(sys.stdin.readline())
model = SentenceTransformer(str(model_path()), device="cpu")
chunks = [sentences[i:i + 64] for i in range(0, len(sentences), 64)]
for chunk in chunks[:2]:
    model.encode(chunk, batch_size=64)
print("ready", flush=True)
i = 0
for line in sys.stdin:
    duration, size = line.split()
    duration, size = float(duration), int(size)
    chunks = [sentences[i:i + size] for i in range(0, len(sentences), size)]
    done, start, cpu = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - start < duration:
        model.encode(chunks[i % len(chunks)], batch_size=size)
        done += len(chunks[i % len(chunks)])
        i += 1
    cpu = time.process_time() - cpu
    print(json.dumps({"eps": done / (time.perf_counter() - start), "cpu_s": cpu,
                      "embeddings": done}), flush=True)
"""


class InProcess:
    """A process with sentence-transformers loaded, measuring ``encode`` when asked to."""

    def __init__(self, sentences: list[str]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", IN_PROCESS],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps(sentences) + "\n")
        self.process.stdin.flush()
        if self.process.stdout.readline().strip() != "ready":
            raise RuntimeError("the in-process baseline did not start")

    def measure(self, duration: float, size: int = 64) -> dict[str, float]:
        """encode() on consecutive chunks of ``size`` sentences, batch_size=size."""
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(f"{duration} {size}\n")
        self.process.stdin.flush()
        result: dict[str, float] = json.loads(self.process.stdout.readline())
        return result

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.wait(30)


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


TICK = os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(roots: list[int]) -> float:
    """CPU time (user + system) of the processes ``roots`` and all their descendants."""
    parents: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry)] = int(fields[1])
        ticks[int(entry)] = int(fields[11]) + int(fields[12])
    wanted, frontier = set(roots), list(roots)
    while frontier:
        pid = frontier.pop()
        for child, parent in parents.items():
            if parent == pid and child not in wanted:
                wanted.add(child)
                frontier.append(child)
    return sum(ticks.get(pid, 0) for pid in wanted) / TICK


def start(stack: ExitStack, command: list[str]) -> int:
    proc = subprocess.Popen(
        command, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )

    def stop() -> None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    stack.callback(stop)
    return proc.pid


class Served:
    """redis-server + `worker start` (one process) + `gateway start` for one model, kept up."""

    def __init__(
        self, stack: ExitStack, model: str, name: str, sentences: list[str], args: Any, tmp: Path
    ) -> None:
        server = stack.enter_context(RedisServer())
        assert server.process is not None
        self.pids = [server.process.pid]
        prefix = "bench"
        self.metrics_port = free_port()
        worker = [sys.executable, "-m", "gpu_worker.cli", "start", "--model", model]
        worker += ["--redis", server.url, "--prefix", prefix, "--workers", "1"]
        worker += ["--batch-size", str(args.batch_size), "--log-level", "WARNING"]
        worker += ["--metrics-port", str(self.metrics_port)]
        self.pids.append(start(stack, worker))
        port = free_port()
        gateway = [sys.executable, "-m", "web_gateway.cli", "start", "--model", model]
        gateway += ["--redis", server.url, "--prefix", prefix, "--port", str(port)]
        gateway += ["--workers", str(args.gateway_workers), "--log-level", "warning"]
        self.pids.append(start(stack, gateway))
        wait_workers(server.url, ModelKeys(name, prefix), 1, timeout=180)
        wait_http(f"http://127.0.0.1:{port}/healthz")
        path = f"/v1/models/{name}/predict"
        self.url = f"http://127.0.0.1:{port}{path}"
        self.script = wrk_script(tmp, path, sentences)
        self.concurrency = args.concurrency
        run_wrk(self.url, self.script, self.concurrency, 3)  # warm up

    def worker_counters(self) -> dict[str, float]:
        """Batches, items and model seconds so far (from the worker's /metrics)."""
        import httpx

        text = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).text
        out = {}
        for key, metric in (
            ("batches", "microbatch_worker_batch_size_count"),
            ("items", "microbatch_worker_batch_size_sum"),
            ("model_s", "microbatch_worker_inference_seconds_sum"),
        ):
            match = re.search(rf"^{metric}{{[^}}]*}} ([0-9.e+-]+)$", text, re.MULTILINE)
            out[key] = float(match.group(1)) if match else float("nan")
        return out

    def measure(self, duration: int) -> dict[str, float]:
        before = self.worker_counters()
        cpu = [tree_cpu_seconds([pid]) for pid in self.pids]
        wrk_cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
        row = run_wrk(self.url, self.script, self.concurrency, duration)
        wrk_after = resource.getrusage(resource.RUSAGE_CHILDREN)
        spent = [tree_cpu_seconds([pid]) - old for pid, old in zip(self.pids, cpu, strict=True)]
        row["cpu_s"] = sum(spent)
        done = max(1, row["requests"] - row["non_2xx"])
        for part, seconds in zip(("redis", "worker", "gateway"), spent, strict=True):
            row[f"{part}_ms"] = 1000 * seconds / done  # CPU ms per embedding
        row["wrk_cpu_s"] = (wrk_after.ru_utime + wrk_after.ru_stime) - (
            wrk_cpu.ru_utime + wrk_cpu.ru_stime
        )
        row["embeddings"] = row["requests"] - row["non_2xx"]
        after = self.worker_counters()
        delta = {key: after[key] - before[key] for key in before}
        row["mean_batch"] = delta["items"] / delta["batches"] if delta["batches"] else 0.0
        row["model_ms_per_item"] = (
            1000 * delta["model_s"] / delta["items"] if delta["items"] else 0.0
        )
        return row


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
    parser.add_argument("--duration", type=int, default=10, help="seconds per measurement")
    parser.add_argument("--concurrency", type=int, default=64, help="wrk connections")
    parser.add_argument("--rounds", type=int, default=6, help="alternations of all measurements")
    parser.add_argument("--gateway-workers", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--modes", default="caller,worker", help="served modes to measure")
    parser.add_argument(
        "--baseline-batches",
        default="64,32",
        help="in-process chunk sizes (the first is the reference; the served mean batch is ~32)",
    )
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
    sizes = [int(size) for size in args.baseline_batches.split(",") if size]
    results: dict[str, list[dict[str, float]]] = {f"in-process-{size}": [] for size in sizes}
    results.update({mode: [] for mode in modes})
    tmp = Path(tempfile.mkdtemp(prefix="microbatch-embed-bench-"))
    with ExitStack() as stack:
        stack.callback(shutil.rmtree, tmp, True)
        served = {mode: Served(stack, *models[mode], sentences, args, tmp) for mode in modes}
        baseline = InProcess(sentences)
        stack.callback(baseline.close)
        for round_ in range(args.rounds):  # alternate, so that a noisy neighbour hits all alike
            line = [f"round {round_ + 1}:"]
            for size in sizes:
                row = baseline.measure(args.duration, size)
                results[f"in-process-{size}"].append(row)
                line.append(
                    f"in-process/{size} {row['eps']:.1f}/s "
                    f"({1000 * row['cpu_s'] / row['embeddings']:.2f} CPU s/1000)"
                )
            for mode in modes:
                row = served[mode].measure(args.duration)
                results[mode].append(row)
                line.append(
                    f"{mode} {row['rps']:.1f}/s (batch {row['mean_batch']:.1f}, "
                    f"{row['model_ms_per_item']:.1f} ms model/item, "
                    f"{1000 * row['cpu_s'] / row['embeddings']:.2f} CPU s/1000: gateway "
                    f"{row['gateway_ms']:.2f} ms, worker {row['worker_ms']:.2f} ms, "
                    f"redis {row['redis_ms']:.2f} ms per embedding)"
                )
            print(" ".join(line), flush=True)

    reference = f"in-process-{sizes[0]}"
    base = [row["eps"] for row in results[reference]]
    base_cpu = [1000 * row["cpu_s"] / row["embeddings"] for row in results[reference]]
    print()
    print(
        f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"torch {_version('torch')}, sentence-transformers {_version('sentence-transformers')}; "
        f"{len(sentences)} sentences, {np.mean(tokens):.1f} word pieces on average "
        f"(4 to {max(tokens)}); {args.rounds} alternating rounds of {args.duration} s each; "
        "medians over the rounds"
    )
    print()
    print(
        f"| what | embeddings/s | vs in-process/{sizes[0]} | CPU s per 1000 "
        f"| vs in-process/{sizes[0]} (CPU) | mean batch | p50 (ms) | p99 (ms) | errors |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")

    def ratios(rows: list[dict[str, float]], key: str) -> tuple[float, float]:
        cpu = [1000 * row["cpu_s"] / row["embeddings"] for row in rows]
        rate = np.median([row[key] / b for row, b in zip(rows, base, strict=True)])
        return float(rate), float(np.median([b / c for b, c in zip(base_cpu, cpu, strict=True)]))

    for size in sizes:
        rows = results[f"in-process-{size}"]
        rate, cpu_ratio = ratios(rows, "eps")
        cpu = np.median([1000 * row["cpu_s"] / row["embeddings"] for row in rows])
        print(
            f"| in-process/{size}: sentence-transformers `encode`, chunks of {size}, one process "
            f"| {np.median([r['eps'] for r in rows]):.1f} | {rate:.0%} | {cpu:.2f} "
            f"| {cpu_ratio:.0%} | {size} | | | |"
        )
    labels = {
        "caller": "gateway + Redis + worker, tokenized caller-side (shipped)",
        "worker": "gateway + Redis + worker, tokenized in the worker",
    }
    for mode in modes:
        rows = results[mode]
        rate, cpu_ratio = ratios(rows, "rps")
        cpu = np.median([1000 * row["cpu_s"] / row["embeddings"] for row in rows])
        errors = sum(int(row["non_2xx"]) + (1 if row["socket_errors"] else 0) for row in rows)
        print(
            f"| {labels[mode]}, concurrency {args.concurrency} "
            f"| {np.median([r['rps'] for r in rows]):.1f} | {rate:.0%} | {cpu:.2f} "
            f"| {cpu_ratio:.0%} | {np.median([r['mean_batch'] for r in rows]):.1f} "
            f"| {np.median([r['p50_ms'] for r in rows]):.0f} "
            f"| {np.median([r['p99_ms'] for r in rows]):.0f} | {errors} |"
        )
    print("\nCPU ms per embedding, by process (medians):")
    for mode in modes:
        parts = {part: np.median([r[f"{part}_ms"] for r in results[mode]]) for part in
                 ("gateway", "redis", "worker")}  # fmt: skip
        print(f"- {labels[mode]}: " + ", ".join(f"{k} {v:.2f}" for k, v in parts.items()))
    wrk = [1000 * r["wrk_cpu_s"] / r["embeddings"] for mode in modes for r in results[mode]]
    print(
        "\nRatios are medians of each round's ratio; CPU s per 1000 embeddings counts every "
        "process of the served stack (redis-server, gateway, worker) but not the load "
        f"generator (wrk: {np.median(wrk):.2f} CPU s per 1000 requests)"
    )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


if __name__ == "__main__":
    main()
