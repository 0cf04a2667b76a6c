"""Handlers the worker tests route events to (WEBHOOKS_HANDLER_MODULES=tests.handlers_for_tests).

Effects are rows in ``test_effects`` written through ``ctx.session``, so they commit exactly
when the delivery is marked succeeded. The table is created by the tests, not by migrations.
"""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta
from pathlib import Path

from celery.exceptions import SoftTimeLimitExceeded
from celery.signals import task_postrun
from sqlalchemy import text

from core.clock import FrozenClock
from tasks.context import Event, HandlerContext
from tasks.errors import DownstreamError, PermanentError, RetryableError
from tasks.handlers import register

EFFECTS_DDL = """
CREATE TABLE IF NOT EXISTS test_effects (
    id bigserial PRIMARY KEY,
    delivery_id bigint NOT NULL,
    event_id text NOT NULL,
    idempotency_key text NOT NULL,
    attempt int NOT NULL,
    generation int NOT NULL,
    handler text NOT NULL,
    pid int NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
)
"""


def record_effect(event: Event, ctx: HandlerContext) -> None:
    ctx.session.execute(
        text(
            "INSERT INTO test_effects "
            "(delivery_id, event_id, idempotency_key, attempt, generation, handler, pid) "
            "VALUES (:d, :e, :k, :a, :g, :h, :p)"
        ),
        {
            "d": ctx.delivery_id,
            "e": event.event_id,
            "k": ctx.idempotency_key,
            "a": ctx.attempt,
            "g": ctx.generation,
            "h": ctx.route.handler,
            "p": os.getpid(),
        },
    )


@register("effect")
def effect(event: Event, ctx: HandlerContext) -> None:
    record_effect(event, ctx)


@register("slow_effect")
def slow_effect(event: Event, ctx: HandlerContext) -> None:
    """Writes its effect (uncommitted), then on the first attempt announces itself with a
    marker file ``<marker_dir>/<delivery>.<attempt>.<pid>`` and sleeps: the window in which
    the tests kill the process."""
    record_effect(event, ctx)
    if ctx.attempt == 1:
        marker = (
            Path(ctx.route.options["marker_dir"]) / f"{ctx.delivery_id}.{ctx.attempt}.{os.getpid()}"
        )
        marker.write_text("started")
        time.sleep(float(ctx.route.options.get("sleep", 2.0)))


@register("flaky_n")
def flaky_n(event: Event, ctx: HandlerContext) -> None:
    """Fails ``failures`` times (retryable), then succeeds."""
    if ctx.attempt <= int(ctx.route.options.get("failures", 3)):
        raise RetryableError(f"planned failure {ctx.attempt}", reason="planned")
    record_effect(event, ctx)


@register("always_fail")
def always_fail(event: Event, ctx: HandlerContext) -> None:
    # A foreign exception quoting the body: the worker must store neither the body nor this
    # message, only the class and where it was raised.
    raise RuntimeError("handler broke on " + event.body.decode())


@register("downstream_down")
def downstream_down(event: Event, ctx: HandlerContext) -> None:
    # The downstream always failing (a 5xx): counted by the route's circuit breaker.
    raise DownstreamError("downstream answered HTTP 503", reason="http_5xx")


@register("permanent")
def permanent(event: Event, ctx: HandlerContext) -> None:
    raise PermanentError("this event can never be handled", reason="test_permanent")


@register("retry_after")
def retry_after(event: Event, ctx: HandlerContext) -> None:
    """Asks for an explicit delay on its first attempt, then succeeds."""
    if ctx.attempt == 1:
        raise RetryableError("come back later", delay=float(ctx.route.options["delay"]))
    record_effect(event, ctx)


@register("hang")
def hang(event: Event, ctx: HandlerContext) -> None:
    """Never returns, and swallows the soft time limit (as code stuck in a C call would):
    only the hard time limit, which kills the process, ends it."""
    record_effect(event, ctx)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            time.sleep(0.1)
        except SoftTimeLimitExceeded:
            continue


@register("spin")
def spin(event: Event, ctx: HandlerContext) -> None:
    """On its first attempt spins on the CPU and never yields (gevent cannot interrupt it);
    later attempts record their effect."""
    if ctx.attempt == 1:
        Path(ctx.route.options["marker_dir"], f"{ctx.delivery_id}.spin").write_text("spinning")
        while True:
            pass
    record_effect(event, ctx)


@register("touch")
def touch(event: Event, ctx: HandlerContext) -> None:
    """An effect outside our database (as a downstream call is): writes nothing through
    ``ctx.session`` (so its success is recorded with its batch-mates' in one statement) and
    logs each call as a file ``<marker_dir>/<delivery>.<attempt>.<pid>`` holding the
    idempotency key. Sleeps ``sleep`` seconds on its first attempt (default 0)."""
    directory = Path(ctx.route.options["marker_dir"])
    marker = directory / f"{ctx.delivery_id}.{ctx.attempt}.{os.getpid()}"
    marker.write_text(ctx.idempotency_key)
    if ctx.attempt == 1:
        time.sleep(float(ctx.route.options.get("sleep", 0)))


@register("gate")
def gate(event: Event, ctx: HandlerContext) -> None:
    """An effect outside our database, then a wait: logs the call as ``touch`` does (the
    effect has happened), then waits until the file ``<marker_dir>/open`` exists. The window
    between a downstream call and the commit of its success, held open for the tests to break
    the database in."""
    directory = Path(ctx.route.options["marker_dir"])
    (directory / f"{ctx.delivery_id}.{ctx.attempt}.{os.getpid()}").write_text(ctx.idempotency_key)
    deadline = time.monotonic() + 60
    while not (directory / "open").exists() and time.monotonic() < deadline:
        time.sleep(0.02)


