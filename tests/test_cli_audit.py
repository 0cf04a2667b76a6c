"""Issue 20 item 5: every configuration change is audited with its operator (the OS user for
the CLI, or ``--as``): sources add/update, secrets add/revoke, routes add."""

from __future__ import annotations

import getpass
import json
import subprocess
import uuid
from typing import Any

from sqlalchemy import Engine

from tests.conftest import BIN, test_env
from tests.leakcheck import remember


def webhooks(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "webhooks"), *args], env=test_env(), capture_output=True, text=True, timeout=60
    )


def _rows(source: str) -> list[dict[str, Any]]:
    listed = webhooks("audit", "list", "--limit", "200", "--json")
    assert listed.returncode == 0, listed.stderr
    return [r for r in json.loads(listed.stdout) if r["target"].get("source") == source][::-1]


def test_every_configuration_change_writes_an_audit_row_with_its_operator(engine: Engine) -> None:
    me = getpass.getuser()
    added = webhooks(
        "sources", "add", f"aud-{uuid.uuid4().hex[:8]}", "--provider", "standard", "--json"
    )
    assert added.returncode == 0, added.stderr
    view = json.loads(added.stdout)
    remember(view["secret"])
    source = view["id"]
    steps = [
        ("routes", "add", source, "--handler", "log", "--events", "order.*"),
        ("routes", "add", source, "--handler", "noop", "--as", "dora"),
        ("secrets", "add", source, "--as", "dora"),
        ("sources", "update", source, "--tolerance", "10m"),
        ("secrets", "revoke", source, view["secret_id"]),
    ]
    for args in steps:
        result = webhooks(*args)
        assert result.returncode == 0, (args, result.stderr)
        remember(*[w for w in result.stdout.split() if w.startswith("whsec_")])
    rows = _rows(source)
    assert [(r["action"], r["operator"], r["via"]) for r in rows] == [
        ("source.add", me, "cli"),
        ("route.add", me, "cli"),
        ("route.add", "dora", "cli"),
        ("secret.add", "dora", "cli"),
        ("source.update", me, "cli"),
        ("secret.revoke", me, "cli"),
    ]
    assert rows[0]["target"]["secret"] == view["secret_id"]
    assert rows[1]["target"]["events"] == "order.*"
    assert rows[4]["target"]["changed"] == {"tolerance": "10m"}
    for r in rows:  # never a secret in the audit trail
        assert view["secret"] not in json.dumps(r)


def test_a_refused_change_writes_no_audit_row() -> None:
    added = webhooks("sources", "add", f"aud-{uuid.uuid4().hex[:8]}", "--provider", "github")
    assert added.returncode == 0, added.stderr
    source = next(line.split()[-1] for line in added.stdout.splitlines() if "source id" in line)
    before = _rows(source)
    refused = webhooks("routes", "add", source, "--handler", "forward", "--option", "url=ftp://x")
    assert refused.returncode == 1
    empty = webhooks("sources", "update", source)
    assert empty.returncode == 1
    assert "nothing to change" in empty.stderr
    assert _rows(source) == before
