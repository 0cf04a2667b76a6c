"""The database schema (SQLAlchemy 2 declarative models).

receipts, deliveries and attempts are range-partitioned by ``expires_at`` (daily partitions
created and dropped by maintenance; in ``delete`` retention mode a single DEFAULT partition
holds everything and expiry is a batched delete). Partitioned tables cannot carry foreign
keys to each other cheaply, so deliveries and attempts repeat ``expires_at`` and are written
only by the statements in :mod:`models.sql`, which keep them consistent.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    CHAR,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    ForeignKey,
    Identity,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    Sequence,
    Text,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from core.states import DeliveryStatus

PARTITIONED_TABLES = ("receipts", "deliveries", "attempts")
# Partitioned by month on received_at (models/ledger_layout.py), apart from the daily three.
LEDGER_TABLE = "ledger"
ARRIVED_VIA = ("webhook", "reconcile", "test")
ARRIVED_VIA_DEFAULT = (
    "coalesce(nullif(current_setting('webhooks.arrived_via', true), ''), 'webhook')"
)

NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)
    type_annotation_map = {
        datetime: DateTime(timezone=True),
        dict[str, Any]: JSONB,
    }


def _in(column: str, values: tuple[str, ...]) -> str:
    quoted = ", ".join(f"'{v}'" for v in values)  # a member's str is its value, unlike its repr
    return f"{column} IN ({quoted})"


class Source(Base):
    """One integration of one account with one provider: the dedup scope."""

    __tablename__ = "sources"
    __table_args__ = (
        UniqueConstraint("account", "name"),
        # No CHECK on provider: providers come from a registry that plug-ins extend (0008).
        CheckConstraint(
            "reconcile_every_s IS NULL OR reconcile_every_s >= 60", name="reconcile_every"
        ),
    )

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    public_id: Mapped[str] = mapped_column(Text, unique=True)
    account: Mapped[str] = mapped_column(Text, server_default="default")
    name: Mapped[str] = mapped_column(Text)
    provider: Mapped[str] = mapped_column(Text)
    # Provider options: generic HMAC header/algorithm/encoding, field paths, ...
    config: Mapped[dict[str, Any]] = mapped_column(server_default=text("'{}'::jsonb"))
    tolerance_s: Mapped[int | None] = mapped_column(Integer)
    max_body_bytes: Mapped[int | None] = mapped_column(Integer)
    # Dedup TTL term overrides in seconds (NULL: provider / global default).
    retry_window_s: Mapped[int | None] = mapped_column(BigInteger)
    queue_lag_s: Mapped[int | None] = mapped_column(BigInteger)
    clock_skew_s: Mapped[int | None] = mapped_column(BigInteger)
    replay_grace_s: Mapped[int | None] = mapped_column(BigInteger)
    # A disabled source answers 410 Gone and writes nothing; what it accepted still runs.
    active: Mapped[bool] = mapped_column(Boolean, server_default=text("true"))
    created_at: Mapped[datetime] = mapped_column(server_default=func.now())
    # Reconciliation (tasks.reconcile, migration 0016): the provider API credential,
    # encrypted like the secrets (NULL: none); beat's schedule (NULL: off) and its last run.
    reconcile_ciphertext: Mapped[bytes | None] = mapped_column(LargeBinary)
    reconcile_every_s: Mapped[int | None] = mapped_column(BigInteger)
    reconciled_at: Mapped[datetime | None] = mapped_column()
    # The subscription watchdog (tasks.watchdog, migration 0030): its last scheduled check
    # (claimed on the database's clock) and the provider's view of the endpoint then.
    watched_at: Mapped[datetime | None] = mapped_column()
    watch_view: Mapped[dict[str, Any] | None] = mapped_column()


# What the watchdog finds wrong with a source's endpoint at its provider (core.watchdog).
FINDING_KINDS = ("disabled", "deleted", "url_mismatch", "events_missing", "cannot_check")


class SubscriptionFinding(Base):
    """One finding of the subscription watchdog (issue 38 item 1): opened once, closed when
    the provider's view is back to normal, both on the database's clock."""

    __tablename__ = "subscription_findings"
    __table_args__ = (
        CheckConstraint(
            "kind IN (" + ", ".join(f"'{k}'" for k in FINDING_KINDS) + ")", name="kind"
        ),
        Index(
            "ix_subscription_findings_open",
            "source_id",
            "kind",
            unique=True,
            postgresql_where=text("closed_at IS NULL"),
        ),
    )

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    source_id: Mapped[int] = mapped_column(ForeignKey("sources.id", ondelete="CASCADE"))
    kind: Mapped[str] = mapped_column(Text)
    detail: Mapped[str] = mapped_column(Text)
    opened_at: Mapped[datetime] = mapped_column(server_default=func.now())
    closed_at: Mapped[datetime | None] = mapped_column()


class SourceSecret(Base):
    __tablename__ = "source_secrets"
    __table_args__ = (Index(None, "source_id", postgresql_where=text("revoked_at IS NULL")),)

    id: Mapped[str] = mapped_column(Text, primary_key=True)
    source_id: Mapped[int] = mapped_column(ForeignKey("sources.id", ondelete="CASCADE"))
    ciphertext: Mapped[bytes] = mapped_column(LargeBinary)
    created_at: Mapped[datetime] = mapped_column(server_default=func.now())
    revoked_at: Mapped[datetime | None] = mapped_column()


class Route(Base):
    """Binds a handler to a source, optionally for matching event types only."""

    __tablename__ = "routes"
    __table_args__ = (
        CheckConstraint("breaker_state IN ('closed', 'open', 'half_open')", name="breaker_state"),
        CheckConstraint(
            "(max_in_flight IS NULL OR max_in_flight >= 1)"
            " AND ((rate_count IS NULL AND rate_period_s IS NULL)"
            " OR (rate_count >= 1 AND rate_period_s >= 1))",
            name="limits",
        ),
        CheckConstraint("lane_on_dead IN ('block', 'skip')", name="lane_on_dead"),
    )

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    source_id: Mapped[int] = mapped_column(ForeignKey("sources.id", ondelete="CASCADE"), index=True)
    handler: Mapped[str] = mapped_column(Text)
    events_glob: Mapped[str] = mapped_column(Text, server_default="*")
    # SQL LIKE form of events_glob, matched inside the receipt transaction.
    events_like: Mapped[str] = mapped_column(Text, server_default="%")
    options: Mapped[dict[str, Any]] = mapped_column(server_default=text("'{}'::jsonb"))
    # The route's own signing secret (forward signs with it), encrypted.
    signing_ciphertext: Mapped[bytes | None] = mapped_column(LargeBinary)
    max_attempts: Mapped[int | None] = mapped_column(Integer)
    max_age_s: Mapped[int | None] = mapped_column(BigInteger)
    active: Mapped[bool] = mapped_column(Boolean, server_default=text("true"))
    created_at: Mapped[datetime] = mapped_column(server_default=func.now())
    # Paused by hand (models/breaker.py): deliveries held, not attempted, until resumed.
    paused_at: Mapped[datetime | None] = mapped_column()
    pause_reason: Mapped[str | None] = mapped_column(Text)
    # The circuit breaker and its failure window (models/breaker.py, migration 0010).
    breaker_state: Mapped[str] = mapped_column(Text, server_default="closed")
    breaker_opened_at: Mapped[datetime | None] = mapped_column()
    breaker_probe_at: Mapped[datetime | None] = mapped_column()
    probe_delivery: Mapped[int | None] = mapped_column(BigInteger)
    breaker_trips: Mapped[int] = mapped_column(Integer, server_default="0")
    window_started_at: Mapped[datetime | None] = mapped_column()
    window_requests: Mapped[int] = mapped_column(Integer, server_default="0")
    window_failures: Mapped[int] = mapped_column(Integer, server_default="0")
    # Admission limits (models/admission.py, migration 0014): NULL max_in_flight is the
    # default budget (WEBHOOKS_ROUTE_MAX_IN_FLIGHT); NULL rate_count, no rate limit.
    max_in_flight: Mapped[int | None] = mapped_column(Integer)
    # When an operator last resumed the route (migration 0014): a delivery's max_age counts
    # from then at the earliest. A breaker's close no longer sets it (issue 34: an open
    # breaker never keeps a delivery alive past its max_age; models/route_ends.py); rows
    # written before keep the close they recorded.
    released_at: Mapped[datetime | None] = mapped_column()
    rate_count: Mapped[int | None] = mapped_column(Integer)
    rate_period_s: Mapped[int | None] = mapped_column(Integer)
    # When and why it was disabled (``active`` false; migration 0022): by the sweep for a
    # breaker open past WEBHOOKS_ROUTE_DISABLE_AFTER, or by an operator. NULL while active.
    disabled_at: Mapped[datetime | None] = mapped_column()
    disabled_reason: Mapped[str | None] = mapped_column(Text)
    # A JMESPath predicate over the event (core.filters, migration 0027); NULL: every event
    # of its types. Checked when saved (models.route_catalog.check_filter).
    filter: Mapped[str | None] = mapped_column(Text)
    # A registered transform's name (tasks.transforms, migration 0029); NULL: none. Checked
    # against the registry when saved (webhooks routes add|update --transform).
    transform: Mapped[str | None] = mapped_column(Text)
    # Ordered lanes (migration 0028, models/lanes.py): a JMESPath expression whose value on
    # an event is its delivery's lane key; NULL: unordered. ``lane_on_dead``: whether a dead
    # delivery holds its lane (block) or not (skip). ``supersede``: an event older than the
    # newest one of its key already succeeded here is recorded superseded, not run.
    order_key: Mapped[str | None] = mapped_column(Text)
    lane_on_dead: Mapped[str] = mapped_column(Text, server_default="block")
    supersede: Mapped[bool] = mapped_column(Boolean, server_default=text("false"))


receipt_id_seq = Sequence("receipts_id_seq", metadata=Base.metadata)
delivery_id_seq = Sequence("deliveries_id_seq", metadata=Base.metadata)
attempt_id_seq = Sequence("attempts_id_seq", metadata=Base.metadata)


class Receipt(Base):
    """One accepted event per (scope, event_id): the durable dedup record."""

    __tablename__ = "receipts"
    __table_args__ = (
        PrimaryKeyConstraint("source_id", "event_id", "expires_at"),
        Index(None, "id"),
        Index(None, "received_at"),
        CheckConstraint("arrived_via IN ('webhook', 'reconcile', 'test')", name="arrived_via"),
        # Payload retention walks only the receipts that still hold a body.
        Index(
            "ix_receipts_payload_held",
            "received_at",
            "id",
            postgresql_where=text("payload IS NOT NULL"),
        ),
        {"postgresql_partition_by": "RANGE (expires_at)"},
    )

    id: Mapped[int] = mapped_column(
        BigInteger, receipt_id_seq, server_default=receipt_id_seq.next_value()
    )
    source_id: Mapped[int] = mapped_column(BigInteger)
    event_id: Mapped[str] = mapped_column(Text)
    expires_at: Mapped[datetime] = mapped_column()
    event_type: Mapped[str] = mapped_column(Text)
    occurred_at: Mapped[datetime | None] = mapped_column()
    received_at: Mapped[datetime] = mapped_column()
    # NULL for an event recovered from the provider's API (arrived_via reconcile): not the
    # body the provider signs, so it compares with nothing (a later webhook is a duplicate).
    body_digest: Mapped[bytes | None] = mapped_column(LargeBinary)
    content_type: Mapped[str | None] = mapped_column(Text)
    # webhook | reconcile | test: the column's default reads the setting webhooks.arrived_via,
    # which reconciliation and a verified `webhooks send` set (SET LOCAL in their accept
    # transaction; migrations 0017, 0024).
    arrived_via: Mapped[str] = mapped_column(Text, server_default=text(ARRIVED_VIA_DEFAULT))
    # The raw body, dropped after its retention (NULL afterwards; payload_dropped_at says when).
    payload: Mapped[bytes | None] = mapped_column(LargeBinary)
    payload_dropped_at: Mapped[datetime | None] = mapped_column()


class Delivery(Base):
    """One (receipt, route): the unit of work a worker claims."""

    __tablename__ = "deliveries"
    __table_args__ = (
        PrimaryKeyConstraint("id", "expires_at"),
        UniqueConstraint("receipt_id", "route_id", "expires_at"),
        CheckConstraint(_in("status", tuple(DeliveryStatus)), name="status"),
        CheckConstraint("crash_mark IN ('suspect', 'bystander')", name="crash_mark"),
        Index(
            "ix_deliveries_due",
            "next_attempt_at",
            postgresql_where=text("status IN ('pending', 'retrying', 'processing')"),
        ),
        Index(None, "status", "source_id", "route_id"),
        # Dead letters of each partition, found without a scan (retention holds them).
        Index("ix_deliveries_dead", "dead_at", postgresql_where=text("status = 'dead'")),
        # The console (0015): one source's deliveries in one state, index-only: the receipt
        # keys for the events list and the ids, in order, for the dead-letter preview.
        Index(
            "ix_deliveries_source_status", "source_id", "status", "id", "receipt_id", "expires_at"
        ),
        # The console (0016): one source's dead deliveries, newest first, index-only: the
        # events list by source and dead walks it and stops after a page (created_at is never
        # before the receipt's received_at: the accept functions write both from one
        # instant). Partial: the hot path's inserts and status changes never write it.
        Index(
            "ix_deliveries_source_dead",
            "source_id",
            "created_at",
            "receipt_id",
            "expires_at",
            postgresql_where=text("status = 'dead'"),
        ),
        # Lanes (0028, models/lanes.py): the unfinished deliveries of a route and key, in
        # order (the claim's probe for an earlier one), and the succeeded ones (supersede).
        Index(
            "ix_deliveries_lane",
            "route_id",
            "lane_key",
            "id",
            postgresql_where=text(
                "lane_key IS NOT NULL AND status IN ('pending', 'processing', 'retrying', 'dead')"
            ),
        ),
        Index(
            "ix_deliveries_lane_done",
            "route_id",
            "lane_key",
            postgresql_where=text("lane_key IS NOT NULL AND status = 'succeeded'"),
        ),
        {"postgresql_partition_by": "RANGE (expires_at)"},
    )

    id: Mapped[int] = mapped_column(
        BigInteger, delivery_id_seq, server_default=delivery_id_seq.next_value()
    )
    expires_at: Mapped[datetime] = mapped_column()
    receipt_id: Mapped[int] = mapped_column(BigInteger)
    source_id: Mapped[int] = mapped_column(BigInteger)
    route_id: Mapped[int] = mapped_column(BigInteger)
    status: Mapped[str] = mapped_column(Text, server_default=DeliveryStatus.PENDING.value)
    # The attempt number of the latest claim: the fencing token, so it only grows (a replay
    # or re-run continues it); attempt rows carry it as their number.
    attempts: Mapped[int] = mapped_column(Integer, server_default="0")
    # ``attempts`` when the delivery was last replayed or re-run: the retry policy counts the
    # attempts since then.
    attempt_base: Mapped[int] = mapped_column(Integer, server_default="0")
    # Times the lease ran out while processing (the worker died): dead after max_redeliveries.
    redeliveries: Mapped[int] = mapped_column(Integer, server_default="0")
    generation: Mapped[int] = mapped_column(Integer, server_default="0")
    # Times the sweeper re-published it since it was last claimed: a pending row re-published
    # twice is claimed through Postgres whatever its fast-claim key says (tasks.claims).
    republished: Mapped[int] = mapped_column(Integer, server_default="0")
    # Set by a worker's watchdog as it kills its own process over one stuck handler
    # (tasks.pools): "suspect" on that delivery, "bystander" on the others it was running.
    # The next claim counts a crash unless "bystander", and clears it.
    crash_mark: Mapped[str | None] = mapped_column(Text)
    lease_until: Mapped[datetime | None] = mapped_column()
    # pending: when the sweeper may re-publish; retrying: when the retry is due;
    # processing: equal to lease_until; NULL once finished (succeeded, dead, discarded).
    next_attempt_at: Mapped[datetime | None] = mapped_column()
    last_error_class: Mapped[str | None] = mapped_column(Text)
    last_error: Mapped[str | None] = mapped_column(Text)
    dead_reason: Mapped[str | None] = mapped_column(Text)
    # When it went dead: dead letters are kept for WEBHOOKS_DEAD_LETTER_RETENTION from then.
    dead_at: Mapped[datetime | None] = mapped_column()
    created_at: Mapped[datetime] = mapped_column()
    updated_at: Mapped[datetime] = mapped_column()
    first_attempt_at: Mapped[datetime | None] = mapped_column()
    succeeded_at: Mapped[datetime | None] = mapped_column()
    # What the handler returned on success, when a short text (0021): a duplicate's answer,
    # ``events show`` and the console show it.
    result_ref: Mapped[str | None] = mapped_column(Text)
    # The value of its route's order key on its event (0028): its lane; NULL: unordered.
    lane_key: Mapped[str | None] = mapped_column(Text)


class Attempt(Base):
    """One try of one delivery, for the operator."""

    __tablename__ = "attempts"
    __table_args__ = (
        PrimaryKeyConstraint("id", "expires_at"),
        Index(None, "delivery_id"),
        {"postgresql_partition_by": "RANGE (expires_at)"},
    )

    id: Mapped[int] = mapped_column(
        BigInteger, attempt_id_seq, server_default=attempt_id_seq.next_value()
    )
    expires_at: Mapped[datetime] = mapped_column()
    delivery_id: Mapped[int] = mapped_column(BigInteger)
    number: Mapped[int] = mapped_column(Integer)
    generation: Mapped[int] = mapped_column(Integer, server_default="0")
    worker: Mapped[str | None] = mapped_column(Text)
    started_at: Mapped[datetime] = mapped_column()
    ended_at: Mapped[datetime | None] = mapped_column()
    # When the outcome's statement ran (the database's clock_timestamp()): for a success,
    # committed_at - ended_at is how long the downstream's 2xx stood unrecorded (0020).
    committed_at: Mapped[datetime | None] = mapped_column()
    # succeeded | retry | dead | crashed (set by the claim that found the lease expired)
    outcome: Mapped[str | None] = mapped_column(Text)
    error_class: Mapped[str | None] = mapped_column(Text)
    error_message: Mapped[str | None] = mapped_column(Text)


class LaneMember(Base):
    """A laned delivery its lane waits on (0033, models/lanes.py): kept by triggers on
    deliveries; small and unpartitioned, so the lane's guard is an index probe."""

    __tablename__ = "lane_members"
    __table_args__ = (
        Index("ix_lane_members_lane", "route_id", "lane_key", "delivery_id"),
        Index(
            "ix_lane_members_processing",
            "route_id",
            "lane_key",
            postgresql_where=text("status = 'processing'"),
        ),
        Index("ix_lane_members_expires_at", "expires_at"),
    )

    delivery_id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    route_id: Mapped[int] = mapped_column(BigInteger)
    lane_key: Mapped[str] = mapped_column(Text)
    status: Mapped[str] = mapped_column(Text)
    lease_until: Mapped[datetime | None] = mapped_column()
    next_attempt_at: Mapped[datetime | None] = mapped_column()
    expires_at: Mapped[datetime] = mapped_column()


