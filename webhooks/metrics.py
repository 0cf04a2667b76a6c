"""Prometheus metrics, shared by the receiver and the workers.

Workers (and a multi-process receiver) run in prometheus-client's multiprocess mode: the entry
point sets PROMETHEUS_MULTIPROC_DIR from WEBHOOKS_METRICS_DIR before this module is imported.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

# Receiver.
REQUESTS = Counter(
    "webhooks_requests_total", "Webhook requests by source and outcome", ["source", "outcome"]
)
DUPLICATES = Counter(
    "webhooks_duplicates_total", "Duplicate deliveries (same id, same body)", ["source"]
)
CONFLICTS = Counter("webhooks_conflicts_total", "Same event id, different body", ["source"])
PUBLISH_FAILURES = Counter(
    "webhooks_publish_failures_total", "Messages not published after commit", ["source"]
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

# Workers.
DELIVERIES = Counter("webhooks_deliveries_total", "Delivery attempts by outcome", ["outcome"])
RETRIES = Counter("webhooks_retries_total", "Retries scheduled")
DEAD_LETTERS = Counter("webhooks_dead_letters_total", "Deliveries that went dead", ["reason"])
CLAIMS = Counter(
    "webhooks_claims_total",
    "Fast-tier claims: first delivery, duplicate (idempotency hit) or degraded (Redis down)",
    ["result"],
)
DEGRADED = Counter("webhooks_degraded_claims_total", "Claims made on the durable tier alone")
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

# Retention and operators.
DEAD_LETTERS_DISCARDED = Counter(
    "webhooks_dead_letters_discarded_total",
    "Dead letters removed: their retention ended (retention) or an operator discarded them",
    ["via"],
)
