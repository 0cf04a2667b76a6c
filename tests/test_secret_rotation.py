"""Rotating WEBHOOKS_SECRET_KEY (issue 11): a list of keys, newest first, every one of them
decrypting; ``webhooks secrets rekey`` re-encrypting every stored secret under the newest,
resumably and idempotently; receivers keep verifying throughout the rotation."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import subprocess
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from cryptography.fernet import Fernet
from cryptography.hazmat.primitives.hashes import SHA256
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from prometheus_client import REGISTRY
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session, sessionmaker

from core.clock import FrozenClock
from core.crypto import (
    Place,
    SecretBox,
    SecretDecryptError,
    new_key,
    reconcile_place,
    route_secret_place,
    source_secret_place,
    stretched_key,
)
from core.settings import SettingsError, load_settings
from ingest.app import create_app
from models import keys
from models.retention_layout import ensure_partitions
from tests.conftest import BASE_ENV, BIN, REDIS, make_settings, test_env
from tests.factories import make_source, source_ttl
from tests.leakcheck import remember
from tests.operators_support import cli, succeed
from tests.processes import receiver
from tests.signing import sign

OLD = BASE_ENV["WEBHOOKS_SECRET_KEY"]
NEW = "rotated-secret-key-" + "r" * 32
ROUTE_SECRET = "whsec_" + base64.b64encode(b"route-signing-secret-for-rotation").decode()


def test_a_generated_key_is_derived_with_hkdf_and_a_passphrase_with_scrypt() -> None:
    """A generated key (``whk_`` + 32 random bytes) skips scrypt: its root is HKDF-SHA256 of
    its bytes; a passphrase's is scrypt of its text. The two kinds share one list, so a
    rotation moves secrets from either to the other."""
    generated = new_key()
    raw = base64.urlsafe_b64decode(generated[4:] + "=")
    hkdf = HKDF(
        algorithm=SHA256(),
        length=32,
        salt=b"webhook-pipeline/secret-box/hkdf-v1",
        info=b"secret-box root",
    )
    assert stretched_key(generated) == hkdf.derive(raw)
    assert stretched_key(NEW) == hashlib.scrypt(
        NEW.encode(),
        salt=b"webhook-pipeline/secret-box/scrypt-v1",
        n=2**15,
        r=8,
        p=1,
        maxmem=64 * 1024 * 1024,
        dklen=32,
    )
    here = source_secret_place("sec_kinds")
    under_passphrase = SecretBox(NEW).seal("s1", here)
    both = SecretBox(f"{generated},{NEW}")
    assert both.open(under_passphrase, here) == "s1"
    under_generated = both.seal("s2", here)
    assert SecretBox(generated).open(under_generated, here) == "s2"
    with pytest.raises(SecretDecryptError):
        SecretBox(NEW).open(under_generated, here)
    assert new_key() != generated


@pytest.mark.parametrize(
    ("key", "why"),
    [
        ("whk_" + "A" * 42 + "E", "is not random"),  # 32 bytes, one character repeated
        ("whk_" + "a" * 43, "is not 32 bytes"),  # not canonical base64url
        ("whk_" + base64.urlsafe_b64encode(b"k" * 31).decode(), "is not 32 bytes"),
        ("whk_" + "x" * 40 + "!!!", "is not 32 bytes"),
    ],
    ids=["repeated", "not-canonical", "31-bytes", "not-base64url"],
)
def test_a_malformed_generated_key_is_refused_never_stretched_instead(key: str, why: str) -> None:
    """A key that claims the generated form and does not have it would skip scrypt with
    little entropy, or (stretched instead) hide a typo: refused, naming its place in the list."""
    with pytest.raises(SettingsError) as refused:
        load_settings(_env_file=None, secret_key=f"{NEW},{key}")
    assert f"key 2 of 2 starts with whk_ but {why}" in str(refused.value)
    assert key not in str(refused.value)


def test_secrets_new_key_prints_a_key_that_works_and_needs_no_settings(tmp_path: Path) -> None:
    """``webhooks secrets new-key`` needs no database and no key set (it makes the first);
    each run prints another key of the generated form, which settings accept."""
    env = {k: v for k, v in test_env().items() if k != "WEBHOOKS_SECRET_KEY"}
    env["WEBHOOKS_ENV_FILE"] = str(tmp_path / "none.env")
    runs = [cli("secrets", "new-key", env=env) for _ in range(2)]
    keys = []
    for run in runs:
        assert run.returncode == 0, run.stderr
        [key] = run.stdout.split()
        assert key.startswith("whk_")
        assert len(key) == 47
        keys.append(key)
    assert keys[0] != keys[1]
    assert (
        load_settings(_env_file=None, secret_key=keys[0]).secret_key.get_secret_value() == (keys[0])
    )


def test_a_cli_run_with_a_malformed_generated_key_is_one_line_and_changes_nothing() -> None:
    bad = "whk_" + "a" * 43
    run = cli("sources", "list", env=test_env(WEBHOOKS_SECRET_KEY=bad))
    assert run.returncode != 0
    assert "key 1 of 1 starts with whk_ but is not 32 bytes" in run.stderr
    assert bad not in run.stderr + run.stdout
    assert "Traceback" not in run.stderr


def test_every_listed_key_decrypts_and_the_newest_encrypts() -> None:
    old, both, new = SecretBox(OLD), SecretBox(f"{NEW},{OLD}"), SecretBox(NEW)
    here = source_secret_place("sec_rotation")
    under_old = old.seal("s1", here)
    assert both.open(under_old, here) == "s1"
    with pytest.raises(SecretDecryptError):
        new.open(under_old, here)
    under_new = both.seal("s2", here)
    assert new.open(under_new, here) == "s2"
    assert both.is_current(under_new, here)
    assert not both.is_current(under_old, here)
    assert new.open(both.rebound(under_old, here), here) == "s1"
    # Written before keys were stretched (SHA-256 of the key), and before binding: still
    # readable by a rekey, which binds it; not current.
    legacy = Fernet(
        base64.urlsafe_b64encode(hashlib.sha256(b"webhooks-secret-box:" + OLD.encode()).digest())
    ).encrypt(b"s0")
    assert old.open(old.rebound(legacy, here), here) == "s0"
    assert not old.is_current(legacy, here)


def test_a_short_or_empty_key_in_the_list_is_refused() -> None:
    for bad, says in ((f"{NEW},short", "key 2 of 2"), (f"{NEW},,{OLD}", "empty key")):
        with pytest.raises(SettingsError, match=says):
            load_settings(secret_key=bad)


def _stored(engine: Engine, source_id: int, route_id: int) -> tuple[bytes, bytes]:
    with engine.connect() as conn:
        secret = conn.execute(
            text("SELECT ciphertext FROM source_secrets WHERE source_id = :s"), {"s": source_id}
        ).scalar_one()
        route = conn.execute(
            text("SELECT signing_ciphertext FROM routes WHERE id = :r"), {"r": route_id}
        ).scalar_one()
    return bytes(secret), bytes(route)


@pytest.fixture
def back_to_the_old_key(sessions: sessionmaker[Session]) -> Iterator[None]:
    """The suite's database is shared: whatever a test moved to NEW goes back to OLD."""
    yield
    keys.rekey(sessions, SecretBox(f"{OLD},{NEW}"))


