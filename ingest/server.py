"""The receiver's HTTP server limits: uvicorn's httptools protocol with the edges closed.

uvicorn bounds neither a request's head nor the time a client may take to send it, and its
``limit_concurrency`` answers 503 without ``Retry-After``. :class:`ReceiverProtocol` adds, per
connection and from :class:`~core.settings.Settings`:

- **head size**: request line plus headers larger than ``WEBHOOKS_MAX_HEADER_BYTES`` (or more
  than ``WEBHOOKS_MAX_HEADERS`` headers) -> ``431``, connection closed. The count runs while the
  head is still arriving, so a 30 MB header is refused after its first ``max_header_bytes`` plus
  one read (at most 256 KiB) is buffered, never in full;
- **read timeouts**: the head must arrive within ``WEBHOOKS_HEADER_TIMEOUT`` of the connection
  opening or the request starting (``408``, closed), and the body within
  ``WEBHOOKS_BODY_TIMEOUT`` of the head: a connection that stalls or trickles (slowloris) is
  closed, and the app sees a disconnect. Idle keep-alive is ``WEBHOOKS_KEEP_ALIVE_TIMEOUT``;
- **connections**: beyond ``WEBHOOKS_MAX_CONNECTIONS`` open connections in this process, a new
  one gets ``503`` with ``Retry-After`` and is closed before anything of it is read.

Each refusal is counted in ``webhooks_receiver_limits_total{limit=...}``; none is logged per
request (a flood must not become a log flood).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from functools import cache
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from core import metrics
from core.errors import WebhooksError
from core.settings import Settings, load_settings

# Bytes a header line adds beyond its name and value: ": " and CRLF.
_LINE_OVERHEAD = 4
# The request line beyond its URL: method, spaces, "HTTP/1.1" and CRLF.
_REQUEST_LINE_OVERHEAD = 20
_REASONS = {
    408: b"Request Timeout",
    431: b"Request Header Fields Too Large",
    503: b"Service Unavailable",
}


@dataclass(frozen=True)
class Limits:
    max_header_bytes: int
    max_headers: int
    header_timeout: float
    body_timeout: float
    max_connections: int
    retry_after: int = 1

    @classmethod
    def from_settings(cls, settings: Settings) -> Limits:
        return cls(
            max_header_bytes=settings.max_header_bytes,
            max_headers=settings.max_headers,
            header_timeout=settings.header_timeout,
            body_timeout=settings.body_timeout,
            max_connections=settings.max_connections,
        )


@cache
def _process_limits() -> Limits:
    # uvicorn instantiates the protocol by class (and, with several workers, in spawned
    # processes), so the limits come from the same environment the app's settings do.
    return Limits.from_settings(load_settings())


class _Refused(WebhooksError):  # noqa: N818 - raised inside a parser callback, never escapes
    """A request refused while its body streams in (over a limit): its status and the limit."""

    def __init__(self, status: int, limit: str) -> None:
        super().__init__(limit)
        self.status = status
        self.limit = limit


def _plain(status: int, extra: bytes = b"") -> bytes:
    reason = _REASONS[status]
    return (
        b"HTTP/1.1 %d %s\r\ncontent-type: text/plain; charset=utf-8\r\n"
        b"content-length: %d\r\nconnection: close\r\n%s\r\n%s"
        % (status, reason, len(reason), extra, reason)
    )


class _Coalescing:
    """The transport as a request's cycle sees it: what it writes in one turn of the event
    loop (uvicorn writes a response's head at ``http.response.start`` and its body at
    ``http.response.body``, the next step of the same turn) goes out as one send, at the end
    of that turn. Two sends per response cost the receiver and the sender a wake-up and a
    segment each; this is the receiver's whole answer in one. ``close`` sends what is held
    first; everything else is the transport's own."""

    __slots__ = ("_held", "_loop", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: list[bytes] | None = None

    def write(self, data: bytes) -> None:
        if self._held is None:
            self._held = [data]
            self._loop.call_soon(self.flush)
        else:
            self._held.append(data)

    def flush(self) -> None:
        held, self._held = self._held, None
        if held and not self._transport.is_closing():
            self._transport.write(held[0] if len(held) == 1 else b"".join(held))

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class ReceiverProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with head-size limits, read timeouts and a connection cap."""

    limits: Limits | None = None  # set by the admin server and by tests building one in-process
    limit_prefix = ""  # the admin port's refusals are counted as "admin_<limit>"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._limits = self.limits or _process_limits()
        self._refused = False
        self._head_done = False
        self._head_pending = 0
        self._head_count = 0
        self._timer: asyncio.TimerHandle | None = None
        # The current cycle's transport: what it holds goes out before anything this
        # protocol writes itself (a refusal, a timeout's 408), so answers keep their order.
        self._held: _Coalescing | None = None

    # Connection ---------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self._admit():
            self._arm(self._limits.header_timeout, "header_timeout")

    def _admit(self) -> bool:
        """Whether this new connection may stay open; otherwise it has been refused (closed).
        Here: at most ``max_connections`` in this process, else ``503`` with ``Retry-After``."""
        if len(self.connections) > self._limits.max_connections:
            self._refuse_busy("max_connections")
            return False
        return True

    def _refuse_busy(self, limit: str) -> None:
        self._refuse(503, limit, b"retry-after: %d\r\n" % self._limits.retry_after)

    def shutdown(self) -> None:
        # uvicorn closes an idle connection at shutdown: a response held this turn goes first.
        self._flush_held()
        super().shutdown()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._unsupported_upgrade_warning()
            return
        except httptools.HttpParserError as exc:
            refused = exc.__context__
            if isinstance(refused, _Refused):
                self._refuse(refused.status, refused.limit)
            else:
                metrics.RECEIVER_LIMITS.labels(self.limit_prefix + "malformed_request").inc()
                self._flush_held()
                self.send_400_response("Invalid HTTP request received.")
                self._refused = True
            return
        if not self._head_done and not self._refused:
            # Still inside a head: what it has buffered so far counts against the limit.
            self._head_pending += len(data)
            if self._head_pending > self._limits.max_header_bytes:
                self._refuse(431, "header_bytes")

    # Parser callbacks ---------------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_done = False
        self._head_pending = 0
        self._head_count = _REQUEST_LINE_OVERHEAD
        self._arm(self._limits.header_timeout, "header_timeout")

    def on_url(self, url: bytes) -> None:  # called once per fragment of a split URL
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + _LINE_OVERHEAD)
        if len(self.headers) >= self._limits.max_headers:
            raise _Refused(431, "header_count")
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._head_done = True
        self._arm(self._limits.body_timeout, "body_timeout")
        super().on_headers_complete()
        if self.cycle is not None:  # its answer goes out as one send (_Coalescing)
            self._held = _Coalescing(self.transport, self.loop)
            self.cycle.transport = self._held  # type: ignore[assignment]

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def _count(self, size: int) -> None:
        self._head_count += size
        if self._head_count > self._limits.max_header_bytes:
            raise _Refused(431, "header_bytes")

    # Timers and refusals ------------------------------------------------------------------

    def _flush_held(self) -> None:
        if self._held is not None:
            self._held.flush()

    def _arm(self, seconds: float, limit: str) -> None:
        self._disarm()
        self._timer = self.loop.call_later(seconds, self._expired, limit)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self, limit: str) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        metrics.RECEIVER_LIMITS.labels(self.limit_prefix + limit).inc()
        self._refused = True
        self._flush_held()
        if self.cycle is None or self.cycle.response_complete:
            # No request in progress: say why before closing (the head never completed).
            self.transport.write(_plain(408))
        # Mid-body: the app's receive() now reports a disconnect (counted there). A body still
        # trickling after the answer (a 404 or 413 sent without reading it) is closed too.
        self.transport.close()

    def _refuse(self, status: int, limit: str, extra: bytes = b"") -> None:
        metrics.RECEIVER_LIMITS.labels(self.limit_prefix + limit).inc()
        self._refused = True
        self._disarm()
        self._flush_held()
        self.transport.write(_plain(status, extra))
        self.transport.close()
