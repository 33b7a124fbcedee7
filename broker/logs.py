"""Logging shared by every microbatch process (workers, gateways, the CLIs): plain text, or one
JSON object per line, in the same format everywhere.

Log records carry events, ids and sizes, never payloads or credentials.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
import traceback
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(process)d] %(message)s"
FORMATS = ("text", "json")
LEVELS = ("debug", "info", "warning", "error", "critical")


# What a text log writes escaped: line breaks (\n, \r and what else str.splitlines() breaks
# at: \v, \f, \x1c-\x1e, \x85, \u2028-\u2029), and every other control character (ESC
# starts the terminal sequences that move the cursor, erase or recolour lines: a forged line).
# A tab stays.
_UNSAFE = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029]")
_UNSAFE_IN_TRACEBACK = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029]")  # not \n
_NAMED = {"\n": "\\n", "\r": "\\r"}
# What JSON leaves raw but a reader of lines or a terminal does not: DEL, the C1 controls
# (NEL breaks a line for str.splitlines; CSI starts a terminal sequence) and the separators
_UNSAFE_IN_JSON = re.compile("[\x7f-\x9f\u2028\u2029]")


def _escaped(match: re.Match[str]) -> str:
    char = match.group()
    named = _NAMED.get(char)
    if named is not None:
        return named
    return f"\\x{ord(char):02x}" if ord(char) < 0x100 else f"\\u{ord(char):04x}"


def _exception_chain(exc: BaseException | None) -> list[BaseException]:
    """``exc`` and every exception a traceback of it shows (causes, contexts, a group's)."""
    chain: list[BaseException] = []
    seen: set[int] = set()
    pending = [exc]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        chain.append(current)
        pending.append(current.__cause__)
        if not current.__suppress_context__:
            pending.append(current.__context__)
        pending.extend(getattr(current, "exceptions", None) or ())
    return chain


class TextFormatter(logging.Formatter):
    """``TEXT_FORMAT``, one line per event: a line break or another control character in a
    message (a value a client chose, say) is written escaped (``\\n``, ``\\x1b``), so it
    cannot start a line of its own nor rewrite one on a terminal. An exception's traceback
    follows on lines of its own, and the same holds there: an exception's message (which may
    quote a client's input) stays on its own line too."""

    def __init__(self, fmt: str | None = TEXT_FORMAT, **kwargs: Any) -> None:
        super().__init__(fmt, **kwargs)

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        if not line.isprintable():  # the common line is: no search then
            line = _UNSAFE.sub(_escaped, line)
        return line

    def formatException(self, ei: Any) -> str:
        text = super().formatException(ei)
        for exc in _exception_chain(ei[1]):
            shown = "".join(traceback.format_exception_only(type(exc), exc)).rstrip("\n")
            if _UNSAFE.search(shown) is not None:
                text = text.replace(shown, _UNSAFE.sub(_escaped, shown))
        return _UNSAFE_IN_TRACEBACK.sub(_escaped, text)


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
        line = json.dumps(event, ensure_ascii=False)
        if not line.isprintable():  # the common line is: no search then
            line = _UNSAFE_IN_JSON.sub(lambda match: f"\\u{ord(match.group()):04x}", line)
        return line


def parse_level(level: str, option: str = "--log-level") -> str:
    """``level`` in lower case if it names a level (any case), else ValueError in one line."""
    name = str(level).strip().lower()
    if name not in LEVELS:
        raise ValueError(f"{option} must be one of {', '.join(LEVELS)}, not {level!r}")
    return name


def parse_format(fmt: str, option: str = "--log-format") -> str:
    """``fmt`` in lower case if it names a log format, else ValueError in one line."""
    name = str(fmt).strip().lower()
    if name not in FORMATS:
        raise ValueError(f"{option} must be one of {', '.join(FORMATS)}, not {fmt!r}")
    return name


def check_level(level: str) -> str:
    """``level`` (any case) as a logging level name, e.g. ``"INFO"``; ValueError in one line."""
    return parse_level(level).upper()


def formatter(fmt: str = "text") -> logging.Formatter:
    """The formatter every process uses for ``text`` or ``json`` logs."""
    return JsonFormatter() if parse_format(fmt) == "json" else TextFormatter()


def configure_logging(level: str = "INFO", fmt: str = "text") -> None:
    """Send logs to stderr at ``level``, as ``text`` or ``json`` lines."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter(fmt))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(parse_level(level).upper())


def dict_config(level: str = "info", fmt: str = "text", loggers: tuple[str, ...] = ()) -> Any:
    """The same set-up as :func:`configure_logging`, as a :func:`logging.config.dictConfig`
    (for servers that take one, e.g. gunicorn's ``logconfig_dict``); ``loggers`` are routed to
    the same handler without propagating (e.g. ``gunicorn.error``)."""
    name = parse_level(level).upper()
    json_lines = parse_format(fmt) == "json"
    chosen = {"()": "broker.logs.JsonFormatter" if json_lines else "broker.logs.TextFormatter"}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"microbatch": chosen},
        "handlers": {
            "stderr": {
                "class": "logging.StreamHandler",
                "formatter": "microbatch",
                "stream": "ext://sys.stderr",
            }
        },
        "root": {"level": name, "handlers": ["stderr"]},
        "loggers": {
            logger: {"level": name, "handlers": ["stderr"], "propagate": False}
            for logger in loggers
        },
    }


def redact_url(url: str) -> str:
    """``url`` with its passwords (in the userinfo, or a query option whose name holds
    ``password``, e.g. ``sentinel_password``) replaced by ``***``.

    What a log may show of a Redis URL: scheme, user, hosts, ports, db (or service and db).
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
                [(k, "***" if "password" in k.lower() else v) for k, v in pairs], safe="*"
            )
        if "://" not in url:
            return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
        query = f"?{query}" if query else ""
        fragment = f"#{parts.fragment}" if parts.fragment else ""
        return f"{parts.scheme}://{netloc}{parts.path}{query}{fragment}"
    except ValueError:
        return "<a URL that cannot be parsed>"


class Every:
    """Lets a repeated message through at most once per ``seconds`` (the first at once)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._next = float("-inf")

    def due(self) -> bool:
        """True if the message may be logged now (and starts the next period)."""
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + self.seconds
        return True

    def reset(self) -> None:
        """Let the next message through at once (the condition it reports has ended)."""
        self._next = float("-inf")


class ThrottledWarning:
    """A line about something that may repeat without end (garbage an outsider keeps writing,
    a model failing on every item): logged the first time, then at most once every
    ``every_s`` seconds, saying how many times it happened meanwhile. ``message`` takes the
    count, then the latest detail. At ``level`` (WARNING unless given)."""

    def __init__(
        self,
        logger: logging.Logger,
        message: str,
        every_s: float = 60.0,
        level: int = logging.WARNING,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.message = message
        self.every_s = every_s
        self.level = level
        self.clock = clock
        self.count = 0
        self._next = float("-inf")

    def note(self, detail: str, traceback_of: BaseException | None = None) -> None:
        """Count one occurrence; log if the last line was long enough ago (with the
        traceback of ``traceback_of``, if given)."""
        self.count += 1
        now = self.clock()
        if now >= self._next:
            self.logger.log(self.level, self.message, self.count, detail, exc_info=traceback_of)
            self.count = 0
            self._next = now + self.every_s
