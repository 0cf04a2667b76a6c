"""``webhooks demo``: the whole flow against the running pipeline: a demo source and routes,
signed events sent to the receiver, their deliveries watched live, a dead letter replayed."""

from __future__ import annotations

import json
import re
import secrets
import time
from collections import Counter
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table
from rich.text import Text

from core.states import UNFINISHED, DeliveryStatus
from webhooks.cli.common import (
    CliError,
    Env,
    cli_command,
    console,
    env,
    handle_errors,
)
from webhooks.cli.render import (
    login,
    row,
    whole,
)
from webhooks.cli.replay import run_replay

# The database, HTTP and logging modules are imported by the commands that use them (see
# webhooks.cli.common).
if TYPE_CHECKING:
    import httpx

    from models import queries


DEMO_ACCOUNT = "demo"


DEMO_SOURCE = "demo"


# (handler, event types): "flaky" is the built-in handler that fails until replayed.
DEMO_ROUTES = (("log", "order.*"), ("flaky", "payment.*"))


DEMO_EVENTS = ("order.created", "order.paid", "order.shipped", "payment.captured")


def _receiver_url(e: Env) -> str:
    host = e.settings.host
    return f"http://{'127.0.0.1' if host in ('0.0.0.0', '::', '') else host}:{e.settings.port}"  # noqa: S104


def _demo_source(e: Env) -> tuple[str, str]:
    """The demo source (created on first use) and its newest secret."""
    from sqlalchemy import select

    from core.crypto import SecretBox, source_secret_place
    from models import catalog, route_catalog
    from models.schema import Source

    box = SecretBox(e.settings.secret_key.get_secret_value(), legacy=e.settings.secret_key_legacy)
    with e.session() as session:
        source = session.scalars(
            select(Source).where(Source.account == DEMO_ACCOUNT, Source.name == DEMO_SOURCE)
        ).first()
        if source is None:
            source, created = catalog.create_source(
                session, box, e.settings, name=DEMO_SOURCE, provider="standard",
                account=DEMO_ACCOUNT,
            )  # fmt: skip
            secret = created.plaintext
        else:
            active = [s for s in catalog.list_secrets(session, source) if s.revoked_at is None]
            secret = (
                box.open(active[-1].ciphertext, source_secret_place(active[-1].id))
                if active
                else None
            )
            if secret is None:
                secret = catalog.add_secret(session, box, source).plaintext
        have = {(r.handler, r.events_glob) for r in route_catalog.list_routes(session, source)}
        for handler, events in DEMO_ROUTES:
            if (handler, events) not in have:
                route_catalog.add_route(session, box, source, handler=handler, events=events)
        assert secret is not None
        return source.public_id, secret


def _send(
    client: httpx.Client, url: str, secret: str, event_id: str, body: bytes, now: datetime
) -> str:
    import standardwebhooks

    signature = standardwebhooks.Webhook(secret).sign(event_id, now, body.decode())
    response = client.post(
        url,
        content=body,
        headers={
            "webhook-id": event_id,
            "webhook-timestamp": str(int(now.timestamp())),
            "webhook-signature": signature,
            "content-type": "application/json",
        },
    )
    if response.status_code not in (200, 202):
        raise CliError(f"the receiver answered {response.status_code} to {event_id}")
    return str(response.json().get("status", response.status_code))


def _states_table(states: list[queries.DeliveryState], title: str) -> Table:
    # 80 columns without cutting anything: no box, short headers (tries = the attempts, gen =
    # the idempotency key's generation).
    table = Table(
        "event",
        "type",
        "delivery",
        "handler",
        "status",
        "tries",
        "gen",
        title=title,
        box=None,
        pad_edge=False,
    )
    colours: dict[str, str] = {
        DeliveryStatus.SUCCEEDED: "green",
        DeliveryStatus.DEAD: "red",
        DeliveryStatus.RETRYING: "yellow",
    }
    for st in states:
        colour = colours.get(st.status, "cyan")
        row(
            table, st.event_id, st.event_type, st.delivery_id, st.handler,
            Text(st.status, style=colour), st.attempts, st.generation,
        )  # fmt: skip
    # Ids and types whole; a handler or status too long for what is left folds, never cut.
    table.columns[3].overflow = "fold"
    table.columns[4].overflow = "fold"
    return whole(table, "event", "type", "delivery")


