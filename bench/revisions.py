"""Checkouts of other revisions for the benchmarks' ``--against REV``: a git worktree of REV
beside this one, so the same script measures this tree and REV's code in the same run."""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def worktree(rev: str) -> tuple[Path, bool]:
    """A checkout of ``rev`` beside this one (reused if present); True if made here."""
    sha = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--verify", f"{rev}^{{commit}}"],  # noqa: S607
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    path = Path(tempfile.gettempdir()) / f"webhooks-bench-{sha[:12]}"
    if (path / "ingest" / "app.py").exists():
        return path, False
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", "--force", str(path), sha],  # noqa: S607
        check=True,
        capture_output=True,
    )
    return path, True


def remove_worktree(path: Path) -> None:
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)],  # noqa: S607
        check=False,
        capture_output=True,
    )
