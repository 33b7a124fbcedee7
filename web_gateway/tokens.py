"""The bearer tokens a gateway process accepts; its tokens file is read again when it changes
(a rotated Kubernetes Secret, an edited file), without a restart."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from .settings import GatewaySettings

log = logging.getLogger("microbatch.gateway")

CHECK_EVERY_S = 1.0  # how often a request looks whether the file changed (one stat)

_Stamp = tuple[int, int, int] | None  # (inode, mtime ns, size) of the file; None if unreadable
_NS = 1_000_000_000


class Tokens:
    """The accepted tokens (empty: auth off), from the settings' tokens and tokens file.

    A changed file is read once it has kept its new stamp for a check, or was last written
    at least a check's interval ago (so a file being written in place is not read
    half-written, and a change made while no request came is in force at the next); one that
    cannot be read, is not UTF-8 or holds no token leaves the tokens read before in force (a
    warning, once a change).
    """

    def __init__(
        self,
        settings: GatewaySettings,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._settings = settings
        self._path: Path | None = settings.auth_tokens_file
        self._clock = clock
        self._wall_clock = wall_clock
        self._stamp = self._stat()
        self._seen = self._stamp  # the stamp the last check found
        self._warned: _Stamp = self._stamp
        self._next_check = clock() + CHECK_EVERY_S
        self.current = _encoded(settings.tokens())

    def get(self) -> list[bytes]:
        """The tokens in force (at most one stat a second, on some request's way)."""
        if self._path is not None:
            now = self._clock()
            if now >= self._next_check:
                self._next_check = now + CHECK_EVERY_S
                self._check()
        return self.current

    def _check(self) -> None:
        stamp = self._stat()
        settled, self._seen = stamp == self._seen or self._written_long_ago(stamp), stamp
        if stamp == self._stamp or not settled:
            return
        try:
            tokens = self._settings.tokens()
        except OSError as exc:
            self._warn(stamp, exc.strerror or str(exc))
            return
        except UnicodeDecodeError:  # its bytes are not quoted: they may be tokens
            self._warn(stamp, "not UTF-8 text")
            return
        except ValueError:
            self._warn(stamp, "it holds no token")
            return
        self._stamp, self.current = stamp, _encoded(tokens)
        log.info("read the tokens file %s again: %d token(s) in force", self._path, len(tokens))

    def _written_long_ago(self, stamp: _Stamp) -> bool:
        """Whether the file was last written at least a check's interval ago: a change made
        while no request came (so no check) is used at once, not after one more request."""
        if stamp is None:
            return False
        return self._wall_clock() * _NS - stamp[1] >= CHECK_EVERY_S * _NS

    def _warn(self, stamp: _Stamp, why: str) -> None:
        if stamp != self._warned:
            self._warned = stamp
            log.warning(
                "the tokens file %s changed but cannot be used (%s): the tokens read before "
                "stay in force", self._path, why,
            )  # fmt: skip

    def _stat(self) -> _Stamp:
        if self._path is None:
            return None
        try:
            found = os.stat(self._path)
        except OSError:
            return None
        return found.st_ino, found.st_mtime_ns, found.st_size


def _encoded(tokens: frozenset[str]) -> list[bytes]:
    return [token.encode() for token in tokens]
