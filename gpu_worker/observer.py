"""BatchObserver: what the batch loop reports as it works."""

from __future__ import annotations

from collections.abc import Sequence


class BatchObserver:
    """What the batch loop reports as it works (metrics, the supervisor's watchdog, logs).

    The base class ignores everything; subclasses override what they need. Calls are made on
    the loop's thread and must be quick.
    """

    def batch_started(
        self, size: int, queue_waits_s: Sequence[float], traces: Sequence[str]
    ) -> None:
        """The model is about to run on ``size`` items (their waits since arrival; the W3C
        traceparents of those that carry one)."""

    def batch_finished(self, size: int, inference_s: float) -> None:
        """The model call (with any splitting after an exception) has returned."""

    def answered(self, outcome: str, count: int = 1) -> None:
        """``count`` items got their answer: ok, model_error, invalid_output, deadline,
        codec_error, invalid_input, malformed, withdrawn or poison."""

    def dead_lettered(self, count: int) -> None:
        """``count`` entries were put in the dead-letter stream: poison, or entries no caller
        can be answered for (no request id or reply key, or a reply key outside the model's)."""

    def redelivered(self) -> None:
        """An entry was taken over from a dead consumer (or this one's, after an outage)."""

    def replies_sent(self) -> None:
        """A batch's replies are on their way: bookkeeping that need not delay them goes here."""
