"""deploy/alerts.yml loads, has the rules the issue asks for, and names only metrics (and their
labels) that core/metrics.py declares."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]

from tests.promql_support import declared, undeclared

ALERTS = Path(__file__).resolve().parent.parent / "deploy" / "alerts.yml"
# promtool's unit tests of the rules (series in, alerts out at set times).
ALERTS_TEST = ALERTS.with_name("alerts_test.yml")
PROMTOOL = shutil.which("promtool")
REQUIRED = {
    "WebhookDeadLetters": "webhooks_dead_letters_total",
    "WebhookOldestPendingTooOld": "webhooks_oldest_pending_seconds",
    "WebhookDegradedClaims": "webhooks_degraded_claims_total",
    "WebhookDuplicateRateCollapsed": "webhooks_duplicates_total",
    "WebhookFastTierMemoryHigh": "webhooks_fast_tier_maxmemory_bytes",
    "WebhookPartitionsAheadRunningOut": 'webhooks_partition_days{state="ahead"}',
    "WebhookPartitionsNotDropped": 'webhooks_partition_days{state="past"}',
    # Issue 22: reconciliation found events the provider sent that never arrived.
    "WebhookReconcileMissingEvents": "webhooks_reconcile_missing_total",
    # Issue 35 item 5: a periodic job that stopped (beat down, its queue not consumed).
    "WebhookPeriodicJobStale": "webhooks_job_last_success_timestamp_seconds",
    "WebhookPeriodicJobNeverRan": "webhooks_job_last_success_timestamp_seconds",
    # Issue 35 item 4: the measured p99 queue lag over the queue_lag term (the budget).
    "WebhookQueueLagOverBudget": "webhooks_queue_lag_p99_seconds",
    "WebhookExpiredRowsNotDeleted": "webhooks_expired_rows",
    # Issue 34: a route disabled for a breaker open longer than WEBHOOKS_ROUTE_DISABLE_AFTER.
    "WebhookRouteDisabled": "webhooks_routes_disabled_total",
    # Issue 35 item 3: a provider's retry window not verified against its page for too long.
    "WebhookProviderWindowReviewDue": "webhooks_provider_window_review_due",
    # Issue 35 item 3: live processes deriving different dedup TTLs for a source.
    "WebhookTtlFingerprintsDisagree": "webhooks_ttl_fingerprint_disagreements",
    # Issue 38 item 1: the provider's endpoint disabled, deleted, elsewhere or missing types;
    # and the provider's API that could not say.
    "WebhookSubscriptionFinding": "webhooks_subscription_findings",
    "WebhookSubscriptionCannotCheck": "webhooks_subscription_findings",
    # Issue 38 item 3: a payload shape drifted (a key path new, changed type or gone).
    "WebhookPayloadShapeDrift": "webhooks_drift_findings",
}


def rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(ALERTS.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def test_the_alert_rules_cover_what_the_issue_asks_for() -> None:
    by_name = {r["alert"]: r for r in rules()}
    assert set(REQUIRED) <= set(by_name)
    for alert, metric in REQUIRED.items():
        rule = by_name[alert]
        assert metric in rule["expr"], alert
        assert re.fullmatch(r"\d+[smhd]", rule["for"]), alert
        assert rule["labels"]["severity"] in {"warning", "critical"}
        assert rule["annotations"]["summary"]
        assert rule["annotations"]["description"]


def test_every_metric_and_label_in_the_rules_is_declared() -> None:
    known = declared()
    assert "webhooks_dead_letters_total" in known  # the table itself is right
    assert undeclared('rate(webhooks_nope_total{source="a"}[5m])', known)  # and the check
    for rule in rules():
        expr: str = rule["expr"]
        assert undeclared(expr, known) == [], rule["alert"]
        used = set(re.findall(r"\bwebhooks_[a-z0-9_]+\b", expr))
        labels_of_rule = {label for name in used for label in known[name]}
        for label in re.findall(r"\$labels\.(\w+)", str(rule["annotations"])):
            assert label in labels_of_rule, f"{rule['alert']}: annotation label {label!r}"


@pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool is missing: `make install` installs it as root (Debian's prometheus)",
)
def test_the_rules_load_in_promtool_and_its_unit_tests_pass() -> None:
    """Prometheus' own tool parses every rule, and evaluates deploy/alerts_test.yml: among
    others, a maintenance job that stopped fires WebhookPeriodicJobStale two periods (and
    the rule's minute) after its last success, not before; beat never started fires
    WebhookPeriodicJobNeverRan (issue 35 item 5); a source's p99 queue lag over its budget
    fires WebhookQueueLagOverBudget after 30 minutes (item 4)."""
    assert PROMTOOL is not None
    checked = subprocess.run(  # noqa: S603
        [PROMTOOL, "check", "rules", str(ALERTS)], capture_output=True, text=True, check=False
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = subprocess.run(  # noqa: S603
        [PROMTOOL, "test", "rules", str(ALERTS_TEST)],
        capture_output=True,
        text=True,
        check=False,
        cwd=ALERTS.parent,
    )
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout
    stale = yaml.safe_load(ALERTS_TEST.read_text())["tests"][0]
    firing = [
        case
        for case in stale["alert_rule_test"]
        if case["alertname"] == "WebhookPeriodicJobStale" and case["exp_alerts"]
    ]
    assert [case["eval_time"] for case in firing] == ["42m"]
    # A source's p99 over its budget from minute 10 fires at 40 (30 minutes held), not at 39;
    # the source within its budget never fires, nor a stale reading of a worker that has not
    # measured since (issue 35 item 4).
    lag = next(
        case
        for case in yaml.safe_load(ALERTS_TEST.read_text())["tests"]
        if any(c["alertname"] == "WebhookQueueLagOverBudget" for c in case["alert_rule_test"])
    )
    fired = {
        c["eval_time"]: [a["exp_labels"]["source"] for a in c["exp_alerts"]]
        for c in lag["alert_rule_test"]
    }
    assert fired == {"9m": [], "39m": [], "40m": ["src_a"]}
