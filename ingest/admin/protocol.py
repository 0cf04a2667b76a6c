"""The admin address's HTTP protocol: the receiver's (:mod:`ingest.server`: head size, header
and body timeouts, refusals counted) with the admin plane's own limits, and connections that
cannot hold the port however slowly they send.

Anyone who reaches the admin address can open connections and send slowly. Each connection is
in one of four phases:

- ``head``: just opened, or a request's head still arriving;
- ``busy``: a request being answered (its head is in and the app has it);
- ``body``: the console's login form arriving, the one body the plane reads before it knows
  who sent it (:class:`~ingest.admin.guard.AdminGuard` says so through the scope's
  :data:`UNPROVEN` extension);
- ``idle``: between keep-alive requests (or a body still trickling after its answer).

All but ``busy`` are *unproven*. A new connection beyond ``WEBHOOKS_ADMIN_MAX_CLIENT_CONNECTIONS``
open from its client address closes that address's connection unproven the longest; beyond
``WEBHOOKS_ADMIN_MAX_CONNECTIONS`` in all, the one unproven the longest of any address. Only
when none is unproven is the new one refused ``503`` with ``Retry-After``. So slow or silent
connections, however many and from however many addresses, cannot keep ``/metrics`` or an
operator out: each new connection makes its own room, and the head and body timeouts
(``WEBHOOKS_ADMIN_HEADER_TIMEOUT``, ``WEBHOOKS_ADMIN_BODY_TIMEOUT``) close the rest. A
connection closed for room gets ``503`` if it was sending a head, nothing if it was idle;
counted as ``webhooks_receiver_limits_total{limit="admin_shed"}``, the refusals as
``limit="admin_client_connections"`` and ``limit="admin_max_connections"``.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable
from typing import Any

from core import metrics
from core.settings import Settings
from ingest.server import Limits, ReceiverProtocol

# scope["extensions"][UNPROVEN]["mark"]: AdminGuard calls it with True before it reads a body
# it has not authenticated (the login form), with False once that body is in.
UNPROVEN = "webhooks.admin.unproven"
MAX_HEADER_BYTES = 16 * 1024  # an operators' port: small requests


class Connections:
    """The open connections of one admin server, by client address (its event loop's only)."""

    def __init__(self) -> None:
        self.by_client: dict[str, set[AdminProtocol]] = {}
        self.count = 0

    def add(self, conn: AdminProtocol) -> None:
        self.by_client.setdefault(conn.address, set()).add(conn)
        self.count += 1

    def discard(self, conn: AdminProtocol) -> None:
        peers = self.by_client.get(conn.address)
        if peers is None or conn not in peers:
            return
        peers.discard(conn)
        self.count -= 1
        if not peers:
            del self.by_client[conn.address]

    def of(self, address: str) -> set[AdminProtocol]:
        return self.by_client.get(address, set())

    def every(self) -> Iterable[AdminProtocol]:
        return itertools.chain.from_iterable(self.by_client.values())


def _oldest_unproven(among: Iterable[AdminProtocol]) -> AdminProtocol | None:
    unproven = [c for c in among if c.unproven_since is not None]
    return min(unproven, key=lambda c: c.unproven_since or 0, default=None)


# When a connection became unproven, in the order of events (ties impossible, unlike times).
_moments = itertools.count(1)


class AdminProtocol(ReceiverProtocol):
    """The receiver's protocol with a per-client cap and room made by closing the connection
    unproven the longest (see the module docstring). :func:`admin_protocol` makes one class
    per server, holding its limits and its :class:`Connections`."""

    limit_prefix = "admin_"
    open_connections: Connections
    max_client_connections: int

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.address = ""
        self.phase = "head"
        self.unproven_since: int | None = None  # a moment of _moments

    # Admission ----------------------------------------------------------------------------

    def _admit(self) -> bool:
        self.address = self.client[0] if self.client else ""
        self.unproven_since = next(_moments)
        conns = self.open_connections
        if len(conns.of(self.address)) >= self.max_client_connections:
            if not self._make_room(conns.of(self.address), "client_connections"):
                return False
        elif conns.count >= self._limits.max_connections and not self._make_room(
            conns.every(), "max_connections"
        ):
            return False
        conns.add(self)
        return True

    def _make_room(self, among: Iterable[AdminProtocol], limit: str) -> bool:
        victim = _oldest_unproven(among)
        if victim is None:  # every one is being answered: this one waits its turn
            self._refuse_busy(limit)
            return False
        victim.shed()
        return True

    def shed(self) -> None:
        """Close this connection to make room for a new one: ``503`` if it was sending a
        head, nothing if idle; mid-body (a login form), the app sees a disconnect."""
        self.open_connections.discard(self)
        self.unproven_since = None
        if self.phase == "head":
            self._refuse_busy("shed")
            return
        metrics.RECEIVER_LIMITS.labels(self.limit_prefix + "shed").inc()
        self._refused = True
        self._disarm()
        self._flush_held()
        self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.open_connections.discard(self)
        super().connection_lost(exc)

    # Phases -------------------------------------------------------------------------------

    def _enter(self, phase: str) -> None:
        if phase == "busy":
            self.unproven_since = None
        elif self.unproven_since is None:
            self.unproven_since = next(_moments)
        self.phase = phase

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._enter("head")
        self.scope["extensions"] = {UNPROVEN: {"mark": self._mark_body}}

    def on_headers_complete(self) -> None:
        self._enter("busy")
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # Idle: uvicorn armed its keep-alive timer (no pipelined request waits).
        if self.phase == "busy" and self.timeout_keep_alive_task is not None:
            self._enter("idle")

    def _mark_body(self, unproven: bool) -> None:
        if self.phase in ("busy", "body") and not self._refused:
            self._enter("body" if unproven else "busy")


def mark_unproven(scope: Any, unproven: bool) -> None:
    """Tell the admin protocol (when it serves this request) that the app reads a body it has
    not authenticated (True), or is done with it (False)."""
    extension = (scope.get("extensions") or {}).get(UNPROVEN)
    if extension is not None:
        mark: Callable[[bool], None] = extension["mark"]
        mark(unproven)


def admin_protocol(settings: Settings) -> type[AdminProtocol]:
    """An :class:`AdminProtocol` class for one admin server: its header and body timeouts
    (``WEBHOOKS_ADMIN_HEADER_TIMEOUT``, ``WEBHOOKS_ADMIN_BODY_TIMEOUT``), a 16 KiB head, its
    caps (``WEBHOOKS_ADMIN_MAX_CONNECTIONS``, ``WEBHOOKS_ADMIN_MAX_CLIENT_CONNECTIONS``) and
    the public port's head count and keep-alive."""
    limits = dataclasses.replace(
        Limits.from_settings(settings),
        max_header_bytes=MAX_HEADER_BYTES,
        header_timeout=settings.admin_header_timeout,
        body_timeout=settings.admin_body_timeout,
        max_connections=settings.admin_max_connections,
    )
    return type(
        "AdminServerProtocol",
        (AdminProtocol,),
        {
            "limits": limits,
            "open_connections": Connections(),
            "max_client_connections": settings.admin_max_client_connections,
        },
    )