class Conflict(Base):
    """The same event id arrived with a different body: recorded, counted, original untouched."""

    __tablename__ = "conflicts"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    source_id: Mapped[int] = mapped_column(BigInteger)
    event_id: Mapped[str] = mapped_column(Text)
    expires_at: Mapped[datetime] = mapped_column(index=True)
    body_digest: Mapped[bytes] = mapped_column(LargeBinary)
    received_at: Mapped[datetime] = mapped_column()


class Replay(Base):
    """Audit row of one operator replay."""

    __tablename__ = "replays"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    operator: Mapped[str] = mapped_column(Text)
    reason: Mapped[str] = mapped_column(Text)
    filter: Mapped[dict[str, Any]] = mapped_column()
    rerun_succeeded: Mapped[bool] = mapped_column(Boolean, server_default=text("false"))
    rate: Mapped[float | None] = mapped_column()
    status: Mapped[str] = mapped_column(Text, server_default="running")
    planned: Mapped[int] = mapped_column(Integer, server_default="0")
    replayed: Mapped[int] = mapped_column(Integer, server_default="0")
    skipped: Mapped[int] = mapped_column(Integer, server_default="0")
    started_at: Mapped[datetime] = mapped_column()
    ended_at: Mapped[datetime | None] = mapped_column()
    via: Mapped[str] = mapped_column(Text, server_default="cli")


