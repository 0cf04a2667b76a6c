"""Issue 20 items 2 and 3: a key that does not match the database, and a Postgres that cannot
be used, each give one clear line (never a traceback), from every group of commands; the
receiver answers 503 with Retry-After for a source it cannot decrypt, never 500."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import tomllib
import uuid
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import httpx
import psycopg
import pytest
from sqlalchemy import text
from sqlalchemy.orm import Session, sessionmaker

from core.settings import Settings
from tests.conftest import (
    ADMIN_DSN,
    BIN,
    ROOT,
    free_port,
    make_settings,
    run_each,
    test_env,
    wait_for_port,
)
from tests.factories import make_source
from tests.processes import receiver
from tests.signing import sign
from tests.workers import json_log_lines, wait_for

OTHER_KEY = "another-secret-key-" + "z" * 32

# A representative command of every group (and the top-level ones that touch the database).
COMMANDS = [
    ["sources", "list"],
    ["secrets", "list", "src_x"],
    ["routes", "list", "src_x"],
    ["handlers", "list"],
    ["events", "list"],
    ["deliveries", "show", "1"],
    ["dead", "list"],
    ["replay", "1", "--reason", "r", "--yes"],
    ["replays", "list"],
    ["audit", "list"],
    ["ttl", "explain", "src_x"],
    ["maintenance", "run"],
    ["send", "src_x"],
]


def webhooks(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "webhooks"), *args],
        env=test_env(**env),
        capture_output=True,
        text=True,
        timeout=90,
    )


def one_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.fixture(scope="module")
def unmigrated() -> Iterator[str]:
    name = f"webhooks_unmigrated_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield name
    with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}"')


def _cases(unmigrated: str) -> list[tuple[str, str, str]]:
    port = free_port()
    missing = f"webhooks_missing_{uuid.uuid4().hex[:8]}"
    return [
        (
            f"postgresql://postgres@127.0.0.1:{port}/webhooks",
            f"127.0.0.1:{port}/webhooks",
            "connection refused",
        ),
        (f"postgresql://postgres@127.0.0.1:5432/{missing}", missing, "unknown database"),
        (
            "postgresql://no_such_role_x:pw@127.0.0.1:5432/postgres",
            "127.0.0.1:5432/postgres",
            "authentication failed",
        ),
        (
            f"postgresql://postgres@127.0.0.1:5432/{unmigrated}",
            unmigrated,
            "not migrated (a table is missing): run `webhooks db upgrade`",
        ),
    ]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c[:2]))
def test_an_unusable_postgres_is_one_line_naming_where_and_why(
    command: list[str], unmigrated: str
) -> None:
    cases = _cases(unmigrated)
    results = run_each(
        partial(webhooks, *command, WEBHOOKS_DATABASE_URL=url) for url, _, _ in cases
    )
    for (_, where, cause), result in zip(cases, results, strict=True):
        line = one_line(result)
        assert where in line, line
        assert cause in line, line
        assert "pw" not in line  # never the password


def test_db_upgrade_and_run_name_the_cause_too(tmp_path: Path) -> None:
    port = free_port()
    url = f"postgresql://postgres@127.0.0.1:{port}/webhooks"
    for command in (["db", "upgrade"], ["run", "--no-flower"]):
        line = one_line(webhooks(*command, WEBHOOKS_DATABASE_URL=url))
        assert f"127.0.0.1:{port}/webhooks: connection refused" in line, line
    bad_role = "postgresql://no_such_role_x:pw@127.0.0.1:5432/webhooks_x"
    line = one_line(webhooks("db", "upgrade", WEBHOOKS_DATABASE_URL=bad_role))
    assert "authentication failed" in line, line


def test_serve_refuses_a_database_a_migration_behind_the_code_in_one_line() -> None:
    """The receiver needs the newest migration (0018 changed what the accept statement
    returns; 0019 marks stored secrets bound to their place; 0020 records when each attempt's
    outcome committed; later ones too): on a database left at 0017 or 0018, or never migrated, ``webhooks serve`` refuses to
    start with one line naming the revisions and the fix, instead of answering every webhook
    with an error. Once upgraded, it starts."""
    from alembic import command  # noqa: PLC0415
    from alembic.script import ScriptDirectory  # noqa: PLC0415

    from models.db import alembic_config, ensure_database  # noqa: PLC0415

    name = f"webhooks_behind_{uuid.uuid4().hex[:8]}"
    url = f"postgresql://postgres@127.0.0.1:5432/{name}"
    settings = make_settings(database_url=url)
    head = ScriptDirectory.from_config(alembic_config(settings)).get_current_head()
    assert head is not None
    assert head >= "0021"
    try:
        ensure_database(settings)
        line = one_line(webhooks("serve", "--port", str(free_port()), WEBHOOKS_DATABASE_URL=url))
        assert f"127.0.0.1:5432/{name} is at migration none, this code needs {head}" in line, line
        assert "webhooks db upgrade" in line
        command.upgrade(alembic_config(settings), "0017")
        line = one_line(webhooks("serve", "--port", str(free_port()), WEBHOOKS_DATABASE_URL=url))
        assert f"is at migration 0017, this code needs {head}: run `webhooks db upgrade`" in line
        command.upgrade(alembic_config(settings), "0018")
        line = one_line(webhooks("serve", "--port", str(free_port()), WEBHOOKS_DATABASE_URL=url))
        assert f"is at migration 0018, this code needs {head}: run `webhooks db upgrade`" in line
        command.upgrade(alembic_config(settings), "head")
        port = free_port()
        proc = subprocess.Popen(
            [str(BIN / "webhooks"), "serve", "--port", str(port), "--workers", "1"],
            env=test_env(WEBHOOKS_DATABASE_URL=url, WEBHOOKS_ADMIN_PORT=str(free_port())),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        try:
            wait_for_port(port, proc)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    finally:
        with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_a_key_that_does_not_match_the_database_is_refused_in_one_line(
    sessions: sessionmaker[Session], settings: Settings
) -> None:
    make_source(sessions, settings, provider="github")
    commands = (["sources", "list"], ["dead", "list"], ["send", "src_x"], ["audit", "list"])
    for result in run_each(partial(webhooks, *c, WEBHOOKS_SECRET_KEY=OTHER_KEY) for c in commands):
        line = one_line(result)
        assert "WEBHOOKS_SECRET_KEY cannot decrypt" in line, line
        assert "stored secrets checked" in line
    # serve refuses to start; run refuses before it starts anything.
    line = one_line(webhooks("serve", "--port", str(free_port()), WEBHOOKS_SECRET_KEY=OTHER_KEY))
    assert "WEBHOOKS_SECRET_KEY cannot decrypt" in line
    line = one_line(webhooks("run", "--no-flower", WEBHOOKS_SECRET_KEY=OTHER_KEY))
    assert "WEBHOOKS_SECRET_KEY cannot decrypt" in line
    # The way out is not refused: rekey with the right key listed after the new one.
    rekey = webhooks(
        "secrets",
        "rekey",
        WEBHOOKS_SECRET_KEY=f"{OTHER_KEY},{settings.secret_key.get_secret_value()}",
    )
    assert rekey.returncode == 0, rekey.stderr
    rekey = webhooks(
        "secrets",
        "rekey",
        WEBHOOKS_SECRET_KEY=f"{settings.secret_key.get_secret_value()},{OTHER_KEY}",
    )
    assert rekey.returncode == 0, rekey.stderr


def test_the_count_of_unreadable_secrets_is_named(
    sessions: sessionmaker[Session], settings: Settings
) -> None:
    from core.crypto import KeyMismatch, SecretBox
    from models.catalog import check_stored_keys

    make_source(sessions, settings, provider="stripe")
    with sessions() as session:
        checked = check_stored_keys(session, SecretBox(settings.secret_key.get_secret_value()))
        assert checked >= 1
        with pytest.raises(KeyMismatch) as caught:
            check_stored_keys(session, SecretBox(OTHER_KEY))
    assert caught.value.unreadable == caught.value.checked == checked
    assert f"cannot decrypt {checked} of the {checked}" in str(caught.value)


def test_a_source_the_receiver_cannot_decrypt_gets_503_with_retry_after(
    sessions: sessionmaker[Session],
) -> None:
    with receiver() as rcv:
        # Written by a process with another key after this receiver started.
        other = make_source(sessions, make_settings(secret_key=OTHER_KEY), provider="github")
        headers, body = sign("github", other.secret, event_id="evt_undecryptable")
        answer = httpx.post(f"{rcv.url}/webhooks/{other.public_id}", content=body, headers=headers)
        log = rcv.log_path.read_text()
    # Gone whole: the other tests' key checks and rekeys read every stored secret, revoked too.
    with sessions() as session, session.begin():
        for sql in (
            "DELETE FROM source_secrets WHERE source_id = :s",
            "DELETE FROM routes WHERE source_id = :s",
            "DELETE FROM sources WHERE id = :s",
        ):
            session.execute(text(sql), {"s": other.id})
    assert answer.status_code == 503
    assert answer.headers["retry-after"] == "60"
    assert "source.secret_undecryptable" in log
    assert "Traceback" not in log
    assert other.secret not in log


def test_version_prints_the_installed_version_and_reads_no_setting() -> None:
    """``webhooks --version``: the project's version from pyproject.toml, exit 0, even with a
    database that does not answer and a secret key too short to pass validation."""
    with (ROOT / "pyproject.toml").open("rb") as f:
        expected = tomllib.load(f)["project"]["version"]
    result = webhooks(
        "--version",
        WEBHOOKS_DATABASE_URL="postgresql://postgres@127.0.0.1:1/nowhere",
        WEBHOOKS_SECRET_KEY="short",
    )
    assert (result.returncode, result.stdout, result.stderr) == (0, f"webhooks {expected}\n", "")


@pytest.mark.parametrize(
    ("url", "says"),
    [
        (
            "postgresql://postgres@127.0.0.1:5432/webhooks_no_such_database",
            "unknown database (WEBHOOKS_DATABASE_URL): run `webhooks db upgrade` to create it",
        ),
        (
            "postgresql://webhooks_no_such_role@127.0.0.1:5432/postgres",
            "authentication failed (the user or password in WEBHOOKS_DATABASE_URL)",
        ),
    ],
    ids=["unknown-database", "unknown-role"],
)
def test_serve_refuses_to_start_on_a_database_it_can_never_use(url: str, says: str) -> None:
    """Waiting changes nothing for a database that does not exist or a role Postgres refuses:
    one line naming where and why, exit 1, nothing bound (it used to start, print the pool's
    connection errors every 2 s and answer every webhook 503 after 5 s)."""
    port = free_port()
    result = webhooks("serve", "--port", str(port), WEBHOOKS_DATABASE_URL=url)
    line = one_line(result)
    assert line == f"error: Postgres at {url.split('@')[1]}: {says}"
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", port)) != 0  # never listened


def test_serve_without_postgres_starts_and_says_so_in_structured_lines(
    sessions: sessionmaker[Session], settings: Settings
) -> None:
    """Postgres away (a port nobody listens on): the receiver starts (Postgres may come
    later), says why in its start-up warning, answers a webhook 503 with Retry-After, and
    the pool's reconnection tries are one structured ``db.connect_failed`` line, not a raw
    line every 2 s. The request answers at its deadline (0.5 s) while its statement waits on
    for a connection (5 s): that statement's end is one ``db.late_failure`` line, never
    asyncio's "exception was never retrieved" traceback."""
    source = make_source(sessions, settings, provider="github")
    headers, body = sign("github", source.secret, event_id="evt_no_postgres")
    away = f"postgresql://postgres@127.0.0.1:{free_port()}/x"
    with receiver(WEBHOOKS_DATABASE_URL=away, WEBHOOKS_DB_ANSWER_TIMEOUT="0.5") as rcv:
        answer = httpx.post(
            f"{rcv.url}/webhooks/{source.public_id}", content=body, headers=headers, timeout=30
        )
        lines = wait_for(
            lambda: (
                (found := json_log_lines(rcv.log_path))
                and {"db.connect_failed", "db.late_failure"} <= {line["event"] for line in found}
                and found
            ),
            timeout=30,
            what="the pool's structured line and the late statement's",
        )
        raw = rcv.log_path.read_text()
    assert answer.status_code == 503
    assert answer.headers["retry-after"]
    [started] = [line for line in lines if line["event"] == "startup.checks_skipped"]
    assert "connection refused (is Postgres running on that port?)" in started["reason"]
    failed = [line for line in lines if line["event"] == "db.connect_failed"]
    assert failed[0]["held_back"] == 0
    assert "Connection refused" in failed[0]["reason"]
    [late] = [line for line in lines if line["event"] == "db.late_failure"]
    assert late["error_class"] == "PoolTimeout"
    assert "error connecting in" not in raw
    assert "Traceback" not in raw