def _not_current(engine: Engine, box: SecretBox) -> int:
    with engine.connect() as conn:
        stored = [
            (source_secret_place(str(k)), c)
            for k, c in conn.execute(text("SELECT id, ciphertext FROM source_secrets"))
        ]
        stored += [
            (route_secret_place(int(k)), c)
            for k, c in conn.execute(
                text(
                    "SELECT id, signing_ciphertext FROM routes WHERE signing_ciphertext IS NOT NULL"
                )
            )
        ]
        stored += [
            (reconcile_place(int(k)), c)
            for k, c in conn.execute(
                text(
                    "SELECT id, reconcile_ciphertext FROM sources WHERE reconcile_ciphertext IS NOT NULL"
                )
            )
        ]
        return sum(not box.is_current(bytes(c), place) for place, c in stored)


class Interrupting(SecretBox):
    """Stops the run (as a Ctrl-C or a crash would) after ``after`` re-encryptions."""

    def __init__(self, key: str, after: int) -> None:
        super().__init__(key)
        self.left = after

    def rebound(self, ciphertext: bytes, place: Place) -> bytes:
        if self.left == 0:
            raise KeyboardInterrupt
        self.left -= 1
        return super().rebound(ciphertext, place)


@pytest.mark.usefixtures("back_to_the_old_key")
def test_rekey_is_resumable_and_idempotent(sessions: sessionmaker[Session], engine: Engine) -> None:
    settings = make_settings()
    made = [make_source(sessions, settings) for _ in range(3)]
    api_key = f"rk_test_{uuid.uuid4().hex}"  # a reconciliation credential is rekeyed too
    remember(api_key)
    with engine.begin() as conn:
        conn.execute(
            text("UPDATE sources SET reconcile_ciphertext = :c WHERE id = :s"),
            {"c": SecretBox(OLD).seal(api_key, reconcile_place(made[0].id)), "s": made[0].id},
        )
    box = SecretBox(f"{NEW},{OLD}")
    todo = _not_current(engine, box)
    assert todo >= len(made)
    with pytest.raises(KeyboardInterrupt):  # stopped after two, each batch committed
        keys.rekey(sessions, Interrupting(f"{NEW},{OLD}", after=2), batch=1)
    assert _not_current(engine, box) == todo - 2
    first = keys.rekey(sessions, box, batch=2)  # picks up where the other run stopped
    assert first.total_rekeyed == todo - 2
    again = keys.rekey(sessions, box, batch=2)
    assert again.total_rekeyed == 0
    assert sum(again.undecryptable.values()) == 0
    newest_only = SecretBox(NEW)
    assert _not_current(engine, newest_only) == 0
    for source in made:
        secret, secret_id = _stored_secret(engine, source.id)
        assert newest_only.open(secret, source_secret_place(secret_id)) == source.secret
    with engine.connect() as conn:
        stored = conn.execute(
            text("SELECT reconcile_ciphertext FROM sources WHERE id = :s"), {"s": made[0].id}
        ).scalar_one()
    assert newest_only.open(bytes(stored), reconcile_place(made[0].id)) == api_key


