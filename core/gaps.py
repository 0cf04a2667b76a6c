"""Intake gaps (issue 38 item 2): the time ranges in which senders got errors or no answer
from us, and, per source, whether its provider still retries what failed then (pure).

Inputs, all read by :mod:`models.intake_gaps`:

- the receivers' heartbeat segments (``intake_heartbeats``): each receiver process records
  ``[started_at, last_seen]`` on the database's clock every ``period``; a beat that finds its
  segment's ``last_seen`` more than two periods old (the process was cut off from the
  database, or paused) opens a new one. A segment stands for its process until two periods
  past its ``last_seen`` (:func:`reach`: a late beat is not an outage); a range covered by no
  segment is "no receiver seen". Its edges are known to within that reach (the resolution),
  so a stop shorter than it may go unseen, and the range reported is the widest it can be.
- the errors the receivers answered (``intake_errors``): counts per source and minute of the
  receiver's host clock (the database may be down when they happen), flushed when the
  database answers again. Minutes of 503 "database unavailable" make a range of kind
  ``database_unreachable``; other 5xx answers, ``errors_answered``. A count under the source
  label ``unknown`` (the source could not be looked up) applies to every source.
- each source's provider: its documented retry window (``descriptions.toml``, or the
  source's own ``retry_window_s``) and whether it retries by itself at all (GitHub does not).

A sender that never reached us (its DNS, its network, a proxy in front of us answering for
us) leaves no trace here: :data:`INVISIBLE` says so wherever the ranges are shown.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

from core.durations import format_duration

INVISIBLE = (
    "a sender that never reached us (its DNS, its network, anything in front of this "
    "receiver answering for it) leaves no trace here: the receiver cannot know it; "
    "`webhooks reconcile SOURCE` compares with the provider's own list"
)
ALL_SOURCES = "unknown"  # the receiver's label when it could not look the source up
MINUTE = timedelta(minutes=1)


class GapKind(StrEnum):
    NO_RECEIVER = "no_receiver_seen"
    DB_UNREACHABLE = "database_unreachable"
    ERRORS = "errors_answered"


class Verdict(StrEnum):
    RETRYING = "retrying"  # the provider still retries every event of the range
    GIVING_UP = "giving_up"  # it gave up on the range's first events, retries its last
    GAVE_UP = "gave_up"  # it gave up on all of them: only reconciliation recovers them
    NO_RETRY = "no_retry"  # it never retries by itself: only reconciliation


@dataclass(frozen=True)
class Segment:
    """One receiver process's uninterrupted heartbeat: up from ``started_at`` until at least
    ``last_seen``."""

    started_at: datetime
    last_seen: datetime
    # Set when the process opened this segment after its beats had failed since then (its
    # own clock): it was up, the database did not answer it.
    unreachable_since: datetime | None = None


@dataclass(frozen=True)
class ErrorMinute:
    source: str  # a source's public id, or ALL_SOURCES
    minute: datetime
    kind: GapKind  # DB_UNREACHABLE or ERRORS
    count: int


@dataclass(frozen=True)
class SourceWindow:
    public_id: str
    name: str
    provider: str
    retry_window: timedelta
    retries: bool  # the provider retries by itself
    reconcilable: bool  # a reconciliation credential, for a provider reconciliation knows


@dataclass(frozen=True)
class Gap:
    start: datetime
    end: datetime | None  # None: still open at ``now``
    kind: GapKind
    errors: int = 0  # answers counted (errors kinds)
    source: str | None = None  # None: every source (no receiver seen, or ALL_SOURCES)

    def view(self) -> dict[str, Any]:
        return {
            "start": self.start,
            "end": self.end,
            "kind": self.kind.value,
            "errors": self.errors,
            "source": self.source,
        }


@dataclass(frozen=True)
class SourceGap:
    """One source's standing in one gap."""

    gap: Gap
    source: SourceWindow
    verdict: Verdict
    retries_until: datetime | None  # the last event of the range (None: no retry)
    gave_up_at: datetime | None  # when the provider gave up on the range's first events

    @property
    def deadline(self) -> datetime:
        """When the provider stops retrying the range's earliest events: the order in which
        reconciliation recovers (a provider that never retries: the range's start)."""
        return self.gap.start + (self.source.retry_window if self.source.retries else timedelta())

    def describe(self) -> str:
        when = "%Y-%m-%d %H:%M:%SZ"
        if self.verdict is Verdict.NO_RETRY:
            text = "does not retry by itself: only reconciliation recovers it"
            if self.source.retry_window > timedelta():
                until = self.gap.start + self.source.retry_window
                text += f" (redeliverable until {until:{when}})"
        elif self.verdict is Verdict.RETRYING:
            assert self.retries_until is not None
            text = f"retries until {self.deadline:{when}} (the range's last events: " + (
                f"{self.retries_until:{when}})" if self.gap.end is not None else "open)"
            )
        elif self.verdict is Verdict.GIVING_UP:
            assert self.retries_until is not None
            text = (
                f"gave up on the range's first events at {self.deadline:{when}}, "
                f"retries its last until {self.retries_until:{when}}: reconcile"
            )
        else:
            text = f"gave up at {self.retries_until:{when}}: reconcile"
        if self.verdict is not Verdict.RETRYING and not self.source.reconcilable:
            text += " (no reconciliation credential: only the sender can resend it)"
        return text

    def view(self) -> dict[str, Any]:
        return {
            **self.gap.view(),
            "source": self.source.public_id,
            "name": self.source.name,
            "provider": self.source.provider,
            "verdict": self.verdict.value,
            "deadline": self.deadline,
            "retries_until": self.retries_until,
            "reconcilable": self.source.reconcilable,
            "says": self.describe(),
        }


