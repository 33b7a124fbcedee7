"""The worker's settings, stated once.

:class:`WorkerConfig` is everything one `worker start` is told: its CLI builds it once and it is
handed down whole (to the supervisor, and to each child as JSON). :class:`BatchSettings` is the
batch loop's share, resolved against the model in one place (:meth:`BatchSettings.for_model`),
which LocalStreamer uses too. A setting has one name and one unit throughout: seconds for
every duration (``--busy-poll-us`` is converted once, as the CLI reads it).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

from broker.client import DEFAULT_REDIS_URL, MAX_TIMEOUT_S
from broker.keys import DEFAULT_PREFIX, MAX_PARTITIONS, ModelKeys, check_name, check_prefix
from broker.logs import redact_url
from broker.redis_url import parse as parse_redis_url

if TYPE_CHECKING:
    from .model import ManagedModel

# Every `worker start` option also reads MICROBATCH_WORKER_<OPTION> (REDIS_URL for --redis).
ENV_PREFIX = "MICROBATCH_WORKER"
DEFAULT_REDIS_WAIT_S = 60.0
MAX_BUSY_POLL_US = 100_000  # past a tenth of a second, spinning buys nothing a sleep would not
MODEL_THREAD_MODES = ("auto", "on", "off")

# The queue bound `worker start` stores with the model unless told otherwise ("auto"): this
# many full batches per live worker (a burst of four batches per worker fits twice over, and an
# item waits at most about this many batch times), and this many data bytes in all.
AUTO_QUEUE_BATCHES = 8
AUTO_QUEUE_BYTES = 256 * 1024 * 1024


@dataclass
class BatchSettings:
    """How a worker forms batches and answers."""

    batch_size: int = 32
    max_latency: float = 0.0  # seconds an item may wait for batch-mates
    block_ms: int = 500
    reply_ttl_s: int = 60
    clock_sync_s: float = 30.0
    max_deliveries: int = 3
    reclaim_every_s: float = 1.0
    reclaim_min_idle_ms: int = 200
    model_thread: str = "auto"  # "on", "off", or "auto": on for batches of 10 ms or more
    # how long a read with nothing in hand polls before it sleeps; None: decided as it goes
    # (gpu_worker.polling: only while arrivals are dense and a core is spare)
    busy_poll_s: float | None = 0.0
    max_batch_cost: int = 0  # the most a batch's items may cost together (0: count items only)

    @classmethod
    def for_model(
        cls,
        model: type[ManagedModel] | ManagedModel,
        batch_size: int | None = None,
        max_latency: float | None = None,
        max_batch_cost: int | None = None,
        **settings: Any,
    ) -> BatchSettings:
        """The settings to serve ``model`` with: each of ``batch_size``, ``max_latency`` and
        ``max_batch_cost`` given wins over the model class's attribute of that name (the one
        place where a model's defaults are resolved)."""
        budget = model.max_batch_cost if max_batch_cost is None else max_batch_cost
        return cls(
            batch_size=model.batch_size if batch_size is None else batch_size,
            max_latency=model.max_latency if max_latency is None else max_latency,
            max_batch_cost=budget or 0,
            **settings,
        )


