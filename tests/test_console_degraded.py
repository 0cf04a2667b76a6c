"""The console's degraded card reads the receiver's fail-open counts (issue 35 item 9, its
second half), not a ping of its own: a real receiver whose Redis (the admission tier) goes
away while an event is accepted publishes it without admission, counts it, and the card says
degraded even after Redis answers again, which a ping would have called ok."""

from __future__ import annotations

import re
import secrets
import uuid

import httpx
from sqlalchemy.orm import Session, sessionmaker

from core.settings import Settings
from tests.conftest import REDIS_PORT
from tests.factories import make_source
from tests.leakcheck import remember
from tests.netproxy import CuttableProxy
from tests.operators_support import console_login
from tests.processes import receiver
from tests.signing import sign
from tests.workers import BROKER_URL, wait_for

FAILED_OPEN = 'webhooks_admissions_total{outcome="failed_open"} 1.0'
CARD = re.compile(r'<div class="card (\w+)" id="degraded"><b>(\w+)</b><span>([^<]*)</span>')


def card(http: httpx.Client, admin_url: str) -> tuple[str, str]:
    page = http.get(f"{admin_url}/console/")
    assert page.status_code == 200, page.text
    found = CARD.search(page.text)
    assert found is not None, page.text
    return found.group(2), found.group(3)


def test_the_degraded_card_reads_the_receivers_fail_open_counts(
    sessions: sessionmaker[Session], settings: Settings
) -> None:
    source = make_source(sessions, settings, provider="stripe", routes=[{"handler": "log"}])
    remember(source.secret)
    token = "adm_" + secrets.token_urlsafe(32)
    remember(token)
    proxy = CuttableProxy(REDIS_PORT)
    try:
        with (
            receiver(
                WEBHOOKS_BROKER_URL=BROKER_URL,
                WEBHOOKS_REDIS_URL=f"redis://127.0.0.1:{proxy.port}/11",
                WEBHOOKS_ADMIN_TOKEN=token,
            ) as rcv,
            httpx.Client(timeout=10) as http,
        ):
            admin = f"http://127.0.0.1:{rcv.admin_port}"
            assert console_login(http, admin, token).status_code == 303
            assert card(http, admin) == ("ok", "admission: no fail-open in the last 5 minutes")

            proxy.cut()  # Redis gone for admission; the broker (another URL) still answers
            headers, body = sign("stripe", source.secret, event_id=f"evt_{uuid.uuid4().hex}")
            remember(body)
            answered = http.post(
                f"{rcv.url}/webhooks/{source.public_id}", headers=headers, content=body
            )
            assert answered.status_code == 202
            # The publisher's admission fails open (counted) while Redis is away; only then
            # does Redis come back (a retry inside the client would otherwise reach it).
            wait_for(
                lambda: FAILED_OPEN in http.get(f"{admin}/metrics").text,
                timeout=30,
                what="the receiver to count the fail-open",
            )
            proxy.restore()  # Redis answers again: a ping now would say ok

            state, text = wait_for(
                lambda: (found := card(http, admin))[0] == "degraded" and found,
                timeout=30,
                what="the card to read the fail-open",
            )
            assert state == "degraded"
            assert text.startswith("admission: admission failed open 1 times, the last ")
            assert "published without their routes&#39; limits" in text
    finally:
        proxy.close()
