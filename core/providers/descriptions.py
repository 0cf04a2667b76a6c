"""The built-in providers' descriptions (:file:`descriptions.toml`) and :func:`described`, which
joins one to a module's code.

A built-in module holds its whole contract in code (how a request is verified, where the id,
type and time come from, the tolerance, the options, the key format) and states
``PROVIDER = described(name, authenticate, extract, ...)``. What is only said about the sender
(the retry window, where it is documented and the day that was last checked, what a capture
replays, the handshake, which fields are signed, the one-line summary) is data, kept in one
table beside the modules and read once per process. A plug-in declares a
:class:`~core.providers.base.Provider` with every field instead; both give the same object.
"""

from __future__ import annotations

import functools
import tomllib
from collections.abc import Callable, Mapping
from datetime import date, datetime, timedelta
from importlib import resources
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final, TypedDict

from core.durations import parse_duration
from core.providers.contract import (
    AuthFn,
    Config,
    ConfigFn,
    ExtractFn,
    KeyFormat,
    Provider,
    TypeRule,
    VerifyGetFn,
)

if TYPE_CHECKING:  # typing only: Unpack for **kwargs is in typing from Python 3.12
    from typing_extensions import Unpack

DESCRIPTIONS: Final = "descriptions.toml"
_REQUIRED: Final = frozenset({"retry_window", "citation", "verified_on", "signed", "summary"})
_OPTIONAL: Final = frozenset({"handshake", "fields", "retries"})


class Contract(TypedDict, total=False):
    """The fields of :class:`~core.providers.base.Provider` a built-in module states in code."""

    tolerance: timedelta | None
    tolerance_rule: Callable[[Config], timedelta | None] | None
    validate_config: ConfigFn
    key_format: KeyFormat
    key_prefix: str
    signs_url: bool
    verify_get: VerifyGetFn | None
    check_secret: Callable[[str], None] | None
    batched: bool
    max_events: int | None
    fields_rule: Callable[[Config], Mapping[str, str]] | None
    type_rule: TypeRule | None


@functools.cache
def table() -> Mapping[str, Mapping[str, Any]]:
    """Every built-in provider's description by name (read once per process)."""
    text = resources.files("core.providers").joinpath(DESCRIPTIONS).read_text("utf-8")
    return MappingProxyType(tomllib.loads(text))


def described(
    name: str, authenticate: AuthFn, extract: ExtractFn, /, **contract: Unpack[Contract]
) -> Provider:
    """The built-in provider ``name``: its code as given, its description from the table.

    A missing row or key, or one the table does not define, stops the import (ValueError): a
    provider is never listed half described.
    """
    row = table().get(name)
    if row is None:
        raise ValueError(f"{DESCRIPTIONS} has no [{name}] table")
    missing, unknown = _REQUIRED - set(row), set(row) - _REQUIRED - _OPTIONAL
    if missing or unknown:
        raise ValueError(
            f"{DESCRIPTIONS} [{name}]: missing {sorted(missing)}, unknown {sorted(unknown)}"
        )
    verified_on = row["verified_on"]
    if not isinstance(verified_on, date) or isinstance(verified_on, datetime):
        raise ValueError(
            f"{DESCRIPTIONS} [{name}]: verified_on must be a date (verified_on = 2026-11-30), "
            f"not {verified_on!r}"
        )
    return Provider(
        name=name,
        authenticate=authenticate,
        extract=extract,
        retry_window=parse_duration(row["retry_window"]),
        citation=row["citation"],
        verified_on=verified_on,
        signed=row["signed"],
        handshake=row.get("handshake"),
        summary=row["summary"],
        fields=MappingProxyType(dict(row.get("fields", {}))),
        **contract,
    )
