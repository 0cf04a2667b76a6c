"""One reconciliation run of one source: list what the provider sent in the window, compare
with the receipts in the source's scope, and recover what is missing.

The comparison is keyed on the event id, the receiver's dedup key, in the source's scope. The
window never reaches past the source's dedup TTL: an older receipt may have expired, so a
missing one would not mean a missed event, and recovering it could run an effect twice.

Stripe: each missing event object is accepted through the receiver's accept transaction
(``webhooks_accept``), so it gets its deliveries and runs like any webhook; the same
transaction sets ``webhooks.arrived_via`` so its receipt says ``reconcile``, and stores no
body digest (the object is not the body Stripe signs), so a webhook of the same event arriving
later is a duplicate, and so is a recovery arriving after the webhook.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

import psycopg
from sqlalchemy import func, select, text
from sqlalchemy.orm import Session, sessionmaker

from core import metrics
from core.crypto import SecretBox, SecretMisplaced, SecretUnbound, reconcile_place
from core.durations import format_duration
from core.errors import WebhooksError
from core.filters import FiltersChanged
from core.filters import decide as decide_filters
from core.logs import get_logger
from core.providers import reconcile_options as options
from core.settings import Settings
from core.ttl import expires_at
from models import catalog
from models.accept import ACCEPT_SQL, NewReceipt, accept_params, decide, route_filters_sync
from models.schema import SourceSecret
from tasks.reconcile.paging import (
    MAX_WAIT,
    MAX_WAITS,
    ApiError,
    Listing,
    Page,
    ProviderEvent,
    RateLimited,
    walk,
)

log = get_logger("reconcile")

DEFAULT_MAX_PAGES = 20
# publish(delivery_id, event_id, source public id) -> queued (tasks.publisher.CeleryPublisher)
Publish = Callable[[int, str, str], bool]


class ReconcileError(WebhooksError):
    """The run cannot start (no credential, bad window, provider not supported): one line,
    nothing changed."""


@dataclass(frozen=True)
class Target:
    id: int
    public_id: str
    name: str
    provider: str
    config: dict[str, Any]
    api_key: str | None = field(repr=False)  # never logged, never printed
    secret_id: str | None  # the newest active secret: the accept transaction's authority
    ttl: timedelta


@dataclass
class Report:
    source: str
    name: str
    provider: str
    since: datetime
    until: datetime
    dry_run: bool
    listing: Listing
    missing: list[ProviderEvent]
    recovered: int = 0
    arrived_meanwhile: int = 0  # missing when compared, a webhook before the recovery
    queued: int = 0  # deliveries published at once (the others: the sweeper)

    @property
    def error(self) -> str | None:
        return None if self.listing.error is None else str(self.listing.error)

    def view(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "name": self.name,
            "provider": self.provider,
            "since": self.since,
            "until": self.until,
            "dry_run": self.dry_run,
            "listed": len(self.listing.events),
            "pages": self.listing.pages,
            "truncated": self.listing.truncated,
            "rate_limited_waits": self.listing.waits,
            "missing": [
                {"event_id": e.event_id, "type": e.event_type, "created": e.created}
                for e in self.missing
            ],
            "recovered": self.recovered,
            "arrived_meanwhile": self.arrived_meanwhile,
            "error": self.error,
        }


def fetcher(target: Target, base: str, since: datetime) -> Callable[[str | None], Page]:
    assert target.api_key is not None
    private = options.private_allowed(target.config)
    if target.provider == "stripe":
        from tasks.reconcile.stripe_api import events_fetcher  # noqa: PLC0415 (the stripe client: only a Stripe run)

        endpoint = _stripe_endpoint(target)
        return events_fetcher(target.api_key, base, since, endpoint, allow_private=private)
    if target.provider == "github":
        from tasks.reconcile.github_api import deliveries_fetcher  # noqa: PLC0415 (only a GitHub run)

        return deliveries_fetcher(target.api_key, base, _hook(target), since, allow_private=private)
    if target.provider == "svix":
        from tasks.reconcile.svix_api import messages_fetcher  # noqa: PLC0415 (the svix client: only a Svix run)

        app = _svix(target)[0]
        return messages_fetcher(target.api_key, base, app, since, allow_private=private)
    raise ReconcileError(f"reconciliation does not support provider {target.provider!r}")


def _stripe_endpoint(target: Target) -> str:
    endpoint = target.config.get("endpoint_id")
    if not isinstance(endpoint, str) or not endpoint:
        raise ReconcileError(
            f"source {target.public_id} ({target.name}) names no Stripe webhook endpoint (only "
            "the event types it subscribes to can be missing): webhooks sources update "
            f"{target.name} --config endpoint_id=we_..."
        )
    return endpoint


def _svix(target: Target) -> tuple[str, str]:
    app, endpoint = target.config.get("app_id"), target.config.get("endpoint_id")
    if not isinstance(app, str) or not isinstance(endpoint, str):
        raise ReconcileError(
            f"source {target.public_id} ({target.name}) names no Svix application and endpoint:"
            f" webhooks sources update {target.name} --config app_id=APP --config "
            "endpoint_id=ENDPOINT"
        )
    return app, endpoint


def _hook(target: Target) -> str:
    hook = target.config.get("hook")
    if not isinstance(hook, str) or not hook:
        raise ReconcileError(
            f"source {target.public_id} ({target.name}) names no hook: webhooks sources update "
            f"{target.name} --config hook=repos/OWNER/REPO/hooks/ID (or orgs/ORG/hooks/ID)"
        )
    return hook


def provider_credential(box: SecretBox, source_id: int, ciphertext: bytes) -> str:
    """The source's API credential, opened only at its own place: one sealed for another row
    or purpose (a signing secret copied there, say) is never sent anywhere."""
    try:
        return box.open(ciphertext, reconcile_place(source_id))
    except (SecretMisplaced, SecretUnbound) as exc:
        # One line, the error's: the CLI prints it, beat logs it as reconcile.skipped.
        raise ReconcileError(str(exc)) from None


def load_target(session: Session, box: SecretBox, settings: Settings, ref: str) -> Target:
    source = catalog.get_source(session, ref)
    if not options.supported(source.provider):
        known = ", ".join(sorted(options.SPECS))
        raise ReconcileError(
            f"source {source.public_id} ({source.name}): reconciliation supports {known}, "
            f"not {source.provider!r}"
        )
    secret_id = session.scalars(
        select(SourceSecret.id)
        .where(SourceSecret.source_id == source.id, SourceSecret.revoked_at.is_(None))
        .order_by(SourceSecret.created_at.desc())
        .limit(1)
    ).first()
    ciphertext = source.reconcile_ciphertext
    return Target(
        id=source.id,
        public_id=source.public_id,
        name=source.name,
        provider=source.provider,
        config=dict(source.config or {}),
        api_key=None
        if ciphertext is None
        else provider_credential(box, source.id, bytes(ciphertext)),
        secret_id=secret_id,
        ttl=catalog.source_effective_ttl(source, settings).total,
    )


DEFAULT_WINDOW = timedelta(days=3)


def default_window(target: Target) -> timedelta:
    """3 days, or less where the source's dedup TTL or the provider's horizon is shorter."""
    horizon = timedelta(days=options.SPECS[target.provider].horizon_days)
    return min(DEFAULT_WINDOW, target.ttl, horizon)


def longest_window(target: Target) -> timedelta:
    """The longest window :func:`check_window` allows: the source's dedup TTL, the provider's
    listing horizon."""
    return min(target.ttl, timedelta(days=options.SPECS[target.provider].horizon_days))


def check_window(target: Target, since: timedelta) -> None:
    if since <= timedelta(0):
        raise ReconcileError("--since must be positive")
    if since > target.ttl:
        raise ReconcileError(
            f"--since {format_duration(since)} reaches past source {target.public_id}'s dedup "
            f"TTL ({format_duration(target.ttl)}): an older receipt may have expired, so a "
            "missing one would not mean a missed event; use a shorter window"
        )
    horizon = timedelta(days=options.SPECS[target.provider].horizon_days)
    if since > horizon:
        raise ReconcileError(
            f"--since {format_duration(since)}: {target.provider} lists "
            f"{format_duration(horizon)} of events at most"
        )


def received(session: Session, source_id: int, event_ids: Sequence[str]) -> set[str]:
    """The event ids with a receipt in the source's scope (expired or not)."""
    found: set[str] = set()
    ids = list(dict.fromkeys(event_ids))
    for start in range(0, len(ids), 1000):
        rows = session.execute(
            text(
                "SELECT DISTINCT event_id FROM receipts"
                " WHERE source_id = :s AND event_id = ANY(:ids)"
            ),
            {"s": source_id, "ids": ids[start : start + 1000]},
        )
        found.update(r[0] for r in rows)
    return found