class AuditEntry(Base):
    """Who changed what outside the pipeline's own flow, and why (discards, routes, sources)."""

    __tablename__ = "audit_log"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(index=True)
    operator: Mapped[str] = mapped_column(Text)
    action: Mapped[str] = mapped_column(Text)
    target: Mapped[dict[str, Any]] = mapped_column()
    reason: Mapped[str] = mapped_column(Text)
    count: Mapped[int] = mapped_column(Integer, server_default="0")
    via: Mapped[str] = mapped_column(Text, server_default="cli")


class Installation(Base):
    """This database's identity: one row, a random id made by migration 0010. Fast-claim keys
    carry it (tasks.claims), so a key from another database sharing the Redis, or from an
    earlier life of this one (dropped and recreated, its ids starting again at 1), never
    matches a row here."""

    __tablename__ = "installation"
    __table_args__ = (CheckConstraint("singleton", name="singleton"),)

    singleton: Mapped[bool] = mapped_column(Boolean, primary_key=True, server_default=text("true"))
    id: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(server_default=func.now())


class AuditDiscarded(Base):
    """The delivery ids one audited discard changed (its ``audit_log`` row has the count)."""

    __tablename__ = "audit_discarded"
    __table_args__ = (PrimaryKeyConstraint("audit_id", "delivery_id"),)

    audit_id: Mapped[int] = mapped_column(
        BigInteger, ForeignKey("audit_log.id", ondelete="CASCADE")
    )
    delivery_id: Mapped[int] = mapped_column(BigInteger)


