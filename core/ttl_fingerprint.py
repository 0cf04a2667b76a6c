"""Do all live processes derive the same dedup TTLs? (issue 35 item 3, second half; pure)

A source's dedup TTL (:mod:`core.ttl`) is its own overrides, which every process reads from
the same database rows, plus what each process brings: its provider registry's retry windows
(built-ins of its code version, plug-ins installed on its host) and three settings from its
environment (``WEBHOOKS_QUEUE_LAG_BUDGET``, ``_CLOCK_SKEW_ALLOWANCE``, ``_MANUAL_REPLAY_GRACE``),
and the margin floor of a raised TTL (:data:`core.ttl.RAISED_MARGIN_FLOOR`). Two receivers of
one deployment started with different settings, or two environments sharing a database,
write one source's receipts with different TTLs: the shorter one forgets a late retry the
other would have deduplicated, and it runs twice.

So each receiver and worker records its :class:`TtlInputs` in Postgres when it starts
(:mod:`models.ttl_fingerprints`), and :func:`compare` derives, for every source, the TTL each
live process would write, from that process's recorded inputs and the source's overrides,
with the arithmetic of :mod:`core.ttl`. A source for which they differ is a
:class:`Disagreement`: maintenance logs and exports it, ``webhooks ttl check`` lists it.
Recording the inputs (not the TTLs) covers sources created after a process started.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal

from core.errors import WebhooksError
from core.settings import Settings
from core.ttl import (
    RAISED_MARGIN_FLOOR,
    TERM_NAMES,
    EffectiveTtl,
    TermDefaults,
    TtlOverrides,
    effective_from,
    terms_from,
)

Role = Literal["receiver", "worker"]
ROLES: tuple[Role, ...] = ("receiver", "worker")
# What :func:`compare` reports as differing, besides the four terms: the provider's documented
# window (which a raised TTL and an overridden window are judged against) and the margin a
# raised TTL keeps above it (the clock-skew setting, at least the floor).
COMPARED = (*TERM_NAMES, "provider_window", "margin")
# The version of the recorded JSON: a process that reads another version says so, not guesses.
VERSION = 1


class FingerprintError(WebhooksError, ValueError):
    """A recorded fingerprint that cannot be read (another version, or damaged)."""


def _seconds(value: timedelta) -> float:
    return value.total_seconds()


@dataclass(frozen=True)
class TtlInputs:
    """What one process derives every dedup TTL from, besides a source's own overrides."""

    windows: Mapping[str, timedelta]  # provider name -> its documented retry window
    queue_lag: timedelta
    clock_skew: timedelta
    replay_grace: timedelta
    margin_floor: timedelta = RAISED_MARGIN_FLOOR

    @classmethod
    def of(cls, settings: Settings, windows: Mapping[str, timedelta]) -> TtlInputs:
        """This process's: ``windows`` from its registry (``registry.providers()``)."""
        return cls(
            windows=dict(sorted(windows.items())),
            queue_lag=settings.queue_lag_budget,
            clock_skew=settings.clock_skew_allowance,
            replay_grace=settings.manual_replay_grace,
        )

    def as_json(self) -> dict[str, Any]:
        """Seconds, keys sorted: what the row's ``terms`` holds and :meth:`digest` hashes."""
        return {
            "version": VERSION,
            "windows": {name: _seconds(w) for name, w in sorted(self.windows.items())},
            "queue_lag": _seconds(self.queue_lag),
            "clock_skew": _seconds(self.clock_skew),
            "replay_grace": _seconds(self.replay_grace),
            "margin_floor": _seconds(self.margin_floor),
        }

    @classmethod
    def from_json(cls, data: Any) -> TtlInputs:
        try:
            if data.get("version") != VERSION:
                raise FingerprintError(f"fingerprint version {data.get('version')!r}")
            return cls(
                windows={str(k): timedelta(seconds=float(v)) for k, v in data["windows"].items()},
                queue_lag=timedelta(seconds=float(data["queue_lag"])),
                clock_skew=timedelta(seconds=float(data["clock_skew"])),
                replay_grace=timedelta(seconds=float(data["replay_grace"])),
                margin_floor=timedelta(seconds=float(data["margin_floor"])),
            )
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, FingerprintError):
                raise
            raise FingerprintError(f"unreadable fingerprint ({type(exc).__name__})") from None

    def digest(self) -> str:
        """A short hash of :meth:`as_json`: equal inputs, equal digests (shown, not compared:
        processes may differ in a provider no source uses and still agree on every TTL)."""
        canonical = json.dumps(self.as_json(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def derive(self, provider: str, overrides: TtlOverrides) -> EffectiveTtl | None:
        """The TTL this process writes for a source of ``provider`` with ``overrides``, by
        :mod:`core.ttl`'s arithmetic; None when the provider is not installed here."""
        window = self.windows.get(provider)
        if window is None:
            return None
        defaults = TermDefaults(window, "", self.queue_lag, self.clock_skew, self.replay_grace)
        terms = terms_from(provider, overrides, defaults)
        # The margin of a raised TTL is the setting's, as in core.ttl.effective_ttl (not an
        # override's).
        return effective_from(terms, self.clock_skew, self.margin_floor)

    def values(self, provider: str, overrides: TtlOverrides) -> dict[str, timedelta | None]:
        """Each of :data:`COMPARED` as this process has it for such a source (an override
        where the source sets one; None for a provider not installed here)."""
        window = self.windows.get(provider)
        mine = {
            "retry_window": window,
            "queue_lag": self.queue_lag,
            "clock_skew": self.clock_skew,
            "replay_grace": self.replay_grace,
        }
        out: dict[str, timedelta | None] = {}
        for name in TERM_NAMES:
            override = getattr(overrides, name)
            out[name] = mine[name] if override is None else override
        out["provider_window"] = window
        out["margin"] = max(self.clock_skew, self.margin_floor)
        return out


@dataclass(frozen=True)
class ProcessTerms:
    """One live process's row: who it is, since when, and its inputs."""

    host: str
    pid: int
    role: str
    environment: str
    started_at: datetime
    last_seen: datetime
    inputs: TtlInputs

    @property
    def key(self) -> tuple[str, int, str]:
        return (self.host, self.pid, self.role)


@dataclass(frozen=True)
class SourceTerms:
    """What a source brings to its TTL: its provider and overrides (shared by every process)."""

    public_id: str
    name: str
    provider: str
    overrides: TtlOverrides


@dataclass(frozen=True)
class Derived:
    """The TTL one process derives for one source (None: its provider is not installed
    there), and the values it derives it from."""

    process: ProcessTerms
    ttl: timedelta | None
    values: Mapping[str, timedelta | None]


@dataclass(frozen=True)
class Disagreement:
    """A source for which live processes derive different TTLs: every live process's
    derivation, and the names (of :data:`COMPARED`) whose values differ between them."""

    source: SourceTerms
    derived: tuple[Derived, ...]
    differing: tuple[str, ...]

    def ttls(self) -> tuple[timedelta | None, ...]:
        """The distinct TTLs, shortest first (a provider not installed last)."""
        found = {d.ttl for d in self.derived}
        return tuple(sorted(found, key=lambda t: (t is None, t or timedelta())))


def compare(
    processes: Iterable[ProcessTerms], sources: Iterable[SourceTerms]
) -> tuple[Disagreement, ...]:
    """Every source for which the given (live) processes derive more than one TTL, in the
    sources' order, each process in (host, pid, role) order. Fewer than two processes: none."""
    live = sorted(processes, key=lambda p: p.key)
    if len(live) < 2:  # noqa: PLR2004 (a disagreement takes two)
        return ()
    out = []
    for source in sources:
        derived = []
        for process in live:
            effective = process.inputs.derive(source.provider, source.overrides)
            ttl = None if effective is None else effective.total
            values = process.inputs.values(source.provider, source.overrides)
            derived.append(Derived(process, ttl, values))
        if len({d.ttl for d in derived}) > 1:
            differing = tuple(
                name for name in COMPARED if len({d.values[name] for d in derived}) > 1
            )
            out.append(Disagreement(source, tuple(derived), differing))
    return tuple(out)
