"""Real pipeline processes for tests: receivers (``webhooks serve``) with their logs kept."""

from __future__ import annotations

import itertools
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import BIN, free_port, test_env, wait_for_port
from tests.leakcheck import log_file

_counter = itertools.count()


@dataclass
class Receiver:
    url: str  # the public port: /webhooks/..., /healthz, /readyz
    port: int
    proc: subprocess.Popen[bytes]
    log_path: Path
    admin_port: int

    @property
    def admin_url(self) -> str:
        """The admin address: /metrics, and the admin API under /admin."""
        return f"http://127.0.0.1:{self.admin_port}"


def spawn(
    name: str, cmd: list[str], env: dict[str, str], path: Path | None = None
) -> subprocess.Popen[bytes]:
    """Start a process whose stdout and stderr go to the suite's log directory."""
    out = (path or log_file(f"{name}-{next(_counter)}")).open("ab")
    return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)


def stop(proc: subprocess.Popen[bytes], timeout: float = 10) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def receiver(*, workers: int = 1, **env_overrides: str) -> Iterator[Receiver]:
    port = free_port()
    admin_port = int(env_overrides.pop("WEBHOOKS_ADMIN_PORT", free_port()))
    path = log_file(f"receiver-{next(_counter)}")
    proc = spawn(
        "receiver",
        [str(BIN / "webhooks"), "serve", "--port", str(port), "--workers", str(workers)],
        test_env(WEBHOOKS_ADMIN_PORT=str(admin_port), **env_overrides),
        path,
    )
    try:
        wait_for_port(port, proc)
        wait_for_port(admin_port, proc)
        yield Receiver(f"http://127.0.0.1:{port}", port, proc, path, admin_port)
    finally:
        stop(proc)