def _stored_secret(engine: Engine, source_id: int) -> tuple[bytes, Any]:
    with engine.connect() as conn:
        row = conn.execute(
            text("SELECT ciphertext, id FROM source_secrets WHERE source_id = :s"),
            {"s": source_id},
        ).one()
    return bytes(row[0]), row[1]


@pytest.mark.usefixtures("back_to_the_old_key")
def test_rotation_with_receivers_running_never_stops_verification(
    sessions: sessionmaker[Session], engine: Engine
) -> None:
    """Receivers on OLD, then on NEW,OLD while ``webhooks secrets rekey`` runs, then on NEW
    alone: every signed request is accepted all along, and the route's signing secret (used
    by forward) moved too."""
    settings = make_settings()
    source = make_source(
        sessions,
        settings,
        provider="standard",
        routes=[{"handler": "forward", "options": {"url": "https://x.example/h"}}],
    )
    remember(source.secret)
    with sessions() as session, session.begin():
        route_id = session.execute(
            text("SELECT id FROM routes WHERE source_id = :s"), {"s": source.id}
        ).scalar_one()

    def post(url: str, n: int) -> int:
        headers, body = sign("standard", source.secret, event_id=f"evt_rot_{n}", event_type="a.b")
        return httpx.post(
            f"{url}/webhooks/{source.public_id}", headers=headers, content=body, timeout=10
        ).status_code

    with receiver() as on_old:
        assert post(on_old.url, 1) == 202
        with receiver(WEBHOOKS_SECRET_KEY=f"{NEW},{OLD}") as on_both:
            assert post(on_both.url, 2) == 202
            rekey = subprocess.run(
                [str(BIN / "webhooks"), "secrets", "rekey"],
                env=test_env(WEBHOOKS_SECRET_KEY=f"{NEW},{OLD}"),
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert rekey.returncode == 0, rekey.stderr
            assert "re-encrypted" in rekey.stdout
            assert post(on_both.url, 3) == 202
    with receiver(WEBHOOKS_SECRET_KEY=NEW) as on_new:
        assert post(on_new.url, 4) == 202
    secret, route = _stored(engine, source.id, route_id)
    newest_only = SecretBox(NEW)
    assert newest_only.open(secret, source_secret_place(source.secret_id)) == source.secret
    # the route's own signing secret moved as well
    assert newest_only.open(route, route_secret_place(route_id))
    again = subprocess.run(
        [str(BIN / "webhooks"), "secrets", "rekey", "--json"],
        env=test_env(WEBHOOKS_SECRET_KEY=NEW),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["rekeyed"] == 0


# --- the leaked-key drill (issue 19, section 4) -------------------------------------------


def _webhooks(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "webhooks"), *args], env=test_env(), capture_output=True, text=True, timeout=60
    )


