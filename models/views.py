"""What the operators' reads take and return, with no database library: operator input (ids,
times, statuses), events, deliveries, dead letters, the ledger's view of an expired event and a
route's state, as plain dataclasses and pure functions.

Both read paths build these: :mod:`models.reads` (plain psycopg: the CLI's read commands, which
must start fast) and the SQLAlchemy modules (:mod:`models.queries`,
:mod:`models.delivery_history`, :mod:`models.ledger_reads`: the admin API and the console),
which re-export them, so each type and rule lives once. Importing this module imports no
SQLAlchemy, psycopg, provider or Celery module (tests/test_cli_lazy.py).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from core.durations import DurationError, parse_duration
from core.errors import WebhooksError
from core.states import AttemptOutcome, DeliveryStatus

# Operator input (models.catalog re-exports these).


class CatalogError(WebhooksError, ValueError):
    """Bad input for a source, secret or route; nothing was changed."""


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


# Operator input, events, deliveries and dead letters (models.queries re-exports these).

MAX_LIST_LIMIT = 1000


# Operators' unambiguous id forms: ``receipt:12``, ``delivery:11``, ``event:evt_1``.
RECEIPT_PREFIX = "receipt:"


DELIVERY_PREFIX = "delivery:"


EVENT_PREFIX = "event:"


# Ids are Postgres bigints: a number beyond this is refused before it reaches a query.
MAX_ID = 2**63 - 1


def receipt_ref(receipt_id: int) -> str:
    """How a receipt id is printed: a bare number could also be a delivery id."""
    return f"{RECEIPT_PREFIX}{receipt_id}"


class QueryError(WebhooksError, ValueError):
    """Bad operator input (unknown status, unparseable time, ...); nothing was read."""

    def __init__(self, message: str, reason: str = "bad_query") -> None:
        super().__init__(message)
        self.reason = reason


class NotFoundError(QueryError):
    """The id, event or delivery asked for does not exist (``reason`` ``not_found``)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "not_found")


def is_number(text: str) -> bool:
    """ASCII digits only (``str.isdigit`` also accepts ``²`` and other scripts' digits)."""
    return text.isascii() and text.isdigit()


def _fits(digits: str) -> bool:
    # The length first: int() of thousands of digits raises ValueError (and costs time).
    return len(digits) <= len(str(MAX_ID)) and int(digits) <= MAX_ID


def parse_id(text: str, what: str = "id") -> int:
    """An operator's numeric id: ASCII digits within a bigint; QueryError otherwise."""
    if not is_number(text):
        raise QueryError(f"not a {what}: {text!r} (a number)", "bad_id")
    if not _fits(text):
        raise QueryError(f"{what} out of range: {text!r} (at most {MAX_ID})", "out_of_range")
    return int(text)


def parse_time(text: str, *, now: datetime) -> datetime:
    """``2026-05-01T10:00``, ``2026-05-01`` (UTC when no offset) or a duration ago (``2h``);
    QueryError for anything else, including a time or duration beyond what can be stored."""
    value = text.strip()
    out_of_range = QueryError(f"time out of range: {text!r}", "out_of_range")
    try:
        return now - parse_duration(value)
    except DurationError:
        pass
    except OverflowError:  # a duration beyond timedelta, or a time before year 1
        raise out_of_range from None
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise QueryError(
            f"not a time: {text!r} (use an ISO time such as 2026-05-01T10:00Z, "
            "or 2h for two hours ago)"
        ) from None
    if parsed.tzinfo is None:
        return parsed.replace(tzinfo=UTC)
    try:  # 0001-01-01T00:00+14:00 is before year 1 in UTC: no datetime can hold it
        parsed.astimezone(UTC)
    except OverflowError:
        raise out_of_range from None
    return parsed


def check_status(status: str | None, allowed: Sequence[str] = tuple(DeliveryStatus)) -> None:
    if status is not None and status not in allowed:
        raise QueryError(f"unknown status {status!r}; one of {', '.join(allowed)}")


