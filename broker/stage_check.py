"""Where a pipeline's call waits: the later stages that have no live worker.

A client watches only the first stage's workers (``NoWorkers``, :mod:`broker.worker_watch`).
A call whose later stage has no worker waits in that stage's stream until its deadline, and
once that stage's backlog reaches its bound the first stage stops reading and new calls are
refused ``QueueFull`` (docs/pipelines.md): neither says where. A client told its pipeline's
stages asks Redis, before it fails such a call, which later stages have no live worker, and
names them in the error. At most one check per ``CHECK_EVERY_S``, shared by every call failing
meanwhile; a check that fails or takes over ``CHECK_TIMEOUT_S`` names none.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence

from .errors import MicrobatchError
from .keys import ModelKeys, check_name, stage_keys_name
from .transport import Transport
from .worker_watch import CHECK_EVERY_S

CHECK_TIMEOUT_S = 0.5  # the longest a failing call waits for the check that names its stage


def stage_names(model: object) -> list[str]:
    """A pipeline's stage names, in declaration order (a Pipeline class or instance has
    ``stage_names()``); none for anything else."""
    names = getattr(model, "stage_names", None)
    return list(names()) if callable(names) else []


def stalled_at(stage: str, keys_name: str) -> str:
    """What an error says of a stage that has no live worker."""
    return (
        f"stage {stage!r} ({keys_name!r} in broker status) has no live worker: start one "
        f"(worker start --model <the pipeline> --stage {stage})"
    )


class StageCheck:
    """Which of one pipeline's later stages have no live worker, as one client last asked."""

    def __init__(
        self,
        keys: ModelKeys,
        stages: Sequence[str],
        transport: Transport,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        names = [check_name(stage) for stage in stages]
        self.first = names[0]
        self.later = [
            (stage, ModelKeys(stage_keys_name(keys.model, stage, False), keys.prefix))
            for stage in names[1:]
        ]
        self._transport = transport
        self._loop = loop
        self._lock = asyncio.Lock()
        self._checked_at = -math.inf
        self._missing: list[tuple[str, str]] = []  # (stage, its keys' name)

    async def name_stage(self, error: MicrobatchError) -> MicrobatchError:
        """``error``, naming the later stages that have no live worker (as of at most
        ``CHECK_EVERY_S`` ago), if any; its ``stage`` is the first of them."""
        try:
            missing = await asyncio.wait_for(self._missing_now(), CHECK_TIMEOUT_S)
        except asyncio.TimeoutError:
            return error
        if not missing:
            return error
        notes = "; ".join(stalled_at(stage, name) for stage, name in missing)
        return type(error)(f"{error.message}; {notes}", index=error.index, stage=missing[0][0])

    async def _missing_now(self) -> list[tuple[str, str]]:
        async with self._lock:  # calls failing together share one check
            if self._loop.time() - self._checked_at >= CHECK_EVERY_S:
                try:
                    await self._check()
                finally:  # failed or cut short: the calls waiting meanwhile name none
                    self._checked_at = self._loop.time()
            return self._missing

    async def _check(self) -> None:
        self._missing = []
        lapses = await asyncio.gather(
            *(self._transport.workers_lapsed_s(keys) for _, keys in self.later),
            return_exceptions=True,
        )
        self._missing = [
            (stage, keys.model)
            for (stage, keys), lapsed in zip(self.later, lapses, strict=True)
            if not isinstance(lapsed, BaseException) and (lapsed is None or lapsed > 0)
        ]
