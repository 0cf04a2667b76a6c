"""Log lines stay whole (found in a full run: a worker's JSON line and Celery's own
"Task ... received" line, written by two threads at once, merged into one unparsable line,
and a test reading the worker's log lost a retry). A real process, threads writing through
structlog and the standard library at once."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT

SCRIPT = """
import logging, threading
from core.logs import configure_logging, get_logger
configure_logging("INFO", json=True)
log, std = get_logger("t"), logging.getLogger("celery.like")

def ours():
    for i in range(3000):
        log.info("delivery.retry", delivery_id=i, delay_s=0.5)

def theirs():
    for i in range(3000):
        std.info("Task webhooks.deliver[%s] received", i)

threads = [threading.Thread(target=f) for f in (ours, theirs, ours, theirs)]
for t in threads: t.start()
for t in threads: t.join()
"""


def test_json_lines_and_standard_library_lines_never_merge() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, check=True
    )
    lines = done.stderr.splitlines()
    ours = [line for line in lines if line.startswith("{")]
    assert len(ours) == 6000
    assert all(json.loads(line)["event"] == "delivery.retry" for line in ours)
    theirs = [line for line in lines if not line.startswith("{")]
    assert len(theirs) == 6000
    assert all(
        line.startswith("Task webhooks.deliver[") and line.endswith("received") for line in theirs
    )
