"""The supervisor: spawn one child process per worker slot, watch them, restart, drain.

Each child is a fresh interpreter (``python -m gpu_worker.child``) whose environment pins it to
its device before torch can be imported. Children report ``ready`` (or why they could not
start) over a pipe, so a broken model stops ``worker start`` with its reason at once.
"""

from __future__ import annotations

import json
import logging
import math
import os
import selectors
import shutil
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

import redis

from broker import multiproc_metrics
from broker.connections import cluster_node_misuse
from broker.keys import ModelKeys
from broker.logs import redact_url
from broker.redis_url import credentials_refused
from broker.transport import counter_value

from .batch_state import STATE_FILE_ENV, BatchState
from .child import CONFIG_ENV, DEVICE_ENV, STATUS_FD_ENV, SUPERVISOR_PID_ENV
from .config import WorkerConfig
from .devices import auto_workers_per_device, child_environment, plan_devices
from .heartbeat import Heartbeats
from .oom import oom_kills, sigkill_cause
from .pipeline import load_stage
from .polling import usable_cores

log = logging.getLogger("microbatch.supervisor")

RESTART_BACKOFF_S = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
HEALTHY_AFTER_S = 60.0
HEARTBEAT_EVERY_S = 1.0
REDIS_WAIT_LOG_EVERY_S = 10.0
REDIS_WAIT_POLL_S = 0.5
# /live fails once the loop has not gone round for this long: well beyond what its Redis
# commands can take in an outage (a few seconds each, a cluster's or sentinels' retries included).
LIVE_STALL_S = 60.0


def certificate_refused(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it was raised in handling: redis-py wraps it) is a TLS
    certificate that failed verification: a wrong CA, host name or an expired certificate."""
    seen: BaseException | None = exc
    for _ in range(5):  # a short chain: redis-py's ConnectionError, then the ssl error
        if seen is None:
            break
        if isinstance(seen, ssl.SSLCertVerificationError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def exit_reason(code: int, oom_kills: tuple[int | None, int | None] = (None, None)) -> str:
    """How a child ended, from its return code (a negative one is the signal that killed it)
    and its memory cgroup's OOM kill counts at its start and at its end."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    if -code == signal.SIGKILL:  # nobody here sends it but the watchdog, which says so itself
        return f"killed by {name} ({sigkill_cause(*oom_kills)})"
    return f"killed by {name}"


class StartError(RuntimeError):
    """Workers could not be started; the message says why."""


class RedisUnreachable(StartError):
    """Redis did not answer within --redis-wait at start-up, refused our credentials, or
    refused a command to the worker's ACL user."""


@dataclass
class Slot:
    """One worker position: its device and the process currently filling it."""

    index: int
    cuda_visible: str | None
    process: subprocess.Popen[bytes] | None = None
    status_fd: int | None = None
    buffer: bytes = b""
    ready: bool = False
    started_at: float = 0.0
    failures: int = 0
    restart_at: float | None = None
    last_error: str = ""
    refused: str = ""  # Redis' NOPERM to the worker's user, as the child reported it
    oom_kills_at_start: int | None = None  # the memory cgroup's OOM kills when it started
    due: str = ""  # why the child is due for replacement (--max-batches, --max-rss-mib), as it said
    replaced: str = ""  # why the child was told to stop to be replaced
    refilling: bool = False  # the fresh process of a replacement, not yet ready
    restarts: int = 0
    consumer: str | None = None
    device_bytes: int | None = None  # what its model holds on its device, as it reported
    auto_extra: bool = False  # started by --workers-per-device auto after the device's first
    busy_since: float | None = None
    batch_items: int = 0
    state: BatchState | None = None

    @property
    def device(self) -> str:
        return "cpu" if self.cuda_visible is None else "cuda:0"


