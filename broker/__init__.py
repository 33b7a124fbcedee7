"""microbatch's wire: codec, keys, protocol, transports and the client.

Importing this package imports neither the client nor Redis' (``Streamer`` is loaded on first
use): the commands' entry points (:mod:`broker.entry_points`) start with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import (
    BrokerUnavailable,
    CodecError,
    DeadlineExceeded,
    InvalidInput,
    InvalidOutput,
    MicrobatchError,
    ModelError,
    NoWorkers,
    PoisonRequest,
    ProtocolError,
    QueueFull,
)
from .keys import DEFAULT_PREFIX, ModelKeys

if TYPE_CHECKING:
    from .client import Streamer

__all__ = [
    "DEFAULT_PREFIX",
    "BrokerUnavailable",
    "CodecError",
    "DeadlineExceeded",
    "InvalidInput",
    "InvalidOutput",
    "MicrobatchError",
    "ModelError",
    "ModelKeys",
    "NoWorkers",
    "PoisonRequest",
    "ProtocolError",
    "QueueFull",
    "Streamer",
]


def __getattr__(name: str) -> Any:
    if name == "Streamer":  # the client, redis-py and numpy, on first use
        from .client import Streamer

        return Streamer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