def _window(since: datetime | None, until: datetime | None) -> None:
    if since is not None and until is not None and since >= until:
        raise QueryError("--since must be before --until")


@dataclass(frozen=True)
class EventFilter:
    source: str | None = None  # public id or unambiguous name
    event_type: str | None = None  # glob: invoice.*
    status: str | None = None  # events having at least one delivery in this state
    since: datetime | None = None  # received_at >= since
    until: datetime | None = None  # received_at < until
    limit: int = 50
    # Cursor pagination (the console): only receipts older than (received_at, id).
    before: tuple[datetime, int] | None = None


@dataclass(frozen=True)
class EventSummary:
    """One received event and how many of its deliveries are in each state."""

    id: int
    source: str
    source_name: str
    event_id: str
    event_type: str
    received_at: datetime
    occurred_at: datetime | None
    deliveries: dict[str, int]  # status -> count
    payload_dropped: bool


@dataclass(frozen=True)
class EventDetail:
    """A receipt with its deliveries and attempts; the payload's size, never its content."""

    id: int
    source: str
    source_name: str
    provider: str
    event_id: str
    event_type: str
    occurred_at: datetime | None
    received_at: datetime
    expires_at: datetime
    content_type: str | None
    payload_bytes: int | None
    payload_dropped_at: datetime | None
    deliveries: list[DeliveryView]
    # or reconcile (webhooks reconcile recovered it), or test (`webhooks send` minted it)
    arrived_via: str = "webhook"
    # Where the type was read from when the signature does not cover it (``X-GitHub-Event``),
    # judged by the provider's rules under the source's current options; None: signed, or
    # recovered from the provider's API (:func:`unsigned_type_of`).
    type_unsigned: str | None = None

    @property
    def sender_retries(self) -> str:
        """Until when its provider retries it (its documented schedule, from the event's own
        time, else its arrival: :func:`core.gaps.gives_up_at`), or that it never retries."""
        from models.intake_gaps import provider_gives_up  # noqa: PLC0415 (only when shown)

        return provider_gives_up(self.provider, self.occurred_at, self.received_at)[1]


@dataclass(frozen=True)
class DeadGroup:
    """Dead deliveries of one source, route and reason."""

    source: str
    source_name: str
    route_id: int
    handler: str
    reason: str | None
    count: int
    oldest: datetime
    newest: datetime
    error_classes: list[str]
    sample_ids: list[int]  # newest first, for `webhooks replay ID ...`


def _delivery_number_message(number: int, also_event: bool) -> str:
    what = f"both delivery {number} and receipt {number}" if also_event else "a delivery id"
    if also_event:
        return (
            f"{number} is {what}: use `webhooks deliveries show {number}` for the delivery, or "
            f"`webhooks events show {RECEIPT_PREFIX}{number}` for the receipt"
        )
    return (
        f"{number} is {what}, not a receipt: use `webhooks deliveries show {number}` "
        f"(or `webhooks events show {DELIVERY_PREFIX}{number}` for its event)"
    )


def unsigned_type_of(
    provider: str, config: dict[str, Any] | None, event_type: str, arrived_via: str
) -> str | None:
    """Where a stored event's type came from when unsigned (``X-GitHub-Event``), by its
    provider's rules under its source's options; None when signed, when the event was
    recovered from the provider's API (no header involved), or when the provider is no longer
    installed (nothing to judge by). Receipts store no such mark: the rules decide it from the
    type itself (GitHub: whether the body identifies the event, else the request was refused;
    WooCommerce: action.* topics), so a source's options changed since are judged as now."""
    if arrived_via == "reconcile":
        return None
    from core.providers import registry  # noqa: PLC0415 (the provider's module: only an event's own)

    try:
        found = registry.get_one(provider)
    except registry.UnknownProvider:
        return None
    return found.unsigned_type(config or {}, event_type)