class LedgerKind(Base):
    """A (source, event type, way of arrival) the ledger names by a 4-byte id (migration
    0026, models/ledger.py): added by the first ending that meets it."""

    __tablename__ = "ledger_kinds"
    __table_args__ = (UniqueConstraint("source_id", "event_type", "via", name="uq_ledger_kinds"),)

    id: Mapped[int] = mapped_column(Integer, Identity(always=True), primary_key=True)
    source_id: Mapped[int] = mapped_column(BigInteger)
    event_type: Mapped[str] = mapped_column(Text)
    # How the receipt arrived, one byte: w(ebhook), r(econcile) or t(est: `webhooks send`).
    via: Mapped[str] = mapped_column(CHAR(1))


class LedgerRow(Base):
    """A receipt whose work ended, kept for months after the receipt (migrations 0023 and 0026,
    models/ledger.py): appended by each statement that ends deliveries of it, never updated,
    never a dedup key, only what the operator reads once the receipt is gone. Partitioned by
    month on ``received_at``; 80 bytes for a Stripe-shaped event (bench/results_ledger.txt)."""

    __tablename__ = LEDGER_TABLE
    __table_args__ = (
        # The operator's lookup by event id (whatever its source: the kind says which).
        Index("ix_ledger_event", text("hashtextextended(event_id, 0)")),
        {"postgresql_partition_by": "RANGE (received_at)"},
    )

    received_at: Mapped[datetime] = mapped_column()
    kind: Mapped[int] = mapped_column(Integer)  # ledger_kinds.id
    event_id: Mapped[str] = mapped_column(Text)
    # The first 8 bytes of the body's SHA-256 (receipts.body_digest); NULL when reconciled.
    digest: Mapped[bytes | None] = mapped_column(LargeBinary)
    # "<route id>.<attempt><s|d|x>[:<result ref | dead reason>]" entries joined by U+001F.
    outcomes: Mapped[str] = mapped_column(Text)

    # No primary key in the table (rows are appended, several per receipt); the ORM needs one
    # to map the class.
    __mapper_args__ = {"primary_key": [received_at, kind, event_id, outcomes]}  # noqa: RUF012


