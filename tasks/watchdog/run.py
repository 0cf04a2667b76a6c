"""One watchdog check of one source (issue 38 item 1): read the provider's view of its
endpoint with the source's API credential, judge it (:mod:`core.watchdog`) and record the
findings (:mod:`models.findings`); and ``--fix``'s re-enable.

The credential is the one reconciliation uses (``sources.reconcile_ciphertext``), opened
only at its own place (:func:`core.crypto.reconcile_place`): it is the source's provider API
credential, and reading the endpoint is what reconciliation already does with it (Stripe's
``enabled_events``, GitHub's hook). No other stored secret is ever sent.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from sqlalchemy import select, text
from sqlalchemy.orm import Session, sessionmaker

from core import metrics
from core import watchdog as judge
from core.crypto import SecretBox
from core.errors import WebhooksError
from core.logs import get_logger
from core.providers import reconcile_options as options
from core.settings import Settings
from models import catalog
from models.findings import Recorded, gauge_rows, record
from models.schema import Route
from tasks.reconcile.run import ReconcileError, provider_credential
from tasks.watchdog.endpoints import (
    CannotCheck,
    github_enable,
    github_view,
    shopify_view,
    stripe_enable,
    stripe_view,
    svix_enable,
    svix_view,
)

log = get_logger("watchdog")


class WatchError(WebhooksError):
    """The source cannot be watched at all (unknown, provider not watched): one line,
    nothing recorded."""


@dataclass(frozen=True)
class Subject:
    id: int
    public_id: str
    name: str
    provider: str
    config: dict[str, Any]
    api_key: str | None = field(repr=False)  # never logged, never printed
    globs: tuple[str, ...]


@dataclass
class Checked:
    source: str
    name: str
    provider: str
    view: judge.View | None
    found: list[judge.Finding]
    recorded: Recorded
    url: str | None  # the URL compared with (None: not compared)

    @property
    def ok(self) -> bool:
        return not self.found

    def view_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "name": self.name,
            "provider": self.provider,
            "provider_view": None if self.view is None else self.view.stored(),
            "expected_url": self.url,
            "findings": [{"kind": f.kind, "detail": f.detail} for f in self.found],
            "opened": self.recorded.opened,
            "closed": self.recorded.closed,
        }


def load_subject(session: Session, box: SecretBox, ref: str) -> Subject:
    source = catalog.get_source(session, ref)
    if source.provider not in judge.WATCHED:
        raise WatchError(
            f"source {source.public_id} ({source.name}): the watchdog reads "
            f"{', '.join(judge.WATCHED)} endpoints, not {source.provider!r}"
        )
    globs = session.scalars(
        select(Route.events_glob).where(Route.source_id == source.id, Route.active.is_(True))
    ).all()
    ciphertext = source.reconcile_ciphertext
    if ciphertext is None:
        # Not watched (beat picks only sources with a credential): asked by name, it says so
        # and records nothing. A cannot_check finding here stayed open for good, and its alert
        # fired, for a source no one meant to watch.
        raise WatchError(
            f"source {source.public_id} ({source.name}) is not watched: it has no API "
            f"credential (webhooks sources update {source.name} --api-key KEY)"
        )
    try:
        key = provider_credential(box, source.id, bytes(ciphertext))
    except ReconcileError as exc:
        raise WatchError(str(exc)) from None
    return Subject(
        id=source.id,
        public_id=source.public_id,
        name=source.name,
        provider=source.provider,
        config=dict(source.config or {}),
        api_key=key,
        globs=tuple(sorted(set(globs))),
    )


Reader = Callable[..., judge.View]
_READERS: dict[str, tuple[Reader, Reader | None]] = {
    "stripe": (stripe_view, stripe_enable),
    "github": (github_view, github_enable),
    "svix": (svix_view, svix_enable),
    "shopify": (shopify_view, None),
}
# Why --fix cannot help a provider's source: said before anything is asked or recorded.
NO_FIX: dict[str, str] = {
    "shopify": (
        "--fix cannot help a shopify source: Shopify has no disabled state (it deletes a"
        " subscription after 8 failed deliveries over 4 hours) and --fix never creates one;"
        " subscribe the app to the topic again"
    ),
}


_EXAMPLE = {
    "stripe": "--config endpoint_id=we_...",
    "github": "--config hook=repos/OWNER/REPO/hooks/ID",
    "svix": "--config app_id=APP --config endpoint_id=ENDPOINT",
    "shopify": "--config shop=NAME.myshopify.com",
}


def _endpoint(subject: Subject) -> str:
    """The endpoint's name in the provider's API (Svix: ``APP_ID/ENDPOINT_ID``)."""
    option = judge.ENDPOINT_OPTION[subject.provider]
    value = subject.config.get(option)
    app = subject.config.get("app_id") if subject.provider == "svix" else ""
    if not isinstance(value, str) or not value or not isinstance(app, str):
        raise CannotCheck(
            None,
            f"source {subject.public_id} names no {subject.provider} endpoint: webhooks sources"
            f" update {subject.name} {_EXAMPLE[subject.provider]}",
        )
    return f"{app}/{value}" if subject.provider == "svix" else value


def _call(settings: Settings, subject: Subject, enable: bool) -> judge.View:
    if subject.api_key is None:
        raise CannotCheck(
            None,
            f"source {subject.public_id} has no API credential: webhooks sources update "
            f"{subject.name} --api-key KEY",
        )
    endpoint = _endpoint(subject)
    reader = _READERS[subject.provider][1 if enable else 0]
    if reader is None:
        raise CannotCheck(None, NO_FIX[subject.provider])
    return reader(
        subject.api_key,
        options.base_of(subject.provider, subject.config),
        endpoint,
        allow_private=options.private_allowed(subject.config),
        timeout=settings.watch_timeout.total_seconds(),
    )


def check(
    settings: Settings, sessions: sessionmaker[Session], box: SecretBox, ref: str, *, via: str
) -> Checked:
    """Read, judge and record one source's endpoint. WatchError before anything is asked or
    written; a provider that does not say is a ``cannot_check`` finding, never an error."""
    with sessions() as session:
        subject = load_subject(session, box, ref)
    url = judge.expected_url(subject.config, settings.public_base_url, subject.public_id)
    view: judge.View | None = None
    try:
        view = _call(settings, subject, enable=False)
    except CannotCheck as exc:
        found = [judge.Finding(judge.CANNOT_CHECK, str(exc))]
        log.warning("watchdog.cannot_check", source=subject.public_id, status=exc.status)
    else:
        found = judge.judge(subject.provider, view, url, subject.globs)
    return _record(sessions, subject, view, found, url, via)


def _record(
    sessions: sessionmaker[Session],
    subject: Subject,
    view: judge.View | None,
    found: list[judge.Finding],
    url: str | None,
    via: str,
) -> Checked:
    with sessions() as session, session.begin():
        if view is not None:
            session.execute(
                text(
                    "UPDATE sources SET watch_view = CAST(:v AS jsonb)"
                    " || jsonb_build_object('checked_at', now()) WHERE id = :s"
                ),
                {"v": _json(view.stored()), "s": subject.id},
            )
        recorded = record(
            session, subject.id, subject.public_id, found, answered=view is not None, via=via
        )
    for kind in recorded.opened:
        log.warning("watchdog.finding_opened", source=subject.public_id, kind=kind)
    for kind in recorded.closed:
        log.info("watchdog.finding_closed", source=subject.public_id, kind=kind)
    return Checked(subject.public_id, subject.name, subject.provider, view, found, recorded, url)


def _json(value: Any) -> str:
    return orjson.dumps(value).decode()


@dataclass(frozen=True)
class Fixed:
    before: Checked
    called: bool  # the provider's API was asked to re-enable
    after: Checked | None


def fix_refusal(sessions: sessionmaker[Session], ref: str) -> str | None:
    """Why ``--fix`` cannot help the source's provider (one line), or None."""
    with sessions() as session:
        return NO_FIX.get(catalog.get_source(session, ref).provider)