def _watch(
    e: Env,
    source: str,
    event_ids: list[str],
    title: str,
    done: Callable[[list[queries.DeliveryState]], bool],
    timeout: float,
) -> list[queries.DeliveryState]:
    from rich.live import Live

    from models import queries

    deadline = time.monotonic() + timeout
    with Live(console=console, refresh_per_second=8) as live:
        while True:
            with e.session() as session:
                states = queries.deliveries_of(session, source, event_ids)
            live.update(_states_table(states, title))
            if done(states):
                break
            if time.monotonic() > deadline:
                raise CliError(
                    f"deliveries did not get there within {timeout:g}s: {_stalled(e, states)}"
                )
            time.sleep(0.2)
    console.print()  # Live leaves the cursor on the table's last line when not a terminal
    return states


def _workers_answering(e: Env) -> list[str]:
    """The workers that answer a Celery ping within a second (none when the broker is
    unreachable: that is no worker either, as far as the demo can tell)."""
    from tasks.config import create_app

    app = create_app(e.settings)
    try:
        replies = app.control.ping(timeout=1.0)
    except Exception:  # noqa: BLE001 (broker down or refusing: nobody answered)
        return []
    finally:
        app.close()
    return sorted(name for reply in replies or [] for name in reply)


def _held_keys(e: Env, pending: list[queries.DeliveryState]) -> list[int]:
    """The pending deliveries whose fast-claim key exists in Redis: a worker refuses each
    copy of them as a duplicate until Postgres' claim takes over (tasks.claims)."""
    import redis

    from models.installation import InstallationUnknown, installation_id
    from tasks.claims import claim_key, make_client

    try:
        installation = installation_id(e.engine)
    except InstallationUnknown:
        return []  # no worker can claim on this database either (its runtime needs the id)
    client = make_client(e.settings.redis_url, e.settings.redis_socket_timeout)
    try:
        pipe = client.pipeline(transaction=False)
        for st in pending:
            pipe.exists(claim_key(installation, st.delivery_id, st.generation))
        held = pipe.execute()
    except redis.RedisError:
        return []
    finally:
        client.close()
    return [st.delivery_id for st, n in zip(pending, held, strict=True) if n]


def _stalled(e: Env, states: list[queries.DeliveryState]) -> str:
    """What holds the deliveries: no worker, keys that say duplicate, or something else."""
    waiting = [st for st in states if st.status in UNFINISHED]
    workers = _workers_answering(e)
    if not workers:
        return (
            "no worker answered a ping: is a worker running? "
            "(`webhooks run` starts receiver, worker and beat)"
        )
    ids = ", ".join(str(st.delivery_id) for st in waiting) or "none"
    held = _held_keys(e, [st for st in waiting if st.status == DeliveryStatus.PENDING])
    if held:
        return (
            f"deliveries {', '.join(map(str, held))} pending while a worker answered "
            f"({', '.join(workers)}), and their fast-claim keys in Redis say duplicate "
            "(the worker logs delivery.not_claimed outcome=duplicate): keys from a success "
            "Postgres no longer shows, such as after a restore. The sweeper hands such a "
            "delivery to Postgres' claim at its second re-publish (2 x WEBHOOKS_PUBLISH_GRACE)"
        )
    return (
        f"deliveries {ids} unfinished while a worker answered ({', '.join(workers)}): "
        "see the worker's log"
    )


