"""``webhooks sources|secrets|routes|handlers``: configure where webhooks come from and where
they go, and take sources and routes out of service (and back) with an audit row."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from core.clock import pinned
from core.durations import format_duration, parse_duration
from webhooks.cli.common import CliError, Env, console, env, handle_errors, print_json
from webhooks.cli.render import (
    OperatorOpt,
    ReasonOpt,
    count,
    login,
    row,
    say,
    show_table,
    whole,
)

# The catalog, providers and crypto are imported by the commands that use them (see
# webhooks.cli.common).
if TYPE_CHECKING:
    from core.crypto import SecretBox
    from models import catalog
    from models.schema import Source

sources_app = typer.Typer(help="Webhook sources (one URL per source).", no_args_is_help=True)
secrets_app = typer.Typer(help="A source's signing secrets (rotation).", no_args_is_help=True)
routes_app = typer.Typer(help="Handlers bound to a source.", no_args_is_help=True)
handlers_app = typer.Typer(help="The handlers this installation registers.", no_args_is_help=True)

JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON.")]
DurationOpt = Annotated[str | None, typer.Option(help="Duration such as 3d, 12h, 10m.")]
WeakSecretOpt = Annotated[
    bool,
    typer.Option(
        "--allow-weak-secret",
        help="Accept a --secret shorter than 16 characters (not for standard/svix, whose "
        "secrets must decode to 24+ bytes); recorded in the audit trail.",
    ),
]


def _provider_names() -> list[str]:
    from core.providers import registry  # noqa: PLC0415

    return list(registry.names())


def _pairs(values: list[str] | None, what: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in values or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise CliError(f"{what} must be KEY=VALUE, got {item!r}")
        out[key.strip()] = value
    return out


def _duration(value: str | None) -> timedelta | None:
    return None if value is None else parse_duration(value)


ApiKeyOpt = Annotated[
    str | None,
    typer.Option(
        "--api-key",
        help="The provider API credential reconciliation lists events with (Stripe: a "
        "restricted key that can read events); '-' reads it from stdin. Stored encrypted, "
        "never printed.",
        show_default=False,
    ),
]
ReconcileEveryOpt = Annotated[
    str | None,
    typer.Option(
        "--reconcile-every",
        help="Beat reconciles this source this often (1h, 30m; at least 1m), or 'off'.",
        show_default=False,
    ),
]


def _api_key(value: str | None) -> str | None:
    """The --api-key value ('-': one line from stdin), checked; never echoed."""
    if value is None:
        return None
    if value == "-":
        import sys  # noqa: PLC0415

        value = sys.stdin.readline().rstrip("\r\n")
    key = value.strip()
    if not key or any(c.isspace() for c in key) or len(key) > 4096:
        raise CliError("--api-key must be one token without spaces (nothing was changed)")
    return key


def _require_reconcilable(provider: str, option: str) -> None:
    from core.providers import reconcile_options as options  # noqa: PLC0415

    if not options.supported(provider):
        raise CliError(
            f"{option}: reconciliation supports {', '.join(sorted(options.SPECS))}, "
            f"not {provider!r}"
        )


def _reconcile_every(provider: str, value: str | None) -> int | None:
    """Seconds, or 0 for 'off'; None when not given."""
    if value is None:
        return None
    if value.strip().lower() in ("off", "none", "0"):
        return 0
    _require_reconcilable(provider, "--reconcile-every")
    seconds = int(parse_duration(value).total_seconds())
    if seconds < 60:
        raise CliError("--reconcile-every must be at least 1m (or off)")
    return seconds


def _reconcile_view(source: Source) -> dict[str, Any]:
    from core.providers import reconcile_options as options  # noqa: PLC0415

    if not options.supported(source.provider):
        return {"supported": False}
    every = source.reconcile_every_s
    return {
        "supported": True,
        "api_base": options.base_of(source.provider, source.config or {}),
        "api_key": "set" if source.reconcile_ciphertext is not None else "not set",
        "every": format_duration(timedelta(seconds=every)) if every else "off",
        "last_run": source.reconciled_at,
    }


def _lay_out_partitions(e: Env) -> None:
    """A longer TTL needs partitions further ahead: lay them out now rather than on the first
    event that needs them."""
    from models.retention_layout import ensure_partitions

    # Which days are past is the database's call (None), never this host's clock.
    ensure_partitions(e.engine, e.settings, pinned(e.clock))


def _box(e: Env) -> SecretBox:
    from core.crypto import SecretBox  # noqa: PLC0415

    return SecretBox(e.settings.secret_key.get_secret_value(), legacy=e.settings.secret_key_legacy)


def _source_view(e: Env, source: Source) -> dict[str, Any]:
    from core.ttl import TtlConfigError  # noqa: PLC0415
    from models import catalog  # noqa: PLC0415

    try:
        ttl = catalog.source_effective_ttl(source, e.settings)
    except TtlConfigError as exc:
        if exc.reason != "unknown_provider":
            raise
        return _unknown_provider_view(source)
    return {
        "id": source.public_id,
        "name": source.name,
        "account": source.account,
        "provider": source.provider,
        "url_path": f"/webhooks/{source.public_id}",
        "config": source.config,
        "tolerance_s": source.tolerance_s,
        "max_body_bytes": source.max_body_bytes,
        "dedup_ttl": ttl.terms.describe()
        if not ttl.raised
        else f"{format_duration(ttl.total)} (raised)",
        "warning": ttl.warning(),
        "active": source.active,
        "created_at": source.created_at,
        "reconcile": _reconcile_view(source),
    }


def _unknown_provider_view(source: Source) -> dict[str, Any]:
    """A source whose provider is not installed here (a plug-in removed): listed, with why."""
    return {
        "id": source.public_id,
        "name": source.name,
        "account": source.account,
        "provider": source.provider,
        "url_path": f"/webhooks/{source.public_id}",
        "config": source.config,
        "tolerance_s": source.tolerance_s,
        "max_body_bytes": source.max_body_bytes,
        "dedup_ttl": None,
        "warning": f"provider {source.provider!r} is not installed (webhooks providers list)",
        "active": source.active,
        "created_at": source.created_at,
        "reconcile": _reconcile_view(source),
    }


@sources_app.command("add")
@handle_errors
def sources_add(
    name: str,
    provider: Annotated[
        str,
        typer.Option(
            help="A registered provider (see `webhooks providers list`).",
            autocompletion=_provider_names,
        ),
    ],
    account: Annotated[str, typer.Option(help="Owning account (the dedup scope).")] = "default",
    secret: Annotated[
        str | None, typer.Option(help="Signing secret; generated when omitted.")
    ] = None,
    config: Annotated[
        list[str] | None,
        typer.Option("--config", help="Provider option KEY=VALUE (generic hmac, public_url, ...)."),
    ] = None,
    tolerance: DurationOpt = None,
    max_body: Annotated[int | None, typer.Option(help="Body size limit in bytes.")] = None,
    retry_window: DurationOpt = None,
    queue_lag: DurationOpt = None,
    clock_skew: DurationOpt = None,
    replay_grace: DurationOpt = None,
    allow_weak_secret: WeakSecretOpt = False,
    api_key: ApiKeyOpt = None,
    reconcile_every: ReconcileEveryOpt = None,
    operator: OperatorOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Create a source (audited); prints its id, URL path and, when generated, its secret
    (once)."""
    from core.providers import validate_config  # noqa: PLC0415
    from core.ttl import TtlOverrides  # noqa: PLC0415
    from models import catalog  # noqa: PLC0415

    # The provider and its options are checked against the registry before anything else.
    options = validate_config(provider, _pairs(config, "--config"))
    every = _reconcile_every(provider, reconcile_every)
    credential = _api_key(api_key)
    if credential is not None:
        _require_reconcilable(provider, "--api-key")
    e = env()
    with e.session() as session:
        source, created = catalog.create_source(
            session,
            _box(e),
            e.settings,
            name=name,
            provider=provider,
            account=account,
            secret=secret,
            config=options,
            validate_config=validate_config,
            tolerance=_duration(tolerance),
            max_body_bytes=max_body,
            ttl=TtlOverrides(
                _duration(retry_window),
                _duration(queue_lag),
                _duration(clock_skew),
                _duration(replay_grace),
            ),
            allow_weak_secret=allow_weak_secret,
            operator=operator or login(),
        )
        if credential is not None:
            source.reconcile_ciphertext = _box(e).encrypt(credential)
        if every:
            source.reconcile_every_s = every
        session.flush()
        view = _source_view(e, source)
    _lay_out_partitions(e)
    view["secret_id"] = created.id
    if created.plaintext is not None:
        view["secret"] = created.plaintext
    if as_json:
        print_json(view)
        return
    console.print(f"source id:  {view['id']}")
    console.print(f"url path:   {view['url_path']}")
    console.print(f"secret id:  {created.id}")
    if created.plaintext is not None:
        console.print(f"secret:     {created.plaintext}  (shown once)", highlight=False)
    console.print(f"dedup ttl:  {view['dedup_ttl']}")


