"""The queue-lag term follows the measured p99 (issue 35 item 4; seeds 000 and 003): the p99
from receipt to final outcome read from Postgres (models/queue_lag.py), exported beside the
budget by a real worker's maintenance, shown by ``webhooks ttl explain`` (80 columns and
--json), and never changing the term itself."""

from __future__ import annotations

import json
import subprocess
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from core.settings import Settings
from core.ttl import QUEUE_LAG_WINDOW, TtlOverrides
from models import queue_lag, requeue
from tasks import capacity
from tests.conftest import BIN, free_port, wait_for_port
from tests.conftest import test_env as subprocess_env
from tests.factories import MadeSource, source_ttl
from tests.retention_support import accept, kill, new_source, succeed
from tests.workers import Broker, running_worker, scrape_metrics, wait_for, worker_settings

HOUR = timedelta(hours=1)
MIN = timedelta(minutes=1)


def percentile_cont(values: list[float], q: float) -> float:
    """Postgres' percentile_cont: linear between the two nearest ranks."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (position - low) * (ordered[high] - ordered[low])


def webhooks_cli(*args: str, columns: int = 200) -> subprocess.CompletedProcess[str]:
    return subprocess.run(  # noqa: S603
        [str(BIN / "webhooks"), *args],
        env=subprocess_env(COLUMNS=str(columns)),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _now() -> datetime:
    """A pinned instant near the real one (the shared database's partitions are laid out
    from today), whole seconds."""
    return datetime.now(UTC).replace(microsecond=0)


def _received(settings: Settings, source: MadeSource, name: str, at: datetime) -> int:
    """Accepted at ``at`` (one route): its delivery's id."""
    _, ids = accept(settings, source, f"evt_{source.id}_{name}", at)
    (delivery_id,) = ids
    return delivery_id


def test_the_p99_is_read_from_the_database_per_source_backlog_included(
    settings: Settings, sessions: sessionmaker[Session], engine: Engine, made: list[MadeSource]
) -> None:
    now = _now()
    source = new_source(sessions, settings, made)
    other = new_source(sessions, settings, made)
    lags: list[float] = []
    for i in range(95):  # the bulk: received 10 h ago, succeeded a minute later
        at = now - 10 * HOUR + i * MIN
        succeed(sessions, _received(settings, source, f"ok{i}", at), at + MIN)
        lags.append(60.0)
    at = now - 20 * HOUR  # dead 3 h after it arrived: its outcome is its dead_at
    kill(sessions, _received(settings, source, "dead", at), at + 3 * HOUR)
    lags.append(3 * 3600.0)
    _received(settings, source, "pending", now - 2 * HOUR)  # unfinished: its age so far
    lags.append(2 * 3600.0)
    # Succeeded only after the instant measured at: unfinished then, its age at that instant.
    at = now - 5 * HOUR
    succeed(sessions, _received(settings, source, "later", at), now + HOUR)
    lags.append(5 * 3600.0)
    # Before the window and still unfinished: the backlog counts, at its age (over the window).
    for hours in (28, 30):
        _received(settings, source, f"backlog{hours}", now - hours * HOUR)
        lags.append(hours * 3600.0)
    # Not counted: finished before the window; replayed (the replay grace's); discarded.
    at = now - 30 * HOUR
    succeed(sessions, _received(settings, source, "old", at), at + HOUR)
    at = now - 6 * HOUR
    replayed = _received(settings, source, "replayed", at)
    kill(sessions, replayed, at + MIN)
    discarded = _received(settings, source, "discarded", at)
    kill(sessions, discarded, at + MIN)
    with sessions() as session, session.begin():
        assert requeue.replay(session, replayed, now=at + HOUR, publish_grace=MIN)
        assert requeue.discard(session, [discarded], now=at + HOUR) == [discarded]
    # Another source's slow deliveries are its own.
    at = now - HOUR
    succeed(sessions, _received(settings, other, "slow", at), at + 50 * MIN)

    with engine.connect() as conn:
        measured = queue_lag.measure(conn, now, QUEUE_LAG_WINDOW)
        alone = queue_lag.measure(conn, now, QUEUE_LAG_WINDOW, source.id)
    mine = measured[source.id]
    assert mine.deliveries == len(lags) == 100
    assert mine.p99 is not None
    assert mine.p99.total_seconds() == pytest.approx(percentile_cont(lags, 0.99))
    assert mine.p99 > QUEUE_LAG_WINDOW  # the backlog shows, though it is older than the window
    assert alone == {source.id: mine}
    assert measured[other.id].p99 == 50 * MIN
    assert measured[other.id].deliveries == 1
    # Before the backlog arrived nothing of it counts; a day on, the bulk has left the window.
    with engine.connect() as conn:
        earlier = queue_lag.measure(conn, now - 31 * HOUR, QUEUE_LAG_WINDOW, source.id)
        later = queue_lag.measure(conn, now + 21 * HOUR, QUEUE_LAG_WINDOW, source.id)
    assert earlier == {}
    # Left: the one pending from the window (23 h) and the backlog (49 h, 51 h).
    assert later[source.id].deliveries == 3
    last = later[source.id].p99
    assert last is not None
    assert last.total_seconds() == pytest.approx(
        percentile_cont([23 * 3600.0, 49 * 3600.0, 51 * 3600.0], 0.99)
    )


