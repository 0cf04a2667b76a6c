"""The pipeline's workers: ``celery -A tasks worker`` and ``celery -A tasks beat``.

``tasks.app`` is built on first access from the environment (``WEBHOOKS_*``, ``.env``) by
:func:`tasks.worker.build_app`, so importing a submodule such as ``tasks.config`` or
``tasks.policy`` needs no configuration, while the Celery command line finds a fully
configured app with its tasks registered.
"""

from __future__ import annotations

import sys
from typing import Any

from core.settings import load_settings
from tasks import observability


def __getattr__(name: str) -> Any:
    # `celery -A tasks` looks up `tasks.app`; build it only then.
    if name != "app":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    settings = load_settings()
    # First: it chooses prometheus-client's multi-process mode, which must happen before
    # anything (the task modules, through core.metrics) imports prometheus_client's metrics.
    observability.setup(settings, sys.argv)
    from tasks.worker import build_app  # noqa: PLC0415 (it imports core.metrics: after setup)

    app = build_app(settings)
    globals()["app"] = app  # later look-ups find it without coming here
    return app