@sources_app.command("update")
@handle_errors
def sources_update(
    source: str,
    retry_window: DurationOpt = None,
    queue_lag: DurationOpt = None,
    clock_skew: DurationOpt = None,
    replay_grace: DurationOpt = None,
    tolerance: DurationOpt = None,
    max_body: Annotated[int | None, typer.Option(help="Body size limit in bytes.")] = None,
    config: Annotated[
        list[str] | None,
        typer.Option(
            "--config",
            help="Provider option KEY=VALUE, merged into the source's (KEY= removes it), "
            "e.g. api_base=URL for reconciliation.",
        ),
    ] = None,
    api_key: ApiKeyOpt = None,
    clear_api_key: Annotated[
        bool, typer.Option("--clear-api-key", help="Remove the reconciliation credential.")
    ] = False,
    reconcile_every: ReconcileEveryOpt = None,
    operator: OperatorOpt = None,
) -> None:
    """Change a source's TTL terms, timestamp tolerance, body limit, provider options or
    reconciliation settings (audited; a credential is recorded as set, never its value)."""
    from core.providers import validate_config  # noqa: PLC0415
    from core.ttl import TtlOverrides  # noqa: PLC0415
    from models import catalog  # noqa: PLC0415

    given = {
        "retry_window": retry_window,
        "queue_lag": queue_lag,
        "clock_skew": clock_skew,
        "replay_grace": replay_grace,
        "tolerance": tolerance,
        "max_body": max_body,
    }
    changed: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
    pairs = _pairs(config, "--config")
    credential = _api_key(api_key)
    if credential is not None and clear_api_key:
        raise CliError("--api-key and --clear-api-key together: choose one")
    asked = pairs or credential is not None or clear_api_key or reconcile_every is not None
    if not changed and not asked:
        raise CliError("nothing to change: give at least one option (see --help)")
    e = env()
    with e.session() as session:
        row = catalog.get_source(session, source)
        # Everything is checked before anything changes: bad input changes nothing.
        every = _reconcile_every(row.provider, reconcile_every)
        if credential is not None:
            _require_reconcilable(row.provider, "--api-key")
        if pairs:
            merged = {**(row.config or {}), **pairs}
            merged = {k: v for k, v in merged.items() if v != ""}
            row.config = validate_config(row.provider, merged)
            changed["config"] = row.config
        if credential is not None:
            row.reconcile_ciphertext = _box(e).encrypt(credential)
            changed["api_key"] = "set"
        if clear_api_key:
            row.reconcile_ciphertext = None
            changed["api_key"] = "removed"
        if every is not None:
            row.reconcile_every_s = every or None
            changed["reconcile_every"] = reconcile_every
        catalog.update_source_ttl(
            session,
            e.settings,
            row,
            TtlOverrides(
                _duration(retry_window),
                _duration(queue_lag),
                _duration(clock_skew),
                _duration(replay_grace),
            ),
        )
        if tolerance is not None:
            row.tolerance_s = int(parse_duration(tolerance).total_seconds())
        if max_body is not None:
            if max_body < 1:
                raise CliError("--max-body must be positive")
            row.max_body_bytes = max_body
        catalog.record_source_update(session, row, changed, operator or login())
        session.flush()
        view = _source_view(e, row)
    _lay_out_partitions(e)
    console.print(f"updated {view['id']}: dedup ttl {view['dedup_ttl']}")
    reconcile = view["reconcile"]
    if reconcile["supported"] and {"config", "api_key", "reconcile_every"} & set(changed):
        say(
            escape(
                f"reconcile: api {reconcile['api_base']}, key {reconcile['api_key']}, "
                f"every {reconcile['every']}"
            )
        )
        if reconcile["every"] != "off" and reconcile["api_key"] != "set":
            say(
                escape(
                    f"warning: no reconciliation credential: beat skips {view['id']} until "
                    f"webhooks sources update {view['name']} --api-key -"
                )
            )


