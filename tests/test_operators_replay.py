"""Replay planning and execution (models.replays) and the operator CLI, against real Postgres,
real Redis and the real ``webhooks`` console script. Workers are in test_operators_e2e.py."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime, timedelta

import pytest
import redis
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session, sessionmaker

from core.clock import FrozenClock
from core.messages import Dispatch
from core.settings import Settings
from models import admission, queries, replays
from models.candidates import ReplayFilter
from models.replays import ReplayError, ReplayRequest, moved, pace, pace_chunk
from tasks.publisher import CeleryPublisher
from tests.factories import accept_event
from tests.operators_support import (
    accept,
    cli,
    flush,
    kill,
    ops_env,
    ops_settings,
    queue_length,
    queued_ids,
    queued_messages,
    replay_rows,
    source_with,
    status_of,
    succeed,
)

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def ops() -> Iterator[Settings]:
    settings = ops_settings()
    flush(settings)
    yield settings
    flush(settings)


def _request(**kwargs: object) -> ReplayRequest:
    values: dict[str, object] = {
        "operator": "alice",
        "reason": "downstream fixed",
        "via": "cli",
        "filter_as_given": {},
    }
    values.update(kwargs)
    if "ids" in values and not values["filter_as_given"]:
        values["filter_as_given"] = {"ids": list(values["ids"])}  # type: ignore[call-overload]
    return ReplayRequest(**values)  # type: ignore[arg-type]


def _plan(sessions: sessionmaker[Session], request: ReplayRequest) -> replays.Plan:
    with sessions() as session:
        return replays.plan_replay(session, request)


class Recorder:
    """A publisher that records ids (where a test is about the transitions, not the broker)."""

    def __init__(self, fail: bool = False) -> None:
        self.ids: list[int] = []
        self.calls: list[list[int]] = []
        self.fail = fail

    def __call__(self, dispatches: Sequence[Dispatch]) -> bool:
        self.calls.append([d.delivery_id for d in dispatches])
        self.ids += self.calls[-1]
        return not self.fail


def _execute(
    sessions: sessionmaker[Session],
    settings: Settings,
    plan: replays.Plan,
    publish: replays.Publish,
    clock: FrozenClock | None = None,
) -> replays.ReplayResult:
    clock = clock or FrozenClock(datetime.now(UTC))
    replay_id = replays.start_replay(sessions, plan, now=clock.now())
    return replays.execute(
        sessions, plan, replay_id, settings=settings, clock=clock,
        sleep=lambda s: clock.advance(timedelta(seconds=s)), publish=publish,
    )  # fmt: skip


# Pacing (pure) -------------------------------------------------------------------------------


def test_pace_never_lets_a_one_second_window_hold_more_than_the_rate() -> None:
    now, last, ran = 100.0, None, []
    for i in range(200):
        wait, _ = pace(last, now, 20.0)
        assert wait >= 0
        now += wait
        last = now
        ran.append(now)
        now += 0.003 * (i % 7)  # uneven work between replays
    for i in range(len(ran) - 20):
        assert ran[i + 20] - ran[i] >= 1.0 - 1e-9
    # Even pacing: the run takes (n - 1) / rate, not less.
    assert ran[-1] - ran[0] >= 199 / 20.0 - 1e-9


def test_pace_waits_only_what_is_left_and_never_bursts_after_a_stall() -> None:
    assert pace(None, 5.0, 2.0) == (0.0, 5.0)
    assert pace(5.0, 5.2, 2.0) == pytest.approx((0.3, 5.5))
    # A stall longer than the interval: no wait, and the next one is a full interval later.
    wait, slot = pace(5.0, 9.0, 2.0)
    assert (wait, slot) == (0.0, 9.0)
    assert pace(slot, 9.0, 2.0) == pytest.approx((0.5, 9.5))


@pytest.mark.parametrize(("rate", "work"), [(50.0, 0.0), (1000.0, 0.004), (2.5, 0.1), (0.5, 0.0)])
def test_chunks_never_move_a_delivery_before_its_slot_nor_a_second_past_the_rate(
    rate: float, work: float
) -> None:
    """Chunked replays (issue 23, item 6) keep the single-delivery pacing's promises: no
    one-second window holds more than the rate (at least one per 1 / rate below 1/s), and
    no delivery moves before the slot it would have had alone."""
    window, now, times = replays.Window(), 100.0, []
    size = replays.chunk_size(rate)
    while len(times) < 3000 and now < 400:
        wait, n = pace_chunk(window, now, rate, size)
        assert wait >= 0
        assert 1 <= n <= size
        now += wait
        moved(window, now, n)
        times += [now] * n
        now += work * (len(times) % 3)  # uneven work between chunks
    limit = max(1, int(rate))
    for i in range(len(times) - limit):
        assert times[i + limit] - times[i] >= 1.0 - 1e-9
    assert times[-1] - times[0] >= (len(times) - 1) / rate - 1e-6


def test_parse_time_accepts_iso_and_durations_ago() -> None:
    now = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)
    assert queries.parse_time("2h", now=now) == datetime(2026, 5, 1, 10, 0, tzinfo=UTC)
    assert queries.parse_time("2026-04-30T08:00Z", now=now) == datetime(2026, 4, 30, 8, tzinfo=UTC)
    assert queries.parse_time("2026-04-30", now=now) == datetime(2026, 4, 30, tzinfo=UTC)
    with pytest.raises(queries.QueryError, match="not a time"):
        queries.parse_time("yesterday-ish", now=now)


# Planning: refusals change nothing --------------------------------------------------------------


def test_requests_without_reason_operator_or_within_the_rate_cap_are_refused() -> None:
    with pytest.raises(ReplayError, match="reason is required"):
        replays.validate_request(_request(ids=(1,), reason="  "))
    with pytest.raises(ReplayError, match="operator"):
        replays.validate_request(_request(ids=(1,), operator=""))
    with pytest.raises(ReplayError, match="at most"):
        replays.validate_request(_request(ids=(1,), rate=replays.MAX_RATE + 1))
    with pytest.raises(ReplayError, match="not both"):
        replays.validate_request(_request(ids=(1,), flt=ReplayFilter(source="x")))


def test_plain_replay_of_a_succeeded_delivery_is_refused_with_a_clear_message(
    ops: Settings, sessions: sessionmaker[Session], engine: Engine
) -> None:
    source = source_with(sessions, ops)
    done = accept(ops, source)
    succeed(sessions, done)
    before = len(replay_rows(engine))
    with pytest.raises(ReplayError) as by_id:
        _plan(sessions, _request(ids=tuple(done)))
    assert by_id.value.reason == "succeeded"
    assert "already succeeded" in str(by_id.value)
    assert "--rerun-succeeded" in str(by_id.value)
    with pytest.raises(ReplayError) as by_filter:
        _plan(sessions, _request(flt=ReplayFilter(source=source.public_id, status="succeeded")))
    assert by_filter.value.reason == "succeeded"
    assert status_of(engine, done) == {done[0]: "succeeded"}
    assert len(replay_rows(engine)) == before


def test_deliveries_still_in_progress_or_unknown_are_refused(
    ops: Settings, sessions: sessionmaker[Session], engine: Engine
) -> None:
    source = source_with(sessions, ops)
    pending = accept(ops, source)
    with pytest.raises(ReplayError) as busy:
        _plan(sessions, _request(ids=tuple(pending)))
    assert busy.value.reason == "not_replayable"
    assert f"{pending[0]} (pending)" in str(busy.value)
    with pytest.raises(queries.NotFoundError, match="no such delivery: 999999999"):
        _plan(sessions, _request(ids=(pending[0], 999_999_999)))
    assert status_of(engine, pending) == {pending[0]: "pending"}


# Execution ---------------------------------------------------------------------------------


def test_replay_of_a_dead_delivery_keeps_the_key_generation_and_is_audited(
    ops: Settings, sessions: sessionmaker[Session], engine: Engine
) -> None:
    source = source_with(sessions, ops)
    dead = accept(ops, source)
    kill(sessions, dead)
    plan = _plan(sessions, _request(ids=tuple(dead)))
    assert plan.count == 1
    assert plan.sample[0].status == "dead"
    published = Recorder()
    result = _execute(sessions, ops, plan, published)
    assert (result.status, result.replayed, result.skipped) == ("done", 1, 0)
    assert published.calls == [dead]
    with engine.connect() as conn:
        row = conn.execute(text("SELECT * FROM deliveries WHERE id = :i"), {"i": dead[0]}).one()
    assert (row.status, row.generation, row.dead_reason, row.dead_at) == ("pending", 0, None, None)
    # The attempt number (the fencing token) goes on; the policy counts from the replay.
    assert (row.attempts, row.attempt_base) == (1, 1)
    [audit] = replay_rows(engine, id=result.replay_id)
    assert (audit.operator, audit.reason, audit.via, audit.status) == (
        "alice",
        "downstream fixed",
        "cli",
        "done",
    )
    assert audit.filter == {"ids": dead}
    assert (audit.planned, audit.replayed, audit.skipped) == (1, 1, 0)
    assert audit.rerun_succeeded is False
    assert audit.started_at is not None
    assert audit.ended_at is not None
    assert audit.ended_at >= audit.started_at


def test_rerun_succeeded_bumps_the_generation_and_is_audited(
    ops: Settings, sessions: sessionmaker[Session], engine: Engine
) -> None:
    source = source_with(sessions, ops)
    done = accept(ops, source)
    succeed(sessions, done)
    plan = _plan(sessions, _request(ids=tuple(done), rerun_succeeded=True))
    result = _execute(sessions, ops, plan, Recorder())
    assert result.replayed == 1
    with engine.connect() as conn:
        row = conn.execute(text("SELECT * FROM deliveries WHERE id = :i"), {"i": done[0]}).one()
    assert (row.status, row.generation, row.succeeded_at) == ("pending", 1, None)
    [audit] = replay_rows(engine, id=result.replay_id)
    assert audit.rerun_succeeded is True
    assert audit.replayed == 1


def test_a_delivery_whose_payload_retention_dropped_is_skipped_with_a_reason(
    ops: Settings, sessions: sessionmaker[Session], engine: Engine
) -> None:
    source = source_with(sessions, ops, "log", "log")
    ids = accept(ops, source)
    other = accept(ops, source)
    kill(sessions, ids + other)
    with engine.begin() as conn:  # what payload retention does to an old receipt
        conn.execute(
            text(
                "UPDATE receipts SET payload = NULL, payload_dropped_at = now() "
                "WHERE id = (SELECT receipt_id FROM deliveries WHERE id = :d)"
            ),
            {"d": ids[0]},
        )
    plan = _plan(sessions, _request(ids=tuple(ids + other)))
    assert plan.count == 4
    assert plan.without_payload == 2
    published = Recorder()
    result = _execute(sessions, ops, plan, published)
    assert (result.status, result.replayed, result.skipped) == ("done", 2, 2)
    assert {s.delivery_id for s in result.skips} == set(ids)
    assert all("payload dropped by retention" in s.reason for s in result.skips)
    assert sorted(published.ids) == sorted(other)
    assert set(status_of(engine, ids).values()) == {"dead"}
    assert set(status_of(engine, other).values()) == {"pending"}
    [audit] = replay_rows(engine, id=result.replay_id)
    assert (audit.planned, audit.replayed, audit.skipped) == (4, 2, 2)


def test_a_failed_publish_is_counted_and_the_replay_still_completes(
    ops: Settings, sessions: sessionmaker[Session], engine: Engine
) -> None:
    source = source_with(sessions, ops)
    dead = accept(ops, source) + accept(ops, source)
    kill(sessions, dead)
    unreachable = ops_settings(broker_url="redis://127.0.0.1:1/0", publish_timeout=0.5)
    publisher = CeleryPublisher(unreachable)
    try:
        result = _execute(sessions, ops, _plan(sessions, _request(ids=tuple(dead))), publisher)
    finally:
        publisher.close()
    assert (result.status, result.replayed, result.publish_failed) == ("done", 2, 2)
    # Pending in Postgres: the sweeper publishes them after publish_grace.
    assert set(status_of(engine, dead).values()) == {"pending"}


def test_filtered_replay_of_1000_dead_deliveries_honours_the_rate_cap(
    ops: Settings, sessions: sessionmaker[Session], engine: Engine
) -> None:
    source = source_with(sessions, ops, *["log"] * 10)
    now = datetime.now(UTC)
    wanted: list[int] = []
    for _ in range(100):
        wanted += accept(ops, source, event_type="order.created")
    # Decoys the filter must leave alone: another type, an older event, another source,
    # and deliveries of the right kind that are not dead.
    decoys = accept(ops, source, event_type="invoice.paid")
    _, old = accept_event(ops, source, event_type="order.created", now=now - timedelta(days=2))
    decoys += list(old.delivery_ids)
    decoys += accept(ops, source_with(sessions, ops), event_type="order.created")
    kill(sessions, wanted + decoys)
    succeeded = accept(ops, source, event_type="order.created")
    succeed(sessions, succeeded)

    rate = 50.0
    given = {"source": source.public_id, "type": "order.*", "since": "1d"}
    flt = ReplayFilter(source.public_id, "order.*", "dead", now - timedelta(days=1))
    plan = _plan(sessions, _request(flt=flt, filter_as_given=given, rate=rate))
    assert plan.count == 1000
    assert {c.delivery_id for c in plan.candidates} == set(wanted)

    clock = FrozenClock(now)
    publisher = CeleryPublisher(ops)
    try:
        result = _execute(sessions, ops, plan, publisher, clock)
    finally:
        publisher.close()

    # The preview's count is what ran, and every one was offered to admission: published to
    # the real broker while its route had room (its in-flight budget, 20 of each of the ten
    # routes), the rest waiting for a worker's dispatcher (models/admission.py). Each once.
    assert (result.status, result.planned, result.replayed, result.skipped) == (
        "done",
        1000,
        1000,
        0,
    )
    assert result.publish_failed == 0
    queued = queued_ids(ops)
    assert len(queued) == 10 * ops.route_max_in_flight
    # A chunk's admitted deliveries go out together: messages of several ids (a worker's
    # cost is per message), never more than a message may carry.
    messages = queued_messages(ops)
    assert len(messages) < len(queued)
    assert max(len(m) for m in messages) <= ops.deliveries_per_message
    gate = redis.Redis.from_url(ops.redis_url)
    try:
        waiting = [
            int(i)
            for route_id in source.route_ids
            for i in gate.zrange(f"{admission.PREFIX}w:{route_id}", 0, -1)
        ]
    finally:
        gate.close()
    assert sorted(queued + waiting) == sorted(wanted)
    assert set(status_of(engine, wanted).values()) == {"pending"}
    assert set(status_of(engine, decoys).values()) == {"dead"}
    assert set(status_of(engine, succeeded).values()) == {"succeeded"}

    # The rate cap, read from when each delivery moved (the injected clock's time): any 51
    # consecutive replays span at least one second, so no second holds more than 50.
    with engine.connect() as conn:
        moved = sorted(
            r[0]
            for r in conn.execute(
                text("SELECT updated_at FROM deliveries WHERE id = ANY(:ids)"), {"ids": wanted}
            )
        )
    window = int(rate)
    assert all(
        moved[i + window] - moved[i] >= timedelta(seconds=1) for i in range(len(moved) - window)
    )
    assert moved[-1] - moved[0] >= timedelta(seconds=999 / rate)

    [audit] = replay_rows(engine, id=result.replay_id)
    assert audit.filter == given
    assert (audit.planned, audit.replayed, audit.skipped, audit.rate) == (1000, 1000, 0, rate)
    # Leave them dead again, so no sweeper of a later test module picks up 1000 messages.
    kill(sessions, wanted)


def test_a_large_replay_by_filter_requeues_every_dead_letter_once_and_audits_it(
    ops: Settings, sessions: sessionmaker[Session], engine: Engine
) -> None:
    """3,000 dead letters by filter at MAX_RATE, in chunks: each matching one moved and
    published exactly once, nothing else touched, the audit row counts them; the same plan
    run again (a second operator, late) moves none and publishes nothing."""
    source = source_with(sessions, ops, *["log"] * 10)
    wanted: list[int] = []
    for _ in range(300):
        wanted += accept(ops, source, event_type="order.created")
    decoys = accept(ops, source, event_type="invoice.paid")
    kill(sessions, wanted + decoys)
    pending = accept(ops, source, event_type="order.created")  # not dead: not a candidate

    given = {"source": source.public_id, "type": "order.created"}
    flt = ReplayFilter(source.public_id, "order.created", "dead")
    request = _request(flt=flt, filter_as_given=given, rate=replays.MAX_RATE)
    plan = _plan(sessions, request)
    assert plan.count == 3000
    publisher = CeleryPublisher(ops)
    try:
        result = _execute(sessions, ops, plan, publisher)
        again = _execute(sessions, ops, _plan(sessions, request), publisher)
        late = _execute(sessions, ops, plan, publisher)
    finally:
        publisher.close()

    assert (result.status, result.replayed, result.skipped, result.publish_failed) == (
        "done", 3000, 0, 0,
    )  # fmt: skip
    # Each once, no duplicate, none missing: published while its route had room (its
    # in-flight budget, of each of the ten routes), the rest waiting for a dispatcher.
    queued = queued_ids(ops)
    assert len(queued) == 10 * ops.route_max_in_flight
    # In messages of up to a full batch (500 moved per chunk at MAX_RATE, 200 admitted), and
    # not one more message from the runs that came after.
    messages = queued_messages(ops)
    assert max(len(m) for m in messages) == ops.deliveries_per_message
    assert len(messages) == -(-len(queued) // ops.deliveries_per_message)
    gate = redis.Redis.from_url(ops.redis_url)
    try:
        waiting = [
            int(i)
            for route_id in source.route_ids
            for i in gate.zrange(f"{admission.PREFIX}w:{route_id}", 0, -1)
        ]
    finally:
        gate.close()
    assert sorted(queued + waiting) == sorted(wanted)
    assert set(status_of(engine, wanted).values()) == {"pending"}
    assert set(status_of(engine, decoys).values()) == {"dead"}
    assert set(status_of(engine, pending).values()) == {"pending"}
    [audit] = replay_rows(engine, id=result.replay_id)
    assert (audit.status, audit.planned, audit.replayed, audit.skipped) == ("done", 3000, 3000, 0)
    assert audit.filter == given
    # Planned again: nothing dead matches any more. Run late from the old plan: all skipped,
    # each with its reason, and not one more message.
    assert (again.planned, again.replayed) == (0, 0)
    assert (late.replayed, late.skipped) == (0, 3000)
    assert {s.reason for s in late.skips} == {
        "now pending, no longer dead: another replay or the pipeline moved it first"
    }
    [late_audit] = replay_rows(engine, id=late.replay_id)
    assert (late_audit.planned, late_audit.replayed, late_audit.skipped) == (3000, 0, 3000)
    kill(sessions, wanted)  # leave them dead, so no sweeper of a later module picks them up


# The CLI -------------------------------------------------------------------------------------


def test_cli_dry_run_shows_the_preview_and_changes_nothing(
    ops: Settings, sessions: sessionmaker[Session], engine: Engine
) -> None:
    source = source_with(sessions, ops)
    dead = accept(ops, source, event_type="order.created") + accept(
        ops, source, event_type="order.created"
    )
    kill(sessions, dead)
    before = len(replay_rows(engine))
    out = cli("replay", "--source", source.public_id, "--dry-run", env=ops_env())
    assert out.returncode == 0, out.stderr
    assert "would replay 2 deliveries" in out.stdout
    assert all(str(i) in out.stdout for i in dead)
    assert "dry run: nothing changed" in out.stdout
    as_json = cli("replay", *map(str, dead), "--dry-run", "--json", env=ops_env())
    assert as_json.returncode == 0, as_json.stderr
    preview = json.loads(as_json.stdout)["preview"]
    assert preview["count"] == 2
    assert {c["delivery_id"] for c in preview["sample"]} == set(dead)
    assert set(status_of(engine, dead).values()) == {"dead"}
    assert len(replay_rows(engine)) == before
    assert queue_length(ops) == 0


def test_cli_replay_needs_a_reason_and_a_yes_and_refuses_succeeded(
    ops: Settings, sessions: sessionmaker[Session], engine: Engine
) -> None:
    source = source_with(sessions, ops)
    dead = accept(ops, source)
    kill(sessions, dead)
    done = accept(ops, source)
    succeed(sessions, done)
    before = len(replay_rows(engine))

    no_reason = cli("replay", str(dead[0]), "--yes", env=ops_env())
    assert no_reason.returncode == 1
    assert "--reason is required" in no_reason.stderr

    declined = cli("replay", str(dead[0]), "--reason", "fixed", input_text="n\n", env=ops_env())
    assert declined.returncode == 1
    assert "Replay 1 delivery?" in declined.stdout
    assert "would replay 1 delivery:" in declined.stdout  # issue 20: not "1 deliveries"

    refused = cli("replay", str(done[0]), "--reason", "again", "--yes", env=ops_env())
    assert refused.returncode == 1
    assert "already succeeded" in refused.stderr
    assert "--rerun-succeeded" in refused.stderr

    assert status_of(engine, dead + done) == {dead[0]: "dead", done[0]: "succeeded"}
    assert len(replay_rows(engine)) == before
    assert queue_length(ops) == 0


def test_cli_replay_runs_publishes_and_audits_as_the_given_operator(
    ops: Settings, sessions: sessionmaker[Session], engine: Engine
) -> None:
    source = source_with(sessions, ops)
    dead = accept(ops, source)
    kill(sessions, dead)
    out = cli(
        "replay", str(dead[0]), "--reason", "bug 42 fixed", "--as", "bob", "--yes", "--json",
        env=ops_env(),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)["result"]
    assert (result["status"], result["replayed"], result["skipped"]) == ("done", 1, 0)
    assert queued_ids(ops) == dead
    [audit] = replay_rows(engine, id=result["replay_id"])
    assert (audit.operator, audit.reason, audit.via, audit.filter) == (
        "bob",
        "bug 42 fixed",
        "cli",
        {"ids": dead},
    )


def test_cli_events_and_dead_letters_show_what_failed_and_never_a_secret(
    ops: Settings, sessions: sessionmaker[Session]
) -> None:
    source = source_with(sessions, ops, "log", "forward_nowhere")
    body = {"id": "evt_secretive", "type": "invoice.paid", "data": {"card": "4242-very-private"}}
    event_id, outcome = accept_event(ops, source, event_type="invoice.paid", body=body)
    ok, broken = outcome.delivery_ids
    succeed(sessions, [ok])
    kill(sessions, [broken], reason="max_attempts")

    listed = cli("events", "list", "--source", source.public_id, "--json", env=ops_env())
    assert listed.returncode == 0, listed.stderr
    [event] = json.loads(listed.stdout)
    assert (event["event_id"], event["event_type"]) == (event_id, "invoice.paid")
    assert event["deliveries"] == {"succeeded": 1, "dead": 1}

    only_dead = cli(
        "events", "list", "--status", "dead", "--type", "invoice.*", "--json", env=ops_env()
    )
    assert event_id in {e["event_id"] for e in json.loads(only_dead.stdout)}

    # A bare number may also be a delivery id: the receipt is named as `events list` prints it.
    shown = cli("events", "show", f"receipt:{event['id']}", "--json", env=ops_env())
    assert shown.returncode == 0, shown.stderr
    detail = json.loads(shown.stdout)
    by_id = {d["id"]: d for d in detail["deliveries"]}
    assert by_id[broken]["status"] == "dead"
    assert by_id[broken]["dead_reason"] == "max_attempts"
    [attempt] = by_id[broken]["attempt_log"]
    assert (attempt["outcome"], attempt["error_class"]) == ("dead", "PermanentError")
    assert by_id[ok]["attempt_log"][0]["outcome"] == "succeeded"
    human = cli("events", "show", event_id, env=ops_env())
    assert human.returncode == 0, human.stderr
    assert "PermanentError" in human.stdout

    dead = cli("dead", "list", "--source", source.public_id, "--json", env=ops_env())
    assert dead.returncode == 0, dead.stderr
    [group] = json.loads(dead.stdout)
    assert (group["handler"], group["reason"], group["count"]) == (
        "forward_nowhere",
        "max_attempts",
        1,
    )
    assert group["sample_ids"] == [broken]

    for out in (listed, shown, human, dead):
        assert source.secret not in out.stdout + out.stderr
        assert "4242-very-private" not in out.stdout + out.stderr

    missing = cli("events", "show", "999999999", env=ops_env())
    assert missing.returncode == 1
    assert "no such event" in missing.stderr
