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
from webhooks.cli.catalog_input import (
    DurationOpt,
    WeakSecretOpt,
    change_by,
    duration_or_none,
    pairs,
    secret_box,
)
from webhooks.cli.common import CliError, Env, console, env, handle_errors, print_json
from webhooks.cli.render import (
    JsonOpt,
    OperatorOpt,
    ReasonOpt,
    count,
    login,
    row,
    say,
    show_table,
    whole,
)
from webhooks.cli.routes import route_view
from webhooks.cli.source_secrets import secret_view

# The catalog, providers and crypto are imported by the commands that use them (see
# webhooks.cli.common).
if TYPE_CHECKING:
    from models import catalog
    from models.schema import Source

sources_app = typer.Typer(help="Webhook sources (one URL per source).", no_args_is_help=True)


def _provider_names() -> list[str]:
    from core.providers import registry

    return list(registry.names())


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
        import sys

        value = sys.stdin.readline().rstrip("\r\n")
    key = value.strip()
    if not key or any(c.isspace() for c in key) or len(key) > 4096:
        raise CliError("--api-key must be one token without spaces (nothing was changed)")
    return key


def _require_reconcilable(provider: str, option: str) -> None:
    from core.providers import reconcile_options as options

    if not options.supported(provider):
        raise CliError(
            f"{option}: reconciliation supports {', '.join(sorted(options.SPECS))}, "
            f"not {provider!r}"
        )


