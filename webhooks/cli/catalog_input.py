"""Operator input shared by the catalog commands (sources, secrets, routes): KEY=VALUE
pairs, durations, the secret box, and who makes a change and why."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Annotated

import typer

from core.durations import parse_duration
from webhooks.cli.common import CliError, Env
from webhooks.cli.render import (
    login,
)

# The catalog, providers and crypto are imported by the commands that use them (see
# webhooks.cli.common).
if TYPE_CHECKING:
    from core.crypto import SecretBox
    from models import catalog


DurationOpt = Annotated[str | None, typer.Option(help="Duration such as 3d, 12h, 10m.")]


WeakSecretOpt = Annotated[
    bool,
    typer.Option(
        "--allow-weak-secret",
        help="Accept a --secret shorter than 16 characters (not for standard/svix, whose "
        "secrets must decode to 24+ bytes); recorded in the audit trail.",
    ),
]


def pairs(values: list[str] | None, what: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in values or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise CliError(f"{what} must be KEY=VALUE, got {item!r}")
        out[key.strip()] = value
    return out


def duration_or_none(value: str | None) -> timedelta | None:
    return None if value is None else parse_duration(value)


def secret_box(e: Env) -> SecretBox:
    from core.crypto import SecretBox

    return SecretBox(e.settings.secret_key.get_secret_value(), legacy=e.settings.secret_key_legacy)


def change_by(operator: str | None, reason: str | None) -> catalog.Change:
    from models import catalog

    return catalog.Change(operator=operator or login(), reason=reason or "", via="cli")
