"""Built-in handlers for demos and benchmarks: ``log``, ``noop`` and ``flaky``."""

from __future__ import annotations

from sqlalchemy import text

from core.logs import get_logger
from tasks.context import Event, HandlerContext
from tasks.errors import PermanentError
from tasks.handlers.registry import register

log = get_logger(__name__)


@register("log")
def log_handler(event: Event, ctx: HandlerContext) -> None:
    """Log the event's metadata (never its body)."""
    log.info(
        "handler.log",
        delivery_id=ctx.delivery_id,
        source=event.meta.source,
        event_id=event.event_id,
        event_type=event.event_type,
        attempt=ctx.attempt,
        idempotency_key=ctx.idempotency_key,
        size=len(event.body),
    )


@register("noop")
def noop_handler(event: Event, ctx: HandlerContext) -> None:
    """Do nothing: the pipeline's own cost, for benchmarks."""


@register("flaky")
def flaky_handler(event: Event, ctx: HandlerContext) -> None:
    """Fail permanently until the delivery has been replayed from the dead letter.

    For the demo of dead letters and replay: the first run goes dead with reason "permanent";
    once an operator replays it (dead -> pending, same key generation) it succeeds. "Replayed"
    is read from our own attempts table: an earlier attempt of this delivery ended dead.
    """
    died_before = ctx.session.execute(
        text("SELECT EXISTS (SELECT 1 FROM attempts WHERE delivery_id = :id AND outcome = 'dead')"),
        {"id": ctx.delivery_id},
    ).scalar_one()
    if not died_before:
        raise PermanentError("flaky handler fails until the event is replayed", reason="flaky")
    log.info("handler.flaky.recovered", delivery_id=ctx.delivery_id, event_id=event.event_id)