@dataclass(frozen=True)
class DeliveryDetail:
    """One delivery as the operator looks it up by the id Flower, the logs and ``dead list``
    show: its event, its route and handler, its state and its attempt history."""

    id: int
    receipt: str  # receipt:12, for `webhooks events show`
    receipt_id: int
    source: str
    source_name: str
    provider: str
    event_id: str
    event_type: str
    received_at: datetime
    route_events: str | None  # None once the route is removed
    route_active: bool | None
    idempotency_key: str | None  # the downstream key of the current generation
    delivery: DeliveryView


# (source id, event id, route id, generation) -> the downstream idempotency key.
KeyOf = Callable[[int, str, int, int], str]


def parse_delivery_ref(ref: str | int) -> int:
    key = str(ref).strip().removeprefix(DELIVERY_PREFIX)
    if not is_number(key):
        raise QueryError(
            f"not a delivery id: {str(ref)!r} (a number, as `dead list` and Flower show it)"
        )
    return parse_id(key, "delivery id")


# A delivery's attempts and replays (models.delivery_history re-exports these).

# The named windows of :attr:`DeliveryView.repeat_windows` (the causes of the
# ``webhooks_repeat_windows_total`` metric).
LEASE_TAKEN_OVER = "lease taken over: its worker was lost holding the lease"


ANSWER_TIMEOUT = "answer timed out: the call was sent, its answer did not come in time"


@dataclass(frozen=True)
class AttemptView:
    """One try of a delivery: who ran it, when, and how it ended. ``number`` is the attempt's
    fencing token: it only grows, across replays and re-runs too."""

    number: int
    generation: int
    worker: str | None
    started_at: datetime
    ended_at: datetime | None
    outcome: str | None
    error_class: str | None
    error: str | None
    # When the outcome's statement ran (0020): for a success, how long after the handler
    # returned (the downstream's 2xx) its effect was recorded.
    committed_at: datetime | None = None

    @property
    def unrecorded_ms(self) -> int | None:
        """Milliseconds from the handler's return to the outcome's commit (None: not known)."""
        if self.committed_at is None or self.ended_at is None:
            return None
        return max(0, int((self.committed_at - self.ended_at).total_seconds() * 1000))


@dataclass(frozen=True)
class ReplayMark:
    """A replay (or re-run) that moved a delivery: the attempts from ``first_attempt`` on
    belong to it (None: none has started since). The audit fields are None when no audit row
    accounts for it (a replay older than the ``replays`` rows kept)."""

    replay_id: int | None
    operator: str | None
    reason: str | None
    via: str | None
    started_at: datetime | None
    rerun: bool
    first_attempt: int | None


@dataclass(frozen=True)
class DeliveryView:
    """One (event, route) unit of work with its attempts (in time order) and the replays that
    split them into runs."""

    id: int
    route_id: int
    handler: str  # REMOVED_ROUTE once the route is gone
    status: str
    attempts: int  # the latest attempt's number (the fencing token; goes on across replays)
    attempts_since_replay: int  # what the retry policy counts: attempts - attempt_base
    generation: int
    dead_reason: str | None
    last_error_class: str | None
    last_error: str | None
    next_attempt_at: datetime | None  # None once finished
    created_at: datetime
    updated_at: datetime
    succeeded_at: datetime | None
    result_ref: str | None = None  # what its handler returned with the success (0021)
    attempt_log: list[AttemptView] = field(default_factory=list)
    replays: list[ReplayMark] = field(default_factory=list)

    @property
    def repeat_windows(self) -> list[tuple[int, str]]:
        """The attempts whose call may have reached the downstream although another attempt
        of the same key generation ran after them, each with its named window: the only
        ways one delivery reaches its downstream twice (docs/workers.md)."""
        out = []
        for a, later in zip(self.attempt_log, self.attempt_log[1:], strict=False):
            if later.generation != a.generation:
                continue
            if a.outcome == "crashed":
                out.append((a.number, LEASE_TAKEN_OVER))
            elif a.error_class == "SoftTimeLimitExceeded" or (a.error or "").startswith(
                ("timeout:", "hard_time_limit:")
            ):
                out.append((a.number, ANSWER_TIMEOUT))
        return out


