"""The floor under a request at concurrency 1: two hops through Redis, with nothing else done.

    python -m bench.hops [--rounds 3000]

One process RPUSHes a message to a list and BLPOPs the answer from another; a second process
BLPOPs the message and RPUSHes it back (uvloop, a private redis-server), over redis-py's asyncio
client and over microbatch's own lean connections (broker.resp_lane, which the hot path uses).
A microbatch request at c=1 makes the same two hops (client -> Redis -> worker, worker -> Redis
-> client) plus the model, so this round trip is what no change to microbatch's own code can
remove, short of busy polling.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from typing import Any

ECHO = "bench:hops:ping", "bench:hops:pong"
CLIENTS = ("redis-py", "lane")


class _Connection:
    """RPUSH and a blocking BLPOP over redis-py's asyncio client or a RespLane."""

    def __init__(self, url: str, client: str) -> None:
        if client == "lane":
            from broker.resp_lane import RespLane

            self.lane: Any = RespLane(url)
        else:
            import redis.asyncio as aioredis

            self.lane, self.redis = None, aioredis.Redis.from_url(url)

    async def rpush(self, key: str, value: bytes) -> None:
        if self.lane is not None:
            await self.lane.execute("RPUSH", key, value)
        else:
            await self.redis.rpush(key, value)

    async def blpop(self, key: str) -> bytes:
        if self.lane is not None:
            return (await self.lane.execute_blocking(0, "BLPOP", key, 0))[1]  # type: ignore[no-any-return]
        return (await self.redis.blpop([key], timeout=0))[1]  # type: ignore[no-any-return]


async def echo(url: str, client: str) -> None:
    connection = _Connection(url, client)
    while True:
        value = await connection.blpop(ECHO[0])
        if value == b"stop":
            return
        await connection.rpush(ECHO[1], value)


async def round_trips(url: str, rounds: int, client: str) -> list[float]:
    sender, receiver = _Connection(url, client), _Connection(url, client)
    took = []
    for _ in range(rounds):
        started = time.perf_counter()
        await sender.rpush(ECHO[0], b"x")
        await receiver.blpop(ECHO[1])
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
    parser.add_argument("--client", choices=CLIENTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.echo:
        uvloop.run(echo(args.echo, args.client))
        return
    with RedisServer() as server:
        for client in CLIENTS:
            other = subprocess.Popen(
                [sys.executable, "-m", "bench.hops", "--echo", server.url, "--client", client]
            )
            try:
                took = uvloop.run(round_trips(server.url, args.rounds, client))
            finally:
                other.wait(10)
            took.sort()
            print(
                f"two hops through Redis ({client}, 2 processes): p50 "
                f"{statistics.median(took) * 1e6:.0f} us, "
                f"p90 {took[int(len(took) * 0.9)] * 1e6:.0f} us over {len(took)} round trips"
            )


if __name__ == "__main__":
    main()
