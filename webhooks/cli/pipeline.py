"""``webhooks serve`` (the receiver alone) and ``webhooks run`` (the whole pipeline).

``webhooks run`` (what ``make run`` runs) manages its children like a small service manager:

- it checks that every port it will use is free before it starts anything;
- each child runs in a session of its own, so a terminal's signals reach ``webhooks run``
  alone: Ctrl-C, SIGTERM and SIGHUP (the terminal closed) all stop every child the same way,
  and a child also gets SIGTERM if ``webhooks run`` itself dies (Linux' parent-death signal);
- it says ``pipeline running`` only once every child answers: the receiver's ``/healthz``
  and its admin address's ``/metrics``, Flower's ``/healthcheck``, and the worker's metrics
  server, which the worker starts from Celery's ``worker_ready`` signal
  (:mod:`tasks.observability`);
- a child that exits stops the pipeline, with one line naming it and its exit status;
  ``pipeline stopped`` is always the last line.

On a terminal the children's output comes through ``webhooks run``, each line prefixed with the
child's name, and their logs are human-readable; elsewhere the children write straight to the
same stdout and stderr, and their logs are JSON lines (``WEBHOOKS_LOG_JSON`` overrides both).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Annotated

import typer

from webhooks.cli.common import CliError, Env, cli_command, console, env, handle_errors, say_error

if TYPE_CHECKING:
    from core.settings import Settings
    from ingest.admin import AdminServer


@handle_errors
def serve(
    host: Annotated[str | None, typer.Option(help="Bind address (default WEBHOOKS_HOST).")] = None,
    port: Annotated[int | None, typer.Option(help="Port (default WEBHOOKS_PORT).")] = None,
    workers: Annotated[int | None, typer.Option(help="Receiver processes.")] = None,
) -> None:
    """Run the receiver (ASGI, uvicorn), and the admin API and /metrics on WEBHOOKS_ADMIN_PORT."""
    import uvicorn

    from ingest.server import ReceiverProtocol

    e = env()
    _check_database_if_reachable(e)
    settings = e.settings
    several = (workers or settings.receiver_workers) > 1
    scratch = None  # a metrics directory of our own, removed at the end
    if settings.metrics_dir:
        # Several receiver processes: prometheus-client's multiprocess mode, in a directory of
        # the receiver's own (workers keep theirs), emptied so old counts do not linger.
        directory = Path(settings.metrics_dir) / "receiver"
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(directory)
    elif several:  # one /metrics for every process: the admin server adds up their files
        scratch = directory = Path(tempfile.mkdtemp(prefix="webhooks-receiver-metrics-"))
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(directory)
    admin = _admin_server(settings, port or settings.port, str(directory) if several else None)
    admin.start()
    # SIGTERM as Ctrl-C: uvicorn stops gracefully, then re-raises it here (a KeyboardInterrupt,
    # which uvicorn.run swallows) instead of the process dying before the admin server stops.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    uvicorn.run(
        "ingest.app:app_from_env",
        factory=True,
        host=host or settings.host,
        port=port or settings.port,
        workers=workers or settings.receiver_workers,
        log_level="warning",
        access_log=False,
        loop="uvloop",
        http=ReceiverProtocol,  # httptools with head limits, read timeouts, connection cap
        timeout_keep_alive=settings.keep_alive_timeout,
        lifespan="on",
    )
    admin.stop()
    if scratch is not None:
        shutil.rmtree(scratch, ignore_errors=True)


def _check_database_if_reachable(e: Env) -> None:
    """Refuse to start (one line) on a database a migration behind this code (the accept
    statement would fail every request: migration 0018 changed what it returns), when
    WEBHOOKS_SECRET_KEY cannot decrypt the stored secrets (every signed request would fail),
    or when WEBHOOKS_DATABASE_URL names a database that does not exist or credentials it
    refuses (every request would wait for a connection, then get 503, for as long as it
    runs). A database that cannot be reached now does not stop the receiver (one warning
    naming why; it answers 503 until Postgres is back; each request still gets 503, never
    500, if the key is wrong)."""
    from sqlalchemy.exc import DBAPIError

    from models.db import UPGRADE_HINT, describe_db_error, migrations_behind, misconfigured, where

    try:
        behind = migrations_behind(e.settings, e.engine)
        if behind is not None:
            current, head = behind
            raise CliError(
                f"Postgres at {where(e.settings.database_url)} is at migration"
                f" {current or 'none'}, this code needs {head}: {UPGRADE_HINT}"
            )
        e.check_keys()
    except DBAPIError as exc:
        reason = describe_db_error(exc, e.settings.database_url)
        if misconfigured(exc) and reason is not None:
            raise CliError(reason) from None
        from core.logs import get_logger

        get_logger("serve").warning(
            "startup.checks_skipped", error_class=type(exc.orig).__name__, reason=reason
        )


def _admin_server(
    settings: Settings, public_port: int, multiprocess_dir: str | None
) -> AdminServer:
    """The admin plane (admin API and /metrics) on WEBHOOKS_ADMIN_HOST:WEBHOOKS_ADMIN_PORT,
    bound now: a taken port stops ``webhooks serve`` before the receiver starts."""
    from ingest.admin import AdminServer

    host, number = settings.admin_host, settings.admin_port
    if number == public_port:
        raise CliError(
            f"the receiver and the admin API would both listen on port {number}: "
            "set WEBHOOKS_ADMIN_PORT to another port"
        )
    try:
        return AdminServer(settings, host=host, port=number, multiprocess_dir=multiprocess_dir)
    except OSError as exc:
        address = Port("admin API", "WEBHOOKS_ADMIN_PORT", host, number).address
        raise CliError(
            f"cannot listen on {address} for the admin API and metrics (WEBHOOKS_ADMIN_PORT): "
            f"{exc.strerror or exc}"
        ) from None


def _bin(name: str) -> str:
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


# Ports ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Port:
    child: str
    variable: str
    host: str
    number: int

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.number}" if ":" in self.host else f"{self.host}:{self.number}"


def redis_problem(settings: Settings) -> str | None:
    """Why the pipeline cannot reach its broker or its Redis (one line naming the variable
    and where, never a password), or None. Checked before anything starts: without them the
    children came up one by one into 60 s of retries, and the only line said the worker's
    /metrics did not answer."""
    from urllib.parse import urlsplit

    from kombu import Connection

    def where(url: str) -> str:
        try:
            parts = urlsplit(url)
            return f"{parts.hostname or 'localhost'}:{parts.port or ''}{parts.path}"
        except ValueError:  # a URL it cannot parse is named by its variable alone
            return "the URL"

    checks = [
        ("WEBHOOKS_BROKER_URL", settings.broker_url),
        ("WEBHOOKS_REDIS_URL", settings.redis_url),
    ]
    for variable, url in dict.fromkeys(checks):
        try:
            with Connection(url, connect_timeout=2) as connection:
                connection.ensure_connection(max_retries=1, interval_start=0, timeout=2)
        except Exception as exc:  # noqa: BLE001 (kombu wraps the transport's errors variously)
            reason = (
                str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
            )
            return f"cannot reach {where(url)} ({variable}): {reason}"
    return None


def port_problem(ports: list[Port]) -> str | None:
    """Why the pipeline cannot have these ports (one line), or None when all are free."""
    seen: dict[int, Port] = {}
    for port in ports:
        if port.number in seen:
            other = seen[port.number]
            return (
                f"{other.variable} and {port.variable} are both {port.number}: "
                f"the {other.child} and the {port.child} need a port each"
            )
        seen[port.number] = port
    for port in ports:
        error = _bind_error(port.host, port.number)
        if error is not None:
            holder = _listener(port.number)
            held = f" (listening: {holder})" if holder else ""
            return (
                f"port {port.number} for the {port.child} ({port.variable}) is taken: "
                f"cannot listen on {port.address}{held}: {error}; stop what holds it "
                f"or set {port.variable}; nothing was started"
            )
    return None


def _bind_error(host: str, number: int) -> str | None:
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, number, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as exc:
        return f"cannot resolve {host}: {exc.strerror}"
    with socket.socket(family, kind, proto) as sock:
        # As the children will bind: SO_REUSEADDR, so a closed socket's TIME_WAIT is no conflict.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def _listener(number: int) -> str | None:
    """The address a listening TCP socket on ``number`` is bound to (Linux' /proc/net)."""
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state = fields[1], fields[3]
            ip_hex, port_hex = local.split(":")
            if state == "0A" and int(port_hex, 16) == number:  # 0A: LISTEN
                raw = bytes.fromhex(ip_hex)
                # /proc writes each 32-bit word in host order (little-endian here).
                ip = b"".join(raw[i : i + 4][::-1] for i in range(0, width, 4))
                family = socket.AF_INET if width == 4 else socket.AF_INET6
                text = socket.inet_ntop(family, ip)
                return f"[{text}]:{number}" if width == 16 else f"{text}:{number}"
    return None


def _probe_host(host: str) -> str:
    """Where to reach a server bound to ``host`` from this machine."""
    if host in ("", "0.0.0.0"):  # noqa: S104  (not a bind: the wildcard's loopback)
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


# Children ---------------------------------------------------------------------------------

_COLOURS = {"receiver": "36", "worker": "35", "beat": "34", "flower": "33"}
_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> Callable[[], None] | None:
    """A pre-exec hook giving the child SIGTERM when ``webhooks run`` dies (Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)

    def hook() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before the hook ran
            os._exit(1)

    return hook


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    urls: tuple[str, ...]  # all answer once the child is ready; none: alive is ready (beat)

    def status(self) -> str:
        code = self.proc.returncode
        if code is not None and code < 0:
            with contextlib.suppress(ValueError):
                return f"killed by {signal.Signals(-code).name}"
        return f"exit status {code}"


class Output:
    """Where ``webhooks run`` and, on a terminal, its children write. Writes never fail: after
    the terminal closed (SIGHUP) there is nobody to read them, and stopping must go on."""

    def __init__(self, *, relay: bool) -> None:
        from core.logs import wants_colour

        self.relay = relay
        self.colour = relay and wants_colour(sys.stderr)
        self._lock = threading.Lock()

    def say(self, text: str, style: str | None = None) -> None:
        with contextlib.suppress(OSError), self._lock:
            console.print(text, style=style, highlight=False, markup=False, soft_wrap=True)

    def error(self, text: str) -> None:
        with contextlib.suppress(OSError), self._lock:
            say_error(text)

    def pump(self, name: str, stream: IO[bytes]) -> None:
        """Copy a child's output, line by line, prefixed with its name; drain it to the end."""
        prefix = f"{name:>8} | ".encode()
        if self.colour:
            prefix = f"\x1b[{_COLOURS.get(name, '2')}m{name:>8}\x1b[0m\x1b[2m |\x1b[0m ".encode()
        writable = True
        for line in iter(stream.readline, b""):
            if not writable:
                continue  # keep reading: a child blocked on a full pipe would never stop
            try:
                with self._lock:
                    sys.stderr.buffer.write(prefix + line)
                    sys.stderr.buffer.flush()
            except OSError:
                writable = False
        stream.close()


class Stop:
    """Set by SIGINT, SIGTERM or SIGHUP; the main loop waits on it."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signal: str | None = None

    def __call__(self, signum: int, _frame: object) -> None:
        self.signal = self.signal or signal.Signals(signum).name
        self.event.set()

    def install(self) -> None:
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, self)


# The command ------------------------------------------------------------------------------


@handle_errors
def run(
    workers: Annotated[
        int | None,
        typer.Option(
            help="Worker concurrency: threads, greenlets or processes of WEBHOOKS_WORKER_POOL "
            "(default WEBHOOKS_WORKER_CONCURRENCY, else 50 threads).",
            min=1,
        ),
    ] = None,
    no_flower: Annotated[bool, typer.Option("--no-flower", help="Do not start Flower.")] = False,
    ready_timeout: Annotated[
        float,
        typer.Option(help="Seconds to wait for every part to answer before giving up."),
    ] = 60.0,
) -> None:
    """Migrate, then run receiver, worker, beat and Flower in the foreground.

    Checks its ports first, says "pipeline running" once every part answers, and stops every
    part on Ctrl-C, SIGTERM or SIGHUP (the terminal closed), or when one of them exits.
    """
    stop = Stop()
    stop.install()
    e = env()
    settings = e.settings
    worker_metrics_port = settings.worker_metrics_port or 9100
    ports = [
        Port("receiver", "WEBHOOKS_PORT", settings.host, settings.port),
        Port("admin API", "WEBHOOKS_ADMIN_PORT", settings.admin_host, settings.admin_port),
        Port(
            "worker metrics",
            "WEBHOOKS_WORKER_METRICS_PORT",
            settings.admin_host,
            worker_metrics_port,
        ),
    ]
    if not no_flower:
        if settings.flower_password is None:
            raise CliError(
                "set WEBHOOKS_FLOWER_PASSWORD (Flower runs with basic auth), or pass --no-flower"
            )
        ports.append(Port("Flower", "WEBHOOKS_FLOWER_PORT", "127.0.0.1", settings.flower_port))
    problem = port_problem(ports) or redis_problem(settings)
    if problem is not None:
        raise CliError(problem)

    from models.db import ensure_database, upgrade

    out = Output(relay=sys.stderr.isatty())
    created = ensure_database(settings)
    upgrade(settings)
    verb = "created and migrated" if created else "migrated"
    out.say(f"database {settings.database_name()} {verb} to the latest schema")
    e.check_keys()
    if stop.event.is_set():
        out.say("pipeline stopped")
        return
    # Beat's schedule and the metrics files, removed when the pipeline stops.
    state = Path(tempfile.mkdtemp(prefix="webhooks-run-"))
    children, failure = _start(
        e, out, stop, state, workers, worker_metrics_port, no_flower, ready_timeout
    )
    try:
        if failure is None:
            auth = None
            if settings.flower_password is not None:
                auth = (settings.flower_user, settings.flower_password.get_secret_value())
            failure = _wait_ready(children, out, stop, ready_timeout, auth)
        if failure is None and not stop.event.is_set():
            _banner(e, out, worker_metrics_port, no_flower)
            failure = _supervise(children, stop)
    finally:
        _stop_all(children, stop)
        shutil.rmtree(state, ignore_errors=True)
        # After the children's own shutdown lines: the reason sits just above the last line.
        if failure is not None:
            out.error(failure)
        out.say("pipeline stopped")
    if failure is not None:
        raise typer.Exit(1)


def _start(
    e: Env,
    out: Output,
    stop: Stop,
    state: Path,
    workers: int | None,
    metrics_port: int,
    no_flower: bool,
    ready_timeout: float,
) -> tuple[list[Child], str | None]:
    settings = e.settings
    metrics_dir = settings.metrics_dir or str(state / "metrics")
    Path(metrics_dir).mkdir(parents=True, exist_ok=True)
    child_env = {
        **os.environ,
        "WEBHOOKS_METRICS_DIR": metrics_dir,
        "WEBHOOKS_WORKER_METRICS_PORT": str(metrics_port),
        "PYTHONUNBUFFERED": "1",  # lines through the pipe as they are written
    }
    if out.relay:
        from core.logs import wants_json

        # The children's stderr is a pipe to us: decide for them as for a terminal.
        child_env["WEBHOOKS_LOG_JSON"] = "true" if wants_json(settings.log_json) else "false"
        if out.colour:
            child_env.setdefault("FORCE_COLOR", "1")
    host = _probe_host(settings.host)
    celery = [_bin("celery"), "-A", "tasks"]
    # The receiver is ready when its public port and its admin address both answer.
    receiver_urls = (
        f"http://{host}:{settings.port}/healthz",
        f"http://{_probe_host(settings.admin_host)}:{settings.admin_port}/metrics",
    )
    specs: list[tuple[str, list[str], tuple[str, ...]]] = [
        ("receiver", [_bin("webhooks"), "serve"], receiver_urls),
        (
            "worker",
            [
                # -P on the command line: gevent must patch before anything is imported.
                *celery, "worker", "-Q", "deliveries,maintenance",
                "-P", settings.worker_pool, "-c", str(workers or settings.worker_slots),
                "-n", "worker@%h", "--loglevel", "WARNING",
            ],
            (f"http://{_probe_host(settings.admin_host)}:{metrics_port}/metrics",),
        ),
        (
            "beat",
            [*celery, "beat", "-s", str(state / "beat-schedule"), "--loglevel", "WARNING"],
            (),
        ),
    ]  # fmt: skip
    # Per child: what its environment adds (Flower's login goes there, never on its command
    # line, where `ps` shows it to every user of the host).
    extra: dict[str, dict[str, str]] = {}
    if not no_flower:
        password = settings.flower_password.get_secret_value() if settings.flower_password else ""
        extra["flower"] = {"FLOWER_BASIC_AUTH": f"{settings.flower_user}:{password}"}
        specs.append(
            (
                "flower",
                [
                    *celery, "flower", f"--port={settings.flower_port}", "--address=127.0.0.1",
                    "--persistent=False",
                ],
                (f"http://127.0.0.1:{settings.flower_port}/healthcheck",),
            )
        )  # fmt: skip
    hook = _die_with_parent(os.getpid())
    children: list[Child] = []
    for name, cmd, urls in specs:
        if name == "flower":
            # Flower asks the workers for their stats as it starts, and logs four "Inspect
            # method ... failed" warnings when none answers yet: start it once ours does.
            worker_urls = next(u for n, _, u in specs if n == "worker")
            _await_urls(children, stop, worker_urls, ready_timeout)
        if stop.event.is_set():
            break
        try:
            proc = subprocess.Popen(  # noqa: S603
                cmd,
                env={**child_env, **extra.get(name, {})},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE if out.relay else None,
                stderr=subprocess.STDOUT if out.relay else None,
                start_new_session=True,
                # No other thread runs yet (the pumps start below): safe before exec.
                preexec_fn=hook,  # noqa: PLW1509
            )
        except OSError as exc:
            return children, f"{name} could not start: {cmd[0]}: {exc.strerror}"
        children.append(Child(name, proc, urls))
    for child in children:
        if child.proc.stdout is not None:
            threading.Thread(
                target=out.pump, args=(child.name, child.proc.stdout), daemon=True
            ).start()
    return children, None


def _await_urls(children: list[Child], stop: Stop, urls: tuple[str, ...], timeout: float) -> None:
    """Until every URL answers 200, a child exits, a signal comes or ``timeout`` passes
    (whichever first; :func:`_wait_ready` then reports what did not answer)."""
    import httpx

    deadline = time.monotonic() + timeout
    left = list(urls)
    with httpx.Client(timeout=2) as client:
        while left and time.monotonic() < deadline and _exited(children) is None:
            for url in list(left):
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(url).status_code == 200:
                        left.remove(url)
            if left and stop.event.wait(0.1):
                return


def _exited(children: list[Child]) -> str | None:
    for child in children:
        if child.proc.poll() is not None:
            return f"{child.name} exited ({child.status()}), so the pipeline was stopped"
    return None


def _wait_ready(
    children: list[Child],
    out: Output,
    stop: Stop,
    timeout: float,
    flower_auth: tuple[str, str] | None,
) -> str | None:
    import httpx

    pending = {c.name: list(c.urls) for c in children if c.urls}
    started = time.monotonic()
    with httpx.Client(timeout=2) as client:
        while pending and not stop.event.is_set():
            if (gone := _exited(children)) is not None:
                return gone
            for name, urls in list(pending.items()):
                auth = flower_auth if name == "flower" else None
                for url in list(urls):
                    with contextlib.suppress(httpx.HTTPError):
                        if client.get(url, auth=auth).status_code == 200:
                            urls.remove(url)
                if not urls:
                    del pending[name]
                    out.say(f"{name} ready ({time.monotonic() - started:.1f}s)", "dim")
            if pending and time.monotonic() - started > timeout:
                waiting = ", ".join(f"{name} ({', '.join(urls)})" for name, urls in pending.items())
                return f"no answer within {timeout:g}s from {waiting}, so the pipeline was stopped"
            stop.event.wait(0.1)
    return _exited(children)


def _supervise(children: list[Child], stop: Stop) -> str | None:
    """Until a signal or a child's exit."""
    while not stop.event.wait(0.2):
        if (gone := _exited(children)) is not None:
            return gone
    return None


def _stop_all(children: list[Child], stop: Stop, grace: float = 15.0) -> None:
    """SIGTERM to every child's process group; SIGKILL what is left after ``grace`` seconds,
    or at once on a second signal."""
    stop.event.clear()
    for child in children:
        if child.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for child in children:
        while child.proc.poll() is None and time.monotonic() < deadline:
            if stop.event.wait(0.05):  # asked again: do not wait
                break
        if child.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.proc.pid, signal.SIGKILL)
        child.proc.wait()
        # A child's own children (Celery's pool) left behind by a killed parent.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.proc.pid, signal.SIGKILL)


