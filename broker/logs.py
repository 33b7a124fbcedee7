"""Logging set-up shared by workers and gateways: plain text, or one JSON object per line.

Log records carry events, ids and sizes, never payloads or credentials.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from datetime import datetime, timezone
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(process)d] %(message)s"
FORMATS = ("text", "json")
LEVELS = ("debug", "info", "warning", "error", "critical")


def check_level(level: str) -> str:
    """``level`` (any case) as a logging level name, e.g. ``"INFO"``.

    Raises ValueError, with a one-line message for a command line, unless it is one of LEVELS.
    """
    if level.lower() not in LEVELS:
        raise ValueError(f"--log-level must be one of {', '.join(LEVELS)}, not {level!r}")
    return level.upper()


def redact_url(url: str) -> str:
    """``url`` with its password (in the userinfo or a ``password=`` query) replaced by ``***``.

    What a log may show of a Redis URL: scheme, user, host, port, db.
    """
    try:
        parts = urlsplit(url)
        netloc = parts.netloc
        userinfo, at, host = netloc.rpartition("@")
        if at:
            user, colon, _password = userinfo.partition(":")
            netloc = f"{user}:***@{host}" if colon else f"{user}@{host}"
        query = parts.query
        if "password" in query.lower():
            pairs = parse_qsl(query, keep_blank_values=True)
            query = urlencode(
                [(k, "***" if k.lower() == "password" else v) for k, v in pairs], safe="*"
            )
        if "://" not in url:
            return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
        query = f"?{query}" if query else ""
        fragment = f"#{parts.fragment}" if parts.fragment else ""
        return f"{parts.scheme}://{netloc}{parts.path}{query}{fragment}"
    except ValueError:
        return "<a URL that cannot be parsed>"


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, pid, message (and the exception)."""

    def format(self, record: logging.LogRecord) -> str:
        event = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
            "pid": record.process,
            "message": record.getMessage(),
        }
        if record.exc_info:
            event["exception"] = self.formatException(record.exc_info)
        return json.dumps(event, ensure_ascii=False)


def configure_logging(level: str = "INFO", fmt: str = "text") -> None:
    """Send logs to stderr at ``level``, as ``text`` or ``json`` lines."""
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {FORMATS}, not {fmt!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


class ThrottledWarning:
    """A warning about something that may repeat without end (garbage an outsider keeps
    writing): logged the first time, then at most once every ``every_s`` seconds, saying how
    many times it happened meanwhile. ``message`` takes the count, then the latest detail."""

    def __init__(self, logger: logging.Logger, message: str, every_s: float = 60.0) -> None:
        self.logger = logger
        self.message = message
        self.every_s = every_s
        self.count = 0
        self._next = float("-inf")

    def note(self, detail: str) -> None:
        """Count one occurrence; log if the last line was long enough ago."""
        self.count += 1
        now = time.monotonic()
        if now >= self._next:
            self.logger.warning(self.message, self.count, detail)
            self.count = 0
            self._next = now + self.every_s
