"""The public port's server limits (issue 11, finding 2), probed on a real ``webhooks serve``.

Raw sockets, because the probes are what a hostile client does: a 30 MB header, a head or body
sent a byte at a time, connections opened and left silent, a body abandoned halfway. The
timeouts are real ones of the server (set to about a second here); each test waits for the
server to close the connection, with a deadline, and never sleeps to pass time of its own.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack

import httpx
import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session, sessionmaker

from core.settings import Settings
from tests.conftest import count_rows
from tests.factories import MadeSource, make_source
from tests.leakcheck import remember
from tests.processes import Receiver, receiver
from tests.signing import sign

LIMITS = {
    "WEBHOOKS_HEADER_TIMEOUT": "1",
    "WEBHOOKS_BODY_TIMEOUT": "1",
    "WEBHOOKS_MAX_CONNECTIONS": "8",
    "WEBHOOKS_MAX_HEADERS": "40",
}
UNKNOWN = "/webhooks/src_" + "a" * 20  # well-formed, unknown: 404 without reading the body


@pytest.fixture(scope="module")
def rcv() -> Iterator[Receiver]:
    with receiver(**LIMITS) as r:
        yield r


@pytest.fixture
def source(sessions: sessionmaker[Session], settings: Settings) -> MadeSource:
    made = make_source(sessions, settings, provider="stripe")
    remember(made.secret)
    return made


def _connect(rcv: Receiver) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", rcv.port), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _read_all(sock: socket.socket, deadline: float = 10) -> bytes:
    """Everything the server sends until it closes the connection (or the deadline)."""
    sock.settimeout(deadline)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    return data


def _status(response: bytes) -> int:
    assert response.startswith(b"HTTP/1.1 "), response[:80]
    return int(response.split(b" ", 2)[1])


def _rss_kib(pid: int) -> int:
    for line in open(f"/proc/{pid}/status").read().splitlines():  # noqa: PTH123, SIM115
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _metric(rcv: Receiver, name: str) -> float:
    url = getattr(rcv, "admin_url", rcv.url)  # /metrics lives on the admin address
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and not line.startswith("#")
    )


def _closed_within(sock: socket.socket, seconds: float) -> tuple[bytes, float]:
    started = time.monotonic()
    data = _read_all(sock, deadline=seconds + 5)
    return data, time.monotonic() - started


def test_a_30_mb_header_is_refused_431_without_buffering_it(rcv: Receiver) -> None:
    before = _rss_kib(rcv.proc.pid)
    refused_before = _metric(rcv, 'webhooks_receiver_limits_total{limit="header_bytes"}')
    with _connect(rcv) as sock:
        sock.sendall(f"POST {UNKNOWN} HTTP/1.1\r\nHost: x\r\nX-Big: ".encode())
        chunk = b"a" * 65536
        sent = 0
        try:
            while sent < 30 * 1024 * 1024:
                sock.sendall(chunk)
                sent += len(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server closed the connection: the rest never left this process
        response = _read_all(sock)
    assert _status(response) == 431
    assert _rss_kib(rcv.proc.pid) - before < 10 * 1024  # nothing near 30 MB was held
    refused = _metric(rcv, 'webhooks_receiver_limits_total{limit="header_bytes"}')
    assert refused == refused_before + 1


def test_a_head_just_under_the_limit_is_served(rcv: Receiver) -> None:
    response = httpx.post(
        f"{rcv.url}{UNKNOWN}", headers={"x-pad": "p" * 30_000}, content=b"{}", timeout=10
    )
    assert response.status_code == 404  # reached the app, which says unknown source


def test_too_many_headers_are_refused_431(rcv: Receiver) -> None:
    headers = "".join(f"X-H{i}: v\r\n" for i in range(60))
    with _connect(rcv) as sock:
        sock.sendall(f"POST {UNKNOWN} HTTP/1.1\r\nHost: x\r\n{headers}\r\n".encode())
        assert _status(_read_all(sock)) == 431


def test_a_slowloris_head_is_closed_within_the_header_timeout(rcv: Receiver) -> None:
    before = _metric(rcv, 'webhooks_receiver_limits_total{limit="header_timeout"}')
    with _connect(rcv) as sock:
        sock.sendall(f"POST {UNKNOWN} HTTP/1.1\r\nHost: x\r\n".encode())
        started = time.monotonic()
        response = b""
        # One header byte every 100 ms: every byte resets no per-read timer, so the head's
        # own deadline (1 s) must end it. Read before each write: a byte written after the
        # server closed draws a reset, which can discard the 408 still unread here.
        sock.settimeout(0.1)
        while time.monotonic() - started < 10:
            try:
                got = sock.recv(4096)
            except TimeoutError:
                got = None
            except ConnectionResetError:
                break
            if got is not None:
                response += got
                if not got:
                    break
                continue
            try:
                sock.sendall(b"X")
            except (BrokenPipeError, ConnectionResetError):
                break
        elapsed = time.monotonic() - started
    assert _status(response) == 408
    assert elapsed < 3
    assert _metric(rcv, 'webhooks_receiver_limits_total{limit="header_timeout"}') == before + 1


def test_a_silent_connection_is_closed_within_the_header_timeout(rcv: Receiver) -> None:
    with _connect(rcv) as sock:
        response, elapsed = _closed_within(sock, 1)
    assert _status(response) == 408
    assert elapsed < 3


def test_a_stalled_body_is_closed_and_logged_as_one_counted_line(
    rcv: Receiver, source: MadeSource, engine: Engine
) -> None:
    rows = count_rows(engine)
    disconnects = _metric(rcv, "webhooks_client_disconnects_total")
    headers, body = sign("stripe", source.secret, event_id="evt_stalled")
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items() if k.lower() != "content-length")
    with _connect(rcv) as sock:
        sock.sendall(
            f"POST /webhooks/{source.public_id} HTTP/1.1\r\nHost: x\r\n{head}"
            f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body[: len(body) // 2]
        )
        response, elapsed = _closed_within(sock, 1)
    assert response == b""  # mid-body: no answer, the connection is closed
    assert elapsed < 3
    _wait_for(lambda: _metric(rcv, "webhooks_client_disconnects_total") == disconnects + 1)
    assert count_rows(engine) == rows
    _assert_one_line_per_disconnect(rcv)


def test_a_sender_that_goes_away_mid_body_is_one_warning_not_a_traceback(
    rcv: Receiver, source: MadeSource, engine: Engine
) -> None:
    rows = count_rows(engine)
    disconnects = _metric(rcv, "webhooks_client_disconnects_total")
    headers, body = sign("stripe", source.secret, event_id="evt_gone")
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items() if k.lower() != "content-length")
    for _ in range(3):
        with _connect(rcv) as sock:
            sock.sendall(
                f"POST /webhooks/{source.public_id} HTTP/1.1\r\nHost: x\r\n{head}"
                f"Content-Length: {len(body) + 100}\r\n\r\n".encode()
                + body
            )
    _wait_for(lambda: _metric(rcv, "webhooks_client_disconnects_total") == disconnects + 3)
    assert count_rows(engine) == rows
    _assert_one_line_per_disconnect(rcv)


def test_connections_beyond_the_cap_get_503_with_retry_after(rcv: Receiver) -> None:
    before = _metric(rcv, 'webhooks_receiver_limits_total{limit="max_connections"}')
    with ExitStack() as stack:
        held = [stack.enter_context(_connect(rcv)) for _ in range(8)]
        # The server accepts in order: once it answers a request on the last held one,
        # all eight are counted.
        held[-1].sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        held[-1].settimeout(5)
        assert held[-1].recv(4096).startswith(b"HTTP/1.1 200")
        with _connect(rcv) as extra:
            response = _read_all(extra)
    assert _status(response) == 503
    assert b"retry-after: 1\r\n" in response.lower()
    after = _metric(rcv, 'webhooks_receiver_limits_total{limit="max_connections"}')
    assert after == before + 1
    # The held ones are gone: a new connection is served again.
    assert httpx.get(f"{rcv.url}/healthz", timeout=10).status_code == 200


def test_keep_alive_requests_within_the_limits_are_served(
    rcv: Receiver, source: MadeSource
) -> None:
    with httpx.Client(timeout=10) as client:
        for i in range(5):
            headers, body = sign("stripe", source.secret, event_id=f"evt_keep_{i}_{time.time()}")
            response = client.post(
                f"{rcv.url}/webhooks/{source.public_id}", headers=headers, content=body
            )
            assert response.status_code == 202, response.text


def _wait_for(predicate: object, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


def _assert_one_line_per_disconnect(rcv: Receiver) -> None:
    lines = rcv.log_path.read_text().splitlines()
    assert not [line for line in lines if "Traceback" in line]
    records = [json.loads(line) for line in lines if line.startswith("{")]
    assert not [r for r in records if r.get("level") == "error"]
    warnings = [r for r in records if r.get("event") == "client_disconnected"]
    assert warnings
    assert all(
        r["level"] == "warning" and set(r) == {"event", "level", "source", "timestamp"}
        for r in warnings
    ), warnings


# The hot route called directly (ingest.app.ReceiverApp) and its answers sent whole
# (ingest.server._Coalescing): pipelined requests, a Connection: close, the other routes.


def _request(path: str, headers: dict[str, str], body: bytes, *, close: bool = False) -> bytes:
    head = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", f"Content-Length: {len(body)}"]
    head += [f"{k}: {v}" for k, v in headers.items() if k.lower() != "content-length"]
    if close:
        head.append("Connection: close")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def _answers(raw: bytes) -> list[tuple[int, bytes]]:
    """(status, body) of each response in ``raw``, in order (Content-Length framing)."""
    out = []
    while raw:
        head, _, rest = raw.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status = int(lines[0].split()[1])
        length = next(
            int(line.split(b":", 1)[1])
            for line in lines
            if line.lower().startswith(b"content-length")
        )
        out.append((status, rest[:length]))
        raw = rest[length:]
    return out


def test_pipelined_webhooks_are_answered_whole_and_in_order_then_closed(
    rcv: Receiver, source: MadeSource, engine: Engine
) -> None:
    """Three signed events in one send, the last asking to close: three whole answers in the
    order asked (202, 200 duplicate, 202), then the close; each event recorded once."""
    stamp = time.time()
    first = sign("stripe", source.secret, event_id=f"evt_pipe_a_{stamp}")
    second = sign("stripe", source.secret, event_id=f"evt_pipe_b_{stamp}")
    path = f"/webhooks/{source.public_id}"
    wire = _request(path, *first) + _request(path, *first) + _request(path, *second, close=True)
    with socket.create_connection(("127.0.0.1", rcv.port), timeout=10) as sock:
        sock.sendall(wire)
        answers = _answers(_read_all(sock))
    assert [status for status, _ in answers] == [202, 200, 202]
    assert f"evt_pipe_a_{stamp}".encode() in answers[0][1]
    assert b"duplicate" in answers[1][1]
    assert f"evt_pipe_b_{stamp}".encode() in answers[2][1]
    with engine.connect() as conn:
        recorded = conn.execute(
            text("SELECT count(*) FROM receipts WHERE source_id = :s"), {"s": source.id}
        ).scalar_one()
    assert recorded == 2


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("POST", "/webhooks/src_aaaaaaaaaaaaaaaaaaaa/extra", 404),  # two segments: no route
        ("POST", "/webhooks/", 404),  # no id at all
        ("PUT", "/webhooks/src_aaaaaaaaaaaaaaaaaaaa", 405),  # Starlette's answer, as before
        ("GET", "/webhooks/src_aaaaaaaaaaaaaaaaaaaa", 404),  # the GET handshake route
    ],
)
def test_what_is_not_the_hot_route_is_still_starlettes(
    rcv: Receiver, method: str, path: str, status: int
) -> None:
    response = httpx.request(method, rcv.url + path, content=b"{}", timeout=10)
    assert response.status_code == status, response.text


def test_an_unknown_source_on_the_hot_route_is_404_without_reading_the_body(
    rcv: Receiver,
) -> None:
    """The direct call still answers before the body: a declared 10 MB body never sent."""
    with socket.create_connection(("127.0.0.1", rcv.port), timeout=10) as sock:
        sock.sendall(
            b"POST /webhooks/src_bbbbbbbbbbbbbbbbbbbb HTTP/1.1\r\nHost: x\r\n"
            b"Content-Length: 10000000\r\nConnection: close\r\n\r\n"
        )
        answers = _answers(_read_all(sock))
    assert [status for status, _ in answers] == [404]
