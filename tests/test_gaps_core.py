"""Issue 38 item 2, the pure part (core/gaps.py): heartbeat segments and error minutes into
gap ranges, and each provider's verdict at a given database time (the clock is a parameter)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from core.gaps import (
    ErrorMinute,
    GapKind,
    Segment,
    SourceWindow,
    Verdict,
    errored,
    gives_up_at,
    judge,
    recoveries,
    report,
    unseen,
)

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
P = timedelta(seconds=15)  # the heartbeat's period; a segment reaches two of them
M = timedelta(minutes=1)


def at(minutes: float) -> datetime:
    return T0 + timedelta(minutes=minutes)


STRIPE = SourceWindow("src_s", "pay", "stripe", timedelta(days=3), True, True)
SHOPIFY = SourceWindow("src_h", "shop", "shopify", timedelta(hours=4), True, False)
GITHUB = SourceWindow("src_g", "code", "github", timedelta(days=3), False, True)


def test_a_stop_between_two_segments_is_one_range_from_the_last_beat_to_the_first() -> None:
    segments = [Segment(at(0), at(10)), Segment(at(25), at(40))]
    [gap] = unseen(segments, at(0), at(40), P)
    assert (gap.start, gap.end, gap.kind) == (at(10), at(25), GapKind.NO_RECEIVER)


def test_overlapping_receivers_cover_each_other_and_a_late_beat_is_no_gap() -> None:
    # Two receivers: one stops at 10, the other runs 5..30; then a beat 25 s late (within two
    # periods) after the first receiver restarts at 30.
    segments = [
        Segment(at(0), at(10)),
        Segment(at(5), at(30)),
        Segment(at(30) + 2 * P, at(40)),
    ]
    assert unseen(segments, at(0), at(40), P) == []
    # Three periods late: a gap, bounded by the last beat and the next segment.
    late = [Segment(at(0), at(10)), Segment(at(10) + 3 * P, at(20))]
    [gap] = unseen(late, at(0), at(20), P)
    assert (gap.start, gap.end) == (at(10), at(10) + 3 * P)


def test_a_range_still_open_has_no_end_and_nothing_before_the_first_beat_counts() -> None:
    segments = [Segment(at(30), at(40))]
    [gap] = unseen(segments, at(0), at(50), P)  # no history before 30: not a gap
    assert (gap.start, gap.end) == (at(40), None)
    assert unseen([], at(0), at(50), P) == []  # never a heartbeat: nothing known
    # ``since`` inside a range: the range is cut at ``since``.
    [cut] = unseen([Segment(at(0), at(10)), Segment(at(30), at(50))], at(20), at(50), P)
    assert (cut.start, cut.end) == (at(20), at(30))


def test_a_range_after_which_the_receiver_came_back_from_a_database_outage_says_so() -> None:
    """The receiver was up but its beats failed (the database did not answer): the segment it
    opened after says since when, and the range before it is the database unreachable, for
    every source, not a receiver down."""
    segments = [Segment(at(0), at(10)), Segment(at(20), at(30), unreachable_since=at(10.2))]
    [gap] = unseen(segments, at(0), at(30), P)
    assert (gap.start, gap.end, gap.kind, gap.source) == (
        at(10),
        at(20),
        GapKind.DB_UNREACHABLE,
        None,
    )
    # Another receiver that was down meanwhile does not change what the range was.
    both = [*segments, Segment(at(25), at(30))]
    assert [g.kind for g in unseen(both, at(0), at(30), P)] == [GapKind.DB_UNREACHABLE]


def test_error_minutes_merge_per_source_and_kind_and_unknown_means_every_source() -> None:
    minutes = [
        ErrorMinute("src_s", at(3), GapKind.DB_UNREACHABLE, 4),
        ErrorMinute("src_s", at(1), GapKind.DB_UNREACHABLE, 2),
        ErrorMinute("src_s", at(2), GapKind.DB_UNREACHABLE, 1),
        ErrorMinute("src_s", at(9), GapKind.DB_UNREACHABLE, 1),
        ErrorMinute("src_s", at(2), GapKind.ERRORS, 7),
        ErrorMinute("unknown", at(2), GapKind.DB_UNREACHABLE, 5),
    ]
    gaps = errored(minutes, at(0))
    spans = {(g.source, g.kind, g.start, g.end, g.errors) for g in gaps}
    assert spans == {
        ("src_s", GapKind.DB_UNREACHABLE, at(1), at(4), 7),
        ("src_s", GapKind.DB_UNREACHABLE, at(9), at(10), 1),
        ("src_s", GapKind.ERRORS, at(2), at(3), 7),
        (None, GapKind.DB_UNREACHABLE, at(2), at(3), 5),
    }
    rep = report([], minutes, [STRIPE, SHOPIFY], since=at(0), now=at(10), period=P)
    every = [s for s in rep.sources if s.gap.source is None]
    assert {s.source.public_id for s in every} == {"src_s", "src_h"}
    # A count for a source that is not (or no longer) active names nobody.
    rep = report([], [ErrorMinute("src_x", at(1), GapKind.ERRORS, 1)], [STRIPE], since=at(0),
                 now=at(5), period=P)  # fmt: skip
    assert len(rep.gaps) == 1
    assert rep.sources == ()


def test_each_provider_s_verdict_follows_its_window_and_the_database_time() -> None:
    [gap] = unseen([Segment(at(0), at(10)), Segment(at(70), at(80))], at(0), at(80), P)
    assert (gap.start, gap.end) == (at(10), at(70))
    hour = timedelta(hours=1)

    s = judge(gap, SHOPIFY, at(80))
    assert s.verdict is Verdict.RETRYING
    assert s.deadline == at(10) + 4 * hour
    assert s.retries_until == at(70) + 4 * hour
    assert "retries until 2026-12-01 16:10:00Z" in s.describe()

    s = judge(gap, SHOPIFY, at(10) + 4 * hour + M)  # first events given up, last not
    assert s.verdict is Verdict.GIVING_UP
    assert "reconcile" in s.describe()
    assert "only the sender can resend it" in s.describe()  # no credential

    s = judge(gap, SHOPIFY, at(70) + 4 * hour)
    assert s.verdict is Verdict.GAVE_UP
    assert s.describe().startswith("gave up at 2026-12-01 17:10:00Z: reconcile")

    assert judge(gap, STRIPE, at(70) + 4 * hour).verdict is Verdict.RETRYING
    g = judge(gap, GITHUB, at(80))
    assert g.verdict is Verdict.NO_RETRY
    assert g.deadline == gap.start  # nothing retries it: recover first
    assert "only reconciliation recovers it" in g.describe()
    assert "redeliverable until 2026-12-04 12:10:00Z" in g.describe()


def test_recoveries_come_in_deadline_order_each_source_once_from_its_earliest_range() -> None:
    segments = [Segment(at(0), at(10)), Segment(at(20), at(100))]
    minutes = [ErrorMinute("src_s", at(50), GapKind.DB_UNREACHABLE, 3)]
    rep = report(segments, minutes, [STRIPE, SHOPIFY, GITHUB], since=at(0), now=at(100),
                 period=P)  # fmt: skip
    assert [(s.source.public_id, s.gap.start) for s in rep.sources] == [
        ("src_g", at(10)),
        ("src_h", at(10)),
        ("src_s", at(10)),
        ("src_s", at(50)),
    ]
    margin = timedelta(minutes=5)
    order = recoveries(rep, margin)
    assert [(r.source.public_id, r.gaps, r.start) for r in order] == [
        ("src_g", 1, at(5)),
        ("src_h", 1, at(5)),
        ("src_s", 2, at(5)),
    ]
    assert [r.deadline for r in order] == [
        at(10),
        at(10) + timedelta(hours=4),
        at(10) + timedelta(days=3),
    ]


def test_a_receipt_knows_when_its_provider_gives_up_on_it() -> None:
    day = timedelta(days=1)
    assert gives_up_at(at(0), at(5), 3 * day, True) == at(0) + 3 * day  # the event's own time
    assert gives_up_at(None, at(5), 3 * day, True) == at(5) + 3 * day  # else its arrival
    assert gives_up_at(at(0), at(5), 3 * day, False) is None  # it never retries


def test_error_counts_wait_in_memory_bounded_and_come_back_when_a_flush_fails() -> None:
    """The receiver's counts (models/intake_gaps.py): per source, minute and kind; given back
    when a flush could not write them; past MAX_KEYS new keys are dropped and counted."""
    from models import intake_gaps  # noqa: PLC0415 (psycopg: only this test)

    counts = intake_gaps.ErrorCounts()
    counts.answered("src_a", "unavailable", at(1) + timedelta(seconds=7))
    counts.answered("src_a", "unavailable", at(1) + timedelta(seconds=50))
    counts.answered("src_a", "provider_missing", at(1))
    counts.failed("src_" + "x" * 20, at(2))
    counts.failed("not-an-id", at(2))
    taken = counts.take()
    assert taken == {
        ("src_a", at(1), "database_unreachable"): 2,
        ("src_a", at(1), "errors_answered"): 1,
        ("src_" + "x" * 20, at(2), "errors_answered"): 1,
        ("unknown", at(2), "errors_answered"): 1,
    }
    assert counts.take() == {}
    counts.answered("src_a", "unavailable", at(1))
    counts.restore(taken)  # the flush failed: nothing lost, added to what came meanwhile
    assert counts.take()[("src_a", at(1), "database_unreachable")] == 3

    bounded = intake_gaps.ErrorCounts()
    for n in range(intake_gaps.MAX_KEYS + 5):
        bounded.add(f"src_{n}", at(0), GapKind.ERRORS)
    assert len(bounded.take()) == intake_gaps.MAX_KEYS
    assert bounded.dropped == 5