@dataclass(frozen=True)
class GapReport:
    since: datetime
    now: datetime
    resolution: timedelta  # reach(period): a range's edges are known to within it
    gaps: tuple[Gap, ...]
    sources: tuple[SourceGap, ...]  # by deadline

    def view(self) -> dict[str, Any]:
        return {
            "since": self.since,
            "now": self.now,
            "resolution_s": self.resolution.total_seconds(),
            "gaps": [g.view() for g in self.gaps],
            "sources": [s.view() for s in self.sources],
            "invisible": INVISIBLE,
        }

    def resolution_text(self) -> str:
        return (
            f"ranges of no receiver seen are exact to within {format_duration(self.resolution)} "
            "(two heartbeats; a shorter stop may go unseen); errors answered, to the minute of "
            "the receiver's clock"
        )


Span = tuple[datetime, datetime, bool]  # start, end, opened after a database outage


def _merge(spans: Iterable[Span]) -> list[Span]:
    out: list[Span] = []
    for start, end, after_outage in sorted(spans, key=lambda s: (s[0], s[1])):
        if out and start <= out[-1][1]:
            if end > out[-1][1]:
                out[-1] = (out[-1][0], end, out[-1][2])
        else:
            out.append((start, end, after_outage))
    return out


def reach(period: timedelta) -> timedelta:
    """How long past its ``last_seen`` a segment stands for its process: two beats."""
    return 2 * period


def unseen(
    segments: Sequence[Segment], since: datetime, now: datetime, period: timedelta
) -> list[Gap]:
    """The ranges in ``[since, now]`` in which no receiver was seen. A segment stands for its
    process up to :func:`reach` past its ``last_seen``; a range is reported from the last
    beat before it to the first beat after it (the widest it can be). Nothing is reported
    before the first segment ever recorded (no history), and a range still open at ``now``
    has no end. A range ended by a segment opened after a database outage (the process was
    up and could not reach the database) is of kind ``database_unreachable``."""
    if not segments:
        return []
    span = reach(period)
    first = min(s.started_at for s in segments)
    covered = _merge(
        (s.started_at, s.last_seen + span, s.unreachable_since is not None) for s in segments
    )
    gaps: list[Gap] = []
    cursor = max(since, first)
    last_seen_before = cursor
    for start, end, after_outage in covered:
        if end <= cursor:
            continue
        if start > cursor:
            kind = GapKind.DB_UNREACHABLE if after_outage else GapKind.NO_RECEIVER
            gaps.append(Gap(last_seen_before, min(start, now), kind))
        cursor = max(cursor, end)
        last_seen_before = end - span
        if cursor >= now:
            break
    if cursor < now:
        gaps.append(Gap(last_seen_before, None, GapKind.NO_RECEIVER))
    return [g for g in gaps if g.end is None or g.end > g.start]


