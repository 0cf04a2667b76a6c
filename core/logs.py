"""Structured logs (structlog): JSON lines for machines, coloured key=value lines for a person
at a terminal. No secret and no payload ever reaches a log line: callers log ids and outcomes
only, and a processor drops any key that looks like either.

``json=None`` (``WEBHOOKS_LOG_JSON`` unset) chooses by where the lines go: human-readable when
stderr is a terminal, JSON otherwise (a file, a pipe, a log collector). ``webhooks run``
decides once for its children, whose stderr is a pipe to it (see :mod:`webhooks.cli.pipeline`).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import MutableMapping
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    from types import ModuleType

FORBIDDEN_KEYS = frozenset(
    {"secret", "secrets", "payload", "body", "data", "signature", "token", "password"}
    | {"headers", "api_key"}
)


def _drop_sensitive(
    logger: Any, method: str, event_dict: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    for key in list(event_dict):
        if key.lower() in FORBIDDEN_KEYS:
            event_dict[key] = "[redacted]"
    return event_dict


def _dumps(obj: Any, **_: Any) -> str:
    # orjson: the receiver writes one line per request, so the renderer is on the hot path.
    return orjson.dumps(obj, default=str).decode()


def wants_json(json: bool | None, stream: Any = None) -> bool:
    """The explicit choice, else JSON unless ``stream`` (stderr) is a terminal."""
    if json is not None:
        return json
    return not _isatty(stream if stream is not None else sys.stderr)


def wants_colour(stream: Any = None) -> bool:
    """Colours on a terminal (or when FORCE_COLOR says the pipe ends at one), never with
    NO_COLOR (https://no-color.org)."""
    if os.environ.get("NO_COLOR"):
        return False
    if os.environ.get("FORCE_COLOR"):
        return True
    return _isatty(stream if stream is not None else sys.stderr)


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


# psycopg_pool logs "error connecting in 'pool-1': <why>" at each of its reconnection tries,
# about every 2 s while Postgres is away or refuses us: 22 plain lines in 20 s from one
# receiver. One structured line instead, then at most one a POOL_LINE_INTERVAL seconds,
# saying how many were held back.
POOL_LINE_INTERVAL = 60.0
_POOL_PREFIX = "error connecting in "


class _PoolConnectLines(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self._last: float | None = None
        self._held = 0
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.startswith(_POOL_PREFIX):
            return True
        now = time.monotonic()
        with self._lock:
            if self._last is not None and now - self._last < POOL_LINE_INTERVAL:
                self._held += 1
                return False
            held, self._held, self._last = self._held, 0, now
        pool, _, reason = message.removeprefix(_POOL_PREFIX).partition(": ")
        get_logger("psycopg.pool").warning(
            "db.connect_failed",
            pool=pool.strip("'"),
            reason=" ".join(line.strip() for line in reason.splitlines())[:240],
            held_back=held,
        )
        return False


def configure_logging(level: str = "INFO", *, json: bool | None = None, lazy: bool = False) -> None:
    """Log records at ``level`` and above to stderr, as JSON lines or for a person.

    ``lazy`` (the CLI): structlog, with the rich tracebacks its console renderer loads (~60 ms),
    is imported and configured when the first line is logged, not now; most commands log
    nothing. The choices (JSON, colours, the stream) are made now either way."""
    # JSON carries a formatted traceback in a field; the console renderer formats it itself.
    as_json, colours, stream = wants_json(json), wants_colour(), sys.stderr
    logging.basicConfig(level=level, stream=sys.stderr, format="%(message)s", force=False)
    pool = logging.getLogger("psycopg.pool")
    if not any(isinstance(f, _PoolConnectLines) for f in pool.filters):
        pool.addFilter(_PoolConnectLines())

    def apply(structlog: ModuleType) -> None:
        tail: list[Any] = (
            [structlog.processors.format_exc_info, structlog.processors.JSONRenderer(_dumps)]
            if as_json
            else [structlog.dev.ConsoleRenderer(colors=colours)]
        )
        structlog.configure(
            processors=[
                structlog.contextvars.merge_contextvars,
                structlog.processors.add_log_level,
                structlog.processors.TimeStamper(fmt="iso", utc=True),
                _drop_sensitive,
                *tail,
            ],
            wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level)),
            # One write per line (print() writes the line and its newline apart, and another
            # thread, Celery's logging, could land between them: tests/test_log_lines.py).
            logger_factory=structlog.WriteLoggerFactory(file=stream),
            cache_logger_on_first_use=True,
        )

    global _pending  # noqa: PLW0603 (one configuration per process)
    with _lock:
        _pending = apply if lazy else None
    if not lazy:
        apply(_structlog())


# A lazy configuration not applied yet (configure_logging(lazy=True)), and its guard.
_pending: Any = None
_lock = threading.Lock()


def _structlog() -> ModuleType:
    """structlog, configured by a pending lazy :func:`configure_logging` first if any."""
    global _pending  # noqa: PLW0603 (applied once, then cleared)
    import structlog  # noqa: PLC0415 (structlog loads rich's tracebacks: ~60 ms of a CLI run that logs nothing)

    if _pending is not None:
        with _lock:
            apply, _pending = _pending, None
        if apply is not None:
            apply(structlog)
    return structlog


class _Logger:
    """structlog's logger ``name``, made when it first logs (so importing a module that has
    a logger does not import structlog)."""

    __slots__ = ("_logger", "_name")

    def __init__(self, name: str) -> None:
        self._name = name
        self._logger: Any = None

    def __getattr__(self, attr: str) -> Any:
        logger = self._logger
        if logger is None:
            logger = self._logger = _structlog().get_logger(self._name)
        return getattr(logger, attr)


def get_logger(name: str) -> Any:
    return _Logger(name)
