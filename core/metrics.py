"""Prometheus metrics, shared by the receiver and the workers.

Workers (and a multi-process receiver) run in prometheus-client's multiprocess mode: the entry
point sets PROMETHEUS_MULTIPROC_DIR from WEBHOOKS_METRICS_DIR before this module is imported.

Every process imports every definition here, and an unlabelled metric exists (at zero) as soon
as it is defined, so each process would list the others' series too. Each exposition point
(the receiver's ``/metrics``, the workers' metrics server) therefore drops the families that
belong to the other kind of process (:func:`exposed`). A family in neither list below is shown
by both: a new metric is never silently hidden.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import CollectorRegistry

# Receiver.
REQUESTS = Counter(
    "webhooks_requests_total", "Webhook requests by source and outcome", ["source", "outcome"]
)
DUPLICATES = Counter(
    "webhooks_duplicates_total", "Duplicate deliveries (same id, same body)", ["source"]
)
CONFLICTS = Counter("webhooks_conflicts_total", "Same event id, different body", ["source"])
# An accepted event a route's filter did not match (core.filters): a ``filtered`` delivery,
# no work for that route's workers. ``route``: the route's id.
FILTERED = Counter(
    "webhooks_filtered_total",
    "Accepted events a route's filter did not match, by source and route",
    ["source", "route"],
)
# A delivery its route's transform dropped (returned None, tasks.transforms): it ends
# ``filtered`` on the worker, its handler never called. ``route``: the route's id.
TRANSFORM_DROPPED = Counter(
    "webhooks_transform_dropped_total",
    "Deliveries a route's transform dropped (filtered on the worker), by source and route",
    ["source", "route"],
)
# A stored secret refused where it was read (core.crypto): ``misplaced``, sealed for another row
# or purpose (copied there: alerted); ``unbound``, written before binding (run db upgrade).
SECRETS_REFUSED = Counter(
    "webhooks_secrets_refused_total",
    "Stored secrets refused where they were read, by purpose and reason",
    ["purpose", "reason"],
)
PUBLISH_FAILURES = Counter(
    "webhooks_publish_failures_total", "Messages not published after commit", ["source"]
)
PUBLISH_DEFERRED = Counter(
    "webhooks_publish_deferred_total",
    "Deliveries left pending for the sweeper without a publish attempt: the publisher's queue "
    "was full (queue_full) or its thread died holding them (publisher_died)",
    ["source", "reason"],
)
PUBLISHER_DEATHS = Counter(
    "webhooks_publisher_deaths_total",
    "Times the receiver's publisher thread died (each one restarted; see the publisher_died log)",
)
ACCEPT_LATENCY = Histogram(
    "webhooks_accept_latency_seconds",
    "Time from request start to the durable 2xx",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
)
ACCEPT_BATCH = Histogram(
    "webhooks_accept_batch_size",
    "Receipts committed together by one accept statement (group commit)",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1000),
)

TTL_RAISED = Counter(
    "webhooks_ttl_raised_total",
    "Receipts accepted with the dedup TTL raised to the minimum safe value "
    "(the source's TTL no longer covers its provider's retry window)",
    ["source"],
)
SOURCES_TTL_RAISED = Gauge(
    "webhooks_sources_ttl_raised",
    "Sources whose dedup TTL is below their retry window (raised), found at process start",
    multiprocess_mode="mostrecent",
)

RECEIVER_LIMITS = Counter(
    "webhooks_receiver_limits_total",
    "Requests and connections the receiver's server limits refused or closed",
    ["limit"],
)
CLIENT_DISCONNECTS = Counter(
    "webhooks_client_disconnects_total", "Senders that went away before their body arrived"
)
# The admin plane's (ADMIN_PLANE below), counted where it runs: the receiver's process, or the
# supervisor of several receiver processes, which imported prometheus_client before it set the
# multiprocess directory, so it counts in its own memory: its /metrics adds these families
# from its own registry to the receivers' files (ingest.admin.server.metrics_endpoint).
LOGINS_THROTTLED = Counter(
    "webhooks_logins_throttled_total",
    "Admin logins refused by the login throttle before their token was compared, by the budget "
    "that was used up (client: the address's; global: every address's) and where (console, "
    "api, docs)",
    ["scope", "via"],
)

# Workers.
# The delivery counters carry the source's public id (seed 004: scope), a bounded label:
# sources are created by an operator, a handful to a few hundred, as the receiver's
# webhooks_requests_total{source} already assumes. A delivery the worker did not claim
# (duplicate, skipped, held, missing, isolated, unclaimed) has source="": the message carries
# ids only, and reading its source would cost a statement (the label is then absent in PromQL).
DELIVERIES = Counter(
    "webhooks_deliveries_total", "Delivery attempts by outcome and source", ["outcome", "source"]
)
RETRIES = Counter("webhooks_retries_total", "Retries scheduled, by source", ["source"])
DEAD_LETTERS = Counter(
    "webhooks_dead_letters_total",
    "Deliveries that went dead, by reason and source",
    ["reason", "source"],
)
CLAIMS = Counter(
    "webhooks_claims_total",
    "Fast-tier claims: first delivery, duplicate (idempotency hit) or degraded (Redis down)",
    ["result"],
)
DEGRADED = Counter("webhooks_degraded_claims_total", "Claims made on the durable tier alone")
# Messages of one bare id whose claim (step 0-2) or success (step 4) one worker thread ran
# for the others arriving at once (tasks/steps/together.py): ``requests`` counts the
# messages, ``calls`` the shared runs; requests / calls is the mean number sharing one.
SHARED_STEPS = Counter(
    "webhooks_shared_steps_total",
    "Bare-id messages' claims and successes (requests) and the shared runs of them (calls)",
    ["step", "counted"],
)
# The named windows in which a downstream can see one delivery twice (docs/workers.md): an
# attempt that follows one whose call may have reached the downstream without its answer
# being recorded. lease_taken_over: a claim took over the lease of a worker lost holding it
# (killed, frozen, cut off after its claim); answer_timeout: a retry after a call that was
# sent and timed out (its own I/O timeout or a time limit) before the answer came.
REPEAT_WINDOWS = Counter(
    "webhooks_repeat_windows_total",
    "Attempts that may repeat a call the downstream already received, by cause",
    ["cause"],
)
OLDEST_PENDING = Gauge(
    "webhooks_oldest_pending_seconds",
    "Age of the oldest unfinished delivery, measured by the sweeper",
    # The latest sweep's reading, not the maximum ever seen by some (possibly dead) process.
    multiprocess_mode="mostrecent",
)
RECEIPT_TO_SUCCESS = Histogram(
    "webhooks_receipt_to_success_seconds",
    "Time from receipt to succeeded",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 3600, 86400),
)
SWEPT = Counter("webhooks_swept_total", "Deliveries re-published by the sweeper")
RECORD_RETRIES = Counter(
    "webhooks_record_retries_total",
    "Outcome records (succeed, retry, dead) tried again after a database connection error",
    ["action"],
)
RETRY_AFTER_IGNORED = Counter(
    "webhooks_retry_after_ignored_total",
    "Retry-After headers from downstreams that were neither seconds nor an HTTP date",
)
BREAKER_CHANGES = Counter(
    "webhooks_route_breaker_changes_total",
    "Circuit breaker and pause state changes by route and the state entered",
    ["route", "state"],
)
BREAKER_STATE = Gauge(
    "webhooks_route_breaker_state",
    "A route's circuit breaker: 0 closed, 1 half-open, 2 open (paused routes: 3)",
    ["route"],
    multiprocess_mode="mostrecent",
)
# Ordered lanes (models/lanes.py, issue 37 items 2 and 3). ``route``: the route's id.
SUPERSEDED = Counter(
    "webhooks_superseded_total",
    "Events recorded superseded (a newer event of their lane key had succeeded on the route;"
    " handler not called), by source and route",
    ["source", "route"],
)
LANES_BLOCKED = Gauge(
    "webhooks_lanes_blocked",
    "Lanes of a route (--lane-on-dead block) whose head is a dead letter, measured by the sweeper",
    ["route"],
    multiprocess_mode="mostrecent",
)
ROUTES_DISABLED = Counter(
    "webhooks_routes_disabled_total",
    "Routes the sweep disabled because their circuit breaker stayed open longer than"
    " WEBHOOKS_ROUTE_DISABLE_AFTER (models/route_ends.py)",
    ["route"],
)
ADMISSIONS = Counter(
    "webhooks_admissions_total",
    "Deliveries offered to admission (models/admission.py) by outcome: admitted, waiting,"
    " duplicate, drained (admitted from waiting), scheduled (a retry waiting to be due),"
    " failed_open (Redis or Postgres failed)",
    ["outcome"],
)
# When a process last went on without Redis (admission failed open; the receiver's
# publisher and the sweeper): the console's degraded card reads it (and the count above)
# from the receiver's own metrics, not a ping of its own. "max": the latest of any process.
FAIL_OPEN_LAST = Gauge(
    "webhooks_fail_open_last_timestamp_seconds",
    "When admission last failed open (Redis or Postgres failed; published without limits),"
    " Unix time",
    multiprocess_mode="max",
)

# Capacity (tasks/capacity.py): measured by each maintenance run, on a worker.
FAST_TIER_KEYS = Gauge(
    "webhooks_fast_tier_keys",
    "Keys in the fast claim tier's Redis database (claim keys), from INFO keyspace",
    multiprocess_mode="mostrecent",
)
FAST_TIER_USED_MEMORY = Gauge(
    "webhooks_fast_tier_used_memory_bytes",
    "Memory the fast claim tier's Redis uses (INFO memory used_memory)",
    multiprocess_mode="mostrecent",
)
FAST_TIER_MAXMEMORY = Gauge(
    "webhooks_fast_tier_maxmemory_bytes",
    "The fast claim tier's Redis maxmemory (0: no limit)",
    multiprocess_mode="mostrecent",
)
PARTITION_DAYS = Gauge(
    "webhooks_partition_days",
    "Daily partitions: whole days laid out beyond what a receipt accepted now can need "
    "(state=ahead), and days wholly past still not dropped (state=past)",
    ["state"],
    multiprocess_mode="mostrecent",
)
# The queue-lag term of the dedup TTL against what the pipeline measures (issue 35 item 4):
# each maintenance run reads from the database, per source, the p99 of the time from receipt
# to final outcome over the last day (models/queue_lag.py), beside the source's queue_lag
# term; WebhookQueueLagOverBudget fires when the first exceeds the second.
QUEUE_LAG_P99 = Gauge(
    "webhooks_queue_lag_p99_seconds",
    "p99 time from receipt to each delivery's final outcome (unfinished: its age so far) over"
    " the last 24 h, per source, measured from the database by maintenance (0: no delivery)",
    ["source"],
    multiprocess_mode="mostrecent",
)
# When each source's p99 was measured: the alert compares only fresh readings, so a worker that
# measured a backlog once and has not run maintenance since does not keep it firing.
QUEUE_LAG_MEASURED = Gauge(
    "webhooks_queue_lag_measured_timestamp_seconds",
    "When maintenance last measured each source's p99 queue lag, Unix time (database clock)",
    ["source"],
    multiprocess_mode="mostrecent",
)
QUEUE_LAG_BUDGET = Gauge(
    "webhooks_queue_lag_budget_seconds",
    "Each source's queue_lag term of its dedup TTL (its override or WEBHOOKS_QUEUE_LAG_BUDGET)",
    ["source"],
    multiprocess_mode="mostrecent",
)

# The periodic jobs (beat's schedule, run on workers): when each last finished without an
# error, and how often beat schedules it, so an alert sees a job that stopped (beat down, no
# worker on the maintenance queue, every run failing) by time passing, not by a value the
# stopped job would have had to write (deploy/alerts.yml, WebhookPeriodicJobStale). "max":
# the latest success over every process, including exited pool children.
JOB_LAST_SUCCESS = Gauge(
    "webhooks_job_last_success_timestamp_seconds",
    "When each periodic job (sweep, maintenance, reconcile, watchdog, drift) last finished"
    " without an"
    " error, Unix time",
    ["job"],
    multiprocess_mode="max",
)
JOB_PERIOD = Gauge(
    "webhooks_job_period_seconds",
    "How often beat schedules each periodic job (sweep, maintenance, reconcile, drift), seconds",
    ["job"],
    multiprocess_mode="max",
)
EXPIRED_ROWS = Gauge(
    "webhooks_expired_rows",
    "Delete mode: rows expired at the last maintenance run's instant that its batched delete"
    " would remove, still there after it (up to 10,000 per table; normally 0)",
    ["table"],
    multiprocess_mode="mostrecent",
)

# The horizon, re-checked (core/horizon.py): each provider's retry window, how many days ago it
# was last verified against its cited page (+Inf: never) and whether that makes it due for
# review (1) under WEBHOOKS_HORIZON_REVIEW_AFTER, set by each maintenance run on a worker from
# the registry alone. The alert reads "due", so the threshold lives in one place, the setting.
PROVIDER_WINDOW_AGE = Gauge(
    "webhooks_provider_window_verified_age_days",
    "Days since each provider's retry window was last verified against its documentation"
    " (+Inf: never verified)",
    ["provider"],
    multiprocess_mode="mostrecent",
)
PROVIDER_WINDOW_DUE = Gauge(
    "webhooks_provider_window_review_due",
    "1 when a provider's retry window is due for review: verified longer ago than"
    " WEBHOOKS_HORIZON_REVIEW_AFTER, never, or dated after today; else 0",
    ["provider"],
    multiprocess_mode="mostrecent",
)
# Do the live processes derive the same dedup TTLs (issue 35 item 3, core/ttl_fingerprint.py)?
# Each maintenance run compares the receivers' and workers' recorded TTL inputs over every
# source; WebhookTtlFingerprintsDisagree reads the first from the worker that checked last.
TTL_FINGERPRINT_DISAGREEMENTS = Gauge(
    "webhooks_ttl_fingerprint_disagreements",
    "Sources for which live receivers and workers derive different dedup TTLs (their recorded"
    " TTL inputs differ: settings, provider windows); webhooks ttl check lists them",
    multiprocess_mode="mostrecent",
)
TTL_FINGERPRINT_PROCESSES = Gauge(
    "webhooks_ttl_fingerprint_processes",
    "Live receivers and workers whose dedup TTL inputs maintenance compared (recorded in"
    " Postgres, seen within WEBHOOKS_TTL_FINGERPRINT_STALE_AFTER)",
    multiprocess_mode="mostrecent",
)
TTL_FINGERPRINT_CHECKED = Gauge(
    "webhooks_ttl_fingerprint_checked_timestamp_seconds",
    "When maintenance last compared the live processes' TTL inputs, Unix time (database clock)",
    multiprocess_mode="mostrecent",
)

# Payload shape drift (issue 38 item 3, tasks/drift.py): open findings per source and kind
# (new_path, type_changed, path_gone), set by each learning run on a worker.
DRIFT_FINDINGS = Gauge(
    "webhooks_drift_findings",
    "Open payload shape drift findings (a JSON key path new, changed type or gone) per source"
    " and kind; webhooks drift list shows them, webhooks drift accept closes them",
    ["source", "kind"],
    multiprocess_mode="mostrecent",
)

# Retention and operators.
DEAD_LETTERS_DISCARDED = Counter(
    "webhooks_dead_letters_discarded_total",
    "Dead letters removed: their retention ended (retention) or an operator discarded them",
    ["via"],
)

# Reconciliation (webhooks reconcile, and beat's schedule on the workers).
RECONCILE_MISSING = Counter(
    "webhooks_reconcile_missing_total",
    "Events the provider sent that had no receipt, found by reconciliation",
    ["source"],
)
RECONCILE_RECOVERED = Counter(
    "webhooks_reconcile_recovered_total",
    "Missing events recovered by reconciliation (accepted, or redelivery requested)",
    ["source"],
)
RECONCILE_API_ERRORS = Counter(
    "webhooks_reconcile_api_errors_total",
    "Reconciliation runs stopped by a provider API error, by HTTP status (none: no answer)",
    ["source", "status"],
)

# The subscription watchdog (issue 38 item 1, tasks.watchdog): 1 per open finding about a
# source's endpoint at its provider (disabled, deleted, url_mismatch, events_missing,
# cannot_check), 0 once closed; set from the findings table by each of beat's ticks.
SUBSCRIPTION_FINDINGS = Gauge(
    "webhooks_subscription_findings",
    "Open findings of the subscription watchdog about a source's endpoint at its provider"
    " (1: open; 0: closed), by kind",
    ["source", "kind"],
    multiprocess_mode="mostrecent",
)

# Which process exposes which families (by family name: a counter's without ``_total``).
Process = Literal["receiver", "worker"]
RECEIVER_ONLY: tuple[Any, ...] = (
    REQUESTS,
    DUPLICATES,
    CONFLICTS,
    FILTERED,
    PUBLISH_FAILURES,
    PUBLISH_DEFERRED,
    PUBLISHER_DEATHS,
    ACCEPT_LATENCY,
    ACCEPT_BATCH,
    TTL_RAISED,
    RECEIVER_LIMITS,
    CLIENT_DISCONNECTS,
    LOGINS_THROTTLED,
)
WORKER_ONLY: tuple[Any, ...] = (
    RECONCILE_MISSING,
    RECONCILE_RECOVERED,
    RECONCILE_API_ERRORS,
    SUBSCRIPTION_FINDINGS,
    DELIVERIES,
    RETRIES,
    DEAD_LETTERS,
    TRANSFORM_DROPPED,
    CLAIMS,
    DEGRADED,
    REPEAT_WINDOWS,
    OLDEST_PENDING,
    RECEIPT_TO_SUCCESS,
    SWEPT,
    RETRY_AFTER_IGNORED,
    FAST_TIER_KEYS,
    FAST_TIER_USED_MEMORY,
    FAST_TIER_MAXMEMORY,
    PARTITION_DAYS,
    QUEUE_LAG_P99,
    QUEUE_LAG_MEASURED,
    QUEUE_LAG_BUDGET,
    BREAKER_CHANGES,
    BREAKER_STATE,
    JOB_LAST_SUCCESS,
    JOB_PERIOD,
    ROUTES_DISABLED,
    SUPERSEDED,
    LANES_BLOCKED,
    EXPIRED_ROWS,
    # The horizon, re-checked.
    PROVIDER_WINDOW_AGE,
    PROVIDER_WINDOW_DUE,
    TTL_FINGERPRINT_DISAGREEMENTS,
    TTL_FINGERPRINT_PROCESSES,
    TTL_FINGERPRINT_CHECKED,
    DRIFT_FINDINGS,
)


# The admin plane's own families (see LOGINS_THROTTLED).
ADMIN_PLANE: tuple[Any, ...] = (LOGINS_THROTTLED,)


def fail_open_reading(source: Any) -> tuple[float, float | None]:
    """(admissions failed open in all, when the last one was: Unix time or None) from a
    registry or collector of these families (the admin plane's /metrics source)."""
    total, last = 0.0, None
    for family in source.collect():
        for sample in family.samples:
            if sample.name == "webhooks_admissions_total":
                if sample.labels.get("outcome") == "failed_open":
                    total += sample.value
            elif sample.name == "webhooks_fail_open_last_timestamp_seconds" and sample.value:
                last = max(last or 0.0, sample.value)
    return total, last


def family_names(metrics: Iterable[Any]) -> frozenset[str]:
    return frozenset(family.name for metric in metrics for family in metric.describe())


def hidden_from(process: Process) -> frozenset[str]:
    """The families ``process`` does not expose: the other kind's own."""
    return family_names(WORKER_ONLY if process == "receiver" else RECEIVER_ONLY)


class _Without:
    """``source``'s families except the hidden ones (exposition time only)."""

    def __init__(self, source: Any, hidden: frozenset[str]) -> None:
        self._source = source
        self._hidden = hidden

    def collect(self) -> Iterator[Any]:
        return (f for f in self._source.collect() if f.name not in self._hidden)


class _Only:
    """``source``'s families of the given names (exposition time only)."""

    def __init__(self, source: Any, names: frozenset[str]) -> None:
        self._source = source
        self._names = names

    def collect(self) -> Iterator[Any]:
        return (f for f in self._source.collect() if f.name in self._names)


def only(source: Any, metrics: Iterable[Any]) -> Any:
    """A collector of ``source``'s families of ``metrics`` alone."""
    return _Only(source, family_names(metrics))


def exposed(process: Process, source: Any) -> Any:
    """A registry to hand to ``generate_latest``: ``source`` without the other process's
    families."""
    registry = CollectorRegistry(auto_describe=False)  # nothing to describe at registration
    registry.register(_Without(source, hidden_from(process)))
    return registry


# A multi-process file holds at least its 4-byte "used" header once its process has sized it.
_SIZED = 4


class SettledFiles(MultiProcessCollector):  # type: ignore[misc]
    """The sum of a multi-process directory's files, leaving out a file its process has
    created but not yet sized.

    prometheus-client's own collector reads every ``*.db`` file it lists, and a process that
    is creating its file (a pool child's first sample, a receiver process starting) leaves it
    at 0 bytes for a moment: a scrape then fails whole with ``struct.error`` and ``/metrics``
    answers 500 (prometheus/client_python#1199, open); a process killed in that moment leaves
    the empty file for good. Such a file holds no sample yet, so leaving it out loses none.
    A file that vanishes between the listing and the read (a dead child's live gauges) is
    left out too."""

    def __init__(self, path: str | None) -> None:
        """``path``: the directory (None: ``PROMETHEUS_MULTIPROC_DIR``)."""
        super().__init__(None, path=path)  # type: ignore[no-untyped-call]
        self._directory = Path(self._path)

    def collect(self) -> Iterable[Any]:
        settled = []
        for file in self._directory.glob("*.db"):
            try:
                if file.stat().st_size >= _SIZED:
                    settled.append(os.fspath(file))
            except FileNotFoundError:
                continue
        return self.merge(settled, accumulate=True)  # type: ignore[no-untyped-call,no-any-return]
