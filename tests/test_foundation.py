"""Settings, migrations, secrets at rest and route matching (issue 2's foundation)."""

from __future__ import annotations

import subprocess
import uuid
from datetime import timedelta

import psycopg
import pytest
import sqlalchemy.exc
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session, sessionmaker

from core.settings import Settings, SettingsError, load_settings
from models.catalog import CatalogError, glob_to_like
from models.db import make_engine, upgrade
from models.installation import InstallationUnknown, installation_id
from models.schema import Base, include_name
from tests.conftest import ADMIN_DSN, BIN, make_settings, test_env
from tests.factories import accept_event, make_source


def _schema_names(name: str | None, type_: str, parent_names: object) -> bool:
    # Tables the suite itself creates (test_effects, for the handlers under test) are no part
    # of the schema, whichever test file ran first.
    if type_ == "table" and name is not None and name.startswith("test_"):
        return False
    return include_name(name, type_, parent_names)


def test_models_and_migrations_agree(engine: Engine) -> None:
    with engine.connect() as conn:
        context = MigrationContext.configure(
            conn,
            opts={
                "include_name": _schema_names,
                "compare_type": True,
                "compare_server_default": True,
            },
        )
        assert compare_metadata(context, Base.metadata) == []


def test_each_life_of_a_database_has_its_own_installation_id() -> None:
    """The claim keys' namespace: random, one row, and new when the database is dropped and
    recreated (its delivery ids start again at 1, its keys must not match the old ones)."""
    from alembic import command  # noqa: PLC0415

    from models.db import alembic_config  # noqa: PLC0415

    name = f"webhooks_inst_{uuid.uuid4().hex[:8]}"
    settings = make_settings(database_url=f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}")
    seen = []
    try:
        for _ in range(2):
            upgrade(settings)
            engine = make_engine(settings, pool_size=1)
            try:
                seen.append(installation_id(engine))
                with engine.connect() as conn, pytest.raises(sqlalchemy.exc.IntegrityError):
                    conn.execute(text("INSERT INTO installation (id) VALUES ('second')"))
                command.downgrade(alembic_config(settings), "0009")
                with pytest.raises(InstallationUnknown, match="webhooks db upgrade"):
                    installation_id(engine)
            finally:
                engine.dispose()
            with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
                conn.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
    finally:
        with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    assert all(len(i) == 16 and int(i, 16) >= 0 for i in seen), seen
    assert seen[0] != seen[1]