@dataclass
class WorkerConfig:
    """The settings of one `worker start`: one field per CLI option, of the same name and in
    the same unit (``--redis`` is ``redis_url``; ``--busy-poll-us`` is ``busy_poll_s``).
    ``None`` for ``batch_size``, ``max_latency`` or ``max_batch_cost``: the model's."""

    model: str
    name: str | None = None
    stage: str | None = None  # of the Pipeline ``model``
    cuda: list[int] | None = None
    workers_per_device: int | None = None  # None: auto
    workers: int = 1
    prefix: str = DEFAULT_PREFIX
    redis_url: str = DEFAULT_REDIS_URL
    redis_wait: float = DEFAULT_REDIS_WAIT_S
    batch_size: int | None = None
    max_latency: float | None = None
    max_batch_cost: int | None = None
    metrics_port: int | None = None
    metrics_host: str = "0.0.0.0"  # the address the metrics port listens on (every interface)
    start_timeout: float = 600.0
    graceful_timeout: float = 30.0
    max_start_failures: int = 3
    batch_timeout: float = 300.0
    heartbeat_ttl: float = 5.0
    max_deliveries: int = 3
    model_thread: str = "auto"
    busy_poll_s: float | None = None  # None: auto
    max_queue_items: int | None = None  # per live worker; None: auto; 0: no item bound
    max_queue_bytes: int | None = None  # in all; None: auto; 0: no byte bound
    partitions: int = 1  # streams the model's queue is spread over
    max_batches: int = 0  # a worker process is replaced after this many batches (0: never)
    max_rss_mib: int = 0  # ... or once its resident memory is over this (0: never)
    app_dir: str = "."  # imported from first (on sys.path, and on the children's PYTHONPATH)
    log_level: str = "info"
    log_format: str = "text"

    @classmethod
    def from_options(
        cls,
        *,
        redis: str,
        cuda: str | None,
        workers_per_device: str,
        busy_poll_us: str,
        max_queue_items: str,
        max_queue_bytes: str,
        **options: Any,
    ) -> WorkerConfig:
        """From `worker start`'s options as the user gives them (ValueError if one is bad);
        the options not named here are fields of the same name."""
        from .devices import parse_cuda

        return cls(
            redis_url=redis,
            cuda=parse_cuda(cuda) if cuda else None,
            workers_per_device=_auto_or_count(
                "--workers-per-device", workers_per_device, 1, "auto or at least 1"
            ),
            busy_poll_s=_busy_poll_s(busy_poll_us),
            max_queue_items=_auto_or_count("--max-queue-items", max_queue_items),
            max_queue_bytes=_auto_or_count("--max-queue-bytes", max_queue_bytes),
            **options,
        )

    def validate(self) -> None:
        """Raise ValueError with a one-line reason for any bad setting."""
        if self.name is not None:
            check_name(self.name)
        check_prefix(self.prefix)
        if self.stage is not None:
            self._check_stage()
        try:
            parse_redis_url(self.redis_url)
        except ValueError as exc:
            raise ValueError(f"--redis: {exc}") from None
        for bad, reason in self._checks():
            if bad:
                raise ValueError(reason)

    def _check_stage(self) -> None:
        """What a pipeline's stage worker cannot be started with (docs/pipelines.md)."""
        if self.name is not None:
            raise ValueError("--name cannot rename a pipeline's stage: name the Pipeline class")
        if self.partitions != 1:
            raise ValueError("--partitions: a pipeline's stages are not partitioned")

    def _checks(self) -> list[tuple[bool, str]]:
        def below(value: float | None, least: float) -> bool:
            return value is not None and value < least

        queue_bound = "must be auto, 0 (no bound) or a positive number"
        return [
            (self.workers < 1, "--workers must be at least 1"),
            (below(self.workers_per_device, 1), "--workers-per-device must be auto or at least 1"),
            (below(self.batch_size, 1), "--batch-size must be at least 1"),
            (below(self.max_batch_cost, 0), "--max-batch-cost cannot be negative"),
            *self._duration_checks(),
            (
                self.metrics_port is not None and not 1 <= self.metrics_port <= 65535,
                "--metrics-port must be between 1 and 65535",
            ),
            (not self.metrics_host.strip(), "--metrics-host cannot be empty"),
            (self.max_deliveries < 1, "--max-deliveries must be at least 1"),
            (self.max_batches < 0, "--max-batches must be 0 (never) or a positive number"),
            (self.max_rss_mib < 0, "--max-rss-mib must be 0 (never) or a positive number"),
            (
                self.model_thread not in MODEL_THREAD_MODES,
                f"--model-thread must be one of {', '.join(MODEL_THREAD_MODES)}",
            ),
            (
                self.busy_poll_s is not None
                and not 0 <= self.busy_poll_s <= MAX_BUSY_POLL_US / 1e6,
                f"--busy-poll-us must be auto or between 0 and {MAX_BUSY_POLL_US}",
            ),
            (below(self.max_queue_items, 0), f"--max-queue-items {queue_bound}"),
            (below(self.max_queue_bytes, 0), f"--max-queue-bytes {queue_bound}"),
            (
                not 1 <= self.partitions <= MAX_PARTITIONS,
                f"--partitions must be between 1 and {MAX_PARTITIONS}",
            ),
        ]

    def _duration_checks(self) -> list[tuple[bool, str]]:
        """Every duration is a finite number of seconds, at most a year: NaN or inf would
        silently turn a deadline or a watchdog off."""
        durations = [  # (option, seconds, whether 0 is allowed)
            ("--redis-wait", self.redis_wait, True),
            ("--start-timeout", self.start_timeout, False),
            ("--graceful-timeout", self.graceful_timeout, True),
            ("--batch-timeout", self.batch_timeout, False),
            ("--heartbeat-ttl", self.heartbeat_ttl, False),
        ]
        if self.max_latency is not None:
            durations.append(("--max-latency", self.max_latency, True))
        checks = []
        for option, seconds, zero in durations:
            least = "0 or more" if zero else "more than 0"
            fits = math.isfinite(seconds) and (seconds >= 0 if zero else seconds > 0)
            checks.append(
                (
                    not fits or seconds > MAX_TIMEOUT_S,
                    f"{option} must be {least} seconds and at most {MAX_TIMEOUT_S:.0f} "
                    f"(a year), not {seconds!r}",
                )
            )
        return checks

    def keys(self, model: type[ManagedModel] | ManagedModel) -> ModelKeys:
        """The keys of the model served: named ``name``, or by the model class (a pipeline's
        stage: the stage's, docs/pipelines.md)."""
        if self.stage is not None:
            from .pipeline import load_pipeline

            return load_pipeline(self.model).keys(self.stage, self.prefix)
        return ModelKeys(self.name or model.name, self.prefix, partitions=self.partitions)

    def batch_settings(self, model: type[ManagedModel] | ManagedModel) -> BatchSettings:
        """The batch loop's settings for ``model`` (its defaults where none was given)."""
        return BatchSettings.for_model(
            model,
            self.batch_size,
            self.max_latency,
            self.max_batch_cost,
            max_deliveries=self.max_deliveries,
            model_thread=self.model_thread,
            busy_poll_s=self.busy_poll_s,
        )

    def queue_bound(self, batch_size: int) -> tuple[int, int]:
        """The queue bound to store with the model: (items per live worker, bytes in all)."""
        items = self.max_queue_items
        if items is None:
            items = AUTO_QUEUE_BATCHES * batch_size
        size = AUTO_QUEUE_BYTES if self.max_queue_bytes is None else self.max_queue_bytes
        return items, size

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    def __repr__(self) -> str:  # never the Redis URL's passwords (as Streamer's repr)
        shown = {field.name: getattr(self, field.name) for field in fields(self)}
        shown["redis_url"] = redact_url(self.redis_url)
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in shown.items())})"

    @classmethod
    def from_json(cls, text: str) -> WorkerConfig:
        return cls(**json.loads(text))


def _busy_poll_s(value: str) -> float | None:
    """``--busy-poll-us`` in seconds; None for auto (ValueError saying what is wrong)."""
    if value.strip().lower() == "auto":
        return None
    try:
        return int(value) / 1e6
    except ValueError:
        raise ValueError(
            f"--busy-poll-us must be auto or a number of microseconds, not {value!r}"
        ) from None


def _auto_or_count(
    option: str,
    value: str,
    least: int = 0,
    allowed: str = "auto, 0 (no bound) or a positive number",
) -> int | None:
    """None for auto, else a count of at least ``least`` (ValueError saying what is wrong)."""
    if value.strip().lower() == "auto":
        return None
    try:
        count = int(value)
    except ValueError:
        raise ValueError(f"{option} must be auto or a number, not {value!r}") from None
    if count < least:
        raise ValueError(f"{option} must be {allowed}")
    return count
