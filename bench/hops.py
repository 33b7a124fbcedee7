"""The floor under a request at concurrency 1: two hops through Redis, with nothing else done.

    python -m bench.hops [--rounds 3000]

One process RPUSHes a message to a list and BLPOPs the answer from another; a second process
BLPOPs the message and RPUSHes it back (redis-py's asyncio client, uvloop, a private
redis-server). A microbatch request at c=1 makes the same two hops (client -> Redis -> worker,
worker -> Redis -> client) plus the model, so this round trip is what no change to microbatch's
own code can remove, short of a leaner Redis client or busy polling.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

ECHO = "bench:hops:ping", "bench:hops:pong"


async def echo(url: str) -> None:
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(url)
    while True:
        _, value = await client.blpop([ECHO[0]], timeout=0)
        if value == b"stop":
            return
        await client.rpush(ECHO[1], value)


async def round_trips(url: str, rounds: int) -> list[float]:
    import redis.asyncio as aioredis

    sender, receiver = aioredis.Redis.from_url(url), aioredis.Redis.from_url(url)
    took = []
    for _ in range(rounds):
        started = time.perf_counter()
        await sender.rpush(ECHO[0], b"x")
        await receiver.blpop([ECHO[1]], timeout=0)
        took.append(time.perf_counter() - started)
    await sender.rpush(ECHO[0], b"stop")
    return took[rounds // 5 :]  # the first fifth warms up


def main() -> None:
    import uvloop

    from broker.devserver import RedisServer

    parser = argparse.ArgumentParser(
        prog="python -m bench.hops", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--rounds", type=int, default=3000)
    parser.add_argument("--echo", help=argparse.SUPPRESS)  # the second process
    args = parser.parse_args()
    if args.echo:
        uvloop.run(echo(args.echo))
        return
    with RedisServer() as server:
        other = subprocess.Popen([sys.executable, "-m", "bench.hops", "--echo", server.url])
        try:
            took = uvloop.run(round_trips(server.url, args.rounds))
        finally:
            other.wait(10)
    took.sort()
    print(
        f"two hops through Redis (redis-py asyncio, 2 processes): p50 "
        f"{statistics.median(took) * 1e6:.0f} us, p90 {took[int(len(took) * 0.9)] * 1e6:.0f} us "
        f"over {len(took)} round trips"
    )


if __name__ == "__main__":
    main()
