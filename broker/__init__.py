"""microbatch's wire: codec, keys, protocol, transports and the client."""

from .client import Streamer
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
