"""The functions library's checks of what any caller (a foreign client, a hostile one) sends:
malformed calls are refused with MBARGS before anything is written."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import pytest
import redis

from broker import codec, functions
from broker.devserver import RedisServer
from broker.keys import ModelKeys


@pytest.fixture
def client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis_server.client()
    functions.load(client)
    yield client


def refusal(client: redis.Redis, *command: object) -> str:
    with pytest.raises(redis.ResponseError) as refused:
        client.execute_command("FCALL", *command)
    return str(refused.value)


def test_a_version_that_is_no_whole_number_is_malformed_not_missing(client: redis.Redis) -> None:
    """`0` or `abc` was told to load the library (MBVERSION), `1.0` was taken as 1 and `02`
    as 2."""
    keys = ModelKeys("toy", "fn")
    for version in ("0", "abc", "1.0", "02", "", "x" * 1000):
        said = refusal(client, functions.RETIRE, 2, keys.stream, keys.heartbeat("w"), version,
                       "workers", "w")  # fmt: skip
        assert said.startswith("MBARGS the library version") and len(said) < 200, said
    newer = str(functions.VERSION + 1)
    said = refusal(
        client, functions.RETIRE, 2, keys.stream, keys.heartbeat("w"), newer, "workers", "w"
    )
    assert said.startswith(f"MBVERSION this Redis holds version {functions.VERSION}")


def test_too_few_keys_are_refused_before_anything_is_written(client: redis.Redis) -> None:
    """mb_withdraw with 2 keys, or mb_enqueue with 3, failed with a raw Lua error, the latter
    only once the stream outgrew one worker's share (having queued until then)."""
    keys = ModelKeys("toy", "fn")
    v = functions.VERSION
    said = refusal(
        client, functions.WITHDRAW, 2, keys.stream, keys.queued_bytes, v, "workers", "1-1"
    )
    assert said == "MBARGS mb_withdraw takes at least 3 keys, not 2"
    said = refusal(client, functions.ENQUEUE, 3, keys.stream, keys.queued_bytes, keys.queue_bound,
                   v, 0, 0, 1, 1, keys.inbox("c"), 1000, "", "c.0", codec.encode(1))  # fmt: skip
    assert said == "MBARGS mb_enqueue takes at least 4 keys, not 3"
    assert client.exists(keys.stream, keys.queued_bytes) == 0


def test_withdrawing_through_another_group_is_refused(client: redis.Redis) -> None:
    """With a group other than the workers', an entry a worker had read looked unread: it was
    deleted and its bytes released while the worker computed it."""
    keys = ModelKeys("toy", "fn")
    entry = client.xadd(keys.stream, {"v": "1", "id": "c.0", "reply": keys.inbox("c"),
                                      "timeout": "1000", "data": codec.encode(1)})  # fmt: skip
    client.xgroup_create(keys.stream, keys.group, id="0")
    client.xreadgroup(keys.group, "w", {keys.stream: ">"})
    said = refusal(client, functions.WITHDRAW, 4, keys.stream, keys.queued_bytes, keys.cancelled,
                   keys.packed_items, functions.VERSION, "nosuch", entry)  # fmt: skip
    assert said == f"MBARGS the group (after the version) must be {keys.group}"
    assert client.xlen(keys.stream) == 1
    marked = client.execute_command("FCALL", functions.WITHDRAW, 4, keys.stream, keys.queued_bytes,
                                    keys.cancelled, keys.packed_items, functions.VERSION,
                                    keys.group, entry)  # fmt: skip
    assert marked == 0 and client.zscore(keys.cancelled, entry) is not None


def test_a_v2_entry_withdrawn_whole_by_its_id_takes_its_item_marks_along(
    client: redis.Redis,
) -> None:
    keys = ModelKeys("toy", "fn2")
    fields = {"v": "2", "reply": keys.inbox("c"), "n": "2"}
    for k in range(2):
        fields |= {f"id.{k}": f"c.{k}", f"timeout.{k}": "1000", f"data.{k}": codec.encode(k)}
    entry = client.xadd(keys.stream, fields).decode()
    base = (functions.WITHDRAW, 3, keys.stream, keys.queued_bytes, keys.cancelled,
            functions.VERSION, keys.group)  # fmt: skip
    client.execute_command("FCALL", *base, f"{entry}#0")  # three keys: only marked
    assert client.zcard(keys.cancelled) == 1
    client.execute_command("FCALL", *base, entry)
    assert client.xlen(keys.stream) == 0 and client.zcard(keys.cancelled) == 0


def enqueue_command(keys: ModelKeys, *, max_items: object = 0, max_bytes: object = 0,
                    bytes_key: str | None = None, bound_key: str | None = None,
                    packed_key: str | None = None) -> tuple[object, ...]:  # fmt: skip
    """One mb_enqueue of one call of one item, with the keys and bounds given."""
    return (functions.ENQUEUE, 5, keys.stream, bytes_key or keys.queued_bytes,
            bound_key or keys.queue_bound, keys.consumers, packed_key or keys.packed_items,
            functions.VERSION, max_items, max_bytes, 1, 1, keys.inbox("c"), 1000, "", "c.0",
            codec.encode(1))  # fmt: skip


