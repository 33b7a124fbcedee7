"""The worker's Python per item outside the model and the sockets, stage by stage, in-process.

    python -m bench.worker_path [--batches 2000]

Builds one batch as XREADGROUP hands it to the transport (two multi-item entries of 32 items,
each item a float32[256] array, as ``bench.model_share``'s callers send), then times, per item:
``read`` (fields paired, entries split, tagged: ``RedisTransport._read_partition`` without its
round trip), ``prepare`` (``Preparer.prepare``: parse, reply-key check, deadline, decode, input
check), ``encode`` (the items' replies, ``OutcomeEncoder.encode``) and ``acks`` (``_removal``:
settling the items and the ack commands). Best of 5 repeats. No Redis: compare two trees'
figures with ``PYTHONPATH`` pointing at each.
"""

from __future__ import annotations

import argparse
import time
import timeit
from collections.abc import Callable
from typing import Any

import numpy as np

from bench.models import Identity
from broker import codec, multi_item
from broker import redis_transport as rt
from broker.keys import ModelKeys
from broker.priorities import LevelKeep
from gpu_worker.model import input_check
from gpu_worker.observer import BatchObserver
from gpu_worker.outcomes import OutcomeEncoder
from gpu_worker.preparing import Preparer

ITEMS_PER_ENTRY = 32


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.worker_path", description=__doc__)
    parser.add_argument("--batches", type=int, default=2000)
    args = parser.parse_args()
    keys = ModelKeys("identity", "bench")
    payload = codec.encode(np.zeros(256, np.float32))
    now = int(time.time() * 1000)
    reply = keys.inbox("client").encode()

    def entry(seq: int) -> tuple[bytes, list[bytes]]:
        flat = [b"v", b"2", b"reply", reply, b"n", b"%d" % ITEMS_PER_ENTRY]
        for i in range(ITEMS_PER_ENTRY):
            flat += [b"id.%d" % i, b"r%d.%d" % (seq, i), b"timeout.%d" % i, b"60000"]
            flat += [b"data.%d" % i, payload]
        return b"%d-%d" % (now, seq), flat

    raw = [entry(1), entry(2)]
    size = ITEMS_PER_ENTRY * len(raw)
    preparer = Preparer(keys, BatchObserver(), lambda: float(now), input_check(Identity.inputs))
    transport: Any = rt.RedisTransport.__new__(rt.RedisTransport)  # its acks alone
    transport._item_acks = {}
    keep = LevelKeep()

    def read() -> list[Any]:
        pairs = [(i.decode(), rt._pairs(f)) for i, f in raw]
        keep.add(0, multi_item.expand(pairs, transport._acks(keys.stream)))
        return rt._tagged(keys, keep.take(size))

    entries = read()
    batch = preparer.prepare(entries, set())
    assert len(batch.items) == size

    encoder = OutcomeEncoder()

    def acks() -> None:
        read()
        transport._removal(keys, entries)

    stages: dict[str, Callable[[], Any]] = {
        "read": read,
        "prepare": lambda: preparer.prepare(entries, set()),
        "encode": lambda: encoder.encode(batch.live, batch.items, {}),
        "read + acks": acks,
    }
    for name, stage in stages.items():
        best = min(timeit.repeat(stage, number=args.batches, repeat=5))
        print(f"{name:12} {best / args.batches / size * 1e6:6.2f} us/item")


if __name__ == "__main__":
    main()