def _require_credential(provider: str) -> None:
    from core.providers import reconcile_options as options

    if not options.takes_credential(provider):
        raise CliError(
            f"--api-key: a provider API credential is for reconciliation "
            f"({', '.join(sorted(options.SPECS))}) and the subscription watchdog "
            f"({', '.join(sorted(options.CREDENTIAL_PROVIDERS))}), not {provider!r}"
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
    from core.providers import reconcile_options as options

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


def _source_view(e: Env, source: Source) -> dict[str, Any]:
    """A source (the ORM's row, or :func:`models.reads.list_sources`' with the same columns)
    as ``sources list|show`` print it."""
    from core.ttl import TtlConfigError, TtlOverrides, effective_ttl

    overrides = TtlOverrides.from_seconds(
        source.retry_window_s, source.queue_lag_s, source.clock_skew_s, source.replay_grace_s
    )
    try:  # models.catalog.source_effective_ttl, without the catalog (SQLAlchemy)
        ttl = effective_ttl(source.provider, overrides, e.settings, source_name=source.name)
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
    from core.crypto import reconcile_place
    from core.providers import validate_config
    from core.ttl import TtlOverrides
    from models import catalog

    # The provider and its options are checked against the registry before anything else.
    options = validate_config(provider, pairs(config, "--config"))
    every = _reconcile_every(provider, reconcile_every)
    credential = _api_key(api_key)
    if credential is not None:
        _require_credential(provider)
    e = env()
    with e.session() as session:
        source, created = catalog.create_source(
            session,
            secret_box(e),
            e.settings,
            name=name,
            provider=provider,
            account=account,
            secret=secret,
            config=options,
            validate_config=validate_config,
            tolerance=duration_or_none(tolerance),
            max_body_bytes=max_body,
            ttl=TtlOverrides(
                duration_or_none(retry_window),
                duration_or_none(queue_lag),
                duration_or_none(clock_skew),
                duration_or_none(replay_grace),
            ),
            allow_weak_secret=allow_weak_secret,
            operator=operator or login(),
        )
        if every:
            source.reconcile_every_s = every
        session.flush()
        if credential is not None:  # sealed for this row: its id exists once flushed
            source.reconcile_ciphertext = secret_box(e).seal(credential, reconcile_place(source.id))
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
    from core.crypto import reconcile_place
    from core.providers import validate_config
    from core.ttl import TtlOverrides
    from models import catalog

    given = {
        "retry_window": retry_window,
        "queue_lag": queue_lag,
        "clock_skew": clock_skew,
        "replay_grace": replay_grace,
        "tolerance": tolerance,
        "max_body": max_body,
    }
    changed: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
    given_config = pairs(config, "--config")
    credential = _api_key(api_key)
    if credential is not None and clear_api_key:
        raise CliError("--api-key and --clear-api-key together: choose one")
    asked = given_config or credential is not None or clear_api_key or reconcile_every is not None
    if not changed and not asked:
        raise CliError("nothing to change: give at least one option (see --help)")
    e = env()
    with e.session() as session:
        row = catalog.get_source(session, source)
        # Everything is checked before anything changes: bad input changes nothing.
        every = _reconcile_every(row.provider, reconcile_every)
        if credential is not None:
            _require_credential(row.provider)
        if given_config:
            merged = {**(row.config or {}), **given_config}
            merged = {k: v for k, v in merged.items() if v != ""}
            row.config = validate_config(row.provider, merged)
            changed["config"] = row.config
        if credential is not None:
            row.reconcile_ciphertext = secret_box(e).seal(credential, reconcile_place(row.id))
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
                duration_or_none(retry_window),
                duration_or_none(queue_lag),
                duration_or_none(clock_skew),
                duration_or_none(replay_grace),
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
    from models import reads

    e = env()
    with e.reads() as conn:
        views = [_source_view(e, s) for s in reads.list_sources(conn)]
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
    from models import catalog, route_catalog

    e = env()
    with e.session() as session:
        row = catalog.get_source(session, source)
        view = _source_view(e, row)
        view["secrets"] = [secret_view(s) for s in catalog.list_secrets(session, row)]
        view["routes"] = [route_view(r) for r in route_catalog.list_routes(session, row)]
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
    from models import catalog

    e = env()
    with e.session() as session:
        row_ = catalog.get_source(session, source)
        changed = catalog.set_source_active(
            session, row_, False, change_by(operator, reason), now=None
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
    from models import catalog

    e = env()
    with e.session() as session:
        row_ = catalog.get_source(session, source)
        changed = catalog.set_source_active(
            session, row_, True, change_by(operator, reason), now=None
        )
    ttl = format_duration(e.settings.source_cache_ttl)
    _say_source(f"enabled (each receiver accepts again within {ttl})", changed)


@sources_app.command("check")
@handle_errors
def sources_check(
    source: Annotated[
        str | None,
        typer.Argument(metavar="[SOURCE]", help="Source id or name (default: every one watched)."),
    ] = None,
    stored: Annotated[
        bool,
        typer.Option("--stored", help="Only list the open findings; ask no provider."),
    ] = False,
    fix: Annotated[
        bool,
        typer.Option(
            "--fix",
            help="Re-enable SOURCE's disabled endpoint (Stripe, Svix) or inactive hook "
            "(GitHub) at its provider, after a confirmation (audited). Never creates or "
            "deletes one (Shopify: refused, it has no disabled state).",
        ),
    ] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    reason: ReasonOpt = None,
    operator: OperatorOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Read each watched source's endpoint at its provider now (the subscription watchdog:
    disabled, deleted, another URL, event types no longer subscribed, or the API could not
    say), record the findings, and list the open ones. Exit code 1 while any is open."""
    from core.docs import see
    from models import findings
    from tasks.watchdog import run as watch

    e = env()
    if fix and (source is None or stored):
        raise CliError("--fix needs one SOURCE and asks its provider (not with --stored)")
    if not e.keys_checked:
        e.check_keys()
    box = secret_box(e)
    if fix:
        assert source is not None
        refused = watch.fix_refusal(e.sessions, source)
        if refused is not None:
            raise CliError(refused, doc="watchdog")
    checked: list[Any] = []
    if not stored:
        refs = [source] if source is not None else _watched(e)
        try:
            checked = [watch.check(e.settings, e.sessions, box, ref, via="cli") for ref in refs]
        except watch.WatchError as exc:
            raise CliError(str(exc), doc="watchdog") from None
    if fix:
        assert source is not None
        checked = [_fix(e, box, checked[0], yes, operator, reason)]
    with e.session() as session:
        scope = None if source is None else _source_id(session, source)
        still = findings.open_findings(session, scope)
    if as_json:
        print_json(
            {
                "checked": [c.view_dict() for c in checked],
                "open": [f.view() for f in still],
            }
        )
    else:
        for c in checked:
            _say_checked(c)
        for f in still:
            say(
                escape(
                    f"open: {f.source} ({f.name}) {f.kind} since "
                    f"{f.opened_at:%Y-%m-%d %H:%M:%S}Z: {f.detail}"
                )
            )
        if not still:
            say("no open finding")
        else:
            say(escape(see("watchdog")))
    if still:
        raise typer.Exit(1)


def _watched(e: Env) -> list[str]:
    from sqlalchemy import select

    from core.watchdog import WATCHED
    from models.schema import Source

    with e.session() as session:
        found = session.scalars(
            select(Source.public_id)
            .where(
                Source.active.is_(True),
                Source.reconcile_ciphertext.is_not(None),
                Source.provider.in_(WATCHED),
            )
            .order_by(Source.public_id)
        )
        return list(found)


def _source_id(session: Any, ref: str) -> int:
    from models import catalog

    return catalog.get_source(session, ref).id


def _say_checked(c: Any) -> None:
    head = f"{c.source} ({c.name}, {c.provider})"
    if c.view is not None and c.view.status != "deleted":
        v = c.view
        url = "" if c.url is not None else "; url not compared (no endpoint_url, no public base)"
        say(escape(f"{head}: {v.status}, url {v.url}, events {','.join(v.events) or 'none'}{url}"))
    for f in c.found:
        say(escape(f"{head}: {f.kind}: {f.detail}"))
    for kind in c.recorded.closed:
        say(escape(f"{head}: {kind} closed (back to normal)"))


def _fix(
    e: Env, box: Any, checked: Any, yes: bool, operator: str | None, reason: str | None
) -> Any:
    from core.watchdog import DISABLED
    from tasks.watchdog import run as watch
    from tasks.watchdog.endpoints import CannotCheck

    if not watch.fixable(checked):
        kinds = ", ".join(f.kind for f in checked.found) or "none"
        _say_checked(checked)
        say(
            escape(
                f"nothing --fix can do (findings: {kinds}): it only re-enables a disabled "
                "endpoint; a deleted one, another URL or other event types are changed at the "
                "provider by hand"
            )
        )
        return checked
    thing = "hook" if checked.provider == "github" else "endpoint"
    if not yes:
        typer.confirm(f"Re-enable {checked.source}'s {thing} at {checked.provider}?", abort=True)
    try:
        after = watch.enable(
            e.settings,
            e.sessions,
            box,
            checked.source,
            operator=operator or login(),
            reason=reason or f"re-enable the {DISABLED} {thing}",
        )
    except CannotCheck as exc:
        raise CliError(f"{checked.provider} refused the re-enable: {exc}", doc="watchdog") from None
    say(escape(f"re-enabled {checked.source}'s {thing} at {checked.provider} (audited)"))
    return after


def register(app: typer.Typer) -> None:
    app.add_typer(sources_app, name="sources")