def _account_state(engine: Engine, source_id: int) -> dict[str, Any]:
    """Everything of one source an incident could touch: the source row, its secrets, its
    routes, its receipts and their deliveries."""
    queries = {
        "source": "SELECT public_id, account, provider, active, config, tolerance_s"
        " FROM sources WHERE id = :s",
        "secrets": "SELECT id, ciphertext, revoked_at FROM source_secrets WHERE source_id = :s"
        " ORDER BY id",
        "routes": "SELECT id, handler, active FROM routes WHERE source_id = :s ORDER BY id",
        "receipts": "SELECT id, event_id, body_digest, payload, expires_at FROM receipts"
        " WHERE source_id = :s ORDER BY id",
        "deliveries": "SELECT id, receipt_id, route_id, status, generation FROM deliveries"
        " WHERE source_id = :s ORDER BY id",
    }
    with engine.connect() as conn:
        return {
            name: [tuple(r) for r in conn.execute(text(sql), {"s": source_id}).all()]
            for name, sql in queries.items()
        }


def test_leaked_key_drill_rotates_one_account_and_leaves_the_other_untouched(
    sessions: sessionmaker[Session], engine: Engine
) -> None:
    """Source A's secret leaks. The operator adds a new one, the sender switches, the leaked
    one is revoked (audited), all with the CLI as an operator runs it, receivers running.
    The leaked secret then opens nothing, on A or on account B, and B's source, secrets and
    receipts are exactly as they were. A duplicate sent to each account is answered as one
    and writes nothing, and A's first event (accepted under the leaked key) sent again under
    A's replacement key is a duplicate of the original receipt, which wins (issue 35 item 8)."""
    settings = make_settings()
    a = make_source(sessions, settings, provider="stripe", account="acct-a")
    b = make_source(sessions, settings, provider="stripe", account="acct-b")
    remember(a.secret)
    remember(b.secret)
    leaked = a.secret

    sent: dict[str, bytes] = {}  # event id -> the body first sent (a re-send repeats it)

    def send(url: str, source: Any, secret: str, event_id: str | None = None) -> httpx.Response:
        event_id = event_id or f"evt_{uuid.uuid4().hex}"
        headers, body = sign(
            "stripe", secret, event_id=event_id, event_type="a.b", raw_body=sent.get(event_id)
        )
        sent.setdefault(event_id, body)
        remember(body)
        return httpx.post(
            f"{url}/webhooks/{source.public_id}", headers=headers, content=body, timeout=10
        )

    def post(url: str, source: Any, secret: str, event_id: str | None = None) -> int:
        return send(url, source, secret, event_id).status_code

    with receiver() as rcv:
        first_a = send(rcv.url, a, leaked)
        assert first_a.status_code == 202
        first_b = send(rcv.url, b, b.secret)
        assert first_b.status_code == 202
        assert post(rcv.url, b, b.secret) == 202
        b_before = _account_state(engine, b.id)

        added = _webhooks("secrets", "add", a.public_id)
        assert added.returncode == 0, added.stderr
        fresh = next(
            line.split()[1] for line in added.stdout.splitlines() if line.startswith("secret:")
        )
        remember(fresh)
        assert post(rcv.url, a, fresh) == 202  # the sender switched; both verify meanwhile
        revoked = _webhooks(
            "secrets", "revoke", a.public_id, a.secret_id, "--reason", "leaked: drill"
        )
        assert revoked.returncode == 0, revoked.stderr

        a_after_rotation = _account_state(engine, a.id)
        # The leaked secret opens nothing: not A (revoked), not B (never its secret).
        assert post(rcv.url, a, leaked) == 401
        assert post(rcv.url, b, leaked) == 401
        assert _account_state(engine, a.id) == a_after_rotation  # nothing written
        assert _account_state(engine, b.id) == b_before
        # A duplicate to each account: answered 200 duplicate, nothing written. A's first
        # event, accepted under the leaked key, sent again under the replacement key: the
        # original receipt wins (its id, digest and body unchanged, no new delivery).
        for source, secret, first in ((a, fresh, first_a), (b, b.secret, first_b)):
            before = _account_state(engine, source.id)
            again = send(rcv.url, source, secret, first.json()["event_id"])
            assert again.status_code == 200, again.text
            assert again.json()["status"] == "duplicate"
            assert _account_state(engine, source.id) == before
        # Both accounts keep working with their current secrets.
        assert post(rcv.url, a, fresh) == 202
        assert post(rcv.url, b, b.secret) == 202

    b_after = _account_state(engine, b.id)
    assert {k: v for k, v in b_after.items() if k not in ("receipts", "deliveries")} == {
        k: v for k, v in b_before.items() if k not in ("receipts", "deliveries")
    }
    assert b_after["receipts"][: len(b_before["receipts"])] == b_before["receipts"]
    assert len(b_after["receipts"]) == len(b_before["receipts"]) + 1
    assert [s[2] for s in b_after["secrets"]] == [None]  # B's secret: never revoked
    with engine.connect() as conn:
        audits = conn.execute(
            text("SELECT target FROM audit_log WHERE action = 'secret.revoke'")
        ).scalars()
        touching = [t for t in audits if t["source"] in (a.public_id, b.public_id)]
    assert touching == [{"source": a.public_id, "provider": "stripe", "secret": a.secret_id}]


