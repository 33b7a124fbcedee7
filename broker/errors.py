"""Typed errors shared by callers, gateways and workers.

Every error that can travel on the wire has a stable ``type`` string (its class name); a reply's
``error.type`` is turned back into the same class on the caller's side by :func:`error_from_wire`.
"""

from __future__ import annotations


class MicrobatchError(Exception):
    """Base class of every microbatch error.

    ``index`` is the position of the failing item in the caller's batch, when one is known;
    ``stage`` the pipeline stage that failed it or held it (docs/pipelines.md), when one is
    known.
    """

    def __init__(
        self, message: str = "", *, index: int | None = None, stage: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.index = index
        self.stage = stage

    @property
    def type(self) -> str:
        """The error's name on the wire (a reply's ``error.type``): its class name."""
        return type(self).__name__

    def __str__(self) -> str:
        if self.index is None:
            return self.message
        return f"item {self.index}: {self.message}"

    def __repr__(self) -> str:
        index = "" if self.index is None else f", index={self.index}"
        return f"{type(self).__name__}({self.message!r}{index})"

    def with_index(self, index: int) -> MicrobatchError:
        """A copy of this error naming the item at ``index``."""
        return type(self)(self.message, index=index, stage=self.stage)


class ModelError(MicrobatchError):
    """The model raised while computing this item (the message is the model's)."""


class DeadlineExceeded(MicrobatchError):
    """The item's deadline passed before its result came back."""


class QueueFull(MicrobatchError):
    """The model's queue is over its bound; the request was refused at once."""


class BrokerUnavailable(MicrobatchError):
    """Redis could not be reached to submit the request."""


class NoWorkers(MicrobatchError):
    """No live worker has consumed the model for longer than the caller's grace period; the
    call's items were withdrawn from the queue."""


class PoisonRequest(MicrobatchError):
    """The item was delivered too many times without an answer and was dead-lettered."""


class CodecError(MicrobatchError):
    """A payload could not be encoded or decoded (malformed, too large, disallowed type)."""


class ProtocolError(MicrobatchError):
    """A stream entry or reply did not follow the wire protocol (e.g. unknown version)."""


class InvalidInput(MicrobatchError):
    """The input does not match what the model declares (shape, datatype, count)."""


class InvalidOutput(MicrobatchError):
    """The model returned something unusable (wrong number of outputs, unencodable value)."""


WIRE_ERRORS: dict[str, type[MicrobatchError]] = {
    cls.__name__: cls
    for cls in (
        ModelError,
        DeadlineExceeded,
        QueueFull,
        BrokerUnavailable,
        NoWorkers,
        PoisonRequest,
        CodecError,
        ProtocolError,
        InvalidInput,
        InvalidOutput,
    )
}


def error_from_wire(
    type_name: str, message: str, *, index: int | None = None, stage: str | None = None
) -> MicrobatchError:
    """Rebuild a typed error from a reply's ``{type, message, stage}``; unknown types stay
    generic."""
    cls = WIRE_ERRORS.get(type_name, MicrobatchError)
    if cls is MicrobatchError:
        message = f"{type_name}: {message}"
    return cls(message, index=index, stage=stage)


def describe_error(exc: BaseException) -> str:
    """One line naming an error for a log: its type, and its message if it is one of ours
    (other exceptions' messages may quote the data that caused them)."""
    if isinstance(exc, MicrobatchError):
        return f"{exc.type}: {exc.message}"
    return type(exc).__name__
