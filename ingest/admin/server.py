"""The admin plane's assembly and server: ``/metrics`` and, with a token configured, the API
(:mod:`ingest.admin.api`) under ``/admin`` and the console (:mod:`ingest.console`) under
``/console``, all behind :class:`~ingest.admin.guard.AdminGuard`; run by ``webhooks serve``
in a thread of its process (:class:`AdminServer`), or alone (:func:`app_from_env`)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import uvicorn
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    generate_latest,
    values,
)
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Mount, Route

from core import metrics
from core.clock import Clock, SystemClock
from core.logs import configure_logging
from core.settings import Settings, load_settings
from ingest.admin.api import create_api
from ingest.admin.guard import CONSOLE_PREFIX, AdminGuard
from ingest.admin.protocol import admin_protocol
from ingest.console.app import create_console
from ingest.plane import OperatorTokens, PlaneState


def metrics_endpoint(
    multiprocess_dir: str | None = None,
) -> Callable[[Request], Awaitable[Response]]:
    """``GET /metrics``: the receiver's families. With ``multiprocess_dir`` (several receiver
    processes, this one their supervisor) the sum of every process's files there, and the
    admin plane's own families (:data:`core.metrics.ADMIN_PLANE`) from this process's
    registry when it counts in memory; otherwise this process's own registry, or its
    multiprocess directory when it runs in that mode."""

    async def endpoint(request: Request) -> Response:
        # The receiver's own families only: the workers' are defined here too, at zero.
        body = generate_latest(metrics.exposed("receiver", metrics_source(multiprocess_dir)))
        return PlainTextResponse(body, media_type=CONTENT_TYPE_LATEST)

    return endpoint


def metrics_source(multiprocess_dir: str | None = None) -> Any:
    """What ``/metrics`` reads (see :func:`metrics_endpoint`), read afresh: the console's
    degraded card reads the same counts."""
    # Multiprocess mode is fixed when prometheus_client is first imported: ask it.
    in_memory = values.ValueClass is values.MutexValue
    if multiprocess_dir is None and in_memory:
        return REGISTRY
    source = CollectorRegistry()
    source.register(metrics.SettledFiles(multiprocess_dir))
    if in_memory:  # the supervisor's admin plane: its counts are in no file
        source.register(metrics.only(REGISTRY, metrics.ADMIN_PLANE))
    return source


def create_admin_app(
    settings: Settings, *, clock: Clock | None = None, multiprocess_dir: str | None = None
) -> AdminGuard:
    """The admin plane: ``/metrics`` (no token) and, when a token is configured, the API under
    ``/admin`` and the console under ``/console``, sharing one :class:`PlaneState`; all
    behind :class:`AdminGuard`."""
    tokens = OperatorTokens(settings.admin_tokens_by_name())
    routes: list[Route | Mount] = [
        Route("/metrics", metrics_endpoint(multiprocess_dir), methods=["GET"])
    ]
    state = None
    if tokens:
        state = PlaneState(settings, clock or SystemClock(), tokens)
        state.read_metrics = lambda: metrics_source(multiprocess_dir)
        routes.append(Mount("/admin", app=create_api(state)))
        routes.append(Mount(CONSOLE_PREFIX, app=create_console(state)))
    return AdminGuard(
        Starlette(routes=routes),
        tokens,
        clock=clock,
        settings=settings,
        throttle=None if state is None else state.throttle,
        sessions=None if state is None else state.console_sessions,
    )


class AdminServer:
    """The admin plane's uvicorn server in a thread of the process that runs ``webhooks
    serve``: the receiver's process itself (one process: ``/metrics`` reads its registry), or
    the supervisor of several (``/metrics`` adds up their multiprocess files).

    The socket is bound here, at once, so a taken port stops ``webhooks serve`` before the
    receiver starts. ``uvicorn.Server.run`` in a thread other than the main one installs no
    signal handlers; :meth:`stop` ends it.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        host: str,
        port: int,
        multiprocess_dir: str | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.sock = _bind(host, port)
        config = uvicorn.Config(
            create_admin_app(settings, clock=clock, multiprocess_dir=multiprocess_dir),
            log_config=None,  # the receiver's logging stays as it is
            log_level="warning",
            access_log=False,
            lifespan="off",
            proxy_headers=False,
            # The public port's protocol with the admin plane's limits: its own header and
            # body timeouts, and caps at which slow connections make room for new ones.
            http=admin_protocol(settings),
            loop="asyncio",
            timeout_keep_alive=settings.keep_alive_timeout,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, name="admin", daemon=True
        )

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout: float = 10) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()


def _bind(host: str, port: int) -> socket.socket:
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def app_from_env() -> AdminGuard:
    """``uvicorn --factory ingest.admin:app_from_env``: the admin API on its own (its
    ``/metrics`` shows this process's registry only; ``webhooks serve`` runs the admin plane
    beside the receiver, where ``/metrics`` means something)."""
    settings = load_settings()
    configure_logging(settings.log_level, json=settings.log_json)
    return create_admin_app(settings)
