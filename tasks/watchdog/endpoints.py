"""The provider's view of a source's endpoint, read (and re-enabled) with the source's API
credential, through reconciliation's client (:mod:`tasks.reconcile.transport`: addresses
judged at connect time, no redirect, a size cap, each call within its timeout).

- Stripe, with the ``stripe`` library: ``GET /v1/webhook_endpoints/{id}`` (``status``,
  ``url``, ``enabled_events``); re-enable: ``POST /v1/webhook_endpoints/{id}`` with
  ``disabled=false``.
- GitHub, with httpx: ``GET /repos/{owner}/{repo}/hooks/{id}`` (or ``/orgs/{org}/hooks/{id}``:
  ``active``, ``config.url``, ``events``, ``last_response``); re-enable: ``PATCH`` the hook
  with ``{"active": true}``.
- Svix, with httpx: ``GET /api/v1/app/{app_id}/endpoint/{endpoint_id}`` (``disabled``,
  ``url``, ``filterTypes``: absent or null for every type); re-enable: ``PATCH`` it with
  ``{"disabled": false}``. Read as JSON rather than through the ``svix`` library: its 2.x
  models name the types ``eventTypes`` where the API (and Svix's other clients) say
  ``filterTypes``, so both names are read.

A 404 is the endpoint deleted (a :class:`~core.watchdog.View`); every other failure (401,
403, 429, 5xx, a timeout, no answer, an answer it cannot read) is :class:`CannotCheck` with
the status, never the API's message or the key. Nothing is retried here: the next period
checks again.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Final

import httpx

from core.errors import WebhooksError
from core.watchdog import View
from tasks.reconcile.paging import ApiError
from tasks.reconcile.transport import api_client


class CannotCheck(WebhooksError):
    """The provider's API did not say what it holds: one line, the status if there was one."""

    def __init__(self, status: int | None, message: str) -> None:
        super().__init__(message)
        self.status = status


def _answered(provider: str, base: str, call: Callable[[], httpx.Response]) -> httpx.Response:
    """The answer of one call to ``provider``'s API at ``base``; no answer (a timeout, a
    transport error, the transport's refusals: redirect, size, address) is CannotCheck."""
    try:
        return call()
    except httpx.TimeoutException:
        raise CannotCheck(None, f"{provider} API at {base} did not answer in time") from None
    except httpx.HTTPError:
        raise CannotCheck(None, f"{provider} API at {base} did not answer") from None
    except ApiError as exc:
        raise CannotCheck(exc.status, str(exc)) from None


def _refusals(
    provider: str, answer: httpx.Response, credential: str, hint: str = "", *, limited: bool = False
) -> None:
    """An answer that says nothing of the endpoint (its 404 is the caller's): rate limited
    (429, or ``limited``), ``credential`` refused (401, 403; ``hint``: what it needs), or
    another error status; CannotCheck with the status for each."""
    status = answer.status_code
    if status == 429 or limited:
        raise CannotCheck(status, f"{provider} rate limited the check ({status})")
    if status in (401, 403):
        raise CannotCheck(status, f"{provider} refused {credential} ({status}){hint}")
    if status >= 400:
        raise CannotCheck(status, f"{provider} API error ({status})")


def _stripe_call(base: str, request: Any) -> Any:
    import stripe  # noqa: PLC0415  (only a Stripe source's check needs it)

    try:
        return request()
    except stripe.InvalidRequestError as exc:
        if exc.http_status == 404:
            return None
        raise CannotCheck(exc.http_status, f"Stripe API error ({exc.http_status})") from None
    except (stripe.AuthenticationError, stripe.PermissionError) as exc:
        raise CannotCheck(
            exc.http_status,
            f"Stripe refused the API key ({exc.http_status}): set one that can read and update"
            " webhook endpoints with webhooks sources update SOURCE --api-key",
        ) from None
    except stripe.RateLimitError as exc:
        raise CannotCheck(exc.http_status, "Stripe rate limited the check (429)") from None
    except stripe.APIConnectionError as exc:
        if isinstance(exc.__cause__, httpx.TimeoutException):
            raise CannotCheck(None, f"Stripe API at {base} did not answer in time") from None
        raise CannotCheck(None, f"Stripe API at {base} did not answer") from None
    except stripe.StripeError as exc:
        raise CannotCheck(exc.http_status, f"Stripe API error ({exc.http_status})") from None
    except ApiError as exc:  # the transport's refusals (redirect, size, address)
        raise CannotCheck(exc.status, str(exc)) from None