# An old signed capture replayed once its receipt has expired (its dedup window is over):
# refused by the signed timestamp where the scheme signs one. GitHub signs no timestamp: the
# same replay is accepted as a new event (README, Security), which is what this drill shows
# the timestamp is for.
CAPTURE_BROKER = f"{REDIS}/8"
T0 = datetime(2025, 9, 1, 12, tzinfo=UTC)


@pytest.mark.parametrize(
    ("provider", "replayed"),
    [("stripe", 401), ("standard", 401), ("slack", 401), ("github", 202)],
)
def test_a_capture_replayed_after_retention_is_refused_by_its_timestamp(
    provider: str, replayed: int, sessions: sessionmaker[Session], engine: Engine
) -> None:
    settings = make_settings(broker_url=CAPTURE_BROKER)
    source = make_source(sessions, settings, provider=provider)
    remember(source.secret)
    ttl = source_ttl(sessions, settings, source.id)
    after_retention = T0 + ttl + timedelta(days=1)
    for at in (T0, after_retention):
        ensure_partitions(engine, settings, at)
    clock = FrozenClock(T0)
    event_id = f"evt_{uuid.uuid4().hex}"
    headers, body = sign(
        provider, source.secret, event_id=event_id, event_type="invoice.paid", timestamp=T0
    )
    remember(body)
    url = f"/webhooks/{source.public_id}"

    async def scenario() -> list[httpx.Response]:
        app = create_app(settings, clock)
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://receiver"
            ) as client,
        ):
            first = await client.post(url, headers=headers, content=body)
            clock.set(T0 + timedelta(seconds=30))  # a replay inside the dedup window
            again = await client.post(url, headers=headers, content=body)
            # Its work was done long ago (a held receipt would still deduplicate), and now
            # its receipt has expired: deduplication no longer stops a replay.
            succeed(sessions, [d[0] for d in _account_state(engine, source.id)["deliveries"]])
            clock.set(after_retention)
            late = await client.post(url, headers=headers, content=body)
            return [first, again, late]

    try:
        first, again, late = asyncio.run(scenario())
        receipts = _account_state(engine, source.id)["receipts"]
    finally:
        redis.Redis.from_url(CAPTURE_BROKER).flushdb()
    assert first.status_code == 202
    assert again.status_code == 200  # a duplicate, within the window
    assert late.status_code == replayed
    assert len(receipts) == (1 if replayed == 401 else 2)  # refused: nothing written
    if replayed == 401:  # refused by its timestamp, not by anything else
        labels = {"source": source.public_id, "outcome": "unauthenticated:stale"}
        assert REGISTRY.get_sample_value("webhooks_requests_total", labels) == 1


