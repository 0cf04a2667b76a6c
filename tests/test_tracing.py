"""OpenTelemetry traces across the pipeline (issue 36 item 5): one event's spans, from the
receiver's accept through the publish, the broker and the worker's claim and handler to the
forward route's downstream call, share one trace; the downstream receives a ``traceparent``
of that trace. Real processes (``webhooks serve``, a Celery worker), exporting over OTLP/HTTP
to a collector on loopback that decodes what the SDK's exporter sends; off, nothing of the SDK
is imported."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from core import tracing
from core.settings import Settings
from tests.factories import make_source
from tests.leakcheck import remember
from tests.loopback import Loopback, Quiet
from tests.processes import receiver
from tests.signing import sign
from tests.workers import BROKER_URL, CLAIMS_URL, flush_redis, running_worker, wait_for, wait_status

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class Span:
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, Any]
    start_ns: int
    end_ns: int


class Collector(Loopback):
    """An OTLP/HTTP trace endpoint on loopback: every span the exporters send, decoded."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        collector = self

        class Handler(Quiet):
            def do_POST(self) -> None:
                request = ExportTraceServiceRequest()
                request.ParseFromString(self.rfile.read(int(self.headers["content-length"])))
                for resource in request.resource_spans:
                    for scope in resource.scope_spans:
                        collector.spans += [_span(s) for s in scope.spans]
                self.answer()

        super().__init__(Handler)


def _span(s: Any) -> Span:
    attributes = {a.key: getattr(a.value, a.value.WhichOneof("value")) for a in s.attributes}
    return Span(s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), attributes,
                s.start_time_unix_nano, s.end_time_unix_nano)  # fmt: skip


class Downstream(Loopback):
    """A forward route's downstream: records each request's headers, answers 200."""

    def __init__(self) -> None:
        self.headers: list[dict[str, str]] = []
        downstream = self

        class Handler(Quiet):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["content-length"]))
                downstream.headers.append({k.lower(): v for k, v in self.headers.items()})
                self.answer()

        super().__init__(Handler, "/hook")


@pytest.fixture
def collector() -> Iterator[Collector]:
    made = Collector()
    yield made
    made.close()


@pytest.fixture
def downstream() -> Iterator[Downstream]:
    made = Downstream()
    yield made
    made.close()


def test_one_events_spans_share_a_trace_from_accept_to_the_downstream(
    sessions: sessionmaker[Session],
    settings: Settings,
    engine: Engine,
    tmp_path: Path,
    collector: Collector,
    downstream: Downstream,
) -> None:
    flush_redis()
    route = {"handler": "forward", "options": {"url": downstream.url, "allow_private": "true"}}
    source = make_source(sessions, settings, provider="stripe", routes=[route])
    remember(source.secret)
    otel = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": collector.url,
        "OTEL_BSP_SCHEDULE_DELAY": "100",  # export within 0.1 s, not 5
    }
    with (
        receiver(WEBHOOKS_BROKER_URL=BROKER_URL, WEBHOOKS_REDIS_URL=CLAIMS_URL, **otel) as rcv,
        running_worker("traced", tmp_path, pool="threads", concurrency=2, extra_env=otel),
    ):
        headers, body = sign("stripe", source.secret, event_id="evt_traced_once")
        remember(body)
        answer = httpx.post(f"{rcv.url}/webhooks/{source.public_id}", headers=headers, content=body)
        assert answer.status_code == 202, answer.text
        wait_for(lambda: downstream.headers, timeout=60, what="the forward's call")
        names = ("webhooks.accept", "webhooks.publish", "webhooks.claim", "webhooks.handler",
                 "webhooks.downstream")  # fmt: skip
        wait_for(
            lambda: {s.name for s in collector.spans} >= set(names),
            timeout=60,
            what="the five spans at the collector",
        )
    by_name = {s.name: s for s in collector.spans}
    accept, publish, claim, handled, call = (by_name[n] for n in names)
    for depth, s in enumerate((accept, publish, claim, handled, call)):  # shown with -s
        offset, took = (s.start_ns - accept.start_ns) / 1e6, (s.end_ns - s.start_ns) / 1e6
        print(f"{'  ' * depth}{s.name:<22} +{offset:7.1f} ms  {took:6.1f} ms")
    # One trace, each span the child of the one before it.
    assert {s.trace_id for s in (accept, publish, claim, handled, call)} == {accept.trace_id}
    assert publish.parent_id == accept.span_id
    assert claim.parent_id == publish.span_id
    assert handled.parent_id == claim.span_id
    assert call.parent_id == handled.span_id
    assert accept.attributes["webhooks.event_id"] == "evt_traced_once"
    assert accept.attributes["webhooks.source"] == source.public_id
    assert handled.attributes["webhooks.handler"] == "forward"
    assert "url.full" not in call.attributes  # the host only: a URL may carry a token
    # The downstream received the call's span as its parent.
    (sent,) = downstream.headers
    version, trace_id, parent_id, flags = sent["traceparent"].split("-")
    assert (version, trace_id, parent_id) == ("00", accept.trace_id, call.span_id)
    assert int(flags, 16) & 1  # sampled
    assert tracing.trace_id(sent["traceparent"]) == accept.trace_id
    [delivery_id] = [s.attributes["webhooks.delivery_id"] for s in (handled,)]
    assert wait_status(engine, int(delivery_id), "succeeded", timeout=30).status == "succeeded"


def test_off_without_an_endpoint_and_no_tracer_made() -> None:
    """Without an OTLP endpoint (the default) setup does nothing: the receiver's and the
    worker's modules load without the SDK's tracer or an exporter (redis-py itself imports
    the SDK's metrics when the SDK is installed, as it is here: not ours to judge)."""
    assert not tracing.wanted({})
    assert not tracing.wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "  "})
    assert tracing.wanted({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318"})
    probe = (
        "import sys, ingest.app, tasks.worker, tasks.handlers.forward\n"
        "from core import tracing\n"
        "assert tracing.setup('probe', {}) is False\n"
        "print(sorted(m for m in sys.modules\n"
        "             if m.startswith(('opentelemetry.sdk.trace', 'opentelemetry.exporter'))))\n"
    )
    shown = subprocess.run(  # noqa: S603
        [sys.executable, "-c", probe], capture_output=True, text=True, check=False, timeout=60
    )
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.strip() == "[]"
