"""``webhooks serve`` (the receiver alone) and ``webhooks run`` (the whole pipeline)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated

import typer

from webhooks.cli.common import CliError, console, env, handle_errors


@handle_errors
def serve(
    host: Annotated[str | None, typer.Option(help="Bind address (default WEBHOOKS_HOST).")] = None,
    port: Annotated[int | None, typer.Option(help="Port (default WEBHOOKS_PORT).")] = None,
    workers: Annotated[int | None, typer.Option(help="Receiver processes.")] = None,
) -> None:
    """Run the receiver (ASGI, uvicorn)."""
    import uvicorn  # noqa: PLC0415

    settings = env().settings
    if settings.metrics_dir:
        # Several receiver processes: prometheus-client's multiprocess mode, in a directory of
        # the receiver's own (workers keep theirs), emptied so old counts do not linger.
        directory = Path(settings.metrics_dir) / "receiver"
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(directory)
    uvicorn.run(
        "ingest.app:app_from_env",
        factory=True,
        host=host or settings.host,
        port=port or settings.port,
        workers=workers or settings.receiver_workers,
        log_level="warning",
        access_log=False,
        loop="uvloop",
        http="httptools",
        lifespan="on",
    )


def _bin(name: str) -> str:
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


@handle_errors
def run(
    workers: Annotated[int, typer.Option(help="Worker processes (Celery concurrency).")] = 2,
    no_flower: Annotated[bool, typer.Option("--no-flower", help="Do not start Flower.")] = False,
) -> None:
    """Migrate, then run receiver, worker, beat and Flower in the foreground; Ctrl-C stops all."""
    from models.db import upgrade  # noqa: PLC0415

    settings = env().settings
    upgrade(settings)
    state = Path(tempfile.mkdtemp(prefix="webhooks-run-"))
    metrics_dir = settings.metrics_dir or str(state / "metrics")
    Path(metrics_dir).mkdir(parents=True, exist_ok=True)
    child_env = {**os.environ, "WEBHOOKS_METRICS_DIR": metrics_dir}
    worker_metrics_port = settings.worker_metrics_port or 9100
    child_env.setdefault("WEBHOOKS_WORKER_METRICS_PORT", str(worker_metrics_port))
    commands: dict[str, list[str]] = {
        "receiver": [_bin("webhooks"), "serve"],
        "worker": [
            _bin("celery"),
            "-A",
            "tasks",
            "worker",
            "-Q",
            "deliveries,maintenance",
            "-c",
            str(workers),
            "-n",
            "worker@%h",
            "--loglevel",
            "WARNING",
        ],
        "beat": [
            _bin("celery"),
            "-A",
            "tasks",
            "beat",
            "-s",
            str(state / "beat-schedule"),
            "--loglevel",
            "WARNING",
        ],
    }
    if not no_flower:
        if settings.flower_password is None:
            raise CliError(
                "set WEBHOOKS_FLOWER_PASSWORD (Flower runs with basic auth), or pass --no-flower"
            )
        auth = f"{settings.flower_user}:{settings.flower_password.get_secret_value()}"
        commands["flower"] = [
            _bin("celery"),
            "-A",
            "tasks",
            "flower",
            f"--port={settings.flower_port}",
            "--address=127.0.0.1",
            f"--basic-auth={auth}",
            "--persistent=False",
        ]
    procs: dict[str, subprocess.Popen[bytes]] = {}
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    try:
        for name, cmd in commands.items():
            procs[name] = subprocess.Popen(cmd, env=child_env, start_new_session=True)  # noqa: S603
        console.print(f"receiver  http://{settings.host}:{settings.port}/webhooks/<source_id>")
        if "flower" in procs:
            console.print(
                f"flower    http://127.0.0.1:{settings.flower_port}  (user {settings.flower_user})"
            )
        console.print(
            f"metrics   http://{settings.host}:{settings.port}/metrics (receiver), "
            f"http://127.0.0.1:{worker_metrics_port}/metrics (workers)"
        )
        console.print("pipeline running; Ctrl-C stops it")
        while not stopping:
            for name, proc in procs.items():
                if proc.poll() is not None:
                    raise CliError(
                        f"{name} exited with status {proc.returncode}; stopping the pipeline"
                    )
            time.sleep(0.5)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for proc in procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        console.print("pipeline stopped")


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
    app.command("run")(run)
