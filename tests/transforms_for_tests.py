"""Transforms the route transform tests name (WEBHOOKS_HANDLER_MODULES=tests.transforms_for_tests,
beside tests.handlers_for_tests)."""

from __future__ import annotations

from tasks.context import Event
from tasks.transforms import Transformed, register_transform

# What the raising transform's exception says: a stand-in for payload, which must never be
# stored or logged.
SECRET_WORDS = "payload-words-never-stored"


@register_transform("reshape")
def reshape(event: Event) -> Transformed | None:
    """A summary of the event and a header of its own; None for an event asking to be dropped."""
    body = event.json
    if body["data"].get("drop"):
        return None
    return Transformed(
        {"kind": event.event_type, "n": body["data"]["n"], "reshaped": True},
        {"x-tenant": "acme"},
    )


@register_transform("explodes")
def explodes(event: Event) -> Transformed:
    raise KeyError(SECRET_WORDS)


@register_transform("spins")
def spins(event: Event) -> Transformed:
    """A runaway: a loop of Python code that never ends, swallowing every Exception."""
    n = 0
    while True:
        try:
            n += 1
        except Exception:  # noqa: BLE001, S112 (a runaway that would swallow an Exception)
            continue
