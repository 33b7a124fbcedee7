"""WorkerConfig: everything `worker start` is told, handed to the supervisor and its children."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from broker.client import DEFAULT_REDIS_URL
from broker.keys import DEFAULT_PREFIX, check_name, check_partitions, check_prefix
from broker.redis_url import parse as parse_redis_url

from .batching import MODEL_THREAD_MODES

DEFAULT_REDIS_WAIT_S = 60.0
MAX_BUSY_POLL_US = 100_000  # past a tenth of a second, spinning buys nothing a sleep would not

# The queue bound `worker start` stores with the model unless told otherwise ("auto"): this
# many full batches per live worker (a burst of four batches per worker fits twice over, and an
# item waits at most about this many batch times), and this many data bytes in all.
AUTO_QUEUE_BATCHES = 8
AUTO_QUEUE_BYTES = 256 * 1024 * 1024


@dataclass
class WorkerConfig:
    """The settings of one `worker start`. The CLI mirrors these fields one for one."""

    model: str
    name: str | None = None
    cuda: list[int] | None = None
    workers_per_device: int = 1
    workers: int = 1
    prefix: str = DEFAULT_PREFIX
    redis_url: str = DEFAULT_REDIS_URL
    redis_wait: float = DEFAULT_REDIS_WAIT_S
    batch_size: int | None = None
    max_latency: float | None = None
    max_batch_cost: int | None = None
    metrics_port: int | None = None
    start_timeout: float = 600.0
    graceful_timeout: float = 30.0
    max_start_failures: int = 3
    batch_timeout: float = 300.0
    heartbeat_ttl: float = 5.0
    max_deliveries: int = 3
    model_thread: str = "auto"
    busy_poll_us: int = 0
    max_queue_items: int | None = None  # per live worker; None: auto; 0: no item bound
    max_queue_bytes: int | None = None  # in all; None: auto; 0: no byte bound
    partitions: int = 1  # streams the model's queue is spread over
    log_level: str = "info"
    log_format: str = "text"
    extra: dict[str, str] = field(default_factory=dict)

    def validate(self) -> None:
        """Raise ValueError with a one-line reason for any bad setting."""
        if self.name is not None:
            check_name(self.name)
        check_prefix(self.prefix)
        try:
            parse_redis_url(self.redis_url)
        except ValueError as exc:
            raise ValueError(f"--redis: {exc}") from None
        if self.workers < 1:
            raise ValueError("--workers must be at least 1")
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError("--batch-size must be at least 1")
        if self.max_latency is not None and self.max_latency < 0:
            raise ValueError("--max-latency cannot be negative")
        if self.max_batch_cost is not None and self.max_batch_cost < 0:
            raise ValueError("--max-batch-cost cannot be negative")
        if self.redis_wait < 0:
            raise ValueError("--redis-wait cannot be negative")
        if self.batch_timeout <= 0 or self.heartbeat_ttl <= 0:
            raise ValueError("--batch-timeout and --heartbeat-ttl must be positive")
        if self.max_deliveries < 1:
            raise ValueError("--max-deliveries must be at least 1")
        if self.model_thread not in MODEL_THREAD_MODES:
            raise ValueError(f"--model-thread must be one of {', '.join(MODEL_THREAD_MODES)}")
        if not 0 <= self.busy_poll_us <= MAX_BUSY_POLL_US:
            raise ValueError(f"--busy-poll-us must be between 0 and {MAX_BUSY_POLL_US}")
        try:
            check_partitions(self.partitions)
        except ValueError as exc:
            raise ValueError(f"--partitions: {exc}") from None
        for option, value in (
            ("--max-queue-items", self.max_queue_items),
            ("--max-queue-bytes", self.max_queue_bytes),
        ):
            if value is not None and value < 0:
                raise ValueError(f"{option} must be auto, 0 (no bound) or a positive number")

    def queue_bound(self, batch_size: int) -> tuple[int, int]:
        """The queue bound to store with the model: (items per live worker, bytes in all)."""
        items = self.max_queue_items
        if items is None:
            items = AUTO_QUEUE_BATCHES * batch_size
        size = AUTO_QUEUE_BYTES if self.max_queue_bytes is None else self.max_queue_bytes
        return items, size

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WorkerConfig:
        return cls(**json.loads(text))
