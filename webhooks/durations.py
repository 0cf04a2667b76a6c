"""Human durations such as ``3d``, ``10m``, ``1h30m`` (CLI input) and their display."""

from __future__ import annotations

import re
from datetime import timedelta

_UNITS = {"w": 604800, "d": 86400, "h": 3600, "m": 60, "s": 1}
_PART = re.compile(r"(\d+)([wdhms])")


class DurationError(ValueError):
    """A duration string could not be parsed."""


def parse_duration(text: str) -> timedelta:
    value = text.strip().lower()
    if value.isdigit():
        return timedelta(seconds=int(value))
    pos = 0
    total = 0
    for match in _PART.finditer(value):
        if match.start() != pos:
            break
        total += int(match.group(1)) * _UNITS[match.group(2)]
        pos = match.end()
    if pos != len(value) or not value:
        raise DurationError(f"not a duration: {text!r} (use e.g. 3d, 12h, 10m, 1h30m)")
    return timedelta(seconds=total)


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
