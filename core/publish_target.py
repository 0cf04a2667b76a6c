"""The ``publish`` handler's route options, judged without I/O (issue 37 item 5), and route
options as operators are shown them (a URL's password masked).

    webhooks routes add SOURCE --handler publish --option url=amqp://user:pw@mq:5672/vhost \\
        --option exchange=events --option routing_key=stripe.{type}

``url``: ``amqp://`` or ``amqps://`` with a host (it may carry a user and password: never
logged, and shown as ``***`` by ``routes list/show``, the console and the admin API).
``exchange``: the exchange's name, which must exist (it is not declared: a missing one is a
broker refusal, retried). ``routing_key``: a template over ``{type}`` (the event type),
``{source}`` (the source's public id) and ``{event_id}``; ``{type}`` by default. Each is
checked when the route is saved (:func:`publish_target`), a bad one refused in one line.
"""

from __future__ import annotations

import string
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import SplitResult, urlsplit

TEMPLATE_FIELDS = ("type", "source", "event_id")
DEFAULT_ROUTING_KEY = "{type}"
# AMQP's short strings (exchange names, routing keys) are at most 255 bytes.
MAX_SHORT = 255
MASK = "***"


@dataclass(frozen=True)
class PublishTarget:
    """Where a ``publish`` route publishes: the broker URL, the exchange, the routing key's
    template."""

    url: str = field(repr=False)  # may carry a password
    exchange: str
    routing_key: str

    def key_for(self, *, event_type: str, source: str, event_id: str) -> str:
        """The routing key of one event (the template filled in)."""
        return self.routing_key.format(type=event_type, source=source, event_id=event_id)


def _check_template(template: str) -> None:
    """Plain ``{field}`` names of :data:`TEMPLATE_FIELDS` only: no attribute or index access,
    no conversion, no format spec (a template is an operator's input, filled per event)."""
    try:
        parts = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ValueError(
            f"publish route's routing_key {template!r} is not a template: {exc}"
        ) from None
    for _literal, name, spec, conversion in parts:
        if name is None:
            continue
        if name not in TEMPLATE_FIELDS or spec or conversion:
            allowed = ", ".join("{" + f + "}" for f in TEMPLATE_FIELDS)
            raise ValueError(f"publish route's routing_key may use {allowed} only, not {{{name}}}")


def publish_target(options: Mapping[str, Any]) -> PublishTarget:
    """The route's target, or ValueError with one line saying what is wrong (no password in
    it: the URL is never quoted)."""
    url = str(options.get("url") or "")
    try:
        parts = urlsplit(url)
        host = parts.hostname
        parts.port  # noqa: B018 (a bad port raises ValueError here)
    except ValueError:
        raise ValueError("publish route's url is not a valid amqp:// URL") from None
    if parts.scheme not in ("amqp", "amqps") or not host:
        raise ValueError("the publish handler needs --option url=amqp://HOST[:PORT]/VHOST")
    exchange = str(options.get("exchange") or "")
    if not exchange.strip():
        raise ValueError("the publish handler needs --option exchange=NAME (an existing exchange)")
    if len(exchange.encode()) > MAX_SHORT:
        raise ValueError(f"publish route's exchange name is longer than {MAX_SHORT} bytes")
    routing_key = str(options.get("routing_key") or DEFAULT_ROUTING_KEY)
    _check_template(routing_key)
    unknown = sorted(set(options) - {"url", "exchange", "routing_key"})
    if unknown:
        raise ValueError(
            f"the publish handler takes the options url, exchange and routing_key, not "
            f"{', '.join(unknown)}"
        )
    return PublishTarget(url, exchange, routing_key)


def masked_url(url: str) -> str:
    """``url`` with its password, if any, as ``***`` (the rest as given)."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        return url
    if not password:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return SplitResult(
        parts.scheme, f"{user}:{MASK}@{host}", parts.path, parts.query, parts.fragment
    ).geturl()


def shown_options(options: Mapping[str, Any] | None) -> dict[str, Any]:
    """A route's options as operators see them: any URL's password masked."""
    return {
        key: masked_url(value) if isinstance(value, str) and "://" in value else value
        for key, value in (options or {}).items()
    }
