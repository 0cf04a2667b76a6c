"""``webhooks send``: one command to send a signed test event to a source, as its provider
would (``stripe trigger``, ``svix message create``), and optionally watch its deliveries.

The body and headers come from :mod:`core.providers.sending`; the secret is the source's
newest active one, decrypted here and never printed. Each request also carries the mark of a
test send (:mod:`core.send_marks`: an HMAC under ``WEBHOOKS_SECRET_KEY`` naming the operator),
so the receiver records its events as ``arrived_via = 'test'`` with an ``audit_log`` row each
(``event.send``); a receiver that cannot verify the mark refuses the request.

What the receiver derives from the request (the event id a provider builds from the body, a
batch's ids) is read with the providers' own ``extract``, so ``--follow`` watches exactly the
receipts the receiver wrote.
"""

from __future__ import annotations

import json
import secrets
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape

from core.states import DeliveryStatus
from webhooks.cli.common import CliError, Env, env, handle_errors
from webhooks.cli.render import OperatorOpt, login, print_delivery, say

# HTTP, the providers and the database are imported by the command (see webhooks.cli.common).
if TYPE_CHECKING:
    import httpx

FINISHED = frozenset({DeliveryStatus.SUCCEEDED, DeliveryStatus.DEAD})
MAX_COUNT = 1000


def receiver_base(e: Env) -> str:
    """The receiver ``webhooks run`` (``make run``) starts, as a client reaches it."""
    host = e.settings.host
    if host in ("0.0.0.0", "::", ""):  # noqa: S104 (a wildcard bind: reach it on loopback)
        host = "127.0.0.1"
    return f"http://{host}:{e.settings.port}"


def read_data(value: str | None) -> Any:
    """``--data``: JSON text, or ``@path`` of a JSON file; CliError naming what is wrong."""
    if value is None:
        return None
    text = value
    if value.startswith("@"):
        path = Path(value[1:]).expanduser()
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else "not UTF-8"
            raise CliError(f"--data {value}: cannot read the file ({reason})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise CliError(
            f"--data is not JSON ({exc.msg} at line {exc.lineno} column {exc.colno}); "
            "give JSON text or @FILE"
        ) from None


def _source_and_secret(e: Env, ref: str) -> tuple[str, str, dict[str, Any], str]:
    """(public id, provider, options, newest active secret) of the source."""
    from core.crypto import SecretBox, source_secret_place
    from models import catalog
    from models.schema import Source

    box = SecretBox(e.settings.secret_key.get_secret_value(), legacy=e.settings.secret_key_legacy)
    with e.session() as session:
        source: Source = catalog.get_source(session, ref)
        active = [s for s in catalog.list_secrets(session, source) if s.revoked_at is None]
        if not active:
            raise CliError(
                f"source {source.public_id} has no active secret: "
                f"webhooks secrets add {source.public_id}"
            )
        if not source.active:
            raise CliError(
                f"source {source.public_id} is disabled (its URL answers 410 Gone): "
                f"webhooks sources enable {source.public_id} --reason TEXT"
            )
        return (
            source.public_id,
            source.provider,
            dict(source.config),
            box.open(active[-1].ciphertext, source_secret_place(active[-1].id)),
        )


def _ids(headers: dict[str, str], body: bytes, provider: str, config: dict[str, Any]) -> list[str]:
    """The event ids the receiver will store for this request (its own extract)."""
    from core.providers import Batch, EventMeta, MalformedEvent, extract

    lowered = {k.lower(): v for k, v in headers.items()}
    try:
        meta = extract(provider, lowered, body, config=config)
    except MalformedEvent:
        return []
    if isinstance(meta, EventMeta):
        return [meta.event_id]
    if isinstance(meta, Batch):
        return [m.event_id for m in meta.events]
    return []


def _target(base: str | None, e: Env, public_id: str) -> str:
    url = (base or receiver_base(e)).rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise CliError(f"--url {url}: give an http(s) URL such as http://127.0.0.1:8000")
    return url if "/webhooks/" in url else f"{url}/webhooks/{public_id}"


def _post(client: httpx.Client, url: str, headers: dict[str, str], body: bytes) -> httpx.Response:
    import httpx

    try:
        return client.post(url, content=body, headers=headers)
    except httpx.HTTPError as exc:
        raise CliError(
            f"no receiver at {url} ({type(exc).__name__}): start the pipeline first "
            "(`make run` or `webhooks run`), or pass --url"
        ) from None


def _answer(response: httpx.Response) -> str:
    text = response.text.strip().replace("\n", " ")
    return f"{response.status_code} {text[:200]}"


