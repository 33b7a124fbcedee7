"""`worker start`: its options -> one WorkerConfig -> the Supervisor.

The options are declared here once; each also reads an environment variable named after it
through one prefix (click's ``auto_envvar_prefix``): MICROBATCH_WORKER_<OPTION>, REDIS_URL for
--redis.
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from broker.cli_common import (
    CONTEXT_SETTINGS,
    PREFIX_HELP,
    check_environment,
    fail,
    log_format_option,
    log_level_option,
    new_app,
    prefix_option,
    redis_option,
    run_app,
    version_option,
)
from broker.client import DEFAULT_REDIS_URL
from broker.keys import DEFAULT_PREFIX
from broker.logs import configure_logging

from .config import (
    AUTO_QUEUE_BATCHES,
    AUTO_QUEUE_BYTES,
    DEFAULT_REDIS_WAIT_S,
    ENV_PREFIX,
    WorkerConfig,
)
from .devices import DeviceError
from .model import ModelLoadError, use_app_dir

app = new_app("Run GPU (or CPU) worker processes that serve a model from Redis streams.")

EXIT_STATUS = (
    "Exit status: 0 after a graceful stop (SIGTERM, SIGHUP, Ctrl-C); 1 when the workers cannot "
    "start (the model's init_model raised: its error is printed; or they were not ready within "
    "--start-timeout) or one did not stop in time; 2 for a bad option, a --model that cannot "
    "be imported or is not a ManagedModel, or when Redis did not answer within --redis-wait "
    "when starting, refused the credentials, or refused a command to the worker's ACL user "
    "(NOPERM); 130 for a Ctrl-C while the command is still being loaded."
)


@app.callback()
def _root(version: Annotated[bool, version_option()] = False) -> None:
    """microbatch workers."""


def run_supervisor(config: WorkerConfig) -> int:
    """Run a supervisor for ``config`` until it stops; the exit status ``worker start`` gives.

    Errors are one ``Error: ...`` line on stderr: 2 for bad settings or a Redis that never
    answered (--redis-wait) or refused the worker's user, 1 when the workers could not start.
    """
    from .supervisor import RedisUnreachable, StartError, Supervisor

    def error(exc: BaseException, code: int) -> int:
        print(f"Error: {exc}", file=sys.stderr, flush=True)
        return code

    try:
        supervisor = Supervisor(config)
    except (ValueError, DeviceError, ModelLoadError) as exc:
        return error(exc, 2)
    try:
        return supervisor.run()
    except RedisUnreachable as exc:
        return error(exc, 2)
    except StartError as exc:
        return error(exc, 1)


@app.command(
    epilog=EXIT_STATUS, context_settings={**CONTEXT_SETTINGS, "auto_envvar_prefix": ENV_PREFIX}
)
def start(
    ctx: typer.Context,
    model: Annotated[
        list[str],
        typer.Option(
            help="Import path 'module:Class' of a ManagedModel subclass, e.g. examples.mlp:MLP, "
            "or of a Pipeline with --stage. One: a worker start serves one model.",
            metavar="<str>",
        ),
    ],
    stage: Annotated[
        str | None,
        typer.Option(
            help="Serve this stage of the Pipeline given by --model (its own model, batch size "
            "and devices; every stage needs workers of its own: docs/pipelines.md).",
        ),
    ] = None,
    name: Annotated[
        str | None,
        typer.Option(help="Model name to serve under [default: the class's name]."),
    ] = None,
    cuda: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated CUDA device indices (relative to the visible devices); "
            "--workers-per-device processes on each. Omit to run on the CPU.",
        ),
    ] = None,
    workers_per_device: Annotated[
        str,
        typer.Option(
            help="Processes per CUDA device, each with its own copy of the weights, or auto: "
            "once the first has loaded the model, a model holding at most 1 GiB on its device "
            "gets up to 3 per device (one per host core), a larger one (or one holding nothing "
            "there through torch) 1. Small models are "
            "bound by the host work of each batch, which more processes overlap; large ones by "
            "the GPU (docs/deployment.md, GPU workers).",
        ),
    ] = "auto",
    workers: Annotated[
        int,
        typer.Option(min=1, help="CPU worker processes (without --cuda)."),
    ] = 1,
    prefix: Annotated[str, prefix_option(PREFIX_HELP)] = DEFAULT_PREFIX,
    redis: Annotated[str, redis_option()] = DEFAULT_REDIS_URL,
    redis_wait: Annotated[
        float,
        typer.Option(
            min=0.0,
            help="Seconds to wait at start-up for Redis to answer (saying so every 10 s) "
            "before giving up with exit status 2. Once serving, a worker rides out Redis "
            "outages and failovers however long they last.",
        ),
    ] = DEFAULT_REDIS_WAIT_S,
    batch_size: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Most items per predict() call [default: the model's batch_size].",
        ),
    ] = None,
    max_latency: Annotated[
        float | None,
        typer.Option(
            min=0.0,
            help="Seconds an item may wait for batch-mates, counted from its arrival; 0 never "
            "waits [default: the model's max_latency].",
        ),
    ] = None,
    max_batch_cost: Annotated[
        int | None,
        typer.Option(
            min=0,
            help="Most a batch's items may cost together, by the model's item_cost (e.g. "
            "tokens); batches then group items of similar cost, and an item over it runs "
            "alone. 0 counts items only [default: the model's max_batch_cost].",
        ),
    ] = None,
    metrics_port: Annotated[
        int | None,
        typer.Option(
            help="Serve Prometheus metrics of all this command's worker processes on this port "
            "(/metrics), with its probes: /ready (a worker process serves the model) and /live "
            "(the supervisor's loop goes round; a Redis outage does not fail it). Any other "
            "path is 404.",
        ),
    ] = None,
    metrics_host: Annotated[
        str,
        typer.Option(
            help="The address --metrics-port listens on: 0.0.0.0 (default) every IPv4 "
            "interface; 127.0.0.1 (or ::1) this machine only, for a scraper or probe on the "
            "same host; or one interface's address.",
        ),
    ] = "0.0.0.0",
    start_timeout: Annotated[
        float,
        typer.Option(
            help="Seconds each worker process may take to load the model, from its start "
            "(the extra ones of --workers-per-device auto start once the first has loaded).",
        ),
    ] = 600.0,
    graceful_timeout: Annotated[
        float,
        typer.Option(
            help="Seconds a worker may take to finish its batch after SIGTERM before it is killed.",
        ),
    ] = 30.0,
    batch_timeout: Annotated[
        float,
        typer.Option(
            help="Seconds one batch may run before the watchdog kills the worker process; its "
            "items are then recomputed by another worker, or dead-lettered.",
        ),
    ] = 300.0,
    heartbeat_ttl: Annotated[
        float,
        typer.Option(
            help="Seconds a worker stays vouched for without renewal; once its heartbeat has "
            "been lapsed for 2 s, live workers take over its unanswered items (a dead host is "
            "detected within this plus 2-3 s).",
        ),
    ] = 5.0,
    max_deliveries: Annotated[
        int,
        typer.Option(
            min=1,
            help="Deliveries after which an unanswered item is dead-lettered and its caller "
            "gets PoisonRequest.",
        ),
    ] = 3,
    max_batches: Annotated[
        int,
        typer.Option(
            min=0,
            help="Replace a worker process once it has computed this many batches (checked "
            "every second): it stops reading, finishes and answers the batches in hand, and a "
            "fresh process loads the model, as gunicorn's --max-requests; a guard against a "
            "model that leaks memory. 0: never.",
        ),
    ] = 0,
    max_rss_mib: Annotated[
        int,
        typer.Option(
            min=0,
            help="Replace a worker process (as --max-batches does) once its resident memory "
            "(RSS) is over this many MiB (checked every second). 0: never.",
        ),
    ] = 0,
    model_thread: Annotated[
        str,
        typer.Option(
            help="Run predict() on a thread of its own, so that reading and decoding the next "
            "batch and sending the last one's replies overlap the model: on, off, or auto (on "
            "while full batches take 10 ms or more; short batches lose more to GIL "
            "hand-offs than the overlap saves, on a GPU too: return outputs pending there, "
            "docs/gpu.md section 6).",
        ),
    ] = "auto",
    busy_poll_us: Annotated[
        str,
        typer.Option(
            help="Microseconds a worker with nothing left to do keeps polling Redis's socket "
            "before it sleeps until work comes: a request arriving meanwhile finds a core that "
            "did not idle. auto (default): only while requests arrive less than 1 ms apart "
            "(then twice the mean gap, at most 1000) and only while a whole core is spare "
            "(the process's cores and CPU quota less the machine's load): off on a busy "
            "machine, on for a GPU worker with cores to spare under dense traffic. "
            "A number fixes it (costs up to that much CPU time per batch when the queue runs "
            "dry); 0 never spins.",
        ),
    ] = "auto",
    max_queue_items: Annotated[
        str,
        typer.Option(
            help="The model's queue bound, stored with it in Redis for every caller: the most "
            "items queued per live worker process of the model (at least one is counted), "
            f"beyond which calls are refused at once (QueueFull, HTTP 503). auto: "
            f"{AUTO_QUEUE_BATCHES} x --batch-size; 0: no item bound.",
        ),
    ] = "auto",
    max_queue_bytes: Annotated[
        str,
        typer.Option(
            help="The most bytes of encoded items queued for the model in all (stored with "
            f"it, like --max-queue-items). auto: {AUTO_QUEUE_BYTES // 2**20} MiB; 0: no byte "
            "bound.",
        ),
    ] = "auto",
    partitions: Annotated[
        int,
        typer.Option(
            min=1,
            help="Spread the model's queue over this many streams, each in its own Redis "
            "Cluster hash slot, so that one model can use several shards. Stored with the "
            "model for callers; every worker reads every partition. Start all workers of a "
            "model with the same count (docs/protocol.md, section 3.1).",
        ),
    ] = 1,
    app_dir: Annotated[
        str,
        typer.Option(
            help="Import --model from this directory first (it is put on sys.path and on the "
            "workers' PYTHONPATH), as uvicorn's --app-dir.",
        ),
    ] = ".",
    log_level: Annotated[str, log_level_option(f"{ENV_PREFIX}_LOG_LEVEL")] = "info",
    log_format: Annotated[str, log_format_option(f"{ENV_PREFIX}_LOG_FORMAT")] = "text",
) -> None:
    """Start worker processes serving MODEL until SIGTERM or Ctrl-C.

    Every option also reads its environment variable (REDIS_URL for --redis, otherwise
    MICROBATCH_WORKER_<OPTION>, e.g. MICROBATCH_WORKER_BATCH_SIZE).
    """
    # --redis reads REDIS_URL alone, so MICROBATCH_WORKER_REDIS is no setting
    check_environment(
        "worker start",
        f"{ENV_PREFIX}_",
        (f"{ENV_PREFIX}_{name.upper()}" for name in ctx.params if name != "redis"),
    )
    use_app_dir(app_dir)  # before anything imports the model
    try:
        configure_logging(log_level, log_format)
        # every option by its name, as declared above (and checked by typer)
        config = WorkerConfig.from_options(**{**ctx.params, "model": _one_model(model)})
    except (ValueError, DeviceError) as exc:
        fail(str(exc))
    raise typer.Exit(run_supervisor(config))


def _one_model(models: list[str]) -> str:
    """The model of a `worker start`, which serves one: a second --model (taken as the
    last one given, the others ignored without a word) is an error."""
    if len(models) > 1:
        raise ValueError(
            f"--model was given {len(models)} times ({', '.join(models)}): a worker start "
            "serves one model; run one per model (a gateway serves several)"
        )
    return models[0]


def main() -> None:
    run_app(app, "worker", f"{ENV_PREFIX}_")


if __name__ == "__main__":
    main()
