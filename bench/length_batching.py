"""Length-aware batching on the real embedder: batches by a token budget against batches by count.

    .venv/bin/python -m bench.length_batching [--rounds 3] [--burst 256] [--rate 3] [--duration 60]

Two `worker start` commands (one process each, torch threads 1) serve examples.embedder's
Embedder from one private redis-server, both kept up for the whole run: **budget** with the
model's ``max_batch_cost`` (4096 tokens: batches of texts of similar length) and **count** with
``--max-batch-cost 0`` (batches of up to 64 texts in arrival order, as before the budget). The
texts are bench/data/texts_mix.json: a seeded mix of short sentences and long paragraphs (see
:func:`make_mix`; ``--write-mix`` writes it again), tokenized once in this process, so the
load is the token ids that callers send. Each round measures both arms, alternating which goes
first, under the same two loads:

- **burst**: the first ``--burst`` texts of the mix submitted at once, each as its own call (a
  backlog): the time until the last answer gives items/s and tokens/s (real tokens, not
  padding); the calls' latencies give p50/p99.
- **open loop**: Poisson arrivals at ``--rate`` texts/s (seeded: the same arrival times and
  texts for both arms) for ``--duration`` seconds; latencies of every call, counted until its
  answer however late (a call that has not been answered within 300 s counts as an error).

The workers log each batch (items, tokens, padded tokens: items x the longest) to a file, which
gives the padded share (padding / padded tokens) and the mean batch of each phase. Every answer
of the bursts is checked against the embeddings computed in this process. Prints a Markdown
table of the medians over the rounds and the median of the per-round ratios (budget / count),
and writes JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

from broker import Streamer
from broker.devserver import RedisServer
from broker.keys import ModelKeys
from examples.embedder import Embedder

ROOT = Path(__file__).resolve().parent.parent
MIX_PATH = ROOT / "bench" / "data" / "texts_mix.json"
BATCH_LOG_ENV = "MICROBATCH_BENCH_BATCH_LOG"
PREFIX = "lenbench"
ARMS = {"budget": [], "count": ["--max-batch-cost", "0"]}
CALL_TIMEOUT_S = 300.0


def make_mix(size: int = 512, seed: int = 0, long_share: float = 0.25) -> list[str]:
    """Short sentences (4 to 40 words) and, a quarter of them, paragraphs of 6 to 18 of those
    sentences (the longest reach the model's 256-token window)."""
    from bench.embed_bench import corpus

    rng = random.Random(seed)
    sentences = corpus(4096, seed)
    texts = []
    for _ in range(size):
        if rng.random() < long_share:
            texts.append(" ".join(rng.choice(sentences) for _ in range(rng.randint(6, 18))))
        else:
            texts.append(rng.choice(sentences))
    return texts


def load_mix() -> list[str]:
    texts: list[str] = json.loads(MIX_PATH.read_text())
    return texts


class CountingEmbedder(Embedder):
    """The embedder with one torch thread, logging each batch: items, tokens, padded tokens."""

    name = "embedder"

    def init_model(self) -> None:
        super().init_model()
        self.torch.set_num_threads(1)
        path = os.environ.get(BATCH_LOG_ENV)
        self.log = open(path, "a", buffering=1) if path else None  # noqa: SIM115

    def predict(self, batch: list[Any]) -> list[Any]:
        if self.log is not None:
            lengths = [len(item) for item in batch]
            self.log.write(f"{len(batch)} {sum(lengths)} {len(batch) * max(lengths)}\n")
        return super().predict(batch)


def read_batches(path: Path) -> list[tuple[int, int, int]]:
    if not path.exists():
        return []
    rows = [line.split() for line in path.read_text().splitlines() if line.strip()]
    return [(int(n), int(tokens), int(padded)) for n, tokens, padded in rows]


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


class Arm:
    """One `worker start` serving the embedder under its own name, with its batch log."""

    def __init__(self, stack: ExitStack, url: str, arm: str, tmp: Path) -> None:
        self.name = f"embedder-{arm}"
        self.log = tmp / f"{arm}.batches"
        command = [sys.executable, "-m", "gpu_worker.cli", "start"]
        command += ["--model", "bench.length_batching:CountingEmbedder", "--name", self.name]
        command += ["--redis", url, "--prefix", PREFIX, "--log-level", "warning", *ARMS[arm]]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        env[BATCH_LOG_ENV] = str(self.log)
        process = subprocess.Popen(command, cwd=ROOT, env=env)
        stack.callback(_stop, process)
        self.url = url

    def wait(self) -> None:
        from bench.http_bench import wait_workers

        wait_workers(self.url, ModelKeys(self.name, PREFIX), 1, timeout=300)


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


async def burst(arm: Arm, url: str, items: list[np.ndarray]) -> tuple[dict[str, Any], list[Any]]:
    """Submit every item at once (one call each); the time until the last answer."""
    before = len(read_batches(arm.log))
    async with Streamer(arm.name, redis_url=url, prefix=PREFIX) as streamer:
        latencies: list[float] = []

        async def one(item: np.ndarray) -> Any:
            started = time.perf_counter()
            (output,) = await streamer.apredict([item], timeout=CALL_TIMEOUT_S)
            latencies.append(time.perf_counter() - started)
            return output

        started = time.perf_counter()
        outputs = await asyncio.gather(*(one(item) for item in items))
        seconds = time.perf_counter() - started
    tokens = sum(len(item) for item in items)
    row = {
        "items_per_s": len(items) / seconds,
        "tokens_per_s": tokens / seconds,
        "p50_ms": percentile(latencies, 50) * 1000,
        "p99_ms": percentile(latencies, 99) * 1000,
        **batch_stats(read_batches(arm.log)[before:]),
    }
    return row, outputs


async def open_loop(
    arm: Arm, url: str, items: list[np.ndarray], rate: float, duration: float, seed: int
) -> dict[str, Any]:
    """Poisson arrivals at ``rate`` per second for ``duration`` seconds; every call's latency."""
    rng = random.Random(seed)
    arrivals, at = [], 0.0
    while True:
        at += rng.expovariate(rate)
        if at >= duration:
            break
        arrivals.append(at)
    before = len(read_batches(arm.log))
    latencies: list[float] = []
    errors = 0
    async with Streamer(arm.name, redis_url=url, prefix=PREFIX) as streamer:

        async def one(item: np.ndarray) -> None:
            nonlocal errors
            started = time.perf_counter()
            try:
                await streamer.apredict([item], timeout=CALL_TIMEOUT_S)
            except Exception:
                errors += 1
                return
            latencies.append(time.perf_counter() - started)

        start = time.perf_counter()
        tasks = []
        for index, offset in enumerate(arrivals):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(one(items[index % len(items)])))
        await asyncio.gather(*tasks)
        seconds = time.perf_counter() - start
    sent = [items[index % len(items)] for index in range(len(arrivals))]
    return {
        "offered_per_s": len(arrivals) / duration,
        "items_per_s": len(latencies) / seconds,
        "tokens_per_s": sum(len(item) for item in sent) / seconds,
        "p50_ms": percentile(latencies, 50) * 1000,
        "p99_ms": percentile(latencies, 99) * 1000,
        "errors": errors,
        **batch_stats(read_batches(arm.log)[before:]),
    }