@sources_app.command("list")
@handle_errors
def sources_list(
    as_json: JsonOpt = False,
    wide: Annotated[
        bool, typer.Option("--wide", help="Add account, URL path and dedup TTL columns.")
    ] = False,
) -> None:
    """List sources (never a secret). Each source's URL is /webhooks/ID on the receiver."""
    from sqlalchemy import select  # noqa: PLC0415

    from models.schema import Source  # noqa: PLC0415

    e = env()
    with e.session() as session:
        views = [_source_view(e, s) for s in session.scalars(select(Source).order_by(Source.id))]
    if as_json:
        print_json(views)
        return
    if not views:
        say("no sources: webhooks sources add NAME --provider PROVIDER")
        return
    headers = ["id", "name", "provider", "active"]
    if wide:
        headers[2:2] = ["account", "url path", "dedup ttl"]
    table = Table(*headers, box=None)
    for v in views:
        cells = [v["id"], v["name"], v["provider"], "yes" if v["active"] else "no (410 Gone)"]
        if wide:
            cells[2:2] = [v["account"], v["url_path"], v["dedup_ttl"]]
        row(table, *cells)
    show_table(
        whole(table, "id", "url path", "provider"),
        "URL: /webhooks/ID on the receiver; --wide for more columns; --json for every field",
    )
    for v in views:  # prose after the table, whole
        if v["warning"]:
            say(escape(f"{v['id']} warning: {v['warning']}"))


