"""service_streamer 0.1.2's API on microbatch: change the import line, keep the application.

::

    from service_streamer import ThreadedStreamer, Streamer, RedisStreamer, ManagedModel
    from service_streamer import run_redis_workers_forever
    # becomes
    from gpu_worker.compat import ThreadedStreamer, Streamer, RedisStreamer, ManagedModel
    from gpu_worker.compat import run_redis_workers_forever

Same classes, signatures and defaults as service_streamer 0.1.2 (``predict``, ``submit``
futures, ``destroy_workers``, ``batch_size``, ``max_latency``, ``worker_num``,
``cuda_devices``, ``model_init_args``/``model_init_kwargs``, ``redis_broker="host:port"``,
``prefix``), on microbatch's machinery:

- ``ThreadedStreamer`` is a :class:`gpu_worker.LocalStreamer`: the model is batched on a thread
  of this process.
- ``Streamer`` starts microbatch worker processes (a supervisor, one pinned process per worker,
  restarted if it dies) behind a private ``redis-server`` on a free loopback port, and talks to
  them with :class:`broker.Streamer`.
- ``RedisStreamer`` is a :class:`broker.Streamer` and ``run_redis_workers_forever`` runs
  microbatch workers, both on the stream of model ``service_streamer`` under the prefix.

What changes (docs/migration.md has the details): items and results travel as msgpack (never
pickle), so they must be msgpack types or numpy arrays / torch tensors (tuples come back as
lists, tensors as CPU tensors: see :mod:`gpu_worker.compat_values`; anything else raises
``CodecError`` at once); a model that raises
fails its own items with ``ModelError`` at once instead of a 20 s hang; a timeout raises
``StreamerTimeout``, which is both microbatch's ``DeadlineExceeded`` and the built-in
``TimeoutError`` that service_streamer raised.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import uuid
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence, Sized
from concurrent.futures import Future
from types import ModuleType
from typing import Any

from broker.client import Streamer as BrokerStreamer
from broker.errors import DeadlineExceeded
from broker.keys import DEFAULT_PREFIX, check_prefix
from broker.loop_thread import refuse_green_threads

from .compat_values import from_wire, to_wire
from .local import LocalStreamer
from .model import ManagedModel as MicrobatchModel
from .outcomes import PredictFn, outputs_now

log = logging.getLogger("microbatch.compat")

__all__ = [
    "COMPAT_NAME",
    "ManagedModel",
    "RedisStreamer",
    "Streamer",
    "StreamerTimeout",
    "ThreadedStreamer",
    "run_redis_workers_forever",
]

COMPAT_NAME = "service_streamer"  # the model name of the compat streams
WORKER_TIMEOUT = 20.0  # service_streamer's predict() timeout, in seconds
START_TIMEOUT = 600.0  # how long Streamer() waits for its workers to load the model
SPEC_ENV = "MICROBATCH_COMPAT_SPEC"  # what the worker processes run (JSON)
CONFIG_ENV = "MICROBATCH_COMPAT_CONFIG"  # the WorkerConfig of the supervisor (JSON)
CHILD_ENV = "MICROBATCH_COMPAT_CHILD"  # set in the supervisor and worker processes
PARENT_ENV = "MICROBATCH_COMPAT_PARENT"  # the pid whose death stops the supervisor
SERVER_ENV = "MICROBATCH_COMPAT_SERVER"  # the private redis-server to stop if orphaned (JSON)
MAIN_MODULE = "__mp_main__"  # the name the main script is imported under in workers


class StreamerTimeout(DeadlineExceeded, TimeoutError):
    """No result in time: microbatch's DeadlineExceeded, and the TimeoutError of
    service_streamer (so ``except TimeoutError`` keeps working)."""


def _compat_error(error: BaseException) -> BaseException:
    if isinstance(error, DeadlineExceeded) and not isinstance(error, StreamerTimeout):
        timeout = StreamerTimeout(error.message, index=error.index)
        timeout.__cause__ = error
        return timeout
    return error


class ManagedModel:
    """service_streamer's ManagedModel: ``init_model`` runs in the worker, ``predict`` per batch.

    ``gpu_id`` is the entry of ``cuda_devices`` this worker was given (None on the CPU). Unlike
    service_streamer, the worker process is already pinned to that device when the model is
    built (``CUDA_VISIBLE_DEVICES`` holds exactly it, so it is ``cuda:0`` inside), which is why
    :meth:`set_gpu_id` does nothing here.
    """

    def __init__(self, gpu_id: int | None = None) -> None:
        self.model: Any = None
        self.gpu_id = gpu_id
        self.set_gpu_id(self.gpu_id)

    @staticmethod
    def set_gpu_id(gpu_id: int | None = None) -> None:
        """Kept for compatibility: the supervisor pins the process before it starts."""

    def init_model(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError

    def predict(self, batch: list[Any]) -> list[Any]:
        raise NotImplementedError


class _FunctionModel(MicrobatchModel):
    """A predict function as a microbatch model (for ThreadedStreamer)."""

    name = COMPAT_NAME

    def __init__(self, predict_function: Callable[[list[Any]], Sequence[Any]]) -> None:
        super().__init__("cpu")
        self.predict_function = predict_function

    def predict(self, batch: list[Any]) -> Sequence[Any]:
        return _predict_values(self.predict_function, batch)


def _predict_values(predict: PredictFn, batch: list[Any]) -> list[Any]:
    """Call a service_streamer predict function with tensors as its callers sent them."""
    outputs = outputs_now(predict([from_wire(item) for item in batch]))
    return [to_wire(output) for output in outputs]


class _BaseStreamer:
    """predict / submit / destroy_workers over a microbatch Streamer."""

    _streamer: BrokerStreamer | None

    def __init__(self, streamer: BrokerStreamer) -> None:
        self._streamer = streamer

    def _live(self) -> BrokerStreamer:
        if self._streamer is None:
            raise RuntimeError("this streamer's workers were destroyed (destroy_workers)")
        return self._streamer

    def predict(self, batch: list[Any], timeout: float | None = None) -> list[Any]:
        """Run the model on ``batch``; one output per item, in order.

        Raises the first failing item's error (``ModelError``, ``CodecError``, ...), or
        :class:`StreamerTimeout` when no result came within ``timeout`` (default 20 s).
        """
        try:
            outputs = self._live().predict(_items(batch), timeout=timeout)
        except DeadlineExceeded as exc:
            raise _compat_error(exc) from exc
        return [from_wire(output) for output in outputs]

    def submit(self, batch: list[Any], timeout: float | None = None) -> Future[list[Any]]:
        """Like predict, without waiting: ``future.result()`` gives the outputs."""
        raw = self._live().submit(_items(batch), timeout=timeout)
        future: Future[list[Any]] = Future()

        def chain(done: Future[list[Any]]) -> None:
            if done.cancelled():
                future.cancel()
            elif (error := done.exception()) is not None:
                future.set_exception(_compat_error(error))
            else:
                future.set_result([from_wire(output) for output in done.result()])

        raw.add_done_callback(chain)
        future.add_done_callback(lambda f: raw.cancel() if f.cancelled() else None)
        return future

    def destroy_workers(self) -> None:
        """Stop the workers and release connections; later calls raise RuntimeError."""
        streamer, self._streamer = self._streamer, None
        if streamer is not None:
            streamer.close()


def _items(batch: Any) -> Any:
    """The batch's items ready to send. Like service_streamer, any sized iterable is a batch
    (a numpy array or a tensor gives its rows), but a string, bytes or a mapping is not
    (TypeError, in the terms of this API: microbatch's Streamer names its own methods)."""
    if isinstance(batch, (str, bytes, bytearray, Mapping)) or not (
        isinstance(batch, Sized) and isinstance(batch, Iterable)
    ):
        raise TypeError(
            "predict and submit take a batch (a list, tuple or other sized iterable; a numpy "
            f"array or a tensor gives its rows) of items, not {type(batch).__name__}"
        )
    return [to_wire(item) for item in batch]


class ThreadedStreamer(_BaseStreamer):
    """Batch ``predict_function`` on a background thread of this process.

    ``max_latency`` (seconds, default 0.1 as in service_streamer) is how long an item may wait
    for batch-mates, counted from its arrival; a full batch never waits. The function runs on a
    thread of its own, so callers' timeouts end their waits while it computes (or hangs).
    """

    def __init__(
        self,
        predict_function: Callable[[list[Any]], Sequence[Any]],
        batch_size: int,
        max_latency: float = 0.1,
        *,
        timeout: float = WORKER_TIMEOUT,
    ) -> None:
        if not callable(predict_function):
            raise TypeError("predict_function must be callable")
        local = LocalStreamer(
            _FunctionModel(predict_function),
            batch_size=batch_size,
            max_latency=max_latency,
            timeout=timeout,
            model_thread="on",
        )
        super().__init__(local)


class Streamer(_BaseStreamer):
    """Run the model in ``worker_num`` worker processes (round-robin over ``cuda_devices``).

    ``predict_function_or_model`` is a ManagedModel subclass (built in each worker as
    ``Model(gpu_id)`` then ``init_model(*model_init_args, **model_init_kwargs)``), or a
    module-level function, or a method of a module-level object. Workers are fresh processes
    that import it by name (the main script is imported as ``__mp_main__``, as multiprocessing's
    spawn does, so keep the ``if __name__ == "__main__":`` guard); nothing is pickled.
    ``model_init_args`` and ``model_init_kwargs`` must be JSON values.

    The workers talk to this process through a private ``redis-server`` (on PATH, or see
    ``broker.devserver``); pass ``redis_url`` to use a Redis of your own instead. The
    constructor returns once every worker has loaded the model, and raises RuntimeError with
    the reason if they cannot.
    """

    def __init__(
        self,
        predict_function_or_model: Any,
        batch_size: int,
        max_latency: float = 0.1,
        worker_num: int = 1,
        cuda_devices: Sequence[int] | None = None,
        model_init_args: Sequence[Any] | None = None,
        model_init_kwargs: dict[str, Any] | None = None,
        *,
        redis_url: str | None = None,
        timeout: float = WORKER_TIMEOUT,
        start_timeout: float = START_TIMEOUT,
    ) -> None:
        _refuse_in_worker("Streamer")
        refuse_green_threads()
        self.worker_num = worker_num
        self.cuda_devices = cuda_devices
        self._streamer = None
        target = _reference(predict_function_or_model)
        prefix = f"compat-{uuid.uuid4().hex[:12]}"
        group = _WorkerGroup(
            target, batch_size, max_latency, worker_num, cuda_devices,
            model_init_args, model_init_kwargs, prefix, COMPAT_NAME,
        )  # fmt: skip
        self._resources = _Resources()
        self._finalizer = weakref.finalize(self, self._resources.close)
        try:
            if redis_url is None:
                from broker.devserver import RedisServer

                self._resources.server = RedisServer().start()
                redis_url = self._resources.server.url
            server = self._resources.server
            if server is not None:  # the supervisor stops it should this program die unclean
                group.env[SERVER_ENV] = json.dumps({"pid": server.process.pid, "dir": server.dir})
            self._resources.group = group
            group.start(redis_url)
            group.wait_ready(start_timeout)
            self._streamer = BrokerStreamer(
                COMPAT_NAME,
                redis_url=redis_url,
                prefix=prefix,
                timeout=timeout,
                wait_for_workers=True,  # as service_streamer: wait while workers restart
            )
        except BaseException:
            self.destroy_workers()
            raise

    def destroy_workers(self) -> None:
        """Stop the worker processes (each finishes its batch) and the private Redis."""
        super().destroy_workers()
        self._finalizer()


class _Resources:
    """What a Streamer owns besides its client: stopped on destroy_workers, GC or exit."""

    def __init__(self) -> None:
        self.group: _WorkerGroup | None = None
        self.server: Any = None

    def close(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            group.stop()
        server, self.server = self.server, None
        if server is not None:
            server.stop()


class RedisStreamer(_BaseStreamer):
    """A client of workers started with ``run_redis_workers_forever`` (any number of hosts).

    ``redis_broker`` is ``"host:port"`` (or a ``redis://`` URL); ``prefix`` separates models
    sharing one Redis (letters, digits, ``_``, ``-``, ``.``; ``''`` is microbatch's default).
    """

    def __init__(
        self,
        redis_broker: str = "localhost:6379",
        prefix: str = "",
        *,
        name: str = COMPAT_NAME,
        timeout: float = WORKER_TIMEOUT,
    ) -> None:
        refuse_green_threads()  # here rather than at the first predict
        self.prefix = prefix
        self._redis_broker = redis_broker
        super().__init__(
            BrokerStreamer(
                name,
                redis_url=redis_url(redis_broker),
                prefix=_prefix(prefix),
                timeout=timeout,
                wait_for_workers=True,  # as service_streamer: queue until workers come
            )
        )


def run_redis_workers_forever(
    model_class: Any,
    batch_size: int,
    max_latency: float = 0.1,
    worker_num: int = 1,
    cuda_devices: Sequence[int] | None = None,
    redis_broker: str = "localhost:6379",
    prefix: str = "",
    model_init_args: Sequence[Any] | None = None,
    model_init_kwargs: dict[str, Any] | None = None,
    *,
    name: str = COMPAT_NAME,
) -> None:
    """Serve ``model_class`` from Redis with ``worker_num`` worker processes until stopped.

    Returns after SIGTERM or Ctrl-C, once every worker has finished its batch; raises
    RuntimeError if the workers cannot start. The same workers as ``worker start``: pinned to
    their device, restarted if they die, their unanswered items taken over by the others.
    """
    _refuse_in_worker("run_redis_workers_forever")
    group = _WorkerGroup(
        _reference(model_class), batch_size, max_latency, worker_num, cuda_devices,
        model_init_args, model_init_kwargs, _prefix(prefix), name,
    )  # fmt: skip
    group.start(redis_url(redis_broker))
    previous: Any = None
    in_main = threading.current_thread() is threading.main_thread()
    if in_main:
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: group.terminate())
    try:
        code = group.wait()
    except KeyboardInterrupt:
        group.stop()
        return
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)
    if code != 0 and not group.stopping:
        raise RuntimeError(group.failure(code))


