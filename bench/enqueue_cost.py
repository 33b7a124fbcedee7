"""What one enqueue costs Redis: ``mb_enqueue`` of this tree, of another revision, and MULTI/EXEC.

    python -m bench.enqueue_cost                        # this tree's library and MULTI/EXEC
    python -m bench.enqueue_cost --against 8b2a57b      # and the library of a git revision
    python -m bench.enqueue_cost --against 834d608 --calls-per-fcall 64 --entry-items 32

Starts a private redis-server, loads each library under a name of its own, stores a queue
bound (512 items per worker, 256 MiB; one live worker) and, round after round, sends pipelines
of enqueues of 1,030-byte items (an MLP input; ``--item-bytes``) with each arm in turn:
``FCALL`` of each library, and the ``MULTI``/``XADD``.../``INCRBY``/``EXEC`` that an unbounded
caller sent before the bound existed. By default each FCALL carries one call (version 1 of the
call: an entry per item); ``--calls-per-fcall`` and ``--entry-items`` send what a busy client
sends (many calls of one reply key in one FCALL, packed into multi-item entries: version 2,
which libraries from 2 on take). The stream is emptied between pipelines, so the queue stays
under the bound, as in service. Redis's CPU time (``INFO cpu``, user + system) over each
pipeline, divided by its enqueues, is the cost; the medians over the rounds are printed, per
FCALL and per item.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
from pathlib import Path
from typing import Any

import redis

from broker import functions
from broker.devserver import RedisServer

ROOT = Path(__file__).resolve().parent.parent
STREAM, COUNTER, PACKED = "mb:{p:m}:requests", "mb:{p:m}:queued-bytes", "mb:{p:m}:packed-items"
BOUND, CONSUMERS, INBOX = "mb:{p:m}:queue-bound", "mb:{p:m}:consumers", "mb:{p:m}:inbox:c"


def library_at(revision: str) -> str:
    """The Lua library of broker/functions.py at a git revision."""
    source = subprocess.run(
        ["git", "show", f"{revision}:broker/functions.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    # (as a module of the broker package, so that its relative imports resolve)
    namespace: dict[str, Any] = {
        "__name__": "broker.bench_functions_at_revision",
        "__package__": "broker",
    }
    exec(compile(source, f"{revision}:broker/functions.py", "exec"), namespace)
    return str(namespace["CODE"])


def renamed(code: str, name: str) -> str:
    """A library's code loaded as library ``name``, its functions named ``name_...``."""
    code = code.replace(f"#!lua name={functions.LIBRARY}", f"#!lua name={name}")
    return code.replace("function_name='mb_", f"function_name='{name}_")


def _cpu(client: redis.Redis) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def measure(args: argparse.Namespace) -> dict[str, list[float]]:
    """Redis CPU microseconds per enqueue call, per arm, one figure per round."""
    libraries = {"this tree": functions.CODE}
    if args.against:
        libraries[args.against] = library_at(args.against)
    data = os.urandom(args.item_bytes)
    items = args.items
    results: dict[str, list[float]] = {name: [] for name in [*libraries, "MULTI/EXEC"]}
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        names = {}
        for i, (arm, code) in enumerate(libraries.items()):
            names[arm] = f"lib{i}"
            client.execute_command("FUNCTION", "LOAD", "REPLACE", renamed(code, names[arm]))
        client.hset(BOUND, mapping={"items": 512, "bytes": 256 * 2**20})
        client.zadd(CONSUMERS, {"w1": 2**50})
        if args.entry_items == 1:  # version 1 of the call (one entry per item): every library
            fcall_head: list[Any] = [4, STREAM, COUNTER, BOUND, CONSUMERS, 1, 0, 0]
        else:  # version 2: items of calls sent together packed, up to entry_items an entry
            fcall_head = [5, STREAM, COUNTER, BOUND, CONSUMERS, PACKED, 2, 0, 0, args.entry_items]
        body: list[Any] = []
        for c in range(args.calls_per_fcall):
            body += [items, INBOX, 30000, ""]
            for i in range(items):
                body += [f"c{c}.{i}", data]
        items *= args.calls_per_fcall

        def queue(pipe: Any, arm: str) -> None:
            if arm == "MULTI/EXEC":
                pipe.execute_command("MULTI")
                for i in range(items):
                    pipe.execute_command(
                        "XADD", STREAM, "*", "v", "1", "id", f"c.{i}", "reply", INBOX,
                        "timeout", 30000, "data", data,
                    )  # fmt: skip
                pipe.execute_command("INCRBY", COUNTER, len(data) * items)
                pipe.execute_command("EXEC")
            else:
                pipe.execute_command("FCALL", f"{names[arm]}_enqueue", *fcall_head, *body)

        for _ in range(args.rounds):
            for arm in results:
                spent = 0.0
                for _ in range(args.pipelines):
                    client.delete(STREAM, PACKED)
                    client.set(COUNTER, 0)
                    pipe = client.pipeline(transaction=False)
                    for _ in range(args.calls):
                        queue(pipe, arm)
                    before = _cpu(client)
                    pipe.execute()
                    spent += _cpu(client) - before
                results[arm].append(spent / (args.pipelines * args.calls) * 1e6)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.enqueue_cost", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--against", help="a git revision whose mb_enqueue to compare")
    parser.add_argument("--items", type=int, default=1, help="items per enqueue call")
    parser.add_argument(
        "--item-bytes", type=int, default=1030, help="bytes of each item (default: an MLP input)"
    )
    parser.add_argument(
        "--calls-per-fcall", type=int, default=1, help="calls (of --items each) per FCALL"
    )
    parser.add_argument(
        "--entry-items", type=int, default=1, help="most items per stream entry (1: version 1)"
    )
    parser.add_argument("--calls", type=int, default=200, help="enqueue calls per pipeline")
    parser.add_argument("--pipelines", type=int, default=10, help="pipelines per round")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    results = measure(args)
    per_fcall = args.items * args.calls_per_fcall
    shape = f"{args.calls_per_fcall} call(s) of {args.items} item(s) per FCALL"
    if args.entry_items > 1:
        shape += f", up to {args.entry_items} an entry"
    print(f"| arm ({shape}) | Redis CPU us per FCALL | range | per item |")
    print("|---|---:|---|---:|")
    for arm, rounds in results.items():
        median = statistics.median(rounds)
        print(
            f"| {arm} | {median:.1f} | {min(rounds):.1f}-{max(rounds):.1f} | "
            f"{median / per_fcall:.2f} |"
        )


if __name__ == "__main__":
    main()
