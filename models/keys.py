"""Re-encrypting every stored secret under the newest ``WEBHOOKS_SECRET_KEY`` (``webhooks
secrets rekey``).

It also binds each one to its place (``core.crypto.Place``): one written before binding
existed is sealed for the row it stands in; one sealed for another row or purpose (copied
there) is counted as misplaced and left alone, refused wherever it is read. Source secrets
and route signing secrets are walked in key order, a batch per transaction, and
each one not already under the newest key is re-encrypted by a guarded UPDATE that names the
ciphertext it read (a secret changed meanwhile is left for the next run). So a run can stop at
any point and be started again (resumable), and a second run finds nothing to do
(idempotent). The plaintexts never leave this process and are never logged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import text
from sqlalchemy.orm import Session, sessionmaker

from core.crypto import (
    Place,
    SecretBox,
    SecretDecryptError,
    SecretMisplaced,
    reconcile_place,
    route_secret_place,
    source_secret_place,
)
from core.errors import WebhooksError
from core.logs import get_logger

log = get_logger("keys")

# (table, key column, ciphertext column, the place of a row's secret): every column that
# holds a secret at rest, and where each of its ciphertexts is bound (core.crypto.Place).
_TARGETS: tuple[tuple[str, str, str, Callable[[Any], Place]], ...] = (
    ("source_secrets", "id", "ciphertext", lambda key: source_secret_place(str(key))),
    ("routes", "id", "signing_ciphertext", lambda key: route_secret_place(int(key))),
    # reconciliation's API credential (0016)
    ("sources", "id", "reconcile_ciphertext", lambda key: reconcile_place(int(key))),
)


@dataclass
class RekeyReport:
    checked: dict[str, int] = field(default_factory=dict)
    rekeyed: dict[str, int] = field(default_factory=dict)
    # Rows no listed key decrypts (left untouched: a key is missing from the list).
    undecryptable: dict[str, int] = field(default_factory=dict)
    # Rows sealed for another place (copied there): left untouched, refused where read.
    misplaced: dict[str, int] = field(default_factory=dict)

    @property
    def total_rekeyed(self) -> int:
        return sum(self.rekeyed.values())


class LegacyKeysInUseError(WebhooksError):
    """``rekey --drop-legacy`` while stored secrets still need the legacy derivation."""

    reason = "legacy_in_use"

    def __init__(self, count: int) -> None:
        super().__init__(
            f"{count} stored secrets are still encrypted under the legacy SHA-256 key"
            " derivation: run `webhooks secrets rekey` first (nothing was changed, and"
            " WEBHOOKS_SECRET_KEY_LEGACY must stay true until this passes)"
        )
        self.count = count


def _ciphertexts(sessions: sessionmaker[Session], batch: int) -> Iterator[bytes]:
    for table, key, column, _ in _TARGETS:
        after: object = None
        while True:
            with sessions() as session:
                rows = session.execute(
                    text(
                        f"SELECT {key}, {column} FROM {table}"  # noqa: S608 (constants above)
                        f" WHERE {column} IS NOT NULL"
                        + ("" if after is None else f" AND {key} > :after")
                        + f" ORDER BY {key} LIMIT :limit"
                    ),
                    {"after": after, "limit": batch},
                ).all()
            yield from (bytes(ciphertext) for _, ciphertext in rows)
            if len(rows) < batch:
                break
            after = rows[-1][0]


def legacy_in_use(sessions: sessionmaker[Session], box: SecretBox, *, batch: int = 500) -> int:
    """How many stored secrets only the legacy derivation of a listed key decrypts."""
    return sum(box.needs_legacy(c) for c in _ciphertexts(sessions, batch))


def rekey(
    sessions: sessionmaker[Session],
    box: SecretBox,
    *,
    batch: int = 500,
    drop_legacy: bool = False,
) -> RekeyReport:
    """Re-encrypt under the newest key. ``drop_legacy``: first confirm that no stored secret
    needs the legacy derivation any more, else LegacyKeysInUseError before anything changes
    (then WEBHOOKS_SECRET_KEY_LEGACY can be turned off everywhere)."""
    if drop_legacy:
        count = legacy_in_use(sessions, box, batch=batch)
        if count:
            raise LegacyKeysInUseError(count)
    report = RekeyReport()
    for table, key, column, place_of in _TARGETS:
        checked = rekeyed = undecryptable = misplaced = 0
        after: object = None
        while True:
            with sessions() as session, session.begin():
                rows = session.execute(
                    text(
                        f"SELECT {key}, {column} FROM {table}"  # noqa: S608 (constants above)
                        f" WHERE {column} IS NOT NULL"
                        + ("" if after is None else f" AND {key} > :after")
                        + f" ORDER BY {key} LIMIT :limit"
                    ),
                    {"after": after, "limit": batch},
                ).all()
                for row_key, ciphertext in rows:
                    checked += 1
                    stored = bytes(ciphertext)
                    place = place_of(row_key)
                    if box.is_current(stored, place):
                        continue
                    try:
                        fresh = box.rebound(stored, place)
                    except SecretMisplaced:
                        misplaced += 1
                        continue
                    except SecretDecryptError:
                        undecryptable += 1
                        continue
                    updated = session.connection().execute(
                        text(
                            f"UPDATE {table} SET {column} = :fresh"  # noqa: S608
                            f" WHERE {key} = :key AND {column} = :old"
                        ),
                        {"fresh": fresh, "key": row_key, "old": stored},
                    )
                    rekeyed += updated.rowcount
            if len(rows) < batch:
                break
            after = rows[-1][0]
        report.checked[table] = checked
        report.rekeyed[table] = rekeyed
        report.undecryptable[table] = undecryptable
        report.misplaced[table] = misplaced
    log.info(
        "secrets.rekeyed",
        rekeyed=report.total_rekeyed,
        undecryptable=sum(report.undecryptable.values()),
        misplaced=sum(report.misplaced.values()),
    )
    return report
