"""The application's own database role (issue 11): ``webhooks db create-role``, then the
pipeline running as that role in a database of its own.

As the compose ``migrate`` step does: the role is created by the superuser, the database is
migrated as the role, then a real receiver accepts an event and maintenance lays out and drops
partitions, all connected as the role, which is not a superuser. Bad input changes nothing.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import httpx
import psycopg
import pytest
from sqlalchemy import text

from models.db import make_engine, make_sessionmaker
from models.retention_expiry import expire_partitions
from models.retention_holds import database_now
from models.retention_layout import ensure_partitions
from models.roles import RoleError, check_role_name
from tests.conftest import ADMIN_DSN, BIN, make_settings, test_env
from tests.factories import make_source
from tests.leakcheck import remember
from tests.processes import receiver
from tests.signing import sign

pytestmark = pytest.mark.slow  # CLI subprocesses and a receiver: about a minute

PASSWORD = "role-pw-" + uuid.uuid4().hex  # trust auth here: checked for length, not used
remember(PASSWORD)


@dataclass(frozen=True)
class Setup:
    database: str
    role: str
    admin_url: str  # the database, as the superuser
    role_url: str  # the database, as the role
    env_file: Path  # empty: no project .env leaks into the CLI runs


def _url(user: str, database: str, password: str | None = None) -> str:
    auth = f"{user}:{password}" if password else user
    return f"postgresql://{auth}@127.0.0.1:5432/{database}"


def _admin(sql: str, *params: object) -> list[tuple[object, ...]]:
    with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
        cur = conn.execute(sql, params or None)
        return cur.fetchall() if cur.description else []


def _drop_database(name: str) -> None:
    _admin("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", name)
    _admin(f'DROP DATABASE IF EXISTS "{name}"')


@pytest.fixture(scope="module")
def setup() -> Iterator[Setup]:
    tag = f"{os.getpid()}_{uuid.uuid4().hex[:6]}"
    database, role = f"webhooks_role_db_{tag}", f"webhooks_role_{tag}"
    with tempfile.NamedTemporaryFile("w", suffix=".env", delete=False) as fh:
        env_file = Path(fh.name)
    yield Setup(
        database,
        role,
        _url("postgres", database),
        _url(role, database, PASSWORD),
        env_file,
    )
    for name in (database, f"{database}_old"):
        _drop_database(name)
    _admin(f'DROP ROLE IF EXISTS "{role}"')
    _admin(f'DROP ROLE IF EXISTS "{role}_su"')
    env_file.unlink()


def cli(
    s: Setup, *args: str, url: str | None = None, **env: str
) -> subprocess.CompletedProcess[str]:
    environ = test_env(
        WEBHOOKS_DATABASE_URL=url or s.admin_url, WEBHOOKS_ENV_FILE=str(s.env_file), **env
    )
    return subprocess.run(
        [str(BIN / "webhooks"), *args],
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def role_attributes(role: str) -> tuple[object, ...] | None:
    rows = _admin(
        "SELECT rolsuper, rolcreatedb, rolcreaterole, rolcanlogin, rolreplication, rolbypassrls "
        "FROM pg_roles WHERE rolname = %s",
        role,
    )
    return rows[0] if rows else None


def database_exists(name: str) -> bool:
    return bool(_admin("SELECT 1 FROM pg_database WHERE datname = %s", name))


def not_owned_by(admin_url: str, role: str) -> list[tuple[object, ...]]:
    """The schema, its relations and its functions, where owned by anyone but ``role``."""
    with psycopg.connect(admin_url) as conn:
        return conn.execute(
            """
            SELECT 'rel', c.relname::text FROM pg_class c
            WHERE c.relnamespace = current_schema()::regnamespace AND c.relowner <> %(r)s::regrole
            UNION ALL
            SELECT 'fn', p.proname::text FROM pg_proc p
            WHERE p.pronamespace = current_schema()::regnamespace AND p.proowner <> %(r)s::regrole
            UNION ALL
            SELECT 'schema', n.nspname::text FROM pg_namespace n
            WHERE n.nspname = current_schema() AND n.nspowner <> %(r)s::regrole
            """,
            {"r": role},
        ).fetchall()


def test_bad_input_is_refused_and_changes_nothing(setup: Setup) -> None:
    roles_before = _admin("SELECT count(*) FROM pg_roles")
    for name, reason in [
        ("app-role", "invalid role name"),
        ('x"; DROP ROLE postgres; --', "invalid role name"),
        ("pg_app", "reserved"),
    ]:
        done = cli(setup, "db", "create-role", name, WEBHOOKS_DB_PASSWORD=PASSWORD)
        assert done.returncode == 1, (name, done.stdout, done.stderr)
        assert reason in done.stderr, (name, done.stderr)
    for name in ("Bad", "1app", "a" * 64, "", "app role", "\u00e9t\u00e9"):
        with pytest.raises(RoleError, match="invalid role name"):
            check_role_name(name)
    for name in ("postgres", "public", "pg_signal_backend"):
        with pytest.raises(RoleError, match="reserved"):
            check_role_name(name)
    missing = cli(setup, "db", "create-role", setup.role)
    assert missing.returncode == 1
    assert "set the role's password in the environment variable WEBHOOKS_DB_PASSWORD" in (
        missing.stderr
    )
    other_var = cli(setup, "db", "create-role", setup.role, "--password-env", "APP_PW")
    assert other_var.returncode == 1
    assert "environment variable APP_PW" in other_var.stderr
    short = cli(setup, "db", "create-role", setup.role, WEBHOOKS_DB_PASSWORD="short")
    assert short.returncode == 1
    assert "too short" in short.stderr
    assert "short" not in short.stderr.replace("too short", "")  # never echoes the password
    # An existing superuser is never demoted, nor handed the database.
    _admin(f'CREATE ROLE "{setup.role}_su" SUPERUSER')
    su = cli(setup, "db", "create-role", f"{setup.role}_su", WEBHOOKS_DB_PASSWORD=PASSWORD)
    assert su.returncode == 1
    assert "is a superuser" in su.stderr
    assert role_attributes(f"{setup.role}_su")[0] is True  # type: ignore[index]
    _admin(f'DROP ROLE "{setup.role}_su"')
    assert _admin("SELECT count(*) FROM pg_roles") == roles_before
    assert role_attributes(setup.role) is None
    # Nothing was created either: the database is made only once the input is good.
    assert not database_exists(setup.database)


def test_create_role_then_migrate_as_it(setup: Setup) -> None:
    done = cli(setup, "db", "create-role", setup.role, WEBHOOKS_DB_PASSWORD=PASSWORD)
    assert done.returncode == 0, done.stderr
    assert f"role {setup.role} created" in done.stdout
    assert PASSWORD not in done.stdout + done.stderr
    again = cli(setup, "db", "create-role", setup.role, WEBHOOKS_DB_PASSWORD=PASSWORD)
    assert again.returncode == 0, again.stderr
    assert f"role {setup.role} updated" in again.stdout
    # LOGIN, and none of the powers a superuser has.
    assert role_attributes(setup.role) == (False, False, False, True, False, False)
    owner = _admin(
        "SELECT datdba::regrole::text FROM pg_database WHERE datname = %s", setup.database
    )
    assert owner == [(setup.role,)]

    upgraded = cli(setup, "db", "upgrade", url=setup.role_url)
    assert upgraded.returncode == 0, upgraded.stderr
    assert not_owned_by(setup.admin_url, setup.role) == []
    with psycopg.connect(setup.admin_url) as conn:
        tables = conn.execute(
            "SELECT count(*) FROM pg_tables WHERE tableowner = %s", (setup.role,)
        ).fetchone()
    assert tables is not None
    assert tables[0] >= 10
    # A non-superuser cannot hand out roles: the command says so and changes nothing.
    as_role = cli(
        setup,
        "db",
        "create-role",
        "webhooks_other",
        url=setup.role_url,
        WEBHOOKS_DB_PASSWORD=PASSWORD,
    )
    assert as_role.returncode == 1
    assert "must connect as a superuser" in as_role.stderr
    assert role_attributes("webhooks_other") is None


def test_pipeline_runs_as_the_role(setup: Setup) -> None:
    """A real receiver connected as the role accepts an event; maintenance (the CLI, and the
    partition creation and drop it and the receiver run) works as the role."""
    settings = make_settings(database_url=setup.role_url)
    engine = make_engine(settings, pool_size=2)
    try:
        with engine.connect() as conn:
            assert conn.execute(text("SELECT current_user")).scalar_one() == setup.role
            assert (
                conn.execute(
                    text("SELECT rolsuper FROM pg_roles WHERE rolname = current_user")
                ).scalar_one()
                is False
            )
        source = make_source(make_sessionmaker(engine), settings, provider="standard")
        remember(source.secret)
        event_id = f"evt_{uuid.uuid4().hex}"
        headers, body = sign("standard", source.secret, event_id=event_id)
        with receiver(WEBHOOKS_DATABASE_URL=setup.role_url) as rcv:
            response = httpx.post(
                f"{rcv.url}/webhooks/{source.public_id}", headers=headers, content=body, timeout=20
            )
        assert response.status_code == 202, response.text
        with engine.connect() as conn:
            stored = conn.execute(
                text("SELECT count(*) FROM receipts WHERE event_id = :e"), {"e": event_id}
            ).scalar_one()
        assert stored == 1

        maintenance = cli(setup, "maintenance", "run", "--json", url=setup.role_url)
        assert maintenance.returncode == 0, maintenance.stderr

        # Partitions: laid out ahead (CREATE TABLE ... PARTITION OF) and dropped when past
        # (DROP TABLE), both as the role, on days chosen relative to the database's clock.
        now = database_now(engine)
        created = ensure_partitions(engine, settings, now + timedelta(days=40))
        assert created
        expiry = expire_partitions(engine, settings, now + timedelta(days=2))
        assert expiry.dropped
        with engine.connect() as conn:
            still = conn.execute(
                text("SELECT count(*) FROM receipts WHERE event_id = :e"), {"e": event_id}
            ).scalar_one()
        assert still == 1  # its delivery is unfinished: held, moved forward, not dropped
    finally:
        engine.dispose()
    assert role_attributes(setup.role)[0] is False  # type: ignore[index]


def test_existing_database_is_handed_over(setup: Setup) -> None:
    """A deployment migrated as the superuser before: create-role hands every table, sequence
    and function to the role, which can then migrate it and lay out partitions."""
    old = f"{setup.database}_old"
    assert cli(setup, "db", "upgrade", url=_url("postgres", old)).returncode == 0
    assert not_owned_by(_url("postgres", old), setup.role) != []
    done = cli(
        setup,
        "db",
        "create-role",
        setup.role,
        url=_url("postgres", old),
        WEBHOOKS_DB_PASSWORD=PASSWORD,
    )
    assert done.returncode == 0, done.stderr
    assert "objects handed over" in done.stdout
    assert not_owned_by(_url("postgres", old), setup.role) == []
    upgraded = cli(setup, "db", "upgrade", url=_url(setup.role, old, PASSWORD))
    assert upgraded.returncode == 0, upgraded.stderr
