"""Runs last: no log line of any process the suite started contains a secret or a body."""

from __future__ import annotations

from tests.leakcheck import LOG_DIR, SENSITIVE


def test_logs_contain_no_secret_and_no_request_body() -> None:
    logs = sorted(LOG_DIR.glob("*.log"))
    assert SENSITIVE, "the suite registered no secret or body to look for"
    assert logs, "the suite captured no process log"
    leaks = []
    for path in logs:
        data = path.read_bytes()
        leaks += [f"{path.name}: {value[:12]!r}..." for value in SENSITIVE if value in data]
    assert not leaks, leaks