def test_an_enqueue_whose_keys_are_not_one_models_is_refused(client: redis.Redis) -> None:
    """On a Redis that is not a cluster, keys of two models were taken: the entry went to one
    model's stream and its bytes to the other's counter, where no worker ever released them."""
    toy, other = ModelKeys("toy", "fnk"), ModelKeys("other", "fnk")
    high = toy.at(1)
    cases = {
        "bytes of another model": enqueue_command(toy, bytes_key=other.queued_bytes),
        "bytes of the other level": enqueue_command(toy, bytes_key=high.queued_bytes),
        "bound of another prefix": enqueue_command(
            toy, bound_key=ModelKeys("toy", "fnkx").queue_bound
        ),
        "packed items of another model": enqueue_command(toy, packed_key=other.packed_items),
        "a counter as the stream": (
            functions.ENQUEUE,
            4,
            toy.queued_bytes,
            toy.queued_bytes,
            toy.queue_bound,
            toy.consumers,
            functions.VERSION,
            0,
            0,
            1,
            1,
            toy.inbox("c"),
            1000,
            "",
            "c.0",
            "x",
        ),
    }
    for case, command in cases.items():
        said = refusal(client, *command)
        assert said.startswith("MBARGS mb_enqueue: key "), (case, said)
    assert client.keys("*fnk*") == [], "nothing written"
    # the model's own keys, at either level, are taken
    assert client.execute_command("FCALL", *enqueue_command(toy))[0][0] == 0
    assert client.execute_command("FCALL", *enqueue_command(high))[0][0] == 0
    assert client.xlen(toy.stream) == 1 and client.xlen(high.stream) == 1
    assert not client.exists(other.queued_bytes)


def test_an_enqueue_with_malformed_bounds_is_refused(client: redis.Redis) -> None:
    """`abc` and `-1` meant no bound, `0.5` refused every call with an item bound of 0."""
    keys = ModelKeys("toy", "fnb")
    for bad in ("abc", "-1", "0.5", "1e3", "", " 5", "0x10"):
        for where in ("max_items", "max_bytes"):
            said = refusal(client, *enqueue_command(keys, **{where: bad}))
            assert said.startswith("MBARGS the caller's max items and max bytes"), (bad, said)
    assert client.keys("*fnb*") == []
    assert client.execute_command("FCALL", *enqueue_command(keys, max_items=5))[0][0] == 0


def test_a_malformed_call_in_an_enqueue_says_what_a_call_is(client: redis.Redis) -> None:
    """A foreign client that sent a call of no items (a `predict([])`), or one item's data
    short, got `MBARGS malformed mb_enqueue arguments at 5` for its whole FCALL: which
    argument 5 is, and what was wrong with it, it had to find out from the Lua."""
    keys = ModelKeys("toy", "fnc")
    head = enqueue_command(keys)[:11]  # function ... version, bounds, entry items
    inbox, data = keys.inbox("rb-1"), codec.encode(1.5)
    cases = {
        "no items": (0, inbox, 5000, ""),
        "no items, then a call": (0, inbox, 5000, "", 1, inbox, 5000, "", "rb-1.1", data),
        "an item's data missing": (1, inbox, 5000, "", "rb-1.1"),
        "a second call's data missing": (1, inbox, 5000, "", "rb-1.1", data, 1, inbox, 5000, ""),
        "a count that is no number": ("one", inbox, 5000, "", "rb-1.1", data),
    }
    for case, calls in cases.items():
        said = refusal(client, *head, *calls)
        assert said.startswith("MBARGS mb_enqueue: the call at argument "), (case, said)
        assert "a whole number of items from 1" in said, (case, said)
    second = refusal(client, *head, *cases["a second call's data missing"])
    assert second.startswith("MBARGS mb_enqueue: the call at argument 11 "), second
    assert client.keys("*fnc*") == [], "nothing written"


def test_withdraw_and_retire_take_only_one_models_keys(client: redis.Redis) -> None:
    toy, other = ModelKeys("toy", "fnw"), ModelKeys("other", "fnw")
    entry = client.xadd(toy.stream, {"v": "1", "id": "c.0", "reply": toy.inbox("c"),
                                     "timeout": "1000", "data": codec.encode(1)})  # fmt: skip
    said = refusal(client, functions.WITHDRAW, 4, toy.stream, other.queued_bytes, toy.cancelled,
                   toy.packed_items, functions.VERSION, toy.group, entry)  # fmt: skip
    assert said.startswith("MBARGS mb_withdraw: key 2 must be " + toy.queued_bytes), said
    said = refusal(client, functions.WITHDRAW, 3, toy.stream, toy.queued_bytes, other.cancelled,
                   functions.VERSION, toy.group, entry)  # fmt: skip
    assert said.startswith("MBARGS mb_withdraw: key 3 must be "), said
    assert client.xlen(toy.stream) == 1 and not client.exists(other.queued_bytes, other.cancelled)
    said = refusal(client, functions.RETIRE, 2, toy.stream, other.heartbeat("w"),
                   functions.VERSION, toy.group, "w")  # fmt: skip
    assert said.startswith("MBARGS mb_retire: key 2 must be "), said
    for bare in (toy.stream.replace(":requests", ":heartbeat:"), "x"):
        said = refusal(client, functions.RETIRE, 2, toy.stream, bare, functions.VERSION,
                       toy.group, "w")  # fmt: skip
        assert said.startswith("MBARGS mb_retire: key 2 must be "), said


