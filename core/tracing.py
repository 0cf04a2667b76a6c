"""OpenTelemetry traces across the pipeline (issue 36 item 5): one trace per event, from the
receiver's accept through the publish and the broker to the worker's claim, the handler and
the downstream call, with the W3C ``traceparent`` header sent to a forward route's downstream.

Optional and off by default. It turns on in a process whose environment names an OTLP
endpoint (``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, the
standard variables; the rest of ``OTEL_*`` is read by the SDK itself: headers, timeout,
``OTEL_SERVICE_NAME``, ``OTEL_TRACES_SAMPLER``) and that has the SDK installed (``pip install
'.[otel]'``). Off, nothing of OpenTelemetry is imported and every call here returns at its
first line: :data:`STATE` ``.on`` is what a hot path checks first.

Spans cross threads and the broker as ``traceparent`` strings, never through context
variables: the publisher thread, a message's handler threads and another host each carry the
string they were handed (:class:`core.messages.Dispatch` ``.trace``, the message header
:data:`core.messages.TRACE_HEADER`, ``HandlerContext.traceparent``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from core.logs import get_logger
from core.messages import Dispatch

log = get_logger(__name__)

ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")


class _State:
    on = False
    tracer: Any = None
    provider: Any = None
    pid: int | None = None


STATE = _State()


def wanted(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the environment asks for traces (an OTLP endpoint named; pure)."""
    return any(environ.get(name, "").strip() for name in ENDPOINT_VARIABLES)


def setup(service: str, environ: Mapping[str, str] = os.environ) -> bool:
    """Turn traces on in this process when :func:`wanted`, exporting to the OTLP endpoint in
    batches; again after a fork (a pool child: the batch thread does not survive it). True
    when on. Without the SDK installed: one line saying so, and off."""
    if not wanted(environ):
        return False
    if STATE.on and STATE.pid == os.getpid():
        return True
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # noqa: PLC0415 (only when traces are asked for)
            OTLPSpanExporter,
        )
        from opentelemetry.sdk.resources import Resource  # noqa: PLC0415 (likewise)
        from opentelemetry.sdk.trace import TracerProvider  # noqa: PLC0415 (likewise)
        from opentelemetry.sdk.trace.export import BatchSpanProcessor  # noqa: PLC0415 (likewise)
    except ImportError as exc:
        log.warning("tracing.unavailable", reason="install the otel extra", error=str(exc))
        return False
    name = environ.get("OTEL_SERVICE_NAME") or f"webhooks-{service}"
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    STATE.provider, STATE.tracer = provider, provider.get_tracer("webhooks")
    STATE.on, STATE.pid = True, os.getpid()
    log.info("tracing.on", service=name)
    return True


def shutdown() -> None:
    """Export what is buffered and stop (a process's exit)."""
    if STATE.on and STATE.provider is not None:
        STATE.provider.shutdown()
    STATE.on, STATE.tracer, STATE.provider = False, None, None


def _context(traceparent: str | None) -> Any:
    from opentelemetry.trace.propagation.tracecontext import (  # noqa: PLC0415 (only on)
        TraceContextTextMapPropagator,
    )

    if not traceparent:
        return None
    return TraceContextTextMapPropagator().extract({"traceparent": traceparent})


def _traceparent(span: Any) -> str:
    from opentelemetry.trace import set_span_in_context  # noqa: PLC0415 (only on)
    from opentelemetry.trace.propagation.tracecontext import (  # noqa: PLC0415 (only on)
        TraceContextTextMapPropagator,
    )

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, context=set_span_in_context(span))
    return carrier["traceparent"]


def _kind(kind: str) -> Any:
    from opentelemetry.trace import SpanKind  # noqa: PLC0415 (only on)

    return getattr(SpanKind, kind.upper())


@contextmanager
def span(
    name: str,
    *,
    parent: str | None = None,
    kind: str = "internal",
    attributes: Mapping[str, Any] | None = None,
) -> Iterator[str | None]:
    """A span named ``name``, the child of ``parent`` (a traceparent; None: a new trace),
    current for its block; yields its own traceparent to hand on (None when off)."""
    if not STATE.on:
        yield None
        return
    with STATE.tracer.start_as_current_span(
        name, context=_context(parent), kind=_kind(kind), attributes=dict(attributes or {})
    ) as current:
        yield _traceparent(current)


def record(
    name: str,
    *,
    parent: str | None,
    start_ns: int,
    end_ns: int | None = None,
    kind: str = "internal",
    attributes: Mapping[str, Any] | None = None,
) -> str | None:
    """A span that already happened (from ``start_ns`` to ``end_ns``, default now, on
    ``time.time_ns``'s clock), the child of ``parent``; its traceparent (None when off). For
    work timed before its span could be named: a request accepted, a message's claim."""
    if not STATE.on:
        return None
    started = STATE.tracer.start_span(
        name,
        context=_context(parent),
        kind=_kind(kind),
        attributes=dict(attributes or {}),
        start_time=start_ns,
    )
    started.end(end_time=end_ns if end_ns is not None else time.time_ns())
    return _traceparent(started)


def trace_id(traceparent: str) -> str:
    """The trace id of a W3C traceparent (``00-<trace id>-<span id>-<flags>``; pure)."""
    return traceparent.split("-")[1]


def accepted(
    dispatches: list[Dispatch], source: str, provider: str, started: float, parent: str | None
) -> list[Dispatch]:
    """The receiver's spans (tracing on): each accepted event's, from the request's start
    (``started``, on ``perf_counter``) to its commit (the child of the request's own
    ``traceparent`` if a proxy sent one), and its deliveries carrying it to the publisher,
    the broker and the workers."""
    start_ns = time.time_ns() - int((time.perf_counter() - started) * 1e9)
    spans: dict[str | None, str | None] = {}
    out = []
    for d in dispatches:
        if d.event_id not in spans:
            attributes = {
                "webhooks.source": source,
                "webhooks.provider": provider,
                "webhooks.event_id": d.event_id or "",
            }
            spans[d.event_id] = record(
                "webhooks.accept", parent=parent, start_ns=start_ns, kind="server",
                attributes=attributes,
            )  # fmt: skip
        out.append(d._replace(trace=spans[d.event_id]))
    return out
