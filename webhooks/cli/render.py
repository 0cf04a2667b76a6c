"""Shared rendering of the operators' commands: options, times, JSON views, tables of event data,
and one delivery with its attempt history.

Event data (event types, ids, error text, handler names, reasons) comes from outside: it is
put in tables as :class:`rich.text.Text` cells and into lines with :func:`rich.markup.escape`,
so ``[link=...]`` or ``[bold]`` in it is printed as written, never interpreted.
"""

from __future__ import annotations

import dataclasses
import getpass
import io
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console, Group, RenderableType
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from webhooks.cli.common import Env, console

if TYPE_CHECKING:
    from models import views as delivery_history

JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON.")]
SourceOpt = Annotated[str | None, typer.Option("--source", help="Source id or name.")]
ReasonOpt = Annotated[
    str | None, typer.Option("--reason", help="Why (required; recorded in the audit).")
]
OperatorOpt = Annotated[
    str | None,
    typer.Option("--operator", "--as", help="Who is making the change (default: your login name)."),
]


def login() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # a container user without a passwd entry or $USER
        return "unknown"


def stamp(value: datetime | None) -> str:
    """A time in a table cell, in UTC: the column's header says ``(UTC)``."""
    if value is None:
        return ""
    aware = value if value.tzinfo is not None else value.replace(tzinfo=UTC)
    return aware.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")


def when(value: datetime | None) -> str:
    """A time in a line of text, in UTC and saying so (the database's times are UTC)."""
    return "" if value is None else f"{stamp(value)} UTC"


def count(n: int, singular: str, plural: str | None = None) -> str:
    """``1 delivery``, ``2 deliveries``: a count with its noun in the right number."""
    if n == 1:
        return f"{n} {singular}"
    if plural is None:
        plural = singular[:-1] + "ies" if singular.endswith("y") else singular + "s"
    return f"{n} {plural}"


def parse_when(e: Env, text: str | None) -> datetime | None:
    from models.views import parse_time

    return None if text is None else parse_time(text, now=e.clock.now())


def plain(obj: Any) -> Any:
    return dataclasses.asdict(obj) if dataclasses.is_dataclass(obj) else obj  # type: ignore[arg-type]


def cell(value: object) -> Text:
    """A table cell printed literally (rich markup in event data is not interpreted)."""
    return Text("" if value is None else str(value))


def row(table: Table, *values: object) -> None:
    table.add_row(*(v if isinstance(v, Text) else cell(v) for v in values))


def say(line: str) -> None:
    """A line whose values were escaped by the caller (:func:`escape`); no highlighting."""
    console.print(line, highlight=False, soft_wrap=True)


def prose(line: str) -> None:
    """A sentence or more (its values escaped by the caller), wrapped at the terminal's width
    between words: what :func:`say` prints on one line however long."""
    console.print(line, highlight=False)


def _replay_line(mark: delivery_history.ReplayMark) -> str:
    kind = "re-run (new key generation)" if mark.rerun else "replay"
    if mark.replay_id is None:
        return f"  ── {kind} (no audit row found) ──"
    return escape(
        f"  ── {kind} {mark.replay_id} at {when(mark.started_at)} by {mark.operator} "
        f"via {mark.via}: {mark.reason} ──"
    )


def _attempt_table() -> Table:
    return Table("#", "gen", "worker", "started (UTC)", "ended (UTC)", "outcome", "error")


