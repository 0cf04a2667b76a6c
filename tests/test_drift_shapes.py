"""Issue 38 item 3, the pure part: a payload's shape (core/shapes.py) and what a sighting
changes in a learnt shape. No database; the clock is passed in."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from core.shapes import (
    Fingerprint,
    NotJson,
    PathSeen,
    drift_of,
    fingerprint,
    fingerprint_body,
    gone,
    merge,
    quarantines,
)

T0 = datetime(2026, 12, 1, tzinfo=UTC)


def test_a_fingerprint_is_paths_and_types_with_arrays_collapsed_and_no_values() -> None:
    doc = {
        "id": "evt_secret_value",
        "data": {
            "object": {"amount": 1200, "rate": 0.5, "paid": True, "note": None},
            "items": [{"id": "it_1"}, {"id": "it_2", "qty": 3}],
        },
    }
    fp = fingerprint(doc)
    assert fp.cut == 0
    assert fp.pairs == {
        ("id", "string"),
        ("data", "object"),
        ("data.object", "object"),
        ("data.object.amount", "integer"),
        ("data.object.rate", "number"),
        ("data.object.paid", "boolean"),
        ("data.object.note", "null"),
        ("data.items", "array"),
        ("data.items[]", "object"),
        ("data.items[].id", "string"),
        ("data.items[].qty", "integer"),
    }
    # No value anywhere in it.
    assert "evt_secret_value" not in repr(fp)
    assert "1200" not in repr(fp)


def test_the_caps_bound_a_fingerprint_and_count_what_they_cut() -> None:
    wide = {f"k{i}": i for i in range(50)}
    fp = fingerprint(wide, max_paths=10)
    assert len(fp.pairs) == 10
    assert fp.cut == 40
    deep: object = 1
    for _ in range(30):
        deep = {"a": deep}
    fp = fingerprint(deep, max_depth=5)
    assert len(fp.pairs) == 5
    assert fp.cut == 1
    # A thousand items of one shape cost what one does.
    assert fingerprint({"xs": [{"a": 1}] * 1000}).pairs == {
        ("xs", "array"),
        ("xs[]", "object"),
        ("xs[].a", "integer"),
    }


def test_a_body_that_is_not_json_is_refused_without_quoting_it() -> None:
    with pytest.raises(NotJson) as caught:
        fingerprint_body(b"token=abc&x=1")
    assert "abc" not in str(caught.value)


def test_a_body_nested_past_the_parsers_depth_is_not_json_not_a_crash() -> None:
    """A sender's array of 100,000 arrays: the parser's recursion limit, which stopped the
    whole learning run (RecursionError) before; now that one body has no shape."""
    with pytest.raises(NotJson):
        fingerprint_body(b"[" * 100_000 + b"]" * 100_000)


def _stored(fp: Fingerprint, at: datetime) -> dict[str, PathSeen]:
    return {p: PathSeen(t, at, at) for p, t in fp.paths().items()}


def test_merge_reports_a_new_path_and_a_type_change_once_each() -> None:
    stored = _stored(fingerprint({"data": {"amount": 1, "id": "x"}}), T0)
    merged = merge(
        stored, fingerprint({"data": {"amount": "1", "id": "y", "extra": 2}}), baseline=True
    )
    kinds = {(c.path, c.kind) for c in merged.changes}
    assert kinds == {("data.extra", "new_path"), ("data.amount", "type_changed")}
    assert [c.detail for c in merged.changes if c.kind == "type_changed"] == [
        "was integer, now also string"
    ]
    # The same shape again: nothing.
    assert (
        merge(stored, fingerprint({"data": {"amount": 2, "id": "z"}}), baseline=True).changes == ()
    )
    # The first shape of an event type is a baseline, not drift.
    assert merge({}, fingerprint({"a": 1}), baseline=False).changes == ()


def test_a_path_is_gone_after_the_absence_window_only_while_its_type_keeps_arriving() -> None:
    absent = timedelta(days=7)
    stored = {
        "data.old": PathSeen(frozenset({"string"}), T0, T0),
        "data.id": PathSeen(frozenset({"string"}), T0, T0 + timedelta(days=8)),
    }
    type_seen = T0 + timedelta(days=8)
    assert gone(stored, type_seen, T0 + timedelta(days=6, hours=23), absent) == ()
    found = gone(stored, type_seen, T0 + timedelta(days=7), absent)
    assert [(c.path, c.kind) for c in found] == [("data.old", "path_gone")]
    # A quiet event type (nothing arrived after the path's last sighting) is not drift.
    assert gone({"data.old": stored["data.old"]}, T0, T0 + timedelta(days=30), absent) == ()


def test_an_event_drifts_from_the_accepted_shape_by_a_new_path_a_new_type_or_an_open_finding() -> (
    None
):
    accepted = {"data": frozenset({"object"}), "data.amount": frozenset({"integer"})}
    same = fingerprint({"data": {"amount": 1}})
    assert drift_of(accepted, frozenset(), same) is None
    assert drift_of(accepted, frozenset(), fingerprint({"data": {"amount": 1, "x": 2}})) == (
        "new path data.x"
    )
    assert drift_of(accepted, frozenset(), fingerprint({"data": {"amount": "1"}})) == (
        "path data.amount is string, was integer"
    )
    # Learnt already but not accepted (its finding is open): still drift.
    assert drift_of(accepted, frozenset({"data.amount"}), same) == (
        "path data.amount not accepted yet"
    )
    # Lacking a path every learnt event had is drift; not judged on a document the caps cut.
    always = frozenset({"data.amount"})
    assert drift_of(accepted, frozenset(), fingerprint({"data": {}}), always) == (
        "lacks path data.amount, which every learnt event had"
    )
    assert drift_of(accepted, frozenset(), same, always) is None
    cut = Fingerprint(fingerprint({"data": {}}).pairs, cut=1)
    assert drift_of(accepted, frozenset(), cut, always) is None
    # No learnt shape: nothing to drift from.
    assert drift_of({}, frozenset(), same) is None
    assert quarantines({"quarantine_drift": "true"})
    assert not quarantines({"quarantine_drift": "no"})
    assert not quarantines(None)