def _follow(e: Env, public_id: str, ids: list[str], timeout: float) -> None:
    """Wait until every delivery of the events is finished (or ``timeout``), then show each
    as ``deliveries show`` does. An event acknowledged without a delivery never gets one
    (the accept writes the receipt and its deliveries in one transaction): said at once.
    Exit status 1 unless every delivery finished in time."""
    from models import queries

    deadline = time.monotonic() + timeout
    waiting: list[str] = []
    while True:
        with e.session() as session:
            states = queries.deliveries_of(session, public_id, ids)
        if not states:
            raise CliError(
                f"no delivery for {', '.join(ids)}: no active route of {public_id} takes it"
                f" (webhooks routes list {public_id})"
            )
        waiting = [str(st.delivery_id) for st in states if st.status not in FINISHED]
        if not waiting or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    with e.session() as session:
        views = [
            d
            for event_id in ids
            for d in queries.get_event(session, f"event:{event_id}", source=public_id).deliveries
        ]
    for d in views:
        print_delivery(d)
    if waiting:
        raise CliError(
            f"still waiting after {timeout:g}s: deliveries {', '.join(waiting)} unfinished"
            " (webhooks deliveries show ID)"
        )


@handle_errors
def send(
    source: Annotated[str, typer.Argument(metavar="SOURCE", help="Source id or name.")],
    event_type: Annotated[
        str | None,
        typer.Option("--type", help="Event type (default: a typical one of the provider)."),
    ] = None,
    data: Annotated[
        str | None,
        typer.Option(
            "--data",
            help="The event's content: JSON text or @FILE, placed where the provider carries "
            "it (Stripe: data.object; Standard Webhooks: data; GitHub: the body).",
        ),
    ] = None,
    event_id: Annotated[
        str | None,
        typer.Option("--id", help="Event id (default: a new random one; with --count, ID-1...)."),
    ] = None,
    count: Annotated[int, typer.Option("--count", help="How many events to send.")] = 1,
    url: Annotated[
        str | None,
        typer.Option("--url", help="Receiver URL (default: the one `make run` starts)."),
    ] = None,
    follow: Annotated[
        bool,
        typer.Option("--follow", help="Wait for the deliveries and show them."),
    ] = False,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds --follow waits.")] = 30.0,
    operator: OperatorOpt = None,
) -> None:
    """Send a signed test event to SOURCE, as its provider would: a body in the provider's
    format, signed with the source's active secret, posted to the receiver; prints the answer.

    Every built-in provider with a shared secret; SendGrid and Discord sign with their own
    private key, so no test event can be signed for them here.

    Audited: each event gets an audit_log row (event.send: who, the source, the event's type
    and id) and is recorded with arrived_via test (webhooks events show)."""
    import httpx

    from core import send_marks
    from core.providers import sending

    if not 1 <= count <= MAX_COUNT:
        raise CliError(f"--count must be from 1 to {MAX_COUNT}, got {count}")
    if timeout <= 0:
        raise CliError("--timeout must be positive")
    content = read_data(data)
    try:
        who = send_marks.check_operator(operator or login())
    except ValueError as exc:
        raise CliError(str(exc)) from None
    e = env()
    keys = send_marks.mark_keys(e.settings.secret_key.get_secret_value())
    public_id, provider, config, secret = _source_and_secret(e, source)
    if provider in sending.PUBLIC_KEY:
        raise CliError(f"{public_id}: {sending.PUBLIC_KEY[provider]}")
    if provider not in sending.SIGNERS:
        raise CliError(f"provider {provider!r} of {public_id} has no test-event sender (a plug-in)")
    target = _target(url, e, public_id)
    run = secrets.token_hex(4)
    sent: list[str] = []
    failed = 0
    with httpx.Client(timeout=10) as client:
        for n in range(1, count + 1):
            the_id = event_id or f"evt_test_{run}"
            if count > 1:
                the_id = f"{the_id}-{n}"
            at = int(e.clock.now().timestamp())
            try:
                headers, body = sending.sign(
                    provider,
                    secret,
                    event_id=the_id,
                    timestamp=at,
                    event_type=event_type,
                    data=content,
                    config=config,
                )
            except sending.CannotSign as exc:
                raise CliError(str(exc)) from None
            ids = _ids(headers, body, provider, config)
            mark = send_marks.make(keys, source=public_id, body=body, operator=who, at=at)
            headers = {**headers, "Webhooks-Test-Send": mark}
            response = _post(client, target, headers, body)
            if response.status_code >= 300:
                failed += 1
            else:
                sent += ids
            shown = ", ".join(ids) or the_id
            say(escape(f"{shown} -> {_answer(response)}"))
    if failed:
        raise CliError(
            f"the receiver refused {failed} of {count} (see its answer above and its log)"
        )
    if follow:
        _follow(e, public_id, sent, timeout)


def register(app: typer.Typer) -> None:
    app.command("send")(send)
