"""``webhooks secrets``: a source's signing secrets (add, list, revoke, rekey the stored
ones under a new ``WEBHOOKS_SECRET_KEY``, new-key for one)."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.table import Table

from webhooks.cli.catalog_input import WeakSecretOpt, secret_box
from webhooks.cli.common import CliError, console, env, handle_errors, print_json
from webhooks.cli.render import (
    JsonOpt,
    OperatorOpt,
    fitted,
    login,
    row,
    whole,
)

# The catalog, providers and crypto are imported by the commands that use them (see
# webhooks.cli.common).


secrets_app = typer.Typer(
    help="A source's signing secrets, and the storage key (rotation).", no_args_is_help=True
)


def secret_view(s: Any) -> dict[str, Any]:
    return {"id": s.id, "created_at": s.created_at, "revoked_at": s.revoked_at}


@secrets_app.command("add")
@handle_errors
def secrets_add(
    source: str,
    secret: Annotated[str | None, typer.Option()] = None,
    allow_weak_secret: WeakSecretOpt = False,
    operator: OperatorOpt = None,
) -> None:
    """Add a secret (rotation): every active secret verifies (audited)."""
    from models import catalog

    e = env()
    with e.session() as session:
        row = catalog.get_source(session, source)
        created = catalog.add_secret(
            session,
            secret_box(e),
            row,
            secret,
            allow_weak_secret=allow_weak_secret,
            operator=operator or login(),
        )
    console.print(f"secret id: {created.id}")
    if created.plaintext is not None:
        console.print(f"secret:    {created.plaintext}  (shown once)", highlight=False)


@secrets_app.command("list")
@handle_errors
def secrets_list(source: str, as_json: JsonOpt = False) -> None:
    """A source's secrets: ids and dates only."""
    from models import catalog

    e = env()
    with e.session() as session:
        views = [
            secret_view(s)
            for s in catalog.list_secrets(session, catalog.get_source(session, source))
        ]
    if as_json:
        print_json(views)
        return
    table = Table("id", "created", "revoked")
    for v in views:
        row(table, v["id"], v["created_at"], v["revoked_at"] or "")
    console.print(fitted(whole(table, "id")))


@secrets_app.command("revoke")
@handle_errors
def secrets_revoke(
    source: str,
    secret_id: str,
    reason: Annotated[
        str | None, typer.Option("--reason", help="Why (optional; recorded in the audit).")
    ] = None,
    operator: OperatorOpt = None,
) -> None:
    """Revoke a secret: it stops verifying at once, in every receiver (audited: who, which
    secret, when; see `webhooks audit list --action secret`)."""
    from models import catalog

    e = env()
    with e.session() as session:
        audit_id = catalog.revoke_secret(
            session,
            catalog.get_source(session, source),
            secret_id,
            now=e.clock.now(),
            operator=operator or login(),
            reason=reason,
        )
    console.print(f"revoked {secret_id} (audit {audit_id})")


@secrets_app.command("new-key")
@handle_errors
def secrets_new_key() -> None:
    """Print a new random WEBHOOKS_SECRET_KEY (whk_...), and change nothing.

    A generated key is derived with HKDF, not scrypt: every process and CLI run starts
    about 0.1 s of CPU sooner. To move to it: WEBHOOKS_SECRET_KEY=NEW,OLD everywhere, then
    `webhooks secrets rekey`, then NEW alone.
    """
    from core.crypto import new_key

    typer.echo(new_key())


@secrets_app.command("rekey")
@handle_errors
def secrets_rekey(
    as_json: JsonOpt = False,
    drop_legacy: Annotated[
        bool,
        typer.Option(
            "--drop-legacy",
            help="First confirm no stored secret needs the legacy SHA-256 key derivation"
            " (refused, changing nothing, while one does); then set"
            " WEBHOOKS_SECRET_KEY_LEGACY=false everywhere.",
        ),
    ] = False,
) -> None:
    """Re-encrypt every stored secret under the newest WEBHOOKS_SECRET_KEY.

    Rotation: set WEBHOOKS_SECRET_KEY=NEW,OLD on every process, run this, then set NEW
    alone. Resumable (each batch commits) and idempotent (a second run changes nothing).
    """
    from models.keys import LegacyKeysInUseError, rekey

    e = env()
    try:
        report = rekey(e.sessions, secret_box(e), drop_legacy=drop_legacy)
    except LegacyKeysInUseError as exc:
        raise CliError(str(exc)) from None
    view = {
        "rekeyed": report.total_rekeyed,
        "checked": report.checked,
        "undecryptable": report.undecryptable,
        "misplaced": report.misplaced,
    }
    if drop_legacy:
        view["legacy_in_use"] = 0
    if as_json:
        print_json(view)
    else:
        console.print(
            f"re-encrypted {report.total_rekeyed} of {sum(report.checked.values())} stored"
            " secrets under the newest key, each bound to its place",
            highlight=False,
        )
    misplaced = sum(report.misplaced.values())
    if misplaced:
        raise CliError(
            f"{misplaced} stored secrets are sealed for another row or purpose (copied there):"
            " they stay refused; set each again (webhooks secrets add SOURCE, then secrets revoke"
            " the copy; a credential: sources update SOURCE --api-key) and review who can write"
            " the database"
        )
    missing = sum(report.undecryptable.values())
    if missing:
        raise CliError(
            f"{missing} stored secrets could not be decrypted with any listed key: add the key"
            " they were written with to WEBHOOKS_SECRET_KEY (after the newest) and run again"
        )
    if drop_legacy and not as_json:
        console.print(
            "no stored secret needs the legacy SHA-256 key derivation: set"
            " WEBHOOKS_SECRET_KEY_LEGACY=false on every process to retire it",
            highlight=False,
        )


def register(app: typer.Typer) -> None:
    app.add_typer(secrets_app, name="secrets")