def _legacy_ciphertext(key: str, plaintext: str) -> bytes:
    """What SecretBox wrote before keys were stretched (Fernet under a SHA-256 of the key),
    and before secrets were bound to their place."""
    digest = hashlib.sha256(b"webhooks-secret-box:" + key.encode()).digest()
    return Fernet(base64.urlsafe_b64encode(digest)).encrypt(plaintext.encode())


def test_drop_legacy_is_refused_while_a_secret_needs_it_then_retires_it(
    sessions: sessionmaker[Session], engine: Engine
) -> None:
    """Issue 18, item 8: ``secrets rekey --drop-legacy`` refuses, changing nothing, while a
    stored secret is only readable through the legacy SHA-256 derivation; after a plain rekey
    it passes, and WEBHOOKS_SECRET_KEY_LEGACY=false takes the derivation out of the box."""
    source = make_source(sessions, make_settings())
    legacy = _legacy_ciphertext(OLD, source.secret)
    with engine.begin() as conn:
        conn.execute(
            text("UPDATE source_secrets SET ciphertext = :c WHERE source_id = :s"),
            {"c": legacy, "s": source.id},
        )

    def cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(BIN / "webhooks"), "secrets", "rekey", *args],
            env=test_env(**env),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    refused = cli("--drop-legacy")
    assert refused.returncode == 1, refused.stdout
    assert "still encrypted under the legacy SHA-256 key derivation" in refused.stderr
    assert "run `webhooks secrets rekey` first" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert _stored_secret(engine, source.id)[0] == legacy  # nothing changed
    # Without the legacy derivation the row cannot be read: that is what the refusal protects.
    here = source_secret_place(source.secret_id)
    with pytest.raises(SecretDecryptError):
        SecretBox(OLD, legacy=False).rebound(legacy, here)
    assert SecretBox(OLD).open(SecretBox(OLD).rebound(legacy, here), here) == source.secret

    assert cli().returncode == 0
    moved = _stored_secret(engine, source.id)[0]
    assert SecretBox(OLD, legacy=False).open(moved, here) == source.secret
    retired = cli("--drop-legacy")
    assert retired.returncode == 0, retired.stderr
    assert "WEBHOOKS_SECRET_KEY_LEGACY=false" in retired.stdout
    off = cli("--drop-legacy", "--json", WEBHOOKS_SECRET_KEY_LEGACY="false")
    assert off.returncode == 0, off.stderr
    assert json.loads(off.stdout)["legacy_in_use"] == 0
    assert load_settings(secret_key=OLD, secret_key_legacy="false").secret_key_legacy is False


@pytest.mark.parametrize(
    ("key", "said"),
    [
        ("short", "key 1 of 1 is shorter than 32 characters"),
        (f"{NEW},short", "key 2 of 2 is shorter than 32 characters"),
        (f"{NEW},", "an empty key in the list"),
    ],
    ids=["short", "second-short", "empty"],
)
def test_a_bad_storage_key_is_named_in_plain_words(key: str, said: str) -> None:
    """Issue 36: a short key read "Value should have at least 32 items after validation, not
    5" (pydantic's words for a SecretStr); the check's own words now, without "Value error"."""
    with pytest.raises(SettingsError) as refused:
        load_settings(_env_file=None, secret_key=key)
    assert str(refused.value) == f"invalid settings: WEBHOOKS_SECRET_KEY: {said}"