def test_db_upgrade_creates_a_missing_database() -> None:
    name = f"webhooks_created_{uuid.uuid4().hex[:8]}"
    env = test_env(WEBHOOKS_DATABASE_URL=f"postgresql://postgres@127.0.0.1:5432/{name}")
    try:
        result = subprocess.run(
            [str(BIN / "webhooks"), "db", "upgrade"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        assert "created and migrated" in result.stdout
        with psycopg.connect(f"postgresql://postgres@127.0.0.1:5432/{name}") as conn:
            version = conn.execute("SELECT version_num FROM alembic_version").fetchone()
            partitions = conn.execute(
                "SELECT count(*) FROM pg_inherits WHERE inhparent = 'receipts'::regclass"
            ).fetchone()
        assert version is not None
        assert partitions is not None
        assert partitions[0] > 0
        again = subprocess.run(
            [str(BIN / "webhooks"), "db", "upgrade"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert again.returncode == 0
        assert "created and migrated" not in again.stdout
    finally:
        with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("WEBHOOKS_PORT", "not-a-port"),
        ("WEBHOOKS_DATABASE_URL", "mysql://nope"),
        ("WEBHOOKS_SECRET_KEY", "short"),
        ("WEBHOOKS_RETENTION_MODE", "sometimes"),
    ],
)
def test_invalid_settings_fail_at_start_naming_the_variable(variable: str, value: str) -> None:
    result = subprocess.run(
        [str(BIN / "webhooks"), "sources", "list"],
        env=test_env(**{variable: value}),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert variable in result.stderr
    assert "Traceback" not in result.stderr


def test_budgets_out_of_order_are_refused_naming_both_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("WEBHOOKS_SOFT_TIME_LIMIT", "90")
    monkeypatch.setenv("WEBHOOKS_HARD_TIME_LIMIT", "60")
    with pytest.raises(SettingsError) as info:
        load_settings()
    assert "WEBHOOKS_SOFT_TIME_LIMIT" in str(info.value)
    assert "WEBHOOKS_HARD_TIME_LIMIT" in str(info.value)


@pytest.mark.parametrize(
    ("name", "value"),
    [("WEBHOOKS_BREAKER_STREAK", "0"), ("WEBHOOKS_BREAKER_STREAK_SPAN", "-1")],
)
def test_a_breaker_streak_out_of_range_is_refused_by_name(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(SettingsError) as info:
        load_settings()
    assert name in str(info.value)


def test_a_negative_streak_span_given_in_code_is_refused_by_name() -> None:
    """The environment's duration parser refuses a negative span before the model sees it;
    a Settings built in code (as the tests and embedders do) meets the model's own check."""
    with pytest.raises(ValueError, match="WEBHOOKS_BREAKER_STREAK_SPAN must not be negative"):
        make_settings(breaker_streak_span=timedelta(seconds=-1))


def test_secrets_are_encrypted_at_rest(
    sessions: sessionmaker[Session], settings: Settings, engine: Engine
) -> None:
    made = make_source(sessions, settings, provider="github", secret="plain-github-secret-123")
    with engine.connect() as conn:
        stored = conn.execute(
            text("SELECT ciphertext FROM source_secrets WHERE id = :i"), {"i": made.secret_id}
        ).scalar_one()
    assert b"plain-github-secret-123" not in bytes(stored)
    other_key = make_settings(secret_key="another-key-" + "z" * 40)
    from core.crypto import SecretBox, SecretDecryptError, source_secret_place

    here = source_secret_place(made.secret_id)
    assert (
        SecretBox(settings.secret_key.get_secret_value()).open(bytes(stored), here)
        == "plain-github-secret-123"
    )
    with pytest.raises(SecretDecryptError):
        SecretBox(other_key.secret_key.get_secret_value()).open(bytes(stored), here)


@pytest.mark.parametrize(
    ("glob", "event_type", "matches"),
    [
        ("*", "invoice.paid", True),
        ("invoice.*", "invoice.paid", True),
        ("invoice.*", "invoicex.paid", False),
        ("invoice.?aid", "invoice.paid", True),
        ("customer.subscription.*", "customer.subscription.updated", True),
        ("customer.subscription.*", "customer.created", False),
        ("100%_done", "100%_done", True),
        ("100%_done", "100xxdone", False),
    ],
)
def test_route_globs_match_in_sql(
    engine: Engine, glob: str, event_type: str, matches: bool
) -> None:
    with engine.connect() as conn:
        result = conn.execute(text("SELECT :t LIKE :p"), {"t": event_type, "p": glob_to_like(glob)})
        assert result.scalar_one() is matches


def test_one_delivery_per_matching_route_in_the_receipt_transaction(
    sessions: sessionmaker[Session], settings: Settings
) -> None:
    made = make_source(
        sessions,
        settings,
        routes=[
            {"handler": "log"},
            {"handler": "log", "events": "invoice.*"},
            {"handler": "log", "events": "customer.*"},
        ],
    )
    _, invoice = accept_event(settings, made, event_type="invoice.paid")
    _, customer = accept_event(settings, made, event_type="customer.created")
    _, other = accept_event(settings, made, event_type="charge.failed")
    assert (invoice.status, len(invoice.delivery_ids)) == ("accepted", 2)
    assert (customer.status, len(customer.delivery_ids)) == ("accepted", 2)
    assert (other.status, len(other.delivery_ids)) == ("accepted", 1)


def test_bad_catalog_input_changes_nothing(
    sessions: sessionmaker[Session], settings: Settings, engine: Engine
) -> None:
    with engine.connect() as conn:
        before = conn.execute(text("SELECT count(*) FROM sources")).scalar_one()
    for kwargs in (
        {"provider": "paypal"},
        {"provider": "standard", "secret": "not base64 !!"},
        {"provider": "hmac", "config": {"algorithm": "md5"}},
        {"provider": "stripe", "ttl_window": True},
    ):
        if kwargs.get("ttl_window"):
            from core.ttl import TtlConfigError, TtlOverrides

            with pytest.raises(TtlConfigError):
                make_source(
                    sessions,
                    settings,
                    provider="stripe",
                    ttl=TtlOverrides(
                        queue_lag=timedelta(0), clock_skew=timedelta(0), replay_grace=timedelta(0)
                    ),
                )
            continue
        with pytest.raises((CatalogError, ValueError)):
            make_source(sessions, settings, **kwargs)  # type: ignore[arg-type]
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM sources")).scalar_one() == before


def test_engine_factory_reaches_the_test_database(settings: Settings) -> None:
    eng = make_engine(settings, pool_size=1)
    try:
        with eng.connect() as conn:
            assert (
                conn.execute(text("SELECT current_database()")).scalar_one()
                == settings.database_name()
            )
    finally:
        eng.dispose()
    upgrade(settings)  # idempotent on an up-to-date database


def test_database_errors_never_carry_bound_parameters(engine: Engine) -> None:
    """SQLAlchemy's error messages name the statement, never the values bound to it. (Postgres
    itself may quote a value in its own message, a cast that failed say: which is why the
    pipeline logs error classes, never error messages, of database errors.)"""
    secret = "whsec_" + "n" * 32
    with pytest.raises(sqlalchemy.exc.DBAPIError) as raised, engine.connect() as conn:
        conn.execute(text("SELECT CAST(:value AS text), 1 / 0"), {"value": secret})
    assert secret not in str(raised.value)
    assert "hidden due to hide_parameters" in str(raised.value)
