"""One worker process: load the model on its device, then run the batch loop over Redis.

Started by the supervisor as ``python -m gpu_worker.child`` with its config in the environment
and a pipe on which it reports ``ready`` or the reason it could not start.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import signal
import socket
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import WorkerConfig
    from .model import ManagedModel

CONFIG_ENV = "MICROBATCH_CHILD_CONFIG"
STATUS_FD_ENV = "MICROBATCH_CHILD_STATUS_FD"
SUPERVISOR_PID_ENV = "MICROBATCH_CHILD_SUPERVISOR"  # the pid whose death stops the child
DEVICE_ENV = "MICROBATCH_CHILD_DEVICE"
EXIT_REFUSED = 4  # Redis refused a command to the worker's ACL user: a restart cannot help

log = logging.getLogger("microbatch.worker")


def report(event: str, **fields: Any) -> None:
    """Tell the supervisor about this child's state (one JSON line on the status pipe)."""
    fd = os.environ.get(STATUS_FD_ENV)
    if fd is None:
        return
    with contextlib.suppress(OSError):  # the supervisor is gone: nothing to tell
        os.write(int(fd), (json.dumps({"event": event, **fields}) + "\n").encode())


def refused_command(exc: BaseException) -> str | None:
    """What Redis said where ``exc`` is its NOPERM to this worker's ACL user, else None."""
    from redis.exceptions import NoPermissionError  # (redis-py's and the lanes' alike)

    return str(exc) if isinstance(exc, NoPermissionError) else None


def consumer_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def check_device(device: str) -> None:
    """Fail clearly if a CUDA worker does not see exactly the one device it was given."""
    if device == "cpu":
        return
    from .devices import device_count

    count = device_count(in_process=True)  # the model imports torch next anyway
    if count != 1:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise RuntimeError(
            f"worker pinned to CUDA_VISIBLE_DEVICES={visible} sees {count} devices, expected 1"
        )


async def serve(model: ManagedModel, config: WorkerConfig, consumer: str) -> None:
    """Serve ``model`` as ``consumer`` until SIGTERM or SIGINT, with ``config`` (whole)."""
    from broker.redis_transport import RedisTransport

    from .batch_state import STATE_FILE_ENV, BatchState
    from .batching import BatchLoop
    from .heartbeat import Heartbeats
    from .metrics import WorkerObserver
    from .model import input_check
    from .outcomes import PredictFn
    from .recycling import RecyclePolicy, replace_when_due

    settings = config.batch_settings(model)
    transport = RedisTransport(config.redis_url)
    keys = config.keys(model)
    # Vouch for this consumer once before its first read; from then on the supervisor renews
    # it, so that no one takes over entries from a worker that is starting up.
    heartbeats = Heartbeats(config.redis_url, keys, config.heartbeat_ttl)
    heartbeats.renew({consumer: {}})
    heartbeats.close()
    warning = await transport.eviction_warning()
    if warning:
        log.warning("%s", warning)
    state_file = os.environ.get(STATE_FILE_ENV)
    observer = WorkerObserver(keys.model, consumer, BatchState(state_file) if state_file else None)
    check = input_check(model.inputs)
    predict: PredictFn = model.predict
    stage = None
    if config.stage is not None:  # a pipeline's stage: its outputs go on to the next stages
        from .forwarding import stage_worker

        stage, predict, check = stage_worker(config, transport, predict, check)
    batch_loop = BatchLoop(
        predict, stage or transport, keys, consumer, settings, observer, check, model.item_cost
    )
    if stage is not None:
        stage.now_ms = batch_loop.clock.now_ms
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # as worker start stops
        loop.add_signal_handler(sig, batch_loop.stop)
    replacing = replace_when_due(
        RecyclePolicy(config.max_batches, config.max_rss_mib), batch_loop, consumer, report
    )
    log.info(
        "worker %s serving %s on %s (batch_size=%d, max_latency=%gs, max_batch_cost=%d, "
        "model_thread=%s, busy_poll=%s)",
        consumer,
        keys.stream if keys.partitions == 1 else f"{keys.stream} and its partitions 1 to "
        f"{keys.partitions - 1}", model.device, settings.batch_size, settings.max_latency,
        settings.max_batch_cost, settings.model_thread,
        "auto" if settings.busy_poll_s is None else f"{round(settings.busy_poll_s * 1e6)}us",
    )  # fmt: skip
    try:
        await batch_loop.run()
    finally:
        if replacing is not None:
            replacing.cancel()
        batch_loop.close()
        observer.flush()
        await transport.close()
    log.info(
        "worker %s stopped after %d batches (%d items, %d taken over, %d dead-lettered)",
        consumer, batch_loop.batches, batch_loop.items, batch_loop.redelivered,
        batch_loop.dead_lettered,
    )  # fmt: skip


def main() -> int:
    from broker.logs import configure_logging

    from .config import WorkerConfig

    config = WorkerConfig.from_json(os.environ[CONFIG_ENV])
    configure_logging(config.log_level, config.log_format)
    supervisor = int(os.environ.get(SUPERVISOR_PID_ENV, "0"))
    if supervisor:
        from .parent_watch import stop_when_orphaned

        stop_when_orphaned(supervisor, "its worker start process")
    device = os.environ.get(DEVICE_ENV, "cpu")
    try:
        from .devices import device_footprint
        from .pipeline import load_stage

        check_device(device)
        model = load_stage(config.model, config.stage)(device=device)
        model.init_model()
        model.warmup()
        footprint = device_footprint(model)  # (a CUDA error may surface here, at its sync)
    except BaseException as exc:
        from .outcomes import describe

        report("error", message=f"model {config.model} failed to start: {describe(exc)}")
        log.debug("start-up failure", exc_info=True)
        return 3
    # The model and its libraries (torch: hundreds of thousands of objects) live as long as the
    # process: frozen out of the collector, a full collection no longer walks them (it took
    # 20-80 ms, stalling every item of the batch in hand).
    gc.collect()
    gc.freeze()
    consumer = consumer_name()
    report("ready", device=device, pid=os.getpid(), consumer=consumer, device_bytes=footprint)
    from broker.loop_thread import new_event_loop

    loop = new_event_loop()
    try:
        loop.run_until_complete(serve(model, config, consumer))
    except Exception as exc:
        said = refused_command(exc)
        if said is None:
            raise
        report("refused", message=f"Redis refused a command to the worker's user: {said}")
        return EXIT_REFUSED
    finally:
        loop.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
