"""What a payload costs Redis on its way into a Redis Function, against plain commands.

    python -m bench.function_args [--sizes 1000,10000,70000] [--calls 200] [--rounds 5]

Starts a private redis-server, loads a library whose one function does nothing, and for each
argument size sends pipelines of ``FCALL`` of that function with one argument of that many
random bytes, of ``ECHO`` and of ``SET`` with the same bytes, arms in turn. Redis's CPU time
(``INFO cpu``, user + system) over each pipeline, divided by its calls, is the cost; the
median over the rounds is printed, and per byte. A request's data crosses one function on its
way in (``mb_enqueue``) and its result another on the way out (``mb_reply``): what the
function adds per byte over ``SET`` is what each crossing costs.
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable
from typing import Any

import redis

from broker.devserver import RedisServer

LIBRARY = "#!lua name=bench_args\nredis.register_function('bench_noop', function() return 0 end)\n"


def _cpu(client: redis.Redis) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


ARMS: dict[str, Callable[[Any, bytes], Any]] = {
    "FCALL (no-op function)": lambda pipe, data: pipe.fcall("bench_noop", 0, data),
    "ECHO": lambda pipe, data: pipe.execute_command("ECHO", data),
    "SET": lambda pipe, data: pipe.set("bench:value", data),
}


def measure(sizes: list[int], calls: int, rounds: int) -> dict[int, dict[str, float]]:
    """Median Redis CPU microseconds per call, by argument size and arm."""
    medians: dict[int, dict[str, float]] = {}
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        client.function_load(LIBRARY, replace=True)
        print(f"redis {client.info('server')['redis_version']}")
        for size in sizes:
            data = os.urandom(size)
            runs: dict[str, list[float]] = {arm: [] for arm in ARMS}
            for _ in range(rounds):
                for arm, send in ARMS.items():
                    pipe = client.pipeline(transaction=False)
                    for _ in range(calls):
                        send(pipe, data)
                    before = _cpu(client)
                    pipe.execute()
                    runs[arm].append((_cpu(client) - before) / calls * 1e6)
            medians[size] = {arm: statistics.median(values) for arm, values in runs.items()}
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,10000,70000", help="argument sizes, bytes")
    parser.add_argument("--calls", type=int, default=200, help="calls per pipeline")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    sizes = [int(size) for size in args.sizes.split(",")]
    results = measure(sizes, args.calls, args.rounds)
    print("| bytes | arm | Redis CPU us per call | ns per byte |")
    print("|---:|---|---:|---:|")
    for size, arms in results.items():
        for arm, micros in arms.items():
            print(f"| {size:,} | {arm} | {micros:.1f} | {micros * 1000 / size:.2f} |")


if __name__ == "__main__":
    main()
