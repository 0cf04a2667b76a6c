"""The admin plane on its own address (issue 11, findings 1, 4, 10 and the named tokens of 11),
against real ``webhooks serve`` processes over real sockets.

- The public port serves ``/webhooks/...``, ``/healthz`` and ``/readyz`` only; the admin API
  and ``/metrics`` (per-source labels) answer on the admin port.
- The token is checked before a byte of the body is read: an unauthenticated 80 MB POST is
  refused 401 with the receiver's memory unchanged and most of the body never sent; bad or
  deeply nested JSON without a token is 401, not 400/422. Authenticated bodies are capped at
  64 KiB (413), declared or chunked.
- Named tokens: the audit records the token's name; a client-named operator is refused.
- Admin inputs beyond their types' ranges are 400, never 422 or 500.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from core.settings import Settings, SettingsError, load_settings
from ingest.admin.guard import MAX_BODY_BYTES
from tests.conftest import BIN, free_port, make_settings, test_env
from tests.leakcheck import log_file, remember
from tests.operators_support import (
    accept,
    kill,
    ops_receiver,
    replay_rows,
    source_with,
)
from tests.processes import Receiver, receiver
from tests.signing import sign

pytestmark = pytest.mark.timeout(180)

OPS_TOKEN = "ops-" + uuid.uuid4().hex + uuid.uuid4().hex
CI_TOKEN = "ci-" + uuid.uuid4().hex + uuid.uuid4().hex
remember(OPS_TOKEN)
remember(CI_TOKEN)
MB = 1024 * 1024


@pytest.fixture(scope="module")
def plane() -> Iterator[Receiver]:
    with ops_receiver(None, WEBHOOKS_ADMIN_TOKENS=f"ops:{OPS_TOKEN}, ci:{CI_TOKEN}") as running:
        yield running


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def memory(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak) of a process, in bytes."""
    values = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            values[key] = int(value.split()[0]) * 1024
    return values