def test_a_malformed_reply_call_is_refused_before_any_reply_is_pushed(client: redis.Redis) -> None:
    """A TTL of 0 deleted the replies it had just pushed (EXPIRE 0), one of `abc` failed after
    pushing them, a count malformed for key 2 failed after key 1's replies were pushed (for
    the worker to push them again), and replies past the counts were dropped unsaid."""
    keys = ModelKeys("toy", "fn")
    one, two = keys.inbox("one"), keys.inbox("two")
    v = functions.VERSION
    for ttl in ("0", "-1", "abc", "1.5", "", "9" * 10):
        said = refusal(client, functions.REPLY, 1, one, v, ttl, 1, b"r")
        assert said.startswith("MBARGS the reply TTL"), said
    for counts in (("1", "x"), ("1", "1.5"), ("1", " 1"), ("1", "-1")):
        said = refusal(client, functions.REPLY, 2, one, two, v, 60, *counts, b"r1", b"r2")
        assert said == "MBARGS malformed mb_reply arguments for key 2", said
    for pushed in ((b"r1",), (b"r1", b"r2", b"r3")):
        said = refusal(client, functions.REPLY, 2, one, two, v, 60, 1, 1, *pushed)
        assert said.startswith(f"MBARGS mb_reply was given {len(pushed)} replies"), said
    assert client.exists(one, two) == 0
    assert client.fcall(functions.REPLY, 0, v, 0) == []  # the workers' check of the library
    assert client.fcall(functions.REPLY, 2, one, two, v, 60, 1, 1, b"r1", b"r2") == []
    assert client.lrange(one, 0, -1) == [b"r1"] and 0 < client.ttl(two) <= 60


# The library's code as released, by (version, revision). A change to the Lua (or to a constant
# written into it) must raise functions.REVISION, or VERSION if the interface changed, so that
# workers replace the code already loaded in Redis; then record the new digest here.
RELEASED = {(2, 2): "b8ed1b72ce79adb74790522bb4e05f2cdaf0f65819f8d5b3e2a7fa91d1a0ced2"}


def test_a_change_to_the_library_code_comes_with_a_new_revision() -> None:
    digest = hashlib.sha256(functions.CODE.encode()).hexdigest()
    release = (functions.VERSION, functions.REVISION)
    assert RELEASED.get(release) == digest, (
        f"the library's code changed without a new revision: raise functions.REVISION "
        f"(VERSION if its interface changed) and record {digest} for it in RELEASED"
    )
    assert functions.code_release(functions.CODE) == release


def test_mb_release_answers_the_version_and_revision_to_any_caller(client: redis.Redis) -> None:
    release = [functions.VERSION, functions.REVISION]
    assert client.execute_command("FCALL", functions.RELEASE, 0) == release
    assert client.execute_command("FCALL_RO", functions.RELEASE, 0) == release
    assert functions.answered_release(release) == tuple(release)
    assert functions.answered_release([b"2", b"1"]) is None


def test_code_release_reads_libraries_without_a_revision_as_revision_0() -> None:
    assert functions.code_release("#!lua name=microbatch\nlocal VERSION = 2\n") == (2, 0)
    assert functions.code_release("#!lua name=microbatch\nlocal VERSION, REVISION = 3, 7\n") == (
        3,
        7,
    )
    assert functions.code_release("#!lua name=microbatch\n") is None
    assert functions.code_version(functions.CODE) == functions.VERSION


def test_counts_that_are_no_plain_digits_are_refused_before_anything_is_queued(
    client: redis.Redis,
) -> None:
    """Lua's tonumber took ' 2', '0x2', '2.0' and '1e1' as counts: the call was queued, and the
    worker that read its entry refused it (its `n` is digits only) and dead-lettered it."""
    keys = ModelKeys("toy", "counts")
    head = (functions.ENQUEUE, 5, keys.stream, keys.queued_bytes, keys.queue_bound,
            keys.consumers, keys.packed_items, functions.VERSION, 0, 0)  # fmt: skip
    call = (keys.inbox("c"), 1000, "", "c.0", codec.encode(1), "c.1", codec.encode(2))
    for count in (" 2", "0x2", "2.0", "1e0", "+2"):
        said = refusal(client, *head, 4, count, *call)
        assert said.startswith("MBARGS mb_enqueue: the call at argument 5 "), (count, said)
        said = refusal(client, *head, count, 2, *call)
        assert said.startswith("MBARGS items per entry must be 1 to"), (count, said)
    assert client.exists(keys.stream, keys.queued_bytes, keys.packed_items) == 0
    queued = client.execute_command("FCALL", *head, 4, 2, *call)  # the same call, well formed
    assert queued[0][0] == 0 and client.xlen(keys.stream) == 1