# -- helpers -------------------------------------------------------------------------------------
def redis_url(redis_broker: str) -> str:
    """service_streamer's ``"host:port"`` as a Redis URL (URLs pass through)."""
    if "://" in redis_broker:
        return redis_broker
    host, sep, port = redis_broker.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"redis_broker must look like 'host:port', not {redis_broker!r}")
    return f"redis://{host}:{int(port)}/0"


def _prefix(prefix: str) -> str:
    return check_prefix(prefix) if prefix else DEFAULT_PREFIX


def _refuse_in_worker(what: str) -> None:
    if os.environ.get(CHILD_ENV):
        raise RuntimeError(
            f"{what} was called while a worker process imported the main module: create it "
            "under `if __name__ == '__main__':` (as with service_streamer's spawned workers)"
        )


def _main_module_path() -> str | None:
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    return os.path.abspath(path) if path else None


def _lookup(root: Any, qualname: str) -> Any:
    obj = root
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _global_name(obj: Any, modules: list[str]) -> tuple[str, str] | None:
    """(module, name) of a module-level global that is ``obj``, searched in ``modules``."""
    for module_name in modules:
        module = sys.modules.get(module_name)
        for name, value in vars(module or ModuleType("_")).items():
            if value is obj and not name.startswith("__"):
                return module_name, name
    return None