def raw_post(
    port: int, path: str, size: int, *, headers: str = "", chunked: bool = False
) -> tuple[int, int, bytes]:
    """POST ``size`` bytes over a raw socket while reading the answer as it comes: (status,
    bytes the server let us send before it answered and closed, the answer)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=20)
    framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {size}"
    head = (
        f"POST {path} HTTP/1.1\r\nHost: admin\r\nContent-Type: application/json\r\n"
        f"{headers}{framing}\r\n\r\n"
    )
    answer = bytearray()
    closed = threading.Event()

    def read() -> None:
        while True:
            try:
                data = sock.recv(65536)
            except OSError:
                break
            if not data:
                break
            answer.extend(data)
        closed.set()

    sent = 0
    piece = b"[" * MB
    sock.sendall(head.encode())
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        while sent < size and not closed.is_set():
            # Never past the declared length: bytes beyond it would be parsed as a second,
            # malformed request and answered 400 before the app's 413 (a race on how much one
            # read of the server's takes).
            part = piece[: size - sent]
            sock.sendall(b"%x\r\n%s\r\n" % (len(part), part) if chunked else part)
            sent += len(part)
        if chunked and not closed.is_set():
            sock.sendall(b"0\r\n\r\n")
    except OSError:
        pass  # the server closed the connection: the point
    assert closed.wait(20), "the server never answered"
    sock.close()
    status = int(answer.split(b" ", 2)[1]) if answer else 0
    return status, sent, bytes(answer)


# --- two addresses ---------------------------------------------------------------------------


def test_the_public_port_serves_webhooks_and_health_only(
    plane: Receiver, ops: Settings, sessions: sessionmaker[Session]
) -> None:
    source = source_with(sessions, ops)
    headers, body = sign("standard", source.secret, event_id=f"evt_{uuid.uuid4().hex}")
    with httpx.Client(timeout=10) as client:
        accepted = client.post(
            f"{plane.url}/webhooks/{source.public_id}", headers=headers, content=body
        )
        assert accepted.status_code == 202, accepted.text
        assert client.get(f"{plane.url}/healthz").status_code == 200
        assert client.get(f"{plane.url}/readyz").status_code == 200
        for path in ("/metrics", "/admin/events", "/admin/docs", "/admin/openapi.json"):
            public = client.get(f"{plane.url}{path}", headers=bearer(OPS_TOKEN))
            assert public.status_code == 404, path
            assert source.public_id not in public.text
        posted = client.post(
            f"{plane.url}/admin/replays",
            json={"reason": "r", "ids": [1]},
            headers=bearer(OPS_TOKEN),
        )
        assert posted.status_code in (404, 405)

        # The admin address: /metrics without a token, per-source labels and all.
        scraped = client.get(f"{plane.admin_url}/metrics")
        assert scraped.status_code == 200
        line = f'webhooks_requests_total{{outcome="accepted",source="{source.public_id}"}} 1.0'
        assert line in scraped.text
        assert client.get(f"{plane.admin_url}/admin/events", headers=bearer(OPS_TOKEN)).is_success
        # ... and nothing of the receiver's own routes.
        assert client.get(f"{plane.admin_url}/healthz").status_code == 401  # not ours: no name
        assert (
            client.get(f"{plane.admin_url}/healthz", headers=bearer(OPS_TOKEN)).status_code == 404
        )


def test_the_admin_address_is_loopback_by_default() -> None:
    settings = make_settings()
    assert (settings.admin_host, settings.admin_port) == ("127.0.0.1", 8001)
    with pytest.raises(SettingsError, match="WEBHOOKS_ADMIN_PORT and WEBHOOKS_PORT"):
        load_settings(
            **{k: getattr(make_settings(), k) for k in ("database_url", "secret_key")},
            port=9000,
            admin_port=9000,
        )


# --- token before body -----------------------------------------------------------------------


@pytest.mark.parametrize("chunked", [False, True], ids=["declared", "chunked"])
def test_an_unauthenticated_80_mb_post_is_refused_unread(plane: Receiver, chunked: bool) -> None:
    before = memory(plane.proc.pid)
    status, sent, answer = raw_post(plane.admin_port, "/admin/replays", 80 * MB, chunked=chunked)
    after = memory(plane.proc.pid)
    assert status == 401, answer[:300]
    assert b"www-authenticate: bearer" in answer.lower()
    # Refused at the headers: what got through before the close is socket buffers, not 80 MB.
    assert sent < 24 * MB, sent
    assert after["VmRSS"] - before["VmRSS"] < 8 * MB, (before, after)
    assert after["VmHWM"] - before["VmHWM"] < 8 * MB, (before, after)
    # A wrong token, a Basic password on an API path: the same.
    for headers in (
        f"Authorization: Bearer {OPS_TOKEN}x\r\n",
        f"Authorization: Basic {OPS_TOKEN}\r\n",
    ):
        status, sent, _ = raw_post(plane.admin_port, "/admin/replays", 80 * MB, headers=headers)
        assert (status, sent < 24 * MB) == (401, True)
    assert memory(plane.proc.pid)["VmHWM"] - before["VmHWM"] < 8 * MB
    assert httpx.get(f"{plane.admin_url}/metrics", timeout=10).status_code == 200


@pytest.mark.parametrize(
    "body",
    [b"{not json", b"[" * 30_000 + b"]" * 30_000, b'{"reason": "r", "ids": ["x"]}', b""],
    ids=["invalid", "deeply-nested", "wrong-types", "empty"],
)
def test_bad_bodies_without_a_token_are_401_not_a_parse_error(plane: Receiver, body: bytes) -> None:
    headers = {"Content-Type": "application/json"}
    refused = httpx.post(f"{plane.admin_url}/admin/replays", content=body, headers=headers)
    assert refused.status_code == 401, refused.text
    assert refused.json()["reason"] == "unauthenticated"
    # With the token the same bodies are a 400 (never 422, never 500).
    answered = httpx.post(
        f"{plane.admin_url}/admin/replays",
        content=body,
        headers={**headers, **bearer(OPS_TOKEN)},
        timeout=10,
    )
    assert answered.status_code == 400, answered.text


def test_authenticated_bodies_are_capped_at_64_kib(plane: Receiver) -> None:
    auth = f"Authorization: Bearer {OPS_TOKEN}\r\n"
    size = 100 * 1024
    declared = raw_post(plane.admin_port, "/admin/replays", size, headers=auth)
    assert declared[0] == 413, declared[2][:300]
    chunked = raw_post(plane.admin_port, "/admin/replays", size, headers=auth, chunked=True)
    assert chunked[0] == 413, chunked[2][:300]
    assert json.loads(chunked[2].split(b"\r\n\r\n", 1)[1])["reason"] == "too_large"
    # Up to the cap is read and parsed (a 400 for this body, not a 413).
    at_cap = b'{"reason": "' + b"r" * (MAX_BODY_BYTES - 40) + b'", "ids": [0]}'
    assert len(at_cap) <= MAX_BODY_BYTES
    parsed = httpx.post(
        f"{plane.admin_url}/admin/replays",
        content=at_cap,
        headers={"Content-Type": "application/json", **bearer(OPS_TOKEN)},
        timeout=10,
    )
    assert parsed.status_code == 400, parsed.text
    assert parsed.json()["errors"][0]["field"] == "body.ids.0"


def test_the_docs_and_schema_need_the_token(plane: Receiver) -> None:
    for path in ("/admin/docs", "/admin/openapi.json", "/admin/docs/assets/swagger-ui.css"):
        missing = httpx.get(f"{plane.admin_url}{path}")
        assert missing.status_code == 401, path
        assert missing.headers["www-authenticate"].startswith("Basic"), path
        assert "paths" not in missing.text
        served = httpx.get(f"{plane.admin_url}{path}", auth=("anyone", CI_TOKEN))
        assert served.status_code == 200, path
    schema = httpx.get(f"{plane.admin_url}/admin/openapi.json", headers=bearer(OPS_TOKEN)).json()
    for operations in schema["paths"].values():
        for operation in operations.values():
            assert "422" not in operation["responses"]


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def test_idle_connections_cannot_hold_the_admin_port(ops: Settings) -> None:
    """Issue 18, item 5: 70 idle sockets (more than one client's 32 connections) are closed
    at the admin header timeout, or earlier to make room for newer ones, and then the admin
    API and /metrics answer at once; before, uvicorn's h11 server started no timer before a
    first request, so they answered 503 for as long as the sockets stayed open."""
    with (
        ops_receiver(
            None, WEBHOOKS_ADMIN_TOKENS=f"ops:{OPS_TOKEN}", WEBHOOKS_ADMIN_HEADER_TIMEOUT="1"
        ) as rcv,
        ExitStack() as stack,
    ):
        started = time.monotonic()
        idle = []
        for _ in range(70):
            sock = stack.enter_context(socket.create_connection(("127.0.0.1", rcv.admin_port)))
            sock.settimeout(10)
            idle.append(sock)
        for sock in idle:  # each one is answered (408 or, closed for room, 503) and closed
            answer = b""
            while chunk := sock.recv(4096):
                answer += chunk
            assert answer.startswith((b"HTTP/1.1 408", b"HTTP/1.1 503")), answer[:100]
        listed = httpx.get(f"{rcv.admin_url}/admin/events", headers=bearer(OPS_TOKEN), timeout=5)
        scraped = httpx.get(f"{rcv.admin_url}/metrics", timeout=5)
        elapsed = time.monotonic() - started
    assert listed.status_code == 200, listed.text
    assert scraped.status_code == 200
    assert elapsed < 6, elapsed
    # Counted apart from the public port's refusals.
    admin = 'webhooks_receiver_limits_total{limit="admin_%s"}'
    closed = _metric(scraped.text, admin % "header_timeout")
    shed = _metric(scraped.text, admin % "shed")
    # The newest 32 stay until the timeout; each one beyond closed the oldest (and perhaps
    # the fixture's port probe, if its close was not read yet).
    assert (closed, 38 <= shed <= 39) == (32, True), (closed, shed)
    assert _metric(scraped.text, 'webhooks_receiver_limits_total{limit="header_timeout"}') == 0


# --- named tokens ----------------------------------------------------------------------------


def test_the_audit_records_the_tokens_name(
    plane: Receiver, ops: Settings, sessions: sessionmaker[Session], engine: Engine
) -> None:
    source = source_with(sessions, ops, "log")
    ids = []
    for token, name in ((OPS_TOKEN, "ops"), (CI_TOKEN, "ci")):
        [delivery] = accept(ops, source)
        kill(sessions, [delivery])
        started = httpx.post(
            f"{plane.admin_url}/admin/replays",
            json={"reason": f"by {name}", "ids": [delivery]},
            headers=bearer(token),
            timeout=10,
        )
        assert started.status_code == 202, started.text
        assert started.json()["replay"]["operator"] == name
        [row] = replay_rows(engine, id=started.json()["replay"]["id"])
        assert (row.operator, row.reason, row.via) == (name, f"by {name}", "api")
        ids.append(delivery)
    # Other test files share this database (a CLI replay's operator is the OS user, root).
    roots_before = replay_rows(engine, operator="root")
    claimed = httpx.post(
        f"{plane.admin_url}/admin/replays",
        json={"reason": "r", "ids": ids, "operator": "root"},
        headers=bearer(CI_TOKEN),
        timeout=10,
    )
    assert claimed.status_code == 400
    assert claimed.json()["errors"][0]["field"] == "body.operator"
    assert replay_rows(engine, operator="root") == roots_before


def test_pause_and_resume_commit_before_they_answer(
    plane: Receiver, ops: Settings, sessions: sessionmaker[Session], engine: Engine
) -> None:
    """A commit made slow on purpose (a deferred constraint trigger on this route's row
    sleeps 1 s at commit): the pause's and the resume's answers still come after their
    commits, so a client that reads the route right after the answer finds the change.
    Before, the endpoint's session committed after the answer was sent."""
    source = source_with(sessions, ops, "log")
    (route_id,) = source.route_ids
    name = f"slow_commit_{uuid.uuid4().hex[:12]}"
    with engine.begin() as conn:
        conn.exec_driver_sql(
            f"CREATE FUNCTION {name}() RETURNS trigger LANGUAGE plpgsql AS"
            " $$ BEGIN PERFORM pg_sleep(1); RETURN NULL; END $$"
        )
        conn.exec_driver_sql(
            f"CREATE CONSTRAINT TRIGGER {name} AFTER UPDATE ON routes"
            f" DEFERRABLE INITIALLY DEFERRED FOR EACH ROW WHEN (NEW.id = {route_id})"
            f" EXECUTE FUNCTION {name}()"
        )
    try:
        for action, paused in (("pause", True), ("resume", False)):
            answer = httpx.post(
                f"{plane.admin_url}/admin/routes/{route_id}/{action}",
                json={"reason": f"{action} before the answer"},
                headers=bearer(OPS_TOKEN),
                timeout=10,
            )
            assert answer.status_code == 200, answer.text
            with engine.connect() as conn:
                stored = conn.exec_driver_sql(
                    "SELECT paused_at IS NOT NULL FROM routes WHERE id = %s", (route_id,)
                ).scalar_one()
            assert stored is paused, f"{action} answered before its commit"
    finally:
        with engine.begin() as conn:
            conn.exec_driver_sql(f"DROP TRIGGER {name} ON routes")
            conn.exec_driver_sql(f"DROP FUNCTION {name}()")


# Random tokens (a repeated character is refused as predictable: test_secret_strength.py).
# Random-looking but the same in every test process: they name parametrized cases, which
# pytest-xdist requires to be collected identically by each of its processes.
S40 = "s-" + hashlib.sha256(b"admin-plane-s40").hexdigest()[:38]
T40 = "t-" + hashlib.sha256(b"admin-plane-t40").hexdigest()[:38]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("ops:" + S40[:31], "the token named 'ops' must be at least 32 characters"),
        ("Ops:" + S40, "entry 1 is not name:token"),
        (S40, "entry 1 is not name:token"),
        ("a:" + S40 + ",a:" + T40, "the name 'a' is given twice"),
        ("a:" + S40 + ",b:" + S40, "the token named 'b' is also given another name"),
        ("x" * 33 + ":" + S40, "entry 1 is not name:token"),
    ],
)
def test_bad_named_tokens_are_refused_without_quoting_them(value: str, message: str) -> None:
    with pytest.raises(SettingsError) as refused:
        load_settings(
            **{k: getattr(make_settings(), k) for k in ("database_url", "secret_key")},
            admin_tokens=value,
        )
    text = str(refused.value)
    assert "WEBHOOKS_ADMIN_TOKENS" in text
    assert message in text
    assert S40[:31] not in text
    assert T40[:31] not in text


