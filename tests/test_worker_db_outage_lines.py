"""Postgres unreachable from a running worker and beat: the periodic sweep logs one
structured line per run (``sweep.failed`` with the error's class), never a traceback, and
sweeps again once the database is back. Real processes; the worker's connections go through a
proxy the test cuts, so Postgres keeps running for everyone else."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import TEST_DB
from tests.netproxy import CuttableProxy
from tests.workers import flush_redis, running_beat, running_worker, wait_for

pytestmark = pytest.mark.slow


def test_a_sweep_without_its_database_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    flush_redis()
    proxy = CuttableProxy(5432)
    via_proxy = f"postgresql://postgres@127.0.0.1:{proxy.port}/{TEST_DB}"
    try:
        with (
            running_worker("outage", tmp_path, database_url=via_proxy) as worker,
            running_beat(tmp_path),
        ):
            wait_for(
                lambda: "Task webhooks.sweep[" in worker.output(),
                timeout=30,
                what="a first sweep while the database answers",
            )
            proxy.cut()  # open connections die; new ones are refused
            wait_for(
                lambda: worker.output().count("sweep.failed") >= 2,
                timeout=30,
                what="two sweeps to fail while the database is unreachable",
            )
            failed = worker.output().count("sweep.failed")
            proxy.restore()

            def swept_after_the_outage() -> bool:
                after = worker.output().rsplit("sweep.failed", 1)[1]
                return "Task webhooks.sweep[" in after and "succeeded in" in after

            wait_for(
                swept_after_the_outage,
                timeout=30,
                what="a sweep to run through once the database is back",
            )
            log = worker.output()
    finally:
        proxy.close()
    assert failed >= 2
    assert "Traceback" not in log, log[-3000:]
    assert "raised unexpected" not in log
    lines = [ln for ln in log.splitlines() if "sweep.failed" in ln]
    assert all('"error_class":' in ln for ln in lines), lines[:3]