def fixable(checked: Checked) -> bool:
    """Only a disabled (inactive) endpoint is re-enabled (Stripe, GitHub, Svix): never
    created, deleted or re-pointed."""
    return any(f.kind == judge.DISABLED for f in checked.found)


def enable(
    settings: Settings,
    sessions: sessionmaker[Session],
    box: SecretBox,
    ref: str,
    *,
    operator: str,
    reason: str,
) -> Checked:
    """Re-enable the source's endpoint at its provider (one call), audited, then record
    what the provider answered (the finding closes when it is enabled again). CannotCheck
    when the call failed (audited too: it was asked)."""
    with sessions() as session:
        subject = load_subject(session, box, ref)
    url = judge.expected_url(subject.config, settings.public_base_url, subject.public_id)
    error: CannotCheck | None = None
    view: judge.View | None = None
    try:
        view = _call(settings, subject, enable=True)
    except CannotCheck as exc:
        error = exc
    with sessions() as session, session.begin():
        catalog.audit_config(
            session,
            "subscription.enable",
            {
                "source": subject.public_id,
                "provider": subject.provider,
                "endpoint": subject.config.get(judge.ENDPOINT_OPTION[subject.provider]),
                "result": "failed" if error is not None else (view.status if view else None),
            },
            operator,
            reason,
        )
    log.info(
        "watchdog.enable_requested",
        source=subject.public_id,
        failed=error is not None,
    )
    if error is not None:
        raise error
    assert view is not None
    found = judge.judge(subject.provider, view, url, subject.globs)
    return _record(sessions, subject, view, found, url, "cli")


def refresh_gauge(session: Session) -> None:
    """``webhooks_subscription_findings`` from the table: 1 per open finding, 0 once closed."""
    for source, kind, is_open in gauge_rows(session):
        metrics.SUBSCRIPTION_FINDINGS.labels(source, kind).set(1 if is_open else 0)
