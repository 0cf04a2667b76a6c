"""Issue 20 item 4: tables readable at 80 columns: ids, URLs and event types are never cut,
long prose goes to ``show`` or ``--wide``, and each table says where ``--json`` is."""

from __future__ import annotations

import subprocess
import uuid
from datetime import UTC, datetime

import pytest
from rich.console import Console
from sqlalchemy.orm import Session, sessionmaker

from core.providers import BUILTIN_PROVIDERS
from core.settings import Settings
from models import queries
from tests.conftest import BIN, test_env
from tests.factories import accept_event, make_source

WIDTHS = (80, 120)


def webhooks(width: int, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "webhooks"), *args],
        env=test_env(COLUMNS=str(width), LINES="50"),
        capture_output=True,
        text=True,
        timeout=60,
    )


def _fits(out: str, width: int) -> None:
    for line in out.splitlines():
        assert len(line) <= width, line


@pytest.mark.parametrize("width", WIDTHS)
def test_providers_list_is_one_line_per_provider_and_show_has_the_rest(width: int) -> None:
    listed = webhooks(width, "providers", "list")
    assert listed.returncode == 0, listed.stderr
    _fits(listed.stdout, width)
    lines = listed.stdout.splitlines()
    for name in BUILTIN_PROVIDERS:
        [line] = [ln for ln in lines if ln.split() and ln.split()[0] == name]
        assert "3d" in line or "d" in line.split()[-1]  # window and TTL on the same line
    assert len(lines) <= len(BUILTIN_PROVIDERS) + 3
    assert "--json" in listed.stdout
    assert "providers show NAME" in listed.stdout
    shown = webhooks(width, "providers", "show", "stripe")
    assert "https://docs.stripe.com/webhooks/process-undelivered-events" in shown.stdout
    wrong = webhooks(width, "providers", "show", "Stripe")
    assert wrong.returncode == 1
    assert "did you mean 'stripe'" in wrong.stderr


@pytest.mark.parametrize("width", WIDTHS)
def test_sources_list_shows_ids_and_url_paths_whole(
    width: int, sessions: sessionmaker[Session], settings: Settings
) -> None:
    source = make_source(
        sessions, settings, provider="stripe", name=f"a-rather-long-source-name-{uuid.uuid4().hex}"
    )
    listed = webhooks(width, "sources", "list")
    assert listed.returncode == 0, listed.stderr
    _fits(listed.stdout, width)
    assert source.public_id in listed.stdout
    assert "--json" in listed.stdout
    assert "--wide" in listed.stdout
    wide = webhooks(max(width, 120), "sources", "list", "--wide")
    assert f"/webhooks/{source.public_id}" in wide.stdout


@pytest.mark.parametrize("width", WIDTHS)
def test_replays_list_headers_are_whole(width: int) -> None:
    listed = webhooks(width, "replays", "list")
    assert listed.returncode == 0, listed.stderr
    _fits(listed.stdout, width)
    if "no replays" not in listed.stdout:
        for header in ("started (UTC)", "operator", "status"):
            assert header in listed.stdout


@pytest.mark.parametrize("width", WIDTHS)
def test_the_demo_table_keeps_event_ids_and_types_whole(width: int) -> None:
    from webhooks.cli.demo import _states_table

    states = [
        queries.DeliveryState(
            f"evt_demo_0123abcd_{n}",
            "payment.captured.with.a.long.type",
            1000 + n,
            "flaky",
            "succeeded",
            1,
            0,
        )
        for n in range(3)
    ]
    console = Console(width=width, record=True, force_terminal=False)
    console.print(_states_table(states, "deliveries"))
    out = console.export_text()
    for st in states:
        assert st.event_id in out
        assert st.event_type in out
        assert str(st.delivery_id) in out


@pytest.mark.parametrize("width", WIDTHS)
def test_times_say_they_are_utc(
    width: int, sessions: sessionmaker[Session], settings: Settings
) -> None:
    """Issue 20 item 7: CLI times are UTC and say so: a ``(UTC)`` header over a table's
    column, ``UTC`` after a time in a line of text."""
    source = make_source(sessions, settings, provider="stripe")
    received = datetime.now(UTC).replace(microsecond=0)
    event_id, _ = accept_event(settings, source, now=received)
    listed = webhooks(width, "events", "list", "--source", source.public_id)
    assert listed.returncode == 0, listed.stderr
    _fits(listed.stdout, width)
    assert "(UTC)" in listed.stdout
    shown = webhooks(width, "events", "show", event_id, "--source", source.public_id)
    assert shown.returncode == 0, shown.stderr
    [line] = [ln for ln in shown.stdout.splitlines() if ln.startswith("received:")]
    assert line.split(None, 1)[1] == received.strftime("%Y-%m-%d %H:%M:%S UTC")
    audit = webhooks(width, "audit", "list", "--limit", "1")
    assert audit.returncode == 0, audit.stderr
    assert audit.stdout.split()[3] == "UTC"  # #ID DATE TIME UTC action ...


@pytest.mark.parametrize("width", WIDTHS)
def test_audit_list_keeps_ids_whole(
    width: int, sessions: sessionmaker[Session], settings: Settings
) -> None:
    """Issue 20 item 4 for the audit trail: a source's id in a change's target is never cut."""
    source = make_source(sessions, settings, provider="stripe")  # audited as source.add
    listed = webhooks(width, "audit", "list", "--action", "source", "--limit", "500")
    assert listed.returncode == 0, listed.stderr
    assert f"source={source.public_id}" in listed.stdout
    assert "…" not in listed.stdout
    assert "--json" in listed.stdout