@sources_app.command("show")
@handle_errors
def sources_show(source: str, as_json: JsonOpt = False) -> None:
    """Show one source with its secrets (ids and dates) and routes."""
    from models import catalog, route_catalog  # noqa: PLC0415

    e = env()
    with e.session() as session:
        row = catalog.get_source(session, source)
        view = _source_view(e, row)
        view["secrets"] = [_secret_view(s) for s in catalog.list_secrets(session, row)]
        view["routes"] = [_route_view(r) for r in route_catalog.list_routes(session, row)]
    if as_json:
        print_json(view)
        return
    for key in (
        "id",
        "name",
        "account",
        "provider",
        "url_path",
        "dedup_ttl",
        "active",
        "config",
        "created_at",
    ):
        say(f"{key + ':':<12} {escape(str(view[key]))}")
    reconcile = view["reconcile"]
    if reconcile["supported"]:
        say(
            escape(
                f"reconcile:   api {reconcile['api_base']}, key {reconcile['api_key']}, "
                f"every {reconcile['every']}, last run {reconcile['last_run'] or 'never'}"
            )
        )
    say(f"secrets:     {len(view['secrets'])}; routes: {len(view['routes'])}")
    for r in view["routes"]:
        state = "" if r["active"] else " (disabled)"
        say(
            escape(
                f"  route {r['id']}: {r['handler']} events={r['events']} "
                f"options={r['options']}{state}"
            )
        )


