"""gpu_worker.preparing: cutting a prepared batch into model-sized batches."""

from __future__ import annotations

from broker.protocol import Request
from gpu_worker.preparing import PreparedBatch, in_chunks


def request(entry_id: str) -> Request:
    return Request(entry_id, f"r-{entry_id}", "mb:{p:m}:inbox:c", 1, 10**15, b"")


def test_a_batch_of_at_most_size_items_is_not_cut() -> None:
    batch = PreparedBatch([("1-0#0", {})], 0.0, [], [], [request("1-0#0")], ["a"])
    assert in_chunks(batch, 1) == [batch]


def test_a_bigger_batch_is_cut_in_order_and_every_entry_is_in_exactly_one_part() -> None:
    ids = [f"1-0#{i}" for i in range(5)]
    entries = [(i, {}) for i in [*ids, "2-0"]]  # 2-0: answered already (an error)
    replies = [("mb:{p:m}:inbox:c", b"error")]
    dead = [(("3-0", {}), "why")]
    batch = PreparedBatch(entries, 7.0, replies, dead, [request(i) for i in ids], list("abcde"))
    parts = in_chunks(batch, 2)
    assert [part.items for part in parts] == [["a", "b"], ["c", "d"], ["e"]]
    assert [[r.entry_id for r in part.live] for part in parts] == [ids[:2], ids[2:4], ids[4:]]
    assert sorted(e[0] for part in parts for e in part.entries) == sorted(e[0] for e in entries)
    assert parts[0].replies == replies and parts[0].dead == dead
    assert all(not part.replies and not part.dead for part in parts[1:])
    assert all(part.now_ms == 7.0 for part in parts)
