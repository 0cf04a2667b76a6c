"""The capacity gauges (issue 19, section 4): the fast tier's keys and memory against
maxmemory, and the partitions laid out ahead and past days not dropped; measured on real
Redis and Postgres, and exported by a real worker's metrics server after maintenance."""

from __future__ import annotations

import struct
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg
import pytest
import redis
from prometheus_client.mmap_dict import MmapedDict, mmap_key
from prometheus_client.multiprocess import MultiProcessCollector
from sqlalchemy import Engine, text

from core.metrics import SettledFiles
from core.settings import Settings
from models.db import make_engine, make_sessionmaker, upgrade
from models.retention_expiry import expire_partitions
from models.retention_layout import ensure_partitions
from tasks.capacity import measure_fast_tier, measure_partitions
from tests.conftest import ADMIN_DSN, REDIS, TEST_DB, free_port, make_settings, wait_for_port
from tests.factories import make_source
from tests.leakcheck import remember
from tests.workers import (
    CLAIMS_URL,
    Broker,
    running_worker,
    scrape_metrics,
    wait_for,
    worker_settings,
)

PRIVATE = f"{REDIS}/9"  # nobody else's keys
DAY = timedelta(days=1)
# Days no other test lays out partitions for (they work in 2024 and later).
T = datetime(2021, 3, 10, 12, tzinfo=UTC)


@pytest.fixture
def private_redis() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(PRIVATE)
    client.flushdb()
    (before,) = client.config_get("maxmemory").values()
    yield client
    client.config_set("maxmemory", before)
    client.flushdb()
    client.close()


def test_the_fast_tier_counts_its_keys_and_reads_memory_against_maxmemory(
    private_redis: redis.Redis,
) -> None:
    assert measure_fast_tier(private_redis).keys == 0
    for i in range(25):  # as the claims write them: claim:<delivery>:<generation>, PX
        private_redis.set(f"claim:{i}:0", "t", px=60_000)
    private_redis.config_set("maxmemory", 512 * 1024 * 1024)
    tier = measure_fast_tier(private_redis)
    assert tier.keys == 25
    assert tier.maxmemory == 512 * 1024 * 1024
    assert 0 < tier.used_memory == pytest.approx(private_redis.info("memory")["used_memory"], 0.2)
    private_redis.config_set("maxmemory", 0)
    assert measure_fast_tier(private_redis).maxmemory == 0  # no limit


def _drop_database(name: str) -> None:
    with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,)
        )
        conn.execute(f'DROP DATABASE IF EXISTS "{name}"')


@pytest.fixture(scope="module")
def own_database() -> Iterator[tuple[Settings, Engine]]:
    """A database of this module's own: the layout is exactly what these tests make."""
    name = f"{TEST_DB}_capacity"
    settings = make_settings(database_url=f"postgresql://postgres@127.0.0.1:5432/{name}")
    _drop_database(name)
    upgrade(settings)  # lays out partitions from the database's now
    engine = make_engine(settings, pool_size=2)
    try:
        yield settings, engine
    finally:
        engine.dispose()
        _drop_database(name)


def test_partition_days_ahead_and_past(own_database: tuple[Settings, Engine]) -> None:
    settings, engine = own_database
    ahead = settings.partition_ahead_days
    # As laid out by the migration, on the database's clock.
    assert measure_partitions(engine, settings, None).ahead == ahead
    assert measure_partitions(engine, settings, None).past == 0
    # A source (Standard Webhooks, about 6 days): only existing sources size the layout.
    remember(make_source(make_sessionmaker(engine), settings, provider="standard").secret)
    ensure_partitions(engine, settings, T)
    assert measure_partitions(engine, settings, T).ahead == ahead
    assert measure_partitions(engine, settings, T).past == 0
    # Three days on without maintenance: three days fewer ahead, three past days not dropped.
    later = T + 3 * DAY
    assert measure_partitions(engine, settings, later).ahead == ahead - 3
    assert measure_partitions(engine, settings, later).past == 3
    # Far on: what was laid out no longer covers what a receipt accepted then needs.
    far = T + (ahead + 2) * DAY
    assert measure_partitions(engine, settings, far).ahead == -2
    # Maintenance at ``later``: laid out again, and the past days dropped.
    ensure_partitions(engine, settings, later)
    expire_partitions(engine, settings, later)
    assert measure_partitions(engine, settings, later).ahead == ahead
    assert measure_partitions(engine, settings, later).past == 0
    # A hole in the run of days is where "ahead" ends, whatever lies beyond it.
    hole = (later + 2 * DAY).date()
    with engine.begin() as conn:
        for table in ("attempts", "deliveries"):  # one table's leaf missing is enough
            conn.execute(text(f"DROP TABLE {table}_p{hole:%Y%m%d}"))
    needed = (later + _longest(engine, settings)).date()
    assert hole < needed  # a receipt accepted now may land beyond the hole: not covered
    assert measure_partitions(engine, settings, later).ahead == (hole - DAY - needed).days < 0