def _secret_view(s: Any) -> dict[str, Any]:
    return {"id": s.id, "created_at": s.created_at, "revoked_at": s.revoked_at}


def _route_view(r: Any) -> dict[str, Any]:
    from models import breaker  # noqa: PLC0415

    return {
        "id": r.id,
        "handler": r.handler,
        "events": r.events_glob,
        "options": r.options,
        "max_attempts": r.max_attempts,
        "max_age_s": r.max_age_s,
        "active": r.active,
        **breaker.state_of(r).view(),
    }


def _breaker_cell(v: dict[str, Any]) -> str:
    """``paused`` or the breaker state, for the routes table."""
    state = str(v["breaker"]["state"])
    return f"paused, {state}" if v["paused"] else state


@secrets_app.command("add")
@handle_errors
def secrets_add(
    source: str,
    secret: Annotated[str | None, typer.Option()] = None,
    allow_weak_secret: WeakSecretOpt = False,
    operator: OperatorOpt = None,
) -> None:
    """Add a secret (rotation): every active secret verifies (audited)."""
    from models import catalog  # noqa: PLC0415

    e = env()
    with e.session() as session:
        row = catalog.get_source(session, source)
        created = catalog.add_secret(
            session,
            _box(e),
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
    from models import catalog  # noqa: PLC0415

    e = env()
    with e.session() as session:
        views = [
            _secret_view(s)
            for s in catalog.list_secrets(session, catalog.get_source(session, source))
        ]
    if as_json:
        print_json(views)
        return
    table = Table("id", "created", "revoked")
    for v in views:
        row(table, v["id"], v["created_at"], v["revoked_at"] or "")
    console.print(table)


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
    from models import catalog  # noqa: PLC0415

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
    from models.keys import LegacyKeysInUseError, rekey  # noqa: PLC0415

    e = env()
    try:
        report = rekey(e.sessions, _box(e), drop_legacy=drop_legacy)
    except LegacyKeysInUseError as exc:
        raise CliError(str(exc)) from None
    view = {
        "rekeyed": report.total_rekeyed,
        "checked": report.checked,
        "undecryptable": report.undecryptable,
    }
    if drop_legacy:
        view["legacy_in_use"] = 0
    if as_json:
        print_json(view)
    else:
        console.print(
            f"re-encrypted {report.total_rekeyed} of {sum(report.checked.values())} stored"
            " secrets under the newest key",
            highlight=False,
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


@routes_app.command("add")
@handle_errors
def routes_add(
    source: str,
    handler: Annotated[str, typer.Option(help="Handler name (forward, log, ...).")],
    events: Annotated[str, typer.Option(help="Event type glob, e.g. invoice.*")] = "*",
    option: Annotated[
        list[str] | None, typer.Option("--option", help="KEY=VALUE, repeatable.")
    ] = None,
    max_attempts: Annotated[int | None, typer.Option(help="Retry budget for this route.")] = None,
    max_age: DurationOpt = None,
    operator: OperatorOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Bind a handler to a source, optionally for matching event types only (audited).

    The handler must be registered here (webhooks handlers list)."""
    from models import catalog, route_catalog  # noqa: PLC0415

    e = env()
    _registry(e).require(handler)
    with e.session() as session:
        route, signing = route_catalog.add_route(
            session,
            _box(e),
            catalog.get_source(session, source),
            handler=handler,
            events=events,
            options=_pairs(option, "--option"),
            max_attempts=max_attempts,
            max_age=_duration(max_age),
            operator=operator or login(),
        )
        view = _route_view(route)
    if signing is not None:
        view["signing_secret"] = signing
    if as_json:
        print_json(view)
        return
    say(escape(f"route {view['id']}: {handler} for {events}"))
    if signing is not None:
        console.print(f"signing secret (give it to the downstream): {signing}", highlight=False)


@routes_app.command("list")
@handle_errors
def routes_list(
    source: Annotated[
        str | None, typer.Argument(help="A source's id or name; every source's when omitted.")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """A source's routes, or every route with its source."""
    from models import catalog, route_catalog  # noqa: PLC0415

    e = env()
    with e.session() as session:
        if source is not None:
            views = [
                _route_view(r)
                for r in route_catalog.list_routes(session, catalog.get_source(session, source))
            ]
        else:
            views = [
                {"source": s.public_id, "source_name": s.name, **_route_view(r)}
                for s, r in route_catalog.list_all_routes(session)
            ]
    if as_json:
        print_json(views)
        return
    if not views:
        say("no routes: webhooks routes add SOURCE --handler NAME")
        return
    if source is not None:
        table = Table("id", "handler", "events", "active", "breaker")
        table.add_column("limits", overflow="fold")
        table.add_column("options", overflow="fold")  # a URL is folded, never cut
        default_budget = e.settings.route_max_in_flight
        for v in views:
            options = "\n".join(f"{k}={o}" for k, o in v["options"].items())
            limits = _limits_cell(v, default_budget).replace(", ", ",\n")
            row(
                table,
                v["id"],
                v["handler"],
                v["events"],
                v["active"],
                _breaker_cell(v),
                limits,
                options,
            )
        show_table(whole(table, "id", "handler", "events"))
        return
    # Every source's routes: whole ids, sources, handlers and event types take the width, so
    # no box and one state column (disabled, paused, else the breaker's state).
    table = Table("id", "source", "handler", "events", "state", box=None)
    for v in views:
        state = "disabled" if not v["active"] else "paused" if v["paused"] else _breaker_cell(v)
        row(table, v["id"], v["source"], v["handler"], v["events"], state)
    # Event types fold rather than push the state out: another route's long list of types
    # must not cut this one's state at 80 columns.
    table.columns[3].overflow = "fold"
    show_table(
        whole(table, "id", "source", "handler", "state"),
        "routes list SOURCE for a source's options; --json for every field",
    )


def _limits_cell(v: dict[str, Any], default_budget: int) -> str:
    """The route's in-flight budget and rate limit, for the routes table and `routes show`."""
    limits = v["limits"]
    budget = limits["max_in_flight"]
    flight = f"{budget} in flight" if budget else f"{default_budget} in flight (default)"
    return f"{flight}, rate {limits['rate_limit'] or 'unlimited'}"


def _registry(e: Env) -> Any:
    from tasks.handlers.registry import load_registry  # noqa: PLC0415

    return load_registry(e.settings.handler_modules)


def _change(operator: str | None, reason: str | None) -> catalog.Change:
    from models import catalog  # noqa: PLC0415

    return catalog.Change(operator=operator or login(), reason=reason or "", via="cli")


def _say_route(verb: str, changed: catalog.Changed, extra: str = "") -> None:
    t = changed.target
    say(
        escape(
            f"route {t['route']} ({t['handler']} for {t['events']} on {t['source']}) {verb} "
            f"(audit {changed.audit_id}){extra}"
        )
    )


RouteIdArg = Annotated[int, typer.Argument(metavar="ROUTE_ID", help="See `routes list SOURCE`.")]


@routes_app.command("disable")
@handle_errors
def routes_disable(
    route_id: RouteIdArg, reason: ReasonOpt = None, operator: OperatorOpt = None
) -> None:
    """Stop routing new events to this route (audited). Its deliveries that are not finished
    go dead with route_inactive when a worker picks them up; replay them after
    `routes enable`."""
    from models import route_catalog  # noqa: PLC0415

    e = env()
    with e.session() as session:
        changed = route_catalog.set_route_active(
            session, route_id, False, _change(operator, reason), now=None
        )
    extra = ""
    if changed.unfinished:
        extra = (
            f"; {changed.unfinished} of its deliveries are not finished: they go dead with "
            f"route_inactive (replay them after webhooks routes enable {route_id})"
        )
    _say_route("disabled: new events no longer get a delivery for it", changed, extra)


@routes_app.command("enable")
@handle_errors
def routes_enable(
    route_id: RouteIdArg, reason: ReasonOpt = None, operator: OperatorOpt = None
) -> None:
    """Route new events to this route again (audited); its handler must be registered."""
    from models import route_catalog  # noqa: PLC0415

    e = env()
    registry = _registry(e)
    with e.session() as session:
        registry.require(route_catalog.get_route(session, route_id).handler)
        changed = route_catalog.set_route_active(
            session, route_id, True, _change(operator, reason), now=None
        )
    _say_route("enabled", changed)


@routes_app.command("show")
@handle_errors
def routes_show(route_id: RouteIdArg, as_json: JsonOpt = False) -> None:
    """One route: its handler, and whether it is paused and its circuit breaker's state."""
    from models import route_catalog  # noqa: PLC0415

    e = env()
    with e.session() as session:
        view = _route_view(route_catalog.get_route(session, route_id))
    if as_json:
        print_json(view)
        return
    b = view["breaker"]
    say(escape(f"route {view['id']}: {view['handler']} for {view['events']}"))
    if view["paused"]:
        say(escape(f"paused since {view['paused_at']}: {view['pause_reason']}"))
    say(escape(f"limits: {_limits_cell(view, e.settings.route_max_in_flight)}"))
    say(
        escape(
            f"breaker {b['state']} (trips {b['trips']}, opened {b['opened_at']}, next probe "
            f"{b['probe_at']}); window since {b['window_started_at']}: "
            f"{b['window_failures']} failures of {b['window_requests']} requests"
        )
    )


@routes_app.command("update")
@handle_errors
def routes_update(
    route_id: RouteIdArg,
    rate_limit: Annotated[
        str | None,
        typer.Option(
            "--rate-limit", help="Most calls to the downstream: 50/s, 3000/m, 100/h, none."
        ),
    ] = None,
    max_in_flight: Annotated[
        str | None,
        typer.Option(
            "--max-in-flight",
            help="Most deliveries in flight at once, or none (the default budget).",
        ),
    ] = None,
    reason: ReasonOpt = None,
    operator: OperatorOpt = None,
) -> None:
    """Set the route's delivery limits (audited): they hold across every worker and host;
    waiting for them is not an attempt."""
    from models import breaker  # noqa: PLC0415
    from models.admission import parse_max_in_flight, parse_rate  # noqa: PLC0415

    values: dict[str, Any] = {}
    if rate_limit is not None:
        values["rate"] = parse_rate(rate_limit)
    if max_in_flight is not None:
        values["max_in_flight"] = parse_max_in_flight(max_in_flight)
    e = env()
    with e.session() as session:
        changed = breaker.set_limits(
            session, route_id, _change(operator, reason or "limits updated"), now=None, **values
        )
    after = changed.target["after"]
    _say_route(
        "updated",
        changed,
        f": {_limits_cell({'limits': after}, e.settings.route_max_in_flight)}",
    )


@routes_app.command("pause")
@handle_errors
def routes_pause(
    route_id: RouteIdArg, reason: ReasonOpt = None, operator: OperatorOpt = None
) -> None:
    """Hold this route's deliveries without attempting them (audited): new events are still
    accepted and stored; `routes resume` delivers them."""
    from models import breaker  # noqa: PLC0415

    e = env()
    with e.session() as session:
        changed = breaker.set_paused(session, route_id, True, _change(operator, reason), now=None)
    _say_route(f"paused: {count(changed.unfinished, 'delivery')} held", changed)


@routes_app.command("resume")
@handle_errors
def routes_resume(
    route_id: RouteIdArg, reason: ReasonOpt = None, operator: OperatorOpt = None
) -> None:
    """Deliver a paused route's held deliveries again (audited; the sweeper publishes them)."""
    from models import breaker  # noqa: PLC0415

    e = env()
    with e.session() as session:
        changed = breaker.set_paused(
            session, route_id, False, _change(operator, reason or "resumed"), now=None
        )
    _say_route(f"resumed: {count(changed.unfinished, 'delivery')} to deliver", changed)


@routes_app.command("remove")
@handle_errors
def routes_remove(
    route_id: RouteIdArg, reason: ReasonOpt = None, operator: OperatorOpt = None
) -> None:
    """Delete a route (audited). Refused while it has deliveries that are not finished or
    dead (disable it instead); finished ones keep their history."""
    from models import route_catalog  # noqa: PLC0415

    e = env()
    with e.session() as session:
        changed = route_catalog.remove_route(session, route_id, _change(operator, reason), now=None)
    _say_route("removed", changed)


def _say_source(verb: str, changed: catalog.Changed) -> None:
    t = changed.target
    say(escape(f"source {t['source']} ({t['name']}) {verb} (audit {changed.audit_id})"))


@sources_app.command("disable")
@handle_errors
def sources_disable(
    source: Annotated[str, typer.Argument(metavar="SOURCE", help="Source id or name.")],
    reason: ReasonOpt = None,
    operator: OperatorOpt = None,
) -> None:
    """Refuse new webhooks for this source: its URL answers 410 Gone and writes nothing
    (audited). What it already accepted still runs."""
    from models import catalog  # noqa: PLC0415

    e = env()
    with e.session() as session:
        row_ = catalog.get_source(session, source)
        changed = catalog.set_source_active(
            session, row_, False, _change(operator, reason), now=None
        )
    ttl = format_duration(e.settings.source_cache_ttl)
    _say_source(
        f"disabled: /webhooks/{changed.target['source']} answers 410 Gone (each receiver "
        f"within {ttl}, its source cache); "
        f"{count(changed.unfinished, 'unfinished delivery', 'unfinished deliveries')} still run",
        changed,
    )


@sources_app.command("enable")
@handle_errors
def sources_enable(
    source: Annotated[str, typer.Argument(metavar="SOURCE", help="Source id or name.")],
    reason: ReasonOpt = None,
    operator: OperatorOpt = None,
) -> None:
    """Accept webhooks for this source again (audited)."""
    from models import catalog  # noqa: PLC0415

    e = env()
    with e.session() as session:
        row_ = catalog.get_source(session, source)
        changed = catalog.set_source_active(
            session, row_, True, _change(operator, reason), now=None
        )
    ttl = format_duration(e.settings.source_cache_ttl)
    _say_source(f"enabled (each receiver accepts again within {ttl})", changed)


@handlers_app.command("list")
@handle_errors
def handlers_list(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Handlers a route can name: the built-ins, the webhooks.handlers entry points and the
    modules in WEBHOOKS_HANDLER_MODULES, with the active routes using each."""
    from models import route_catalog  # noqa: PLC0415

    e = env()
    infos = _registry(e).describe()
    with e.session() as session:
        routes = route_catalog.active_routes(session)
    used: dict[str, list[int]] = {}
    for route, _source in routes:
        used.setdefault(route.handler, []).append(route.id)
    views = [
        {
            "name": i.name,
            "origin": i.origin,
            "module": i.module,
            "summary": i.summary,
            "active_routes": used.get(i.name, []),
        }
        for i in infos
    ]
    known = {i.name for i in infos}
    unknown = {h: ids for h, ids in used.items() if h not in known}
    if as_json:
        print_json({"handlers": views, "unknown_in_routes": unknown})
        return
    table = Table("name", "from", "active routes", "what it does")
    for v in views:
        routes_text = " ".join(str(i) for i in v["active_routes"]) or "-"
        row(table, v["name"], v["origin"], routes_text, v["summary"])
    console.print(table)
    for handler, ids in sorted(unknown.items()):
        say(
            escape(
                f"active route {' '.join(str(i) for i in ids)} names {handler!r}, which is not "
                "registered here: its events go dead with unknown_handler (deploy the handler, "
                "or webhooks routes disable ROUTE_ID)"
            )
        )


def register(app: typer.Typer) -> None:
    app.add_typer(sources_app, name="sources")
    app.add_typer(secrets_app, name="secrets")
    app.add_typer(routes_app, name="routes")
    app.add_typer(handlers_app, name="handlers")
