"""Sources and their secrets: creation, rotation, revocation, TTLs, enabling and disabling;
the audit trail of configuration changes. Routes: :mod:`models.route_catalog`."""

from __future__ import annotations

import base64
import binascii
import getpass
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Engine, func, select, update
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from core.crypto import (
    SecretBox,
    check_key,
    check_keys,
    generate_secret,
    key_format,
    key_prefix,
    public_id,
    source_secret_place,
)
from core.logs import get_logger
from core.settings import Settings
from core.states import UNFINISHED
from core.ttl import (
    EffectiveTtl,
    TtlConfigError,
    TtlOverrides,
    derive_ttl,
    effective_ttl,
    known_providers,
    unknown_provider,
)
from models.schema import (
    AuditEntry,
    Delivery,
    Route,
    Source,
    SourceSecret,
)
from models.views import (
    CatalogError,
    glob_to_like,
)

# Defined in models.views (no database library: the CLI's fast reads build them too),
# importable from here, where they were first defined.
__all__ = [
    "CatalogError",
    "glob_to_like",
]


log = get_logger("catalog")


#: ``(provider, options) -> normalised options`` (ValueError naming a bad option). Storage does
#: not know providers' options: the CLI passes ``core.providers.validate_config``.
ConfigValidator = Callable[[str, Mapping[str, Any]], dict[str, Any]]


# Secret strength (checked before anything is written). Providers whose secret format is whsec
# (Standard Webhooks, Svix and the senders using them) take secrets that are
# ``whsec_`` + base64 of the key: their libraries generate 24 to 32 random bytes; so does any
# ``whsec_`` key of another provider (GitLab's signing token), Stripe's aside. Other
# providers' secrets are used as given (the HMAC key is the string itself): at least 16
# characters, unless the operator says the sender dictates a shorter one (audited).
MIN_WHSEC_BYTES = 24
MIN_SECRET_CHARS = 16
WEAK_SECRET_ACTION = "weak_secret"  # noqa: S105 (an audit action, not a secret)
REVOKE_ACTION = "secret.revoke"  # noqa: S105 (an audit action, not a secret)
REVOKE_REASON = "secret revoked"  # noqa: S105 (the audit's reason when none is given)
WEAK_SECRET_REASON = "weak secret allowed"  # noqa: S105


@dataclass(frozen=True)
class CreatedSecret:
    id: str
    plaintext: str | None  # only set when we generated it (printed once, never stored in clear)


def get_source(session: Session, ref: str) -> Source:
    """Find a source by public id, or by name when the name is unambiguous."""
    found = session.scalars(select(Source).where(Source.public_id == ref)).first()
    if found is not None:
        return found
    by_name = session.scalars(select(Source).where(Source.name == ref)).all()
    if len(by_name) == 1:
        return by_name[0]
    if len(by_name) > 1:
        raise CatalogError(f"source name {ref!r} is ambiguous; use the source id")
    raise CatalogError(f"no such source: {ref!r}")


def whole_seconds(value: timedelta | None) -> int | None:
    return None if value is None else int(value.total_seconds())


