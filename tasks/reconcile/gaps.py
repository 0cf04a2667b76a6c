"""``webhooks reconcile`` without SOURCE: recover the intake gaps (issue 38 item 2).

The gaps (:func:`models.intake_gaps.read`: the ranges with no receiver seen, the database
unreachable or 5xx answered) are grouped per affected source (:func:`core.gaps.recoveries`),
and each source with a reconciliation credential is reconciled, in the order of its earliest
deadline (the provider that gives up first, or never retries, first), over a window from its
earliest range's start less :data:`MARGIN` (an event created just before the range was first
sent in it) to now, no longer than what reconciliation may compare (the source's dedup TTL,
the provider's listing horizon: :func:`tasks.reconcile.run.longest_window`). A source without
one is named as not recoverable here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from core.crypto import SecretBox
from core.gaps import GapReport, Recovery, recoveries
from core.logs import get_logger
from core.settings import Settings
from models import pg
from models.intake_gaps import read
from tasks.reconcile.run import (
    Publish,
    ReconcileError,
    Report,
    load_target,
    longest_window,
    reconcile,
)

log = get_logger("reconcile")

MARGIN = timedelta(minutes=5)


@dataclass
class SourceRun:
    recovery: Recovery
    since: datetime | None = None  # the window's start asked for
    clamped: bool = False  # the gaps reach further back than reconciliation may compare
    report: Report | None = None
    error: str | None = None  # the run could not start (one line)

    def view(self) -> dict[str, Any]:
        r = self.recovery
        return {
            "source": r.source.public_id,
            "name": r.source.name,
            "provider": r.source.provider,
            "deadline": r.deadline,
            "gaps": r.gaps,
            "since": self.since,
            "clamped": self.clamped,
            "recoverable": r.source.reconcilable,
            "error": self.error,
            "report": None if self.report is None else self.report.view(),
        }


@dataclass
class GapRun:
    gaps: GapReport
    runs: list[SourceRun] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return any(
            r.error is not None or (r.report is not None and r.report.error is not None)
            for r in self.runs
            if r.recovery.source.reconcilable
        )

    def view(self) -> dict[str, Any]:
        return {"gaps": self.gaps.view(), "sources": [r.view() for r in self.runs]}


def reconcile_gaps(
    settings: Settings,
    sessions: sessionmaker[Session],
    box: SecretBox,
    *,
    dry_run: bool,
    max_pages: int,
    sleep: Callable[[float], None],
    publish: Publish | None = None,
    since: timedelta | None = None,
) -> GapRun:
    """Each gap-affected source reconciled in deadline order; ``since``: how far back the
    gaps are read (default: :func:`models.intake_gaps.default_since`)."""
    with pg.connect(settings) as conn:
        report = read(conn, settings, since)
    done = GapRun(report)
    for recovery in recoveries(report, MARGIN):
        run = SourceRun(recovery)
        done.runs.append(run)
        if not recovery.source.reconcilable:
            continue
        try:
            with sessions() as session:
                target = load_target(session, box, settings, recovery.source.public_id)
            window = report.now - recovery.start
            longest = longest_window(target)
            run.clamped = window > longest
            window = min(window, longest)
            run.since = report.now - window
            log.info(
                "reconcile.gap",
                source=recovery.source.public_id,
                deadline=recovery.deadline,
                since=run.since,
                clamped=run.clamped,
            )
            run.report = reconcile(
                settings, sessions, box, recovery.source.public_id, since=window,
                dry_run=dry_run, max_pages=max_pages, sleep=sleep, publish=publish,
            )  # fmt: skip
        except ReconcileError as exc:
            run.error = str(exc)
            log.warning("reconcile.skipped", source=recovery.source.public_id, reason=str(exc))
    return done
