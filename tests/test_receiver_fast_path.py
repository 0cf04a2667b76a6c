"""The receiver's hot path (issue 24): its answers as one send (``ingest.server._Coalescing``
on a real event loop; on a real ``webhooks serve`` in tests/test_receiver_limits.py), generic
plans for admission's by-id statements, and the start-up objects frozen.
"""

from __future__ import annotations

import asyncio

from ingest.server import _Coalescing
from webhooks.settings import Settings


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
