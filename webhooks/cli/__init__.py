"""The ``webhooks`` command line. Each area registers its own commands."""

from __future__ import annotations

import typer

from webhooks.cli import db, operators, pipeline, retention, sources

app = typer.Typer(
    name="webhooks",
    help="Webhook pipeline: receiver, workers, operators' tools.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

for module in (db, sources, pipeline, operators, retention):
    module.register(app)


def main() -> None:
    app()
