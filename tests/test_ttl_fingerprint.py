"""Every live process derives the same dedup TTLs (issue 35 item 3, its second half): each
receiver and worker records its TTL inputs (its providers' retry windows, the queue-lag,
clock-skew and replay-grace settings, the margin floor) in Postgres when it starts; maintenance
compares the live ones over every source, logs and exports a disagreement, and ``webhooks ttl
check`` lists the disagreeing processes and exits 4. A dead process's row stops counting once
not seen for WEBHOOKS_TTL_FINGERPRINT_STALE_AFTER on the database's clock (moved here by
moving the row's own ``last_seen`` back, never by a sleep).

Real Postgres, a real ``celery worker`` and a real ``webhooks serve``, ``ttl check`` as a
subprocess; the comparison itself is pure and checked against :mod:`core.ttl`."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY
from sqlalchemy import Engine, text

from core.providers import registry
from core.settings import Settings, SettingsError, load_settings
from core.ttl import TtlOverrides, effective_ttl
from core.ttl_fingerprint import (
    FingerprintError,
    ProcessTerms,
    SourceTerms,
    TtlInputs,
    compare,
)
from models import ttl_fingerprints
from models.ttl_fingerprints import Heartbeat
from tasks import horizon
from tests.conftest import BASE_ENV, BIN, free_port, make_settings, test_env, wait_for_port
from tests.factories import make_source
from tests.processes import receiver
from tests.workers import Broker, running_worker, scrape_metrics, wait_for, worker_settings

DISAGREE_EXIT = 4
DAY = timedelta(days=1)
# A day no built-in window is due for review on: ttl check's exit status is the processes'.
AS_OF = "2026-12-02"
T0 = datetime.fromisoformat("2026-12-02T12:00:00+00:00")


@pytest.fixture(autouse=True)
def _no_rows(engine: Engine) -> Iterator[None]:
    """Each test starts with no recorded process (other modules' killed ones may be there)."""
    with engine.begin() as conn:
        conn.execute(text("DELETE FROM ttl_fingerprints"))
    yield
    with engine.begin() as conn:
        conn.execute(text("DELETE FROM ttl_fingerprints"))


def _inputs(**changes: Any) -> TtlInputs:
    values: dict[str, Any] = {
        "windows": {name: p.retry_window for name, p in registry.providers().items()},
        "queue_lag": DAY,
        "clock_skew": timedelta(minutes=10),
        "replay_grace": 2 * DAY,
    }
    values.update(changes)
    return TtlInputs(**values)


def _process(pid: int, inputs: TtlInputs, role: str = "worker") -> ProcessTerms:
    return ProcessTerms("h1", pid, role, "production", T0, T0, inputs)


def _source(provider: str = "stripe", **overrides: timedelta) -> SourceTerms:
    return SourceTerms("src_1", "shop", provider, TtlOverrides(**overrides))


# The pure comparison -------------------------------------------------------------------------


@pytest.mark.parametrize("provider", sorted(registry.names()))
def test_a_recorded_fingerprint_derives_what_core_ttl_derives(provider: str) -> None:
    settings = make_settings(queue_lag_budget="3h", clock_skew_allowance="90s")
    mine = ttl_fingerprints.this_process_inputs(settings)
    again = TtlInputs.from_json(json.loads(json.dumps(mine.as_json())))  # through the row
    assert again == mine
    assert again.digest() == mine.digest()
    # Plain, and raised: a retry window override the other terms do not cover.
    for overrides in (TtlOverrides(), TtlOverrides(retry_window=90 * DAY, replay_grace=DAY)):
        expected = effective_ttl(provider, overrides, settings)
        derived = again.derive(provider, overrides)
        assert derived is not None
        assert (derived.total, derived.raised) == (expected.total, expected.raised)


def test_two_processes_with_another_lag_disagree_on_the_sources_that_take_it() -> None:
    one, two = _process(1, _inputs()), _process(2, _inputs(queue_lag=2 * DAY), "receiver")
    found = compare([two, one], [_source(), _source("github", queue_lag=DAY)])
    assert len(found) == 1  # github's source overrides the lag: both derive the same TTL
    shop = found[0]
    assert shop.source.name == "shop"
    assert [d.process.pid for d in shop.derived] == [1, 2]  # in (host, pid, role) order
    stripe = registry.get("stripe").retry_window
    extra = timedelta(minutes=10) + 2 * DAY
    assert [d.ttl for d in shop.derived] == [stripe + DAY + extra, stripe + 2 * DAY + extra]
    assert shop.differing == ("queue_lag",)
    assert shop.ttls() == (stripe + DAY + extra, stripe + 2 * DAY + extra)
    # Alone, or all alike: nothing to report.
    assert compare([one], [_source()]) == ()
    assert compare([one, _process(3, _inputs())], [_source()]) == ()


def test_another_window_a_missing_provider_and_the_margin_are_each_a_difference() -> None:
    stripe = registry.get("stripe").retry_window
    longer = _inputs(windows={**_inputs().windows, "stripe": stripe + DAY})
    found = compare([_process(1, _inputs()), _process(2, longer)], [_source()])
    assert found[0].differing == ("retry_window", "provider_window")
    # A source whose overridden window is longer than both still differs when raised.
    missing = _inputs(windows={k: v for k, v in _inputs().windows.items() if k != "stripe"})
    found = compare([_process(1, _inputs()), _process(2, missing)], [_source()])
    assert [d.ttl for d in found[0].derived][1] is None
    assert found[0].ttls()[-1] is None
    assert found[0].differing == ("retry_window", "provider_window")
    # A raised TTL (terms short of the window) is the window plus the margin: the skew setting.
    short = {"retry_window": DAY, "queue_lag": timedelta(0), "replay_grace": timedelta(0)}
    skewed = _inputs(clock_skew=timedelta(minutes=20))
    found = compare(
        [_process(1, _inputs()), _process(2, skewed)], [_source(clock_skew=timedelta(0), **short)]
    )
    assert found[0].differing == ("margin",)
    assert [d.ttl for d in found[0].derived] == [
        stripe + timedelta(minutes=10),
        stripe + timedelta(minutes=20),
    ]


@pytest.mark.parametrize(
    "data",
    [{"version": 2}, {"version": 1}, {"version": 1, "windows": [], "queue_lag": 1}, "text"],
    ids=["other-version", "missing-terms", "bad-windows", "not-an-object"],
)
def test_an_unreadable_fingerprint_is_refused_by_name(data: object) -> None:
    with pytest.raises(FingerprintError, match="fingerprint"):
        TtlInputs.from_json(data)


def test_the_stale_period_is_a_positive_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in BASE_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("WEBHOOKS_TTL_FINGERPRINT_STALE_AFTER", raising=False)
    assert load_settings(_env_file=None).ttl_fingerprint_stale_after == timedelta(minutes=10)
    monkeypatch.setenv("WEBHOOKS_TTL_FINGERPRINT_STALE_AFTER", "0s")
    with pytest.raises(SettingsError, match="WEBHOOKS_TTL_FINGERPRINT_STALE_AFTER must be pos"):
        load_settings(_env_file=None)


# Rows, staleness and maintenance, in this process ----------------------------------------------


def _db_now(engine: Engine) -> datetime:
    with engine.connect() as conn:
        now: datetime = conn.execute(text("SELECT now()")).scalar_one()
    return now


def _rows(engine: Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(
            conn.execute(
                text(
                    "SELECT host, pid, role, environment, digest, terms, started_at, last_seen"
                    " FROM ttl_fingerprints ORDER BY pid"
                )
            )
        )


def _backdate(engine: Engine, pid: int, by: timedelta) -> None:
    """The database's clock moved past the row: its last_seen moved back instead."""
    with engine.begin() as conn:
        conn.execute(
            text("UPDATE ttl_fingerprints SET last_seen = last_seen - :by WHERE pid = :pid"),
            {"by": by, "pid": pid},
        )


def _gauge(name: str) -> float | None:
    return REGISTRY.get_sample_value(name)


def test_maintenance_compares_the_live_rows_and_removes_the_dead(
    engine: Engine, settings: Settings, sessions: Any
) -> None:
    made = make_source(sessions, settings, provider="stripe")
    stale = settings.ttl_fingerprint_stale_after
    beats = [
        Heartbeat(settings, "worker", inputs=_inputs(), host="h1", pid=101),
        Heartbeat(settings, "receiver", inputs=_inputs(queue_lag=2 * DAY), host="h2", pid=202),
    ]
    for beat in beats:
        assert beat.beat(start=True)
    found = horizon.record_fingerprints(engine, settings, None)
    assert found is not None
    assert [p.key for p in found.processes] == [("h1", 101, "worker"), ("h2", 202, "receiver")]
    assert made.public_id in [d.source.public_id for d in found.disagreements]
    assert _gauge("webhooks_ttl_fingerprint_disagreements") == len(found.disagreements)
    assert _gauge("webhooks_ttl_fingerprint_processes") == 2  # noqa: PLR2004
    assert _gauge("webhooks_ttl_fingerprint_checked_timestamp_seconds") == found.at.timestamp()
    # The receiver not seen for just under the stale period still counts; at it, it does not.
    now = _db_now(engine)
    _backdate(engine, 202, stale - timedelta(seconds=1))
    with engine.connect() as conn:
        assert len(ttl_fingerprints.check(conn, settings, now).processes) == 2  # noqa: PLR2004
    _backdate(engine, 202, timedelta(seconds=1))
    with engine.connect() as conn:
        assert len(ttl_fingerprints.check(conn, settings, now).processes) == 1
    found = horizon.record_fingerprints(engine, settings, now)
    assert found is not None
    assert (found.pruned, found.disagreements) == (1, ())
    assert [r.pid for r in _rows(engine)] == [101]  # removed, not only ignored
    assert _gauge("webhooks_ttl_fingerprint_disagreements") == 0
    assert _gauge("webhooks_ttl_fingerprint_processes") == 1
    # A beat after its row was removed (the process was cut off, not dead) records it again.
    assert beats[1].beat()
    assert [r.pid for r in _rows(engine)] == [101, 202]


def test_a_heartbeat_that_cannot_reach_the_database_does_not_raise(settings: Settings) -> None:
    cut_off = make_settings(
        database_url=f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/nowhere",
        db_connect_timeout=1,
    )
    beat = Heartbeat(cut_off, "receiver", inputs=_inputs(), host="h9", pid=909)
    assert beat.beat(start=True) is False
    beat.stop()  # nothing to delete: one info line, no error


# Real processes --------------------------------------------------------------------------------


def _check(*args: str, as_of: str = AS_OF, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "webhooks"), "ttl", "check", "--as-of", as_of, *args],
        env=test_env(COLUMNS="80", **env),
        capture_output=True,
        text=True,
        timeout=60,
    )


