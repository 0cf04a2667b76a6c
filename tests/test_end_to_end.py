"""Receiver and worker processes together: HTTP in, handler effect out."""

from __future__ import annotations

from pathlib import Path

import httpx
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session, sessionmaker

from core.settings import Settings
from tests.factories import make_source
from tests.leakcheck import remember
from tests.processes import receiver
from tests.signing import sign
from tests.workers import BROKER_URL, CLAIMS_URL, flush_redis, running_worker, wait_status


def test_same_event_id_under_two_accounts_is_processed_independently(
    sessions: sessionmaker[Session], settings: Settings, engine: Engine, tmp_path: Path
) -> None:
    flush_redis()
    sources = [
        make_source(
            sessions, settings, provider="stripe", account=account, routes=[{"handler": "log"}]
        )
        for account in ("acct-one", "acct-two")
    ]
    with (
        receiver(WEBHOOKS_BROKER_URL=BROKER_URL, WEBHOOKS_REDIS_URL=CLAIMS_URL) as rcv,
        running_worker("e2e", tmp_path, concurrency=2),
        httpx.Client(timeout=10) as client,
    ):
        for source in sources:
            remember(source.secret)
            headers, body = sign("stripe", source.secret, event_id="evt_same_everywhere")
            remember(body)
            response = client.post(
                f"{rcv.url}/webhooks/{source.public_id}", headers=headers, content=body
            )
            assert response.status_code == 202, response.text
        with engine.connect() as conn:
            rows = conn.execute(
                text(
                    "SELECT d.id, r.source_id FROM deliveries d JOIN receipts r ON r.id = d.receipt_id"
                    " WHERE r.event_id = 'evt_same_everywhere' AND r.source_id IN (:a, :b)"
                ),
                {"a": sources[0].id, "b": sources[1].id},
            ).all()
        assert sorted(r.source_id for r in rows) == sorted(s.id for s in sources)
        for row in rows:
            assert wait_status(engine, row.id, "succeeded", timeout=60).status == "succeeded"
