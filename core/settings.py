"""The one typed Settings object.

Built once at each entry point (CLI, receiver, worker, beat) and passed down; nothing reads the
environment anywhere else. Every time budget is derived from the others here, so the ordering
handler I/O timeout < soft limit < hard limit < processing TTL < visibility timeout holds by
construction and is checked again by :meth:`Settings.check_budgets`.
"""

from __future__ import annotations

import itertools
import os
import re
from datetime import timedelta
from functools import cached_property
from pathlib import Path
from typing import Literal

from pydantic import (
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError
from pydantic_settings import BaseSettings, SettingsConfigDict

from core.durations import DurationError, format_duration, parse_duration
from core.errors import WebhooksError
from core.token_strength import weakness

MIN_ADMIN_TOKEN_LENGTH = 32
# Threads or greenlets per worker when WEBHOOKS_WORKER_CONCURRENCY is unset (bench_forward.py).
IO_POOL_DEFAULT_CONCURRENCY = 50
# The most delivery ids a task message may carry (WEBHOOKS_DELIVERY_BATCH's ceiling), and
# how many it carries by default under the threads and gevent pools (bench_workers.py).
MAX_DELIVERY_BATCH = 256
IO_POOL_DEFAULT_BATCH = 16
ADMIN_TOKEN_NAME = re.compile(r"[a-z0-9_-]{1,32}")
# The name WEBHOOKS_ADMIN_TOKEN's one token goes by (in the audit, as the operator).
DEFAULT_ADMIN_TOKEN_NAME = "admin"  # noqa: S105  (a name, not a secret)


class SettingsError(WebhooksError):
    """Settings could not be built; the message names the offending variable."""


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="WEBHOOKS_",
        env_file=".env",
        env_file_encoding="utf-8",
        extra="ignore",
        frozen=True,
        # A refused value may be a secret (a short key or token): errors never quote it.
        hide_input_in_errors=True,
    )

    environment: Literal["development", "production", "test"] = "development"

    # Connections.
    database_url: str = "postgresql+psycopg://postgres@127.0.0.1:5432/webhooks"
    redis_url: str = "redis://127.0.0.1:6379/1"
    broker_url: str = "redis://127.0.0.1:6379/0"
    db_pool_size: int = Field(default=10, ge=1, le=200)
    db_connect_timeout: float = Field(default=5.0, gt=0)
    # The longest a receiver's request waits for the database (the source's lookup, the
    # accept) before it answers 503 with Retry-After: a receiver cut off from Postgres never
    # hangs a provider's connection (ingest/store.py).
    db_answer_timeout: float = Field(default=0.9, gt=0)
    redis_socket_timeout: float = Field(default=0.5, gt=0)

    # Secrets.
    # One key, or several newest first (rotation: core/crypto.py), each >= 32 characters
    # (checked by _check_secret_keys, which names the short key's place in the list).
    secret_key: SecretStr
    # Ciphertexts written before keys were stretched still decrypt (a SHA-256 of the key);
    # false once `webhooks secrets rekey --drop-legacy` found none left (core.crypto).
    secret_key_legacy: bool = True
    admin_token: SecretStr | None = None
    # Named admin tokens, ``name:token,name2:token2``: the audit records the name (see
    # admin_tokens_by_name). WEBHOOKS_ADMIN_TOKEN is one more, named "admin".
    admin_tokens: SecretStr | None = None
    flower_user: str = "admin"
    flower_password: SecretStr | None = None

    # Receiver.
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    # The admin plane (admin API and /metrics): an address of its own, loopback by default.
    admin_host: str = "127.0.0.1"
    admin_port: int = Field(default=8001, ge=1, le=65535)
    receiver_workers: int = Field(default=1, ge=1, le=64)
    max_body_bytes: int = Field(default=1024 * 1024, ge=1024)
    default_tolerance: timedelta = timedelta(seconds=300)
    source_cache_ttl: timedelta = timedelta(seconds=30)
    publish_timeout: float = Field(default=2.0, gt=0)
    # How long the receiver's publisher waits, once a delivery is ready, for more to publish
    # with it (seconds), when deliveries arrive closer together than this (a lone delivery
    # after a quiet spell goes out at once): messages of several ids cost the workers far
    # less per delivery (tasks/pipeline.py, bench/results_forward.txt). 0: never wait.
    publish_linger: float = Field(default=0.01, ge=0, le=1)
    # The most deliveries waiting in a receiver process for its publisher thread. Past it (a
    # broker slower than the receiver, the thread restarting) a delivery stays pending in
    # Postgres and the sweeper publishes it after publish_grace (counted:
    # webhooks_publish_deferred_total). Bounds the memory a slow broker can take.
    publish_queue_limit: int = Field(default=10_000, ge=1, le=1_000_000)
    # Group commit (ingest/store.py): accept batches in flight per receiver process, and the
    # most receipts one batch (one transaction) carries.
    accept_concurrency: int = Field(default=2, ge=1, le=64)
    accept_batch_max: int = Field(default=64, ge=1, le=1000)
    # HTTP server limits of the public port (ingest/server.py): the head (request line and
    # headers) in bytes and headers, seconds to send the head and then the body, idle seconds
    # between keep-alive requests, and open connections per receiver process.
    max_header_bytes: int = Field(default=32 * 1024, ge=1024, le=1024 * 1024)
    max_headers: int = Field(default=100, ge=8, le=1000)
    header_timeout: float = Field(default=10.0, gt=0, le=300)
    body_timeout: float = Field(default=30.0, gt=0, le=3600)
    keep_alive_timeout: int = Field(default=5, ge=1, le=300)
    max_connections: int = Field(default=1000, ge=1, le=100_000)
    # The admin address's own limits (ingest/admin/protocol.py): its requests are small, so
    # its head and body get less time than the public port's; open connections in all and per
    # client address. At either cap a new connection closes the oldest one that is not in the
    # middle of an answered request (still sending its head, idle, or trickling a login form).
    admin_header_timeout: float = Field(default=5.0, gt=0, le=300)
    admin_body_timeout: float = Field(default=10.0, gt=0, le=3600)
    admin_max_connections: int = Field(default=128, ge=2, le=10_000)
    admin_max_client_connections: int = Field(default=32, ge=1, le=10_000)

    # Worker time budgets (seconds). The rest are derived below.
    handler_io_timeout: float = Field(default=10.0, gt=0)
    soft_time_limit: float = Field(default=30.0, gt=0)
    hard_time_limit: float = Field(default=60.0, gt=0)
    # A route's transform (tasks.transforms) runs at most this long before its handler; past
    # it the delivery goes dead with transform_failed (TransformTimeLimit). The handler's soft
    # limit bounds it too (the smaller of the two applies).
    transform_time_limit: float = Field(default=1.0, gt=0, le=60)
    visibility_timeout: float = Field(default=3600.0, gt=0)
    # How long a worker's wait for the broker's next message lasts (kombu's Redis BRPOP timeout):
    # a stopping worker begins its warm shutdown once that wait returns, so shorter stops
    # sooner, at the cost of one more idle Redis round trip per interval.
    broker_poll_interval: timedelta = Field(default=timedelta(seconds=1), gt=timedelta(0))
    max_redeliveries: int = Field(default=3, ge=1)
    # How long a worker keeps trying to record an outcome that already happened (a handler's
    # success, or a failure's retry or dead state) through database faults before it leaves
    # the delivery to its lease (tasks/connections.py): longer than a Postgres restart, well
    # under the lease (4 x the hard time limit).
    record_retry_seconds: float = Field(default=30.0, ge=0, le=3600)
    # Worker pool (docs/workers.md; time limits per pool: tasks/pools.py): threads or gevent
    # keep many I/O-bound handlers in flight in one process (threads measured faster,
    # bench/results_forward.txt); prefork runs CPU-bound handlers in parallel. Concurrency
    # unset: 50 threads or greenlets (fewer threads spend less CPU contending: 0.58x bare at
    # 50 against 0.36x at 100 for a 100 ms downstream), one process per CPU for prefork.
    worker_pool: Literal["threads", "gevent", "prefork"] = "threads"
    worker_concurrency: int | None = Field(default=None, ge=1, le=2000)
    # Most delivery ids in one task message (docs/workers.md, tasks/pipeline.py). The
    # receiver's publisher packs the deliveries it finds queued together, up to this many per
    # message; a worker claims them in one statement, runs their handlers concurrently and
    # records their successes in one statement, each delivery keeping its own attempt, retry
    # and dead-letter fate. 1: one delivery per message. Unset: 16 for the threads and gevent
    # pools, 1 for prefork (see deliveries_per_message).
    delivery_batch: int | None = Field(default=None, ge=1, le=MAX_DELIVERY_BATCH)

    # Retry policy defaults (per-route overrides live on the route).
    # Derived from the providers' own schedules (PROVIDERS.md): Standard Webhooks and Svix
    # back off from seconds to hours and stop after about 1-3 days, Stripe after 3 days.
    retry_base: timedelta = timedelta(seconds=5)
    retry_cap: timedelta = timedelta(hours=6)
    max_attempts: int = Field(default=12, ge=1)
    max_age: timedelta = timedelta(days=3)
    # Circuit breaker per route (models/breaker.py; Convoy's defaults): it opens when at least
    # breaker_failure_ratio of at least breaker_min_requests requests failed downstream (5xx,
    # timeout, connection) within breaker_window of the route's first counted failure; while
    # open one probe delivery goes out every breaker_probe_interval.
    breaker_window: timedelta = timedelta(minutes=5)
    breaker_min_requests: int = Field(default=10, ge=1)
    breaker_failure_ratio: float = Field(default=0.7, gt=0, le=1)
    breaker_probe_interval: timedelta = timedelta(seconds=30)
    # A quiet route's outage (too few requests for the ratio): it also opens once
    # breaker_streak requests in a row failed downstream, the first of them at least
    # breaker_streak_span ago, with no success since (one delivery alone gets there at about
    # its sixth attempt, some 80 s after its first: well inside its 12).
    breaker_streak: int = Field(default=5, ge=1)
    breaker_streak_span: timedelta = timedelta(minutes=1)
    # A route whose breaker has stayed open this long (counted from its opening, or from its
    # resume by hand if later) is disabled by the sweep, audited and alerted, and its waiting
    # deliveries go dead with route_disabled (replayable once it is enabled again:
    # models/route_ends.py). Svix disables an endpoint after 5 days of failures; of the
    # built-in senders' own retry windows only Intercom's and Meta's (7 d) and Adyen's
    # (30 d) are longer (docs/providers.md, docs/handlers.md).
    route_disable_after: timedelta = timedelta(days=5)
    # Admission (models/admission.py): deliveries of one route admitted to the broker and not
    # finished at once, unless the route sets its own (`routes update --max-in-flight`). The
    # default, 40, is below the 50 slots of one default worker: a route's backlog leaves
    # the other routes free slots (README "Fairness and limits"; 20 drained a one-route
    # burst 2.2x slower for no better quiet latency: bench/results_fairness*.txt).
    route_max_in_flight: int = Field(default=40, ge=1, le=100_000)
    # How often each worker's dispatcher admits waiting deliveries (round-robin across routes).
    dispatch_interval: timedelta = timedelta(milliseconds=50)
    # false: this worker runs no dispatcher (another worker's, on any host, does the work).
    dispatcher: bool = True
    # false: no admission at all (every delivery published at once, as before issue 23).
    admission: bool = True
    # Seed of the workers' jitter source: reproducible retry delays in tests; None = OS entropy.
    retry_seed: int | None = None

    # Sweeper and maintenance.
    sweep_interval: timedelta = timedelta(seconds=15)
    publish_grace: timedelta = timedelta(seconds=30)
    sweep_batch: int = Field(default=500, ge=1)
    maintenance_interval: timedelta = timedelta(minutes=10)
    # The subscription watchdog (tasks.watchdog, issue 38 item 1): every source with an API
    # credential has its endpoint read at its provider this often (one call per source and
    # period), each call within watch_timeout (a hanging API cannot hold beat's period).
    # public_base_url: the receiver's URL as the providers post to it; a source's endpoint
    # is expected at {public_base_url}/webhooks/{source id} unless its endpoint_url option
    # says otherwise (neither: the URL is not compared).
    watch_every: timedelta = Field(default=timedelta(minutes=15), ge=timedelta(minutes=1))
    watch_timeout: timedelta = Field(default=timedelta(seconds=10), gt=timedelta(0))
    public_base_url: str | None = None

    # Retention (issue 5): global defaults for the dedup TTL terms that are not provider ones.
    queue_lag_budget: timedelta = timedelta(days=1)
    clock_skew_allowance: timedelta = timedelta(minutes=10)
    manual_replay_grace: timedelta = timedelta(days=2)
    retention_mode: Literal["partition", "delete"] = "partition"
    partition_ahead_days: int = Field(default=7, ge=1, le=366)
    delete_batch_size: int = Field(default=10_000, ge=1, le=10_000)
    # A body is dropped once every delivery of its event succeeded this long ago: by default
    # the manual replay grace, the window an operator is expected to re-run a success in
    # (seed 004: bodies are not kept in the ledger once dispatch is done). docs/retention.md.
    payload_retention: timedelta = timedelta(days=2)
    # Dead letters are kept this long after they went dead, whatever their receipt's TTL.
    dead_letter_retention: timedelta = timedelta(days=30)
    # The processed-events ledger (models/ledger.py) is kept this many whole months past the
    # month an event was received in, then dropped a month at a time (seed 003: long enough
    # to answer a customer dispute, which is usually months). Months, not a duration: its
    # partitions are calendar months, and durations refuse months (no fixed length).
    ledger_retention: int = Field(default=13, ge=1, le=1200)
    # The providers' retry windows are re-checked (core/horizon.py): one last verified against
    # its cited page longer ago than this (or never) is due for review, reported by
    # `webhooks ttl check` and maintenance's gauges. Whole days (180d), at least 1d.
    horizon_review_after: timedelta = timedelta(days=180)
    # Each receiver and worker records the inputs of its dedup TTLs in Postgres at start
    # (core/ttl_fingerprint.py) and refreshes the row every fifth of this; a row not refreshed
    # for this long (the database's clock) is a process gone: no longer compared, and removed
    # by maintenance. Maintenance and `webhooks ttl check` compare the live ones.
    ttl_fingerprint_stale_after: timedelta = timedelta(minutes=10)
    # Each receiver records that it is up and answering (intake_heartbeats, core/gaps.py) every
    # this long, from a thread of its own, and adds the 5xx it answered to intake_errors: what
    # `webhooks gaps` reads. A receiver stopped for less than two periods may go unseen.
    intake_heartbeat_period: timedelta = timedelta(seconds=15)
    # Payload shape drift (issue 38 item 3, docs/drift.md): beat's learning run reads the
    # receipts accepted since its last run (on a worker, the maintenance queue; the receiver
    # pays nothing), at most drift_sample per (source, event type) per run, and reports a
    # JSON key path absent for drift_absent_days while its event type kept arriving.
    drift_every: timedelta = timedelta(minutes=10)
    drift_sample: int = Field(default=20, ge=1, le=10_000)
    drift_absent_days: int = Field(default=7, ge=1, le=3650)

    # Observability.
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    # JSON log lines, or human-readable ones (coloured on a terminal). None (unset): JSON
    # unless stderr is a terminal; true or false when set explicitly.
    log_json: bool | None = None
    metrics_dir: str | None = None
    flower_port: int = Field(default=5555, ge=1, le=65535)
    worker_metrics_port: int | None = Field(default=None, ge=1, le=65535)

    # The operator console (/console/ on the admin address): a session ends this long after
    # its last request; cookies are Secure when the request is https, or always with
    # console_secure_cookies (the console behind a TLS-terminating proxy); Flower's address as
    # the operator's browser reaches it (default http://127.0.0.1:WEBHOOKS_FLOWER_PORT).
    console_idle_timeout: timedelta = timedelta(minutes=30)
    console_secure_cookies: bool = False
    console_flower_url: str | None = None
    # The docs' markdown the console serves at /console/docs/ (core/docs.py): unset, the
    # checkout's docs/ beside the packages; the image sets /app/docs.
    console_docs_dir: Path | None = None
    # The login throttle (models/login_throttle.py), over the console's login form, the admin
    # API's bearer token and the docs' password alike: failed logins one client address may
    # make at once, then that many a minute; and the same for every address together. A
    # throttled attempt is answered 429 with Retry-After, its token never compared.
    console_login_failures: int = Field(default=5, ge=1, le=1000)
    console_login_global_failures: int = Field(default=60, ge=1, le=100_000)

    # Extra modules imported by workers so their handlers register (besides entry points).
    handler_modules: list[str] = Field(default_factory=list)

    @field_validator("secret_key")
    @classmethod
    def _check_secret_keys(cls, value: SecretStr) -> SecretStr:
        from core.crypto import split_keys  # noqa: PLC0415 (cryptography and the providers: loaded when a key is checked)

        split_keys(value.get_secret_value())  # raises naming the short key's position
        return value

    @field_validator("admin_token")
    @classmethod
    def _check_admin_token(cls, value: SecretStr | None) -> SecretStr | None:
        """Empty (or unset) turns the admin API off; a set token is at least 32 characters and
        not predictable (:mod:`core.token_strength`)."""
        token = "" if value is None else value.get_secret_value()
        if token and len(token) < MIN_ADMIN_TOKEN_LENGTH:
            raise ValueError(
                f"WEBHOOKS_ADMIN_TOKEN must be at least {MIN_ADMIN_TOKEN_LENGTH} characters "
                f"(this one has {len(token)}); leave it empty to turn the admin API off"
            )
        weak = weakness(token) if token else None
        if weak is not None:
            raise ValueError(f"WEBHOOKS_ADMIN_TOKEN {weak}")
        return value

    @field_validator("admin_tokens")
    @classmethod
    def _check_admin_tokens(cls, value: SecretStr | None) -> SecretStr | None:
        parse_admin_tokens("" if value is None else value.get_secret_value())
        return value

    @field_validator("database_url")
    @classmethod
    def _normalise_database_url(cls, value: str) -> str:
        if value.startswith("postgres://"):
            value = "postgresql://" + value.removeprefix("postgres://")
        if value.startswith("postgresql://"):
            value = "postgresql+psycopg://" + value.removeprefix("postgresql://")
        if not value.startswith("postgresql+psycopg://"):
            raise ValueError("must be a postgresql:// URL")
        return value

    @field_validator("*", mode="before")
    @classmethod
    def _parse_durations(cls, value: object, info: ValidationInfo) -> object:
        """Every ``timedelta`` setting takes what the CLI takes (:mod:`core.durations`):
        ``30s``, ``1h30m``, plain seconds, ISO 8601."""
        if info.field_name is None or cls.model_fields[info.field_name].annotation is not timedelta:
            return value
        if isinstance(value, str):
            try:
                return parse_duration(value)
            except DurationError as exc:
                # A custom error type: the message is shown as is, after the variable's name.
                raise PydanticCustomError("duration", str(exc)) from None
        if isinstance(value, int | float) and not isinstance(value, bool):
            return timedelta(seconds=value)
        return value

    @field_validator("redis_url", "broker_url")
    @classmethod
    def _check_redis_url(cls, value: str) -> str:
        if not value.startswith(("redis://", "rediss://", "amqp://", "pyamqp://")):
            raise ValueError("must be a redis:// (or amqp:// for the broker) URL")
        return value

    @model_validator(mode="after")
    def _check_budgets(self) -> Settings:
        self.check_budgets()
        return self

    @model_validator(mode="after")
    def _check_breaker(self) -> Settings:
        for name in (
            "breaker_window",
            "breaker_probe_interval",
            "console_idle_timeout",
            "route_disable_after",
            "ttl_fingerprint_stale_after",
            "intake_heartbeat_period",
            "drift_every",
        ):
            if getattr(self, name) <= timedelta():
                raise ValueError(f"WEBHOOKS_{name.upper()} must be positive")
        if self.breaker_streak_span < timedelta():
            raise ValueError("WEBHOOKS_BREAKER_STREAK_SPAN must not be negative")
        return self

    @model_validator(mode="after")
    def _check_horizon(self) -> Settings:
        after = self.horizon_review_after
        if after < timedelta(days=1) or after % timedelta(days=1):
            raise ValueError(
                "WEBHOOKS_HORIZON_REVIEW_AFTER must be a whole number of days, at least 1d "
                f"(e.g. 180d), not {format_duration(after)}"
            )
        return self

    @model_validator(mode="after")
    def _check_admin_plane(self) -> Settings:
        if self.admin_port == self.port:
            raise ValueError(
                f"WEBHOOKS_ADMIN_PORT and WEBHOOKS_PORT are both {self.port}: the admin API "
                "and /metrics need a port of their own"
            )
        self.admin_tokens_by_name()  # WEBHOOKS_ADMIN_TOKEN clashing with a named one
        return self

    # Derived values -------------------------------------------------------------------

    @cached_property
    def processing_ttl(self) -> float:
        """The fast claim's crash floor: four times the hard limit (see the seeds)."""
        return 4 * self.hard_time_limit

    @cached_property
    def max_countdown(self) -> float:
        """Longest retry delay handed to Celery as a countdown; longer ones go to the sweeper."""
        return self.visibility_timeout - self.hard_time_limit

    @property
    def worker_slots(self) -> int:
        """Deliveries one worker runs at once: the Celery concurrency actually used."""
        if self.worker_concurrency is not None:
            return self.worker_concurrency
        if self.worker_pool == "prefork":
            return os.cpu_count() or 1
        return IO_POOL_DEFAULT_CONCURRENCY

    @property
    def deliveries_per_message(self) -> int:
        """WEBHOOKS_DELIVERY_BATCH, or its default for the pool. Prefork is the pool for
        CPU-bound handlers, and a batch's handlers run as threads of one process, sharing its
        interpreter lock: sixteen handlers of five CPU seconds each would take eighty seconds
        together and all miss the hard limit. So prefork gets one delivery per message."""
        if self.delivery_batch is not None:
            return self.delivery_batch
        return 1 if self.worker_pool == "prefork" else IO_POOL_DEFAULT_BATCH

    @property
    def psycopg_dsn(self) -> str:
        """The database URL in the form psycopg itself accepts."""
        return "postgresql://" + self.database_url.removeprefix("postgresql+psycopg://")

    def check_budgets(self) -> None:
        """The time budgets, in order, and how the clock-skew allowance relates to them.

        Leases (``processing_ttl``) and due times are judged on one clock, the database's
        (:mod:`core.clock`), and the fast claim's TTL on Redis's: no host's skew can
        shorten a live lease, so ``processing_ttl`` carries no margin for
        ``clock_skew_allowance`` and may be shorter than it. The allowance covers only what
        host clocks still anchor: a sender's event time and a receiver's arrival time, i.e.
        the dedup TTL. What a lease must outlive is a live handler, which the hard time limit
        (this host's monotonic timer, immune to wall-clock steps) ends first:
        ``hard_time_limit < processing_ttl``, checked below with the rest of the chain.
        """
        chain = [
            ("WEBHOOKS_HANDLER_IO_TIMEOUT", self.handler_io_timeout),
            ("WEBHOOKS_SOFT_TIME_LIMIT", self.soft_time_limit),
            ("WEBHOOKS_HARD_TIME_LIMIT", self.hard_time_limit),
            ("processing_ttl (4 x WEBHOOKS_HARD_TIME_LIMIT)", self.processing_ttl),
            ("WEBHOOKS_VISIBILITY_TIMEOUT", self.visibility_timeout),
        ]
        for (lo_name, lo), (hi_name, hi) in itertools.pairwise(chain):
            if not lo < hi:
                raise ValueError(
                    f"time budgets out of order: {lo_name}={lo} must be < {hi_name}={hi}"
                )

    def admin_tokens_by_name(self) -> dict[str, SecretStr]:
        """Every admin token by its name: WEBHOOKS_ADMIN_TOKENS, and WEBHOOKS_ADMIN_TOKEN as
        ``admin``. Empty: the admin API is off."""
        named = parse_admin_tokens(
            "" if self.admin_tokens is None else self.admin_tokens.get_secret_value()
        )
        single = "" if self.admin_token is None else self.admin_token.get_secret_value()
        if single:
            if DEFAULT_ADMIN_TOKEN_NAME in named:
                raise ValueError(
                    f"WEBHOOKS_ADMIN_TOKENS names a token {DEFAULT_ADMIN_TOKEN_NAME!r}, the name "
                    "WEBHOOKS_ADMIN_TOKEN goes by: rename it or drop WEBHOOKS_ADMIN_TOKEN"
                )
            if any(token.get_secret_value() == single for token in named.values()):
                raise ValueError("WEBHOOKS_ADMIN_TOKEN is also in WEBHOOKS_ADMIN_TOKENS")
            named[DEFAULT_ADMIN_TOKEN_NAME] = SecretStr(single)
        return named

    def database_name(self) -> str:
        return self.database_url.rsplit("/", 1)[-1].split("?", 1)[0]


