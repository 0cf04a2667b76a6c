"""What a handler may raise, and the worker's own typed errors.

Every error carries a short machine ``reason`` (a metric label and the dead-letter reason) and
a message that never contains payload or secrets: it is stored in ``attempts.error_message``
and ``deliveries.last_error`` for the operator.
"""

from __future__ import annotations

from core.errors import WebhooksError


class HandlerError(WebhooksError):
    """Base class of the errors a handler raises on purpose."""

    reason: str = "handler_error"

    def __init__(self, message: str = "", *, reason: str | None = None) -> None:
        super().__init__(message or (reason or self.reason))
        if reason is not None:
            self.reason = reason


class RetryableError(HandlerError):
    """Try again later; ``delay`` (seconds) asks for a specific wait, bounded by the policy."""

    reason = "retryable"

    def __init__(
        self, message: str = "", *, delay: float | None = None, reason: str | None = None
    ) -> None:
        super().__init__(message, reason=reason)
        if delay is not None and delay < 0:
            raise ValueError("retry delay must not be negative")
        self.delay = delay


class DownstreamError(RetryableError):
    """The downstream itself failed (5xx, timeout, connection error): retried like any
    :class:`RetryableError`, and counted by the route's circuit breaker (models/breaker.py).
    A handler calling a service raises it for the same failures; 408, 429 and 4xx are not
    the downstream failing and never count."""

    reason = "downstream"


class PermanentError(HandlerError):
    """Retrying cannot help (bad request, gone resource): the delivery goes dead at once."""

    reason = "permanent"


class UnknownHandlerError(PermanentError):
    """The route names a handler no installed module registers.

    Permanent: a dead letter is visible and can be replayed once the handler is deployed,
    whereas retrying would only burn attempts on every worker that lacks it too.
    """

    reason = "unknown_handler"

    def __init__(self, name: str) -> None:
        super().__init__(f"no handler registered under {name!r}", reason=self.reason)
        self.name = name


class HandlerRegistrationError(WebhooksError):
    """A handler name was registered twice with different callables, or a module failed."""

    reason = "handler_registration"


class LeaseFenced(WebhooksError):
    """This attempt's lease may end before a call started now could finish and be recorded
    (the worker was frozen, partitioned or starved since its claim): no call is made. Raised
    by ``ctx.fence()`` (:class:`tasks.context.HandlerContext`), never a handler's failure: the
    attempt ends ``fenced`` and spends nothing of the delivery's ``max_attempts``."""

    reason = "fenced"

    def __init__(self, left: float, needed: float) -> None:
        super().__init__(
            f"the lease had {max(left, 0.0):.1f}s left, a call needs {needed:.1f}s;"
            " no call was made"
        )
        self.left = left
        self.needed = needed


class DriftHeld(WebhooksError):
    """The event's payload shape drifted from the one accepted for its source and event type,
    and its route quarantines drift (``--quarantine-drift``): no call is made; the delivery
    waits, held, until ``webhooks drift accept`` (docs/drift.md). Spends no attempt."""

    reason = "drift"
