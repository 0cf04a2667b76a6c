"""The baselines of the receiver benchmark, written the way most tutorials write them.

(a) ``naive``: FastAPI, HMAC check (standardwebhooks), ``task.delay(payload)``, no database.
(b) ``naive_insert``: the same plus one INSERT per request (SQLAlchemy session, commit).
(c) ``bare``: a bare ASGI app that returns 200.

Run with ``uvicorn bench.naive_apps:<name> --factory``; settings from the WEBHOOKS_* env.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from typing import Any

from celery import Celery
from fastapi import FastAPI, HTTPException, Request
from sqlalchemy import Column, Integer, LargeBinary, MetaData, Table, Text, create_engine
from sqlalchemy.orm import sessionmaker
from standardwebhooks.webhooks import Webhook, WebhookVerificationError
from starlette.concurrency import run_in_threadpool

SECRET = os.environ["BENCH_SECRET"]
BROKER = os.environ["WEBHOOKS_BROKER_URL"]
DB_URL = os.environ["WEBHOOKS_DATABASE_URL"].replace("postgresql://", "postgresql+psycopg://")

celery_app = Celery("naive", broker=BROKER)
celery_app.conf.update(task_serializer="json", accept_content=["json"])


@celery_app.task(name="naive.process_webhook")
def process_webhook(payload: str) -> None:
    """Never runs in the benchmark (no worker): only the publish cost counts."""


metadata = MetaData()
naive_events = Table(
    "naive_events",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("event_id", Text),
    Column("payload", LargeBinary),
)


def naive() -> FastAPI:
    app = FastAPI()
    wh = Webhook(SECRET)

    @app.post("/webhook")
    async def webhook(request: Request) -> dict[str, str]:
        body = await request.body()
        try:
            wh.verify(body, dict(request.headers))
        except WebhookVerificationError:
            raise HTTPException(status_code=401, detail="bad signature") from None
        process_webhook.delay(body.decode())
        return {"status": "ok"}

    return app


def naive_insert() -> FastAPI:
    app = FastAPI()
    wh = Webhook(SECRET)
    engine = create_engine(DB_URL, pool_size=10)
    metadata.create_all(engine)
    factory = sessionmaker(engine)

    @app.post("/webhook")
    async def webhook_raw(request: Request) -> dict[str, str]:
        body = await request.body()
        try:
            wh.verify(body, dict(request.headers))
        except WebhookVerificationError:
            raise HTTPException(status_code=401, detail="bad signature") from None

        # The tutorial's blocking session work, run where FastAPI runs sync code (a thread)
        # rather than on the event loop, so the baseline is not a straw man.
        def store() -> None:
            with factory() as db:
                db.execute(
                    naive_events.insert().values(
                        event_id=request.headers["webhook-id"], payload=body
                    )
                )
                db.commit()

        await run_in_threadpool(store)
        process_webhook.delay(body.decode())
        return {"status": "ok"}

    return app


def bare() -> Callable[..., Awaitable[None]]:
    async def app(
        scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]
    ) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        more = True
        while more:
            message = await receive()
            more = message.get("more_body", False)
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/plain")],
            }
        )
        await send({"type": "http.response.body", "body": b"ok"})

    return app