def create_source(
    session: Session,
    box: SecretBox,
    settings: Settings,
    *,
    name: str,
    provider: str,
    account: str = "default",
    secret: str | None = None,
    config: dict[str, Any] | None = None,
    tolerance: timedelta | None = None,
    max_body_bytes: int | None = None,
    ttl: TtlOverrides | None = None,
    allow_weak_secret: bool = False,
    operator: str | None = None,
    validate_config: ConfigValidator | None = None,
    via: str = "cli",
) -> tuple[Source, CreatedSecret]:
    """Create a source with one secret (generated when ``secret`` is None). A given secret
    below the minimum strength is refused before anything is written; ``allow_weak_secret``
    lets a short non-whsec secret through with an ``audit_log`` row (``operator``: who).
    Provider options are stored as ``validate_config`` returns them; without a validator a
    source can only be created without options (the provider's defaults apply)."""
    known = known_providers()
    if provider not in known:
        raise CatalogError(unknown_provider(provider))
    if not name.strip():
        raise CatalogError("source name must not be empty")
    if secret is not None:
        check_secret_strength(provider, secret, allow_weak=allow_weak_secret)
    if max_body_bytes is not None and max_body_bytes < 1:
        raise CatalogError("max body bytes must be positive")
    if validate_config is not None:
        normalised = validate_config(provider, config or {})
    elif config:
        raise CatalogError(
            "provider options need validating against the provider: pass validate_config "
            "(core.providers.validate_config)"
        )
    else:
        normalised = {}
    overrides = ttl or TtlOverrides()
    derive_ttl(provider, overrides, settings, source_name=name)  # refuses a too-short TTL
    exists = session.scalars(
        select(Source.id).where(Source.account == account, Source.name == name)
    ).first()
    if exists is not None:
        raise CatalogError(f"account {account!r} already has a source named {name!r}")
    source = Source(
        public_id=public_id("src"),
        account=account,
        name=name,
        provider=provider,
        config=normalised,
        tolerance_s=whole_seconds(tolerance),
        max_body_bytes=max_body_bytes,
        retry_window_s=whole_seconds(overrides.retry_window),
        queue_lag_s=whole_seconds(overrides.queue_lag),
        clock_skew_s=whole_seconds(overrides.clock_skew),
        replay_grace_s=whole_seconds(overrides.replay_grace),
    )
    session.add(source)
    session.flush()
    created = add_secret(
        session,
        box,
        source,
        secret,
        allow_weak_secret=allow_weak_secret,
        operator=operator,
        audit=False,
    )
    target = {
        "source": source.public_id,
        "name": name,
        "account": account,
        "provider": provider,
        "secret": created.id,
    }
    audit_config(session, "source.add", target, operator, "source added", via=via)
    return source, created


def audit_config(
    session: Session,
    action: str,
    target: dict[str, Any],
    operator: str | None,
    reason: str,
    *,
    via: str = "cli",
) -> int:
    """The audit row of a configuration change (every one is audited): who (``operator``,
    default this process's login name: the OS user for the CLI), what, through what
    (``via``: cli or console), on the database's clock, in the change's own transaction."""
    change = Change(operator=(operator or "").strip() or login_name(), reason=reason, via=via)
    return record_audit(session, change, action, target, count=1, now=None)


#: How many stored secrets of each kind the start-up key check reads (newest first).
KEY_SAMPLE = 200


def check_stored_keys(session: Session, box: SecretBox, *, sample: int = KEY_SAMPLE) -> int:
    """Check that ``box`` (``WEBHOOKS_SECRET_KEY``) decrypts the stored secrets: the newest
    ``sample`` active source secrets, route signing secrets and reconciliation credentials
    (each kind). Returns how many were checked;
    :class:`core.crypto.KeyMismatch` naming the count it cannot read otherwise. Run at
    the start of the receiver, ``webhooks run`` and the CLI."""
    sources = session.scalars(
        select(SourceSecret.ciphertext)
        .where(SourceSecret.revoked_at.is_(None))
        .order_by(SourceSecret.created_at.desc())
        .limit(sample)
    ).all()
    routes = session.scalars(
        select(Route.signing_ciphertext)
        .where(Route.signing_ciphertext.is_not(None))
        .order_by(Route.id.desc())
        .limit(sample)
    ).all()
    credentials = session.scalars(
        select(Source.reconcile_ciphertext)
        .where(Source.reconcile_ciphertext.is_not(None))
        .order_by(Source.id.desc())
        .limit(sample)
    ).all()
    return check_keys(box, [bytes(c) for c in [*sources, *routes, *credentials] if c is not None])


def source_ttl_overrides(source: Source) -> TtlOverrides:
    return TtlOverrides.from_seconds(
        source.retry_window_s, source.queue_lag_s, source.clock_skew_s, source.replay_grace_s
    )


def source_effective_ttl(source: Source, settings: Settings) -> EffectiveTtl:
    return effective_ttl(
        source.provider, source_ttl_overrides(source), settings, source_name=source.name
    )


