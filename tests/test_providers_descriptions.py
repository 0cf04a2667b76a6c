"""The built-in providers' descriptions (core/providers/descriptions.toml) and described()."""

from __future__ import annotations

from datetime import date, timedelta

import pytest

from core.providers import BUILTIN_PROVIDERS, descriptions, registry
from core.providers.base import json_fields, no_options


def test_every_builtin_has_one_row_and_every_row_a_builtin() -> None:
    assert set(descriptions.table()) == set(BUILTIN_PROVIDERS)


def test_described_joins_the_row_to_the_code() -> None:
    stripe = registry.get("stripe")
    assert stripe.retry_window == timedelta(days=3)
    assert stripe.key_prefix == "whsec_"
    assert stripe.fields == {"id": "signed", "type": "signed", "time": "signed"}
    assert registry.get("svix").retry_window == timedelta(hours=27, minutes=35, seconds=5)
    assert registry.get("github").fields == {}  # stated in code (fields_rule)


def _auth(*_: object) -> tuple[str, int | None]:
    return "s", None


def test_a_missing_or_incomplete_row_stops_the_import(monkeypatch: pytest.MonkeyPatch) -> None:
    extract = json_fields(id="id", type="type")
    with pytest.raises(ValueError, match=r"has no \[nobody\] table"):
        descriptions.described("nobody", _auth, extract)
    rows = dict(descriptions.table())
    rows["broken"] = {
        "retry_window": "1d",
        "citation": "x",
        "verified_on": date(2026, 12, 1),
        "signed": "body",
        "typo": "x",
    }
    monkeypatch.setattr(descriptions, "table", lambda: rows)
    with pytest.raises(ValueError, match=r"missing \['summary'\], unknown \['typo'\]"):
        descriptions.described("broken", _auth, extract, validate_config=no_options)
