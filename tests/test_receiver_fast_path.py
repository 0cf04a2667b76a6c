"""The receiver's hot path without Starlette's routing, and its answers as one send (issue 24).

``ingest.app.ReceiverApp`` calls the webhook handler directly for ``POST /webhooks/{id}``;
``ingest.server._Coalescing`` holds what a request's cycle writes in one turn of the event
loop and sends it as one. Probed on a real ``webhooks serve`` with raw sockets (pipelined
requests, a ``Connection: close``), plus the transport wrapper on a real event loop.
"""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session, sessionmaker

from ingest.server import _Coalescing
from tests.factories import MadeSource, make_source
from tests.leakcheck import remember
from tests.processes import Receiver, receiver
from tests.signing import sign
from webhooks.settings import Settings


@pytest.fixture(scope="module")
def rcv() -> Any:
    with receiver() as r:
        yield r


@pytest.fixture
def source(sessions: sessionmaker[Session], settings: Settings) -> MadeSource:
    made = make_source(sessions, settings, provider="stripe")
    remember(made.secret)
    return made


def _request(path: str, headers: dict[str, str], body: bytes, *, close: bool = False) -> bytes:
    head = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", f"Content-Length: {len(body)}"]
    head += [f"{k}: {v}" for k, v in headers.items() if k.lower() != "content-length"]
    if close:
        head.append("Connection: close")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def _read_until_closed(sock: socket.socket, deadline: float = 10) -> bytes:
    sock.settimeout(deadline)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


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
        answers = _answers(_read_until_closed(sock))
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
        answers = _answers(_read_until_closed(sock))
    assert [status for status, _ in answers] == [404]


class _Recorder:
    """A transport stand-in that records its calls (the wrapper's only collaborator)."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        assert not self.closed, "written after close"
        self.sent.append(data)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str) -> str:
        return f"extra:{name}"


def test_writes_of_one_turn_go_out_as_one_send_and_close_sends_first() -> None:
    async def scenario() -> tuple[list[bytes], list[bytes], list[bytes], bool, str]:
        transport = _Recorder()
        wrapped = _Coalescing(transport, asyncio.get_running_loop())  # type: ignore[arg-type]
        wrapped.write(b"HTTP/1.1 202 Accepted\r\n\r\n")
        wrapped.write(b'{"status":"accepted"}')
        held = list(transport.sent)  # nothing sent within the turn
        await asyncio.sleep(0)  # the turn ends: one send
        after_turn = list(transport.sent)
        wrapped.write(b"HTTP/1.1 200 OK\r\n\r\n")
        wrapped.write(b"{}")
        wrapped.close()  # sends what it holds, then closes
        return held, after_turn, transport.sent, transport.closed, wrapped.get_extra_info("peer")

    held, after_turn, sent, closed, extra = asyncio.run(scenario())
    assert held == []
    assert after_turn == [b'HTTP/1.1 202 Accepted\r\n\r\n{"status":"accepted"}']
    assert sent[1:] == [b"HTTP/1.1 200 OK\r\n\r\n{}"]
    assert closed
    assert extra == "extra:peer"  # everything else is the transport's own


def test_nothing_is_written_to_a_transport_already_closing() -> None:
    async def scenario() -> list[bytes]:
        transport = _Recorder()
        wrapped = _Coalescing(transport, asyncio.get_running_loop())  # type: ignore[arg-type]
        wrapped.write(b"late")
        transport.close()  # the peer went away within the turn
        await asyncio.sleep(0)
        return transport.sent

    assert asyncio.run(scenario()) == []


def test_admission_and_the_worker_plan_their_by_id_statements_once(settings: Settings) -> None:
    """The receiver's admission connection, the dispatcher's and the worker's engine run
    generic plans: their ``id = ANY(...)`` statements span every daily partition, and a
    custom plan re-planned all of them on every execution (about 1 ms at 14 days)."""
    from ingest.publisher import Publisher  # noqa: PLC0415
    from tasks.config import Dispatch  # noqa: PLC0415
    from tasks.dispatcher import Dispatcher  # noqa: PLC0415
    from tasks.runtime import build_runtime  # noqa: PLC0415

    publisher = Publisher(settings)
    try:
        # No such delivery: admission finds no route and lets it out (the worker decides).
        assert publisher.admitted([Dispatch(-42, "evt", "src")]) == [Dispatch(-42, "evt", "src")]
        conn = publisher._admission_conn  # noqa: SLF001
        assert conn is not None
        assert conn.execute("SHOW plan_cache_mode").fetchone() == ("force_generic_plan",)
    finally:
        publisher.close()
    dispatcher = Dispatcher(settings, lambda dispatches: None)
    try:
        mode = dispatcher.conn().execute("SHOW plan_cache_mode").fetchone()
        assert mode == ("force_generic_plan",)
    finally:
        dispatcher.close()
    runtime = build_runtime(settings)
    try:
        with runtime.engine.connect() as worker_conn:
            shown = worker_conn.exec_driver_sql("SHOW plan_cache_mode").scalar_one()
        assert shown == "force_generic_plan"
    finally:
        runtime.engine.dispose()


def test_the_receiver_freezes_what_it_loaded_at_start(settings: Settings) -> None:
    """Once started, the receiver's long-lived objects are out of the collector's sight
    (``gc.freeze``): a full collection walked ~100,000 of them, ~15-55 ms that every request
    in flight waited out (the receiver's p99)."""
    import gc  # noqa: PLC0415

    from ingest.app import create_app  # noqa: PLC0415

    app = create_app(settings)

    async def started() -> int:
        async with app.router.lifespan_context(app):  # what uvicorn runs at start and stop
            return gc.get_freeze_count()

    gc.unfreeze()
    try:
        assert gc.get_freeze_count() == 0
        assert asyncio.run(started()) > 50_000
    finally:
        gc.unfreeze()