def report_raised_ttls(engine: Engine, settings: Settings, *, process: str) -> int:
    """Run at the start of every process (receiver, worker, beat): one warning per source
    whose dedup TTL no longer covers its provider's retry window (its receipts are written
    with the raised, minimum safe TTL instead), and the gauge
    ``webhooks_sources_ttl_raised``. Returns how many. An unreachable database is logged and
    skipped: the process starts anyway, and reports again at its next start. A source whose
    provider is not installed here (a plug-in removed) gets one warning and does not stop
    the process: its other sources still work."""
    try:
        with Session(engine) as session:
            rows = list(session.scalars(select(Source).order_by(Source.id)))
    except OperationalError as exc:
        log.warning("sources.ttl_check_skipped", process=process, error_class=type(exc).__name__)
        return 0
    found = []
    for source in rows:
        try:
            found.append((source, source_effective_ttl(source, settings)))
        except TtlConfigError as exc:
            if exc.reason != "unknown_provider":
                raise
            log.warning(
                "source.provider_unknown",
                process=process,
                source=source.public_id,
                provider=source.provider,
                fix="install the package that provides it (webhooks providers list), "
                f"or webhooks sources disable {source.public_id}",
            )
    raised = [(s, ttl) for s, ttl in found if ttl.raised]
    for source, ttl in raised:
        log.warning(
            "source.ttl_raised",
            process=process,
            source=source.public_id,
            provider=source.provider,
            detail=ttl.warning(),
            fix=f"webhooks ttl explain {source.public_id}, then webhooks sources update",
        )
    # Only processes that serve metrics call this; the CLI's commands do not load prometheus.
    from core.metrics import SOURCES_TTL_RAISED  # noqa: PLC0415 (prometheus_client, ~50 ms of each CLI run that reads the catalog)

    SOURCES_TTL_RAISED.set(len(raised))
    return len(raised)


def update_source_ttl(
    session: Session, settings: Settings, source: Source, changes: TtlOverrides
) -> None:
    """Apply the given TTL term overrides (None leaves a term unchanged); refuse a short TTL."""
    merged = source_ttl_overrides(source)
    merged = TtlOverrides(
        retry_window=changes.retry_window or merged.retry_window,
        queue_lag=changes.queue_lag if changes.queue_lag is not None else merged.queue_lag,
        clock_skew=changes.clock_skew if changes.clock_skew is not None else merged.clock_skew,
        replay_grace=changes.replay_grace
        if changes.replay_grace is not None
        else merged.replay_grace,
    )
    derive_ttl(source.provider, merged, settings, source_name=source.name)
    source.retry_window_s = whole_seconds(merged.retry_window)
    source.queue_lag_s = whole_seconds(merged.queue_lag)
    source.clock_skew_s = whole_seconds(merged.clock_skew)
    source.replay_grace_s = whole_seconds(merged.replay_grace)


def record_source_update(
    session: Session, source: Source, changed: Mapping[str, Any], operator: str | None
) -> int:
    """The audit row of ``sources update``: which settings changed, to what."""
    target = {"source": source.public_id, "name": source.name, "changed": dict(changed)}
    return audit_config(session, "source.update", target, operator, "source updated")


def add_secret(
    session: Session,
    box: SecretBox,
    source: Source,
    secret: str | None = None,
    *,
    allow_weak_secret: bool = False,
    operator: str | None = None,
    audit: bool = True,
) -> CreatedSecret:
    """Add a secret to a source (generated when ``secret`` is None). A given secret below the
    minimum strength is refused before anything is written (see :func:`check_secret_strength`);
    a weak one let through by ``allow_weak_secret`` gets an ``audit_log`` row (action
    ``weak_secret``, ``operator``: who, default this process's login name)."""
    generated = secret is None
    try:
        plaintext = generate_secret(source.provider) if secret is None else secret
    except ValueError as exc:  # a public-key provider: the key must be given
        raise CatalogError(str(exc)) from None
    weak = check_secret_strength(source.provider, plaintext, allow_weak=allow_weak_secret)
    secret_id = public_id("sec")
    row = SourceSecret(
        id=secret_id,
        source_id=source.id,
        ciphertext=box.seal(plaintext, source_secret_place(secret_id)),
    )
    session.add(row)
    session.flush()
    if weak:
        change = Change(operator=operator or login_name(), reason=WEAK_SECRET_REASON, via="cli")
        target = {"source": source.public_id, "provider": source.provider, "secret": row.id}
        record_audit(session, change, WEAK_SECRET_ACTION, target, count=1, now=None)
        log.warning(
            "secret.weak_allowed",
            source=source.public_id,
            provider=source.provider,
            secret_id=row.id,
        )
    if audit:  # create_source audits the source with its first secret
        target = {"source": source.public_id, "provider": source.provider, "secret": row.id}
        audit_config(session, "secret.add", target, operator, "secret added")
    return CreatedSecret(row.id, plaintext if generated else None)


