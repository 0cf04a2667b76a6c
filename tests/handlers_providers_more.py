"""A handler for the issue-13 second-half tests (WEBHOOKS_HANDLER_MODULES=tests.handlers_providers_more):
it records what a handler sees of a form-encoded event (its content type, ``event.form`` and
what ``event.json`` says) in ``test_form_seen``, through ``ctx.session``."""

from __future__ import annotations

import json

from sqlalchemy import text

from tasks.context import Event, HandlerContext
from tasks.errors import PermanentError
from tasks.handlers import register

FORM_SEEN_DDL = """
CREATE TABLE IF NOT EXISTS test_form_seen (
    event_id text PRIMARY KEY,
    content_type text,
    form jsonb,
    json_error text
)
"""


@register("form_seen")
def form_seen(event: Event, ctx: HandlerContext) -> None:
    try:
        _ = event.json
        json_error = None
    except PermanentError as exc:
        json_error = str(exc)
    ctx.session.execute(
        text(
            "INSERT INTO test_form_seen (event_id, content_type, form, json_error) "
            "VALUES (:e, :c, CAST(:f AS jsonb), :j) ON CONFLICT DO NOTHING"
        ),
        {
            "e": event.event_id,
            "c": event.meta.content_type,
            "f": json.dumps(event.form),
            "j": json_error,
        },
    )
