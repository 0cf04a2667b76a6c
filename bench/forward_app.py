"""The baseline of bench_forward.py: a bare Celery task that POSTs a body to a URL with
httpx, with the pipeline's own Celery configuration (same broker, acks_late, prefetch 1, time
limits, events) and nothing else: no claim, no database, no signing.

Each running task borrows an ``httpx.Client`` of its own from a stack (one kept-alive
connection each), as ``forward`` does: one client shared by ~100 concurrent requests spends
its CPU in httpcore's pool, which checks every pooled connection on each request."""

from __future__ import annotations

import httpx

from core.settings import load_settings
from tasks.config import create_app

FORWARD_TASK = "bench.forward"

app = create_app(load_settings(), main="bench")
_idle: list[httpx.Client] = []
# One TLS context for every client: building one per client costs milliseconds each.
_tls = httpx.create_ssl_context()


@app.task(name=FORWARD_TASK, ignore_result=True)
def forward(url: str, body: str) -> None:
    client = _idle.pop() if _idle else httpx.Client(verify=_tls)
    try:
        response = client.post(
            url, content=body, headers={"content-type": "application/json"}, timeout=10.0
        )
        response.raise_for_status()
    finally:
        _idle.append(client)