def _stripe(api_key: str, base: str, allow_private: bool, timeout: float) -> Any:
    import stripe  # noqa: PLC0415  (only a Stripe source's check needs it)

    from tasks.reconcile.stripe_api import guarded_client  # noqa: PLC0415 (the stripe client)

    return stripe.StripeClient(
        api_key,
        base_addresses={"api": base},
        max_network_retries=0,
        http_client=guarded_client(base, allow_private, timeout),
    )


def _stripe_view(found: Any) -> View:
    if found is None:
        return View("deleted")
    body = found.to_dict()
    status = str(body.get("status") or "")
    return View(
        status="enabled" if status == "enabled" else (status or "unknown"),
        url=body.get("url"),
        events=tuple(str(e) for e in body.get("enabled_events") or ()),
    )


def stripe_view(
    api_key: str, base: str, endpoint_id: str, *, allow_private: bool, timeout: float
) -> View:
    client = _stripe(api_key, base, allow_private, timeout)
    found = _stripe_call(base, lambda: client.v1.webhook_endpoints.retrieve(endpoint_id))
    return _stripe_view(found)


def stripe_enable(
    api_key: str, base: str, endpoint_id: str, *, allow_private: bool, timeout: float
) -> View:
    """``disabled=false`` on the endpoint (one call); the endpoint as Stripe then has it."""
    client = _stripe(api_key, base, allow_private, timeout)
    found = _stripe_call(
        base, lambda: client.v1.webhook_endpoints.update(endpoint_id, {"disabled": False})
    )
    return _stripe_view(found)


def _github(token: str, base: str, allow_private: bool, timeout: float) -> httpx.Client:
    return api_client(
        base,
        f"GitHub API at {base}",
        allow_private=allow_private,
        timeout=timeout,
        headers={
            "Authorization": f"Bearer {token}",
            "Accept": "application/vnd.github+json",
            "X-GitHub-Api-Version": "2022-11-28",
            "User-Agent": "webhook-pipeline-watchdog",
        },
    )


def _github_answer(base: str, call: Callable[[], httpx.Response]) -> View:
    answer = _answered("GitHub", base, call)
    status = answer.status_code
    if status == 404:
        return View("deleted")
    _refusals(
        "GitHub",
        answer,
        "the token",
        ": it needs admin:repo_hook (or admin:org_hook) on the hook named by --config hook=...",
        limited=status == 403 and answer.headers.get("x-ratelimit-remaining") == "0",
    )
    try:
        body = answer.json()
        last = body.get("last_response") or {}
        code, said = last.get("code"), last.get("status")
        return View(
            status="enabled" if body["active"] is True else "inactive",
            url=(body.get("config") or {}).get("url"),
            events=tuple(str(e) for e in body.get("events") or ()),
            last_response=None if code is None and said is None else f"{code} {said}".strip(),
        )
    except (ValueError, KeyError, TypeError, AttributeError):
        raise CannotCheck(status, f"GitHub API at {base} answered a hook it cannot read") from None


def _svix(token: str, base: str, allow_private: bool, timeout: float) -> httpx.Client:
    return api_client(
        base,
        f"Svix API at {base}",
        allow_private=allow_private,
        timeout=timeout,
        headers={"Authorization": f"Bearer {token}", "Accept": "application/json"},
    )


def _svix_answer(base: str, call: Callable[[], httpx.Response]) -> View:
    answer = _answered("Svix", base, call)
    status = answer.status_code
    if status == 404:
        return View("deleted")
    _refusals("Svix", answer, "the API token")
    try:
        body = answer.json()
        types = body.get("filterTypes", body.get("eventTypes"))
        return View(
            status="disabled" if body.get("disabled") is True else "enabled",
            url=str(body["url"]),
            events=("*",) if not types else tuple(str(t) for t in types),
        )
    except (ValueError, KeyError, TypeError, AttributeError):
        raise CannotCheck(
            status, f"Svix API at {base} answered an endpoint it cannot read"
        ) from None