def test_admin_token_is_one_more_token_named_admin() -> None:
    single, ops, other = ("a-" + uuid.uuid4().hex + uuid.uuid4().hex for _ in range(3))
    settings = make_settings(admin_token=single, admin_tokens="ops:" + ops)
    named = {k: v.get_secret_value() for k, v in settings.admin_tokens_by_name().items()}
    assert named == {"ops": ops, "admin": single}
    for clash in ("admin:" + other, "ops:" + single):
        with pytest.raises(ValueError, match="WEBHOOKS_ADMIN_TOKEN") as refused:
            make_settings(admin_token=single, admin_tokens=clash)
        assert single not in str(refused.value)


# --- admin inputs: 400 -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        "/admin/events/99999999999999999999999",
        "/admin/events?since=99999999d",
        "/admin/replays/-1",
        "/admin/deliveries/-1",
        "/admin/events?limit=-1",
    ],
)
def test_admin_inputs_beyond_their_ranges_are_400_with_reason_and_detail_on_a_served_plane(
    plane: Receiver, path: str
) -> None:
    answer = httpx.get(f"{plane.admin_url}{path}", headers=bearer(OPS_TOKEN), timeout=10)
    assert answer.status_code == 400, answer.text
    body = answer.json()
    assert body["reason"]
    assert body["detail"]