@dataclass(frozen=True)
class ReplayAudit:
    """A ``replays`` row, as far as attributing it to a delivery needs."""

    id: int
    operator: str
    reason: str
    via: str
    started_at: datetime
    rerun: bool
    filter: dict[str, Any]

    def names(self, delivery_id: int) -> bool:
        return delivery_id in (self.filter.get("ids") or [])

    def could_have_moved(
        self, delivery_id: int, source: str, source_name: str, event_type: str
    ) -> bool:
        """Named by id, or a filter replay whose filter (as given) matches the event."""
        if "ids" in self.filter:
            return self.names(delivery_id)
        given_source = self.filter.get("source")
        if given_source is not None and given_source not in (source, source_name):
            return False
        pattern = self.filter.get("type")
        return pattern is None or fnmatch.fnmatchcase(event_type, str(pattern))


def replay_marks(
    attempts: Sequence[AttemptView], audit: Sequence[ReplayAudit], *, attempt_base: int
) -> list[ReplayMark]:
    """Where replays split a delivery's attempts (in time order) into runs, and which audit
    row each was (pure).

    A new run starts at an attempt that follows a finished one (its predecessor ended
    ``dead`` or ``succeeded``), carries a new key generation (a re-run), or is the first
    after ``attempt_base`` (the latest replay; this also finds a replay of a delivery that
    went dead by crashing, whose last attempt says ``crashed``); a replay that names the
    delivery between two of its attempts marks one too. A replay whose attempt has not
    started yet is a mark at the end. Each mark takes the earliest replay that could have
    moved the delivery after the run before it had started (one naming it by id first):
    later ones could only have found it no longer dead.
    """
    starts: list[int] = []  # indexes of attempts that open a run
    for i in range(1, len(attempts)):
        prev, cur = attempts[i - 1], attempts[i]
        if (
            prev.outcome in (AttemptOutcome.DEAD, AttemptOutcome.SUCCEEDED)
            or cur.generation > prev.generation
            or (attempt_base > 0 and cur.number == attempt_base + 1)
            or any(
                prev.started_at < a.started_at <= cur.started_at and "ids" in a.filter
                for a in audit
            )
        ):
            starts.append(i)
    pending_replay = attempt_base > 0 and not any(a.number > attempt_base for a in attempts)
    if pending_replay and attempts:
        starts.append(len(attempts))
    marks: list[ReplayMark] = []
    for k, i in enumerate(starts):
        after = attempts[i - 1].started_at
        # The run it opens ends where the next run's last attempt before it starts.
        until = attempts[starts[k + 1] - 1].started_at if k + 1 < len(starts) else None
        window = [
            a for a in audit if a.started_at > after and (until is None or a.started_at <= until)
        ]
        window.sort(key=lambda a: ("ids" not in a.filter, a.started_at, a.id))
        first = attempts[i].number if i < len(attempts) else None
        rerun = i < len(attempts) and attempts[i].generation > attempts[i - 1].generation
        if window:
            a = window[0]
            marks.append(
                ReplayMark(a.id, a.operator, a.reason, a.via, a.started_at, a.rerun or rerun, first)
            )
        else:
            marks.append(ReplayMark(None, None, None, None, None, rerun, first))
    return marks


# The handler shown for a delivery whose route was removed (``webhooks routes remove``).
REMOVED_ROUTE = "(route removed)"

# The processed-events ledger's entry codes (models.ledger re-exports these).