def _banner(e: Env, out: Output, metrics_port: int, no_flower: bool) -> None:
    settings = e.settings
    host = _probe_host(settings.host)
    receiver = f"http://{host}:{settings.port}"
    admin = f"http://{_probe_host(settings.admin_host)}:{settings.admin_port}"
    lines = [f"  receiver  {receiver}/webhooks/<source_id>  (health /healthz, /readyz)"]
    given = {
        "WEBHOOKS_ADMIN_TOKENS": settings.admin_tokens,
        "WEBHOOKS_ADMIN_TOKEN": settings.admin_token,
    }
    tokens = [name for name, value in given.items() if value and value.get_secret_value()]
    if tokens:
        where = "; ".join(_where(e, variable) for variable in tokens)
        lines.append(f"  admin API {admin}/admin  tokens: {where}")
        lines.append(f"  console   {admin}/console/  (log in with an admin token)")
    else:
        lines.append("  admin API off (set WEBHOOKS_ADMIN_TOKENS to enable it)")
    lines.append(f"  metrics   {admin}/metrics (receiver, no token)")
    if not no_flower:
        lines.append(
            f"  Flower    http://127.0.0.1:{settings.flower_port}  user {settings.flower_user}, "
            f"password: {_where(e, 'WEBHOOKS_FLOWER_PASSWORD')}"
        )
    lines.append(
        f"  metrics   http://{_probe_host(settings.admin_host)}:{metrics_port}/metrics (workers)"
    )
    settings_from = str(e.config.path) if e.config.path else "the environment"
    lines.append(
        f"  CLI       {cli_command()} demo  (from any directory; settings: {settings_from})"
    )
    out.say("pipeline running", "bold green")
    for line in lines:
        out.say(line)
    out.say("Ctrl-C (or SIGTERM, or closing the terminal) stops it", "dim")


def _where(e: Env, variable: str) -> str:
    """Where a secret is set, never its value."""
    if variable in e.from_file and e.config.path is not None:
        return f"{variable} in {e.config.path}"
    return f"{variable} in the environment"


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
    app.command("run")(run)
