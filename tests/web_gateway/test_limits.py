"""The gateway's connection limits against a real gateway (gunicorn, one worker process).

Slow clients: 500 connections stalled mid-headers and mid-body (a Content-Length longer than
the body sent) are answered 408 and closed within their timeouts while normal requests keep
being answered, and the gateway's memory stays within 50 MB of its idle size. Also: the idle
keep-alive deadline, the per-process connection cap, and clients sending headers without end.
"""

from __future__ import annotations

import contextlib
import gzip
import re
import resource
import selectors
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from broker.devserver import RedisServer
from broker.keys import ModelKeys
from tests.conftest import run_python, wait_for_consumers, worker_process
from tests.e2e.test_gateway import gateway_process

DOUBLER = "tests.gateway_models:Doubler"
HEADER_TIMEOUT = 2.0
BODY_TIMEOUT = 3.0
KEEPALIVE_TIMEOUT = 1.0
# the deadlines are checked every 0.5 s (a quarter of the shortest timeout here); the rest is
# room for a loaded two-core machine
SLACK = 2.0
STALLED = 500


@pytest.fixture(autouse=True)
def enough_descriptors() -> None:
    """500 client sockets here, and as many in the gateway (which inherits this limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 4 * STALLED
    if soft != resource.RLIM_INFINITY and soft < wanted:
        new = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def worker_pid(gunicorn_pid: int) -> int:
    with open(f"/proc/{gunicorn_pid}/task/{gunicorn_pid}/children") as children:
        (pid,) = children.read().split()
    return int(pid)


@pytest.fixture(scope="module")
def limited(redis_server: RedisServer) -> Iterator[tuple[str, int]]:
    """A gateway with short limits in front of a real Doubler worker (shared by the tests
    that use it: each waits until its own connections are closed)."""
    prefix = f"l{uuid.uuid4().hex[:10]}"
    args = [
        f"--header-timeout={HEADER_TIMEOUT}",
        f"--body-timeout={BODY_TIMEOUT}",
        f"--keepalive-timeout={KEEPALIVE_TIMEOUT}",
    ]
    with (
        worker_process(redis_server.url, DOUBLER, prefix, expect_consumers=None),
        gateway_process(redis_server.url, [DOUBLER], prefix, *args) as (base, gateway),
    ):
        wait_for_consumers(redis_server.url, ModelKeys("doubler", prefix), 1)
        yield base, gateway.pid


class Stalled:
    """A connection that sends part of a request and then nothing; records how it ends."""

    def __init__(self, port: int, data: bytes) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.sendall(data)
        self.opened = time.monotonic()
        self.sock.setblocking(False)
        self.received = b""
        self.closed_after: float | None = None

    def read(self) -> None:
        try:
            chunk = self.sock.recv(65536)
        except BlockingIOError:
            return
        except ConnectionResetError:
            chunk = b""
        if chunk:
            self.received += chunk
        else:
            self.closed_after = time.monotonic() - self.opened
            self.sock.close()


def wait_until_closed(connections: list[Stalled], within: float) -> None:
    selector = selectors.DefaultSelector()
    for connection in connections:
        selector.register(connection.sock, selectors.EVENT_READ, connection)
    deadline = time.monotonic() + within
    open_ones = len(connections)
    while open_ones and time.monotonic() < deadline:
        for key, _ in selector.select(timeout=0.1):
            connection: Any = key.data
            connection.read()
            if connection.closed_after is not None:
                selector.unregister(key.fileobj)
                open_ones -= 1
    selector.close()


@pytest.mark.slow
def test_500_stalled_clients_are_cut_off_while_others_are_served(
    limited: tuple[str, int],
) -> None:
    base, gunicorn_pid = limited
    port = int(base.rsplit(":", 1)[1])
    pid = worker_pid(gunicorn_pid)
    with httpx.Client(base_url=base, timeout=10) as http:
        for _ in range(20):  # warm up, then measure the idle size
            assert http.post("/v1/models/doubler/predict", json={"inputs": [[1, 2, 3, 4]]})
    idle = rss_bytes(pid)

    answered: list[int] = []
    stop = threading.Event()

    def normal_traffic() -> None:
        with httpx.Client(base_url=base, timeout=10) as http:
            while not stop.is_set():
                response = http.post("/v1/models/doubler/predict", json={"inputs": [[1, 2, 3, 4]]})
                answered.append(response.status_code)
                assert response.json() == {"outputs": [[2.0, 4.0, 6.0, 8.0]]}
                time.sleep(0.02)

    traffic = threading.Thread(target=normal_traffic)
    traffic.start()
    try:
        mid_headers = b"POST /v1/models/doubler/predict HTTP/1.1\r\nHost: x\r\nContent-Ty"
        mid_body = (
            b"POST /v1/models/doubler/predict HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
            b'{"inputs": [[1, 2,'
        )
        stalled = [Stalled(port, mid_headers if i % 2 == 0 else mid_body) for i in range(STALLED)]
        before = len(answered)
        time.sleep(1.0)  # all 500 open and stalled
        peak = rss_bytes(pid)
        assert len(answered) > before, "normal requests stopped being answered"
        wait_until_closed(stalled, BODY_TIMEOUT + SLACK + 5)
        during = len(answered) - before
    finally:
        stop.set()
        traffic.join()

    assert answered and set(answered) == {200}
    assert during >= 10, f"only {during} normal requests answered while 500 clients stalled"
    assert peak - idle < 50 * 2**20, f"RSS grew {(peak - idle) / 2**20:.1f} MB"
    for i, connection in enumerate(stalled):
        timeout = HEADER_TIMEOUT if i % 2 == 0 else BODY_TIMEOUT
        assert connection.closed_after is not None, f"connection {i} is still open"
        assert timeout - 0.1 <= connection.closed_after <= timeout + SLACK, (
            i,
            connection.closed_after,
        )
        assert connection.received.startswith(b"HTTP/1.1 408 Request Timeout\r\n")
        what = b"headers" if i % 2 == 0 else b"body"
        assert b"RequestTimeout" in connection.received and what in connection.received
    assert rss_bytes(pid) - idle < 50 * 2**20
    with httpx.Client(base_url=base, timeout=10) as http:  # and the gateway still serves
        assert http.get("/healthz").status_code == 200


@pytest.mark.slow
def test_an_idle_keep_alive_connection_is_closed_after_its_timeout(
    limited: tuple[str, int],
) -> None:
    base, _ = limited
    port = int(base.rsplit(":", 1)[1])
    connection = Stalled(port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    wait_until_closed([connection], KEEPALIVE_TIMEOUT + SLACK + 5)
    assert connection.received.startswith(b"HTTP/1.1 200 OK\r\n")
    assert connection.closed_after is not None
    assert KEEPALIVE_TIMEOUT - 0.1 <= connection.closed_after <= KEEPALIVE_TIMEOUT + SLACK
    # a connection that never sends anything is cut off by the header timeout
    silent = Stalled(port, b"")
    wait_until_closed([silent], HEADER_TIMEOUT + SLACK + 5)
    assert silent.closed_after is not None and silent.closed_after >= HEADER_TIMEOUT - 0.1
    assert silent.received.startswith(b"HTTP/1.1 408 ")


def test_connections_over_the_cap_are_refused_at_once(
    redis_server: RedisServer, prefix: str
) -> None:
    cap = 20
    env = {"MICROBATCH_GATEWAY_RETRY_AFTER": "7"}
    with gateway_process(
        redis_server.url, [DOUBLER], prefix, f"--max-connections={cap}", env=env
    ) as (base, _):
        port = int(base.rsplit(":", 1)[1])
        held = [Stalled(port, b"") for _ in range(cap)]
        time.sleep(0.5)
        extra = Stalled(port, b"")
        wait_until_closed([extra], 5)
        assert extra.closed_after is not None and extra.closed_after < 5
        assert extra.received.startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
        assert b"retry-after: 7\r\n" in extra.received and b"TooManyConnections" in extra.received
        for connection in held[: cap // 2]:
            connection.sock.close()
        time.sleep(0.5)
        assert httpx.get(f"{base}/healthz", timeout=5).status_code == 200
        for connection in held[cap // 2 :]:
            connection.sock.close()


@contextlib.contextmanager
def descriptor_limit(soft: int) -> Iterator[None]:
    """Processes started within get a soft RLIMIT_NOFILE of ``soft`` (this process's own is
    restored on leaving: it needs its descriptors)."""
    before = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, before[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, before)


def test_a_gateway_under_a_low_descriptor_limit_still_holds_its_connection_cap(
    redis_server: RedisServer, prefix: str
) -> None:
    """A soft limit of descriptors (`ulimit -n`: 1024 under systemd and many shells) below
    --max-connections left the cap unreachable: past the descriptors, new connections were
    reset unanswered (libuv accepts and closes them) and the gateway could not open a Redis
    connection. Each gateway process raises its soft limit (within the hard one) to what its
    cap needs."""
    cap, soft = 300, 128
    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 4 * cap:
        pytest.skip("the hard descriptor limit is too low to raise the soft one")
    with contextlib.ExitStack() as stack:
        with descriptor_limit(soft):
            gateway = gateway_process(
                redis_server.url, [DOUBLER], prefix, f"--max-connections={cap}"
            )
            base, _ = stack.enter_context(gateway)
        port = int(base.rsplit(":", 1)[1])
        held = [Stalled(port, b"") for _ in range(soft + 50)]
        time.sleep(0.5)
        assert httpx.get(f"{base}/healthz", timeout=5).status_code == 200
        for connection in held:
            connection.sock.close()


def test_a_hard_descriptor_limit_below_the_cap_is_said_at_start() -> None:
    code = (
        "import logging, resource\n"
        "from web_gateway.descriptors import raise_descriptor_limit\n"
        "logging.basicConfig(format='%(levelname)s %(message)s')\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (100, 200))\n"
        "raise_descriptor_limit(1000, 2)\n"
        "print(resource.getrlimit(resource.RLIMIT_NOFILE))\n"
    )
    done = run_python(code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "(200, 200)"  # raised as far as the hard limit lets it
    assert done.stderr.startswith(
        "WARNING this gateway process may open only 200 files (ulimit -n) where "
        "--max-connections 1000 needs about 1264: "
    )


def read_until_closed(sock: socket.socket) -> bytes:
    """What the gateway sends until it closes the connection (a TimeoutError if it does not);
    a reset (closed with requests unread) ends it too."""
    received = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            received += chunk
    sock.close()
    return received


def flood_headers(port: int, line: bytes, megabytes: int) -> tuple[int, bytes]:
    """Send a request's start, then ``line`` over and over (``megabytes`` at most) until the
    gateway stops reading; (bytes sent, what came back)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(b"POST /v1/models/doubler/predict HTTP/1.1\r\nHost: x\r\n")
    sent = 0
    with contextlib.suppress(ConnectionError):  # closed by the gateway
        while sent < megabytes * 2**20:
            sock.sendall(line)
            sent += len(line)
    return sent, read_until_closed(sock)


