"""lane members: the unfinished deliveries of every lane in a small unpartitioned table,
kept by triggers on ``deliveries``; the lane's guard reads it; a claim of a lane's delivery
re-checks its lane under a per-lane lock

Issue 37's floor (an ordered route drains at least 0.8x an unordered one). 0028's
``webhooks_lane_clear`` read the partitioned ``deliveries``: each call locked every partition
and its indexes (86 locks, 69 outside Postgres's fast path), about 16 calls a claim, and the
shared lock manager capped an ordered route at 0.22x (bench/results_lanes.txt).

``lane_members``: one row per delivery with a lane key whose status a lane waits on (pending,
processing, retrying, dead: 0028's ``ix_deliveries_lane`` predicate), with its route, key,
status, lease and due time. Unpartitioned and small (the unfinished ordered backlog only), so
the guard is two index probes on one table: an earlier member that holds the lane (dead ones
only on a ``block`` route), or another member processing under a live lease. What a lane's
next head is (:func:`models.lanes.next_heads`), which refused deliveries a lane holds
(``waiting``) and the blocked-lanes gauge read it too, never ``deliveries``.

Kept by row triggers on ``deliveries`` (AFTER INSERT / UPDATE / DELETE, only for rows with a
lane key: the trigger's WHEN is tested in C, an unordered row costs nothing more), in the
writing statement's transaction: every statement that moves a delivery (the accept, the claim,
success, retry, dead, superseded, filtered, a replay, a re-run, a discard, retention's deletes,
a row moved to another day) keeps its member in step without knowing of it, so the table is
the lane as ``deliveries`` holds it at every commit. A day's partition dropped whole takes its
members with it (:func:`models.partitions.drop`).

A claim race: the guard reads the members in the claim statement's snapshot, so two claims of
two deliveries of one lane could both pass it when an operator's replay made an older one
claimable meanwhile (0028 admitted this gap). ``webhooks_lane_claim``, a BEFORE UPDATE row
trigger fired when a laned delivery is claimed (it becomes processing with one more attempt),
reads the lane in a fresh snapshot (a volatile function's queries take their own, in READ
COMMITTED; ``webhooks_lane_blocked``): another member processing under a live lease, or an
earlier one holding the lane, and the row is not updated (the trigger returns NULL; the claim
returns nothing for it, as a lane refusal). A clear lane: the trigger takes the lane's
transaction-scoped advisory lock (``pg_try_advisory_xact_lock`` on a 64-bit hash of route and
key) and reads the lane once more. A delivery that is not its lane's head never takes the
lock, so it never holds a head's claim back. The lock is held until the claim commits, so
the second of two racing claims of one lane either fails to take it (refused; the worker reports its
delivery held by its lane or skipped, and whoever ends the lane's delivery, or the sweeper,
publishes the head again) or reads the first's committed member. A try-lock, never a wait:
two claims of several lanes in opposite orders cannot deadlock. The instant compared with a
lease is the claim's own (``updated_at``, which every claim sets to its ``:now``: the
database's clock, or a test's pinned instant).

Backfill: every unfinished laned delivery becomes a member (under the triggers' table lock,
in the migration's transaction). Downgrade: triggers, functions and table dropped, 0028's
``webhooks_lane_clear`` (reading ``deliveries``) restored.

Revision ID: 0033
Revises: 0032
Create Date: 2026-12-07
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

from alembic import op

revision: str = "0033"
down_revision: str | None = "0032"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OPEN = "('pending', 'processing', 'retrying', 'dead')"

TABLE = """
CREATE TABLE lane_members (
    delivery_id bigint NOT NULL,
    route_id bigint NOT NULL,
    lane_key text NOT NULL,
    status text NOT NULL,
    lease_until timestamptz,
    next_attempt_at timestamptz,
    expires_at timestamptz NOT NULL,
    CONSTRAINT pk_lane_members PRIMARY KEY (delivery_id)
)
"""
INDEXES = (
    "CREATE INDEX ix_lane_members_lane ON lane_members (route_id, lane_key, delivery_id)",
    "CREATE INDEX ix_lane_members_processing ON lane_members (route_id, lane_key)"
    " WHERE status = 'processing'",
    "CREATE INDEX ix_lane_members_expires_at ON lane_members (expires_at)",
)

#: The lane condition (same name and arguments as 0028's: the claim, the sweeper's pick, the
#: accept functions and models/lanes.py call it), on the members: no earlier member holds the
#: lane, no other member is processing under a live lease. STABLE: the caller's snapshot.
LANE_CLEAR = """
CREATE OR REPLACE FUNCTION webhooks_lane_clear(
    p_route bigint, p_key text, p_id bigint, p_now timestamptz)