def test_maintenance_exports_p99_and_budget_and_never_changes_the_term(
    settings: Settings, sessions: sessionmaker[Session], engine: Engine, made: list[MadeSource]
) -> None:
    """The term is the configured floor: measured over it or far under it, the source's
    queue_lag term and its dedup TTL stay what is configured (item 4: alert only)."""
    now = _now()
    slow = new_source(sessions, settings, made, ttl=TtlOverrides(queue_lag=HOUR))
    fast = new_source(sessions, settings, made)
    idle = new_source(sessions, settings, made)
    before = {s.id: source_ttl(sessions, settings, s.id) for s in (slow, fast, idle)}
    for i in range(3):
        at = now - 5 * HOUR + i * MIN
        succeed(sessions, _received(settings, slow, f"s{i}", at), at + 2 * HOUR)
        succeed(sessions, _received(settings, fast, f"f{i}", at), at + timedelta(seconds=2))
    lags = capacity.record_queue_lag(engine, settings, now)
    assert lags is not None
    by_id = {lag.source_id: lag for lag in lags}
    assert by_id[slow.id].measured.p99 == 2 * HOUR
    assert by_id[fast.id].measured.p99 == timedelta(seconds=2)
    assert by_id[idle.id].measured.p99 is None
    assert by_id[slow.id].queue_lag_override == HOUR
    from core import metrics  # noqa: PLC0415

    def gauge(metric: object, source: MadeSource) -> float:
        return float(metric.labels(source.public_id)._value.get())  # type: ignore[attr-defined]

    assert gauge(metrics.QUEUE_LAG_P99, slow) == 7200
    assert gauge(metrics.QUEUE_LAG_BUDGET, slow) == 3600
    assert gauge(metrics.QUEUE_LAG_P99, fast) == 2
    assert gauge(metrics.QUEUE_LAG_BUDGET, fast) == settings.queue_lag_budget.total_seconds()
    assert gauge(metrics.QUEUE_LAG_P99, idle) == 0
    # When it was measured: the alert counts only fresh readings.
    assert gauge(metrics.QUEUE_LAG_MEASURED, idle) == now.timestamp()
    after = {s.id: source_ttl(sessions, settings, s.id) for s in (slow, fast, idle)}
    assert after == before


