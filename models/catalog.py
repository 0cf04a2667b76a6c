"""Sources, their secrets and their routes: creation, rotation, revocation."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Engine, select, update
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from models.schema import PROVIDERS, Route, Source, SourceSecret
from webhooks.crypto import SecretBox, generate_secret, public_id
from webhooks.logs import get_logger
from webhooks.metrics import SOURCES_TTL_RAISED
from webhooks.settings import Settings
from webhooks.ttl import EffectiveTtl, TtlOverrides, derive_ttl, effective_ttl

log = get_logger("catalog")


class CatalogError(ValueError):
    """Bad input for a source, secret or route; nothing was changed."""


@dataclass(frozen=True)
class CreatedSecret:
    id: str
    plaintext: str | None  # only set when we generated it (printed once, never stored in clear)


def glob_to_like(pattern: str) -> str:
    """``invoice.*`` -> ``invoice.%`` (``?`` -> ``_``; LIKE's own metacharacters escaped)."""
    out = []
    for ch in pattern:
        if ch == "*":
            out.append("%")
        elif ch == "?":
            out.append("_")
        elif ch in "%_\\":
            out.append("\\" + ch)
        else:
            out.append(ch)
    return "".join(out)


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


def _seconds(value: timedelta | None) -> int | None:
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
) -> tuple[Source, CreatedSecret]:
    from ingest.providers import validate_config  # noqa: PLC0415

    if provider not in PROVIDERS:
        raise CatalogError(f"unknown provider {provider!r}; one of {', '.join(PROVIDERS)}")
    if not name.strip():
        raise CatalogError("source name must not be empty")
    if max_body_bytes is not None and max_body_bytes < 1:
        raise CatalogError("max body bytes must be positive")
    normalised = validate_config(provider, config or {})
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
        tolerance_s=_seconds(tolerance),
        max_body_bytes=max_body_bytes,
        retry_window_s=_seconds(overrides.retry_window),
        queue_lag_s=_seconds(overrides.queue_lag),
        clock_skew_s=_seconds(overrides.clock_skew),
        replay_grace_s=_seconds(overrides.replay_grace),
    )
    session.add(source)
    session.flush()
    created = add_secret(session, box, source, secret)
    return source, created


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
    skipped: the process starts anyway, and reports again at its next start."""
    try:
        with Session(engine) as session:
            rows = list(session.scalars(select(Source).order_by(Source.id)))
            found = [(s, source_effective_ttl(s, settings)) for s in rows]
    except OperationalError as exc:
        log.warning("sources.ttl_check_skipped", process=process, error_class=type(exc).__name__)
        return 0
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
    source.retry_window_s = _seconds(merged.retry_window)
    source.queue_lag_s = _seconds(merged.queue_lag)
    source.clock_skew_s = _seconds(merged.clock_skew)
    source.replay_grace_s = _seconds(merged.replay_grace)


def add_secret(
    session: Session, box: SecretBox, source: Source, secret: str | None = None
) -> CreatedSecret:
    generated = secret is None
    plaintext = generate_secret(source.provider) if secret is None else secret
    if not plaintext.strip():
        raise CatalogError("secret must not be empty")
    if source.provider in ("standard", "svix"):
        _check_whsec(plaintext)
    row = SourceSecret(id=public_id("sec"), source_id=source.id, ciphertext=box.encrypt(plaintext))
    session.add(row)
    session.flush()
    return CreatedSecret(row.id, plaintext if generated else None)


def _check_whsec(secret: str) -> None:
    import base64  # noqa: PLC0415
    import binascii  # noqa: PLC0415

    try:
        base64.b64decode(secret.removeprefix("whsec_"), validate=True)
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


def revoke_secret(session: Session, source: Source, secret_id: str, *, now: datetime) -> None:
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


def add_route(
    session: Session,
    box: SecretBox,
    source: Source,
    *,
    handler: str,
    events: str = "*",
    options: dict[str, str] | None = None,
    max_attempts: int | None = None,
    max_age: timedelta | None = None,
) -> tuple[Route, str | None]:
    """Bind a handler. ``forward`` routes get their own signing secret (returned once)."""
    if not handler.strip():
        raise CatalogError("handler name must not be empty")
    if not events.strip():
        raise CatalogError("event pattern must not be empty")
    if max_attempts is not None and max_attempts < 1:
        raise CatalogError("max attempts must be at least 1")
    opts = dict(options or {})
    signing_plain: str | None = None
    signing_ct: bytes | None = None
    if handler == "forward":
        url = opts.get("url", "")
        if not url.startswith(("http://", "https://")):
            raise CatalogError("the forward handler needs --option url=http(s)://...")
        signing_plain = opts.pop("secret", None) or generate_secret("standard")
        _check_whsec(signing_plain)
        signing_ct = box.encrypt(signing_plain)
    route = Route(
        source_id=source.id,
        handler=handler,
        events_glob=events,
        events_like=glob_to_like(events),
        options=opts,
        signing_ciphertext=signing_ct,
        max_attempts=max_attempts,
        max_age_s=_seconds(max_age),
    )
    session.add(route)
    session.flush()
    return route, signing_plain


def list_routes(session: Session, source: Source) -> list[Route]:
    return list(
        session.scalars(select(Route).where(Route.source_id == source.id).order_by(Route.id))
    )