def batch_stats(batches: list[tuple[int, int, int]]) -> dict[str, float]:
    items = sum(n for n, _, _ in batches)
    tokens = sum(t for _, t, _ in batches)
    padded = sum(p for _, _, p in batches)
    return {
        "batches": len(batches),
        "mean_batch": items / len(batches) if batches else 0.0,
        "padded_share": (padded - tokens) / padded if padded else 0.0,
    }


def reference(items: list[np.ndarray]) -> list[np.ndarray]:
    """The embeddings of ``items`` computed here, in batches of similar length."""
    model = Embedder()
    model.init_model()
    model.torch.set_num_threads(1)
    order = sorted(range(len(items)), key=lambda i: len(items[i]))
    out: list[Any] = [None] * len(items)
    for start in range(0, len(order), 16):
        chunk = order[start : start + 16]
        for index, vector in zip(chunk, model.predict([items[i] for i in chunk]), strict=True):
            out[index] = vector
    return out


def check(outputs: list[Any], want: list[np.ndarray]) -> None:
    for index, (got, expected) in enumerate(zip(outputs, want, strict=True)):
        if not np.allclose(np.asarray(got), expected, atol=1e-4):
            raise AssertionError(f"answer {index} differs from the in-process embedding")


def summarize(rounds: list[dict[str, dict[str, dict[str, Any]]]]) -> dict[str, Any]:
    """Medians over rounds per phase and arm, and the median of the per-round ratios."""
    out: dict[str, Any] = {}
    for phase in ("burst", "open_loop"):
        keys = [k for k, v in rounds[0][phase]["budget"].items() if isinstance(v, (int, float))]
        out[phase] = {
            arm: {k: statistics.median(r[phase][arm][k] for r in rounds) for k in keys}
            for arm in ARMS
        }
        out[phase]["ratio"] = {
            k: statistics.median(
                r[phase]["budget"][k] / r[phase]["count"][k] if r[phase]["count"][k] else 0.0
                for r in rounds
            )
            for k in keys
        }
    return out


