"""The new providers of issue 13 (second half) as tests sign for them, shared by the test
modules that use them: how to sign a delivery for each (:class:`Spec`, :data:`SPECS`), and
helpers for sending those deliveries through a real receiver and reading what it stored.
"""

from __future__ import annotations

import secrets as pysecrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session, sessionmaker

from core.settings import Settings
from tests import signing
from tests.factories import MadeSource, make_source
from tests.leakcheck import remember
from tests.processes import Receiver

URL = "https://hooks.example.com/webhooks/src_abcdefghij0123456789?team=ops"
OTHER_URL = "https://evil.example.net/webhooks/src_abcdefghij0123456789?team=ops"


def text_secret() -> str:
    return pysecrets.token_urlsafe(32)


@dataclass
class Spec:
    """How to sign a delivery for one provider: ``sign(secret, ts, event_id) -> (headers, body)``
    with the test's own key material from ``keys()`` (signing key, stored secret)."""

    provider: str
    sign: Callable[[Any, int, str], tuple[dict[str, str], bytes]]
    keys: Callable[[], tuple[Any, str]] = lambda: (s := text_secret(), s)
    timed: bool = False
    config: dict[str, Any] = field(default_factory=dict)
    url_signed: bool = False

    def __str__(self) -> str:
        return self.provider


def _adyen_keys() -> tuple[str, str]:
    key = pysecrets.token_hex(32).upper()
    return key, key


SPECS = [
    Spec("bitbucket", lambda k, ts, i: signing.sign_bitbucket(k, event_id=i)),
    Spec("pagerduty", lambda k, ts, i: signing.sign_pagerduty(k, event_id=i, timestamp=ts)),
    Spec("twitch", lambda k, ts, i: signing.sign_twitch(k, event_id=i, timestamp=ts), timed=True),
    Spec("mailgun", lambda k, ts, i: signing.sign_mailgun(k, event_id=i, timestamp=ts), timed=True),
    Spec(
        "discord",
        lambda k, ts, i: signing.sign_discord(k, timestamp=ts),
        keys=signing.discord_keypair,
        timed=True,
    ),
    Spec(
        "square",
        lambda k, ts, i: signing.sign_square(k, event_id=i, url=URL, timestamp=ts),
        config={"public_url": URL},
        url_signed=True,
    ),
    Spec(
        "hubspot",
        lambda k, ts, i: signing.sign_hubspot(k, event_ids=[i], url=URL, timestamp=ts),
        config={"public_url": URL},
        url_signed=True,
        timed=True,
    ),
    Spec(
        "twilio",
        lambda k, ts, i: signing.sign_twilio(k, url=URL, sid=i),
        config={"public_url": URL},
        url_signed=True,
    ),
    Spec("zoom", lambda k, ts, i: signing.sign_zoom(k, timestamp=ts), timed=True),
    Spec(
        "meta",
        lambda k, ts, i: signing.sign_meta(k, timestamp=ts),
        config={"verify_token": "tok-" + "v" * 20},
    ),
    Spec(
        "adyen",
        lambda k, ts, i: signing.sign_adyen(k, [signing.adyen_item(i)]),
        keys=_adyen_keys,
    ),
    Spec(
        "sendgrid",
        lambda k, ts, i: signing.sign_sendgrid(k, [signing.sendgrid_event(i, ts=ts)], timestamp=ts),
        keys=signing.sendgrid_keypair,
        timed=True,
    ),
]
BY_NAME = {s.provider: s for s in SPECS}


# -- through a real receiver ---------------------------------------------------------------


def new_source(
    sessions: sessionmaker[Session], settings: Settings, spec: Spec
) -> tuple[MadeSource, Any, dict[str, Any]]:
    """A source for ``spec`` with fresh key material; returns (source, signing key, config)."""
    signer, secret = spec.keys()
    config = dict(spec.config)
    made = make_source(
        sessions, settings, provider=spec.provider, secret=secret, config=config or None
    )
    remember(secret)
    if isinstance(signer, str):
        remember(signer)
    return made, signer, config


def sign_for(spec: Spec, signer: Any, ts: int | None = None, event_id: str | None = None) -> Any:
    event_id = event_id or f"evt_{pysecrets.token_hex(8)}"
    headers, body = spec.sign(signer, int(time.time()) if ts is None else ts, event_id)
    remember(body)
    return event_id, headers, body


def post(
    client: httpx.Client, rcv: Receiver, source: MadeSource, headers: Any, body: bytes
) -> httpx.Response:
    return client.post(f"{rcv.url}/webhooks/{source.public_id}", headers=headers, content=body)


def receipts(engine: Engine, source: MadeSource) -> list[tuple[str, str, str | None, bytes]]:
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT event_id, event_type, content_type, payload FROM receipts "
                "WHERE source_id = :s ORDER BY event_id"
            ),
            {"s": source.id},
        ).all()
    return [(r[0], r[1], r[2], bytes(r[3])) for r in rows]


def written(engine: Engine, source: MadeSource) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                text(
                    "SELECT (SELECT count(*) FROM receipts WHERE source_id = :s) + "
                    "(SELECT count(*) FROM conflicts WHERE source_id = :s)"
                ),
                {"s": source.id},
            ).scalar_one()
        )
