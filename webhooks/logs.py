"""Structured JSON logs (structlog). No secret and no payload ever reaches a log line:
callers log ids and outcomes only, and a processor drops any key that looks like either."""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any

import orjson
import structlog

FORBIDDEN_KEYS = frozenset(
    {"secret", "secrets", "payload", "body", "data", "signature", "token", "password", "headers"}
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


def configure_logging(level: str = "INFO", *, json: bool = True) -> None:
    renderer: Any = (
        structlog.processors.JSONRenderer(serializer=_dumps)
        if json
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    logging.basicConfig(level=level, stream=sys.stderr, format="%(message)s", force=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _drop_sensitive,
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


def get_logger(name: str) -> Any:
    return structlog.get_logger(name)
