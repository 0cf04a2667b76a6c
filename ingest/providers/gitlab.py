"""GitLab: ``X-Gitlab-Token`` carries the webhook's secret token itself (no HMAC, no timestamp).

Authentication is a constant-time comparison of the header with each of the source's secrets.
Nothing is signed: whoever captures one request holds the token and can send anything, under
any id, forever, until the token is rotated. Keep the endpoint on TLS and rotate the token if a
request may have leaked. The dedup id is ``Idempotency-Key`` (a UUID that GitLab keeps when it
retries or resends a delivery), else ``X-Gitlab-Event-UUID``; the type is ``X-Gitlab-Event``.

Retries: no fixed schedule is documented. A hook answering 5xx is disabled temporarily, with a
back-off growing to at most 24 hours, and a delivery can be resent by hand from the hook's
history (gitlab-org/gitlab#414893 tracks the unclear semantics). Three days is taken to cover
the back-off and a manual resend. Docs: https://docs.gitlab.com/user/project/integrations/webhooks/
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from ingest.providers.base import (
    AuthError,
    Challenge,
    EventMeta,
    Provider,
    Secrets,
    event_id,
    event_type,
    header,
)


def authenticate(
    headers: Mapping[str, str], body: bytes, secrets: Secrets, config: Mapping[str, Any]
) -> tuple[str, int | None]:
    offered = header(headers, "x-gitlab-token").encode("utf-8")
    for secret_id, secret in secrets:
        if secret and hmac.compare_digest(secret.encode("utf-8"), offered):
            return secret_id, None
    raise AuthError("bad_signature")


def extract(
    headers: Mapping[str, str], body: bytes, config: Mapping[str, Any]
) -> EventMeta | Challenge:
    raw_id = headers.get("idempotency-key") or headers.get("x-gitlab-event-uuid")
    return EventMeta(
        event_id=event_id(raw_id),
        event_type=event_type(headers.get("x-gitlab-event")),
        occurred_at=None,
    )


PROVIDER = Provider(
    name="gitlab",
    authenticate=authenticate,
    extract=extract,
    retry_window=timedelta(days=3),
    citation="https://docs.gitlab.com/user/project/integrations/webhook_events/ (no schedule "
    "documented; auto-disable back-off up to 24 h, gitlab-org/gitlab#414893)",
    signed="nothing: X-Gitlab-Token is the secret itself, so a capture can forge any event",
    tolerance=None,
    summary="X-Gitlab-Token shared token (constant-time compare)",
)
