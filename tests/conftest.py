"""Test infrastructure: real Postgres and Redis, no mocks of either.

The suite runs against the services on this machine: Postgres 127.0.0.1:5432, and a
redis-server each pytest process starts for itself on a free port (or the one
``WEBHOOKS_TEST_REDIS_PORT`` names). Each process creates and migrates its own database
``webhooks_test_<pid>`` (dropped at the end) and uses Redis databases 4-15, so a pipeline
started by ``make run`` and other suites on the same machine are not disturbed. Subprocesses (receivers, workers, beat) get the same settings through
the environment returned by :func:`test_env`.
"""

from __future__ import annotations

import atexit
import base64
import hashlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import psycopg
import pytest
import redis
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session, sessionmaker

from core.settings import Settings
from models.db import make_engine, make_sessionmaker, upgrade

# Helper modules that also define fixtures: a test module asks for them by name (or with
# ``pytest.mark.usefixtures``), never by importing them from another test file.
pytest_plugins = ("tests.retention_support", "tests.workers")

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
# One database per test run, so runs on one machine never share (or drop) each other's data.
TEST_DB = os.environ.get("WEBHOOKS_TEST_DATABASE", f"webhooks_test_{os.getpid()}")
ADMIN_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"


_GIVEN_PORTS: set[int] = set()


def free_port() -> int:
    """A port free now, and never one this process was given before: the kernel can hand the
    same free port to two calls in a row (a pipeline's four ports once had two the same)."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port not in _GIVEN_PORTS:
            _GIVEN_PORTS.add(port)
            return port


# The Redis server the suite uses (its databases 3-15). Every pytest process (each
# pytest-xdist worker of ``make test``, or a run in one process) starts a redis-server of its
# own on a free port, stopped when the process exits: the suite's Redis databases are fixed
# numbers, so two processes sharing one server (two xdist workers, or suites of two worktrees
# run side by side) would consume each other's messages and flush each other's keys.
# ``WEBHOOKS_TEST_REDIS_PORT=6379`` points a run at a server already running there instead.
# Postgres needs nothing: every process makes a database of its own.
def _private_redis() -> int:
    port = free_port()
    subprocess.run(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--daemonize", "yes", "--dir", tempfile.gettempdir(),
         "--logfile", ""],
        check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 10
    while not _answers(port):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the suite's own redis-server on {port} did not start")
        time.sleep(0.05)
    # Whatever process serves the port then (a test restarts it) is shut down.
    atexit.register(
        subprocess.run,
        ["redis-cli", "-p", str(port), "shutdown", "nosave"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False,
    )  # fmt: skip
    return port


def _answers(port: int) -> bool:
    try:
        return bool(redis.Redis(port=port, socket_timeout=1).ping())
    except redis.RedisError:
        return False


# Not through os.environ: the xdist workers inherit the controller's environment, and each
# needs a server of its own (the controller's, which runs no test, stays idle).
_NAMED_PORT = os.environ.get("WEBHOOKS_TEST_REDIS_PORT")
REDIS_PORT = int(_NAMED_PORT) if _NAMED_PORT else _private_redis()
REDIS = f"redis://127.0.0.1:{REDIS_PORT}"

# A developer's own .env (``make run`` writes one at the project root) must never reach the
# tests: the pipeline's processes get this empty settings file instead, and Settings built
# in this process read no file at all.
EMPTY_ENV_FILE = ROOT / "tests" / "empty.env"
Settings.model_config["env_file"] = None
os.environ["WEBHOOKS_ENV_FILE"] = str(EMPTY_ENV_FILE)

BASE_ENV = {
    "WEBHOOKS_ENV_FILE": str(EMPTY_ENV_FILE),
    "WEBHOOKS_ENVIRONMENT": "test",
    "WEBHOOKS_DATABASE_URL": f"postgresql://postgres@127.0.0.1:5432/{TEST_DB}",
    "WEBHOOKS_BROKER_URL": f"{REDIS}/14",
    "WEBHOOKS_REDIS_URL": f"{REDIS}/15",
    # A generated key (core.crypto.new_key's form), derived with HKDF: every subprocess of
    # the suite started ~0.1 s of CPU sooner than with scrypt. Passphrase keys (scrypt)
    # are the subject of tests/test_crypto*.py and the rotation tests.
    "WEBHOOKS_SECRET_KEY": "whk_"
    + base64.urlsafe_b64encode(hashlib.sha256(b"the suite's storage key").digest())
    .decode()
    .rstrip("="),
    "WEBHOOKS_LOG_JSON": "true",
    # Every test connects from 127.0.0.1 and the processes of one part of the run share a
    # Redis: the production login budgets (5 failures per address a minute) would throttle
    # one module's deliberate wrong tokens because of another's. The throttle's own tests
    # (tests/test_login_throttle.py) set the budgets they test.
    "WEBHOOKS_CONSOLE_LOGIN_FAILURES": "1000",
    "WEBHOOKS_CONSOLE_LOGIN_GLOBAL_FAILURES": "100000",
    # A receiver answers 503 when Postgres has not answered its accept within this deadline
    # (0.9 s in production). Two test processes share two cores with their receivers,
    # workers and Postgres, so a healthy statement can take longer than that and a test
    # about something else met a 503 (the sender's retry, not a loss, but not what it
    # tests). The tests of the deadline itself (tests/test_receiver.py) set 0.9.
    "WEBHOOKS_DB_ANSWER_TIMEOUT": "5",
}


# The suite starts thousands of Python subprocesses (CLI runs, receivers, workers, beat).
# Where PYTHONDONTWRITEBYTECODE is set (CI machines set it) each one compiled the project's
# modules again (~70 ms of CPU a CLI run); they share a bytecode cache outside the tree
# instead. Python validates each entry against its source's mtime and size, and writes
# atomically, so runs and worktrees side by side share it safely.
PYCACHE = Path(tempfile.gettempdir()) / "webhooks-tests-pycache"
# pytest rewrites each test module's asserts (an AST pass over every file) and caches the
# result only where bytecode may be written: where PYTHONDONTWRITEBYTECODE is set, each pytest
# process (two xdist workers, then the serial part) spent half of its collection (~10 s of
# CPU of ~20) rewriting the same 120 files again. From here on this process writes bytecode:
# the test modules' to tests/__pycache__ (ignored by git), beside the project's and the
# libraries' that `make install` compiled in place (no PYTHONPYCACHEPREFIX here: it would
# compile every library again into that directory, ~10 s more on a first run).
sys.dont_write_bytecode = False


def test_env(**overrides: str) -> dict[str, str]:
    """Environment for a subprocess of the pipeline under test."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WEBHOOKS_")}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = str(PYCACHE)
    env.update(BASE_ENV)
    env.update(overrides)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    # The project first; an override adds to it (a plug-in installed into a directory).
    extra = overrides.get("PYTHONPATH")
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{extra}" if extra else str(ROOT)
    return env