_BY_NAME_HINT = (
    "; the workers import the model by name: pass a ManagedModel subclass, a module-level "
    "function or a method of a module-level object (or use ThreadedStreamer)"
)


def _reference(target: Any) -> dict[str, Any]:
    """How a worker process finds ``target`` by name: {module, qualname, attr}.

    Raises TypeError for something that cannot be imported by name (a lambda, a closure, an
    object that is not a module-level global).
    """
    hint = _BY_NAME_HINT
    ref = _locate(target)
    if "<" in ref["qualname"]:  # <lambda>, <locals>
        raise TypeError(f"{target!r} cannot be imported by name{hint}")
    if ref["module"] == "__main__" and _main_module_path() is None:
        raise TypeError(f"{target!r} lives in a main module without a file{hint}")
    try:  # it must resolve here the way the workers will resolve it
        found_obj = _lookup(sys.modules[ref["module"]], ref["qualname"])
        if ref["attr"]:
            found_obj = getattr(found_obj, ref["attr"])
    except (KeyError, AttributeError):
        raise TypeError(f"{target!r} cannot be imported by name{hint}") from None
    if ref["attr"] is None and found_obj is not target:
        raise TypeError(f"{target!r} cannot be imported by name{hint}")
    return ref


def _locate(target: Any) -> dict[str, Any]:
    """Where ``target`` claims to live: {module, qualname, attr} (not checked yet)."""
    if isinstance(target, type):
        if not issubclass(target, (ManagedModel, MicrobatchModel)):
            raise TypeError(f"{target.__qualname__} is not a ManagedModel subclass")
        return {"module": target.__module__, "qualname": target.__qualname__, "attr": None}
    if not callable(target):
        raise TypeError(f"predict_function_or_model must be callable, not {type(target).__name__}")
    if hasattr(target, "__self__") and not isinstance(target.__self__, ModuleType):
        return _locate_method(target)
    if hasattr(target, "__qualname__") and hasattr(target, "__module__"):
        return {"module": target.__module__, "qualname": target.__qualname__, "attr": None}
    found = _global_name(target, ["__main__", type(target).__module__])
    if found is None:
        raise TypeError(f"{target!r} is no module-level global{_BY_NAME_HINT}")
    return {"module": found[0], "qualname": found[1], "attr": None}


