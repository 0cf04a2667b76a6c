"""CLI start-up benchmark: the median wall time and user CPU of ``webhooks`` commands, each run
as a new process (as an operator, and the test suite, run them), beside the floor: ``python -c
'import psycopg'`` in the same run, each command's wall time as a ratio to it (issue 36 item 1:
every read command within 0.4 s and at most 3x the floor).

Commands: the six read commands (``events list``, ``events show 5``, ``dead list``,
``deliveries show 5``, ``sources list``, ``routes list``: settings, the key check, the
queries; 5 is no event and no delivery, so those end with their one-line error), ``--help``,
and a bad input (``events list --since`` a time that does not parse). They run against a
database of their own, migrated, with one source and one route (and so one stored secret: the
key check derives the key).
Python's bytecode cache is on (a directory of its own, filled by a first, uncounted run), as
in the suite's subprocesses. Both trees' storage keys are generated ones (``whk_``, HKDF: what
``make .env`` writes), or with ``--passphrase`` passphrases (scrypt). Each tree has a database
of its own, its secret sealed under its key.

Against a revision (``--against REV``): the same commands from a git worktree of REV
(``bench/revisions.py``), run alternately with this tree's, each ``--runs`` times. User CPU is
the steadier figure on a shared machine.

Usage: .venv/bin/python bench/bench_cli.py [--runs 7] [--against REV] [--passphrase]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psycopg
from revisions import remove_worktree, worktree

ROOT = Path(__file__).resolve().parent.parent
ADMIN_DSN = os.environ.get("BENCH_ADMIN_DSN", "postgresql://postgres@127.0.0.1:5432/postgres")
COMMANDS = [
    ["events", "list"],
    ["events", "show", "5"],
    ["dead", "list"],
    ["deliveries", "show", "5"],
    ["sources", "list"],
    ["routes", "list"],
    ["--help"],
    ["events", "list", "--since", "not-a-time"],
]
PROGRAM = "import sys; sys.argv[0] = 'webhooks'; from webhooks.cli import main; main()"
# The floor, run by the same interpreter in each tree's environment: the driver alone.
FLOOR = "import psycopg"
FLOOR_NAME = "python -c 'import psycopg'"


# Fixed, so that both trees decrypt the one stored secret: 32 bytes, base64url.
GENERATED_KEY = "whk_" + "Q2xpLWJlbmNoLWtleS0zMi1ieXRlcy1yYW5kb20tISE"
PASSPHRASE = "bench-secret-key-" + "k" * 32


def environment(code: Path, database: str, key: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WEBHOOKS_")}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.update(
        PYTHONPATH=str(code),
        PYTHONPYCACHEPREFIX=str(Path("/tmp") / "bench-cli-pycache"),
        WEBHOOKS_ENV_FILE=str(ROOT / "tests" / "empty.env"),
        WEBHOOKS_ENVIRONMENT="test",
        WEBHOOKS_DATABASE_URL=f"postgresql://postgres@127.0.0.1:5432/{database}",
        WEBHOOKS_BROKER_URL="redis://127.0.0.1:6379/14",
        WEBHOOKS_REDIS_URL="redis://127.0.0.1:6379/15",
        WEBHOOKS_SECRET_KEY=key,
        WEBHOOKS_LOG_JSON="true",
        COLUMNS="120",
    )
    return env


def run(code: Path, args: list[str], env: dict[str, str]) -> tuple[float, float, int]:
    """Wall seconds, user CPU seconds and exit code of one ``webhooks`` process (of the floor
    for ``args`` [FLOOR_NAME])."""
    argv = ["-c", FLOOR] if args == [FLOOR_NAME] else ["-c", PROGRAM, *args]
    start = time.perf_counter()
    proc = subprocess.Popen(  # noqa: S603
        [sys.executable, *argv],
        cwd=code,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    return wall, usage.ru_utime, proc.returncode


def measure(
    trees: dict[str, Path], envs: dict[str, dict[str, str]], runs: int
) -> dict[tuple[str, str], list]:
    results: dict[tuple[str, str], list[tuple[float, float, int]]] = {}
    for label, code in trees.items():  # fill the bytecode cache, uncounted
        for args in COMMANDS:
            run(code, args, envs[label])
    for i in range(runs):
        order = list(trees.items()) if i % 2 == 0 else list(trees.items())[::-1]
        for args in [[FLOOR_NAME], *COMMANDS]:
            for label, code in order:
                results.setdefault((label, " ".join(args)), []).append(run(code, args, envs[label]))
    return results


def report(results: dict[tuple[str, str], list], labels: list[str], runs: int) -> str:
    """Per command and tree: median wall / user CPU (exit codes), the wall time's ratio to the
    floor's in that tree; with two trees, this tree's wall and user CPU against REV's."""
    lines = [
        f"webhooks CLI, median of {runs} runs each (wall s / user CPU s (exit code), x floor:"
        f" wall as a multiple of {FLOOR_NAME}'s median wall in the same tree and run)"
    ]
    head = f"{'command':<34}" + "".join(f"{label:>32}" for label in labels)
    if len(labels) == 2:
        head += f"{'wall ratio':>12}{'CPU ratio':>11}"
    lines.append(head)
    floors = {
        label: statistics.median(r[0] for r in results[(label, FLOOR_NAME)]) for label in labels
    }
    for args in [[FLOOR_NAME], *COMMANDS]:
        name = " ".join(args)
        line = f"{name:<34}"
        walls, users = [], []
        for label in labels:
            rows = results[(label, name)]
            wall = statistics.median(r[0] for r in rows)
            user = statistics.median(r[1] for r in rows)
            codes = sorted({r[2] for r in rows})
            walls.append(wall)
            users.append(user)
            cell = (
                f"{wall:.3f} / {user:.3f} ({','.join(map(str, codes))}) {wall / floors[label]:.1f}x"
            )
            line += f"{cell:>32}"
        if len(labels) == 2:
            line += f"{walls[0] / walls[1]:>11.2f}x{users[0] / users[1]:>10.2f}x"
        lines.append(line)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--against", metavar="REV", help="also run REV's code, alternating")
    parser.add_argument(
        "--passphrase", action="store_true", help="a passphrase storage key (scrypt)"
    )
    args = parser.parse_args()
    trees = {"this tree": ROOT}
    made = None
    if args.against:
        path, fresh = worktree(args.against)
        made = path if fresh else None
        trees[args.against] = path
    # Both trees with the same kind of key (main reads generated keys since 5f2d77f's successor).
    keys = dict.fromkeys(trees, PASSPHRASE if args.passphrase else GENERATED_KEY)
    databases = {label: f"webhooks_bench_cli_{uuid.uuid4().hex[:8]}" for label in trees}
    envs = {label: environment(trees[label], databases[label], keys[label]) for label in trees}
    try:
        for label, database in databases.items():
            with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
                conn.execute(f'CREATE DATABASE "{database}"')
            for setup in (
                ["db", "upgrade"],
                ["sources", "add", "bench", "--provider", "standard"],
                ["routes", "add", "bench", "--handler", "log"],
            ):
                subprocess.run(  # noqa: S603
                    [sys.executable, "-c", PROGRAM, *setup],
                    cwd=trees[label], env=envs[label], check=True, capture_output=True,
                )  # fmt: skip
        results = measure(trees, envs, args.runs)
    finally:
        with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
            for database in databases.values():
                conn.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
        if made is not None:
            remove_worktree(made)
    revision = ""
    if args.against:
        sha = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", args.against],  # noqa: S607
            capture_output=True, text=True, check=False,
        ).stdout.strip()  # fmt: skip
        revision = f" against {args.against} ({sha})"
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],  # noqa: S607
        capture_output=True, text=True, check=False,
    ).stdout.strip()  # fmt: skip
    kind = "passphrase keys (scrypt)" if args.passphrase else "generated keys (HKDF)"
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"# {stamp}, rev {head} (this tree), load average {load}")
    print(f"bench_cli{revision}: {len(COMMANDS)} commands, {kind}, load average {load}")
    print(report(results, list(trees), args.runs))


if __name__ == "__main__":
    main()
