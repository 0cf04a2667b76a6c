"""Runs last: no log line of any process the suite started contains a secret or a body.

In a run of several processes (``pytest -n 2 -m 'not serial'``, then ``-m serial``) it runs
last and reads the logs and the remembered values of every process (:mod:`tests.leakcheck`).
"""

from __future__ import annotations

import pytest

from tests.leakcheck import LOG_DIR, everything_remembered

pytestmark = pytest.mark.serial


def test_logs_contain_no_secret_and_no_request_body() -> None:
    sensitive = everything_remembered()
    logs = sorted(LOG_DIR.glob("*.log"))
    assert sensitive, "the suite registered no secret or body to look for"
    assert logs, "the suite captured no process log"
    leaks = []
    for path in logs:
        data = path.read_bytes()
        leaks += [f"{path.name}: {value[:12]!r}..." for value in sensitive if value in data]
    assert not leaks, leaks