# What each final status is written as (an entry's code).
CODES = {
    DeliveryStatus.SUCCEEDED: "s",
    DeliveryStatus.DEAD: "d",
    DeliveryStatus.DISCARDED: "x",
    DeliveryStatus.SUPERSEDED: "u",
    DeliveryStatus.FILTERED: "f",
}


STATUS_OF_CODE = {code: status for status, code in CODES.items()}


# Between a row's entries: a control character, which result references (printable only,
# tasks.context.result_reference) and dead reasons (codes) never hold.
SEP = "\x1f"

# An event read from the ledger (models.ledger_reads re-exports these).

# The ledger's one-byte `via` (models/ledger.py) as receipts name it.
ARRIVED_VIA_OF = {"w": "webhook", "r": "reconcile", "t": "test"}


# Why an event shown from the ledger is not shown from its receipt.
FROM_LEDGER = "receipt expired; from the ledger"


@dataclass(frozen=True)
class LedgerOutcome:
    """One route's final outcome, as the ledger recorded it."""

    route_id: int
    handler: str  # REMOVED_ROUTE once the route is gone
    status: str  # succeeded | dead | discarded
    result_ref: str | None = None  # a success's result reference
    dead_reason: str | None = None


@dataclass(frozen=True)
class LedgerEntry:
    """One receipt of an event, from the ledger."""

    source: str
    source_name: str
    provider: str
    event_id: str
    event_type: str
    received_at: datetime
    digest: str | None  # hex, the first 8 bytes of the body's SHA-256; None when reconciled
    arrived_via: str  # webhook | reconcile
    outcomes: list[LedgerOutcome] = field(default_factory=list)


@dataclass(frozen=True)
class LedgerEvent:
    """An event whose receipt is gone, as the ledger keeps it: every receipt of it the ledger
    holds (a redelivery after the TTL was new work, with a row of its own), newest first."""

    source: str
    event_id: str
    runs: list[LedgerEntry]
    note: str = FROM_LEDGER
    found_in: str = "ledger"


# The runs shown, at most (the newest).
MAX_RUNS = 50


_ENTRY = re.compile(r"(\d+)\.(\d+)([a-z])(?::(.*))?", re.DOTALL)


# Of two entries of one route at the same attempt, the later decision: an operator discards a
# dead letter (d, then x); a success and a dead letter never end one attempt together.
_LATER = {"d": 0, "s": 1, "x": 2}


@dataclass(frozen=True)
class Entry:
    """One route's outcome as one ledger row wrote it."""

    route_id: int
    attempt: int
    code: str  # s | d | x | u | f (CODES)
    detail: str | None  # the result reference or the dead reason


def entries(outcomes: str) -> list[Entry]:
    """A ledger row's entries (models/ledger.py); one that does not parse is left out."""
    out = []
    for part in outcomes.split(SEP):
        found = _ENTRY.fullmatch(part)
        if found:
            route, attempt, code, detail = found.groups()
            out.append(Entry(int(route), int(attempt), code, detail or None))
    return out


def merged(rows_outcomes: list[str]) -> dict[int, Entry]:
    """Each route's final entry across a receipt's rows: the highest attempt's (pure)."""
    final: dict[int, Entry] = {}
    for outcomes in rows_outcomes:
        for entry in entries(outcomes):
            seen = final.get(entry.route_id)
            if seen is None or (entry.attempt, _LATER.get(entry.code, -1)) > (
                seen.attempt,
                _LATER.get(seen.code, -1),
            ):
                final[entry.route_id] = entry
    return final


def _outcomes(final: dict[int, Entry], handlers: dict[int, str]) -> list[LedgerOutcome]:
    return [
        LedgerOutcome(
            e.route_id,
            handlers.get(e.route_id, REMOVED_ROUTE),
            STATUS_OF_CODE.get(e.code, e.code),
            result_ref=e.detail if e.code == "s" else None,
            dead_reason=e.detail if e.code == "d" else None,
        )
        for e in sorted(final.values(), key=lambda e: e.route_id)
    ]