def reconcile(
    settings: Settings,
    sessions: sessionmaker[Session],
    box: SecretBox,
    ref: str,
    *,
    since: timedelta | None,
    dry_run: bool,
    max_pages: int = DEFAULT_MAX_PAGES,
    sleep: Callable[[float], None],
    publish: Publish | None = None,
    settle: timedelta = timedelta(0),
) -> Report:
    """One run; ReconcileError before anything is asked of the provider or written.
    ``since`` None: :func:`default_window`. Events created within ``settle`` of now are
    left out of the comparison (beat's runs: their webhooks are usually in flight)."""
    if max_pages < 1:
        raise ReconcileError("--max-pages must be at least 1")
    with sessions() as session:
        target = load_target(session, box, settings, ref)
        until = session.scalar(select(func.now()))
    assert until is not None
    if target.api_key is None:
        raise ReconcileError(
            f"source {target.public_id} ({target.name}) has no reconciliation credential: "
            f"webhooks sources update {target.name} --api-key KEY"
        )
    since = default_window(target) if since is None else since
    check_window(target, since)
    base = options.base_of(target.provider, target.config)
    start = until - since
    fetch = fetcher(target, base, start)
    log.info("reconcile.started", source=target.public_id, since=start, dry_run=dry_run)
    listing = walk(fetch, max_pages=max_pages, sleep=sleep)
    label = target.public_id
    if listing.error is not None:
        metrics.RECONCILE_API_ERRORS.labels(label, str(listing.error.status or "none")).inc()
        log.warning(
            "reconcile.api_error",
            source=label,
            status=listing.error.status,
            pages=listing.pages,
        )
    with sessions() as session:
        have = received(session, target.id, [e.event_id for e in listing.events])
    # Newest first: the first of an event id is its latest delivery (GitHub redelivers that).
    delivered = {e.event_id for e in listing.events if e.delivered}
    settled = until - settle
    unique: dict[str, ProviderEvent] = {}
    for event in listing.events:
        if event.created > settled and settle > timedelta(0):
            continue
        if event.event_id not in have and event.event_id not in delivered:
            unique.setdefault(event.event_id, event)
    missing = sorted(unique.values(), key=lambda e: (e.created, e.event_id))
    metrics.RECONCILE_MISSING.labels(label).inc(len(missing))
    report = Report(
        source=label,
        name=target.name,
        provider=target.provider,
        since=start,
        until=until,
        dry_run=dry_run,
        listing=listing,
        missing=missing,
    )
    if missing and not dry_run:
        if target.provider == "github":
            _redeliver(target, base, report, sleep)
        elif target.provider == "svix":
            _svix_recover(target, base, report)
        else:
            _recover(settings, target, report, publish)
    log.info(
        "reconcile.finished",
        source=label,
        listed=len(listing.events),
        pages=listing.pages,
        truncated=listing.truncated,
        reconnects=len(listing.reconnects),
        missing=len(missing),
        recovered=report.recovered,
        arrived_meanwhile=report.arrived_meanwhile,
        dry_run=dry_run,
    )
    return report


