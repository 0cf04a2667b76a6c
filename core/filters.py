"""Route filters: a predicate over an event, written in JMESPath (issue 37 item 1).

A route's filter is a JMESPath expression (https://jmespath.org/specification.html) over one
document, ``{"body": ..., "type": ..., "headers": {...}}``:

- ``body``: the event's JSON body, parsed (``null`` when the body is not JSON);
- ``type``: the event type the provider's format names;
- ``headers``: the request's headers, names lower-cased, *without* any whose name could carry
  a credential (:func:`visible_headers`): signatures, secrets, tokens, keys, cookies,
  authorisation and this project's own test-send mark. A filter can never read or leak them.

The event matches when the expression's value is true in JMESPath's sense (not ``false``,
``null``, an empty string, list or object). An expression that fails on this event (a
comparison of a string with a number, a function given the wrong type) does not match: the
reason recorded says so, never the event's values.

Beyond JMESPath's own functions (``contains``, ``starts_with``, ``ends_with``, ``length``,
...), :class:`FilterFunctions` adds ``matches(subject, pattern)``: a search with the ``regex``
package (Python's ``re`` syntax), each pattern compiled once and cached, and each search cut
off after :data:`MATCH_TIMEOUT_S`. The subject is the sender's payload and the receiver judges
filters on its event loop: a pattern that backtracks catastrophically on some body (``(a|aa)+$``
against forty ``a`` and a ``b``) would otherwise hold the receiver for minutes. A search cut
off is a filter that failed on this event (``TimeoutError``): the event does not match.

Everything here is pure: :func:`compile_filter` checks an expression once (when the route is
saved, and again when a receiver first meets it: :func:`compiled` caches per text) and
:func:`evaluate` runs it.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

import jmespath
import orjson
import regex
from jmespath import exceptions as jp_exceptions
from jmespath import functions as jp_functions
from jmespath import visitor as jp_visitor
from jmespath.parser import ParsedResult

from core.errors import WebhooksError

#: The longest filter a route may hold: a predicate, not a program.
MAX_FILTER_CHARS = 2_000

#: A header whose lower-cased name holds one of these is never shown to a filter.
HIDDEN_HEADER_PARTS = (
    "sig",  # *-signature, x-hub-signature-256, webhook-signature, x-slack-signature, ...
    "secret",
    "token",
    "auth",  # authorization, proxy-authorization, x-*-auth
    "key",
    "cookie",
    "hmac",  # x-shopify-hmac-sha256
    "password",
    "test-send",  # this project's own mark (core.send_marks)
)

_PATTERN_CACHE_SIZE = 256


class FilterError(WebhooksError, ValueError):
    """A route filter that cannot be saved: ``reason`` names what is wrong and ``position``
    where (0-based, in characters), when the parser knows it."""

    def __init__(self, expression: str, reason: str, position: int | None = None) -> None:
        self.expression = expression
        self.reason = reason
        self.position = position
        where = "" if position is None else f" at position {position}"
        super().__init__(f"filter refused{where}: {reason}")


class FiltersChanged(WebhooksError, RuntimeError):
    """An accept found a route filter it was not judged against (changed meanwhile), again
    after the routes were read afresh: nothing was written; the sender (or the next run) retries."""


# The longest one ``matches()`` search may take (seconds): far above any linear pattern's time
# on a body the receiver accepts, far below what a sender's retry would wait for.
MATCH_TIMEOUT_S = 0.05


@lru_cache(maxsize=_PATTERN_CACHE_SIZE)
def _pattern(pattern: str) -> regex.Pattern[str]:
    return regex.compile(pattern)


class FilterFunctions(jp_functions.Functions):  # type: ignore[misc]
    """JMESPath's functions plus ``matches(string, pattern)``."""

    @jp_functions.signature({"types": ["string"]}, {"types": ["string"]})  # type: ignore[untyped-decorator]
    def _func_matches(self, subject: str, pattern: str) -> bool:
        return _pattern(pattern).search(subject, timeout=MATCH_TIMEOUT_S) is not None


_FUNCTIONS = FilterFunctions()
_OPTIONS = jmespath.Options(custom_functions=_FUNCTIONS)
# One interpreter for every search: ``ParsedResult.search`` builds a new one per call, and
# with it an empty cache of its node handlers (a simple filter's search took 4.5 us, now 2.4;
# judging a receipt 10.3 us, now 7.6: bench/results_filters.txt). It keeps no state of a
# search (the cache only fills), so it is shared by every thread.
_INTERPRETER = jp_visitor.TreeInterpreter(_OPTIONS)
_KNOWN_FUNCTIONS = frozenset(_FUNCTIONS.FUNCTION_TABLE)


