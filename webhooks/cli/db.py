"""``webhooks db upgrade``: create the database when missing, migrate it, lay out partitions."""

from __future__ import annotations

import typer

from webhooks.cli.common import console, env, handle_errors

db_app = typer.Typer(help="Database schema.", no_args_is_help=True)


@db_app.command("upgrade")
@handle_errors
def upgrade(revision: str = typer.Argument("head", help="Alembic revision")) -> None:
    """Create the database if it is missing and migrate it to the latest schema."""
    from models.db import ensure_database  # noqa: PLC0415
    from models.db import upgrade as run_upgrade

    settings = env().settings
    created = ensure_database(settings)
    run_upgrade(settings, revision)
    verb = "created and migrated" if created else "migrated"
    console.print(f"database {settings.database_name()} {verb} to {revision}")


def register(app: typer.Typer) -> None:
    app.add_typer(db_app, name="db")