@register("hang_once")
def hang_once(event: Event, ctx: HandlerContext) -> None:
    """Like ``hang`` on its first attempt (never returns, swallows the soft limit); later
    attempts record their effect."""
    if ctx.attempt == 1:
        hang(event, ctx)
    record_effect(event, ctx)


# Set in a worker's environment: its pool process kills itself (SIGKILL) right after a
# delivery's success is committed, before the task returns and so before the broker ack
# (acks_late), once per delivery (a marker file remembers).
KILL_AFTER_COMMIT_DIR = "WEBHOOKS_TEST_KILL_AFTER_COMMIT_DIR"


@task_postrun.connect(weak=False)
def _kill_after_commit(
    args: tuple[object, ...] | None = None, retval: object = None, **_: object
) -> None:
    directory = os.environ.get(KILL_AFTER_COMMIT_DIR)
    if not directory or not args:
        return
    if isinstance(args[0], list):  # a batch: its text counts its deliveries by outcome
        if not (isinstance(retval, str) and f"{len(args[0])} succeeded" in retval):
            return
        name = "-".join(map(str, args[0]))
    elif retval == "succeeded":
        name = str(args[0])
    else:
        return
    marker = Path(directory) / f"{name}.killed"
    if marker.exists():
        return
    marker.write_text(str(os.getpid()))
    os.kill(os.getpid(), signal.SIGKILL)


@register("wedge")
def wedge(event: Event, ctx: HandlerContext) -> None:
    """Stuck in a C call on every attempt, past any exception the pool can raise in it, so
    only its worker's watchdog ends it, by killing the process (tasks.pools). Marker files
    ``<marker_dir>/<delivery>.<attempt>.wedged`` when it starts and ``...soft`` at its soft
    limit. Under gevent it blocks the event loop at once (the unpatched sleep); elsewhere it
    waits for its soft limit first (swallowed), then blocks: the window in which the tests
    start the handlers it will take down with it."""
    directory = Path(ctx.route.options["marker_dir"])
    (directory / f"{ctx.delivery_id}.{ctx.attempt}.wedged").write_text(str(os.getpid()))
    from tasks.pools import is_green  # noqa: PLC0415

    if is_green():
        from gevent import monkey  # noqa: PLC0415

        monkey.get_original("time", "sleep")(600)
    try:
        while True:
            time.sleep(0.05)
    except SoftTimeLimitExceeded:
        (directory / f"{ctx.delivery_id}.{ctx.attempt}.soft").write_text(str(os.getpid()))
    time.sleep(600)


@register("fenced_call")
def fenced_call(event: Event, ctx: HandlerContext) -> None:
    """A call to a downstream behind the fence: announces its arrival (the marker
    ``<marker_dir>/<delivery>.<attempt>.arrived``), waits until ``<marker_dir>/open`` exists
    (the window in which the tests freeze its worker), then ``ctx.fence()`` and the "call":
    the marker ``<delivery>.<attempt>.called``."""
    directory = Path(ctx.route.options["marker_dir"])
    (directory / f"{ctx.delivery_id}.{ctx.attempt}.arrived").write_text("")
    deadline = time.monotonic() + 60
    while not (directory / "open").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    ctx.fence()
    (directory / f"{ctx.delivery_id}.{ctx.attempt}.called").write_text(ctx.idempotency_key)


@register("pause_once")
def pause_once(event: Event, ctx: HandlerContext) -> None:
    """On its first attempt, a pause of ``pause_s`` seconds on a pinned clock (the test's
    FrozenClock moves; nothing sleeps), then the fence and the effect."""
    if ctx.attempt == 1 and isinstance(ctx.clock, FrozenClock):
        ctx.clock.advance(timedelta(seconds=float(ctx.route.options["pause_s"])))
    ctx.fence()
    record_effect(event, ctx)


@register("crash_postgres")
def crash_postgres(event: Event, ctx: HandlerContext) -> None:
    """An effect outside our database (the marker ``<marker_dir>/<delivery>.<attempt>``),
    then Postgres crashes at once: SIGQUIT to the postmaster named by ``pid_file`` is an
    immediate shutdown, nothing flushed that was not flushed already (``pg_ctl stop -m
    immediate``). Milliseconds after the claim: what an asynchronous claim commit loses."""
    directory = Path(ctx.route.options["marker_dir"])
    (directory / f"{ctx.delivery_id}.{ctx.attempt}").write_text(ctx.idempotency_key)
    pid = int(Path(ctx.route.options["pid_file"]).read_text().split()[0])
    os.kill(pid, signal.SIGQUIT)
    # Returns once the postmaster is gone: the success's commit must meet the crash, not
    # race it (a backend still alive for a few milliseconds would commit it first).
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return
        if state == "Z":  # exited, not yet reaped by its parent
            return
        time.sleep(0.01)


@register("result_ref")
def result_ref(event: Event, ctx: HandlerContext) -> object:
    """Returns what its route's options say: ``ref`` (formatted with the event id) as the
    result reference, or ``returns`` = ``dict`` / ``long`` / ``newline`` for one the worker
    must refuse; with ``session`` it also writes its effect through ``ctx.session`` (the
    success commits with it), else it writes nothing (the grouped success statement)."""
    if ctx.route.options.get("session"):
        record_effect(event, ctx)
    bad = ctx.route.options.get("returns")
    if bad == "dict":
        return {"id": event.event_id}
    if bad == "long":
        return "r" * 201
    if bad == "newline":
        return "line one\nline two"
    return str(ctx.route.options.get("ref", "ref-{event_id}")).format(event_id=event.event_id)