def _locate_method(target: Any) -> dict[str, Any]:
    """Where a bound method's owner lives (a class, or a module-level object)."""
    owner = target.__self__
    modules = ["__main__", getattr(type(owner), "__module__", "__main__")]
    if isinstance(owner, type):
        found: tuple[str, str] | None = (owner.__module__, owner.__qualname__)
    else:
        found = _global_name(owner, modules)
    if found is None:
        raise TypeError(
            f"{target!r} belongs to an object that is no module-level global{_BY_NAME_HINT}"
        )
    return {"module": found[0], "qualname": found[1], "attr": target.__name__}


def _import(module_name: str, main_path: str | None) -> ModuleType:
    if module_name != "__main__":
        return importlib.import_module(module_name)
    module = sys.modules.get(MAIN_MODULE)
    if module is None:
        if main_path is None:
            raise ImportError("the main module has no file to import")
        spec = importlib.util.spec_from_file_location(MAIN_MODULE, main_path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot import {main_path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[MAIN_MODULE] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[MAIN_MODULE]
            raise
    return module


def _gpu_id(spec: dict[str, Any]) -> int | None:
    """This worker's entry of cuda_devices, from the device the supervisor pinned it to."""
    if not spec.get("cuda"):
        return None
    pinned = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    preset = spec.get("visible_preset")
    entries = [e.strip() for e in preset.split(",")] if preset else None
    try:
        return entries.index(pinned) if entries is not None else int(pinned)
    except ValueError:
        return None


class CompatWorker(MicrobatchModel):
    """What a compat worker process serves: the user's model, found by name (see SPEC_ENV)."""

    name = COMPAT_NAME

    def init_model(self) -> None:
        spec = json.loads(os.environ[SPEC_ENV])
        for entry in reversed(spec.get("sys_path", [])):
            if entry not in sys.path:
                sys.path.insert(0, entry)
        if "argv" in spec:  # the parent's, as multiprocessing's spawned children see them
            sys.argv[:] = spec["argv"]
        ref = spec["target"]
        target = _lookup(_import(ref["module"], spec.get("main_path")), ref["qualname"])
        if ref["attr"]:
            target = getattr(target, ref["attr"])
        self.gpu_id = _gpu_id(spec)
        self.predict_function: PredictFn
        if isinstance(target, type) and issubclass(target, ManagedModel):
            model = target(self.gpu_id)
            model.init_model(*spec.get("init_args", []), **spec.get("init_kwargs", {}))
            self.predict_function = model.predict
        elif isinstance(target, type) and issubclass(target, MicrobatchModel):
            ours = target(device=self.device)
            ours.init_model()
            ours.warmup()
            self.predict_function = ours.predict
        else:
            self.predict_function = target

    def predict(self, batch: list[Any]) -> Sequence[Any]:
        return _predict_values(self.predict_function, batch)


class _WorkerGroup:
    """One supervisor process (as `worker start` runs) serving the compat model."""

    def __init__(
        self,
        target: dict[str, Any],
        batch_size: int,
        max_latency: float,
        worker_num: int,
        cuda_devices: Sequence[int] | None,
        model_init_args: Sequence[Any] | None,
        model_init_kwargs: dict[str, Any] | None,
        prefix: str,
        name: str,
    ) -> None:
        if worker_num < 1:
            raise ValueError("worker_num must be at least 1")
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        devices: list[int] | None = None
        if cuda_devices is not None:
            indices = [int(index) for index in cuda_devices]
            if not indices:
                raise ValueError("cuda_devices is empty: pass None to run on the CPU")
            devices = [indices[i % len(indices)] for i in range(worker_num)]
        sys_path = [entry for entry in sys.path if entry]
        spec = {
            "target": target,
            "init_args": list(model_init_args or []),
            "init_kwargs": dict(model_init_kwargs or {}),
            "main_path": _main_module_path(),
            "sys_path": sys_path,
            "argv": [str(arg) for arg in sys.argv],
            "cuda": devices is not None,
            "visible_preset": os.environ.get("CUDA_VISIBLE_DEVICES"),
        }
        try:
            spec_json = json.dumps(spec)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"model_init_args and model_init_kwargs must be JSON: {exc}") from None
        self.config: dict[str, Any] = {
            "model": f"{__name__}:CompatWorker",
            "name": name,
            "cuda": devices,
            # worker_num processes in all, one per entry of devices: never sized by the model
            "workers_per_device": 1,
            "workers": worker_num,
            "prefix": prefix,
            "batch_size": batch_size,
            "max_latency": float(max_latency),
            "log_level": os.environ.get("MICROBATCH_WORKER_LOG_LEVEL", "warning"),
        }
        self.keys_name, self.prefix, self.url = name, prefix, ""
        self.worker_num = worker_num
        self.env = {
            **os.environ,
            SPEC_ENV: spec_json,
            CHILD_ENV: "1",
            PARENT_ENV: str(os.getpid()),
            "PYTHONPATH": os.pathsep.join(sys_path),
        }
        self.process: subprocess.Popen[bytes] | None = None
        self.relay: threading.Thread | None = None
        self.lines: deque[str] = deque(maxlen=50)
        self.stopping = False

    def start(self, url: str) -> None:
        """Start the supervisor serving the model from the Redis at ``url``."""
        self.url = url
        env = {**self.env, CONFIG_ENV: json.dumps({**self.config, "redis_url": url})}
        code = f"import {__name__} as c; raise SystemExit(c._supervise())"
        command = [sys.executable, "-c", code]
        self.process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE)
        self.relay = threading.Thread(target=self._relay, name="compat-workers-log", daemon=True)
        self.relay.start()

    def _relay(self) -> None:
        """Copy the supervisor's messages to our stderr, keeping the last lines for errors."""
        assert self.process is not None and self.process.stderr is not None
        with self.process.stderr:  # closed once the supervisor has said its last
            for raw in self.process.stderr:
                line = raw.decode(errors="replace")
                self.lines.append(line.rstrip())
                with contextlib.suppress(Exception):
                    sys.stderr.write(line)

    def failure(self, code: int | None) -> str:
        errors = [line for line in self.lines if line.startswith("Error:")]
        reason = errors[-1][len("Error:") :].strip() if errors else "see the log above"
        if reason.startswith("CUDA device"):  # service_streamer ran on the CPU without a word
            reason += "; on a machine without these GPUs pass cuda_devices=None"
        return f"the service_streamer workers stopped (exit code {code}): {reason}"

    def wait_ready(self, timeout: float) -> None:
        """Return once every worker consumes the stream; raise RuntimeError if they cannot."""
        from broker.connections import sync_client
        from broker.keys import ModelKeys
        from broker.liveness import wait_for_consumers

        def running() -> None:
            assert self.process is not None
            code = self.process.poll()
            if code is not None:
                if self.relay is not None:
                    self.relay.join(5.0)  # until it has read the last messages
                raise RuntimeError(self.failure(code))

        keys = ModelKeys(self.keys_name, self.prefix)
        client = sync_client(self.url, socket_timeout=5)
        try:
            wait_for_consumers(client, keys, self.worker_num, timeout, check=running)
        except TimeoutError:
            raise RuntimeError(f"the workers did not start within {timeout:g} s") from None
        finally:
            client.close()

    def wait(self) -> int:
        assert self.process is not None
        return self.process.wait()

    def terminate(self) -> None:
        """Ask the supervisor to stop (each worker finishes its batch)."""
        self.stopping = True
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()

    def stop(self, timeout: float = 60.0) -> None:
        self.terminate()
        if self.process is None:
            return
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if self.relay is not None:  # it ends once it has read the supervisor's last line
            self.relay.join(5.0)


def _supervise() -> int:
    """The supervisor process of a compat worker group (started by _WorkerGroup)."""
    from broker.logs import configure_logging

    from .cli import run_supervisor
    from .config import WorkerConfig
    from .parent_watch import stop_when_orphaned

    config = WorkerConfig(**json.loads(os.environ[CONFIG_ENV]))
    parent = int(os.environ.get(PARENT_ENV, "0"))
    if parent:
        stop_when_orphaned(parent, "the program that started these workers")
    configure_logging(config.log_level, config.log_format)
    try:
        return run_supervisor(config)
    finally:
        if parent and os.getppid() != parent:  # the program died without destroy_workers
            _stop_orphaned_server()


def _stop_orphaned_server() -> None:
    """Stop the private redis-server of a Streamer whose program is gone (it was that
    program's child, so nothing else would), and remove its directory."""
    import shutil
    import time

    server = json.loads(os.environ.get(SERVER_ENV) or "null")
    if server is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(server["pid"], signal.SIGTERM)
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            os.kill(server["pid"], 0)  # ProcessLookupError once it is gone
            time.sleep(0.05)
        os.kill(server["pid"], signal.SIGKILL)
    shutil.rmtree(server["dir"], ignore_errors=True)
