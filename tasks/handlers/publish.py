"""Built-in ``publish``: publish each event to an AMQP exchange, with publisher confirms.

    webhooks routes add SOURCE --handler publish --option url=amqp://user:pw@mq:5672/vhost \\
        --option exchange=events --option routing_key=events.{type}

The message: the event's body (a transform's, if the route has one), its content type, and
``message_id`` = the delivery's downstream idempotency key (the same on every retry and
replay of one event: consumers dedupe on it); headers ``webhooks-source``,
``webhooks-event-type`` and ``webhooks-event-id`` (and a transform's headers); persistent
(delivery mode 2). The options are checked when the route is saved
(:mod:`core.publish_target`).

The delivery succeeds only once the broker confirmed the message (kombu's ``pyamqp``
transport with ``confirm_publish``: ``basic.ack``). Anything else is the downstream failing,
a :class:`~tasks.errors.DownstreamError` that is retried and that the route's circuit breaker
counts like a 5xx: the broker unreachable or closing the connection, a refused login or
vhost, a missing exchange, a ``basic.nack``, no confirm within ``WEBHOOKS_HANDLER_IO_TIMEOUT``.
A confirm lost after the broker took the message (the connection dropped between the two)
is such a failure too, and its retry publishes the message again: at least once, never lost;
the message id lets consumers drop the repeat (docs/routing.md).

Connections are pooled per URL in each worker process (``kombu.pools``: at most
``WEBHOOKS_WORKER_SLOTS`` x the batch size, made as needed and then reused), never one per
delivery; a connection that failed is dropped from its pool slot and made again on next use.
Errors and log lines name the error's class, never the URL (it may carry a password) nor the
body.
"""

from __future__ import annotations

import os
import socket
import threading
from typing import Any

import amqp.exceptions
from kombu import Connection, Producer
from kombu.exceptions import LimitExceeded, OperationalError

from core.publish_target import publish_target
from tasks.context import Event, HandlerContext
from tasks.errors import DownstreamError, PermanentError, RetryableError
from tasks.handlers.registry import register

# What a broker that cannot take the message raises (connection, channel, confirm).
BROKER_ERRORS: tuple[type[BaseException], ...] = (
    OSError,  # refused, reset, unreachable, timed out (socket.timeout is one)
    OperationalError,
    amqp.exceptions.AMQPError,  # AccessRefused, NotFound, MessageNacked is not one (below)
    amqp.exceptions.MessageNacked,
    ConnectionError,
    EOFError,
)


# Connections one process keeps per URL at most (its handlers running at once; one waits
# up to the I/O timeout for a free one past that).
POOL_LIMIT = 64
_POOLS: dict[tuple[int, str], Any] = {}
_POOLS_LOCK = threading.Lock()


def _pool(url: str, timeout: float) -> Any:
    """This process's pool of connections to ``url`` (kombu's ``ConnectionPool``, made on
    first use; a forked child makes its own)."""
    key = (os.getpid(), url)
    pool = _POOLS.get(key)
    if pool is None:
        with _POOLS_LOCK:
            pool = _POOLS.get(key)
            if pool is None:
                conn = Connection(
                    url,
                    transport_options={"confirm_publish": True},
                    connect_timeout=timeout,
                    heartbeat=0,
                )
                pool = _POOLS[key] = conn.Pool(limit=POOL_LIMIT)
    return pool


def publish_message(
    url: str,
    *,
    exchange: str,
    routing_key: str,
    body: bytes,
    content_type: str,
    message_id: str,
    headers: dict[str, Any],
    timeout: float,
) -> None:
    """Publish one message and wait for the broker's confirm, on a pooled connection of
    ``url``; the broker's failures as they are raised (:data:`BROKER_ERRORS`)."""
    with _pool(url, timeout).acquire(block=True, timeout=timeout) as conn:
        try:
            conn.ensure_connection(max_retries=0, timeout=timeout)
            producer = Producer(conn.default_channel)
            producer.publish(
                body,
                exchange=exchange,
                routing_key=routing_key,
                content_type=content_type,
                content_encoding="binary",
                message_id=message_id,
                headers=headers,
                delivery_mode=2,
                retry=False,
                timeout=timeout,
                confirm_timeout=timeout,
            )
        except BaseException:
            # Its state is unknown (a closed channel, a half-read frame): made anew next time.
            conn.collect()
            raise


@register("publish")
def publish(event: Event, ctx: HandlerContext) -> None:
    """Publish each event to an AMQP exchange (RabbitMQ), confirmed by the broker."""
    try:
        target = publish_target(ctx.route.options)
    except ValueError as exc:
        raise PermanentError(str(exc), reason="misconfigured") from None
    meta = event.meta
    headers: dict[str, Any] = {
        **event.headers,
        "webhooks-source": meta.source,
        "webhooks-event-type": meta.event_type,
        "webhooks-event-id": meta.event_id,
    }
    ctx.fence()
    try:
        publish_message(
            target.url,
            exchange=target.exchange,
            routing_key=target.key_for(
                event_type=meta.event_type, source=meta.source, event_id=meta.event_id
            ),
            body=event.body,
            content_type=meta.content_type or "application/json",
            message_id=ctx.idempotency_key,
            headers=headers,
            timeout=ctx.io_timeout,
        )
    except LimitExceeded:  # this process's own connections all busy: not the broker's fault
        raise RetryableError(
            f"all {POOL_LIMIT} connections to the broker are busy", reason="pool_busy"
        ) from None
    except BROKER_ERRORS as exc:
        reason = "timeout" if isinstance(exc, socket.timeout | TimeoutError) else "broker"
        raise DownstreamError(
            f"the broker did not confirm the message: {type(exc).__name__}", reason=reason
        ) from None
