"""``webhooks providers list``: every registered provider (built-ins and plug-ins) with what its
signature covers, which event fields (id, type, time) come from signed parts, its timestamp
tolerance, its documented retry window and the dedup TTL that
follows from it under this installation's settings."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from core.durations import format_duration
from webhooks.cli.common import CliError, env, handle_errors, print_json
from webhooks.cli.render import row, say, show_table, whole

if TYPE_CHECKING:
    from core.providers import Provider

providers_app = typer.Typer(help="The webhook providers this installation knows.")


def provider_views() -> list[dict[str, Any]]:
    """One view per provider, in registry order (what ``list`` prints)."""
    from core.providers import registry
    from core.ttl import TtlOverrides, dedup_terms

    settings = env().settings
    builtin = set(registry.builtin_names())
    views = []
    for provider in registry.providers().values():
        ttl = dedup_terms(provider.name, TtlOverrides(), settings)
        tolerance = provider.default_tolerance({}) if provider.tolerance_rule is None else None
        views.append(
            {
                "name": provider.name,
                "builtin": provider.name in builtin,
                "summary": provider.summary,
                "signed": provider.signed,
                # id/type/time -> "signed", "unsigned" or a condition; {} when not stated.
                "signed_fields": dict(provider.signed_fields({})),
                "max_events": provider.max_events if provider.batched else None,
                "tolerance_s": None if tolerance is None else int(tolerance.total_seconds()),
                "tolerance": _tolerance_text(provider, tolerance),
                "retry_window_s": int(provider.retry_window.total_seconds()),
                "retry_window": format_duration(provider.retry_window),
                "dedup_ttl_s": int(ttl.total.total_seconds()),
                "dedup_ttl": format_duration(ttl.total),
                "citation": provider.citation,
                # The day the window was last checked against its citation (None: never).
                "verified_on": provider.verified_on,
                "handshake": provider.handshake,
                "signs_url": provider.signs_url,
                "key_format": provider.key_format,
            }
        )
    return views


def fields_text(fields: dict[str, str]) -> str:
    """``id: unsigned, type: unsigned`` (what a captured request can change); the provider's
    default options (a source's own options may sign more: GitHub hook_event, ...)."""
    if not fields:
        return "not stated"
    return ", ".join(f"{name}: {where}" for name, where in fields.items())


def _tolerance_text(provider: Provider, tolerance: Any) -> str:
    if provider.tolerance_rule is not None:
        return "by config"
    return "none (no signed time)" if tolerance is None else format_duration(tolerance)


def short_signed(signed: str) -> str:
    """What the signature covers, without the prose after it (``id + timestamp + body``)."""
    return signed.split(":", 1)[0].split(";", 1)[0].strip()


@providers_app.command("list")
@handle_errors
def providers_list(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    wide: Annotated[
        bool, typer.Option("--wide", help="Every column: fields, tolerance, citation.")
    ] = False,
) -> None:
    """List providers, one line each: what is signed, retry window, dedup TTL (the rest:
    `webhooks providers show NAME`)."""
    views = provider_views()
    if as_json:
        print_json(views)
        return
    if wide:
        _wide_table(views)
        return
    table = Table("provider", "signed", "retry window", "dedup ttl", box=None)
    for v in views:
        name = v["name"] if v["builtin"] else f"{v['name']} (plug-in)"
        row(table, name, short_signed(v["signed"]), v["retry_window"], v["dedup_ttl"])
    # Prose: one line, cut to fit (providers show NAME has it whole); the rest never cut.
    table.columns[1].no_wrap, table.columns[1].overflow = True, "ellipsis"
    table.columns[1].max_width = 40
    show_table(whole(table, "provider", "retry window", "dedup ttl"),
               "webhooks providers show NAME for the rest; --json for every field")  # fmt: skip


def _wide_table(views: list[dict[str, Any]]) -> None:
    table = Table(
        "provider", "signed", "fields", "tolerance", "retry window", "dedup ttl", "citation"
    )
    for v in views:
        name = v["name"] if v["builtin"] else f"{v['name']} (plug-in)"
        row(
            table, name, v["signed"], fields_text(v["signed_fields"]), v["tolerance"],
            v["retry_window"], v["dedup_ttl"], v["citation"],
        )  # fmt: skip
    show_table(whole(table, "provider", "citation"))


@providers_app.command("show")
@handle_errors
def providers_show(
    name: Annotated[str, typer.Argument(metavar="NAME", help="A provider (providers list).")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """One provider: what its signature covers and what a capture replays, which fields are
    signed, tolerance, retry window, its citation and the day that was last verified, dedup
    TTL, key format."""
    views = {v["name"]: v for v in provider_views()}
    if name not in views:
        from difflib import get_close_matches

        close = get_close_matches(name.lower(), views, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else " (webhooks providers list)"
        raise CliError(f"no provider {name!r}{hint}")
    v = views[name]
    if as_json:
        print_json(v)
        return
    for label, value in (
        ("provider", v["name"] + ("" if v["builtin"] else " (plug-in)")),
        ("summary", v["summary"]),
        ("signed", v["signed"]),
        ("fields", fields_text(v["signed_fields"])),
        ("tolerance", v["tolerance"]),
        ("retry", f"{v['retry_window']} ({v['citation']})"),
        ("verified", str(v["verified_on"] or "never") + " (webhooks ttl check)"),
        ("dedup ttl", v["dedup_ttl"]),
        ("key format", v["key_format"]),
        ("handshake", v["handshake"] or "none"),
    ):
        if value:
            say(f"{label + ':':<11} {escape(str(value))}")


def register(app: typer.Typer) -> None:
    app.add_typer(providers_app, name="providers")
