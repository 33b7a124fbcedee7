"""LocalStreamer: the embedded default. The same API and batch loop as Streamer, no Redis."""

from __future__ import annotations

from typing import Any

from broker.client import DEFAULT_TIMEOUT_S, ClientCore, Streamer
from broker.client_settings import ClientSettings
from broker.memory_transport import InMemoryTransport
from broker.transport import Transport

from .batching import BatchLoop
from .config import BatchSettings
from .model import ManagedModel, check_batching, input_check, is_integer

LOCAL_PREFIX = "local"


class LocalStreamer(Streamer):
    """Batch a model inside this process: callers' items are batched on a background thread.

    ``LocalStreamer(MLP, batch_size=64)`` builds the model, runs ``init_model`` and ``warmup``
    (errors surface here), and then serves ``predict``/``submit``/``apredict`` exactly like a
    Streamer backed by Redis workers. A bad argument raises ValueError before the model loads.

    ``model_thread`` is the worker's ``--model-thread`` (auto, on, off), ``max_batch_cost``
    its ``--max-batch-cost`` (default: the model's; 0 counts items only). Callers' timeouts and
    cancellations are handled on the same background loop as the batches: with the model
    inline, a call made while ``predict`` runs starts its timeout only when ``predict``
    returns; ``"on"`` keeps that loop free while the model computes.
    """

    def __init__(
        self,
        model: type[ManagedModel] | ManagedModel,
        batch_size: int | None = None,
        max_latency: float | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        device: str = "cpu",
        max_queue_items: int = 0,
        model_thread: str = "auto",
        max_batch_cost: int | None = None,
    ) -> None:
        instance = model(device=device) if isinstance(model, type) else model
        settings = BatchSettings.for_model(
            instance, batch_size, max_latency, max_batch_cost, model_thread=model_thread
        )
        _check_batching(settings)
        # Nothing from the environment: the MICROBATCH_CLIENT_* settings are for Redis clients.
        client = ClientSettings.from_values(
            prefix=LOCAL_PREFIX,
            timeout=timeout,
            max_queue_items=max_queue_items,
            wait_for_workers=True,  # its worker is the batch loop in this process
        )
        super().__init__(instance.name, model=instance, settings=client)
        self.settings = settings
        self._batch_loop: BatchLoop | None = None
        self._get_thread_core()  # build the model now, so that its errors surface here

    native_async = False  # the in-memory queue lives on the private loop thread

    def _make_transport(self) -> Transport:
        return InMemoryTransport()

    def _on_core_start(self, core: ClientCore) -> Any:
        model = self.model
        model.init_model()
        model.warmup()
        self._batch_loop = BatchLoop(
            model.predict,
            core.transport,
            core.keys,
            "local",
            self.settings,
            check_item=input_check(model.inputs),
            item_cost=model.item_cost,
        )
        core.loop.create_task(self._batch_loop.run())

    def __repr__(self) -> str:
        settings, model = self.settings, type(self.model).__name__
        return (
            f"LocalStreamer({model}, batch_size={settings.batch_size}, "
            f"max_latency={settings.max_latency:g})"
        )

    @property
    def batches_run(self) -> int:
        """How many batches the model has run in this process."""
        return self._batch_loop.batches if self._batch_loop is not None else 0

    def close(self) -> None:
        """Stop the batch loop, then close as :meth:`Streamer.close` does. Used again, the
        LocalStreamer loads the model anew (``init_model`` and ``warmup`` run again)."""
        if self._batch_loop is not None:
            self._batch_loop.stop()
            self._batch_loop.close()
        super().close()


def _check_batching(settings: BatchSettings) -> None:
    """ValueError naming a bad ``batch_size``, ``max_latency`` or ``max_batch_cost``, before
    the model loads (as a model's class attributes are checked)."""
    check_batching(settings.batch_size, settings.max_latency)
    budget = settings.max_batch_cost
    if not is_integer(budget) or budget < 0:
        raise ValueError(f"max_batch_cost must be an int >= 0 (0: items only), not {budget!r}")
