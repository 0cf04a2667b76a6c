"""The downstream of bench_fairness.py: one ASGI app, a delay per path (``BENCH_PATH_DELAYS``,
e.g. ``noisy=200,quiet=10``: milliseconds, the path's last segment), a path that answers 503
until a set instant (``POST /control?path=failing&until=<epoch s>``), and every call kept:
``GET /stats`` returns ``[path, arrived (epoch s), status, event id]`` per call, and the
highest number of calls in progress at once per path; ``DELETE /stats`` resets."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any
from urllib.parse import parse_qs

import orjson

DELAYS = {
    name: float(ms) / 1000.0
    for name, ms in (
        item.split("=") for item in os.environ.get("BENCH_PATH_DELAYS", "").split(",") if item
    )
}
_calls: list[list[Any]] = []
_fail_until: dict[str, float] = {}
_busy: dict[str, int] = {}
_peak: dict[str, int] = {}


async def _body(receive: Any) -> bytes:
    chunks = []
    more = True
    while more:
        message = await receive()
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    return b"".join(chunks)


async def _answer(send: Any, status: int, payload: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json")]})  # fmt: skip
    await send({"type": "http.response.body", "body": payload})


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    body = await _body(receive)
    path = scope["path"]
    if path == "/stats":
        if scope["method"] == "DELETE":
            _calls.clear()
            _peak.clear()
        await _answer(send, 200, orjson.dumps({"calls": _calls, "peak": _peak}))
        return
    if path == "/control":
        query = parse_qs(scope["query_string"].decode())
        _fail_until[query["path"][0]] = float(query["until"][0])
        await _answer(send, 200, b"{}")
        return
    name = path.rsplit("/", 1)[-1]
    arrived = time.time()
    try:
        event_id = str(orjson.loads(body)["data"]["id"])
    except (ValueError, KeyError, TypeError):
        event_id = ""
    status = 503 if arrived < _fail_until.get(name, 0.0) else 200
    _calls.append([name, arrived, status, event_id])
    if status == 200:
        _busy[name] = _busy.get(name, 0) + 1
        _peak[name] = max(_peak.get(name, 0), _busy[name])
        try:
            await asyncio.sleep(DELAYS.get(name, 0.0))
        finally:
            _busy[name] -= 1
    await _answer(send, status, b"{}")