def _event_id_of(ref: str | int) -> str | None:
    """The provider event id an operator's reference names (None: a receipt or delivery id,
    which the ledger does not keep)."""
    key = str(ref).strip()
    for prefix in (RECEIPT_PREFIX, DELIVERY_PREFIX):
        if key.startswith(prefix) and key[len(prefix) :].isdigit():
            return None
    return key.removeprefix(EVENT_PREFIX)


# A route's rate limit (models.admission re-exports it).

# Calls are spaced this much wider than the rate. The downstream sees each call some
# milliseconds to tens of milliseconds after its slot (scheduling, the connection, a busy
# host), and its promise is the rate + 5% in any one-second window as the downstream counts:
# spaced exactly, 50 ms of such jitter already shows 22 calls in a second at 20/s; spaced 5%
# wider, it takes 100 ms. The cost: a route runs at most at 95% of its rate.
SPACING = 1.05


@dataclass(frozen=True)
class Rate:
    """``count`` calls per ``period_s`` seconds, evenly spaced (:data:`SPACING` wider)."""

    count: int
    period_s: int

    @property
    def interval_ms(self) -> float:
        return SPACING * 1000.0 * self.period_s / self.count

    def __str__(self) -> str:
        unit = {1: "s", 60: "m", 3600: "h"}.get(self.period_s)
        return f"{self.count}/{unit}" if unit else f"{self.count}/{self.period_s}s"


# A route's pause, breaker and limits (models.breaker re-exports these).


@dataclass(frozen=True)
class RouteState:
    """A route's pause and breaker, as operators read them."""

    route_id: int
    paused: bool
    paused_at: datetime | None
    pause_reason: str | None
    breaker_state: str
    breaker_opened_at: datetime | None
    breaker_probe_at: datetime | None
    probe_delivery: int | None
    breaker_trips: int
    window_started_at: datetime | None
    window_requests: int
    window_failures: int
    limits: dict[str, Any]
    # When and why the route was disabled (None while active, or disabled before 0022).
    disabled_at: datetime | None = None
    disabled_reason: str | None = None

    def view(self) -> dict[str, Any]:
        """JSON-ready (the CLI's --json and the admin API)."""

        def iso(value: datetime | None) -> str | None:
            return None if value is None else value.isoformat()

        return {
            "limits": self.limits,
            "paused": self.paused,
            "paused_at": iso(self.paused_at),
            "pause_reason": self.pause_reason,
            "disabled_at": iso(self.disabled_at),
            "disabled_reason": self.disabled_reason,
            "breaker": {
                "state": self.breaker_state,
                "opened_at": iso(self.breaker_opened_at),
                "probe_at": iso(self.breaker_probe_at),
                "probe_delivery": self.probe_delivery,
                "trips": self.breaker_trips,
                "window_started_at": iso(self.window_started_at),
                "window_requests": self.window_requests,
                "window_failures": self.window_failures,
            },
        }


def state_of(route: Any) -> RouteState:
    """The state of a route row (the ORM's :class:`models.schema.Route` or a
    :class:`models.reads.RouteRow`: the same attributes)."""
    return RouteState(
        route.id,
        route.paused_at is not None,
        route.paused_at,
        route.pause_reason,
        route.breaker_state,
        route.breaker_opened_at,
        route.breaker_probe_at,
        route.probe_delivery,
        route.breaker_trips,
        route.window_started_at,
        route.window_requests,
        route.window_failures,
        limits_view(route),
        route.disabled_at,
        route.disabled_reason,
    )


def limits_view(route: Any) -> dict[str, Any]:
    """The route's limits as operators read them (``None``: the default budget / no rate)."""
    rate = (
        None if route.rate_count is None else str(Rate(route.rate_count, route.rate_period_s or 1))
    )
    return {"max_in_flight": route.max_in_flight, "rate_limit": rate}
