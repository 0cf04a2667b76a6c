"""deploy/grafana/webhooks.json (issue 36 item 6): a Grafana dashboard over the metrics the
pipeline exports. Every query names metrics and labels core/metrics.py declares, and parses
as PromQL in Prometheus' own tool once Grafana's variables are given values."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]

from tests.promql_support import declared, undeclared

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "webhooks.json"
PROMTOOL = shutil.which("promtool")
# What Grafana puts in place of its variables, for PromQL's own parser.
VARIABLES = {"$__rate_interval": "5m", "$source": ".*"}
# Each part of the pipeline has its panels (the issue: a dashboard over what it exports).
REQUIRED = {
    "webhooks_requests_total",
    "webhooks_deliveries_total",
    "webhooks_dead_letters_total",
    "webhooks_receipt_to_success_seconds_bucket",
    "webhooks_route_breaker_state",
    "webhooks_job_last_success_timestamp_seconds",
    "webhooks_partition_days",
}


def panels() -> list[dict[str, Any]]:
    return [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["type"] != "row"]


def queries() -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in panels() for t in p["targets"]]


def test_every_query_names_declared_metrics_and_labels() -> None:
    known = declared()
    found = queries()
    assert len(found) >= 30
    for title, expr in found:
        assert undeclared(expr, known) == [], title
    used = {m for _, expr in found for m in re.findall(r"\bwebhooks_[a-z0-9_]+\b", expr)}
    assert used >= REQUIRED, REQUIRED - used
    # The source picker reads a declared metric's declared label.
    (variable,) = [
        v for v in json.loads(DASHBOARD.read_text())["templating"]["list"] if v["name"] == "source"
    ]
    metric, label = re.fullmatch(r"label_values\((\w+), (\w+)\)", variable["definition"]).groups()  # type: ignore[union-attr]
    assert label in known[metric]


def test_every_metric_the_pipeline_exports_has_a_panel() -> None:
    """Each metric core.metrics declares is drawn by some panel (one of its samples: a
    counter's ``_total``, a histogram's ``_bucket`` or ``_count``...): a metric added without
    a panel fails here, naming it."""
    used = {m for _, expr in queries() for m in re.findall(r"\bwebhooks_[a-z0-9_]+\b", expr)}
    families: dict[str, set[str]] = {}
    for sample in declared():
        family = re.sub(r"(_total|_bucket|_sum|_count)$", "", sample)
        families.setdefault(family, set()).add(sample)
    without = sorted(family for family, samples in families.items() if not samples & used)
    assert without == [], f"metrics without a panel in {DASHBOARD.name}: {without}"
    assert len(families) >= 50  # the check covers them all, not a few


def test_panels_do_not_overlap_and_each_has_a_unit() -> None:
    taken: set[tuple[int, int]] = set()
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        g = panel["gridPos"]
        cells = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not cells & taken, panel["title"]
        assert g["x"] + g["w"] <= 24, panel["title"]
        taken |= cells
    for panel in panels():
        assert panel["fieldConfig"]["defaults"]["unit"], panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]


@pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool is missing: `make install` installs it as root (Debian's prometheus)",
)
def test_every_query_parses_in_promtool(tmp_path: Path) -> None:
    """Each query as a recording rule: `promtool check rules` parses its PromQL."""
    assert PROMTOOL is not None
    rules = []
    for i, (_, query) in enumerate(queries()):
        expr = query
        for variable, value in VARIABLES.items():
            expr = expr.replace(variable, value)
        assert "$" not in expr, query
        rules.append({"record": f"dashboard:query_{i}", "expr": expr})
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    checked = subprocess.run(  # noqa: S603
        [PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True, check=False
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"{len(rules)} rules found" in checked.stdout
