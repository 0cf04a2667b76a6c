"""The receiver's hot path (issue 24): its answers as one send (``ingest.server._Coalescing``
on a real event loop; on a real ``webhooks serve`` in tests/test_receiver_limits.py), generic
plans for admission's by-id statements, and the start-up objects frozen.
"""

from __future__ import annotations

import asyncio
from typing import Any

from core.settings import Settings
from ingest.server import _Coalescing


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
    from core.messages import Dispatch  # noqa: PLC0415
    from tasks.dispatcher import Dispatcher  # noqa: PLC0415
    from tasks.publisher import Publisher  # noqa: PLC0415
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


def test_a_shutdown_in_the_turn_an_answer_was_written_sends_it_before_closing() -> None:
    """uvicorn's graceful shutdown closes a connection whose response is complete at once:
    an answer written in that same turn is still held by ``_Coalescing``, and must go out
    before the close (``ReceiverProtocol.shutdown``), or the sender never gets its 202."""
    from uvicorn.config import Config  # noqa: PLC0415
    from uvicorn.server import ServerState  # noqa: PLC0415

    from ingest.server import Limits, ReceiverProtocol  # noqa: PLC0415

    class Transport(_Recorder):
        def get_extra_info(self, name: str) -> None:  # type: ignore[override]
            return None

        def pause_reading(self) -> None:
            pass

        def resume_reading(self) -> None:
            pass

    class Protocol(ReceiverProtocol):
        limits = Limits(8192, 50, 10.0, 10.0, 10)

    async def scenario() -> tuple[list[bytes], bool]:
        protocol: Protocol | None = None

        async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            assert protocol is not None
            await send(
                {
                    "type": "http.response.start",
                    "status": 202,
                    "headers": [(b"content-length", b"8")],
                }
            )
            await send({"type": "http.response.body", "body": b"accepted"})
            protocol.shutdown()  # the server's shutdown, in the turn the answer was written

        config = Config(app=app, lifespan="off", proxy_headers=False, log_config=None)
        protocol = Protocol(config, ServerState(), {}, _loop=asyncio.get_running_loop())
        transport = Transport()
        protocol.connection_made(transport)  # type: ignore[arg-type]
        protocol.data_received(b"POST /x HTTP/1.1\r\nhost: t\r\ncontent-length: 0\r\n\r\n")
        for _ in range(20):  # the cycle's task runs; the held answer's turn ends
            await asyncio.sleep(0)
        return transport.sent, transport.closed

    sent, closed = asyncio.run(scenario())
    assert closed
    assert len(sent) == 1
    assert sent[0].startswith(b"HTTP/1.1 202 ")
    assert sent[0].endswith(b"\r\n\r\naccepted")