def check_secret_strength(provider: str, secret: str, *, allow_weak: bool = False) -> bool:
    """Refuse (CatalogError) a secret too weak for ``provider``; True when it is weak but
    ``allow_weak`` lets it through (the caller audits that), False when it is strong enough.

    Providers whose secret format is ``whsec`` (Standard Webhooks, Svix, ...), and any
    ``whsec_`` key of another provider (GitLab's signing token) but Stripe's: ``whsec_`` +
    base64 decoding to at least :data:`MIN_WHSEC_BYTES` bytes, always. Other secrets: at least
    :data:`MIN_SECRET_CHARS` characters, unless ``allow_weak``."""
    if not secret.strip():
        raise CatalogError("secret must not be empty")
    try:
        check_key(provider, secret)  # the provider's key format (public keys, hex keys)
    except ValueError as exc:
        raise CatalogError(str(exc)) from None
    if _is_whsec(provider, secret):
        key = check_whsec(secret)
        if len(key) < MIN_WHSEC_BYTES:
            raise CatalogError(
                f"a {provider} secret must decode to at least {MIN_WHSEC_BYTES} bytes "
                f"(whsec_ + base64 of {MIN_WHSEC_BYTES} to 32 random bytes); this one decodes "
                f"to {len(key)}: omit --secret to have one generated"
            )
        return False
    if len(secret) >= MIN_SECRET_CHARS:
        return False
    if allow_weak:
        return True
    raise CatalogError(
        f"a {provider} secret must be at least {MIN_SECRET_CHARS} characters (this one has "
        f"{len(secret)}): omit --secret to have one generated, or, if the sender dictates "
        "this secret, pass --allow-weak-secret (recorded in the audit trail)"
    )


def _is_whsec(provider: str, secret: str) -> bool:
    """Judged as a Standard Webhooks key (whsec_ + base64 of 24+ bytes): the provider's format
    says so, or the key looks like one whatever the format (GitLab's is ``text``, and its
    signing token is a whsec_ key), unless the provider's own keys are whsec_-prefixed text
    (Stripe: the whole string is the HMAC key)."""
    if key_format(provider) == "whsec":
        return True
    return secret.startswith("whsec_") and key_prefix(provider) != "whsec_"


def login_name() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # a container user without a passwd entry or $USER
        return "unknown"


def check_whsec(secret: str) -> bytes:
    """The key a ``whsec_`` + base64 secret decodes to; CatalogError if it is not base64."""
    try:
        return base64.b64decode(secret.removeprefix("whsec_"), validate=True)
    except (binascii.Error, ValueError):
        raise CatalogError("a Standard Webhooks / Svix secret is whsec_ + base64") from None


def list_secrets(session: Session, source: Source) -> list[SourceSecret]:
    return list(
        session.scalars(
            select(SourceSecret)
            .where(SourceSecret.source_id == source.id)
            .order_by(SourceSecret.created_at)
        )
    )


def revoke_secret(
    session: Session,
    source: Source,
    secret_id: str,
    *,
    now: datetime,
    operator: str | None = None,
    reason: str | None = None,
) -> int:
    """Revoke one active secret and record who did it, which secret and when: an
    ``audit_log`` row (action ``secret.revoke``) in the same transaction, so the revocation
    and its record commit together. Returns the audit row's id. A revocation is often urgent
    (a leak), so a reason is optional (:data:`REVOKE_REASON` when none is given);
    ``operator`` defaults to this process's login name."""
    result = session.execute(
        update(SourceSecret)
        .where(
            SourceSecret.id == secret_id,
            SourceSecret.source_id == source.id,
            SourceSecret.revoked_at.is_(None),
        )
        .values(revoked_at=now)
    )
    if result.rowcount == 0:  # type: ignore[attr-defined]
        raise CatalogError(f"no active secret {secret_id!r} on source {source.public_id}")
    # Receivers may still hold the secret in their cache; the receipt transaction re-checks
    # that the matching secret is unrevoked, so revocation takes effect at once everywhere.
    change = Change(
        operator=(operator or "").strip() or login_name(),
        reason=(reason or "").strip() or REVOKE_REASON,
        via="cli",
    )
    target = {"source": source.public_id, "provider": source.provider, "secret": secret_id}
    return record_audit(session, change, REVOKE_ACTION, target, count=1, now=now)


