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
from collections.abc import MutableMapping
from typing import Any

import orjson
import structlog

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


def configure_logging(level: str = "INFO", *, json: bool | None = None) -> None:
    # JSON carries a formatted traceback in a field; the console renderer formats it itself.
    tail: list[Any] = (
        [structlog.processors.format_exc_info, structlog.processors.JSONRenderer(_dumps)]
        if wants_json(json)
        else [structlog.dev.ConsoleRenderer(colors=wants_colour())]
    )
    logging.basicConfig(level=level, stream=sys.stderr, format="%(message)s", force=False)
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
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


def get_logger(name: str) -> Any:
    return structlog.get_logger(name)