def parse_admin_tokens(text: str) -> dict[str, SecretStr]:
    """``name:token,name2:token2`` by name. Each token is at least 32 characters and not
    predictable (:mod:`core.token_strength`). Errors name the entry by position and name, never
    quote a token: the value is a secret even when it is refused."""
    tokens: dict[str, SecretStr] = {}
    seen: set[str] = set()
    for position, entry in enumerate((e.strip() for e in text.split(",")), start=1):
        if not entry:
            continue
        name, sep, token = entry.partition(":")
        name, token = name.strip(), token.strip()
        if not sep or ADMIN_TOKEN_NAME.fullmatch(name) is None:
            raise ValueError(
                f"entry {position} is not name:token with a name of 1-32 characters "
                "a-z, 0-9, _ or -"
            )
        if len(token) < MIN_ADMIN_TOKEN_LENGTH:
            raise ValueError(
                f"the token named {name!r} must be at least {MIN_ADMIN_TOKEN_LENGTH} "
                f"characters (it has {len(token)})"
            )
        weak = weakness(token)
        if weak is not None:
            raise ValueError(f"the token named {name!r} {weak}")
        if name in tokens:
            raise ValueError(f"the name {name!r} is given twice")
        if token in seen:
            raise ValueError(f"the token named {name!r} is also given another name")
        seen.add(token)
        tokens[name] = SecretStr(token)
    return tokens


def load_settings(**overrides: object) -> Settings:
    """Build Settings from the environment; raise SettingsError naming the bad variable."""
    try:
        return Settings(**overrides)  # type: ignore[arg-type]
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            loc = "_".join(str(p) for p in err["loc"]) if err["loc"] else ""
            name = f"WEBHOOKS_{loc.upper()}" if loc else "settings"
            # A validator's own words, without pydantic's "Value error, " before them.
            cause = err.get("ctx", {}).get("error") if err["type"] == "value_error" else None
            problems.append(f"{name}: {cause if cause is not None else err['msg']}")
        raise SettingsError("invalid settings: " + "; ".join(problems)) from None
