"""The console's charts: per-bucket series drawn as inline SVG (no script, no external asset,
so the strict CSP holds). Pure: the numbers come from :func:`models.console.activity`."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from models.console import Activity

WIDTH = 600
HEIGHT = 140
PAD = 4  # around the plot, in the viewBox's units


@dataclass(frozen=True)
class Line:
    """One series: its class (colour), legend, the polyline segments to draw (a gap where a
    value is missing) and its raw values as the page states them (``data-values``)."""

    name: str
    label: str
    segments: list[str]
    dots: list[tuple[str, str]]  # a value alone between gaps: a dot (x, y), not a line
    values: str
    total: float


@dataclass(frozen=True)
class Chart:
    title: str
    unit: str  # of the y axis
    top: str  # the y axis' highest value, as shown
    start: str  # the first bucket's time, UTC
    end: str  # the end of the last bucket
    lines: list[Line]
    width: int = WIDTH
    height: int = HEIGHT


def _number(value: float) -> str:
    return f"{value:.3g}" if value < 1000 else f"{value:,.0f}"


def line_chart(
    title: str,
    unit: str,
    series: list[tuple[str, str, list[float | None]]],
    *,
    start: datetime,
    step: timedelta,
    scale: float = 1.0,
) -> Chart:
    """``series``: (name, label, one value per bucket or None), drawn as value times ``scale``."""
    buckets = max((len(values) for _, _, values in series), default=0)
    highest = max(
        (v * scale for _, _, values in series for v in values if v is not None), default=0.0
    )
    top = highest if highest > 0 else 1.0
    span_x = (WIDTH - 2 * PAD) / max(buckets - 1, 1)
    span_y = HEIGHT - 2 * PAD
    lines = []
    for name, label, values in series:
        segments: list[str] = []
        points: list[str] = []
        for i, value in enumerate(values):
            if value is None:
                if points:
                    segments.append(" ".join(points))
                points = []
                continue
            x = PAD + i * span_x
            y = HEIGHT - PAD - (value * scale / top) * span_y
            points.append(f"{x:.1f},{y:.1f}")
        if points:
            segments.append(" ".join(points))
        dots = [tuple(one.split(",")) for one in segments if " " not in one]
        segments = [many for many in segments if " " in many]
        raw = ",".join("" if v is None else _number(v) for v in values)
        total = sum(v for v in values if v is not None)
        lines.append(Line(name, label, segments, [(x, y) for x, y in dots], raw, total))
    return Chart(
        title,
        unit,
        _number(top),
        f"{start:%Y-%m-%d %H:%M}",
        f"{start + buckets * step:%H:%M} UTC",
        lines,
    )


def charts_of(activity: Activity) -> list[Chart]:
    """A window's two charts: what happened per minute, and the receipt-to-success lag."""
    minutes = activity.step.total_seconds() / 60
    per = "per minute" if minutes == 1 else f"per minute, {minutes:.0f}-minute buckets"
    counts: list[tuple[str, str, list[float | None]]] = [
        ("accepted", "accepted", list(map(float, activity.accepted))),
        ("succeeded", "succeeded", list(map(float, activity.succeeded))),
        ("retrying", "retried", list(map(float, activity.retrying))),
        ("dead", "dead, not replayed", list(map(float, activity.dead))),
    ]
    lag: list[tuple[str, str, list[float | None]]] = [
        ("p50", "p50", list(activity.p50)),
        ("p99", "p99", list(activity.p99)),
    ]
    return [
        line_chart(
            f"Events, last {activity.window}",
            per,
            counts,
            start=activity.start,
            step=activity.step,
            scale=1 / minutes,
        ),
        line_chart(
            f"Receipt to success, last {activity.window}",
            "seconds",
            lag,
            start=activity.start,
            step=activity.step,
        ),
    ]
