"""Previewed replays and discards waiting for their confirmation, in the admin plane's
process (injected clock). A preview freezes what it counted under a one-use token for the
session's operator, so the confirmation moves exactly the rows the preview showed; a plan not
confirmed within :data:`PLAN_TTL` is gone.
"""

from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from core.clock import Clock
from models.candidates import Candidate, ReplayFilter

PLAN_TTL = timedelta(minutes=15)


@dataclass
class PendingPlan:
    """A previewed replay or discard, waiting for its confirmation."""

    operator: str
    action: str  # "replay" or "discard"
    filter_as_given: dict[str, Any]
    ids: tuple[int, ...]
    flt: ReplayFilter | None
    # By ids: the candidates as planned. By filter: the sample only; ``frozen`` holds every
    # matching id, and the confirmation reads the candidates of exactly those.
    candidates: tuple[Candidate, ...]
    made_at: datetime
    frozen: tuple[int, ...] = ()


class PlanStore:
    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self._plans: dict[str, PendingPlan] = {}
        self._lock = threading.Lock()

    def keep(self, plan: PendingPlan) -> str:
        """Keep the plan (dropping expired ones); the one-use token of its confirmation."""
        token = secrets.token_urlsafe(24)
        now = self.clock.now()
        with self._lock:
            for key in [k for k, p in self._plans.items() if now - p.made_at > PLAN_TTL]:
                del self._plans[key]
            self._plans[token] = plan
        return token

    def take(self, token: str, operator: str) -> PendingPlan | None:
        """The plan of this token, once, for the operator who previewed it; None when
        unknown, another operator's, or expired."""
        with self._lock:
            plan = self._plans.get(token)
            if plan is None or plan.operator != operator:
                return None
            if self.clock.now() - plan.made_at > PLAN_TTL:
                del self._plans[token]
                return None
            del self._plans[token]
            return plan