def _recover(settings: Settings, target: Target, report: Report, publish: Publish | None) -> None:
    if target.secret_id is None:
        raise ReconcileError(
            f"source {target.public_id} has no active secret: the accept transaction "
            "authorises each event with one (webhooks secrets add)"
        )
    with psycopg.connect(settings.psycopg_dsn) as conn:
        for event in report.missing:
            status, delivery_ids = accept_recovered(conn, settings, target, event)
            if status == "accepted":
                report.recovered += 1
                metrics.RECONCILE_RECOVERED.labels(target.public_id).inc()
                log.info(
                    "reconcile.recovered",
                    source=target.public_id,
                    event_id=event.event_id,
                    deliveries=len(delivery_ids),
                )
                for delivery_id in delivery_ids if publish is not None else ():
                    assert publish is not None
                    report.queued += publish(delivery_id, event.event_id, target.public_id)
            elif status == "duplicate":
                report.arrived_meanwhile += 1
            else:
                raise ReconcileError(
                    f"source {target.public_id}: its secret was revoked during the run; "
                    f"{report.recovered} recovered before that, run again"
                )


def _redeliver(target: Target, base: str, report: Report, sleep: Callable[[float], None]) -> None:
    """GitHub: one redelivery request per missing delivery (its latest attempt), each 429
    waited out like a page; the first other error stops the requests (the rest wait for the
    next run)."""
    from tasks.reconcile.github_api import redeliver  # noqa: PLC0415 (only a GitHub run)

    assert target.api_key is not None
    hook = _hook(target)
    private = options.private_allowed(target.config)
    for event in report.missing:
        assert event.ref is not None
        while True:
            try:
                redeliver(target.api_key, base, hook, event.ref, allow_private=private)
            except RateLimited as exc:
                if len(report.listing.waits) >= MAX_WAITS:
                    _stopped(report, target, ApiError(429, "rate limited: stopped"))
                    return
                wait = min(exc.retry_after if exc.retry_after is not None else 2.0, MAX_WAIT)
                report.listing.waits.append(wait)
                sleep(wait)
                continue
            except ApiError as exc:
                _stopped(report, target, exc)
                return
            break
        report.recovered += 1
        metrics.RECONCILE_RECOVERED.labels(target.public_id).inc()
        log.info("reconcile.redelivery_requested", source=target.public_id, event_id=event.event_id)


