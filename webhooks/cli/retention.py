"""Commands of this area are registered here."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Filled in by the area's own work."""