class Supervisor:
    """Own the worker children of one `worker start`."""

    def __init__(self, config: WorkerConfig) -> None:
        config.validate()
        self.config = config
        # light: fails fast on a bad path (a pipeline's stage: the stage's model)
        self.model_class = load_stage(config.model, config.stage)
        if config.cuda:
            # auto (None) starts one per device: the rest once the first has loaded the model
            # and told what it holds there (_size_devices)
            per_device = config.workers_per_device or 1
            devices: list[str | None] = list(plan_devices(config.cuda, per_device))
        else:
            devices = [None] * config.workers
        self.slots = [Slot(index, device) for index, device in enumerate(devices)]
        # --workers-per-device auto: the devices whose first worker has yet to report its model's
        # size, after which the rest of that device's workers are started
        self._sizing: set[str | None] = set()
        if config.cuda and config.workers_per_device is None:
            self._sizing = set(devices)
        self.keys = config.keys(self.model_class)
        self.queue_bound = config.queue_bound(config.batch_settings(self.model_class).batch_size)
        self.heartbeats = Heartbeats(
            config.redis_url, self.keys, config.heartbeat_ttl, self.queue_bound, self._went_round
        )
        self._next_heartbeat = 0.0
        # Renew well within the TTL: a renewal can come up to one select timeout late.
        self._heartbeat_every = min(HEARTBEAT_EVERY_S, config.heartbeat_ttl / 3)
        self.selector = selectors.DefaultSelector()
        self._stopping = False
        self._ticked = time.monotonic()  # when the supervisor's loop last went round
        self.metrics: SupervisorMetrics | None = None
        if config.metrics_port is not None:
            self.metrics = SupervisorMetrics(
                config.metrics_port,
                self.keys,
                self.heartbeats,
                self.ready,
                self.alive,
                host=config.metrics_host,
            )
        self.all_ready_once = False

    def ready(self) -> bool:
        """Whether a worker process has loaded the model and serves it, and no stop was asked
        (``/ready`` on the metrics port; read from its thread)."""
        return not self._stopping and any(slot.ready for slot in list(self.slots))

    def alive(self) -> bool:
        """Whether the supervisor's loop went round within ``LIVE_STALL_S`` (``/live`` on the
        metrics port; read from its thread). A Redis outage does not stall it (every Redis
        command it sends times out within seconds, and each partition a renewal tries alone
        counts as going round); a stop in progress counts as alive."""
        return self._stopping or time.monotonic() - self._ticked < LIVE_STALL_S

    def _went_round(self) -> None:
        """Note that the loop makes progress (at each turn, and within a long renewal)."""
        self._ticked = time.monotonic()

    # -- children -----------------------------------------------------------------------------
    def _spawn(self, slot: Slot) -> None:
        read_fd, write_fd = os.pipe()
        env = child_environment(slot.cuda_visible)
        env[CONFIG_ENV] = self.config.to_json()
        env[STATUS_FD_ENV] = str(write_fd)
        if slot.state is None:
            slot.state = BatchState.create()
        slot.state.idle()
        env[STATE_FILE_ENV] = slot.state.path
        env[DEVICE_ENV] = slot.device
        env[SUPERVISOR_PID_ENV] = str(os.getpid())
        slot.process = subprocess.Popen(
            [sys.executable, "-m", "gpu_worker.child"], env=env, pass_fds=(write_fd,)
        )
        os.close(write_fd)
        os.set_blocking(read_fd, False)
        slot.status_fd, slot.buffer, slot.ready = read_fd, b"", False
        slot.started_at, slot.restart_at = time.monotonic(), None
        slot.oom_kills_at_start = oom_kills()
        self.selector.register(read_fd, selectors.EVENT_READ, slot)
        log.info(
            "started worker %d (pid %d) on %s%s", slot.index, slot.process.pid, slot.device,
            f" (CUDA_VISIBLE_DEVICES={slot.cuda_visible})" if slot.cuda_visible else "",
        )  # fmt: skip

    def _read_status(self, slot: Slot) -> None:
        assert slot.status_fd is not None
        try:
            chunk = os.read(slot.status_fd, 65536)
        except BlockingIOError:
            return
        if not chunk:
            self._close_status(slot)
            return
        slot.buffer += chunk
        while b"\n" in slot.buffer:
            line, slot.buffer = slot.buffer.split(b"\n", 1)
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if message.get("event") == "ready":
                slot.ready, slot.refilling = True, False
                slot.consumer = str(message.get("consumer"))
                size = message.get("device_bytes")
                slot.device_bytes = size if isinstance(size, int) else None
                self._next_heartbeat = 0.0  # vouch for it at once
                log.info(
                    "worker %d ready (pid %s) on %s",
                    slot.index, message.get("pid"), message.get("device", slot.device),
                )  # fmt: skip
            elif message.get("event") == "error":
                slot.last_error = str(message.get("message", "unknown error"))
            elif message.get("event") == "refused":
                slot.refused = str(message.get("message", "NOPERM"))
            elif message.get("event") == "replace":
                slot.due = str(message.get("reason", "due"))

    def _close_status(self, slot: Slot) -> None:
        if slot.status_fd is not None:
            self.selector.unregister(slot.status_fd)
            os.close(slot.status_fd)
            slot.status_fd = None

    def _reap(self, slot: Slot, now: float) -> None:
        """Handle a child that exited: restart it with backoff, or give up."""
        assert slot.process is not None
        code = slot.process.returncode
        was_ready = slot.ready
        self._forget(slot)
        if self._stopping:
            return
        if slot.refused:  # every worker logs in as the same user: none would get further
            refused, slot.refused = slot.refused, ""
            raise RedisUnreachable(
                f"{refused} (give the user what `broker acl` grants <prefix>-worker: "
                "docs/deployment.md, ACL users)"
            )
        if self._replaced(slot, code, now):
            return
        reason = slot.last_error or exit_reason(code, (slot.oom_kills_at_start, oom_kills()))
        if not self.all_ready_once:
            if slot.auto_extra:  # one the user did not ask for: serve without it
                self._drop_extra(slot, reason)
                return
            raise StartError(f"worker {slot.index} could not start: {reason}")
        self._restart_later(slot, reason, was_ready, now)

    def _restart_later(self, slot: Slot, reason: str, was_ready: bool, now: float) -> None:
        """Restart a child that died, after a backoff; give up on one that keeps failing to
        start."""
        healthy = was_ready and now - slot.started_at > HEALTHY_AFTER_S
        if healthy:
            slot.failures = 0
        if not was_ready:
            slot.failures += 1
            if slot.failures >= self.config.max_start_failures:
                raise StartError(
                    f"worker {slot.index} failed to start {slot.failures} times: {reason}"
                )
        if healthy:  # the backoff starts anew: a crash soon after this one waits 1 s, not 30
            slot.restarts = 0
        delay = RESTART_BACKOFF_S[min(slot.restarts, len(RESTART_BACKOFF_S) - 1)]
        slot.restarts += 1
        slot.restart_at = now + delay
        if self.metrics is not None:
            self.metrics.restarted()
        slot.last_error = ""
        log.warning("worker %d %s; restarting in %.1f s", slot.index, reason, delay)

    def _replace_due(self) -> None:
        """Stop a child due for replacement (as SIGTERM does), one slot at a time: under an
        even load the workers of one `worker start` come due together, and replacing them all
        at once left the host serving nothing until a fresh process had loaded the model."""
        if self._stopping or any(slot.replaced or slot.refilling for slot in self.slots):
            return
        for slot in self.slots:
            if slot.due and slot.process is not None and slot.process.poll() is None:
                slot.replaced, slot.due = slot.due, ""
                slot.process.send_signal(signal.SIGTERM)
                return

    def _replaced(self, slot: Slot, code: int, now: float) -> bool:
        """Start a fresh child at once where this one stopped itself to be replaced and
        finished its batches (exit status 0): no crash, no backoff."""
        replaced, slot.replaced = slot.replaced, ""
        if not replaced or code != 0 or slot.last_error:
            return False
        slot.restart_at, slot.refilling = now, True
        log.info("worker %d stopped to be replaced: %s; starting a fresh one", slot.index,
                 replaced)  # fmt: skip
        return True

    def _forget(self, slot: Slot) -> None:
        """Let go of an exited child: its last words, its metrics, its heartbeat."""
        assert slot.process is not None
        if slot.status_fd is not None:
            self._read_status(slot)
            self._close_status(slot)
        if self.metrics is not None:
            self.metrics.process_gone(slot.process.pid)
        slot.process = None
        slot.ready, slot.busy_since, slot.due, slot.refilling = False, None, "", False
        if slot.consumer is not None:
            self.heartbeats.retire(slot.consumer)
            slot.consumer = None

    # -- lifecycle ----------------------------------------------------------------------------
    def request_stop(self, signum: int = signal.SIGTERM, frame: FrameType | None = None) -> None:
        """Begin a graceful stop: children finish their batch, answer it and exit."""
        if not self._stopping:
            running = sum(s.process is not None and s.process.poll() is None for s in self.slots)
            if running:
                log.info("stopping %d worker(s) (%s)", running, signal.Signals(signum).name)
            else:  # still waiting for Redis: nothing started
                log.info("stopping before any worker started")
        self._stopping = True
        for slot in self.slots:
            if slot.process is not None and slot.process.poll() is None:
                slot.process.send_signal(signal.SIGTERM)

    def run(self) -> int:
        """Serve until SIGTERM/SIGINT; return the exit code. Raises StartError if workers can't.

        The signal handlers it installs are put back as they were when it returns.
        """
        # SIGHUP too (a closed terminal, a `systemctl reload`): there is nothing to reload,
        # and its default action killed this process alone, leaving the workers behind.
        stopping = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
        previous = {signum: signal.signal(signum, self.request_stop) for signum in stopping}
        try:
            return self._serve()
        finally:
            for signum, handler in previous.items():
                if handler is not None:  # None: installed outside Python, cannot be put back
                    signal.signal(signum, handler)

    def _serve(self) -> int:
        try:
            if not self._wait_for_redis():
                return self._drain()
            for slot in self.slots:
                self._spawn(slot)
            while not self._stopping:
                self._step()
            return self._drain()
        except BaseException:
            self._stopping = True
            self.request_stop()
            self._drain(grace=5.0)
            raise

    def _wait_for_redis(self) -> bool:
        """Return once Redis answers PING (True), or when asked to stop first (False).

        Says that it waits, once every 10 s; raises RedisUnreachable after --redis-wait
        seconds, or at once if Redis refuses the credentials or its TLS certificate fails
        verification (waiting will not help).
        """
        where = redact_url(self.config.redis_url)
        started = time.monotonic()
        next_log = started
        waited_before = False
        while not self._stopping:
            self._ticked = time.monotonic()
            try:
                self.heartbeats.client.ping()
            except (redis.AuthenticationError, redis.exceptions.AuthorizationError) as exc:
                refused = credentials_refused(self.config.redis_url, exc)
                raise RedisUnreachable(f"Redis at {where} {refused}") from None
            except (redis.RedisError, OSError) as exc:
                if certificate_refused(exc):
                    raise RedisUnreachable(
                        f"Redis at {where} presented a TLS certificate that failed "
                        f"verification (check ssl_ca_certs and the host name): {exc}"
                    ) from None
                now = time.monotonic()
                if now - started >= self.config.redis_wait:
                    raise RedisUnreachable(
                        f"Redis at {where} did not answer within {self.config.redis_wait:g} s "
                        f"(--redis-wait): {exc}"
                    ) from None
                if now >= next_log:
                    left = self.config.redis_wait - (now - started)
                    log.warning(
                        "waiting for Redis at %s (%s); giving up in %.0f s (--redis-wait)",
                        where, exc, left,
                    )  # fmt: skip
                    next_log = now + REDIS_WAIT_LOG_EVERY_S
                    waited_before = True
                time.sleep(min(REDIS_WAIT_POLL_S, max(0.0, started + self.config.redis_wait - now)))
                continue
            if waited_before:
                log.info("Redis at %s answers", where)
            self._check_not_a_cluster_node()
            self.heartbeats.warn_if_partitions_lowered()
            return True
        return False

    def _check_not_a_cluster_node(self) -> None:
        """Raise RedisUnreachable where a plain URL names a Redis Cluster node: its workers
        would die at their first MOVED reply and be restarted without end."""
        error = cluster_node_misuse(self.heartbeats.client, self.config.redis_url)
        if error:
            raise RedisUnreachable(error)

    def _step(self) -> None:
        self._ticked = time.monotonic()
        for key, _ in self.selector.select(timeout=min(0.2, self._heartbeat_every)):
            self._read_status(key.data)
        now = time.monotonic()
        self._tend_children(now)
        self._replace_due()
        if self._sizing:
            self._size_devices()
        self._watchdog(now)
        if self.metrics is not None:
            self.metrics.maybe_sample(now)
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + self._heartbeat_every
            self.heartbeats.renew(
                {
                    slot.consumer: self._state(slot, now)
                    for slot in self.slots
                    if slot.ready and slot.consumer is not None and not self._overran(slot, now)
                }
            )
        if not self.all_ready_once:
            self._check_started(now)
        else:
            self._stop_late(self._late(now))

    def _tend_children(self, now: float) -> None:
        """Reap the children that exited, restart those due, and read the others' batches."""
        for slot in self.slots:
            if slot.process is not None and slot.process.poll() is not None:
                self._reap(slot, now)
            elif slot.process is None and slot.restart_at is not None and now >= slot.restart_at:
                self._spawn(slot)
        for slot in self.slots:
            if slot.state is not None and slot.process is not None:
                slot.batch_items, slot.busy_since = slot.state.read()

    def _size_devices(self) -> None:
        """`--workers-per-device auto`: once a device's first worker is ready, start as many
        more on that device as its model's size and the host's cores call for."""
        if self._stopping:  # a SIGTERM came as the first was ready: no new worker to leave behind
            return
        cores, devices = usable_cores(), len(self.config.cuda or ())
        for slot in list(self.slots):
            if slot.cuda_visible not in self._sizing or not slot.ready:
                continue
            self._sizing.discard(slot.cuda_visible)
            count = auto_workers_per_device(slot.device_bytes, devices, cores)
            held = "an unknown size" if slot.device_bytes is None else _mib(slot.device_bytes)
            log.info(
                "--workers-per-device auto: the model holds %s on device %s and %g core(s) "
                "serve %d device(s): %d worker(s) on it",
                held, slot.cuda_visible, cores, devices, count,
            )  # fmt: skip
            for _ in range(count - 1):
                extra = Slot(len(self.slots), slot.cuda_visible, auto_extra=True)
                self.slots.append(extra)
                self._spawn(extra)

    def _drop_extra(self, slot: Slot, reason: str) -> None:
        """An extra worker of `--workers-per-device auto` could not start (a second copy of
        the model that does not fit, say): its device runs with the workers it has."""
        self.slots.remove(slot)
        if slot.state is not None:
            slot.state.close(unlink=True)
        left = sum(other.cuda_visible == slot.cuda_visible for other in self.slots)
        log.warning(
            "worker %d, an extra worker of --workers-per-device auto, could not start: %s; "
            "device %s runs %d worker(s) (--workers-per-device N fixes the number)",
            slot.index, reason, slot.cuda_visible, left,
        )  # fmt: skip

    def _check_started(self, now: float) -> None:
        """Say when all workers are ready for the first time; give up on one that has not
        loaded within --start-timeout of its start (the extra workers of
        `--workers-per-device auto` start once the first has loaded)."""
        if not self._sizing and all(slot.ready for slot in self.slots):
            self.all_ready_once = True
            items, size = self.queue_bound
            log.info(
                "all %d worker(s) ready; queue bound of %s: %s per live worker, %s",
                len(self.slots), self.keys.model,
                f"{items} items" if items else "no item bound",
                f"{size} bytes in all" if size else "no byte bound",
            )  # fmt: skip
            return
        late = self._late(now)
        if any(not slot.auto_extra for slot in late):
            raise StartError(
                f"workers not ready within {self.config.start_timeout:g} s (--start-timeout)"
            )
        self._stop_late(late)  # auto's own extras: stopped, then left out as they exit

    def _late(self, now: float) -> list[Slot]:
        """The slots whose process has not loaded the model within --start-timeout."""
        return [
            slot
            for slot in self.slots
            if slot.process is not None
            and not slot.ready
            and now - slot.started_at > self.config.start_timeout
        ]

    def _stop_late(self, late: list[Slot]) -> None:
        """Kill the processes of these late slots: a restarted (or replacement) process stuck
        loading the model is then restarted as one that failed to start, instead of holding
        its slot for good."""
        for slot in late:
            if slot.process is not None and not slot.last_error:
                slot.last_error = f"not ready within {self.config.start_timeout:g} s"
                slot.process.kill()

    @staticmethod
    def _state(slot: Slot, now: float) -> dict[str, int]:
        """What `broker status` shows of a worker: its current batch, if it is computing one."""
        if slot.busy_since is None:
            return {}
        return {"batch": slot.batch_items, "batch_ms": int((now - slot.busy_since) * 1000)}

    def _overran(self, slot: Slot, now: float) -> bool:
        return slot.busy_since is not None and now - slot.busy_since > self.config.batch_timeout

    def _watchdog(self, now: float) -> None:
        """Kill a child whose batch has run past --batch-timeout; it is restarted and its
        entries are taken over by live workers (or dead-lettered after --max-deliveries)."""
        for slot in self.slots:
            process = slot.process
            if process is not None and process.poll() is None and self._overran(slot, now):
                log.error(
                    "worker %d (pid %d) has been in one batch for over %g s (--batch-timeout); "
                    "killing it",
                    slot.index, process.pid, self.config.batch_timeout,
                )  # fmt: skip
                slot.last_error = "killed by the watchdog: batch ran past --batch-timeout"
                process.kill()
                slot.busy_since = None
                if slot.state is not None:
                    slot.state.idle()

    def _drain(self, grace: float | None = None) -> int:
        deadline = time.monotonic() + (self.config.graceful_timeout if grace is None else grace)
        code = 0
        for slot in self.slots:
            process = slot.process
            if process is None:
                continue
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.error("worker %d did not stop in time; killing it", slot.index)
                process.kill()
                process.wait()
                code = 1
            if process.returncode not in (0, -signal.SIGTERM, -signal.SIGINT):
                code = code or 1
            self._close_status(slot)
            if slot.consumer is not None:
                self.heartbeats.retire(slot.consumer)
            if slot.state is not None:
                slot.state.close(unlink=True)
        self.heartbeats.close()
        if self.metrics is not None:
            self.metrics.close()
        return code