def _function_calls(node: dict[str, Any]) -> list[tuple[str, list[Any]]]:
    """Every function call in a parsed expression's tree: (name, its argument nodes)."""
    calls = []
    if node.get("type") == "function_expression":
        calls.append((str(node["value"]), list(node.get("children", []))))
    for child in node.get("children", []):
        if isinstance(child, dict):
            calls += _function_calls(child)
    return calls


def compile_filter(expression: str) -> ParsedResult:
    """The parsed expression, or :class:`FilterError` with the position of what is wrong
    (a syntax error, an unknown function, a wrong number of arguments, a ``matches`` pattern
    that is not a regular expression) (pure)."""
    text = expression.strip()
    if not text:
        raise FilterError(expression, "empty expression", 0)
    if len(expression) > MAX_FILTER_CHARS:
        raise FilterError(expression, f"longer than {MAX_FILTER_CHARS} characters")
    try:
        parsed = jmespath.compile(expression)
    except jp_exceptions.LexerError as exc:
        reason = str(exc).splitlines()[0].split(": ", 1)[-1].rstrip(":").strip()
        raise FilterError(expression, reason, exc.lex_position) from None
    except jp_exceptions.ParseError as exc:
        raise FilterError(expression, _parse_reason(exc), exc.lex_position) from None
    except jp_exceptions.JMESPathError as exc:
        raise FilterError(expression, str(exc).splitlines()[0]) from None
    for name, args in _function_calls(parsed.parsed):
        if name not in _KNOWN_FUNCTIONS:
            raise FilterError(expression, f"unknown function {name}()", _call_at(expression, name))
        wanted = len(_FUNCTIONS.FUNCTION_TABLE[name]["signature"])
        variadic = any(a.get("variadic") for a in _FUNCTIONS.FUNCTION_TABLE[name]["signature"])
        if len(args) != wanted and not variadic:
            raise FilterError(
                expression,
                f"{name}() takes {wanted} arguments, given {len(args)}",
                _call_at(expression, name),
            )
        if name == "matches" and len(args) == 2 and args[1].get("type") == "literal":  # noqa: PLR2004
            _check_pattern(expression, args[1].get("value"))
    return parsed


def _parse_reason(exc: jp_exceptions.ParseError) -> str:
    """The parser's message without its prefix and caret drawing: 'Incomplete expression',
    'Unexpected token: ==', ..."""
    first = str(exc).splitlines()[0]
    reason = first.split(": ", 1)[-1].rstrip(":").strip() or "invalid expression"
    if exc.token_value not in (None, "") and exc.token_type != "eof":  # noqa: S105 (a token kind)
        reason = f"unexpected {exc.token_value!r}" if "Incomplete" not in reason else reason
    return reason


def _check_pattern(expression: str, pattern: Any) -> None:
    if not isinstance(pattern, str):
        return
    try:
        _pattern(pattern)
    except regex.error as exc:
        quoted = _find(expression, f"'{pattern}'")  # the literal, not an earlier match
        at = None if quoted is None else quoted + 1 + (exc.pos or 0)
        raise FilterError(expression, f"matches(): bad pattern: {exc.msg}", at) from None


def _call_at(expression: str, name: str) -> int | None:
    """Where a call of ``name`` starts (``name`` then ``(``, spaces allowed between)."""
    found = re.search(rf"(?<![\w.]){re.escape(name)}\s*\(", expression)
    return None if found is None else found.start()


def _find(expression: str, fragment: str) -> int | None:
    at = expression.find(fragment)
    return None if at < 0 else at


@lru_cache(maxsize=1024)
def compiled(expression: str) -> ParsedResult:
    """:func:`compile_filter`, once per distinct text in this process (the receiver meets
    the same few filters on every request)."""
    return compile_filter(expression)


def _search(expression: str, document: dict[str, Any]) -> Any:
    """The value of ``expression`` (compiled once) on ``document``."""
    return _INTERPRETER.visit(compiled(expression).parsed, document)


def visible_headers(headers: Any) -> dict[str, str]:
    """The headers a filter sees: names lower-cased, every one that could carry a credential
    left out (:data:`HIDDEN_HEADER_PARTS`); of a repeated header, the last value (pure)."""
    shown: dict[str, str] = {}
    for name, value in headers.items():
        lower = str(name).lower()
        if not any(part in lower for part in HIDDEN_HEADER_PARTS):
            shown[lower] = str(value)
    return shown


