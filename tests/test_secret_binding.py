"""Stored secrets are bound to their place (issue 34, item 1): a ciphertext copied to another
row, or from one purpose to another, is refused where it is read and never used.

The live probe of the security review, repeated: whoever can write the ``sources`` table
copies source A's signing-secret ciphertext into source B's reconciliation credential and
points B's ``api_base`` at a host of theirs (here a local fake of Stripe's API). Before the
binding, reconciliation decrypted it and sent it as a Bearer token; now the real ``webhooks
reconcile`` refuses with one line and the fake API receives nothing.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session, sessionmaker

from core import metrics
from core.crypto import (
    ROUTE_SIGNING,
    SIGNING,
    Place,
    SecretBox,
    SecretDecryptError,
    SecretMisplaced,
    SecretUnbound,
    _stretched,
    reconcile_place,
    route_secret_place,
    source_secret_place,
)
from core.settings import Settings
from ingest.store import Store
from models.db import upgrade
from models.keys import rekey
from tests.conftest import make_settings, test_env
from tests.factories import make_source
from tests.fake_providers import FakeStripe, serving
from tests.leakcheck import remember
from tests.operators_support import cli
from tests.workers import delivery, new_dispatches, publish_one_message, running_worker, wait_for

KEY = make_settings().secret_key.get_secret_value()


def _unbound(plaintext: str) -> bytes:
    """A ciphertext as the code before binding wrote it: the bare secret in a Fernet token."""
    return _stretched(KEY.split(",")[0]).encrypt(plaintext.encode())


@pytest.fixture
def reseal(engine: Engine) -> Iterator[Callable[[str, str], None]]:
    """Rows a test corrupts on purpose, sealed again for their own place afterwards: the
    suite's database is shared (a rekey test counts every stored secret)."""
    todo: list[tuple[str, str]] = []
    yield lambda secret_id, plaintext: todo.append((secret_id, plaintext))
    box = SecretBox(KEY)
    with engine.begin() as conn:
        for secret_id, plaintext in todo:
            conn.execute(
                text("UPDATE source_secrets SET ciphertext = :c WHERE id = :id"),
                {"c": box.seal(plaintext, source_secret_place(secret_id)), "id": secret_id},
            )


def stored(engine: Engine, secret_id: str) -> bytes:
    with engine.connect() as conn:
        return bytes(
            conn.execute(
                text("SELECT ciphertext FROM source_secrets WHERE id = :id"), {"id": secret_id}
            ).scalar_one()
        )


def _refused(purpose: str, reason: str) -> float:
    value = metrics.SECRETS_REFUSED.labels(purpose, reason)._value.get()
    return float(value)


def test_a_sealed_secret_opens_only_at_its_own_place() -> None:
    box = SecretBox(KEY)
    here = source_secret_place("sec_a")
    sealed = box.seal("whsec_the-secret", here)
    assert box.open(sealed, here) == "whsec_the-secret"
    before = _refused(SIGNING, "misplaced")
    for elsewhere in (
        source_secret_place("sec_b"),  # another row, same purpose
        Place("source_secrets", "sec_a", ROUTE_SIGNING),  # same row, another purpose
        reconcile_place(7),  # another table and purpose
        route_secret_place(1),
    ):
        with pytest.raises(SecretMisplaced) as refused:
            box.open(sealed, elsewhere)
        assert refused.value.found == here
        assert "whsec_the-secret" not in str(refused.value)
    assert _refused(SIGNING, "misplaced") == before + 1  # counted once, for its purpose
    # The plaintext is not readable from the token without the key, place and all.
    with pytest.raises(SecretDecryptError):
        SecretBox("another-key-" + "z" * 40).open(sealed, here)


