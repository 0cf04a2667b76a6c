"""GitHub: ``X-Hub-Signature-256: sha256=<hex HMAC-SHA256(secret, raw body)>``.

Only the body is signed. The delivery id ``X-GitHub-Delivery`` (the dedup id, the same on a
redelivery) and the event header ``X-GitHub-Event`` are not: a captured request can be
replayed with a new delivery id and is then accepted as a new event, forever (no timestamp is
signed). The body carries the ``action`` but not the event's name.

The type is ``{event}.{action}`` (``{event}`` when the body has no action), and by default
the event's name comes from the signed body wherever the body identifies it: every event of
:data:`BODY_KEYS` carries an object of its own at the top level (``issue``, ``pull_request``,
``release``, ...), found in GitHub's payload schemas (octokit/webhooks, checked so that no
other event's payload carries the same keys). ``X-GitHub-Event`` is then only checked: a
delivery whose header names one of those events while the body is another's (a captured
``pull_request`` body re-sent as ``release``) is refused (400 bad_type), nothing written. A
header naming an event no body identifies (``watch``, ``team``, the ``alert`` events,
``installation``, any event newer than the table) is taken as sent and recorded as unsigned:
``events show`` and the console say so, and ``routes add`` warns for a route on such a type
(:func:`unsigned_type`).

Options: ``type_from=header`` takes the header as sent, unchecked (the behaviour before the
default changed; a captured body re-sent under another event runs that event's routes).
``hook_event=NAME`` (a hook subscribed to that one event) takes every type from signed parts:
``NAME.{action}``, or ``ping`` for GitHub's ping (its body carries ``hook`` and ``zen``), and
refuses any delivery whose header names another event. What mitigates the rest: TLS (a
capture needs the plaintext), a secret per source rotated when exposed, and handlers
idempotent on the payload's own object ids. GitHub does not retry automatically; a delivery
from the past 3 days can be redelivered by hand (same id).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final
from urllib.parse import parse_qs

from core.providers.base import (
    SIGNED_FIELD,
    UNSIGNED_FIELD,
    Challenge,
    EventMeta,
    MalformedEvent,
    body_hmac,
    check_mapping,
    event_id,
    event_type,
    header_type,
    json_object,
    type_from_option,
)
from core.providers.descriptions import described

authenticate = body_hmac("x-hub-signature-256", scheme="sha256")

# GitHub's event names: lower-case words joined by underscores (pull_request_review).
_EVENT_NAME: Final = re.compile(r"[a-z][a-z0-9_]{0,63}")
HEADER: Final = "X-GitHub-Event"
_OPTIONS: Final = ("hook_event", "type_from")

#: The events a signed body identifies: (event, the top-level keys its payload always carries),
#: the most specific first (``pull_request`` + ``comment`` before ``pull_request``); the first
#: whose keys are all in the body names it. Derived from GitHub's payload schemas as
#: octokit/webhooks publishes them (payload-schemas/api.github.com): each event's keys are
#: required in every one of its actions, and any other event whose payload may carry them
#: comes earlier. An event left out (ambiguous, or nothing of its own) keeps the header's
#: name, unsigned.
BODY_KEYS: Final[tuple[tuple[str, tuple[str, ...]], ...]] = (
    ("ping", ("hook", "zen")),
    ("meta", ("hook",)),
    ("pull_request_review_comment", ("pull_request", "comment")),
    ("pull_request_review_thread", ("pull_request", "thread")),
    ("pull_request_review", ("pull_request", "review")),
    ("pull_request", ("pull_request",)),
    ("issue_comment", ("issue", "comment")),
    ("issues", ("issue",)),
    ("discussion_comment", ("discussion", "comment")),
    ("discussion", ("discussion",)),
    ("deployment_review", ("since",)),
    ("commit_comment", ("comment",)),
    ("label", ("label",)),
    ("milestone", ("milestone",)),
    ("release", ("release",)),
    ("push", ("pusher",)),
    ("create", ("master_branch",)),
    ("delete", ("ref_type", "pusher_type")),
    ("fork", ("forkee",)),
    ("star", ("starred_at",)),
    ("gollum", ("pages",)),
    ("deployment_status", ("deployment_status",)),
    ("workflow_job", ("workflow_job",)),
    ("deployment", ("deployment", "workflow_run")),
    ("workflow_run", ("workflow_run",)),
    ("check_run", ("check_run",)),
    ("check_suite", ("check_suite",)),
    ("membership", ("scope",)),
    ("member", ("member",)),
    ("merge_group", ("merge_group",)),
    ("repository_dispatch", ("client_payload",)),
    ("workflow_dispatch", ("inputs",)),
    ("package", ("package",)),
    ("registry_package", ("registry_package",)),
    ("security_advisory", ("security_advisory",)),
    ("sponsorship", ("sponsorship",)),
    ("marketplace_purchase", ("marketplace_purchase",)),
    ("project_card", ("project_card",)),
    ("project_column", ("project_column",)),
    ("project", ("project",)),
    ("projects_v2_item", ("projects_v2_item",)),
    ("branch_protection_rule", ("rule",)),
    ("deploy_key", ("key",)),
    ("org_block", ("blocked_user",)),
    ("installation_repositories", ("repositories_added",)),
    ("code_scanning_alert", ("commit_oid",)),
    ("secret_scanning_alert_location", ("location",)),
    ("status", ("sha", "context")),
    ("page_build", ("build",)),
    ("repository_import", ("status",)),
)
SIGNED_EVENTS: Final = frozenset(name for name, _ in BODY_KEYS)


def body_event(payload: Mapping[str, Any]) -> str | None:
    """The event the signed body identifies (:data:`BODY_KEYS`), or None."""
    for name, keys in BODY_KEYS:
        if all(key in payload for key in keys):
            return name
    return None


def validate_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """``hook_event`` (the single event the hook sends) or ``type_from`` (``body``, the
    default, or ``header``): see the module's doc."""
    check_mapping(config)
    unknown = sorted(str(k) for k in config if k not in _OPTIONS)
    if unknown:
        raise ValueError(
            f"unknown option {unknown[0]!r}; the options are 'hook_event' and 'type_from'"
        )
    out = type_from_option(config)
    if "hook_event" not in config:
        return out
    if out:
        raise ValueError(
            "option 'hook_event' takes every type from the signed body: it cannot be "
            "combined with type_from=header"
        )
    value = config["hook_event"]
    if not isinstance(value, str) or not _EVENT_NAME.fullmatch(value.strip()):
        raise ValueError(
            "option 'hook_event' must be the one GitHub event the hook sends, e.g. issues or "
            "pull_request (lower case, underscores)"
        )
    return {"hook_event": value.strip()}