def _row_of(engine: Engine, pid: int, role: str) -> Any:
    return next((r for r in _rows(engine) if (r.pid, r.role) == (pid, role)), None)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_worker_records_its_inputs_at_start_refreshes_them_and_forgets_them_at_stop(
    tmp_path: Path, engine: Engine
) -> None:
    before = _db_now(engine)
    with running_worker(
        "fingerprint",
        tmp_path,
        admission=False,
        queue_lag_budget=timedelta(hours=5),
        ttl_fingerprint_stale_after=timedelta(seconds=5),  # a beat a second
    ) as worker:
        row = wait_for(
            lambda: _row_of(engine, worker.pid, "worker"), timeout=30, what="the worker's row"
        )
        assert row.host == socket.gethostname()
        assert row.environment == "test"
        assert before <= row.started_at <= row.last_seen
        assert row.terms["queue_lag"] == 5 * 3600
        assert row.terms["windows"]["stripe"] == registry.get("stripe").retry_window.total_seconds()
        assert row.digest == TtlInputs.from_json(row.terms).digest()
        assert [r.pid for r in _rows(engine)] == [worker.pid]  # the main process only
        # Its heartbeat refreshes last_seen (moved back a minute here), started_at kept.
        _backdate(engine, worker.pid, timedelta(minutes=1))
        fresh = wait_for(
            lambda: (r := _row_of(engine, worker.pid, "worker")) and r.last_seen >= row.last_seen,
            timeout=30,
            what="the heartbeat",
        )
        assert fresh
        assert _row_of(engine, worker.pid, "worker").started_at == row.started_at
    assert _row_of(engine, worker.pid, "worker") is None  # a clean stop deletes it


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_processes_with_another_lag_are_found_by_maintenance_and_listed_until_one_dies(
    tmp_path: Path, engine: Engine, settings: Settings, sessions: Any
) -> None:
    made = make_source(sessions, settings, provider="stripe", name="fp-shop")
    port = free_port()
    broker = Broker(worker_settings())
    try:
        with (
            running_worker(
                "fp",
                tmp_path,
                admission=False,
                worker_metrics_port=port,
                metrics_dir=str(tmp_path / "metrics"),
                queue_lag_budget=DAY,
            ) as worker,
            receiver(WEBHOOKS_QUEUE_LAG_BUDGET="2d") as rcv,
        ):
            wait_for_port(port, worker.proc)
            wait_for(
                lambda: len(_rows(engine)) == 2,  # noqa: PLR2004
                timeout=30,
                what="both processes' rows",
            )
            assert _row_of(engine, rcv.proc.pid, "receiver").terms["queue_lag"] == 2 * 86400
            # Maintenance on the real worker: the gauges and one structured line.
            broker.maintenance()

            def measured() -> dict[str, float] | None:
                samples = {
                    name: value
                    for (name, _), value in scrape_metrics(port).items()
                    if name.startswith("webhooks_ttl_fingerprint_")
                }
                return samples if samples.get("webhooks_ttl_fingerprint_processes") else None

            samples = wait_for(measured, timeout=60, what="maintenance's fingerprint gauges")
            assert samples["webhooks_ttl_fingerprint_processes"] == 2  # noqa: PLR2004
            assert samples["webhooks_ttl_fingerprint_disagreements"] >= 1
            line = wait_for(
                lambda: next(
                    (x for x in worker.json_lines() if x["event"] == "ttl.fingerprints_disagree"),
                    None,
                ),
                timeout=30,
                what="the disagreement's log line",
            )
            assert line["level"] == "warning"
            assert made.public_id in line["sources"]
            assert line["differing"] == ["queue_lag"]
            assert sorted(line["processes"]) == sorted(
                f"{socket.gethostname()}:{pid}:{role}"
                for pid, role in ((worker.pid, "worker"), (rcv.proc.pid, "receiver"))
            )

            # ttl check lists the two processes, their TTLs and the lag, and exits 4.
            listed = _check("--json")
            assert listed.returncode == DISAGREE_EXIT, listed.stderr
            view = json.loads(listed.stdout)["processes"]
            assert len(view["disagreements"]) == samples["webhooks_ttl_fingerprint_disagreements"]
            shop = next(d for d in view["disagreements"] if d["source"] == made.public_id)
            stripe = registry.get("stripe").retry_window.total_seconds()
            extra = 600 + 2 * 86400  # the default skew and replay grace
            assert shop["differing"] == ["queue_lag"]
            assert sorted(
                (p["pid"], p["role"], p["dedup_ttl_s"], p["terms"]) for p in shop["processes"]
            ) == sorted(
                [
                    (worker.pid, "worker", stripe + 86400 + extra, {"queue_lag": 86400}),
                    (rcv.proc.pid, "receiver", stripe + 2 * 86400 + extra, {"queue_lag": 172800}),
                ]
            )
            human = _check()
            assert human.returncode == DISAGREE_EXIT, human.stderr
            lines = human.stdout.splitlines()
            at = lines.index(f"fp-shop ({made.public_id}, stripe):")
            assert lines[at + 1].split() == [
                "host", "pid", "role", "environment", "dedup", "TTL", "queue_lag"
            ]  # fmt: skip
            rows = {tuple(line.split()[1:3]) for line in lines[at + 2 : at + 4]}
            assert rows == {(str(worker.pid), "worker"), (str(rcv.proc.pid), "receiver")}
            assert "WEBHOOKS_QUEUE_LAG_BUDGET" in " ".join(human.stdout.split())

            # The receiver dies outright (no clean stop: its row stays) ...
            os.kill(rcv.proc.pid, signal.SIGKILL)
            rcv.proc.wait(10)
            assert _row_of(engine, rcv.proc.pid, "receiver") is not None
            assert _check().returncode == DISAGREE_EXIT  # still within the stale period
            # ... and is not seen for the stale period: it stops counting.
            _backdate(engine, rcv.proc.pid, settings.ttl_fingerprint_stale_after)
            agreed = _check()
            assert agreed.returncode == 0, agreed.stdout + agreed.stderr
            assert "The 1 live processes (0 receivers, 1 workers) derive the same" in " ".join(
                agreed.stdout.split()
            )
            broker.maintenance()
            wait_for(
                lambda: scrape_metrics(port).get(("webhooks_ttl_fingerprint_processes", ())) == 1,
                timeout=60,
                what="the next maintenance run",
            )
            assert scrape_metrics(port)[("webhooks_ttl_fingerprint_disagreements", ())] == 0
            assert _row_of(engine, rcv.proc.pid, "receiver") is None  # removed
    finally:
        broker.close()


