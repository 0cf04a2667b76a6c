"""A provider added through the entry-point group ``webhooks.providers`` by a separate package
(tests/plugin_provider), end to end, without touching this repository's code: pip builds and
installs it into a directory of its own (put on the subprocesses' PYTHONPATH, so the shared venv
and the other tests never see it); ``webhooks providers list`` shows it, ``webhooks sources add
--provider acme`` accepts it, and a real ``webhooks serve`` writes the receipt of a delivery it
signs. A broken plug-in stops the CLI with one line naming it."""

from __future__ import annotations

import hashlib
import hmac
import json
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import Engine, text

from tests.conftest import BIN, count_rows, free_port, test_env
from tests.leakcheck import remember
from tests.processes import receiver

PLUGIN_SRC = Path(__file__).resolve().parent / "plugin_provider"


def pip_install(source: Path, target: Path) -> None:
    """Build the package with its own pyproject and install it into ``target`` (no deps)."""
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--no-index", "--target", str(target), str(source)],
        check=True, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("plugin")
    source = work / "src"
    shutil.copytree(PLUGIN_SRC, source, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    target = work / "site"
    pip_install(source, target)
    assert next(target.glob("webhooks_acme_provider-1.0.0.dist-info/entry_points.txt"))
    return target


def webhooks(*args: str, pythonpath: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "webhooks"), *args],
        env=test_env(PYTHONPATH=str(pythonpath)),
        capture_output=True,
        text=True,
        timeout=60,
    )


def acme_signed(secret: str, event_id: str, ts: int) -> tuple[dict[str, str], bytes]:
    """Acme's documented scheme, written here from its docstring, not imported from it."""
    body = json.dumps({"id": event_id, "kind": "anvil.shipped", "at": ts}).encode()
    digest = hmac.new(secret.encode(), f"{ts}.".encode() + body, hashlib.sha256).hexdigest()
    return {
        "X-Acme-Signature": f"v1={digest}",
        "X-Acme-Timestamp": str(ts),
        "Content-Type": "application/json",
    }, body


@pytest.fixture(scope="module")
def acme_receiver(plugin_path: Path) -> Iterator[str]:
    with receiver(PYTHONPATH=str(plugin_path)) as running:
        yield running.url


def test_the_plugin_is_listed_with_its_contract(plugin_path: Path) -> None:
    listed = webhooks("providers", "list", "--json", pythonpath=plugin_path)
    assert listed.returncode == 0, listed.stderr
    views = {v["name"]: v for v in json.loads(listed.stdout)}
    acme = views["acme"]
    assert acme["builtin"] is False
    assert acme["retry_window_s"] == 2 * 3600
    assert acme["dedup_ttl_s"] > acme["retry_window_s"]
    assert acme["citation"] == "https://acme.example/docs/webhooks#retries"
    assert acme["tolerance_s"] == 300
    # Without the plug-in on the path, nothing of it is known.
    bare = subprocess.run(
        [str(BIN / "webhooks"), "providers", "list", "--json"],
        env=test_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert "acme" not in {v["name"] for v in json.loads(bare.stdout)}


def test_a_plugin_source_receives_a_signed_delivery_end_to_end(
    plugin_path: Path, acme_receiver: str, engine: Engine
) -> None:
    added = webhooks(
        "sources", "add", f"acme-{uuid.uuid4().hex[:8]}", "--provider", "acme", "--json",
        pythonpath=plugin_path,
    )  # fmt: skip
    assert added.returncode == 0, added.stderr
    view = json.loads(added.stdout)
    secret = view["secret"]
    remember(secret)
    event_id = f"acme_{uuid.uuid4().hex}"
    headers, body = acme_signed(secret, event_id, int(time.time()))
    remember(body)
    url = f"{acme_receiver}/webhooks/{view['id']}"
    response = httpx.post(url, headers=headers, content=body, timeout=10)
    assert (response.status_code, response.json()) == (
        202,
        {"status": "accepted", "event_id": event_id},
    ), response.text
    with engine.connect() as conn:
        row = conn.execute(
            text(
                "SELECT r.event_type, r.payload FROM receipts r JOIN sources s "
                "ON s.id = r.source_id WHERE s.public_id = :p AND r.event_id = :e"
            ),
            {"p": view["id"], "e": event_id},
        ).one()
    assert row.event_type == "anvil.shipped"
    assert bytes(row.payload) == body
    # The plug-in's scheme refuses what it should: a wrong secret writes nothing.
    before = count_rows(engine)
    forged_headers, forged = acme_signed(
        "not-the-secret-" + "x" * 16, "acme_forged", int(time.time())
    )
    forged_response = httpx.post(url, headers=forged_headers, content=forged, timeout=10)
    assert forged_response.status_code == 401
    assert count_rows(engine) == before


def test_a_source_whose_plugin_is_gone_gets_503_and_nothing_is_written(
    plugin_path: Path, engine: Engine
) -> None:
    added = webhooks(
        "sources", "add", f"acme-{uuid.uuid4().hex[:8]}", "--provider", "acme", "--json",
        pythonpath=plugin_path,
    )  # fmt: skip
    assert added.returncode == 0, added.stderr
    view = json.loads(added.stdout)
    remember(view["secret"])
    headers, body = acme_signed(view["secret"], f"acme_{uuid.uuid4().hex}", int(time.time()))
    before = count_rows(engine)
    with receiver() as plain:  # this receiver does not have the plug-in installed
        url = f"{plain.url}/webhooks/{view['id']}"
        response = httpx.post(url, headers=headers, content=body, timeout=10)
        check = httpx.get(url, params={"hub.challenge": "x"}, timeout=10)
    # The sender keeps the event and retries: once the plug-in is back, it is received.
    assert (response.status_code, response.headers.get("retry-after")) == (503, "60")
    assert response.json() == {"error": "provider not installed"}
    assert check.status_code == 503
    assert count_rows(engine) == before
    lines = plain.log_path.read_text()
    assert '"event":"provider_missing"' in lines
    assert "Traceback" not in lines


def test_a_broken_plugin_stops_the_receiver_at_start(tmp_path: Path) -> None:
    target = _broken_plugin(tmp_path)
    port = free_port()
    result = subprocess.run(
        [str(BIN / "webhooks"), "serve", "--port", str(port), "--workers", "1"],
        env=test_env(PYTHONPATH=str(target), WEBHOOKS_ADMIN_PORT=str(free_port())),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "provider plug-in 'broken'" in " ".join(result.stderr.split())


def _broken_plugin(tmp_path: Path) -> Path:
    source = tmp_path / "broken"
    source.mkdir()
    (source / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=61", "wheel"]\n'
        'build-backend = "setuptools.build_meta"\n'
        '[project]\nname = "webhooks-broken-provider"\nversion = "0.1"\n'
        '[project.entry-points."webhooks.providers"]\n'
        'broken = "webhooks_missing_module:PROVIDER"\n'
        "[tool.setuptools]\npy-modules = []\n"
    )
    target = tmp_path / "site"
    pip_install(source, target)
    return target


def test_a_broken_plugin_is_one_clear_error(tmp_path: Path) -> None:
    target = _broken_plugin(tmp_path)
    result = webhooks("providers", "list", pythonpath=target)
    assert result.returncode != 0
    message = " ".join(result.stderr.split())
    assert "provider plug-in 'broken'" in message
    assert "webhooks_missing_module:PROVIDER" in message
    assert "webhooks-broken-provider" in message
    assert "ModuleNotFoundError" in message
    assert "Traceback" not in result.stderr