class Subscription(Base):
    """State kept by the example ``stripe_subscription`` handler (ordering-guarded)."""

    __tablename__ = "subscriptions"
    __table_args__ = (PrimaryKeyConstraint("source_id", "subscription_id"),)

    source_id: Mapped[int] = mapped_column(BigInteger)
    subscription_id: Mapped[str] = mapped_column(Text)
    customer: Mapped[str | None] = mapped_column(Text)
    status: Mapped[str] = mapped_column(Text)
    event_id: Mapped[str] = mapped_column(Text)
    event_created: Mapped[datetime] = mapped_column()
    updated_at: Mapped[datetime] = mapped_column()


class TtlFingerprint(Base):
    """One live receiver's or worker's dedup TTL inputs (core/ttl_fingerprint.py), written at
    its start and refreshed by its heartbeat (models/ttl_fingerprints.py)."""

    __tablename__ = "ttl_fingerprints"
    __table_args__ = (
        PrimaryKeyConstraint("host", "pid", "role"),
        CheckConstraint(_in("role", ("receiver", "worker")), name="role"),
    )

    host: Mapped[str] = mapped_column(Text)
    pid: Mapped[int] = mapped_column(Integer)
    role: Mapped[str] = mapped_column(Text)
    environment: Mapped[str] = mapped_column(Text)
    digest: Mapped[str] = mapped_column(Text)
    terms: Mapped[dict[str, Any]] = mapped_column()
    started_at: Mapped[datetime] = mapped_column(server_default=func.now())
    last_seen: Mapped[datetime] = mapped_column(server_default=func.now())


