"""Svix: the application's messages, listed with the ``svix`` client (``server_url``: the
source's ``api_base``), and ``recover`` for the window on the source's endpoint.

``GET /api/v1/app/{app_id}/msg?after=...&iterator=...``; a message's id is the ``svix-id``
header, the receiver's dedup key. Recovery is one call, ``POST
/api/v1/app/{app_id}/endpoint/{endpoint_id}/recover {"since": ...}``: Svix resends every
message of the window whose delivery to the endpoint failed, and the signed webhooks arrive
as usual. The client's own retries are off (:func:`tasks.reconcile.paging.walk` decides);
the client does not expose response headers, so a 429 waits the default backoff.

The client's own httpx client is replaced by :mod:`.transport`'s (the library takes none as a
parameter, so its attribute is set): addresses judged at connect time, no redirect, no proxy
from the environment, at most ``MAX_RESPONSE_BYTES`` of an answer, each call within
``CALL_TIMEOUT`` seconds (the library's ``timeout`` bounds each socket read, not a call).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

import httpx
from svix.api import MessageListOptions, RecoverIn, Svix, SvixOptions
from svix.exceptions import HttpError

from tasks.reconcile.paging import ApiError, Page, ProviderEvent, RateLimited, Unreachable
from tasks.reconcile.transport import CALL_TIMEOUT, api_client, timed_out

PAGE_SIZE = 100


def _client(token: str, base: str, allow_private: bool) -> Any:
    client = Svix(token, SvixOptions(server_url=base, retry_schedule=[], timeout=CALL_TIMEOUT))
    client._httpx_client = api_client(base, f"Svix API at {base}", allow_private=allow_private)
    return client


def _raised(exc: Exception, base: str) -> Exception:
    if isinstance(exc, HttpError):
        status = int(exc.status_code)
        if status == 429:
            return RateLimited(None)
        if status in (401, 403):
            return ApiError(status, f"Svix refused the API token ({status})")
        return ApiError(status, f"Svix API error {status}")
    if isinstance(exc, ApiError):  # refused by the transport (redirect, size, address)
        return exc
    if isinstance(exc, httpx.NetworkError | httpx.RemoteProtocolError):
        return Unreachable(f"Svix API at {base} did not answer")  # walk tries again
    if isinstance(exc, httpx.TimeoutException):
        return timed_out(f"Svix API at {base}")
    if isinstance(exc, ValueError):  # pydantic's ValidationError; an error body not JSON
        return ApiError(None, f"Svix API at {base} answered a body its client cannot read")
    return ApiError(None, f"Svix API at {base} did not answer")


# What a call may raise: the library's HttpError, httpx's errors, a body it cannot read, and
# the transport's refusals.
_FAILURES = (HttpError, httpx.HTTPError, ValueError, ApiError)


def messages_fetcher(
    token: str, base: str, app_id: str, since: datetime, *, allow_private: bool = False
) -> Callable[[str | None], Page]:
    client = _client(token, base, allow_private)

    def fetch(cursor: str | None) -> Page:
        options = MessageListOptions(
            limit=PAGE_SIZE, iterator=cursor, after=since, with_content=False
        )
        try:
            page = client.message.list(app_id, options)
        except _FAILURES as exc:
            raise _raised(exc, base) from None
        events = [
            ProviderEvent(event_id=str(m.id), event_type=str(m.event_type), created=m.timestamp)
            for m in page.data
        ]
        return Page(events, None if page.done or not page.iterator else str(page.iterator))

    return fetch


def recover(
    token: str,
    base: str,
    app_id: str,
    endpoint_id: str,
    since: datetime,
    *,
    allow_private: bool = False,
) -> None:
    try:
        _client(token, base, allow_private).endpoint.recover(
            app_id, endpoint_id, RecoverIn(since=since)
        )
    except _FAILURES as exc:
        raise _raised(exc, base) from None