def test_a_validation_error_names_the_field_not_the_value(plane: Receiver) -> None:
    secret_like = "s3cr3t-" + uuid.uuid4().hex
    answer = httpx.post(
        f"{plane.admin_url}/admin/replays",
        json={"reason": "r", "ids": [secret_like]},
        headers=bearer(OPS_TOKEN),
        timeout=10,
    )
    assert answer.status_code == 400
    assert answer.json()["errors"][0]["field"] == "body.ids.0"
    assert secret_like not in answer.text


# --- webhooks serve --------------------------------------------------------------------------


def test_metrics_add_up_across_receiver_processes_without_a_metrics_dir(
    ops: Settings, sessions: sessionmaker[Session]
) -> None:
    source = source_with(sessions, ops)
    with receiver(workers=2) as rcv:
        for _ in range(8):
            headers, body = sign("standard", source.secret, event_id=f"evt_{uuid.uuid4().hex}")
            # A new connection each time, so both processes answer some of them.
            with httpx.Client(timeout=10) as fresh:
                posted = fresh.post(
                    f"{rcv.url}/webhooks/{source.public_id}", headers=headers, content=body
                )
                assert posted.status_code == 202
        scraped = httpx.get(f"{rcv.admin_url}/metrics", timeout=10).text
        assert httpx.get(f"{rcv.url}/metrics", timeout=10).status_code == 404
    line = f'webhooks_requests_total{{outcome="accepted",source="{source.public_id}"}} 8.0'
    assert line in scraped, [m for m in scraped.splitlines() if "requests_total" in m]


