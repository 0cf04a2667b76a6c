"""The ``webhooks`` command line. Each area registers its own commands."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
import typer.core

from webhooks.cli import (
    db,
    operators,
    pipeline,
    providers,
    reconcile,
    retention,
    routes,
    send,
    source_secrets,
    sources,
)
from webhooks.cli.common import OPTIONS

app = typer.Typer(
    name="webhooks",
    help="Webhook pipeline: receiver, workers, operators' tools.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _version(wanted: bool) -> None:
    """``--version``: the installed distribution's version, then exit (before any setting is
    read: it works without a database or a .env)."""
    if wanted:
        from importlib.metadata import version  # noqa: PLC0415 (only for --version)

        typer.echo(f"webhooks {version('webhook-pipeline')}")
        raise typer.Exit


@app.callback()
def _options(
    _version_flag: Annotated[
        bool,
        typer.Option(
            "--version",
            help="Print the version and exit.",
            callback=_version,
            is_eager=True,
        ),
    ] = False,
    env_file: Annotated[
        Path | None,
        typer.Option(
            "--env-file",
            metavar="PATH",
            help=(
                "Settings file (WEBHOOKS_* lines). Default: WEBHOOKS_ENV_FILE, else the .env of "
                "the project this command is installed from, else ./.env. The environment wins."
            ),
            show_default=False,
        ),
    ] = None,
) -> None:
    """Webhook pipeline: receiver, workers, operators' tools."""
    OPTIONS.env_file = env_file


for module in (
    db,
    sources,
    source_secrets,
    routes,
    send,
    providers,
    pipeline,
    operators,
    retention,
    reconcile,
):
    module.register(app)


def _plain_help() -> None:
    """Help as click writes it: ``SOURCE`` (``[SOURCE]`` when optional) in the usage line, no
    type column for a flag, and a docstring's paragraphs reflowed to the terminal's width.
    Typer 0.29 writes ``{source}`` and ``--json <bool>``, which read as template placeholders
    to fill in, and keeps the source's line breaks after the first paragraph, so an 80-column
    terminal shows ragged half-lines. tests/test_cli_runtime.py checks every command's help.

    Typer imports its rich_utils (rich's markdown, tracebacks: a tenth of a second) only to
    write help or an error, so the reflow is put in place when help is written, not here."""
    argument: Any = typer.core.TyperArgument
    option: Any = typer.core.TyperOption
    shown_type = option.display_type_rich

    def reflow(paragraphs: list[str], markup_mode: Any) -> str:
        # "\b" first on a paragraph keeps its line breaks, as in click.
        return "\n\n".join(
            p.removeprefix("\b\n") if p.startswith("\b") else p.replace("\n", " ")
            for p in paragraphs
        )

    def usage_name(self: Any) -> str:
        name = str(self.metavar or self.name.upper())
        name = name if self.required else f"[{name}]"
        return name + ("..." if self.nargs != 1 else "")

    def display_type_rich(self: Any, ctx: Any) -> str | None:
        return None if self.is_flag else shown_type(self, ctx)

    def reflowing(format_help: Any) -> Any:
        def wrapper(self: Any, ctx: Any, formatter: Any) -> Any:
            import typer.rich_utils

            if hasattr(typer.rich_utils, "_fix_linebreaks"):
                typer.rich_utils._fix_linebreaks = reflow
            return format_help(self, ctx, formatter)

        return wrapper

    if hasattr(argument, "_usage_display_name"):
        argument._usage_display_name = usage_name
    option.display_type_rich = display_type_rich
    for command in (typer.core.TyperCommand, typer.core.TyperGroup):
        command.format_help = reflowing(command.format_help)  # type: ignore[method-assign]


_plain_help()


def main() -> None:
    app()