def _longest(engine: Engine, settings: Settings) -> timedelta:
    from core.ttl import MAX_EVENT_TIME_LEAD  # noqa: PLC0415
    from models.retention_layout import longest_ttl  # noqa: PLC0415

    return longest_ttl(engine, settings) + MAX_EVENT_TIME_LEAD


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_worker_exports_the_capacity_gauges_after_maintenance(tmp_path: Path) -> None:
    claims = redis.Redis.from_url(CLAIMS_URL)
    claims.flushdb()
    for i in range(7):
        claims.set(f"claim:{i}:0", "t", px=120_000)
    port = free_port()
    broker = Broker(worker_settings())
    try:
        with running_worker(
            "capacity",
            tmp_path,
            pool="prefork",
            concurrency=1,
            worker_metrics_port=port,
            metrics_dir=str(tmp_path / "metrics"),
            # No dispatcher: its admission keys (adm:*) would share the claims database and
            # the count of keys this test planted.
            admission=False,
        ) as worker:
            wait_for_port(port, worker.proc)
            # A file a pool child has created but not yet sized (prometheus/client_python
            # #1199): the scrape leaves it out instead of answering 500.
            (directory,) = (tmp_path / "metrics").glob("worker-*")
            (directory / "counter_1.db").touch()
            before = time.time()
            broker.maintenance()

            def measured() -> dict[tuple[str, tuple[tuple[str, str], ...]], float] | None:
                samples = scrape_metrics(port)
                wanted = (
                    ("webhooks_partition_days", (("state", "ahead"),)),
                    ("webhooks_job_last_success_timestamp_seconds", (("job", "maintenance"),)),
                )
                return samples if all(key in samples for key in wanted) else None

            samples = wait_for(measured, timeout=60, what="the maintenance run's gauges")
    finally:
        broker.close()
        claims.flushdb()
        claims.close()
    settings = make_settings()
    assert samples[("webhooks_partition_days", (("state", "ahead"),))] == (
        settings.partition_ahead_days
    )
    # The shared database's past days (a live lease may postpone one): measured, whatever.
    assert samples[("webhooks_partition_days", (("state", "past"),))] >= 0
    assert samples[("webhooks_fast_tier_keys", ())] == 7
    assert samples[("webhooks_fast_tier_used_memory_bytes", ())] > 0
    assert ("webhooks_fast_tier_maxmemory_bytes", ()) in samples
    # The run's success and the jobs' periods (issue 35 item 5: the stale-job alert).
    maintained = samples[("webhooks_job_last_success_timestamp_seconds", (("job", "maintenance"),))]
    assert before <= maintained <= time.time()
    periods = {
        job: samples[("webhooks_job_period_seconds", (("job", job),))]
        for job in ("sweep", "maintenance", "reconcile")
    }
    interval = worker_settings().maintenance_interval.total_seconds()
    assert periods == {
        "sweep": worker_settings().sweep_interval.total_seconds(),
        "maintenance": interval,
        "reconcile": 60.0,
    }


def test_a_scrape_leaves_out_a_file_its_process_has_not_sized(tmp_path: Path) -> None:
    """A process creating its multi-process file leaves it at 0 bytes for a moment (one
    killed then leaves it so for good): prometheus-client's own collector fails the whole
    scrape on it; ours sums the other files and leaves it out."""
    written = MmapedDict(str(tmp_path / "counter_100.db"))
    key = mmap_key("webhooks_x_total", "webhooks_x_total", ["source"], ["a"], "x")
    written.write_value(key, 3.0, 0.0)
    written.close()
    (tmp_path / "counter_101.db").touch()
    with pytest.raises(struct.error):
        list(MultiProcessCollector(None, path=str(tmp_path)).collect())
    (family,) = SettledFiles(str(tmp_path)).collect()
    assert [(s.name, s.labels, s.value) for s in family.samples] == [
        ("webhooks_x_total", {"source": "a"}, 3.0)
    ]