class IntakeHeartbeat(Base):
    """One receiver process's uninterrupted stretch of heartbeats (core/gaps.py,
    models/intake_gaps.py): kept after it stops, pruned by maintenance."""

    __tablename__ = "intake_heartbeats"
    __table_args__ = (Index(None, "last_seen"),)

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    host: Mapped[str] = mapped_column(Text)
    pid: Mapped[int] = mapped_column(Integer)
    started_at: Mapped[datetime] = mapped_column(server_default=func.now())
    last_seen: Mapped[datetime] = mapped_column(server_default=func.now())
    unreachable_since: Mapped[datetime | None] = mapped_column()


class IntakeError(Base):
    """The 5xx answers the receivers gave, per source, minute (the receiver's clock) and kind
    (core/gaps.py): flushed from memory when the database answers."""

    __tablename__ = "intake_errors"
    __table_args__ = (
        PrimaryKeyConstraint("source", "minute", "kind"),
        CheckConstraint(_in("kind", ("database_unreachable", "errors_answered")), name="kind"),
        Index(None, "minute"),
    )

    source: Mapped[str] = mapped_column(Text)
    minute: Mapped[datetime] = mapped_column()
    kind: Mapped[str] = mapped_column(Text)
    count: Mapped[int] = mapped_column(Integer)


