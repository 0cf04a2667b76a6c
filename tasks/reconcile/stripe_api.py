"""Stripe's events, listed with the ``stripe`` library at the source's ``api_base``.

``GET /v1/webhook_endpoints/{endpoint_id}`` first: only the event types the source's endpoint
subscribes to (``enabled_events``; ``*``: all) were ever sent to it, so only those can be
missing. Then ``GET /v1/events?created[gte]=...`` newest first, 100 a page,
``starting_after`` the last id of the page before. The library's own retries are off (they
would also repeat 5xx answers, with its own sleeps): :func:`tasks.reconcile.paging.walk`
decides (429 and ``Retry-After``; a connection refused or reset: :class:`Unreachable`). Errors are
reported by status and code only: never the API's message, which may quote part of the key.

The library's HTTP client is replaced (:class:`_GuardedClient`, over :mod:`.transport`'s
httpx client): its default one, requests, follows redirects (a 302 to another plain-http host
was followed, the key header stripped but loopback left), reads a body whole, uses proxies
from the environment and bounds each socket read, not a call.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from fnmatch import fnmatchcase
from typing import Any, Final, cast

import httpx
import orjson

from tasks.reconcile.paging import (
    ApiError,
    Page,
    ProviderEvent,
    RateLimited,
    Unreachable,
    retry_after,
)
from tasks.reconcile.transport import api_client, timed_out

PAGE_SIZE = 100
# Refused, reset or closed before an answer (not a timeout): walk tries a listing again.
UNANSWERED: Final = (httpx.NetworkError, httpx.RemoteProtocolError)


def _header(headers: Any, name: str) -> str | None:
    for key, value in dict(headers or {}).items():
        if str(key).lower() == name:
            return str(value)
    return None


def _unanswered(exc: Exception) -> bool:
    """The library's connection error was a refused, reset or closed connection, not a
    timeout (httpx's NetworkError and RemoteProtocolError; a timeout is neither)."""
    return isinstance(exc.__cause__, UNANSWERED)


def _guarded(base: str, allow_private: bool, timeout: float | None = None) -> Any:
    """A ``stripe.HTTPClient`` over :func:`tasks.reconcile.transport.api_client`. A refusal
    of the transport (redirect, size, address) is an ApiError that passes through the library
    as it is; an httpx error becomes the library's APIConnectionError (its cause kept)."""
    import stripe  # noqa: PLC0415  (only a run that reconciles Stripe needs it)

    class _GuardedClient(stripe.HTTPClient):
        name = "webhooks-reconcile"

        def __init__(self) -> None:
            super().__init__()
            self._client = api_client(
                base, f"Stripe API at {base}", allow_private=allow_private, timeout=timeout
            )

        def request(
            self,
            method: str,
            url: str,
            headers: Mapping[str, str] | None,
            post_data: Any = None,
            *,
            _usage: list[str] | None = None,
        ) -> tuple[str, int, Mapping[str, str]]:
            try:
                answer = self._client.request(
                    method, url, headers=dict(headers or {}), content=post_data
                )
            except httpx.HTTPError as exc:
                raise stripe.APIConnectionError(  # type: ignore[no-untyped-call]
                    f"Stripe API at {base} did not answer ({type(exc).__name__})",
                    should_retry=False,
                ) from exc
            body = answer.content.decode("utf-8", errors="replace")
            return body, answer.status_code, answer.headers

        def request_stream(
            self,
            method: str,
            url: str,
            headers: Mapping[str, str] | None,
            post_data: Any = None,
            *,
            _usage: list[str] | None = None,
        ) -> tuple[Any, int, Mapping[str, str]]:
            raise NotImplementedError("reconciliation streams nothing from Stripe")

        def close(self) -> None:
            self._client.close()

    return _GuardedClient()


def guarded_client(base: str, allow_private: bool, timeout: float | None = None) -> Any:
    """A ``stripe.HTTPClient`` over :mod:`.transport` (the watchdog's, :mod:`tasks.watchdog`):
    see :func:`_guarded`."""
    return _guarded(base, allow_private, timeout)


def events_fetcher(
    api_key: str, base: str, since: datetime, endpoint_id: str, *, allow_private: bool = False
) -> Callable[[str | None], Page]:
    import stripe  # noqa: PLC0415  (only a run that reconciles Stripe needs it)

    client = stripe.StripeClient(
        api_key,
        base_addresses={"api": base},
        max_network_retries=0,
        http_client=_guarded(base, allow_private),
    )
    enabled: list[str] = []

    def call(request: Callable[[], Any]) -> Any:
        try:
            return request()
        except stripe.RateLimitError as exc:
            raise RateLimited(retry_after(_header(exc.headers, "retry-after"))) from None
        except (stripe.AuthenticationError, stripe.PermissionError) as exc:
            raise ApiError(
                exc.http_status,
                f"Stripe refused the API key ({exc.http_status}): set one that can read events "
                "and webhook endpoints with webhooks sources update SOURCE --api-key",
            ) from None
        except stripe.InvalidRequestError as exc:
            raise ApiError(
                exc.http_status, f"Stripe API error {exc.http_status} {exc.code or ''}".strip()
            ) from None
        except stripe.APIConnectionError as exc:
            if _unanswered(exc):
                raise Unreachable(f"Stripe API at {base} did not answer") from None
            if isinstance(exc.__cause__, httpx.TimeoutException):
                raise timed_out(f"Stripe API at {base}") from None
            raise ApiError(None, f"Stripe API at {base} did not answer") from None
        except stripe.StripeError as exc:
            code = f" {exc.code}" if exc.code else ""
            raise ApiError(exc.http_status, f"Stripe API error {exc.http_status}{code}") from None

    def fetch(cursor: str | None) -> Page:
        if not enabled:  # the first call (a 429 here is waited out like a page's)
            endpoint = call(lambda: client.v1.webhook_endpoints.retrieve(endpoint_id))
            enabled.extend(str(e) for e in endpoint.to_dict().get("enabled_events") or [])
            if not enabled:
                raise ApiError(None, f"Stripe endpoint {endpoint_id} subscribes to no event")
        params: dict[str, Any] = {"created": {"gte": int(since.timestamp())}, "limit": PAGE_SIZE}
        if cursor is not None:
            params["starting_after"] = cursor
        page = call(lambda: client.v1.events.list(cast(Any, params)))
        listed = [_event(e) for e in page.data]
        events = [e for e in listed if any(fnmatchcase(e.event_type, p) for p in enabled)]
        more = bool(page.has_more) and bool(listed)
        return Page(events, listed[-1].event_id if more else None)

    return fetch


def _event(event: Any) -> ProviderEvent:
    body = event.to_dict()
    return ProviderEvent(
        event_id=str(body["id"]),
        event_type=str(body["type"]),
        created=datetime.fromtimestamp(int(body["created"]), UTC),
        body=orjson.dumps(body),
    )