@dataclass(frozen=True)
class Verdict:
    """One route's filter decided for one event: ``matched``, else ``reason`` says why not
    (never a value of the event)."""

    route_id: int
    expression: str | None
    matched: bool
    reason: str | None = None
    # The route's order key (its text, as evaluated) and its value on this event: the
    # delivery's lane (None: unordered). Migration 0028.
    order_key: str | None = None
    lane_key: str | None = None


def evaluate(route_id: int, expression: str, document: dict[str, Any]) -> Verdict:
    """Whether ``document`` (``{"body", "type", "headers"}``) matches the route's filter
    (pure but for the compile cache). A filter that cannot be compiled any more (saved by an
    older version) or fails on this event does not match."""
    try:
        value = _search(expression, document)
    except FilterError:
        return Verdict(route_id, expression, False, f"route {route_id}: filter does not compile")
    except (jp_exceptions.JMESPathError, TypeError, ValueError, regex.error, TimeoutError) as exc:
        reason = f"route {route_id}: filter failed on this event ({type(exc).__name__})"
        return Verdict(route_id, expression, False, reason)
    if _truthy(value):
        return Verdict(route_id, expression, True)
    return Verdict(route_id, expression, False, f"route {route_id}: filter did not match")


def _truthy(value: Any) -> bool:
    """JMESPath's truth: false, null, "", [] and {} are false; every number is true."""
    if value is None or value is False:
        return False
    if isinstance(value, (str, list, dict)):
        return len(value) > 0
    return True


def document(body: bytes, event_type: str, headers: Any) -> dict[str, Any]:
    """The document a filter reads (pure): the body parsed as JSON, or null."""
    try:
        parsed: Any = orjson.loads(body)
    except orjson.JSONDecodeError:
        parsed = None
    return {"body": parsed, "type": event_type, "headers": visible_headers(headers)}


@lru_cache(maxsize=1024)
def _glob(pattern: str) -> re.Pattern[str]:
    """A route's event-type glob as the accept's LIKE reads it: ``*`` any run, ``?`` one
    character, everything else itself."""
    parts = (".*" if ch == "*" else "." if ch == "?" else re.escape(ch) for ch in pattern)
    return re.compile("".join(parts), re.DOTALL)


@dataclass(frozen=True)
class RouteFilter:
    """An active route that holds a filter, as the receiver reads it with its source."""

    route_id: int
    events_glob: str
    expression: str | None
    order_key: str | None = None

    def applies(self, event_type: str) -> bool:
        if self.events_glob == "*":  # every event (the default glob): no pattern to run
            return True
        return _glob(self.events_glob).fullmatch(event_type) is not None


def decide(
    filters: tuple[RouteFilter, ...], body: bytes, event_type: str, headers: Any
) -> tuple[Verdict, ...]:
    """The verdicts of the routes (with a filter or an order key) that apply to this event's
    type (the body parsed once, and only when one applies): each filter judged, and each
    matching route's lane key computed (:func:`lane_key`)."""
    applying = [f for f in filters if f.applies(event_type)]
    if not applying:
        return ()
    doc = document(body, event_type, headers)
    out = []
    for f in applying:
        verdict = (
            evaluate(f.route_id, f.expression, doc)
            if f.expression is not None
            else Verdict(f.route_id, None, True)
        )
        if f.order_key is not None:
            key = lane_key(f.order_key, doc) if verdict.matched else None
            verdict = replace(verdict, order_key=f.order_key, lane_key=key)
        out.append(verdict)
    return tuple(out)


#: A lane key longer than this is stored as its digest (an index entry has a size limit).
MAX_LANE_KEY_CHARS = 200


def lane_key(expression: str, document: dict[str, Any]) -> str | None:
    """The value of a route's order key on an event (pure but for the compile cache): a
    string as itself, any other value as its JSON text, a long one as ``sha256:<hex>``;
    None (the event goes unordered) when the value is null or empty, or the expression fails
    on this event or no longer compiles."""
    try:
        value = _search(expression, document)
    except (FilterError, jp_exceptions.JMESPathError, TypeError, ValueError, re.error):
        return None
    if value is None or value in ("", [], {}):
        return None
    text = value if isinstance(value, str) else orjson.dumps(value).decode()
    if len(text) > MAX_LANE_KEY_CHARS:
        return "sha256:" + hashlib.sha256(text.encode()).hexdigest()
    return text