def errored(minutes: Sequence[ErrorMinute], since: datetime) -> list[Gap]:
    """Consecutive minutes with errors answered, per source and kind, as ranges."""
    gaps: list[Gap] = []
    keyed = sorted(
        (m for m in minutes if m.minute + MINUTE > since and m.count > 0),
        key=lambda m: (m.source, m.kind, m.minute),
    )
    for m in keyed:
        last = gaps[-1] if gaps else None
        source = None if m.source == ALL_SOURCES else m.source
        if (
            last is not None
            and last.source == source
            and last.kind is m.kind
            and last.end is not None
            and m.minute <= last.end
        ):
            gaps[-1] = Gap(last.start, m.minute + MINUTE, m.kind, last.errors + m.count, source)
        else:
            gaps.append(Gap(m.minute, m.minute + MINUTE, m.kind, m.count, source))
    return gaps


def judge(gap: Gap, source: SourceWindow, now: datetime) -> SourceGap:
    """Whether ``source``'s provider still retries what failed in ``gap``, at ``now`` (the
    database's clock)."""
    if not source.retries:
        return SourceGap(gap, source, Verdict.NO_RETRY, None, None)
    first = gap.start + source.retry_window
    last = (gap.end if gap.end is not None else now) + source.retry_window
    if now < first:
        return SourceGap(gap, source, Verdict.RETRYING, last, None)
    if now < last:
        return SourceGap(gap, source, Verdict.GIVING_UP, last, first)
    return SourceGap(gap, source, Verdict.GAVE_UP, last, first)


def report(
    segments: Sequence[Segment],
    minutes: Sequence[ErrorMinute],
    sources: Sequence[SourceWindow],
    *,
    since: datetime,
    now: datetime,
    period: timedelta,
) -> GapReport:
    """Every gap in ``[since, now]`` (by start), and each affected source's standing in each
    (by deadline, then source)."""
    gaps = sorted(
        [*unseen(segments, since, now, period), *errored(minutes, since)],
        key=lambda g: (g.start, g.kind, g.source or ""),
    )
    by_id = {s.public_id: s for s in sources}
    standing = [
        judge(gap, source, now)
        for gap in gaps
        for source in ([by_id[gap.source]] if gap.source in by_id else sources)
        if gap.source is None or gap.source in by_id
    ]
    standing.sort(key=lambda s: (s.deadline, s.source.public_id, s.gap.start))
    return GapReport(since, now, reach(period), tuple(gaps), tuple(standing))


@dataclass(frozen=True)
class Recovery:
    """One source's reconciliation for the gaps: from the earliest start of its ranges (less
    ``margin``), ordered by its earliest deadline."""

    source: SourceWindow
    deadline: datetime
    start: datetime
    gaps: int


def recoveries(rep: GapReport, margin: timedelta) -> list[Recovery]:
    """Per source, in the order of its earliest deadline (the provider that gives up first is
    recovered first), the window reconciliation must cover."""
    found: dict[str, Recovery] = {}
    for s in rep.sources:  # by deadline already
        known = found.get(s.source.public_id)
        start = s.gap.start - margin
        if known is None:
            found[s.source.public_id] = Recovery(s.source, s.deadline, start, 1)
        else:
            found[s.source.public_id] = Recovery(
                s.source, known.deadline, min(known.start, start), known.gaps + 1
            )
    return sorted(found.values(), key=lambda r: (r.deadline, r.source.public_id))


def gives_up_at(
    occurred_at: datetime | None, received_at: datetime | None, window: timedelta, retries: bool
) -> datetime | None:
    """When the provider stops retrying one event: from the event's own time (else its
    arrival), plus the provider's window; None for a provider that never retries."""
    anchor = occurred_at or received_at
    if anchor is None or not retries:
        return None
    return anchor + window
