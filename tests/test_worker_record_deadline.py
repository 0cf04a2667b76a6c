"""When recording an outcome cannot succeed in time (issue 19, section 0): the worker retries
the success's record on fresh connections for ``WEBHOOKS_RECORD_RETRY_SECONDS``, then stops
trying and leaves the delivery to its lease, as after a crash. Nothing is lost: once the
database is reachable again the lease runs out, the sweeper republishes the delivery, and its
second call carries the first call's idempotency key, which is what lets the downstream make
the effect once. A real worker whose every database connection goes through a proxy that the
test cuts (Postgres itself keeps running for everyone else)."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from tests.conftest import TEST_DB
from tests.netproxy import CuttableProxy
from tests.workers import (
    attempts,
    delivery,
    new_dispatches,
    publish_one_message,
    running_beat,
    running_worker,
    wait_for,
    wait_status,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("clean_worker_state")]

RECORD_WITHIN = 1.5


def test_an_unrecordable_success_takes_the_lease_path_and_repeats_under_the_same_key(
    tmp_path: Path, sessions: sessionmaker[Session], engine: Engine
) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    (dispatch,) = new_dispatches(sessions, [("gate", {"marker_dir": str(marks)})])
    publish_one_message([dispatch])
    proxy = CuttableProxy(5432)  # the worker's way to Postgres; the test's own is direct
    via_proxy = f"postgresql://postgres@127.0.0.1:{proxy.port}/{TEST_DB}"
    try:
        with running_worker(
            "unrecorded", tmp_path, database_url=via_proxy, record_retry_seconds=RECORD_WITHIN
        ) as worker:
            calls = wait_for(
                lambda: sorted(marks.glob(f"{dispatch.delivery_id}.*")),
                timeout=30,
                what="the handler to have made its effect and wait at the gate",
            )
            proxy.cut()  # the database is unreachable from the worker from now on
            (marks / "open").write_text("")
            wait_for(
                lambda: "delivery.record_abandoned" in worker.output(),
                timeout=30,
                what="the worker to give up recording after its retry time",
            )
            # It gave up, and did not hand the delivery back: it is still leased.
            assert delivery(engine, dispatch.delivery_id).status == "processing"
            proxy.restore()
            # The lease runs out (4 x the hard limit), the sweeper republishes the delivery.
            with running_beat(tmp_path):
                row = wait_status(engine, dispatch.delivery_id, "succeeded", timeout=60)
            log = worker.output()
    finally:
        proxy.close()
    calls = sorted(marks.glob(f"{dispatch.delivery_id}.*"))
    keys = {p.read_text() for p in calls}
    # The downstream was called again (the first success was never recorded), both times
    # with the one idempotency key of this delivery event.
    assert len(calls) == 2, calls
    assert len(keys) == 1, keys
    assert [a.outcome for a in attempts(engine, dispatch.delivery_id)][-1] == "succeeded"
    assert row.attempts >= 2
    assert log.count("delivery.record_abandoned") == 1
    assert "delivery.record_retry" in log
    assert "Traceback" not in log, log[-4000:]