def test_ttl_explain_shows_the_measured_p99_beside_the_budget_in_80_columns(
    settings: Settings, sessions: sessionmaker[Session], made: list[MadeSource]
) -> None:
    """``ttl explain`` reads the p99 when it runs (the database's clock: the rows are placed
    relative to it), in the table under queue_lag and in --json; the term is unchanged."""
    now = _now()
    slow = new_source(sessions, settings, made, provider="stripe", ttl=TtlOverrides(queue_lag=HOUR))
    for i in range(5):
        at = now - 6 * HOUR + i * MIN
        succeed(sessions, _received(settings, slow, f"s{i}", at), at + 2 * HOUR)
    idle = new_source(sessions, settings, made, provider="stripe")

    done = webhooks_cli("ttl", "explain", slow.public_id, columns=80)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    term = next(i for i, line in enumerate(lines) if " queue_lag " in line)
    assert "1h" in lines[term]
    assert "source override" in lines[term]
    measured = lines[term + 1]  # beside the budget: the next row
    assert "p99 measured" in measured
    assert "2h" in measured
    assert "7200" in measured
    assert "last 1d (5" in measured
    assert "OVER the budget" in done.stdout

    as_json = webhooks_cli("ttl", "explain", slow.public_id, "--json")
    assert as_json.returncode == 0, as_json.stderr
    view = json.loads(as_json.stdout)
    assert view["queue_lag_measured"] == {
        "p99": "2h",
        "p99_seconds": 7200.0,
        "deliveries": 5,
        "window": "1d",
        "window_seconds": 86400,
        "budget": "1h",
        "budget_seconds": 3600,
        "over_budget": True,
    }
    # Measured over its budget, the term is still the configured one.
    assert {t["name"]: t["seconds"] for t in view["terms"]}["queue_lag"] == 3600

    quiet = webhooks_cli("ttl", "explain", idle.public_id, columns=80)
    assert quiet.returncode == 0, quiet.stderr
    assert "no delivery in the last 1d" in quiet.stdout
    assert max(len(line) for line in quiet.stdout.splitlines()) <= 80
    quiet_json = json.loads(webhooks_cli("ttl", "explain", idle.public_id, "--json").stdout)
    assert quiet_json["queue_lag_measured"]["p99"] is None
    assert quiet_json["queue_lag_measured"]["over_budget"] is False
    assert quiet_json["queue_lag_measured"]["budget_seconds"] == 86400


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_worker_exports_the_measured_p99_beside_the_budget_after_maintenance(
    tmp_path: Path, settings: Settings, sessions: sessionmaker[Session], made: list[MadeSource]
) -> None:
    """A real worker's maintenance reads the p99 from the database (rows another process
    wrote) and its metrics server exports it beside the budget, per source."""
    now = _now()  # the worker decides on the database's clock, a moment after this
    slow = new_source(sessions, settings, made, ttl=TtlOverrides(queue_lag=HOUR))
    for i in range(4):
        at = now - 5 * HOUR + i * MIN
        succeed(sessions, _received(settings, slow, f"w{i}", at), at + 90 * MIN)
    port = free_port()
    broker = Broker(worker_settings())
    try:
        with running_worker(
            "queue-lag",
            tmp_path,
            pool="prefork",
            concurrency=1,
            worker_metrics_port=port,
            metrics_dir=str(tmp_path / "metrics"),
            admission=False,
        ) as worker:
            wait_for_port(port, worker.proc)
            broker.maintenance()
            p99 = ("webhooks_queue_lag_p99_seconds", (("source", slow.public_id),))
            budget = ("webhooks_queue_lag_budget_seconds", (("source", slow.public_id),))
            # The run finished without an error (the gauges are set even when it fails).
            done = ("webhooks_job_last_success_timestamp_seconds", (("job", "maintenance"),))
            measured_at = (
                "webhooks_queue_lag_measured_timestamp_seconds",
                (("source", slow.public_id),),
            )

            def measured() -> dict[tuple[str, tuple[tuple[str, str], ...]], float] | None:
                samples = scrape_metrics(port)
                wanted = (p99, budget, done)
                return samples if all(key in samples for key in wanted) else None

            samples = wait_for(measured, timeout=60, what="the maintenance run's queue lag")
    finally:
        broker.close()
    assert samples[p99] == 90 * 60
    assert samples[budget] == 3600  # the source's override, not WEBHOOKS_QUEUE_LAG_BUDGET
    assert now.timestamp() <= samples[measured_at] <= time.time()
    assert now.timestamp() <= samples[done] <= time.time()