def table(summary: dict[str, Any], args: argparse.Namespace) -> str:
    lines = []
    for phase, title in (
        ("burst", f"burst of {args.burst} texts at once"),
        ("open_loop", f"open loop, {args.rate:g} texts/s for {args.duration:g} s"),
    ):
        lines += [
            f"**{title}** (medians of {args.rounds} rounds; ratio: median of the rounds' "
            "budget / count)",
            "",
            "| batches by | items/s | tokens/s | p50 (ms) | p99 (ms) | padded share "
            "| mean batch | batches |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for arm in (*ARMS, "ratio"):
            row = summary[phase][arm]
            label = {
                "budget": "token budget 4096 (the model's default)",
                "count": "count, 64 (`--max-batch-cost 0`)",
                "ratio": "ratio budget / count",
            }[arm]
            fmt = "{:.2f}x" if arm == "ratio" else None
            cells = [
                fmt.format(row[k]) if fmt else f"{row[k]:.1f}"
                for k in ("items_per_s", "tokens_per_s", "p50_ms", "p99_ms")
            ]
            share = fmt.format(row["padded_share"]) if fmt else f"{100 * row['padded_share']:.0f}%"
            batch = fmt.format(row["mean_batch"]) if fmt else f"{row['mean_batch']:.1f}"
            count = fmt.format(row["batches"]) if fmt else f"{row['batches']:.0f}"
            lines.append(f"| {label} | {' | '.join(cells)} | {share} | {batch} | {count} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.length_batching", description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--burst", type=int, default=256, help="texts submitted at once")
    parser.add_argument("--rate", type=float, default=3.0, help="open-loop texts per second")
    parser.add_argument("--duration", type=float, default=60.0, help="open-loop seconds")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--write-mix", action="store_true", help="write the mix file and exit")
    args = parser.parse_args(argv)
    if args.write_mix:
        MIX_PATH.parent.mkdir(exist_ok=True)
        MIX_PATH.write_text(json.dumps(make_mix(), indent=0) + "\n")
        print(f"wrote {MIX_PATH}")
        return
    texts = load_mix()
    tokenizer = Embedder().tokenizer
    items = [tokenizer.encode(text) for text in texts]
    lengths = [len(item) for item in items]
    print(
        f"mix: {len(items)} texts, {statistics.mean(lengths):.1f} tokens on average "
        f"(median {statistics.median(lengths):.0f}, max {max(lengths)})",
        flush=True,
    )
    burst_items = [items[i % len(items)] for i in range(args.burst)]
    want = reference(burst_items)
    import tempfile

    rounds = []
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        server = stack.enter_context(RedisServer())
        arms = {arm: Arm(stack, server.url, arm, tmp) for arm in ARMS}
        for arm in arms.values():
            arm.wait()
        for arm in arms.values():  # warm up: one burst of 32
            asyncio.run(burst(arm, server.url, items[:32]))
        for number in range(args.rounds):
            order = list(ARMS) if number % 2 == 0 else list(reversed(ARMS))
            result: dict[str, dict[str, Any]] = {"burst": {}, "open_loop": {}}
            for name in order:
                row, outputs = asyncio.run(burst(arms[name], server.url, burst_items))
                check(outputs, want)
                result["burst"][name] = row
                print(f"round {number + 1} burst {name}: {json.dumps(row)}", flush=True)
            for name in order:
                row = asyncio.run(
                    open_loop(arms[name], server.url, items, args.rate, args.duration, number)
                )
                result["open_loop"][name] = row
                print(f"round {number + 1} open loop {name}: {json.dumps(row)}", flush=True)
            rounds.append(result)
    summary = summarize(rounds)
    print()
    print(table(summary, args))
    if args.json:
        report = {
            "command": " ".join(["python -m bench.length_batching", *(argv or sys.argv[1:])]),
            "machine": f"{os.cpu_count()} CPUs, {platform.processor() or platform.machine()}",
            "python": platform.python_version(),
            "mix": {"texts": len(items), "mean_tokens": statistics.mean(lengths)},
            "rounds": rounds,
            "summary": summary,
        }
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
