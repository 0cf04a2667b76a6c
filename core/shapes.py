"""Payload shapes (issue 38 item 3): what a JSON document looks like, never what it holds.

A document's :func:`fingerprint` is a bounded set of ``(path, type)`` pairs: a path names
object keys joined by ``.``, an array collapsed to ``[]`` (``data.items[].id``), so a list of
a thousand items costs what a list of one does; a type is JSON's (``string``, ``integer``,
``number``, ``boolean``, ``null``, ``object``, ``array``). No value is kept. At most
:data:`MAX_PATHS` paths per document and :data:`MAX_DEPTH` levels: what was cut is counted,
never silently dropped.

A stored shape (per source and event type: each path's types, first and last sighting) and a
new sighting :func:`merge` into the changes an operator is told about: a path never seen
before, a path seen with a type it never had, and (:func:`gone`) a path not seen for the
absence window while its event type kept arriving. Pure: the clock is passed in.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Literal

from core.errors import WebhooksError

MAX_PATHS = 512  # distinct (path, type) pairs kept from one document
MAX_DEPTH = 16  # levels below the root; deeper values are not walked
MAX_PATH_CHARS = 256  # a longer path (a key made of data) is cut, counted

Kind = Literal["new_path", "type_changed", "path_gone"]
KINDS: tuple[Kind, ...] = ("new_path", "type_changed", "path_gone")


class NotJson(WebhooksError, ValueError):
    """The body is not a JSON document, or nests deeper than the parser goes (no shape is
    learnt from it)."""


@dataclass(frozen=True)
class Fingerprint:
    """One document's shape: ``(path, type)`` pairs, and how many were cut by the caps."""

    pairs: frozenset[tuple[str, str]]
    cut: int = 0

    def paths(self) -> dict[str, frozenset[str]]:
        """Each path with the types it had in this document."""
        out: dict[str, set[str]] = {}
        for path, kind in self.pairs:
            out.setdefault(path, set()).add(kind)
        return {p: frozenset(t) for p, t in out.items()}


def json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    raise TypeError(f"not a JSON value: {type(value).__name__}")


def fingerprint(
    document: object, *, max_paths: int = MAX_PATHS, max_depth: int = MAX_DEPTH
) -> Fingerprint:
    """The shape of a parsed JSON document (the root itself is not a path)."""
    pairs: set[tuple[str, str]] = set()
    cut = 0
    # Breadth first: when the cap bites, what is kept is the outer shape.
    level: list[tuple[str, object]] = [("", document)]
    depth = 0
    while level:
        following: list[tuple[str, object]] = []
        for prefix, value in level:
            children: Iterable[tuple[str, object]]
            if isinstance(value, dict):
                children = ((f"{prefix}.{k}" if prefix else str(k), v) for k, v in value.items())
            elif isinstance(value, list):
                children = ((f"{prefix}[]", v) for v in value)
            else:
                continue
            for path, child in children:
                if depth >= max_depth or len(path) > MAX_PATH_CHARS:
                    cut += 1
                    continue
                pair = (path, json_type(child))
                if pair not in pairs:
                    if len(pairs) >= max_paths:
                        cut += 1
                        continue
                    pairs.add(pair)
                if isinstance(child, dict | list):
                    following.append((path, child))
        level = following
        depth += 1
    return Fingerprint(frozenset(pairs), cut)


def fingerprint_body(body: bytes) -> Fingerprint:
    """The shape of a raw body; :class:`NotJson` when it does not parse (its text is never
    quoted: it is a payload)."""
    try:
        document = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        # RecursionError: a body nested deeper than the interpreter's recursion limit (a
        # sender's array of a thousand arrays) stopped every learning run before this.
        raise NotJson("the body is not JSON") from None
    return fingerprint(document)


@dataclass(frozen=True)
class PathSeen:
    """One stored path of a shape: its types so far and when it was first and last seen."""

    types: frozenset[str]
    first_seen: datetime
    last_seen: datetime


@dataclass(frozen=True)
class Change:
    """One drift: ``detail`` names types and dates, never a value."""

    path: str
    kind: Kind
    detail: str


@dataclass(frozen=True)
class Merged:
    """A sighting merged into a stored shape: the changes, and the paths to store (each
    path of the sighting with its types)."""

    changes: tuple[Change, ...]
    seen: Mapping[str, frozenset[str]] = field(default_factory=dict)


def merge(stored: Mapping[str, PathSeen], sighting: Fingerprint, *, baseline: bool) -> Merged:
    """The changes ``sighting`` makes to ``stored``. ``baseline``: the event type has a learnt
    shape already; without one, every path is the first shape, not a drift."""
    seen = sighting.paths()
    changes: list[Change] = []
    if baseline:
        for path in sorted(seen):
            types = seen[path]
            known = stored.get(path)
            if known is None:
                changes.append(Change(path, "new_path", f"first seen as {_names(types)}"))
            elif not types <= known.types:
                changes.append(
                    Change(
                        path,
                        "type_changed",
                        f"was {_names(known.types)}, now also {_names(types - known.types)}",
                    )
                )
    return Merged(tuple(changes), seen)


def gone(
    stored: Mapping[str, PathSeen],
    type_last_seen: datetime | None,
    now: datetime,
    absent: timedelta,
) -> tuple[Change, ...]:
    """Paths not seen for ``absent`` (at ``now``, the database's clock) although their event
    type arrived after they were last seen: a quiet event type is not a drift."""
    if type_last_seen is None:
        return ()
    out = []
    for path in sorted(stored):
        last = stored[path].last_seen
        if last <= now - absent and type_last_seen > last:
            out.append(Change(path, "path_gone", f"not seen since {last:%Y-%m-%d %H:%M} UTC"))
    return tuple(out)


def _names(types: Iterable[str]) -> str:
    return "|".join(sorted(types))


# A route's option (``routes add|update --quarantine-drift``): its deliveries whose event has
# drifted from the accepted shape wait, held, until ``webhooks drift accept``.
QUARANTINE_OPTION = "quarantine_drift"


def quarantines(options: Mapping[str, object] | None) -> bool:
    return str((options or {}).get(QUARANTINE_OPTION, "")).strip().lower() == "true"


def drift_of(
    accepted: Mapping[str, frozenset[str]],
    unaccepted: frozenset[str],
    sighting: Fingerprint,
    always: frozenset[str] = frozenset(),
) -> str | None:
    """Why an event's shape is not the accepted one (None: it is): a (path, type) the learnt
    shape never had, a path with an open new-path or type-changed finding (``unaccepted``), or
    the lack of a path every learnt event of its type had (``always``; not judged on a
    document the caps cut). An event type with no learnt shape has nothing to drift from."""
    if not accepted:
        return None
    seen = sighting.paths()
    missing = sorted(always - seen.keys()) if sighting.cut == 0 else []
    if missing:
        return f"lacks path {missing[0]}, which every learnt event had"
    for path, types in sorted(seen.items()):
        if path in unaccepted:
            return f"path {path} not accepted yet"
        known = accepted.get(path)
        if known is None:
            return f"new path {path}"
        if not types <= known:
            return f"path {path} is {_names(types - known)}, was {_names(known)}"
    return None