def include_name(name: str | None, type_: str, parent_names: object) -> bool:
    """Alembic filter: partitions (``receipts_p20261130``, ``receipts_default``) belong to
    maintenance, not to migrations."""
    if type_ == "table" and name is not None:
        return not any(
            name.startswith(f"{t}_p") or name == f"{t}_default"
            for t in (*PARTITIONED_TABLES, LEDGER_TABLE)
        )
    return True


class DriftMark(Base):
    """Payload shape learning's progress (issue 38 item 3, models/drift.py): one row, the
    last receipt id a learning run read and when a run last claimed its period (the
    database's clock), so two workers never learn the same period twice."""

    __tablename__ = "drift_marks"

    singleton: Mapped[bool] = mapped_column(Boolean, primary_key=True, server_default=text("true"))
    through_receipt_id: Mapped[int] = mapped_column(BigInteger, server_default="0")
    ran_at: Mapped[datetime | None] = mapped_column()


class DriftShape(Base):
    """One (source, event type) whose payload shape is learnt: when it was first and last
    sighted, how many sightings were fingerprinted and how many paths the caps cut."""

    __tablename__ = "drift_shapes"
    __table_args__ = (PrimaryKeyConstraint("source_id", "event_type"),)

    source_id: Mapped[int] = mapped_column(ForeignKey("sources.id", ondelete="CASCADE"))
    event_type: Mapped[str] = mapped_column(Text)
    first_seen: Mapped[datetime] = mapped_column()
    last_seen: Mapped[datetime] = mapped_column()
    sightings: Mapped[int] = mapped_column(BigInteger, server_default="0")
    cut_paths: Mapped[int] = mapped_column(BigInteger, server_default="0")