_POOL_LINES = """
import logging
from core import logs
logs.configure_logging("INFO", json=True)
pool = logging.getLogger("psycopg.pool")
for _ in range(5):
    pool.warning("error connecting in %r: %s", "pool-1", "connection failed: refused\\n\\tagain")
logs.POOL_LINE_INTERVAL = 0.0
pool.warning("error connecting in %r: %s", "pool-1", "connection failed: refused")
pool.warning("the pool's other lines pass as they were")
"""


def test_the_pools_connection_errors_are_one_line_a_minute_with_the_count_held_back() -> None:
    """psycopg_pool's "error connecting in 'pool-1': ..." warnings through the filter that
    ``configure_logging`` installs (in a process of its own): the first becomes one
    structured line, the next ones within POOL_LINE_INTERVAL are held back and counted in
    the next line; the pool's other lines are untouched."""
    run = subprocess.run(
        [sys.executable, "-c", _POOL_LINES],
        env=test_env(), capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    lines = run.stderr.splitlines()
    emitted = [json.loads(line) for line in lines if line.startswith("{")]
    assert [(e["event"], e["pool"], e["held_back"]) for e in emitted] == [
        ("db.connect_failed", "pool-1", 0),
        ("db.connect_failed", "pool-1", 4),
    ]
    assert emitted[0]["reason"] == "connection failed: refused again"
    assert "the pool's other lines pass as they were" in lines
    assert not any("error connecting in" in line for line in lines)