def _mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"


class SupervisorMetrics:
    """Serves the metrics of every process of this `worker start` on one port, and samples
    the queue's depth for them."""

    SAMPLE_EVERY_S = 2.0

    def __init__(
        self,
        port: int,
        keys: ModelKeys,
        heartbeats: Heartbeats,
        ready: Callable[[], bool] | None = None,
        alive: Callable[[], bool] | None = None,
        host: str = "0.0.0.0",
    ) -> None:
        self.directory = multiproc_metrics.fresh_directory("microbatch-metrics-")
        from . import metrics
        from .metrics_server import start_metrics_server

        self._metrics = metrics
        try:
            self.server, self.thread = start_metrics_server(
                port, multiproc_metrics.registry(), host=host, ready=ready, alive=alive
            )
        except OSError as exc:  # the port is taken, say: a bad option, not a traceback
            shutil.rmtree(self.directory, ignore_errors=True)
            where = "" if host == "0.0.0.0" else f" on --metrics-host {host}"
            raise ValueError(f"--metrics-port {port}{where}: {exc.strerror or exc}") from None
        self.keys = keys
        self.client = heartbeats.client
        self._next_sample = 0.0
        metrics.RESTARTS.labels(keys.model)  # exported as 0 from the start
        shown = f"[{host}]" if ":" in host else host  # an IPv6 address, as a URL holds it
        log.info("metrics on http://%s:%d/metrics", shown, port)

    def restarted(self) -> None:
        self._metrics.RESTARTS.labels(self.keys.model).inc()

    def process_gone(self, pid: int) -> None:
        multiproc_metrics.process_gone(pid)

    def maybe_sample(self, now: float) -> None:
        if now < self._next_sample:
            return
        self._next_sample = now + self.SAMPLE_EVERY_S
        from broker.liveness import live_consumers

        labels = (self.keys.model, self.keys.prefix)
        try:
            depth = pending = items = 0
            for part in self.keys.lanes():  # the model's queue: every partition and level
                length = self.client.xlen(part.stream)
                depth += length
                items += length + counter_value(self.client.get(part.packed_items))
                try:
                    summary: Any = self.client.xpending(part.stream, part.group)
                except redis.ResponseError:
                    summary = {"pending": 0}
                pending += int(summary["pending"])
            live = len(live_consumers(self.client, self.keys))
        except redis.RedisError as exc:
            log.debug("cannot sample the queue: %s", exc)
            # unknown while Redis is away, not the values last seen (a queue still "empty",
            # workers still "live", through an outage)
            self._set_gauges(labels, math.nan, math.nan, math.nan, math.nan, up=False)
            return
        self._set_gauges(labels, depth, items, pending, live, up=True)

    def _set_gauges(
        self,
        labels: tuple[str, str],
        depth: float,
        items: float,
        pending: float,
        live: float,
        up: bool,
    ) -> None:
        self._metrics.QUEUE_DEPTH.labels(*labels).set(depth)
        self._metrics.QUEUE_ITEMS.labels(*labels).set(items)
        self._metrics.QUEUE_PENDING.labels(*labels).set(pending)
        self._metrics.LIVE_WORKERS.labels(*labels).set(live)
        self._metrics.REDIS_UP.labels(*labels).set(1 if up else 0)

    def close(self) -> None:
        self.server.shutdown()
        shutil.rmtree(self.directory, ignore_errors=True)
