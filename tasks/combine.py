"""Flat combining: the threads of one worker process that need the same statement at once
share one execution of it (issue 33 item 2).

A message of one id pays the claim (probe, fast claim, guarded claim) and the success
(guarded success, fast-claim promotion) for itself alone: three statements and two Redis
round trips, each with the per-call CPU of the driver, for one delivery. The threads of a
``-P threads -c 50`` worker draining such messages arrive at those steps together, so the
first to arrive (the leader) runs the step for every request waiting at that moment, in
one statement, and hands each its own part; the others wait for it. Nothing waits on
purpose: a request that finds no leader runs at once (a lone message takes no more time
than before), and a batch forms only from the requests that queued while the previous
one ran, as Postgres' own group commit does. Under gevent the lock and events are the
monkeypatched ones; a prefork child has one thread, so every request leads its own.

Each request names its keys (delivery ids): a batch never holds two requests with a key in
common (two copies of one id claimed in one statement), the later waits for the next
batch. A batch that raises raises in every request it held, each of which handles it as it
handled its own statement's failure before. The leader runs batches until its own request
is done, then hands the lead to the first request still waiting.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class _Slot(Generic[T, R]):
    __slots__ = ("done", "error", "event", "keys", "lead", "request", "result")

    def __init__(self, request: T, keys: frozenset[Hashable]) -> None:
        self.request = request
        self.keys = keys
        self.event = threading.Event()
        self.done = False
        self.lead = False
        self.result: R | None = None
        self.error: BaseException | None = None


class Combiner(Generic[T, R]):
    """Runs ``run(requests)`` (one result per request, in order) for the requests of
    concurrent callers of :meth:`submit`, at most ``limit`` at a time."""

    def __init__(self, run: Callable[[list[T]], Sequence[R]], *, limit: int) -> None:
        self._run = run
        self._limit = max(1, limit)
        self._lock = threading.Lock()
        self._pending: list[_Slot[T, R]] = []
        self._leading = False
        #: Batches run and requests they held (tests and the bench read them).
        self.batches = 0
        self.requests = 0

    def submit(self, request: T, keys: Sequence[Hashable]) -> R:
        """``request``'s result, computed in a batch with the requests waiting beside it."""
        slot: _Slot[T, R] = _Slot(request, frozenset(keys))
        with self._lock:
            self._pending.append(slot)
            if not self._leading:
                self._leading = slot.lead = True
        if not slot.lead:
            slot.event.wait()
        if not slot.done:  # leading: run batches until ours is done, then pass the lead on
            try:
                while not slot.done:
                    self._one_batch()
            finally:
                self._hand_over()
        if slot.error is not None:
            raise slot.error
        return slot.result  # type: ignore[return-value]

    def _one_batch(self) -> None:
        with self._lock:
            batch: list[_Slot[T, R]] = []
            rest: list[_Slot[T, R]] = []
            taken: set[Hashable] = set()
            for s in self._pending:
                if len(batch) < self._limit and not (s.keys & taken):
                    batch.append(s)
                    taken |= s.keys
                else:
                    rest.append(s)
            self._pending = rest
            self.batches += 1
            self.requests += len(batch)
        try:
            pairs = list(zip(batch, self._run([s.request for s in batch]), strict=True))
        except BaseException as exc:  # noqa: BLE001 (raised again in each request it held)
            for s in batch:
                s.error, s.done = exc, True
                s.event.set()
            return
        for s, result in pairs:
            s.result, s.done = result, True
            s.event.set()

    def _hand_over(self) -> None:
        with self._lock:
            if self._pending:
                nxt = self._pending[0]
                nxt.lead = True
                nxt.event.set()
            else:
                self._leading = False