class DriftPath(Base):
    """One JSON key path of a learnt shape (core/shapes.py): its types, never a value."""

    __tablename__ = "drift_paths"
    __table_args__ = (PrimaryKeyConstraint("source_id", "event_type", "path"),)

    source_id: Mapped[int] = mapped_column(ForeignKey("sources.id", ondelete="CASCADE"))
    event_type: Mapped[str] = mapped_column(Text)
    path: Mapped[str] = mapped_column(Text)
    types: Mapped[list[str]] = mapped_column(ARRAY(Text))
    first_seen: Mapped[datetime] = mapped_column()
    last_seen: Mapped[datetime] = mapped_column()
    # In how many learnt events of its type it was (drift_shapes.sightings: in all of them).
    sightings: Mapped[int] = mapped_column(BigInteger, server_default="0")


class DriftFinding(Base):
    """One drift of a learnt shape: open until an operator accepts it (``webhooks drift
    accept``, audited). At most one open finding per (source, event type, path, kind)."""

    __tablename__ = "drift_findings"
    __table_args__ = (
        CheckConstraint(_in("kind", ("new_path", "type_changed", "path_gone")), name="kind"),
        Index(
            "uq_drift_findings_open",
            "source_id",
            "event_type",
            "path",
            "kind",
            unique=True,
            postgresql_where=text("accepted_at IS NULL"),
        ),
    )

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    source_id: Mapped[int] = mapped_column(ForeignKey("sources.id", ondelete="CASCADE"))
    event_type: Mapped[str] = mapped_column(Text)
    path: Mapped[str] = mapped_column(Text)
    kind: Mapped[str] = mapped_column(Text)
    detail: Mapped[str] = mapped_column(Text)
    opened_at: Mapped[datetime] = mapped_column()
    accepted_at: Mapped[datetime | None] = mapped_column()
    accepted_by: Mapped[str | None] = mapped_column(Text)
