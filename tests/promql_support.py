"""What the committed PromQL (deploy/alerts.yml, deploy/grafana/) is checked against: the
metrics core/metrics.py declares, with their labels."""

from __future__ import annotations

import re

from prometheus_client.metrics import MetricWrapperBase

from core import metrics

SUFFIXES = {
    "counter": ("_total",),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("_sum", "_count", ""),
}


def declared() -> dict[str, tuple[str, ...]]:
    """Exported sample name -> label names, for every metric in core.metrics."""
    names: dict[str, tuple[str, ...]] = {}
    for obj in vars(metrics).values():
        if isinstance(obj, MetricWrapperBase):
            for suffix in SUFFIXES[str(obj._type)]:
                extra = ("le",) if suffix == "_bucket" else ()
                names[obj._name + suffix] = (*obj._labelnames, *extra)
    return names


def undeclared(expr: str, known: dict[str, tuple[str, ...]]) -> list[str]:
    """What in ``expr`` names a metric or label core.metrics does not declare (empty: none;
    an expression that names no metric of ours is one finding)."""
    found: list[str] = []
    if expr.count("(") != expr.count(")"):
        found.append("unbalanced parentheses")
    used = set(re.findall(r"\bwebhooks_[a-z0-9_]+\b", expr))
    if not used:
        found.append("no webhooks_ metric")
    found += [f"undeclared metric {name}" for name in sorted(used - set(known))]
    labels = {label for name in used for label in known.get(name, ())}
    for name, matchers in re.findall(r"\b(webhooks_[a-z0-9_]+)\{([^}]*)\}", expr):
        for label in re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", matchers):
            if label not in known.get(name, ()):
                found.append(f"{name} has no label {label!r}")
    for grouping in re.findall(r"\b(?:by|on|without|ignoring)\s*\(([^)]*)\)", expr):
        for label in filter(None, (x.strip() for x in grouping.split(","))):
            if label not in labels:
                found.append(f"no metric here has label {label!r}")
    return found