RETURNS boolean LANGUAGE plpgsql STABLE AS $fn$
BEGIN
    RETURN NOT EXISTS (
        SELECT 1 FROM lane_members l
        WHERE l.route_id = p_route AND l.lane_key = p_key AND l.delivery_id < p_id
          AND (l.status <> 'dead'
               OR EXISTS (SELECT 1 FROM routes lr WHERE lr.id = p_route
                            AND lr.lane_on_dead = 'block')))
      AND NOT EXISTS (
        SELECT 1 FROM lane_members l
        WHERE l.route_id = p_route AND l.lane_key = p_key AND l.status = 'processing'
          AND l.delivery_id <> p_id AND l.lease_until > p_now);
END
$fn$;
"""

#: The members kept in step with ``deliveries`` (AFTER row triggers, below).
MEMBERS = f"""
CREATE FUNCTION webhooks_lane_members() RETURNS trigger LANGUAGE plpgsql AS $fn$
BEGIN
    IF TG_OP <> 'INSERT' THEN
        IF TG_OP = 'DELETE' OR NEW.lane_key IS NULL OR NEW.status NOT IN {OPEN}
           OR NEW.lane_key IS DISTINCT FROM OLD.lane_key
           OR NEW.route_id IS DISTINCT FROM OLD.route_id THEN
            DELETE FROM lane_members WHERE delivery_id = OLD.id;
        END IF;
        IF TG_OP = 'DELETE' THEN
            RETURN NULL;
        END IF;
    END IF;
    IF NEW.lane_key IS NOT NULL AND NEW.status IN {OPEN} THEN
        IF TG_OP = 'UPDATE' THEN
            UPDATE lane_members SET route_id = NEW.route_id, lane_key = NEW.lane_key,
                status = NEW.status, lease_until = NEW.lease_until,
                next_attempt_at = NEW.next_attempt_at, expires_at = NEW.expires_at
            WHERE delivery_id = NEW.id;
            IF FOUND THEN
                RETURN NULL;
            END IF;
        END IF;
        INSERT INTO lane_members AS m (delivery_id, route_id, lane_key, status, lease_until,
                                       next_attempt_at, expires_at)
        VALUES (NEW.id, NEW.route_id, NEW.lane_key, NEW.status, NEW.lease_until,
                NEW.next_attempt_at, NEW.expires_at)
        ON CONFLICT (delivery_id) DO UPDATE SET
            route_id = EXCLUDED.route_id, lane_key = EXCLUDED.lane_key,
            status = EXCLUDED.status, lease_until = EXCLUDED.lease_until,
            next_attempt_at = EXCLUDED.next_attempt_at, expires_at = EXCLUDED.expires_at;
    END IF;
    RETURN NULL;
