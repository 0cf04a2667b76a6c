"""The downstream of bench_forward.py: answers 200 after ``BENCH_DELAY_MS`` and remembers,
for each request, how long after the event was sent (``sent_at`` in its JSON body) it
answered. ``GET /stats`` returns the count and those latencies (``?count=1``: the count only); ``DELETE /stats`` resets."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import orjson

DELAY = float(os.environ.get("BENCH_DELAY_MS", "100")) / 1000.0
_latencies: list[float] = []


async def _body(receive: Any) -> bytes:
    chunks = []
    more = True
    while more:
        message = await receive()
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    return b"".join(chunks)


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    method = scope["method"]
    body = await _body(receive)
    if scope["path"] == "/stats":
        if method == "DELETE":
            _latencies.clear()
        if scope.get("query_string") == b"count=1":
            payload = orjson.dumps({"count": len(_latencies)})
        else:
            payload = orjson.dumps({"count": len(_latencies), "latencies": _latencies})
    else:
        await asyncio.sleep(DELAY)
        try:
            sent = float(orjson.loads(body)["sent_at"])
            _latencies.append(time.time() - sent)
        except (ValueError, KeyError, TypeError):
            _latencies.append(-1.0)
        payload = b"{}"
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json")]})  # fmt: skip
    await send({"type": "http.response.body", "body": payload})