def print_delivery(d: delivery_history.DeliveryView) -> None:
    """The delivery's line, then its attempts in time order, each replay a separator line
    with its audit row (who, when, why) between the runs."""
    shown = len(d.attempt_log)
    line = f"delivery {d.id}: route {d.route_id} ({escape(d.handler)}) [bold]{d.status}[/bold]"
    line += f", {shown} attempt{'' if shown == 1 else 's'}"
    if d.replays:
        line += f" ({d.attempts_since_replay} since the last replay)"
    line += f", key generation {d.generation}"
    if d.dead_reason:
        line += f", dead: {escape(d.dead_reason)}"
    if d.result_ref:
        line += f", result {escape(d.result_ref)}"
    if d.next_attempt_at is not None:
        line += f", next attempt {when(d.next_attempt_at)}"
    if d.status == "filtered":  # no work was made: why, on the delivery's own line
        line += f": {escape(d.last_error or 'its filter did not match')}"
    say(line)
    if d.last_error_class and d.status != "filtered":
        say(f"  last error: {escape(d.last_error_class)}: {escape(d.last_error or '')}")
    marks = {m.first_attempt: m for m in d.replays if m.first_attempt is not None}
    table = _attempt_table()
    for a in d.attempt_log:
        mark = marks.get(a.number)
        if mark is not None:
            if table.row_count:
                console.print(fitted(table))
            say(_replay_line(mark))
            table = _attempt_table()
        error = f"{a.error_class}: {a.error or ''}" if a.error_class else ""
        outcome = a.outcome or "running"
        if a.outcome == "succeeded" and a.unrecorded_ms is not None:
            outcome += f" (committed {a.unrecorded_ms} ms after)"  # the 2xx stood unrecorded
        row(
            table,
            a.number,
            a.generation,
            a.worker or "",
            stamp(a.started_at),
            stamp(a.ended_at),
            outcome,
            error,
        )
    if table.row_count:
        console.print(fitted(table))
    for number, window in d.repeat_windows:
        say(f"  attempt {number}'s call may have reached the downstream too: {window}")
    for mark in d.replays:
        if mark.first_attempt is None:
            say(_replay_line(mark) + " (no attempt yet)")


def whole(table: Table, *headers: str) -> Table:
    """Never cut these columns (ids, URLs, event types): each is as wide as its widest cell,
    on one line, and rich narrows the other columns instead. Call after adding the rows."""
    for column in table.columns:
        if str(column.header) in headers:
            widest = max((Text(str(c)).cell_len for c in column.cells), default=0)
            column.no_wrap = True
            column.min_width = max(widest, Text(str(column.header)).cell_len)
    return table


def _squeezed(table: Table) -> bool:
    """Whether rich, fitting ``table`` to the terminal, drops a column (its header is gone) or
    cuts a cell of a column :func:`whole` keeps whole: the table as rich would print it at
    this terminal's width (other columns may be cut on purpose, e.g. one-line prose)."""
    plain = Console(width=console.width, color_system=None, file=io.StringIO())
    with plain.capture() as captured:
        plain.print(table)
    shown = captured.get()
    for column in table.columns:
        words = str(column.header).split()
        if words and words[0] not in shown:
            return True
        whole_cells = column.no_wrap and column.min_width is not None
        if whole_cells and any(str(cell) not in shown for cell in column.cells):
            return True
    return False


def fitted(table: Table) -> RenderableType:
    """``table`` when it fits the terminal; else each row as a block of its own, one field a
    line (``header  value``), so that at 80 columns no id is cut and no column is dropped
    (rich squeezes a table that is too wide: it cut ids and dropped ``--wide``'s columns).
    Every table of the CLI is printed through this."""
    if not table.row_count or not _squeezed(table):
        return table
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="dim", no_wrap=True)
    grid.add_column(overflow="fold")
    cells = [list(column.cells) for column in table.columns]
    for i in range(table.row_count):
        if i:
            grid.add_row("", "")
        for column, values in zip(table.columns, cells, strict=True):
            grid.add_row(Text(str(column.header)), values[i])
    if table.title is None:
        return grid
    return Group(Text(str(table.title), style="italic"), grid)


def show_table(table: Table, more: str = "--json for every field") -> None:
    """The table, then where the rest is (``--json``, ``--wide``, a ``show`` command)."""
    console.print(fitted(table))
    console.print(f"[dim]({escape(more)})[/dim]", highlight=False)