def test_an_unbound_secret_is_refused_until_it_is_rebound() -> None:
    box = SecretBox(KEY)
    old = _unbound("whsec_old")
    with pytest.raises(SecretUnbound):
        box.open(old, source_secret_place("sec_x"))
    bound = box.rebound(old, source_secret_place("sec_x"))
    assert box.open(bound, source_secret_place("sec_x")) == "whsec_old"
    assert box.is_current(bound, source_secret_place("sec_x"))
    assert not box.is_current(bound, source_secret_place("sec_y"))
    # Rebinding never moves a sealed secret to another place.
    with pytest.raises(SecretMisplaced):
        box.rebound(bound, reconcile_place(1))
    with pytest.raises(ValueError, match="purpose"):
        Place("sources", "1", "anything")


def test_a_signing_secret_copied_into_a_credential_never_reaches_the_api(
    engine: Engine, sessions: sessionmaker[Session], settings: Settings
) -> None:
    victim = make_source(sessions, settings, provider="stripe")
    remember(victim.secret)
    key = f"rk_test_{uuid.uuid4().hex}"
    remember(key)
    fake = FakeStripe(key)
    env = test_env()
    with serving(fake):
        attacker = make_source(sessions, settings, provider="stripe")
        done = cli(
            "sources", "update", attacker.name, "--api-key", key,
            "--config", f"api_base={fake.url}", "--config", f"endpoint_id={fake.endpoint_id}",
            env=env,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        # The copy: the victim's signing-secret ciphertext as the attacker's credential.
        with engine.begin() as conn:
            conn.execute(
                text(
                    "UPDATE sources SET reconcile_ciphertext ="
                    " (SELECT ciphertext FROM source_secrets WHERE id = :secret)"
                    " WHERE id = :attacker"
                ),
                {"secret": victim.secret_id, "attacker": attacker.id},
            )
        fake.seen.clear()
        run = cli("reconcile", attacker.name, "--dry-run", env=env)
    assert run.returncode != 0
    assert len(run.stderr.strip().splitlines()) == 1, run.stderr  # one line, no log noise
    assert "sealed for" in run.stderr
    assert "webhooks sources update SOURCE --api-key" in run.stderr  # the fix for a credential
    assert "copied there" in run.stderr
    assert "Traceback" not in run.stderr
    assert victim.secret not in run.stdout + run.stderr
    assert fake.seen == []  # not one request: the secret went nowhere
    with engine.begin() as conn:  # the shared database: no misplaced row left behind
        conn.execute(
            text("UPDATE sources SET reconcile_ciphertext = NULL WHERE id = :id"),
            {"id": attacker.id},
        )


def test_a_secret_copied_to_another_row_is_refused_by_the_receiver(
    engine: Engine,
    sessions: sessionmaker[Session],
    settings: Settings,
    reseal: Callable[[str, str], None],
) -> None:
    """The receiver's source lookup (what every signed request of that source goes through)
    refuses a signing secret copied from another source's row."""
    one = make_source(sessions, settings)
    other = make_source(sessions, settings)
    remember(one.secret, other.secret)
    reseal(other.secret_id, other.secret)
    with engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE source_secrets SET ciphertext ="
                " (SELECT ciphertext FROM source_secrets WHERE id = :from) WHERE id = :to"
            ),
            {"from": one.secret_id, "to": other.secret_id},
        )

    async def lookup(public_id: str) -> object:
        store = Store(settings, SecretBox(KEY))
        await store.open()
        try:
            return await store.source(public_id, refresh=True)
        finally:
            await store.close()

    with pytest.raises(SecretMisplaced):
        asyncio.run(lookup(other.public_id))
    assert asyncio.run(lookup(one.public_id)) is not None  # the original still opens


