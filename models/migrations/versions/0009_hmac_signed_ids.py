"""generic HMAC: the event id comes from the signed body unless a source chose a header

Before this revision every generic-HMAC source stored ``id_header: x-webhook-id``, filled in as
a default, and that unsigned header took precedence over the signed body ``id``: one captured
request could be replayed under new ids and was accepted each time (issue 11, finding 3).

Decision, per ``sources`` row with ``provider = 'hmac'``:

* ``id_header`` is the old default ``x-webhook-id`` and ``id_field`` is set: the default was
  never a choice, so ``id_header`` becomes null and the id is read from the signed body. A
  sender that puts the id only in that header now gets 400 ``missing_id`` for it, which is
  visible and is fixed by ``signed_content`` or, knowingly, ``id_from_unsigned_header``.
* ``id_header`` is anything else, or ``id_field`` is null (the header is the only id): the
  operator chose the header on purpose, so it is kept with ``id_from_unsigned_header: true``,
  which says explicitly what it always meant (a capture replays under a new id).

Every row also gets the new keys ``signed_content: null`` and, where not set above,
``id_from_unsigned_header: false``, so the stored options are what validation returns.
Downgrade puts the old default header back where it was removed and drops the new keys.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.execute(
        """
        UPDATE sources SET config = config
            || jsonb_build_object('id_header', NULL, 'id_from_unsigned_header', false)
        WHERE provider = 'hmac'
          AND config->>'id_header' = 'x-webhook-id'
          AND coalesce(config->>'id_field', '') <> ''
        """
    )
    op.execute(
        """
        UPDATE sources SET config = config || '{"id_from_unsigned_header": true}'::jsonb
        WHERE provider = 'hmac'
          AND coalesce(config->>'id_header', '') <> ''
          AND NOT config ? 'id_from_unsigned_header'
        """
    )
    op.execute(
        """
        UPDATE sources SET config = config
            || jsonb_build_object(
                'signed_content', config->'signed_content',
                'id_from_unsigned_header', coalesce(config->'id_from_unsigned_header', 'false')
            )
        WHERE provider = 'hmac'
        """
    )


def downgrade() -> None:
    op.execute(
        """
        UPDATE sources SET config = (config - 'signed_content' - 'id_from_unsigned_header')
            || jsonb_build_object(
                'id_header',
                CASE WHEN jsonb_typeof(config->'id_header') = 'string' THEN config->'id_header'
                     ELSE '"x-webhook-id"'::jsonb END
            )
        WHERE provider = 'hmac'
        """
    )
