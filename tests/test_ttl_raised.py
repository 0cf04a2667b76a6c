"""A source whose dedup TTL no longer covers its provider's retry window (issue 9): reported
at the start of every process and by ``webhooks sources list``, counted, and its requests
still accepted with the TTL raised to the minimum safe value, never answered 500."""

from __future__ import annotations

import json
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session, sessionmaker

from core.settings import Settings
from core.ttl import TtlOverrides, effective_ttl
from tests.conftest import BIN, make_settings, test_env
from tests.factories import make_source
from tests.leakcheck import remember
from tests.processes import receiver
from tests.signing import sign
from tests.workers import running_worker

# A settings change after the source was created: no queue lag, no replay grace.
SHRUNK = {"WEBHOOKS_QUEUE_LAG_BUDGET": "PT0S", "WEBHOOKS_MANUAL_REPLAY_GRACE": "PT0S"}
STRIPE_WINDOW = timedelta(days=3)


def test_a_covering_ttl_is_kept_and_a_short_one_raised_to_the_safe_floor() -> None:
    normal = make_settings()
    shrunk = make_settings(queue_lag_budget=timedelta(0), manual_replay_grace=timedelta(0))
    short = TtlOverrides(retry_window=timedelta(hours=1))

    kept = effective_ttl("stripe", short, normal)
    assert (kept.raised, kept.total) == (False, kept.terms.total)
    assert kept.warning() is None

    raised = effective_ttl("stripe", short, shrunk)
    assert raised.terms.total == timedelta(hours=1, minutes=10)  # below the 3 d window
    assert raised.raised
    assert raised.total == STRIPE_WINDOW + shrunk.clock_skew_allowance
    assert raised.total > raised.terms.retry_window
    assert "raised to 3d10m" in (raised.warning() or "")


def test_a_source_below_its_retry_window_is_reported_counted_and_still_accepted(
    sessions: sessionmaker[Session], settings: Settings, engine: Engine, tmp_path: Path
) -> None:
    source = make_source(
        sessions,
        settings,
        provider="stripe",
        routes=[],
        ttl=TtlOverrides(retry_window=timedelta(hours=1)),
    )
    remember(source.secret)
    created = datetime.now(UTC).replace(microsecond=0)
    headers, body = sign(
        "stripe", source.secret, event_id="evt_raised", event_type="invoice.paid", timestamp=created
    )
    remember(body)
    with receiver(**SHRUNK) as rcv, httpx.Client(timeout=10) as client:
        answer = client.post(
            f"{rcv.url}/webhooks/{source.public_id}", headers=headers, content=body
        )
        again = client.post(f"{rcv.url}/webhooks/{source.public_id}", headers=headers, content=body)
        exposition = client.get(f"{rcv.admin_url}/metrics").text
    log = rcv.log_path.read_text()

    assert answer.status_code == 202, answer.text
    assert again.status_code == 200  # still deduplicated
    with engine.connect() as conn:
        expires, occurred = conn.execute(
            text("SELECT expires_at, occurred_at FROM receipts WHERE source_id = :s"),
            {"s": source.id},
        ).one()
    assert expires - occurred == STRIPE_WINDOW + settings.clock_skew_allowance
    # Reported at start, and counted per accepted receipt.
    starts = [json.loads(line) for line in log.splitlines() if '"source.ttl_raised"' in line]
    assert any(line["source"] == source.public_id for line in starts)
    assert f'webhooks_ttl_raised_total{{source="{source.public_id}"}} 1.0' in exposition

    listed = subprocess.run(
        [str(BIN / "webhooks"), "sources", "list", "--json"],
        env=test_env(**SHRUNK),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert listed.returncode == 0, listed.stderr
    [view] = [v for v in json.loads(listed.stdout) if v["id"] == source.public_id]
    assert "raised to 3d10m" in view["warning"]
    with running_worker("ttl-report", tmp_path, extra_env=SHRUNK) as worker:
        reported = [
            line for line in worker.json_lines() if line.get("event") == "source.ttl_raised"
        ]
    assert any(
        line["source"] == source.public_id and line["process"] == "worker" for line in reported
    )
    human = subprocess.run(
        [str(BIN / "webhooks"), "sources", "list"],
        env=test_env(**SHRUNK, COLUMNS="250"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "warning" in human.stdout
    assert "raised" in human.stdout