def test_upgrade_and_rekey_bind_what_was_written_before_binding(
    engine: Engine,
    sessions: sessionmaker[Session],
    settings: Settings,
    reseal: Callable[[str, str], None],
) -> None:
    made = make_source(sessions, settings)
    remember(made.secret)
    with engine.begin() as conn:
        conn.execute(
            text("UPDATE source_secrets SET ciphertext = :old WHERE id = :id"),
            {"old": _unbound(made.secret), "id": made.secret_id},
        )
    box = SecretBox(KEY)

    with pytest.raises(SecretUnbound):
        box.open(stored(engine, made.secret_id), source_secret_place(made.secret_id))
    upgrade(settings)  # what `webhooks db upgrade` runs
    assert (
        box.open(stored(engine, made.secret_id), source_secret_place(made.secret_id)) == made.secret
    )
    # A misplaced one stays refused and is reported by rekey, not rebound where it stands.
    other = make_source(sessions, settings)
    remember(other.secret)
    reseal(other.secret_id, other.secret)
    with engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE source_secrets SET ciphertext ="
                " (SELECT ciphertext FROM source_secrets WHERE id = :from) WHERE id = :to"
            ),
            {"from": made.secret_id, "to": other.secret_id},
        )

    copied = stored(engine, other.secret_id)
    report = rekey(sessions, box)
    assert report.misplaced["source_secrets"] >= 1  # this one (others' tests may add theirs)
    assert stored(engine, other.secret_id) == copied  # left as it was, not rebound where it stands
    with pytest.raises(SecretMisplaced):
        box.open(stored(engine, other.secret_id), source_secret_place(other.secret_id))


def test_a_route_secret_is_sealed_for_its_route(
    engine: Engine, sessions: sessionmaker[Session], settings: Settings
) -> None:
    made = make_source(
        sessions,
        settings,
        routes=[{"handler": "forward", "options": {"url": "https://example.test/hook"}}],
    )
    remember(made.secret)
    with engine.connect() as conn:
        ciphertext = conn.execute(
            text("SELECT signing_ciphertext FROM routes WHERE id = :id"), {"id": made.route_ids[0]}
        ).scalar_one()
    box = SecretBox(KEY)
    assert box.open(bytes(ciphertext), route_secret_place(made.route_ids[0])).startswith("whsec_")
    with pytest.raises(SecretMisplaced):
        box.open(bytes(ciphertext), route_secret_place(made.route_ids[0] + 1))


@pytest.mark.slow
@pytest.mark.usefixtures("clean_worker_state")
def test_a_forward_route_whose_secret_was_copied_goes_dead_and_calls_nothing(
    engine: Engine, sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    """The worker opens a route's signing secret only at its own route: another route's copied
    there is refused before any downstream call, and the delivery is a dead letter saying so."""
    url = "https://downstream.invalid/hook"  # never reached: the refusal comes first
    (victim, attacker) = new_dispatches(
        sessions, [("forward", {"url": url}), ("forward", {"url": url})]
    )
    route = "(SELECT route_id FROM deliveries WHERE id = :attacker)"
    with engine.begin() as conn:
        own = conn.execute(
            text(f"SELECT signing_ciphertext FROM routes WHERE id = {route}"),
            {"attacker": attacker.delivery_id},
        ).scalar_one()
        conn.execute(
            text(
                "UPDATE routes SET signing_ciphertext = (SELECT r.signing_ciphertext FROM routes r"
                f" JOIN deliveries d ON d.route_id = r.id WHERE d.id = :victim) WHERE id = {route}"
            ),
            {"victim": victim.delivery_id, "attacker": attacker.delivery_id},
        )
    try:
        publish_one_message([attacker])
        with running_worker("misplaced", tmp_path):
            row = wait_for(
                lambda: (r := delivery(engine, attacker.delivery_id)).status == "dead" and r,
                timeout=60,
                what="the delivery to go dead",
            )
    finally:
        # The suite's database is shared: the rotation tests' rekey counts every stored
        # secret, and a copy left here made them report one sealed for another place.
        with engine.begin() as conn:
            conn.execute(
                text(f"UPDATE routes SET signing_ciphertext = :own WHERE id = {route}"),
                {"own": own, "attacker": attacker.delivery_id},
            )
    assert row.dead_reason == "permanent"  # the dead letter's reason for every permanent error
    assert "sealed for routes row" in row.last_error  # which place the copy came from
    assert row.attempts == 1  # refused at once: no retry, no downstream call