def test_ttl_check_says_when_no_process_is_recorded_and_refuses_an_unreachable_database() -> None:
    quiet = _check()
    assert quiet.returncode == 0, quiet.stderr
    assert "No live receiver or worker has recorded its TTL inputs" in " ".join(
        quiet.stdout.split()
    )
    assert json.loads(_check("--json").stdout)["processes"] == {
        "stale_after_s": 600,
        "live": [],
        "unreadable": [],
        "disagreements": [],
    }
    gone = _check(
        WEBHOOKS_DATABASE_URL=f"postgresql://postgres@127.0.0.1:{free_port()}/nowhere",
        WEBHOOKS_DB_CONNECT_TIMEOUT="1",
    )
    assert gone.returncode == 1
    assert "Traceback" not in gone.stderr
    assert gone.stderr.strip().count("\n") == 0, gone.stderr


def test_a_disagreement_exits_4_over_windows_due_and_windows_only_reads_no_database(
    settings: Settings, sessions: Any
) -> None:
    make_source(sessions, settings, provider="stripe")
    for pid, lag in ((301, DAY), (302, 3 * DAY)):
        beat = Heartbeat(settings, "worker", inputs=_inputs(queue_lag=lag), host="h3", pid=pid)
        assert beat.beat(start=True)
    late = "2027-06-01"  # every built-in window is due for review by then
    both = _check(as_of=late)
    assert both.returncode == DISAGREE_EXIT, both.stderr
    said = " ".join(both.stdout.split())
    assert "retry windows due for review on 2027-06-01" in said  # both halves printed
    assert "Live processes (0 receivers, 2 workers) derive different dedup TTLs" in said
    windows = _check("--windows-only", "--json", as_of=late)
    assert windows.returncode == 3, windows.stderr  # noqa: PLR2004 (DUE_EXIT)
    assert json.loads(windows.stdout)["processes"] is None
    nowhere = f"postgresql://postgres@127.0.0.1:{free_port()}/nowhere"
    assert _check("--windows-only", WEBHOOKS_DATABASE_URL=nowhere).returncode == 0
