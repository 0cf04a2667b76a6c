"""Svix: the application's messages, listed with the ``svix`` client (``server_url``: the
source's ``api_base``), and ``recover`` for the window on the source's endpoint.

``GET /api/v1/app/{app_id}/msg?after=...&iterator=...``; a message's id is the ``svix-id``
header, the receiver's dedup key. Recovery is one call, ``POST
/api/v1/app/{app_id}/endpoint/{endpoint_id}/recover {"since": ...}``: Svix resends every
message of the window whose delivery to the endpoint failed, and the signed webhooks arrive
as usual. The client's own retries are off (:func:`tasks.reconcile.paging.walk` decides);
the client does not expose response headers, so a 429 waits the default backoff.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

import httpx
import pydantic
from svix.api import MessageListOptions, RecoverIn, Svix, SvixOptions
from svix.exceptions import HttpError

from tasks.reconcile.paging import ApiError, Page, ProviderEvent, RateLimited, Unreachable

PAGE_SIZE = 100


def _client(token: str, base: str) -> Any:
    return Svix(token, SvixOptions(server_url=base, retry_schedule=[], timeout=30.0))


def _raised(exc: Exception, base: str) -> Exception:
    if isinstance(exc, HttpError):
        status = int(exc.status_code)
        if status == 429:
            return RateLimited(None)
        if status in (401, 403):
            return ApiError(status, f"Svix refused the API token ({status})")
        return ApiError(status, f"Svix API error {status}")
    if isinstance(exc, httpx.NetworkError | httpx.RemoteProtocolError):
        return Unreachable(f"Svix API at {base} did not answer")  # walk tries again
    if isinstance(exc, pydantic.ValidationError):
        return ApiError(None, f"Svix API at {base} answered a body its client cannot read")
    return ApiError(None, f"Svix API at {base} did not answer")


def messages_fetcher(
    token: str, base: str, app_id: str, since: datetime
) -> Callable[[str | None], Page]:
    client = _client(token, base)

    def fetch(cursor: str | None) -> Page:
        options = MessageListOptions(
            limit=PAGE_SIZE, iterator=cursor, after=since, with_content=False
        )
        try:
            page = client.message.list(app_id, options)
        except (HttpError, httpx.HTTPError, pydantic.ValidationError) as exc:
            raise _raised(exc, base) from None
        events = [
            ProviderEvent(event_id=str(m.id), event_type=str(m.event_type), created=m.timestamp)
            for m in page.data
        ]
        return Page(events, None if page.done or not page.iterator else str(page.iterator))

    return fetch


def recover(token: str, base: str, app_id: str, endpoint_id: str, since: datetime) -> None:
    try:
        _client(token, base).endpoint.recover(app_id, endpoint_id, RecoverIn(since=since))
    except (HttpError, httpx.HTTPError, pydantic.ValidationError) as exc:
        raise _raised(exc, base) from None