def fields(config: Mapping[str, Any]) -> Mapping[str, str]:
    if config.get("hook_event"):
        the_type = SIGNED_FIELD
    elif header_type(config):
        the_type = UNSIGNED_FIELD
    else:
        the_type = f"{SIGNED_FIELD} for the events the body identifies, else {UNSIGNED_FIELD}"
    return {"id": UNSIGNED_FIELD, "type": the_type}


def unsigned_type(config: Mapping[str, Any], pattern: str) -> str | None:
    """``X-GitHub-Event`` for a type (or glob) whose event name can come from the header
    alone under ``config``; None when the body names it (or ``hook_event`` is set)."""
    if config.get("hook_event"):
        return None
    if header_type(config) or pattern.split(".", 1)[0] not in SIGNED_EVENTS:
        return HEADER
    return None


def _payload(headers: Mapping[str, str], body: bytes) -> dict[str, Any]:
    """The JSON payload; GitHub can also be set to send it as the form field ``payload``."""
    content_type = headers.get("content-type", "")
    if content_type.startswith("application/x-www-form-urlencoded"):
        try:
            fields = parse_qs(body.decode("utf-8"), strict_parsing=True)
        except (UnicodeDecodeError, ValueError):
            raise MalformedEvent("bad_json") from None
        payload = fields.get("payload")
        if not payload:
            raise MalformedEvent("bad_json")
        return json_object(payload[0].encode("utf-8"))
    return json_object(body)


def extract(
    headers: Mapping[str, str], body: bytes, config: Mapping[str, Any]
) -> EventMeta | Challenge:
    the_id = event_id(headers.get("x-github-delivery"))
    hook_event = config.get("hook_event")
    payload = _payload(headers, body)
    if isinstance(hook_event, str) and hook_event:
        the_type = _signed_type(headers, payload, hook_event)
        return EventMeta(event_id=the_id, event_type=the_type, occurred_at=None)
    named = headers.get("x-github-event")
    if not header_type(config):
        named = _checked_event(named, payload)
    the_type = event_type(named)
    action = payload.get("action")
    if isinstance(action, str) and action:
        the_type = event_type(f"{the_type}.{action}")
    return EventMeta(event_id=the_id, event_type=the_type, occurred_at=None)


def _checked_event(named: str | None, payload: Mapping[str, Any]) -> str | None:
    """The event's name under the default: the header's when it names an event no body
    identifies (unsigned), else the body's own, which the header must name (bad_type
    otherwise); None when neither names one (missing_type)."""
    if named and named not in SIGNED_EVENTS:
        return named
    found = body_event(payload)
    if named and found != named:
        raise MalformedEvent("bad_type")
    return found


def _signed_type(headers: Mapping[str, str], payload: Mapping[str, Any], hook_event: str) -> str:
    """The type from the configured event and the signed body; the header must agree."""
    if "hook" in payload and "zen" in payload:  # GitHub's ping when a hook is created
        return "ping"
    if headers.get("x-github-event") != hook_event:
        raise MalformedEvent("bad_type")
    action = payload.get("action")
    if isinstance(action, str) and action:
        return event_type(f"{hook_event}.{action}")
    return hook_event


PROVIDER = described(
    "github",
    authenticate,
    extract,
    tolerance=None,
    validate_config=validate_config,
    fields_rule=fields,
    type_rule=unsigned_type,
)
