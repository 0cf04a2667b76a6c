"""The ``webhooks`` command line. Each area registers its own commands.

The areas' modules are imported lazily: a command imports its own module (and what that
imports) when it runs, never the others' (``events list`` does not import the pipeline's
``run``, nor ``db`` Alembic's). :data:`COMMANDS` names each top-level command's module, in the
order help lists them; tests/test_cli_lazy.py checks it against every module's ``register``.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, MutableMapping
from pathlib import Path
from typing import Annotated, Any

import typer
import typer.core
import typer.main

from webhooks.cli.common import OPTIONS

# Each top-level command and the module whose ``register(app)`` adds it, in the order Typer
# listed them when every module was registered at import (commands first, then groups).
COMMANDS: tuple[tuple[str, str], ...] = (
    ("send", "send"),
    ("serve", "pipeline"),
    ("run", "pipeline"),
    ("replay", "operators"),
    ("demo", "operators"),
    ("reconcile", "reconcile"),
    ("gaps", "gaps"),
    ("db", "db"),
    ("sources", "sources"),
    ("secrets", "source_secrets"),
    ("routes", "routes"),
    ("handlers", "routes"),
    ("transforms", "routes"),
    ("providers", "providers"),
    ("events", "operators"),
    ("deliveries", "operators"),
    ("dead", "operators"),
    ("replays", "operators"),
    ("audit", "operators"),
    ("ttl", "retention"),
    ("maintenance", "retention"),
    ("drift", "drift"),
)
# The read commands' groups come from their own modules, not through operators (which imports
# replay and demo too): what `events list` or `dead list` needs and no more.
_LIGHTEST = {"events": "events", "deliveries": "events"}


def module_commands(module: str) -> dict[str, Any]:
    """The click commands ``webhooks.cli.<module>.register`` adds, by name."""
    found = importlib.import_module(f"webhooks.cli.{module}")
    scratch = typer.Typer()
    found.register(scratch)
    return dict(typer.main.get_group(scratch).commands)


class _LazyCommands(MutableMapping[str, Any]):
    """The root group's commands: every name known at once, each command built (its module
    imported) on first access."""

    def __init__(self, given: MutableMapping[str, Any]) -> None:
        self._built: dict[str, Any] = dict(given)
        self._names = [name for name, _ in COMMANDS] + [n for n in given if n not in _MODULES]

    def __getitem__(self, name: str) -> Any:
        if name not in self._built:
            module = _LIGHTEST.get(name) or _MODULES[name]  # KeyError: no such command
            for built_name, command in module_commands(module).items():
                self._built.setdefault(built_name, command)
        return self._built[name]

    def __setitem__(self, name: str, command: Any) -> None:
        if name not in self._names:
            self._names.append(name)
        self._built[name] = command

    def __delitem__(self, name: str) -> None:
        self._names.remove(name)
        self._built.pop(name, None)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._names))

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._names


_MODULES = dict(COMMANDS)


class LazyGroup(typer.core.TyperGroup):
    """The root ``webhooks`` group, its commands loaded on demand (:class:`_LazyCommands`)."""

    def __init__(self, **attrs: Any) -> None:
        super().__init__(**attrs)
        self.commands = _LazyCommands(self.commands)


app = typer.Typer(
    name="webhooks",
    help="Webhook pipeline: receiver, workers, operators' tools.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    cls=LazyGroup,
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