# Lifecycle (a source's here, a route's in models.route_catalog): disable, enable, remove; each
# one guarded statement and one audit_log row in the caller's transaction, so the change and
# its record commit together.


@dataclass(frozen=True)
class Change:
    """Who makes an operator change, why, and through what (recorded in ``audit_log``)."""

    operator: str
    reason: str
    via: str = "cli"

    def check(self) -> None:
        if not self.reason.strip():
            raise CatalogError("--reason is required: it is recorded in the audit trail")
        if not self.operator.strip():
            raise CatalogError("an operator name is required (--operator)")


@dataclass(frozen=True)
class Changed:
    """What a lifecycle change did: its audit row, its target, and the deliveries of the
    target that were not finished at that moment."""

    audit_id: int
    target: dict[str, Any]
    unfinished: int


def record_audit(
    session: Session,
    change: Change,
    action: str,
    target: dict[str, Any],
    *,
    count: int,
    now: datetime | None,
) -> int:
    """One ``audit_log`` row; ``now`` None: the database's clock."""
    entry = AuditEntry(
        at=now if now is not None else func.now(),
        operator=change.operator.strip(),
        action=action,
        target=target,
        reason=change.reason.strip(),
        count=count,
        via=change.via,
    )
    session.add(entry)
    session.flush()
    return int(entry.id)


# Console logins (issue 34 item 5): who logged in from where, and every refused token.
LOGIN_ACTION = "login"
LOGIN_FAILED_ACTION = "login.failed"
NO_OPERATOR = "anonymous"  # a refused login's operator: the token matched no name


def record_login(session: Session, *, operator: str | None, client: str, via: str) -> int:
    """The ``audit_log`` row of a console login: ``operator`` the name of the admin token
    that matched, or None for a refused token (action ``login.failed``). The target is the
    client's address (and the token's name); never the token, right or wrong: a wrong one is
    often a typo of the right one."""
    if operator is None:
        change = Change(NO_OPERATOR, "wrong token", via=via)
        return record_audit(
            session, change, LOGIN_FAILED_ACTION, {"client": client}, count=1, now=None
        )
    change = Change(operator, "logged in", via=via)
    target = {"client": client, "token_name": operator}
    return record_audit(session, change, LOGIN_ACTION, target, count=1, now=None)


def count_unfinished(session: Session, *where: Any) -> int:
    return int(
        session.scalar(select(func.count()).where(Delivery.status.in_(UNFINISHED), *where)) or 0
    )


def set_source_active(
    session: Session, source: Source, active: bool, change: Change, *, now: datetime | None
) -> Changed:
    """Disable a source (its URL answers 410 Gone and writes nothing) or enable it again.
    Deliveries it already accepted are not touched: they run as before."""
    change.check()
    moved = session.execute(
        update(Source)
        .where(Source.id == source.id, Source.active.is_not(active))
        .values(active=active)
        .returning(Source.id)
    ).first()
    if moved is None:
        state = "enabled" if active else "disabled"
        raise CatalogError(f"source {source.public_id} is already {state}")
    target = {"source": source.public_id, "name": source.name, "provider": source.provider}
    unfinished = count_unfinished(session, Delivery.source_id == source.id)
    action = "source.enable" if active else "source.disable"
    audit_id = record_audit(session, change, action, target, count=1, now=now)
    return Changed(audit_id, target, unfinished)


@dataclass(frozen=True)
class AuditRecord:
    """An ``audit_log`` row as operators read it."""

    id: int
    at: datetime
    operator: str
    action: str
    target: dict[str, Any]
    reason: str
    count: int
    via: str


def list_audit(
    session: Session, *, limit: int = 20, action: str | None = None
) -> list[AuditRecord]:
    """Most recent first; ``action`` is a prefix (``route``, ``source.disable``)."""
    query = select(AuditEntry).order_by(AuditEntry.at.desc(), AuditEntry.id.desc()).limit(limit)
    if action is not None:
        query = query.where(AuditEntry.action.startswith(action, autoescape=True))
    return [
        AuditRecord(e.id, e.at, e.operator, e.action, e.target, e.reason, e.count, e.via)
        for e in session.scalars(query)
    ]
