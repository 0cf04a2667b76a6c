"""``webhooks run`` as a service manager, and the CLI's runtime: configuration found from any
directory, durations, JSON times, help text, each process's own metrics.

Everything runs for real: ``webhooks run`` starts the receiver, a Celery worker, beat and
Flower on the suite's database and Redis databases 6 (broker) and 7 (claims), which no other
test module uses. The closed terminal is a real pseudo-terminal whose master side is closed.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import select
import signal
import socket
import subprocess
import sys
import termios
import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import httpx
import psycopg
import pytest
import typer.main
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from core import metrics
from core.durations import DurationError, parse_duration
from core.logs import wants_json
from core.settings import Settings, SettingsError, load_settings
from tests.conftest import ADMIN_DSN, BASE_ENV, BIN, REDIS, ROOT, free_port, test_env
from tests.leakcheck import log_file, remember
from tests.workers import children, wait_for
from webhooks.cli import app
from webhooks.cli.common import ConfigSource, find_env_file, print_json

pytestmark = [pytest.mark.timeout(180)]

REDIS = {
    "WEBHOOKS_BROKER_URL": f"{REDIS}/6",
    "WEBHOOKS_REDIS_URL": f"{REDIS}/7",
}
FLOWER_PASSWORD = "runtime-flower-" + "p" * 12
remember(FLOWER_PASSWORD)


# Helpers ----------------------------------------------------------------------------------


def run_env(**overrides: str) -> dict[str, str]:
    """A pipeline on free ports; WEBHOOKS_LOG_JSON unset (auto) unless given."""
    env = test_env(
        **REDIS,
        WEBHOOKS_PORT=str(free_port()),
        WEBHOOKS_ADMIN_PORT=str(free_port()),
        WEBHOOKS_FLOWER_PORT=str(free_port()),
        WEBHOOKS_WORKER_METRICS_PORT=str(free_port()),
        WEBHOOKS_FLOWER_PASSWORD=FLOWER_PASSWORD,
        WEBHOOKS_LOG_LEVEL="INFO",
        WEBHOOKS_SWEEP_INTERVAL="1h",  # beat stays quiet during a test
    )
    env.pop("WEBHOOKS_LOG_JSON")
    env.update(overrides)
    return env


def cli(
    *args: str, env: dict[str, str], cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [str(BIN / "webhooks"), *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    log_file(f"runtime-cli-{os.getpid()}-{id(proc)}").write_text(proc.stdout + proc.stderr)
    return proc


class Output:
    """Lines read from a pipe or a pseudo-terminal by a thread, waited on by the test."""

    def __init__(self, read: Callable[[], bytes]) -> None:
        self._read = read
        self._buffer = b""
        self._changed = threading.Condition()
        self.closed = False
        self._thread = threading.Thread(target=self._pump, daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        while True:
            try:
                chunk = self._read()
            except OSError:  # EIO: the pseudo-terminal's other side is gone
                chunk = b""
            with self._changed:
                if not chunk:
                    self.closed = True
                    self._changed.notify_all()
                    return
                self._buffer += chunk
                self._changed.notify_all()

    @property
    def text(self) -> str:
        with self._changed:
            return self._buffer.decode(errors="replace").replace("\r\n", "\n")

    def lines(self) -> list[str]:
        return [line for line in self.text.splitlines() if line.strip()]

    def wait_for(self, needle: str, timeout: float = 90) -> None:
        with self._changed:
            found = self._changed.wait_for(
                lambda: needle in self._buffer.decode(errors="replace") or self.closed, timeout
            )
        if not found or needle not in self.text:
            raise AssertionError(f"no {needle!r} in the output:\n{self.text[-4000:]}")

    def wait_closed(self, timeout: float = 60) -> None:
        with self._changed:
            assert self._changed.wait_for(lambda: self.closed, timeout), self.text[-3000:]


class Pipeline:
    """``webhooks run`` with stdout and stderr on one pipe (not a terminal)."""

    def __init__(self, env: dict[str, str], cwd: Path, *args: str) -> None:
        self.env = env
        self.proc = subprocess.Popen(
            [str(BIN / "webhooks"), "run", *args],
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        assert self.proc.stdout is not None
        self.out = Output(self.proc.stdout.read1)  # type: ignore[attr-defined]

    def port(self, name: str) -> int:
        return int(self.env[f"WEBHOOKS_{name}"])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        log_file(f"runtime-run-{self.proc.pid}").write_text(self.out.text)


@contextlib.contextmanager
def pipeline(env: dict[str, str], cwd: Path, *args: str) -> Iterator[Pipeline]:
    running = Pipeline(env, cwd, *args)
    try:
        yield running
    finally:
        pids = descendants(running.proc.pid)
        running.close()
        for pid in pids:  # never leave a child behind, whatever the test found
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def descendants(pid: int) -> list[int]:
    found = []
    for child in children(pid):
        found += [child, *descendants(child)]
    return found


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited


def answers(url: str, auth: tuple[str, str] | None = None) -> int | None:
    try:
        return httpx.get(url, auth=auth, timeout=5).status_code
    except httpx.HTTPError:
        return None


def families(port: int) -> set[str]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {f.name for f in text_string_to_metric_families(text)}


# webhooks run -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("variable", "child"),
    [
        ("WEBHOOKS_PORT", "receiver"),
        ("WEBHOOKS_ADMIN_PORT", "admin API"),
        ("WEBHOOKS_FLOWER_PORT", "Flower"),
        ("WEBHOOKS_WORKER_METRICS_PORT", "worker metrics"),
    ],
)
def test_run_refuses_a_taken_port_and_starts_nothing(
    tmp_path: Path, variable: str, child: str
) -> None:
    # A database that does not exist: had run migrated anything, it would exist afterwards.
    database = f"webhooks_test_runtime_{os.getpid()}_untouched"
    env = run_env(WEBHOOKS_DATABASE_URL=f"postgresql://postgres@127.0.0.1:5432/{database}")
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", int(env[variable])))
        holder.listen()
        result = cli("run", env=env, cwd=tmp_path)
    assert result.returncode == 1
    assert result.stdout == ""
    [line] = result.stderr.splitlines()
    port = env[variable]
    assert line.startswith(f"error: port {port} for the {child} ({variable}) is taken"), line
    assert f"127.0.0.1:{port}" in line
    assert "nothing was started" in line
    assert "Traceback" not in result.stderr
    with psycopg.connect(ADMIN_DSN) as conn:
        row = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (database,)).fetchone()
    assert row is None, "run migrated a database although a port was taken"


@pytest.mark.parametrize("variable", ["WEBHOOKS_BROKER_URL", "WEBHOOKS_REDIS_URL"])
def test_run_without_redis_says_which_and_starts_nothing(tmp_path: Path, variable: str) -> None:
    """Issue 36: with Redis down, ``run`` started every child into a minute of retries and
    then said only that the worker's /metrics did not answer. Now one line names the
    variable and where (never its password), at once, and nothing is migrated or started."""
    database = f"webhooks_test_runtime_{os.getpid()}_no_redis"
    port = free_port()  # nobody listens there
    env = run_env(
        WEBHOOKS_DATABASE_URL=f"postgresql://postgres@127.0.0.1:5432/{database}",
        **{variable: f"redis://:hunter2-redis-password@127.0.0.1:{port}/0"},
    )
    result = cli("run", env=env, cwd=tmp_path)
    assert result.returncode == 1
    assert result.stdout == ""
    [line] = result.stderr.splitlines()
    assert line.startswith(f"error: cannot reach 127.0.0.1:{port}/0 ({variable}): "), line
    assert "refused" in line.lower()
    assert "hunter2" not in result.stderr
    assert "Traceback" not in result.stderr
    with psycopg.connect(ADMIN_DSN) as conn:
        row = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (database,)).fetchone()
    assert row is None, "run migrated a database although Redis was unreachable"


def test_run_refuses_two_children_on_one_port(tmp_path: Path) -> None:
    env = run_env()
    env["WEBHOOKS_FLOWER_PORT"] = env["WEBHOOKS_PORT"]
    result = cli("run", env=env, cwd=tmp_path)
    assert result.returncode == 1
    assert result.stderr.startswith("error: WEBHOOKS_PORT and WEBHOOKS_FLOWER_PORT are both")


def _gate(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """The receiver (``webhooks serve``) blocks before it imports anything until the test
    opens a FIFO: a receiver that is provably not answering yet."""
    gate_dir = tmp_path / "gate"
    gate_dir.mkdir()
    fifo = gate_dir / "receiver.fifo"
    os.mkfifo(fifo)
    (gate_dir / "sitecustomize.py").write_text(
        "import os\n"
        "gate = os.environ.get('RUNTIME_TEST_RECEIVER_GATE')\n"
        "if gate:\n"
        "    with open('/proc/self/cmdline', 'rb') as f:\n"
        "        argv = f.read().split(b'\\0')\n"
        "    if b'serve' in argv:\n"
        "        with open(gate) as g:\n"
        "            g.read()\n"
    )
    env = run_env(RUNTIME_TEST_RECEIVER_GATE=str(fifo))
    env["PYTHONPATH"] = f"{gate_dir}{os.pathsep}{ROOT}"
    return env, fifo


@pytest.mark.slow
def test_run_says_running_only_once_every_child_answers_then_sigterm_stops_all(
    tmp_path: Path,
) -> None:
    env, fifo = _gate(tmp_path)
    # As after `make run`: the project's virtualenv is not on PATH.
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if p != str(BIN))
    scratch = tmp_path / "tmp"  # where `webhooks run` keeps beat's schedule while it runs
    scratch.mkdir()
    env["TMPDIR"] = str(scratch)
    with pipeline(env, tmp_path) as run:
        receiver = f"http://127.0.0.1:{run.port('PORT')}"
        admin = f"http://127.0.0.1:{run.port('ADMIN_PORT')}"
        worker_metrics = run.port("WORKER_METRICS_PORT")
        flower = f"http://127.0.0.1:{run.port('FLOWER_PORT')}"
        # Worker and Flower answer while the receiver is held: no banner.
        run.out.wait_for("worker ready")
        run.out.wait_for("flower ready")
        assert "pipeline running" not in run.out.text
        assert "receiver ready" not in run.out.text
        assert answers(f"{receiver}/healthz") is None
        with fifo.open("w"):
            pass  # let the receiver start
        run.out.wait_for("pipeline running")
        # The migration at start is said (issue 36: it happened without a word).
        name = env["WEBHOOKS_DATABASE_URL"].rsplit("/", 1)[1]
        assert f"database {name} migrated to the latest schema" in run.out.text
        assert len(list(scratch.glob("webhooks-run-*"))) == 1
        # The moment the banner is out, every child answers.
        assert answers(f"{receiver}/healthz") == 200
        assert answers(f"{admin}/metrics") == 200
        assert answers(f"{receiver}/metrics") == 404  # the public port lists no sources
        assert answers(f"http://127.0.0.1:{worker_metrics}/metrics") == 200
        assert answers(f"{flower}/healthcheck", ("admin", FLOWER_PASSWORD)) == 200

        banner = run.out.text.split("pipeline running", 1)[1]
        assert f"{receiver}/webhooks/<source_id>" in banner
        assert f"{admin}/metrics" in banner
        # No admin token here: the API and the console are off, and the banner offers neither.
        assert "admin API off" in banner
        assert "/console/" not in banner
        assert f"{flower}  user admin, password: WEBHOOKS_FLOWER_PASSWORD in the environment" in (
            banner
        )
        assert FLOWER_PASSWORD not in run.out.text
        # Nor on any child's command line, which `ps` shows every user of the host.
        for child in children(run.proc.pid):
            assert FLOWER_PASSWORD.encode() not in Path(f"/proc/{child}/cmdline").read_bytes()
        assert f"{BIN / 'webhooks'} demo" in banner  # the CLI as it can be typed from anywhere

        # Each process lists its own metric families only.
        receiver_families = families(run.port("ADMIN_PORT"))
        worker_families = families(worker_metrics)
        assert "webhooks_requests" in receiver_families
        assert not receiver_families & metrics.hidden_from("receiver")
        assert not worker_families & metrics.hidden_from("worker")
        # Worker-only and unlabelled: listed at 0 (the delivery counters carry a source label,
        # so they are listed once a delivery of some source has counted).
        assert "webhooks_retry_after_ignored" in worker_families
        assert "webhooks_sources_ttl_raised" in receiver_families & worker_families

        # Flower's inspection at its start found the worker (its stats are listed), so it
        # logged no "Inspect method ... failed" (issue 20: four at every start, Flower having
        # been started before the worker could answer).
        def inspected() -> bool:
            listed = httpx.get(f"{flower}/api/workers", auth=("admin", FLOWER_PASSWORD))
            return any("stats" in info for info in listed.json().values())

        wait_for(inspected, timeout=30, what="Flower's inspection of the worker")
        assert "Inspect method" not in run.out.text

        # Not a terminal, WEBHOOKS_LOG_JSON unset: the children log JSON lines.
        run.out.wait_for('"event":"worker_metrics.serving"')

        pids = descendants(run.proc.pid)
        assert len(pids) >= 4  # receiver, worker (threads pool: no pool processes), beat, Flower
        run.proc.send_signal(signal.SIGTERM)
        assert run.proc.wait(60) == 0
        run.out.wait_closed()
        assert run.out.lines()[-1] == "pipeline stopped"
        wait_for(lambda: not [p for p in pids if alive(p)], timeout=30, what="every child to exit")
        # Issue 20: every run left its temporary directory behind.
        assert list(scratch.glob("webhooks-run-*")) == []


@pytest.mark.slow
def test_a_child_that_never_answers_stops_the_pipeline(tmp_path: Path) -> None:
    env, _ = _gate(tmp_path)  # the receiver is held for good
    with pipeline(env, tmp_path, "--no-flower", "--ready-timeout", "20") as run:
        wait_for(lambda: len(children(run.proc.pid)) == 3, timeout=60, what="three children")
        pids = descendants(run.proc.pid)
        assert run.proc.wait(90) == 1
        run.out.wait_closed()
        lines = run.out.lines()
        assert lines[-1] == "pipeline stopped"
        receiver = f"http://127.0.0.1:{run.port('PORT')}/healthz"
        admin = f"http://127.0.0.1:{run.port('ADMIN_PORT')}/metrics"
        # (and from the worker, on a machine so busy that it took longer than 20 s)
        assert lines[-2].startswith(
            f"error: no answer within 20s from receiver ({receiver}, {admin})"
        )
        assert lines[-2].endswith(", so the pipeline was stopped")
        assert "pipeline running" not in run.out.text
        wait_for(lambda: not [p for p in pids if alive(p)], timeout=30, what="every child to exit")


@pytest.mark.slow
def test_closing_the_terminal_stops_every_child_and_logs_are_human_readable(
    tmp_path: Path,
) -> None:
    env = run_env()
    master, slave = os.openpty()

    def controlling_terminal() -> None:  # the session's terminal, as in a shell
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    proc = subprocess.Popen(
        [str(BIN / "webhooks"), "run", "--no-flower"],
        env={**env, "TERM": "xterm"},
        cwd=tmp_path,
        stdin=slave,
        stdout=slave,
        stderr=slave,
        start_new_session=True,
        preexec_fn=controlling_terminal,  # noqa: PLW1509
    )
    os.close(slave)
    reading = threading.Event()
    reading.set()

    def read() -> bytes:
        while reading.is_set():
            if select.select([master], [], [], 0.1)[0]:
                return os.read(master, 65536)
        return b""

    out = Output(read)
    pids: list[int] = []
    try:
        out.wait_for("pipeline running")
        out.wait_for("worker_metrics.serving")
        text = out.text
        # On a terminal: children's lines prefixed with their name, logs as coloured text.
        assert '"event":"worker_metrics.serving"' not in text
        [line] = [ln for ln in text.splitlines() if "worker_metrics.serving" in ln]
        assert "worker" in line.split("|", 1)[0]
        assert "\x1b[" in line
        pids = descendants(proc.pid)
        assert len(pids) >= 3  # receiver, worker (threads pool: no pool processes), beat
        # The terminal closes: the kernel hangs up the session (SIGHUP to its leader).
        reading.clear()
        out.wait_closed()
        os.close(master)
        assert proc.wait(60) == 0
        wait_for(lambda: not [p for p in pids if alive(p)], timeout=30, what="every child to exit")
    finally:
        reading.clear()
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        log_file(f"runtime-tty-{proc.pid}").write_text(out.text)


@pytest.mark.slow
def test_a_child_that_dies_stops_the_pipeline_with_its_name_and_status(tmp_path: Path) -> None:
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = run_env(WEBHOOKS_LOG_JSON="true", TMPDIR=str(scratch))
    with pipeline(env, tmp_path, "--no-flower") as run:
        run.out.wait_for("pipeline running")
        # The migration at start is said (issue 36: it happened without a word).
        name = env["WEBHOOKS_DATABASE_URL"].rsplit("/", 1)[1]
        assert f"database {name} migrated to the latest schema" in run.out.text
        assert len(list(scratch.glob("webhooks-run-*"))) == 1
        pids = descendants(run.proc.pid)
        [beat] = [
            p for p in children(run.proc.pid) if b"beat" in Path(f"/proc/{p}/cmdline").read_bytes()
        ]
        os.kill(beat, signal.SIGKILL)
        assert run.proc.wait(60) == 1
        run.out.wait_closed()
        lines = run.out.lines()
        assert lines[-1] == "pipeline stopped"
        assert lines[-2] == "error: beat exited (killed by SIGKILL), so the pipeline was stopped"
        assert "Traceback" not in run.out.text
        wait_for(lambda: not [p for p in pids if alive(p)], timeout=30, what="every child to exit")
        assert list(scratch.glob("webhooks-run-*")) == []  # removed on a failure too


def test_logs_are_json_unless_on_a_terminal_or_as_set() -> None:
    master, slave = os.openpty()
    read_end, write_end = os.pipe()
    with (
        os.fdopen(slave, "w") as terminal,
        os.fdopen(write_end, "w") as pipe,
        os.fdopen(master),
        os.fdopen(read_end),
    ):
        assert wants_json(None, pipe) is True
        assert wants_json(None, terminal) is False
        assert wants_json(True, terminal) is True  # WEBHOOKS_LOG_JSON=true on a terminal
        assert wants_json(False, pipe) is False
    assert Settings.model_fields["log_json"].default is None


# Configuration from anywhere --------------------------------------------------------------


def _env_file(path: Path, **extra: str) -> Path:
    values = {k: v for k, v in BASE_ENV.items() if k != "WEBHOOKS_LOG_JSON"} | extra
    path.write_text("".join(f"{k}={v}\n" for k, v in values.items()))
    return path


def _bare_env(**extra: str) -> dict[str, str]:
    """No WEBHOOKS_* setting in the environment: they must come from a file."""
    return {k: v for k, v in test_env().items() if not k.startswith("WEBHOOKS_")} | extra


def test_settings_file_from_another_directory(tmp_path: Path) -> None:
    (tmp_path / "conf").mkdir()
    config = _env_file(tmp_path / "conf" / "pipeline.env")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    by_option = cli(
        "--env-file", str(config), "replays", "list", "--json", env=_bare_env(), cwd=elsewhere
    )
    assert by_option.returncode == 0, by_option.stderr
    assert isinstance(json.loads(by_option.stdout), list)
    relative = cli(
        "--env-file", "../conf/pipeline.env", "replays", "list", env=_bare_env(), cwd=elsewhere
    )
    assert relative.returncode == 0, relative.stderr
    by_variable = cli(
        "replays", "list", env=_bare_env(WEBHOOKS_ENV_FILE=str(config)), cwd=elsewhere
    )
    assert by_variable.returncode == 0, by_variable.stderr


def test_the_environment_wins_over_the_file_and_the_option_over_the_variable(
    tmp_path: Path,
) -> None:
    good = _env_file(tmp_path / "good.env")
    bad = _env_file(tmp_path / "bad.env", WEBHOOKS_SWEEP_INTERVAL="fortnightly")
    # --env-file beats WEBHOOKS_ENV_FILE.
    result = cli(
        "--env-file",
        str(good),
        "replays",
        "list",
        env=_bare_env(WEBHOOKS_ENV_FILE=str(bad)),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    # The environment beats the file.
    result = cli(
        "--env-file",
        str(bad),
        "replays",
        "list",
        env=_bare_env(WEBHOOKS_SWEEP_INTERVAL="15s"),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr


def test_a_missing_setting_says_where_the_cli_looked(tmp_path: Path) -> None:
    without_key = tmp_path / "partial.env"
    without_key.write_text("WEBHOOKS_PORT=8123\n")
    result = cli("replays", "list", env=_bare_env(WEBHOOKS_ENV_FILE=str(without_key)), cwd=tmp_path)
    assert result.returncode == 1
    [line] = result.stderr.splitlines()
    assert line == (
        "error: invalid settings: WEBHOOKS_SECRET_KEY: required, not set; settings read from "
        f"the environment and {without_key} (WEBHOOKS_ENV_FILE)"
        " (see docs/providers.md#settings-and-secrets)"
    )
    missing = cli("--env-file", "nowhere.env", "replays", "list", env=_bare_env(), cwd=tmp_path)
    assert missing.returncode == 1
    assert missing.stderr.strip() == (
        "error: --env-file nowhere.env: no such file (see docs/providers.md#settings-and-secrets)"
    )

    if (ROOT / ".env").exists():
        return  # after `make run` the project's .env is found: nothing else to list
    nothing = cli("replays", "list", env=_bare_env(), cwd=tmp_path)
    assert nothing.returncode == 1
    [line] = nothing.stderr.splitlines()
    assert line.startswith("error: invalid settings: WEBHOOKS_SECRET_KEY: required, not set")
    assert f"no {ROOT / '.env'} (project root), no {tmp_path / '.env'} (current directory)" in line
    assert line.endswith(
        "pass --env-file PATH or set WEBHOOKS_ENV_FILE (see docs/providers.md#settings-and-secrets)"
    )


def test_env_file_search_order(tmp_path: Path) -> None:
    root, cwd = tmp_path / "project", tmp_path / "cwd"
    root.mkdir()
    cwd.mkdir()
    assert find_env_file(None, {}, cwd, root) == ConfigSource(
        None, "", (f"{root / '.env'} (project root)", f"{cwd / '.env'} (current directory)")
    )
    (cwd / ".env").touch()
    assert find_env_file(None, {}, cwd, root).path == cwd / ".env"
    (root / ".env").touch()
    assert find_env_file(None, {}, cwd, root).path == root / ".env"
    (tmp_path / "x.env").touch()
    assert find_env_file(None, {"WEBHOOKS_ENV_FILE": "../x.env"}, cwd, root).path == (
        tmp_path / "x.env"
    )
    (tmp_path / "y.env").touch()
    chosen = find_env_file(tmp_path / "y.env", {"WEBHOOKS_ENV_FILE": "../x.env"}, cwd, root)
    assert (chosen.path, chosen.how) == (tmp_path / "y.env", "--env-file")


# Durations --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("2", 2), ("2.5", 2.5), ("2s", 2), ("1h30m", 5400), ("PT2S", 2), ("P3D", 259200),
     ("pt0.2s", 0.2), ("P1DT2H", 93600), ("3d", 259200), ("12h", 43200), ("10m", 600),
     ("250ms", 0.25), ("1w", 604800), (" 45 ", 45)],
)  # fmt: skip
def test_one_parser_for_cli_and_settings(
    text: str, seconds: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert parse_duration(text) == timedelta(seconds=seconds)
    monkeypatch.setenv("WEBHOOKS_SWEEP_INTERVAL", text)
    assert load_settings().sweep_interval == timedelta(seconds=seconds)


@pytest.mark.parametrize("text", ["", "2x", "1h30", "P1M", "PT", "-5s", "soon", "1 h"])
def test_a_bad_duration_names_the_variable(text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(DurationError):
        parse_duration(text)
    monkeypatch.setenv("WEBHOOKS_SWEEP_INTERVAL", text)
    with pytest.raises(SettingsError) as error:
        load_settings()
    assert f"WEBHOOKS_SWEEP_INTERVAL: not a duration: {text!r}" in str(error.value)


def test_every_duration_setting_takes_the_short_forms(monkeypatch: pytest.MonkeyPatch) -> None:
    names = [n for n, f in Settings.model_fields.items() if f.annotation is timedelta]
    assert {"sweep_interval", "max_age", "payload_retention"} <= set(names)
    # WEBHOOKS_HORIZON_REVIEW_AFTER is whole days (a bare 180 would be seconds): its own form.
    whole_days = {"horizon_review_after"}
    assert whole_days <= set(names)
    for name in names:
        monkeypatch.setenv(f"WEBHOOKS_{name.upper()}", "2d" if name in whole_days else "1h30m")
    settings = load_settings()
    assert {getattr(settings, n) for n in names if n not in whole_days} == {timedelta(minutes=90)}
    assert {getattr(settings, n) for n in whole_days} == {timedelta(days=2)}


def test_durations_in_the_environment_of_a_real_command(tmp_path: Path) -> None:
    for value in ("2", "2s", "1h30m", "PT2S"):
        ok = cli("replays", "list", env=test_env(WEBHOOKS_SWEEP_INTERVAL=value), cwd=tmp_path)
        assert ok.returncode == 0, (value, ok.stderr)
    bad = cli("replays", "list", env=test_env(WEBHOOKS_SWEEP_INTERVAL="2 weeks"), cwd=tmp_path)
    assert bad.returncode == 1
    [line] = bad.stderr.splitlines()
    assert line.startswith("error: invalid settings: WEBHOOKS_SWEEP_INTERVAL: not a duration")
    assert "Traceback" not in bad.stderr


# JSON, help -------------------------------------------------------------------------------


def test_json_times_are_iso_8601_with_z(capsys: pytest.CaptureFixture[str]) -> None:
    paris = timezone(timedelta(hours=1))
    print_json(
        {
            "utc": datetime(2026, 11, 30, 20, 14, 19, 519799, tzinfo=UTC),
            "offset": datetime(2026, 11, 30, 21, 14, 19, tzinfo=paris),
            "day": datetime(2026, 11, 30, tzinfo=UTC).date(),
        }
    )
    assert json.loads(capsys.readouterr().out) == {
        "utc": "2026-11-30T20:14:19.519799Z",
        "offset": "2026-11-30T20:14:19Z",
        "day": "2026-11-30",
    }


def test_cli_json_output_writes_z_times(tmp_path: Path) -> None:
    name = f"runtime-json-{os.getpid()}"
    result = cli(
        "sources", "add", name, "--provider", "standard", "--json", env=test_env(), cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    created = json.loads(result.stdout)["created_at"]
    assert created.endswith("Z"), created
    assert "T" in created, created
    assert datetime.fromisoformat(created.replace("Z", "+00:00")).tzinfo is not None


def _command_paths() -> list[list[str]]:
    root = typer.main.get_command(app)
    paths: list[list[str]] = [[]]

    def walk(command: object, prefix: list[str]) -> None:
        for name, sub in getattr(command, "commands", {}).items():
            paths.append([*prefix, name])
            walk(sub, [*prefix, name])

    walk(root, [])
    return paths


def test_help_has_no_placeholders() -> None:
    paths = _command_paths()
    assert ["run"] in paths
    assert ["events", "list"] in paths
    runner = CliRunner()
    for path in paths:
        result = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "200"})
        assert result.exit_code == 0, (path, result.output)
        for placeholder in ("<bool>", "{"):
            assert placeholder not in result.output, (path, placeholder, result.output)
    # A docstring's later paragraphs reflow to the width (no line break from the source).
    wide = runner.invoke(app, ["run", "--help"], env={"COLUMNS": "200"}).output
    assert "once every part answers, and stops every part on Ctrl-C" in wide
    # The installed script renders the same way.
    script = subprocess.run(
        [str(BIN / "webhooks"), "routes", "add", "--help"],
        env=test_env(COLUMNS="200"), capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert "Usage: webhooks routes add [OPTIONS] SOURCE" in script.stdout
    assert "<bool>" not in script.stdout


# What the CLI may not import before a command needs it: the command modules import SQLAlchemy,
# psycopg, settings, logging, HTTP and Celery inside the commands (webhooks.cli.common).
HEAVY = ("alembic", "celery", "httpx", "psycopg", "pydantic_settings", "sqlalchemy", "structlog")
_PROBE = """
import sys
import typer.main
from webhooks.cli import app
typer.main.get_command(app).main(sys.argv[2:], prog_name="webhooks", standalone_mode=False)
print(sorted({m.split(".")[0] for m in sys.modules} & set(sys.argv[1].split(","))), file=sys.stderr)
"""


@pytest.mark.parametrize("args", [["--help"], ["routes", "add", "--help"], ["replay", "--help"]])
def test_help_imports_neither_the_database_nor_the_settings(args: list[str]) -> None:
    """Every command's options and help are declared without the modules its work needs, so
    that `webhooks --help`, and each command before it does its work, starts fast."""
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, ",".join(HEAVY), *args],
        env=test_env(COLUMNS="200"), capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "Usage: webhooks" in proc.stdout
    assert proc.stderr.strip().splitlines()[-1] == "[]", proc.stderr
