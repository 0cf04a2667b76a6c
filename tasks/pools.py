"""How each Celery pool enforces the time limits, and what we add where it does not.

``WEBHOOKS_WORKER_POOL`` picks the pool (``webhooks run`` passes ``-P`` and ``-c``):

prefork
    Celery signals the soft limit into the child (``SoftTimeLimitExceeded`` raised in the
    handler: a retryable failure) and kills the child at the hard limit (a crash: the lease
    runs out after the processing TTL and the sweeper republishes the delivery). Stops any
    handler, even one spinning on the CPU.
gevent
    Celery runs each task in a greenlet under a ``gevent.Timeout``, counted from the task's
    start; it has no soft limit. :func:`time_limits` puts each handler under a soft limit
    (:func:`soft_limit`: the same ``SoftTimeLimitExceeded``, the same retryable failure) and
    a hard ``Timeout`` of its own, both counted from the handler's start; Celery's is set to
    a backstop above them (:func:`tasks.config.deliver_annotations`), or a slow claim would
    let it fire before the soft limit. At the hard limit the ``Timeout`` is raised in the
    handler's greenlet and :mod:`tasks.steps.run` fails the attempt (retry now). Both need
    the handler to yield (any socket, ``time.sleep``, a query): a handler that spins on the
    CPU freezes every greenlet of the process, so :func:`start_watchdog` kills the process
    once its event loop has not run for the hard limit, which is then exactly prefork's
    crash path (lease, sweeper, ``max_redeliveries``). Each handler of a batch
    (:mod:`tasks.pipeline`) runs in a greenlet of its own under the same two limits.
threads
    Celery's thread pool enforces neither limit (``celery.concurrency.thread`` takes no
    timeout). :func:`time_limits` does: a watchdog thread raises ``SoftTimeLimitExceeded``
    in the handler's thread at the soft limit and :class:`HardTimeLimitExceeded` (not an
    ``Exception``: a handler's ``except Exception`` cannot swallow it) at the hard limit,
    after which :mod:`tasks.steps.run` fails the attempt (retry now). Such an exception lands
    between two Python bytecodes: a thread blocked inside one C call (a ``time.sleep(600)``,
    a socket read without timeout) does not see it, so at ``1.5 x`` the hard limit the
    watchdog kills the process (prefork's crash path again; ``forward``'s own I/O timeouts,
    below the soft limit, keep it from ever getting there).

A message carrying several deliveries (:mod:`tasks.pipeline`) runs each handler in a thread of
its own (a greenlet under gevent), under every pool, prefork included: each handler gets the
soft and hard limits above and a stuck one fails its own delivery, not its batch-mates.
Celery's limits on such a message are a backstop at twice the hard limit
(:func:`core.messages.batch_time_limits`), under the processing TTL (4 x hard).

A small blast radius: killing the process re-runs every delivery it had in flight (up to
every slot's message), and each such redelivery counts as a crash (``max_redeliveries``).
So before either watchdog kills, it names what it kills for: :func:`set_crash_reporter`'s
function gets the stuck deliveries (each :func:`time_limits` names its delivery: the threads
past 1.5 x the hard limit; under gevent, the handler whose greenlet holds the blocked loop)
and every other delivery this process holds (:func:`in_flight`, from claim to report), and
marks them in Postgres (:mod:`tasks.crashes`: one short statement, bounded, best effort), so
the next claim counts the crash against the suspects only. A watchdog that finds no suspect
(the loop blocked outside any handler) names nobody: every redelivery counts, as after a
kill -9 from outside.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from celery.exceptions import SoftTimeLimitExceeded

from core.errors import WebhooksError
from core.logs import get_logger
from models.crash_marks import Held

log = get_logger(__name__)

# How often the watchdog looks, and how often the event loop proves it runs.
WATCHDOG_TICK = 0.5
# A watchdog tick this much later than due, with the process's CPU time standing still
# (under this share of the gap), is a pause of the whole process, not a stuck handler.
PAUSE_S = 1.0
PAUSED_CPU_SHARE = 0.1


# Called by a watchdog just before it kills this process: (suspects, bystanders). Set once per
# worker (tasks.worker.build_app); must not raise and must return within a few seconds.
CrashReporter = Callable[[list[Held], list[Held]], None]


class _Crashes:
    reporter: CrashReporter | None = None
    # Every delivery attempt this process holds, from its claim to its report
    # (tasks.pipeline.run): whatever a kill takes with it. Plain dict operations (atomic
    # under the GIL): the gevent watchdog reads it from a native thread while the loop is
    # blocked.
    in_flight: dict[tuple[int, int], Held] = {}  # noqa: RUF012 (process-wide by design)


@contextmanager
def in_flight(held: Sequence[Held]) -> Iterator[None]:
    """While the deliveries ``held`` (claimed by this task) are in this process: a watchdog
    that kills it names them bystanders unless they are the stuck ones."""
    for h in held:
        _Crashes.in_flight[(h.id, h.attempt)] = h
    try:
        yield
    finally:
        for h in held:
            _Crashes.in_flight.pop((h.id, h.attempt), None)


def set_crash_reporter(reporter: CrashReporter | None) -> None:
    """What a watchdog calls to name the deliveries it kills for (see the module's docstring)."""
    _Crashes.reporter = reporter


def _report_then_kill(event: str, suspects: list[Held], **fields: Any) -> None:
    """Log ``event``, name the stuck deliveries and their bystanders (every other delivery
    this process holds; only when some delivery is the suspect: otherwise every redelivery
    keeps counting), then SIGKILL this process."""
    bystanders = [h for h in list(_Crashes.in_flight.values()) if h not in suspects]
    # Logged from a watchdog thread; the line carries ids, no payload.
    log.error(
        event,
        kill=True,
        suspects=[h.id for h in suspects],
        bystanders=len(bystanders),
        **fields,
    )
    reporter = _Crashes.reporter
    if reporter is not None and suspects:
        try:
            reporter(suspects, bystanders)
        except BaseException as exc:  # noqa: BLE001 (best effort: the kill must happen)
            log.warning("worker.crash_report_failed", error_class=type(exc).__name__)
    os.kill(os.getpid(), signal.SIGKILL)


def is_green() -> bool:
    """True in a process monkey-patched by gevent (``celery worker -P gevent`` does it before
    anything else is imported)."""
    monkey = sys.modules.get("gevent.monkey")
    return bool(monkey is not None and monkey.is_module_patched("socket"))


class PoolMismatchError(WebhooksError, RuntimeError):
    """The worker command runs another pool than WEBHOOKS_WORKER_POOL says."""

    reason = "pool_mismatch"


def command_pool(argv: Sequence[str]) -> str:
    """The pool a ``celery worker`` command line asks for (``-P x``, ``-Px``, ``--pool x``,
    ``--pool=x``); Celery's default, prefork, when it names none."""
    for i, arg in enumerate(argv):
        if arg in ("-P", "--pool") and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--pool="):
            return arg.removeprefix("--pool=")
        if arg.startswith("-P") and len(arg) > 2:
            return arg[2:]
    return "prefork"


def check_pool(pool: str, argv: Sequence[str]) -> None:
    """In a worker command: the pool on the command line must be WEBHOOKS_WORKER_POOL's. The
    pool is chosen on the command line only (Celery lets a configured ``worker_pool`` override
    an explicit ``-P prefork``, and gevent must patch before anything is imported), while
    the concurrency, the connection pool and the time limits follow the setting: a mismatch
    would run, say, 50 prefork processes."""
    running = command_pool(argv)
    if running != pool:
        raise PoolMismatchError(
            f"the worker command runs -P {running} but WEBHOOKS_WORKER_POOL={pool}: pass "
            f"-P {pool}, or set WEBHOOKS_WORKER_POOL={running} (webhooks run and "
            "docker-compose.yml pass the setting's pool)"
        )
    if pool == "gevent" and not is_green():
        raise PoolMismatchError("WEBHOOKS_WORKER_POOL=gevent needs `celery worker -P gevent`")


@contextmanager
def soft_limit(seconds: float) -> Iterator[None]:
    """Raise ``SoftTimeLimitExceeded`` in the handler after ``seconds`` under gevent; a no-op
    elsewhere (prefork's own signal does it)."""
    if not is_green():
        yield
        return
    from gevent import Timeout  # noqa: PLC0415 (gevent only under the gevent pool)

    exc = SoftTimeLimitExceeded(f"soft time limit ({seconds}s) exceeded")
    with Timeout(seconds, exc):
        yield


class HardTimeLimitExceeded(BaseException):  # noqa: N818 (named like Celery's limits)
    """Raised in a thread-pool handler at the hard limit. A BaseException, like gevent's
    Timeout: the handler's own ``except Exception`` must not swallow it."""


def is_hard_timeout(exc: BaseException) -> bool:
    """The hard limit fired in this task: ours (threads) or Celery's ``gevent.Timeout``
    (our gevent soft limit raises SoftTimeLimitExceeded, an Exception, instead)."""
    if isinstance(exc, HardTimeLimitExceeded):
        return True
    if not is_green():
        return False
    from gevent import Timeout  # noqa: PLC0415 (gevent only under the gevent pool)

    return isinstance(exc, Timeout)


def _async_raise(ident: int, exc: type[BaseException] | None) -> None:
    """Raise ``exc`` in thread ``ident`` at its next bytecode (None: cancel a pending one)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(ident), ctypes.py_object(exc) if exc is not None else None
    )


class _Deadline:
    __slots__ = ("hard", "held", "kill", "sent", "soft")

    def __init__(self, soft: float, hard: float, kill: float, held: Held | None) -> None:
        self.soft, self.hard, self.kill, self.held = soft, hard, kill, held
        self.sent: type[BaseException] | None = None


class _ThreadLimits:
    """The deadlines of the handlers running in this process's threads, and the one
    watchdog thread that enforces them."""

    lock = threading.Lock()
    running: dict[int, _Deadline] = {}  # noqa: RUF012 (process-wide by design)
    started = False

    @classmethod
    def enter(cls, soft: float, hard: float, held: Held | None) -> int:
        ident = threading.get_ident()
        now = time.monotonic()
        with cls.lock:
            cls.running[ident] = _Deadline(now + soft, now + hard, now + 1.5 * hard, held)
            if not cls.started:
                cls.started = True
                threading.Thread(target=cls._watch, name="time-limits", daemon=True).start()
        return ident

    @classmethod
    def leave(cls, ident: int) -> None:
        with cls.lock:
            deadline = cls.running.pop(ident, None)
            if deadline is not None and deadline.sent is not None:
                _async_raise(ident, None)  # not raised yet: it must not hit the worker's code

    @classmethod
    def _watch(cls) -> None:
        tick = WATCHDOG_TICK / 5
        last, last_cpu = time.monotonic(), time.process_time()
        while True:
            time.sleep(tick)
            now, cpu = time.monotonic(), time.process_time()
            paused = now - last - tick
            if paused > PAUSE_S and cpu - last_cpu < PAUSED_CPU_SHARE * paused:
                cls._shift(paused)
            last, last_cpu = now, cpu
            with cls.lock:
                stuck = [d for d in cls.running.values() if now >= d.kill]
                if not stuck:
                    cls._signal(now)
            if stuck:
                # Outside the lock: handlers may still finish while the marks are written.
                suspects = [d.held for d in stuck if d.held is not None]
                _report_then_kill("worker.handler_stuck", suspects, past_hard_limit=True)

    @classmethod
    def _shift(cls, paused: float) -> None:
        """The whole process was stopped for ``paused`` seconds (SIGSTOP of its host, a VM
        paused): its handlers did not run either, so their limits move by that much. Killing
        the worker for them on its thaw took a healthy host down with answers in hand (issue
        32's drill). Told from a handler that holds the GIL in a C call, which also delays
        this thread, by the process's CPU time: a stopped process spends none."""
        with cls.lock:
            for deadline in cls.running.values():
                deadline.soft += paused
                deadline.hard += paused
                deadline.kill += paused
        log.warning("worker.paused", seconds=round(paused, 1), handlers=len(cls.running))

    @classmethod
    def _signal(cls, now: float) -> None:
        """The soft and hard limits due now (the caller holds the lock)."""
        for ident, deadline in cls.running.items():
            if now >= deadline.hard and deadline.sent is not HardTimeLimitExceeded:
                deadline.sent = HardTimeLimitExceeded
                _async_raise(ident, HardTimeLimitExceeded)
            elif now >= deadline.soft and deadline.sent is None:
                deadline.sent = SoftTimeLimitExceeded
                _async_raise(ident, SoftTimeLimitExceeded)


class _Green:
    """The handlers running in this process's greenlets (gevent): greenlet -> delivery."""

    running: dict[Any, Held] = {}  # noqa: RUF012 (process-wide by design)


@contextmanager
def time_limits(soft: float, hard: float, held: Held | None = None) -> Iterator[None]:
    """Around a handler: the soft and hard limits the pool itself does not enforce (see the
    module's docstring), and the delivery ``held`` it runs for, which a watchdog names when
    it kills the process. Prefork: nothing (Celery does it all: its hard limit kills a child
    that runs one lone delivery, the one to blame)."""
    if is_green():
        import gevent  # noqa: PLC0415 (gevent only under the gevent pool)
        from gevent import Timeout  # noqa: PLC0415 (gevent only under the gevent pool)

        me = gevent.getcurrent()
        if held is not None:
            _Green.running[me] = held
        try:
            # The handler's hard limit, a lone delivery's as each of a batch's: Celery's own
            # Timeout, counted from the task's start, is only a backstop above it
            # (tasks.config.deliver_annotations).
            with Timeout(hard), soft_limit(soft):
                yield
        finally:
            _Green.running.pop(me, None)
        return
    if threading.current_thread() is threading.main_thread():
        # A prefork child (or a test calling the task inline): Celery's signals do it.
        yield
        return
    ident = _ThreadLimits.enter(soft, hard, held)
    try:
        yield
    finally:
        _ThreadLimits.leave(ident)


_LIMITS = (SoftTimeLimitExceeded, HardTimeLimitExceeded)
_LIMIT_CLASSES = frozenset(_LIMITS)


def run_limited(
    handler: Callable[..., object],
    *args: object,
    soft: float,
    hard: float,
    held: Held | None = None,
) -> object:
    """``handler(*args)`` under :func:`time_limits`, returning what it returned, with two
    guarantees a ``with`` block
    cannot give under the thread pool, where a limit is an exception another thread raises
    into this one at its next bytecode:

    - **A handler's return is final.** A limit signalled at the instant the handler returned
      lands here, after it, and is absorbed: the success stands (a retry would repeat an
      effect already made); if it landed before the returned value was kept, the value is
      None (a result reference is best-effort, the success is not).
    - **No limit fires in the pipeline's own code.** When this returns or raises, the limits
      are disarmed and none is pending, so none lands in the success commit or the rollback.

    The watchdog signals a thread at most twice (soft, then hard) and only while its deadline
    is registered; :meth:`_ThreadLimits.leave` unregisters it and cancels what is pending,
    under the watchdog's lock. So the nested catches below absorb every limit that can land
    between the handler's return and that unregistering. Under gevent and in a prefork
    child's main thread the limits never interrupt anything but the handler (a greenlet
    timeout fires at a yield; Celery's signal kills the child), and :func:`time_limits` is
    all there is."""
    if is_green() or threading.current_thread() is threading.main_thread():
        with time_limits(soft, hard, held):
            return handler(*args)
    ident = _ThreadLimits.enter(soft, hard, held)
    failure: BaseException | None = None
    returned: object = None
    try:
        try:
            returned = handler(*args)
        except BaseException as exc:  # noqa: BLE001 (the handler's own outcome, raised below)
            # A limit whose traceback ends in this frame landed after the handler returned
            # (the check that follows a call); one raised in the handler has its frames. No
            # call in here: each call is a point where a second limit could land.
            tb = exc.__traceback__
            if not (exc.__class__ in _LIMIT_CLASSES and tb is not None and tb.tb_next is None):
                failure = exc
        _ThreadLimits.leave(ident)
    except _LIMITS:  # landed after the handler, before the deadline was unregistered
        try:
            _ThreadLimits.leave(ident)
        except _LIMITS:
            try:
                _ThreadLimits.leave(ident)
            except _LIMITS:
                _ThreadLimits.leave(ident)
    if failure is not None:
        raise failure
    return returned


def _blocking_greenlets() -> list[Held]:
    """From the watchdog's native thread while the event loop is blocked: the delivery whose
    handler's greenlet is the one running (a started greenlet without a saved frame: its
    frames are on the thread's stack); the others are suspended."""
    return [
        held
        for greenlet, held in list(_Green.running.items())
        if greenlet.gr_frame is None and not greenlet.dead
    ]


class _Beat:
    last = time.monotonic()


def _tick() -> None:
    _Beat.last = time.monotonic()


def start_watchdog(hard_limit: float) -> bool:
    """Under gevent: a native thread that SIGKILLs this process once the event loop has been
    blocked (a handler spinning on the CPU, a C call that never yields) for ``hard_limit``.
    Returns whether it started (False outside gevent)."""
    if not is_green():
        return False
    import gevent  # noqa: PLC0415 (gevent only under the gevent pool)
    from gevent import monkey  # noqa: PLC0415 (likewise)

    start_thread: Any = monkey.get_original("_thread", "start_new_thread")
    real_sleep: Any = monkey.get_original("time", "sleep")

    def beat() -> None:
        while True:
            _tick()
            gevent.sleep(WATCHDOG_TICK)

    def watch() -> None:
        while True:
            real_sleep(WATCHDOG_TICK)
            blocked = time.monotonic() - _Beat.last
            if blocked > hard_limit:
                _report_then_kill(
                    "worker.event_loop_blocked", _blocking_greenlets(), blocked_s=round(blocked, 1)
                )

    _tick()
    gevent.spawn(beat)
    start_thread(watch, ())
    return True
