"""The baseline of bench_workers.py: a bare Celery no-op task, with the pipeline's own Celery
configuration (same broker, acks_late, prefetch 1, time limits, events) and nothing else."""

from __future__ import annotations

from core.settings import load_settings
from tasks.config import create_app

NOOP_TASK = "bench.noop"

app = create_app(load_settings(), main="bench")


@app.task(name=NOOP_TASK, ignore_result=True)
def noop(delivery_id: int) -> None:
    return None
