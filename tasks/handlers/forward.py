"""Built-in ``forward``: POST the original body to the route's URL, signed.

    webhooks routes add SOURCE --handler forward --option url=https://downstream.example/hook

Headers: ``Idempotency-Key`` carries the downstream key (the same on every retry and replay
of one event), and Standard Webhooks headers (``webhook-id`` = that key,
``webhook-timestamp``, ``webhook-signature``) are made with the route's own signing secret, so
the downstream verifies us with any Standard Webhooks library. Connect and read timeouts are
``WEBHOOKS_HANDLER_IO_TIMEOUT`` (below the soft time limit). 2xx succeeds; 408, 429, 5xx,
timeouts and connection errors retry, honouring ``Retry-After`` within the policy's cap;
redirects and other 4xx are permanent. Errors name the status, never the URL (it may carry
a token) nor the body.
"""

from __future__ import annotations

import os
from datetime import datetime
from email.utils import parsedate_to_datetime

import httpx
from standardwebhooks.webhooks import Webhook

from tasks.context import Event, HandlerContext
from tasks.errors import PermanentError, RetryableError
from tasks.handlers.registry import register

USER_AGENT = "webhook-pipeline/0.1"

_client: httpx.Client | None = None


def _reset_client() -> None:
    # A pooled connection must not be shared across fork.
    global _client  # noqa: PLW0603
    _client = None


os.register_at_fork(after_in_child=_reset_client)


def _http() -> httpx.Client:
    global _client  # noqa: PLW0603
    if _client is None:
        _client = httpx.Client(follow_redirects=False, headers={"user-agent": USER_AGENT})
    return _client


def parse_retry_after(value: str | None, now: datetime) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (delta-seconds or HTTP-date)."""
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        return None
    return max(0.0, (when - now).total_seconds())


def signed_headers(event: Event, ctx: HandlerContext, secret: str, now: datetime) -> dict[str, str]:
    try:
        text = event.body.decode("utf-8")
    except UnicodeDecodeError:
        raise PermanentError(
            "body is not UTF-8, cannot sign it as Standard Webhooks", reason="malformed_body"
        ) from None
    signature = Webhook(secret).sign(ctx.idempotency_key, now, text)
    return {
        "content-type": event.meta.content_type or "application/json",
        "idempotency-key": ctx.idempotency_key,
        "webhook-id": ctx.idempotency_key,
        "webhook-timestamp": str(int(now.timestamp())),
        "webhook-signature": signature,
        "x-webhooks-event-type": event.event_type,
    }


@register("forward")
def forward(event: Event, ctx: HandlerContext) -> None:
    url = ctx.route.options.get("url")
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise PermanentError("forward route has no http(s) url option", reason="misconfigured")
    if not ctx.route.signing_secret:
        raise PermanentError("forward route has no signing secret", reason="misconfigured")
    now = ctx.clock.now()
    headers = signed_headers(event, ctx, ctx.route.signing_secret, now)
    try:
        response = _http().post(
            url, content=event.body, headers=headers, timeout=httpx.Timeout(ctx.io_timeout)
        )
    except httpx.TimeoutException as exc:
        raise RetryableError(
            f"downstream timed out ({type(exc).__name__})", reason="timeout"
        ) from None
    except httpx.TransportError as exc:
        raise RetryableError(
            f"downstream unreachable ({type(exc).__name__})", reason="connection"
        ) from None
    status = response.status_code
    if 200 <= status < 300:
        return
    if status in (408, 429) or status >= 500:
        raise RetryableError(
            f"downstream answered HTTP {status}",
            delay=parse_retry_after(response.headers.get("retry-after"), now),
            reason="http_retryable",
        )
    raise PermanentError(f"downstream answered HTTP {status}", reason="http_rejected")