def _svix_recover(target: Target, base: str, report: Report) -> None:
    """Svix: one ``recover`` for the window; Svix resends each failed message of it."""
    from tasks.reconcile.svix_api import recover  # noqa: PLC0415 (the svix client: only a Svix run)

    assert target.api_key is not None
    app, endpoint = _svix(target)
    try:
        private = options.private_allowed(target.config)
        recover(target.api_key, base, app, endpoint, report.since, allow_private=private)
    except ApiError as exc:
        _stopped(report, target, exc)
        return
    report.recovered = len(report.missing)
    metrics.RECONCILE_RECOVERED.labels(target.public_id).inc(len(report.missing))
    log.info("reconcile.recover_requested", source=target.public_id, missing=len(report.missing))


def _stopped(report: Report, target: Target, error: ApiError) -> None:
    report.listing.error = error
    metrics.RECONCILE_API_ERRORS.labels(target.public_id, str(error.status or "none")).inc()
    log.warning("reconcile.api_error", source=target.public_id, status=error.status)


def accept_recovered(
    conn: psycopg.Connection[Any], settings: Settings, target: Target, event: ProviderEvent
) -> tuple[str, tuple[int, ...]]:
    """Accept one recovered event object through the receiver's accept function, in one
    transaction that marks its receipt ``reconcile``. Returns (accepted | duplicate | revoked,
    delivery ids)."""
    assert event.body is not None
    assert target.secret_id is not None
    with conn.transaction():
        now = conn.execute("SELECT now()").fetchone()
        assert now is not None
        receipt = NewReceipt(
            source_id=target.id,
            secret_id=target.secret_id,
            event_id=event.event_id,
            event_type=event.event_type,
            occurred_at=event.created,
            # The event time comes from the provider's API over TLS: it anchors the expiry,
            # as the signed time of a webhook does.
            expires_at=expires_at(event.created, now[0], target.ttl),
            received_at=None,
            digest=b"",
            content_type="application/json",
            payload=event.body,
            ttl=target.ttl,
        )
        conn.execute("SELECT set_config('webhooks.arrived_via', 'reconcile', true)")
        # Its routes' filters judged here, with no request headers; the accept re-checks
        # them: one changed between the read and the accept (stale, nothing written) is
        # read and judged again, once.
        for _ in range(2):
            filters = route_filters_sync(conn, target.id)
            verdicts = decide_filters(filters, event.body, event.event_type, {})
            params = accept_params(replace(receipt, verdicts=verdicts), settings.publish_grace)
            params["digest"] = None  # not the body the provider signs: compares with nothing
            outcome = decide(conn.execute(ACCEPT_SQL, params).fetchone())
            if outcome.status != "stale":
                return outcome.status, outcome.delivery_ids
    raise FiltersChanged(f"route filters of source {target.public_id} changed twice meanwhile")