def _row(out: str, key: str) -> list[str]:
    """The cells of the borderless table row holding ``key``, a folded cell joined again: it
    goes on over the next lines, whose other cells are blank (so they start with spaces
    where a row starts with its id)."""
    lines = out.splitlines()
    [start] = [n for n, line in enumerate(lines) if key in line]
    cells = lines[start].split()
    folded = 3  # the events column, the only one that folds
    for line in lines[start + 1 :]:
        if not line.startswith("  ") or not line.strip():
            break
        [piece] = line.split()
        cells[folded] += piece
    return cells


@pytest.mark.parametrize("width", WIDTHS)
def test_routes_list_without_a_source_lists_every_route_whole(
    width: int, sessions: sessionmaker[Session], settings: Settings
) -> None:
    """Issue 20 item 8: a way to list all routes; ids, sources, event types and a forward's
    URL never cut."""
    url = f"https://billing.example.com/hooks/{uuid.uuid4().hex}"
    first = make_source(
        sessions, settings, routes=[{"handler": "log", "events": "invoice.payment_succeeded"}]
    )
    second = make_source(
        sessions, settings, routes=[{"handler": "forward", "options": {"url": url}}]
    )
    listed = webhooks(width, "routes", "list")
    assert listed.returncode == 0, listed.stderr
    _fits(listed.stdout, width)
    assert "…" not in listed.stdout
    for made in (first, second):
        [route_id] = made.route_ids
        assert _row(listed.stdout, made.public_id)[:2] == [str(route_id), made.public_id]
    # Whole, though maybe folded: other routes in the database (a long handler name) can
    # leave the events column narrower than the type at 80 columns.
    assert _row(listed.stdout, first.public_id)[2:] == [
        "log",
        "invoice.payment_succeeded",
        "closed",
    ]
    assert "routes list SOURCE" in listed.stdout
    assert "--json" in listed.stdout

    one = webhooks(width, "routes", "list", second.public_id)
    assert one.returncode == 0, one.stderr
    _fits(one.stdout, width)
    assert "…" not in one.stdout
    folded = "".join(ln.split("│")[-2].strip() for ln in one.stdout.splitlines() if "│" in ln)
    assert f"url={url}" in folded


def test_the_demos_delivery_table_fits_80_columns_without_cutting_a_status() -> None:
    """``webhooks demo``'s live table at 80 columns: ids, handlers and statuses whole (it
    printed ``suc…`` and ``fla…`` in a boxed table)."""
    from webhooks.cli.demo import _states_table  # noqa: PLC0415

    states = [
        queries.DeliveryState("evt_demo_caf4a85e_1", "order.created", 1, "log", "succeeded", 1, 0),
        queries.DeliveryState(
            "evt_demo_caf4a85e_4", "payment.captured", 4, "flaky", "succeeded", 2, 0
        ),
    ]
    out = Console(width=80, record=True)
    out.print(_states_table(states, "after the replay"))
    text = out.export_text()
    assert "…" not in text
    for st in states:
        assert st.event_id in text
        assert st.handler in text
    assert text.count("succeeded") == 2
    assert max(len(line) for line in text.splitlines()) <= 80


def _fields(out: str) -> dict[str, str]:
    """A table printed one field a line (``header  value``), as ``header -> value``."""
    fields: dict[str, str] = {}
    for line in out.splitlines():
        header, _, value = line.strip().partition("  ")
        if value.strip():
            fields.setdefault(header.strip(), value.strip())
    return fields


def test_a_table_too_wide_for_80_columns_is_one_field_a_line_never_cut(
    sessions: sessionmaker[Session], settings: Settings
) -> None:
    """Issue 36: at 80 columns ``sources list --wide`` dropped its name, account, TTL and
    active columns and ``events list`` cut ids and types (``evt_test_a…``) with every time
    on two lines. A table that cannot fit whole is printed one field a line, each row a
    block; at 200 columns the same command is the table it was."""
    name = f"payments-production-{uuid.uuid4().hex[:12]}"
    source = make_source(sessions, settings, provider="stripe", name=name)
    event_type = "customer.subscription.trial_will_end"
    event_id, _ = accept_event(
        settings, source, event_id=f"evt_test_{uuid.uuid4().hex}", event_type=event_type
    )
    wide = webhooks(80, "sources", "list", "--wide")
    assert wide.returncode == 0, wide.stderr
    _fits(wide.stdout, 80)
    block = wide.stdout[wide.stdout.index(f"id         {source.public_id}") :]
    fields = _fields(block)
    assert fields["name"] == name
    assert fields["account"] == "default"
    assert fields["url path"] == f"/webhooks/{source.public_id}"
    assert fields["provider"] == "stripe"
    assert fields["active"] == "yes"
    assert fields["dedup ttl"].startswith("retry_window 3d")

    listed = webhooks(80, "events", "list", "--source", source.public_id)
    assert listed.returncode == 0, listed.stderr
    _fits(listed.stdout, 80)
    assert "…" not in listed.stdout
    fields = _fields(listed.stdout)
    assert (fields["source"], fields["type"], fields["event id"]) == (name, event_type, event_id)
    assert len(fields["received (UTC)"]) == len("2026-12-07 02:48:49")  # one line

    roomy = webhooks(200, "events", "list", "--source", source.public_id)
    [line] = [ln for ln in roomy.stdout.splitlines() if event_id in ln]
    assert name in line
    assert event_type in line