def test_sigterm_stops_both_servers_cleanly() -> None:
    with receiver() as rcv:
        rcv.proc.send_signal(signal.SIGTERM)
        assert rcv.proc.wait(20) == 0
    for port in (rcv.port, rcv.admin_port):
        with socket.socket() as sock:
            assert sock.connect_ex(("127.0.0.1", port)) != 0, port


def _serve(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [str(BIN / "webhooks"), "serve", *args],
        env=test_env(**env),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    log_file(f"serve-{os.getpid()}-{time.monotonic_ns()}").write_text(done.stdout + done.stderr)
    return done


def test_serve_refuses_a_taken_admin_port_and_one_port_for_both() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        refused = _serve({"WEBHOOKS_ADMIN_PORT": str(taken)}, "--port", str(free_port()))
    assert refused.returncode == 1
    assert f"cannot listen on 127.0.0.1:{taken}" in refused.stderr
    assert "WEBHOOKS_ADMIN_PORT" in refused.stderr
    assert "Traceback" not in refused.stderr
    port = free_port()
    same = _serve({"WEBHOOKS_ADMIN_PORT": str(port)}, "--port", str(port))
    assert same.returncode == 1
    assert "WEBHOOKS_ADMIN_PORT" in same.stderr
    assert "Traceback" not in same.stderr
