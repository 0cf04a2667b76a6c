"""Everything sensitive the suite sends, and where the pipeline's processes log.

Tests register secrets and request bodies with :func:`remember`; every subprocess the suite
starts logs into :data:`LOG_DIR`. ``tests/test_zz_no_leaks.py`` runs last and fails if any
log line contains any remembered value.

A run in several processes (``pytest -n 2 -m 'not serial'``, then ``pytest -m serial``)
gives every part one ``WEBHOOKS_TEST_LOG_DIR``, and each process also writes what it
remembers there (``sensitive-<pid>.hex``), so the last check reads every process's logs and
every process's secrets. Without that variable a run keeps both to itself.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

_SHARED = os.environ.get("WEBHOOKS_TEST_LOG_DIR")
LOG_DIR = Path(_SHARED) if _SHARED else Path(tempfile.mkdtemp(prefix="webhooks-test-logs-"))
LOG_DIR.mkdir(parents=True, exist_ok=True)
SENSITIVE: set[bytes] = set()
_MINE = LOG_DIR / f"sensitive-{os.getpid()}.hex"


def remember(*values: str | bytes) -> None:
    for value in values:
        raw = value.encode() if isinstance(value, str) else value
        if len(raw) >= 8 and raw not in SENSITIVE:
            SENSITIVE.add(raw)
            with _MINE.open("a") as out:
                out.write(raw.hex() + "\n")


def everything_remembered() -> set[bytes]:
    """What this process and every other process of the run remembered."""
    found = set(SENSITIVE)
    for path in LOG_DIR.glob("sensitive-*.hex"):
        found |= {bytes.fromhex(line) for line in path.read_text().split()}
    return found


def log_file(name: str) -> Path:
    """A log file of this process's own: processes sharing the directory count their logs
    from 0 alike (``receiver-0``), and one file for two would mix their lines."""
    return LOG_DIR / f"{name}.p{os.getpid()}.log"