def svix_view(token: str, base: str, endpoint: str, *, allow_private: bool, timeout: float) -> View:
    """``endpoint``: ``APP_ID/ENDPOINT_ID``."""
    app, _, ep = endpoint.partition("/")
    with _svix(token, base, allow_private, timeout) as client:
        return _svix_answer(base, lambda: client.get(f"/api/v1/app/{app}/endpoint/{ep}"))


def svix_enable(
    token: str, base: str, endpoint: str, *, allow_private: bool, timeout: float
) -> View:
    """``{"disabled": false}`` on the endpoint (one call); the endpoint as Svix then has it."""
    app, _, ep = endpoint.partition("/")
    with _svix(token, base, allow_private, timeout) as client:
        path = f"/api/v1/app/{app}/endpoint/{ep}"
        return _svix_answer(base, lambda: client.patch(path, json={"disabled": False}))


def github_view(token: str, base: str, hook: str, *, allow_private: bool, timeout: float) -> View:
    with _github(token, base, allow_private, timeout) as client:
        return _github_answer(base, lambda: client.get(f"/{hook}"))


def github_enable(token: str, base: str, hook: str, *, allow_private: bool, timeout: float) -> View:
    """``{"active": true}`` on the hook (one call); the hook as GitHub then has it."""
    with _github(token, base, allow_private, timeout) as client:
        return _github_answer(base, lambda: client.patch(f"/{hook}", json={"active": True}))


# Shopify's REST Admin API version: a stable version is supported for at least 12 months, and
# a request naming one no longer supported is served by the oldest supported one
# (https://shopify.dev/docs/api/usage/versioning); the webhook resource's ``topic`` and
# ``address`` are the same in every version (https://shopify.dev/docs/api/admin-rest/latest/resources/webhook).
SHOPIFY_API_VERSION: Final = "2025-10"
# At most this many pages of 250 subscriptions (Shopify's largest page) are read.
SHOPIFY_PAGES: Final = 4


def _shopify(token: str, base: str, allow_private: bool, timeout: float) -> httpx.Client:
    return api_client(
        base,
        f"Shopify API at {base}",
        allow_private=allow_private,
        timeout=timeout,
        headers={"X-Shopify-Access-Token": token, "Accept": "application/json"},
    )


def _shopify_page(
    base: str, call: Callable[[], httpx.Response]
) -> tuple[list[tuple[str, str]], str | None]:
    """One page's (topic, address) pairs and the next page's URL, if any."""
    answer = _answered("Shopify", base, call)
    status = answer.status_code
    if status == 404:
        raise CannotCheck(status, f"Shopify API at {base} has no such shop or API version (404)")
    _refusals(
        "Shopify",
        answer,
        "the access token",
        ": set the app's Admin API access token with webhooks sources update SOURCE --api-key -",
    )
    try:
        subs = [(str(w["topic"]), str(w["address"])) for w in answer.json()["webhooks"]]
    except (ValueError, KeyError, TypeError):
        raise CannotCheck(
            status, f"Shopify API at {base} answered subscriptions it cannot read"
        ) from None
    following = answer.links.get("next", {}).get("url")
    if following is not None and not str(following).startswith(f"{base}/"):
        raise CannotCheck(status, f"Shopify API at {base} named a next page elsewhere")
    return subs, following


def shopify_view(token: str, base: str, shop: str, *, allow_private: bool, timeout: float) -> View:
    """Every webhook subscription of the token's app at the shop (``base`` is the shop's
    ``https://{shop}`` unless the source's ``api_base`` says otherwise)."""
    subs: list[tuple[str, str]] = []
    path: str | None = f"/admin/api/{SHOPIFY_API_VERSION}/webhooks.json?limit=250"
    with _shopify(token, base, allow_private, timeout) as client:
        for _ in range(SHOPIFY_PAGES):
            if path is None:
                break
            page, path = _shopify_page(base, functools.partial(client.get, path))
            subs.extend(page)
        if path is not None:
            raise CannotCheck(
                None, f"shop {shop} has more than {SHOPIFY_PAGES * 250} webhook subscriptions"
            )
    addresses = {a.rstrip("/") for _, a in subs}
    return View(
        status="enabled",
        url=next(iter(addresses)) if len(addresses) == 1 else None,
        events=tuple(sorted({t for t, _ in subs})),
        subscriptions=tuple(sorted(set(subs))),
    )
