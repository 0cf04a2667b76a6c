"""This process's event loop, for handlers' network I/O (issue 33 item 1).

One asyncio loop per worker process, in a daemon thread of its own, started on first use
(after a fork: the child starts its own, the parent's thread did not survive the fork). A
handler thread hands it a coroutine with :func:`call` and waits for the outcome: hundreds of
calls are in flight on one loop, each costing the loop's few microseconds instead of a
blocking client's pool bookkeeping (bench/results_http_clients.txt: aiohttp on a loop spends
0.15 ms of CPU a request where an httpx client per thread spends 2.3-2.6 ms).

The handler keeps its thread, so every guarantee of the synchronous path holds unchanged:
its lease is fenced, its soft and hard limits are the thread's (:mod:`tasks.pools`), a stuck
handler fails its own delivery only, and the pipeline records each outcome as before. A
coroutine handed here must bound its own time (``forward``'s whole call is bounded by its
I/O timeout); :func:`call` waits that long plus a margin, then cancels it.

Not under gevent: the gevent pool's greenlets already wait cheaply, and an asyncio loop in a
monkey-patched process would share nothing with gevent's hub (``forward`` keeps its
synchronous client there).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import os
import queue
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from core.errors import WebhooksError
from core.logs import get_logger

log = get_logger(__name__)

T = TypeVar("T")

# What a caller waits beyond the coroutine's own bound before it gives up on the loop.
WAIT_MARGIN_S = 5.0


class LoopStalled(WebhooksError, TimeoutError):  # noqa: N818 (a timeout, named for what it says)
    """The loop did not finish a call within its bound plus :data:`WAIT_MARGIN_S` (a loop
    blocked by a bug: every coroutine here bounds its own time)."""


class _Loop:
    lock = threading.Lock()
    pid: int | None = None
    loop: asyncio.AbstractEventLoop | None = None
    # Run on the loop when the process exits (e.g. closing client sessions).
    closers: list[Callable[[], Awaitable[None]]] = []  # noqa: RUF012 (process-wide by design)


def loop() -> asyncio.AbstractEventLoop:
    """This process's loop, started in its thread on first use."""
    pid = os.getpid()
    if _Loop.loop is not None and _Loop.pid == pid:
        return _Loop.loop
    with _Loop.lock:
        if _Loop.loop is None or _Loop.pid != pid:
            new = _new_loop()
            ready = threading.Event()

            def serve() -> None:
                asyncio.set_event_loop(new)
                new.call_soon(ready.set)
                new.run_forever()

            threading.Thread(target=serve, name="handler-io", daemon=True).start()
            ready.wait()
            _Loop.loop, _Loop.pid = new, pid
            _Loop.closers = []
    return _Loop.loop


def _new_loop() -> asyncio.AbstractEventLoop:
    """uvloop's loop where it is installed (a dependency): its ``call_soon_threadsafe``, timers
    and socket transports are C, where on asyncio's own loop the hand-over and aiohttp's
    transport were a third of a forwarding worker's CPU (py-spy, GIL samples:
    bench/results_forward.txt); asyncio's loop otherwise."""
    try:
        import uvloop  # noqa: PLC0415 (optional: asyncio's loop without it)
    except ImportError:  # pragma: no cover (installed with the project)
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def on_exit(closer: Callable[[], Awaitable[None]]) -> None:
    """Run ``closer()`` on this process's loop when the process exits (best effort, bounded)."""
    _Loop.closers.append(closer)


def submit(coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
    """Start ``coro`` on this process's loop; its future, for any thread to wait on."""
    return asyncio.run_coroutine_threadsafe(coro, loop())


def call(coro: Coroutine[Any, Any, T], bound: float) -> T:
    """Run ``coro`` on this process's loop and return its result (or raise what it raised).
    ``bound`` is the time the coroutine bounds itself to; past it plus :data:`WAIT_MARGIN_S`
    the call is cancelled and :class:`LoopStalled` raised. Anything raised into the waiting
    thread (a time limit, a shutdown) cancels the coroutine before it propagates.

    The hand-over is a :class:`queue.SimpleQueue` (C: one lock, no Python-level condition)
    and one ``call_soon_threadsafe`` each way in, instead of ``run_coroutine_threadsafe``'s
    chained futures: those cost a forwarding worker 15-20% of its CPU under load (py-spy, GIL
    samples: ``Condition.notify``/``wait`` and ``_chain_future`` per call)."""
    running = loop()
    call = _Call(coro, running)
    running.call_soon_threadsafe(call.start)
    try:
        ok, value = call.answers.get(timeout=bound + WAIT_MARGIN_S)
    except queue.Empty:
        running.call_soon_threadsafe(call.cancel)
        raise LoopStalled(f"the handler I/O loop gave no answer within {bound}s") from None
    except BaseException:
        running.call_soon_threadsafe(call.cancel)
        raise
    if ok:
        return value  # type: ignore[no-any-return]
    raise value


class _Call:
    """One :func:`call` on the loop: its task, and the queue its outcome is put on."""

    __slots__ = ("answers", "coro", "running", "task")

    def __init__(self, coro: Coroutine[Any, Any, Any], running: asyncio.AbstractEventLoop):
        self.coro, self.running = coro, running
        self.answers: queue.SimpleQueue[tuple[bool, Any]] = queue.SimpleQueue()
        self.task: asyncio.Task[Any] | None = None

    def start(self) -> None:  # on the loop
        self.task = self.running.create_task(self.coro)
        self.task.add_done_callback(self.done)

    def done(self, task: asyncio.Task[Any]) -> None:  # on the loop
        if task.cancelled():
            self.answers.put((False, asyncio.CancelledError()))
            return
        failure = task.exception()
        self.answers.put((True, task.result()) if failure is None else (False, failure))

    def cancel(self) -> None:  # on the loop, always after start (one thread's FIFO calls)
        if self.task is not None:
            self.task.cancel()


def _close() -> None:
    running = _Loop.loop
    if running is None or _Loop.pid != os.getpid() or not _Loop.closers:
        return

    async def close_all() -> None:
        for closer in _Loop.closers:
            try:
                await closer()
            except Exception as exc:  # noqa: BLE001 (best effort at exit)
                log.warning("handler_io.close_failed", error_class=type(exc).__name__)

    try:
        asyncio.run_coroutine_threadsafe(close_all(), running).result(timeout=2.0)
    except Exception as exc:  # noqa: BLE001 (best effort at exit)
        log.warning("handler_io.close_failed", error_class=type(exc).__name__)


atexit.register(_close)
