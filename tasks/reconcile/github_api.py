"""GitHub's hook deliveries, through the REST API with httpx at the source's ``api_base``.

``GET /{hook}/deliveries?per_page=100`` (``hook``: ``repos/OWNER/REPO/hooks/ID`` or
``orgs/ORG/hooks/ID``), newest first, the next page's ``cursor`` in the ``Link`` header; the
API has no time filter, so the walk stops at the first delivery older than the window. A
delivery's ``guid`` is the ``X-GitHub-Delivery`` header, the receiver's dedup key, the same on
every redelivery. Recovery asks GitHub to redeliver (``POST .../deliveries/{id}/attempts``):
the real signed webhook then arrives and is accepted as usual. Errors are reported by status
only, never with the API's message or the token. The client is :mod:`.transport`'s: addresses
judged at connect time, no redirect, at most ``MAX_RESPONSE_BYTES`` of an answer, each call
within ``CALL_TIMEOUT`` seconds.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, Final
from urllib.parse import parse_qs, urlsplit

import httpx

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


def _client(token: str, base: str, allow_private: bool) -> httpx.Client:
    return api_client(
        base,
        f"GitHub API at {base}",
        allow_private=allow_private,
        headers={
            "Authorization": f"Bearer {token}",
            "Accept": "application/vnd.github+json",
            "X-GitHub-Api-Version": "2022-11-28",
            "User-Agent": "webhook-pipeline-reconcile",
        },
    )


def _unanswered(base: str, exc: httpx.HTTPError) -> ApiError:
    if isinstance(exc, UNANSWERED):
        return Unreachable(f"GitHub API at {base} did not answer")
    if isinstance(exc, httpx.TimeoutException):
        return timed_out(f"GitHub API at {base}")
    return ApiError(None, f"GitHub API at {base} did not answer")


def _raise_for(answer: httpx.Response, what: str) -> None:
    status = answer.status_code
    if status == 429 or (status == 403 and answer.headers.get("x-ratelimit-remaining") == "0"):
        wait = retry_after(answer.headers.get("retry-after"))
        if wait is None and answer.headers.get("x-ratelimit-reset", "").isdigit():
            reset = int(answer.headers["x-ratelimit-reset"])
            wait = max(0.0, reset - datetime.now(UTC).timestamp())
        raise RateLimited(wait)
    if status in (401, 403, 404):
        raise ApiError(
            status,
            f"GitHub refused {what} ({status}): the token needs admin:repo_hook (or "
            "admin:org_hook) on the hook named by --config hook=...",
        )
    if status >= 400:
        raise ApiError(status, f"GitHub API error {status}")


def _next_cursor(link: str | None) -> str | None:
    for part in (link or "").split(","):
        url, _, rel = part.partition(";")
        if 'rel="next"' in rel:
            found = parse_qs(urlsplit(url.strip().strip("<>")).query).get("cursor")
            return found[0] if found else None
    return None


def deliveries_fetcher(
    token: str, base: str, hook: str, since: datetime, *, allow_private: bool = False
) -> Callable[[str | None], Page]:
    client = _client(token, base, allow_private)

    def fetch(cursor: str | None) -> Page:
        params: dict[str, Any] = {"per_page": PAGE_SIZE}
        if cursor is not None:
            params["cursor"] = cursor
        try:
            answer = client.get(f"/{hook}/deliveries", params=params)
        except httpx.HTTPError as exc:
            raise _unanswered(base, exc) from None
        _raise_for(answer, "the deliveries list")
        try:
            items = _deliveries(answer)
        except (ValueError, KeyError, TypeError):
            raise ApiError(
                answer.status_code, f"GitHub API at {base} answered a list it cannot read"
            ) from None
        events = []
        older = False
        for item, delivered_at in items:
            if delivered_at < since:
                older = True
                continue
            kind = str(item.get("event") or "unknown")
            action = item.get("action")
            code = item.get("status_code")
            events.append(
                ProviderEvent(
                    event_id=str(item["guid"]),
                    event_type=f"{kind}.{action}" if action else kind,
                    created=delivered_at,
                    ref=str(item["id"]),
                    delivered=isinstance(code, int) and 200 <= code < 300,
                )
            )
        return Page(events, None if older else _next_cursor(answer.headers.get("link")))

    return fetch


def _deliveries(answer: httpx.Response) -> list[tuple[dict[str, Any], datetime]]:
    """The page's deliveries with their time (ValueError, KeyError or TypeError when it is
    not a list of deliveries)."""
    items = answer.json()
    if not isinstance(items, list):
        raise TypeError("not a list")
    return [
        (item, datetime.fromisoformat(str(item["delivered_at"]).replace("Z", "+00:00")))
        for item in items
    ]


def redeliver(
    token: str, base: str, hook: str, delivery_id: str, *, allow_private: bool = False
) -> None:
    """Ask GitHub to send the delivery again (202); ApiError otherwise."""
    with _client(token, base, allow_private) as client:
        try:
            answer = client.post(f"/{hook}/deliveries/{delivery_id}/attempts")
        except httpx.HTTPError as exc:
            raise _unanswered(base, exc) from None
    _raise_for(answer, "a redelivery")
