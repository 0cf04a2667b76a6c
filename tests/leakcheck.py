"""Everything sensitive the suite sends, and where the pipeline's processes log.

Tests register secrets and request bodies with :func:`remember`; every subprocess the suite
starts logs into :data:`LOG_DIR`. ``tests/test_zz_no_leaks.py`` runs last and fails if any
log line contains any remembered value.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

LOG_DIR = Path(tempfile.mkdtemp(prefix="webhooks-test-logs-"))
SENSITIVE: set[bytes] = set()


def remember(*values: str | bytes) -> None:
    for value in values:
        raw = value.encode() if isinstance(value, str) else value
        if len(raw) >= 8:
            SENSITIVE.add(raw)


def log_file(name: str) -> Path:
    return LOG_DIR / f"{name}.log"
