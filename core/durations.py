"""Durations: one parser for the command line (``--since 2h``) and every duration setting
(``WEBHOOKS_SWEEP_INTERVAL=15s``), and their display.

Accepted: unit parts ``30s``, ``10m``, ``2h``, ``3d``, ``1w``, ``250ms``, combined as
``1h30m`` (a part may have decimals: ``1.5h``); plain seconds ``2`` or ``2.5``; ISO 8601
durations ``PT30S``, ``P3D``, ``P1DT2H30M``, ``PT0.2S``. Months and years have no fixed
length and are refused.
"""

from __future__ import annotations

import re
from datetime import timedelta

from core.errors import WebhooksError

_UNITS = {"w": 604800.0, "d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
_NUMBER = r"\d+(?:\.\d+)?"
_PART = re.compile(rf"({_NUMBER})(ms|[wdhms])")
_SECONDS = re.compile(rf"{_NUMBER}")
_ISO = re.compile(
    rf"p(?:(?P<w>{_NUMBER})w)?(?:(?P<d>{_NUMBER})d)?"
    rf"(?:t(?:(?P<h>{_NUMBER})h)?(?:(?P<m>{_NUMBER})m)?(?:(?P<s>{_NUMBER})s)?)?"
)
EXAMPLES = "30s, 10m, 2h, 3d, 1h30m, plain seconds (2.5) or ISO 8601 (PT30S, P3D)"


class DurationError(WebhooksError, ValueError):
    """A duration string could not be parsed."""


def parse_duration(text: str) -> timedelta:
    """``text`` as a duration; :class:`DurationError` (a ValueError) names what is accepted."""
    value = text.strip().lower()
    if _SECONDS.fullmatch(value):
        return timedelta(seconds=float(value))
    if value.startswith("p"):
        return _parse_iso(text, value)
    pos = 0
    total = 0.0
    for match in _PART.finditer(value):
        if match.start() != pos:
            break
        total += float(match.group(1)) * _UNITS[match.group(2)]
        pos = match.end()
    if pos != len(value) or not value:
        raise DurationError(f"not a duration: {text!r} (use e.g. {EXAMPLES})")
    return timedelta(seconds=total)


def _parse_iso(text: str, value: str) -> timedelta:
    match = _ISO.fullmatch(value)
    # "P" and "PT" alone match the pattern with no part: not a duration either.
    if match is None or not any(match.groupdict().values()) or value.endswith("t"):
        date_part = value.split("t", 1)[0]
        hint = " (months and years have no fixed length)" if re.search(r"\d[my]", date_part) else ""
        raise DurationError(f"not a duration: {text!r}{hint} (use e.g. {EXAMPLES})")
    parts = {k: float(v) for k, v in match.groupdict().items() if v is not None}
    return timedelta(
        weeks=parts.get("w", 0),
        days=parts.get("d", 0),
        hours=parts.get("h", 0),
        minutes=parts.get("m", 0),
        seconds=parts.get("s", 0),
    )


def format_duration(delta: timedelta) -> str:
    seconds = int(delta.total_seconds())
    if seconds == 0:
        return "0s"
    sign = "-" if seconds < 0 else ""
    seconds = abs(seconds)
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if seconds >= size:
            parts.append(f"{seconds // size}{unit}")
            seconds %= size
    return sign + "".join(parts)