test_env.__test__ = False  # type: ignore[attr-defined]  # a helper, not a test

T = TypeVar("T")


def run_each(calls: Iterable[Callable[[], T]]) -> list[T]:
    """Independent subprocess runs (CLI calls that change nothing, or nothing the others
    read), two at a time, results in order: the suite runs one test at a time, so a test
    waiting on one CLI process left the machine's second core idle."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        return list(pool.map(lambda call: call(), calls))


def make_settings(**overrides: object) -> Settings:
    values: dict[str, object] = {
        "environment": "test",
        "database_url": BASE_ENV["WEBHOOKS_DATABASE_URL"],
        "broker_url": BASE_ENV["WEBHOOKS_BROKER_URL"],
        "redis_url": BASE_ENV["WEBHOOKS_REDIS_URL"],
        "secret_key": BASE_ENV["WEBHOOKS_SECRET_KEY"],
    }
    values.update(overrides)
    return Settings(**values)  # type: ignore[arg-type]


def wait_for_port(
    port: int, proc: subprocess.Popen[bytes] | None = None, timeout: float = 60
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening on {port}")
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listening on {port} after {timeout}s")


@pytest.fixture(scope="session", autouse=True)
def _database() -> Iterator[None]:
    for key, value in BASE_ENV.items():
        os.environ[key] = value
    # The suite's Redis databases (3-15) start empty: they outlive a run's Postgres database,
    # and an earlier run's keys (admission's in-flight sets, claim keys) name route and
    # delivery ids that this run's fresh database hands out again.
    for number in range(3, 16):
        client = redis.Redis(port=REDIS_PORT, db=number)
        try:
            client.flushdb()
        finally:
            client.close()
    with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (TEST_DB,)
        )
        conn.execute(f'DROP DATABASE IF EXISTS "{TEST_DB}"')
    upgrade(make_settings())
    yield
    with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (TEST_DB,)
        )
        conn.execute(f'DROP DATABASE IF EXISTS "{TEST_DB}"')


@pytest.fixture(scope="session")
def settings() -> Settings:
    return make_settings()


@pytest.fixture(scope="session")
def engine(settings: Settings) -> Iterator[Engine]:
    eng = make_engine(settings, pool_size=5)
    yield eng
    eng.dispose()


@pytest.fixture(scope="session")
def sessions(engine: Engine) -> sessionmaker[Session]:
    return make_sessionmaker(engine)


@pytest.fixture
def db(sessions: sessionmaker[Session]) -> Iterator[Session]:
    """A session whose work is committed explicitly by the test (real transactions)."""
    with sessions() as session:
        yield session


@pytest.fixture
def redis_client() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(BASE_ENV["WEBHOOKS_REDIS_URL"])
    yield client
    client.close()


def count_rows(engine: Engine, *tables: str) -> dict[str, int]:
    tables = tables or ("receipts", "deliveries", "conflicts", "attempts")
    with engine.connect() as conn:
        return {
            t: int(conn.execute(text(f"SELECT count(*) FROM {t}")).scalar_one()) for t in tables
        }


@pytest.fixture(scope="module")
def ops() -> Iterator[Settings]:
    """The operators' settings (tests/operators_support.py), their Redis flushed before and
    after the module: shared by the files that run a receiver's admin plane or the CLI."""
    from tests.operators_support import flush, ops_settings  # it imports this module

    settings = ops_settings()
    flush(settings)
    yield settings
    flush(settings)
