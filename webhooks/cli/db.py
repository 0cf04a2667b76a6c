"""``webhooks db upgrade``: create the database when missing, migrate it, lay out partitions.
``webhooks db create-role``: the non-superuser role the pipeline connects as."""

from __future__ import annotations

import os
from typing import Annotated

import typer

from webhooks.cli.common import console, env, handle_errors

db_app = typer.Typer(help="Database schema.", no_args_is_help=True)


@db_app.command("upgrade")
@handle_errors
def upgrade(revision: str = typer.Argument("head", help="Alembic revision")) -> None:
    """Create the database if it is missing and migrate it to the latest schema."""
    from models.db import ensure_database
    from models.db import upgrade as run_upgrade

    settings = env().settings
    created = ensure_database(settings)
    run_upgrade(settings, revision)
    verb = "created and migrated" if created else "migrated"
    console.print(f"database {settings.database_name()} {verb} to {revision}")


@db_app.command("create-role")
@handle_errors
def create_role(
    name: Annotated[str, typer.Argument(help="Role name (lower-case letters, digits, _).")],
    password_env: Annotated[
        str,
        typer.Option(
            "--password-env",
            help="Environment variable holding the role's password (never the command line).",
        ),
    ] = "WEBHOOKS_DB_PASSWORD",  # noqa: S107  (a variable's name, not a password)
) -> None:
    """Create the application's database role (LOGIN, no SUPERUSER/CREATEDB/CREATEROLE) and
    make it the owner of the database, its schema and its objects. Run as the superuser, once
    per deployment, before ``db upgrade`` runs as that role; running it again is harmless (it
    re-asserts the attributes and sets the password again)."""
    from models.roles import check_password, check_role_name, ensure_app_role

    check_role_name(name)
    e = env()  # reads the env file too, which may hold the password variable
    password = check_password(os.environ.get(password_env), password_env)
    report = ensure_app_role(e.settings, name, password)
    verb = "created" if report.created else "updated"
    console.print(
        f"role {report.role} {verb}: owns database {report.database} and schema "
        f"{report.schema} ({report.reassigned} objects handed over); not a superuser",
        highlight=False,
    )


def register(app: typer.Typer) -> None:
    app.add_typer(db_app, name="db")