@handle_errors
def demo(
    receiver: Annotated[
        str | None,
        typer.Option("--receiver", help="Receiver URL (default from WEBHOOKS_HOST/PORT)."),
    ] = None,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds per stage.")] = 60.0,
) -> None:
    """Run the whole flow against the running pipeline (start it with `webhooks run`).

    Creates a demo source and routes, sends signed events (one duplicate, one whose handler
    fails until replayed), shows them move through the states, replays the dead one and
    prints a summary.
    """
    import httpx

    from core.logs import configure_logging
    from models import replays

    e = env()
    configure_logging("WARNING", json=e.settings.log_json)
    base = (receiver or _receiver_url(e)).rstrip("/")
    started = time.monotonic()
    with httpx.Client(timeout=10) as client:
        try:
            client.get(f"{base}/healthz").raise_for_status()
        except httpx.HTTPError:
            raise CliError(
                f"no receiver at {base}: start the pipeline first (`make run` or `webhooks run`)"
            ) from None
        source, secret = _demo_source(e)
        console.print(
            f"demo source {source} (Standard Webhooks), routes: "
            + ", ".join(f"{h} for {t}" for h, t in DEMO_ROUTES)
        )
        run = secrets.token_hex(4)
        now = e.clock.now()
        events = [
            (f"evt_demo_{run}_{n}", kind, json.dumps({
                "type": kind, "timestamp": now.isoformat(), "data": {"order": f"ord_{run}_{n}"},
            }).encode())
            for n, kind in enumerate(DEMO_EVENTS, 1)
        ]  # fmt: skip
        console.rule("1. a provider sends 5 signed webhooks; the last is a retry of the first")
        answers: Counter[str] = Counter()
        for event_id, kind, body in [*events, events[0]]:
            answer = _send(client, f"{base}/webhooks/{source}", secret, event_id, body, now)
            answers[answer] += 1
            console.print(f"  {event_id} {kind:<17} -> {answer}", highlight=False)
    ids = [event_id for event_id, _, _ in events]

    def settled(states: list[queries.DeliveryState]) -> bool:
        return len(states) == len(ids) and all(
            st.status
            == (DeliveryStatus.DEAD if st.handler == "flaky" else DeliveryStatus.SUCCEEDED)
            for st in states
        )

    console.rule("2. workers deliver them; the flaky handler fails and its delivery goes dead")
    states = _watch(e, source, ids, "deliveries", settled, timeout)
    dead = [st.delivery_id for st in states if st.status == DeliveryStatus.DEAD]

    console.rule("3. an operator replays the dead letter (audited, same downstream key)")
    request = replays.ReplayRequest(
        operator=login(),
        reason="webhooks demo: the flaky handler fails until its delivery is replayed",
        via="cli",
        filter_as_given={"ids": dead},
        ids=tuple(dead),
    )
    with e.session() as session:
        plan = replays.plan_replay(session, request)
    result = run_replay(e, plan, show_progress=False)
    console.print(
        f"  replay {result.replay_id} by {request.operator}: {result.replayed} replayed",
        highlight=False,
    )
    final = _watch(
        e, source, ids, "after the replay",
        lambda sts: len(sts) == len(ids)
        and all(st.status == DeliveryStatus.SUCCEEDED for st in sts),
        timeout,
    )  # fmt: skip

    console.rule("summary")
    first_time = sum(1 for st in final if st.delivery_id not in dead)
    for label, value in (
        ("webhooks sent", f"{sum(answers.values())} ({len(ids)} events + 1 provider retry)"),
        ("receiver said", ", ".join(f"{n} {k}" for k, n in sorted(answers.items()))),
        (
            "deliveries",
            f"{len(final)} succeeded: {first_time} first time, {len(dead)} after replay",
        ),
        ("replay audit", f"#{result.replay_id} by {request.operator} (webhooks replays list)"),
        ("took", f"{time.monotonic() - started:.1f}s"),
    ):
        console.print(f"  {label + ':':<14} {value}", highlight=False)
    cmd = cli_command()  # `webhooks` is on PATH only in an activated virtualenv
    for delivery_id in dead:
        console.print(
            f"  {'dead letter:':<14} delivery {delivery_id}: its failed attempt in Flower "
            f"{_flower_row(e, delivery_id)}; {cmd} deliveries show {delivery_id}",
            highlight=False,
            soft_wrap=True,  # a URL cut in two cannot be opened
        )
    console.print(
        f"\nnext:\n  {cmd} events list --source {source}\n  {cmd} events show {ids[-1]}\n"
        f"  {cmd} dead list\n  {cmd} replays list\n"
        f"Flower: http://127.0.0.1:{e.settings.flower_port} (workers, tasks, retries)",
        highlight=False,
    )


def _flower_row(e: Env, delivery_id: int) -> str:
    """The URL of the Flower page of the delivery's FAILURE task (its dead attempt), asked of
    Flower's API with the configured login; else where to search for it."""
    import httpx

    from core.messages import DELIVER_TASK

    base = f"http://127.0.0.1:{e.settings.flower_port}"
    fallback = f"{base}/tasks (search: ({delivery_id},))"
    if e.settings.flower_password is None:
        return fallback
    auth = (e.settings.flower_user, e.settings.flower_password.get_secret_value())
    params = {"taskname": DELIVER_TASK, "state": "FAILURE", "limit": "200"}
    try:
        answer = httpx.get(f"{base}/api/tasks", params=params, auth=auth, timeout=5)
        tasks = answer.json() if answer.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        return fallback
    for task_id, task in tasks.items():
        # "(7,)", or "([6, 7],)" for a message the publisher packed (its state is its worst
        # delivery's: FAILURE when one of them went dead).
        if delivery_id in [int(i) for i in re.findall(r"\d+", str(task.get("args") or ""))]:
            return f"{base}/task/{task_id}"
    return fallback