def test_headers_without_end_get_431_and_hold_no_memory(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """uvicorn's httptools protocol keeps a request's headers however large: without a limit,
    a few clients sending them for the header timeout filled the gateway's memory."""
    prefix = f"h{uuid.uuid4().hex[:10]}"
    log = tmp_path / "gateway.log"
    with (
        worker_process(redis_server.url, DOUBLER, prefix),
        gateway_process(redis_server.url, [DOUBLER], prefix, log_path=log) as (base, gunicorn),
    ):
        port = int(base.rsplit(":", 1)[1])
        pid = worker_pid(gunicorn.pid)
        idle = rss_bytes(pid)
        many = b"X-Pad: " + b"a" * 8000 + b"\r\n"  # many headers, each of them whole
        endless = b"a" * 65536  # one header whose line never ends
        for line in (many, endless, many, endless):
            sent, received = flood_headers(port, line, megabytes=40)
            assert received.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n")
            assert b"HeadersTooLarge" in received and b"65536 bytes" in received
            assert sent < 20 * 2**20, f"the gateway read {sent} bytes of headers"
        assert rss_bytes(pid) - idle < 20 * 2**20
        response = httpx.post(
            f"{base}/v1/models/doubler/predict",
            json={"inputs": [[1, 2, 3, 4]]},
            headers={"X-Pad": "a" * 60000},  # under the limit: served
            timeout=10,
        )
        assert response.json() == {"outputs": [[2.0, 4.0, 6.0, 8.0]]}
    said = log.read_text()  # the periodic summary, not a line per connection
    assert "whose headers were too large" in said and "Invalid HTTP request" not in said


def test_a_client_pipelining_without_end_gets_its_first_answers_and_a_close(
    redis_server: RedisServer, prefix: str
) -> None:
    """uvicorn queued every request of each read and took another read at every answer: 8
    clients pipelining 4 MB of requests each, reading nothing back, grew a gateway process by
    1.8 GB. Now a connection's queue is bounded, and past it the connection is closed once
    the queued requests are answered."""
    from web_gateway.http_protocol import MAX_PIPELINED

    with gateway_process(redis_server.url, [DOUBLER], prefix) as (base, gunicorn):
        port = int(base.rsplit(":", 1)[1])
        pid = worker_pid(gunicorn.pid)
        idle = rss_bytes(pid)
        request = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
        flooders = []
        for _ in range(8):
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            with contextlib.suppress(ConnectionError):  # the gateway stopped reading, closed
                sock.sendall(request * (4 * 2**20 // len(request)))
            flooders.append(sock)
        assert rss_bytes(pid) - idle < 20 * 2**20
        for sock in flooders:
            # the request in progress and those queued behind it, in order, then the close
            assert read_until_closed(sock).count(b"HTTP/1.1 200 OK\r\n") <= MAX_PIPELINED + 1
        pipelined = request * 10  # a client pipelining within the bound is served whole
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(pipelined)
            received = b""
            while received.count(b'{"status":"ok"}') < 10:
                received += sock.recv(65536)
        assert received.count(b"HTTP/1.1 200 OK\r\n") == 10


def untaking_client(port: int) -> socket.socket:
    """A connection whose client reads nothing (and whose receive buffer is small)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.settimeout(5)
    return sock


@pytest.mark.slow
def test_clients_that_take_no_answers_are_aborted_after_the_send_timeout(
    redis_server: RedisServer, prefix: str
) -> None:
    """A client sending requests and reading no answers held its connection, and megabytes of
    kernel buffers, for ever: the app waited to send, no read deadline applied, and a
    connection closed with answers unsent waited for them to leave. 10 such clients held every
    connection of a process allowing 10, and new clients got 503. Now each is aborted once its
    answers have waited the send timeout."""
    clients, send_timeout = 10, 2.0
    args = [f"--send-timeout={send_timeout}", f"--max-connections={clients}"]
    with gateway_process(redis_server.url, [DOUBLER], prefix, *args) as (base, _):
        port = int(base.rsplit(":", 1)[1])
        request = b"GET /openapi.json HTTP/1.1\r\nHost: x\r\n\r\n"
        answer = len(httpx.get(f"{base}/openapi.json").content)
        with open("/proc/sys/net/ipv4/tcp_wmem") as wmem:
            send_buffer = int(wmem.read().split()[2])  # the most the kernel holds unsent
        answers = (send_buffer + 2**20) // answer  # more than the kernel and gateway hold
        socks = [untaking_client(port) for _ in range(clients)]
        sending = list(socks)
        for _ in range(0, answers, 8):  # paced: within the pipelining bound
            for sock in list(sending):
                try:
                    sock.sendall(request * 8)
                except ConnectionResetError:  # aborted already: its first answers waited
                    sending.remove(sock)
            time.sleep(0.05)
        time.sleep(send_timeout + SLACK)
        others = [untaking_client(port) for _ in range(clients)]  # as many as the cap
        for sock in others:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        for sock in others:  # served: the untaking clients' connections were let go
            assert read_until_closed(sock).startswith(b"HTTP/1.1 200 OK\r\n")
        for sock in socks:  # reset, their answers dropped (a connection left open would
            assert len(read_until_closed(sock)) < answers * answer  # send them all here)


@pytest.mark.slow
def test_the_request_bodies_a_process_holds_stay_within_its_budget(
    redis_server: RedisServer, prefix: str
) -> None:
    """Connections sending large bodies each held up to --max-body-bytes, all of them together
    without bound (100 connections sending 15 MB each grew a gateway process by 1.5 GB in 4 s).
    Now a process holds at most --max-held-body-bytes of them: a body arriving past it is
    answered 503 and its connection closed, and once bodies are let go requests are served."""
    budget, senders, sent = 64 * 2**20, 20, 8 * 2**20
    args = [f"--max-held-body-bytes={budget}", "--body-timeout=3"]
    with (
        worker_process(redis_server.url, DOUBLER, prefix),
        gateway_process(redis_server.url, [DOUBLER], prefix, *args) as (base, gunicorn),
    ):
        port = int(base.rsplit(":", 1)[1])
        pid = worker_pid(gunicorn.pid)
        idle = rss_bytes(pid)
        head = (
            b"POST /v1/models/doubler/predict HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % (16 * 2**20)
        )
        socks = []
        for _ in range(senders):  # each sends half its body, then nothing
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            with contextlib.suppress(ConnectionError):  # refused: closed by the gateway
                sock.sendall(head + b"1" * sent)
            socks.append(sock)
        time.sleep(0.5)
        assert rss_bytes(pid) - idle < budget + 48 * 2**20  # not senders * sent (160 MB)
        answers = [read_until_closed(sock) for sock in socks]  # 503 at once, or 408 later
        refused = [a for a in answers if a.startswith(b"HTTP/1.1 503 Service Unavailable\r\n")]
        assert len(refused) >= senders - budget // sent
        assert all(b"TooManyBodyBytes" in answer for answer in refused)
        assert all(a.startswith(b"HTTP/1.1 408 ") for a in answers if a not in refused)
        response = httpx.post(
            f"{base}/v1/models/doubler/predict", json={"inputs": [[1, 2, 3, 4]]}, timeout=10
        )
        assert response.json() == {"outputs": [[2.0, 4.0, 6.0, 8.0]]}


def test_clients_sending_garbage_or_upgrades_do_not_flood_the_log(
    redis_server: RedisServer, prefix: str, tmp_path: Path
) -> None:
    """uvicorn logged a warning line for every connection that sent what is not HTTP, and two
    for every request asking for an upgrade (as `curl --http2` does): one client could write
    thousands of lines a second. Now they are counted in the periodic summary (and at a stop)."""
    log = tmp_path / "gateway.log"
    with gateway_process(redis_server.url, [DOUBLER], prefix, log_path=log) as (base, _):
        port = int(base.rsplit(":", 1)[1])
        for _ in range(50):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                sock.sendall(b"GARBAGE\x00\r\n\r\n")
                assert read_until_closed(sock).startswith(b"HTTP/1.1 400 Bad Request\r\n")
        upgrade = b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: %s\r\n\r\n"
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            for protocol in (b"h2c", b"websocket") * 25:  # one keep-alive connection
                sock.sendall(upgrade % protocol)
                assert sock.recv(65536).startswith(b"HTTP/1.1 200 OK\r\n")
    said = log.read_text()
    assert "Invalid HTTP request" not in said and "upgrade" not in said.lower()
    # summed up: at most one line every 10 s, and what is left at the stop
    assert said.count("not valid HTTP") <= 2
    assert sum(map(int, re.findall(r"(\d+) not valid HTTP", said))) == 50


def peak_growth(pid: int, idle: int) -> int:
    """The process's peak resident memory (VmHWM, reset before ``idle`` was read) over
    ``idle``."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 - idle
    raise RuntimeError(f"no VmHWM for {pid}")


def test_json_bodies_of_empty_lists_are_refused_before_they_are_parsed(
    redis_server: RedisServer, prefix: str
) -> None:
    """A 16 MiB JSON body of empty lists ("[],": 3 bytes each, ~90 bytes each once parsed)
    raised a gateway process's peak memory by 500 MB, and 8 of them gzip-compressed to 24 KB
    each (which --max-held-body-bytes counts as 24 KB) by 1.6 GB. Now it is answered 413 by a
    count of its brackets, before orjson sees it: the process peaks within a few copies of the
    body."""
    with (
        worker_process(redis_server.url, DOUBLER, prefix),
        gateway_process(redis_server.url, [DOUBLER], prefix) as (base, gunicorn),
    ):
        pid = worker_pid(gunicorn.pid)
        flood = b'{"inputs": [[1, 2, 3, 4]], "x": [' + b"[]," * (16 * 2**20 // 3 - 20) + b"[]]}"
        tensor = b'{"name": "input", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}'
        v2_flood = b'{"inputs": [' + tensor + b'], "x": [' + b"{}," * (16 * 2**20 // 3 - 40)
        v2_flood += b"{}]}"
        compressed = gzip.compress(flood)
        with contextlib.suppress(OSError):  # reset the peak (where the kernel allows it)
            Path(f"/proc/{pid}/clear_refs").write_text("5")
        idle = rss_bytes(pid)
        for path, body, headers in (
            ("/v1/models/doubler/predict", flood, {}),
            ("/v2/models/doubler/infer", v2_flood, {}),
            ("/v1/models/doubler/predict", compressed, {"Content-Encoding": "gzip"}),
        ):
            response = httpx.post(f"{base}{path}", content=body, headers=headers, timeout=30)
            assert response.status_code == 413, (path, response.text[:200])
            assert "arrays and objects (--max-json-containers)" in response.text
        assert peak_growth(pid, idle) < 100 * 2**20, f"{peak_growth(pid, idle) / 2**20:.0f} MB"
        response = httpx.post(
            f"{base}/v1/models/doubler/predict", json={"inputs": [[1, 2, 3, 4]]}, timeout=10
        )
        assert response.json() == {"outputs": [[2.0, 4.0, 6.0, 8.0]]}


def test_compressed_bodies_are_held_at_their_decompressed_size(
    redis_server: RedisServer, prefix: str
) -> None:
    """--max-held-body-bytes counted a gzip body as the bytes that came in: 12 KB sent held
    12 MB in the process until answered, so many small compressed requests waiting for the
    workers took the process far past the budget. Now what decompressing adds is held too: a
    body that would take the process past the budget is answered 503, and the bytes are let go
    when each request is answered."""
    from tests.gateway_models import sleep_item

    budget = 32 * 2**20
    args = [f"--max-held-body-bytes={budget}"]
    with (
        worker_process(redis_server.url, DOUBLER, prefix),
        gateway_process(redis_server.url, [DOUBLER], prefix, *args) as (base, _),
    ):
        url = f"{base}/v1/models/doubler/predict"
        headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}

        def body(seconds: float) -> bytes:  # 12 MiB of JSON, 12 KB gzipped
            document = b'{"inputs": [%s], "pad": "%s"}' % (
                str(sleep_item(seconds)).encode(),
                b"a" * (12 * 2**20),
            )
            return gzip.compress(document)

        slow = body(1.5)
        answers: list[httpx.Response] = []

        def send() -> None:
            answers.append(httpx.post(url, content=slow, headers=headers, timeout=30))

        senders = [threading.Thread(target=send) for _ in range(4)]
        for sender in senders:
            sender.start()
            time.sleep(0.2)  # each arrives while the ones before wait for the worker
        for sender in senders:
            sender.join(60)
        statuses = sorted(answer.status_code for answer in answers)
        assert statuses.count(200) == 2 and statuses.count(503) == 2, statuses
        for answer in answers:
            if answer.status_code == 503:
                assert answer.json()["error"]["type"] == "TooManyBodyBytes", answer.text
                assert "counted decompressed" in answer.text
                assert answer.headers["Retry-After"]
        for _ in range(3):  # let go once answered: one at a time, each fits again
            answer = httpx.post(url, content=body(0.0), headers=headers, timeout=30)
            assert answer.status_code == 200, answer.text[:200]