END
$fn$;
"""  # noqa: S608 (OPEN is a literal of this module)
TRIGGERS = (
    "CREATE TRIGGER lane_members_insert AFTER INSERT ON deliveries FOR EACH ROW"
    " WHEN (NEW.lane_key IS NOT NULL) EXECUTE FUNCTION webhooks_lane_members()",
    "CREATE TRIGGER lane_members_update"
    " AFTER UPDATE OF status, lease_until, next_attempt_at, lane_key, route_id, expires_at"
    " ON deliveries FOR EACH ROW"
    " WHEN (OLD.lane_key IS NOT NULL OR NEW.lane_key IS NOT NULL)"
    " EXECUTE FUNCTION webhooks_lane_members()",
    "CREATE TRIGGER lane_members_delete AFTER DELETE ON deliveries FOR EACH ROW"
    " WHEN (OLD.lane_key IS NOT NULL) EXECUTE FUNCTION webhooks_lane_members()",
    "CREATE TRIGGER lane_claim BEFORE UPDATE ON deliveries FOR EACH ROW"
    " WHEN (NEW.lane_key IS NOT NULL AND NEW.status = 'processing'"
    " AND NEW.attempts IS DISTINCT FROM OLD.attempts)"
    " EXECUTE FUNCTION webhooks_lane_claim()",
)

#: A claim of a laned delivery, re-checked under its lane's lock (see the docstring). The
#: queries of a trigger take their own snapshot: they see every claim committed before.
CLAIM = """
CREATE FUNCTION webhooks_lane_blocked(p_route bigint, p_key text, p_id bigint, p_now timestamptz)
RETURNS boolean LANGUAGE plpgsql VOLATILE AS $fn$
BEGIN
    RETURN EXISTS (
        SELECT 1 FROM lane_members l
        WHERE l.route_id = p_route AND l.lane_key = p_key AND l.delivery_id < p_id
          AND (l.status <> 'dead'
               OR EXISTS (SELECT 1 FROM routes lr WHERE lr.id = p_route
                            AND lr.lane_on_dead = 'block'))
    ) OR EXISTS (
        SELECT 1 FROM lane_members l
        WHERE l.route_id = p_route AND l.lane_key = p_key
          AND l.status = 'processing' AND l.delivery_id <> p_id AND l.lease_until > p_now
    );
END
$fn$;

CREATE FUNCTION webhooks_lane_claim() RETURNS trigger LANGUAGE plpgsql AS $fn$
BEGIN
    -- Not the lane's head: refused, without the lock (a head's claim never waits on it).
    IF webhooks_lane_blocked(NEW.route_id, NEW.lane_key, NEW.id, NEW.updated_at) THEN
        RETURN NULL;
    END IF;
    IF NOT pg_try_advisory_xact_lock(hashtextextended(NEW.lane_key, NEW.route_id)) THEN
        RETURN NULL;
    END IF;
    -- Under the lock: a claim of the lane committed since the read above is seen now.
    IF webhooks_lane_blocked(NEW.route_id, NEW.lane_key, NEW.id, NEW.updated_at) THEN
        RETURN NULL;
    END IF;
    RETURN NEW;
END
$fn$;
"""

BACKFILL = f"""
INSERT INTO lane_members (delivery_id, route_id, lane_key, status, lease_until,
                          next_attempt_at, expires_at)
SELECT id, route_id, lane_key, status, lease_until, next_attempt_at, expires_at
FROM deliveries WHERE lane_key IS NOT NULL AND status IN {OPEN}
ON CONFLICT (delivery_id) DO NOTHING
"""  # noqa: S608 (OPEN is a literal of this module)


def upgrade() -> None:
    op.execute(TABLE)
    for index in INDEXES:
        op.execute(index)
    op.execute(MEMBERS)
    op.execute(CLAIM)
    # The triggers' lock on deliveries (SHARE ROW EXCLUSIVE) stops every writer until this
    # transaction commits: no delivery can change between the backfill's read and the end.
    for trigger in TRIGGERS:
        op.execute(trigger)
    op.execute(BACKFILL)
    op.execute(LANE_CLEAR)


def downgrade() -> None:
    for name in ("lane_claim", "lane_members_delete", "lane_members_update", "lane_members_insert"):
        op.execute(f"DROP TRIGGER {name} ON deliveries")
    op.execute("DROP FUNCTION webhooks_lane_claim()")
    op.execute("DROP FUNCTION webhooks_lane_blocked(bigint, text, bigint, timestamptz)")
    op.execute("DROP FUNCTION webhooks_lane_members()")
    old = importlib.import_module("models.migrations.versions.0028_route_lanes")
    op.execute(old.LANE_CLEAR.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1))
    op.execute("DROP TABLE lane_members")
