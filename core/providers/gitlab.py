"""GitLab: ``X-Gitlab-Token`` (the secret token itself), or GitLab's signing token.

Secret token (the classic setting): a constant-time comparison of the header with each of the
source's secrets. Nothing is signed: whoever captures one request holds the token and can send
anything, under any id, forever, until the token is rotated. Keep the endpoint on TLS and
rotate the token if a request may have leaked.

Signing token (``whsec_...``; GitLab's newer option): GitLab then sends Standard Webhooks
headers (``webhook-id`` = ``Idempotency-Key``, ``webhook-timestamp``, ``webhook-signature``)
and the request is verified as the ``standard`` provider verifies it: id, timestamp and body
are signed, and the timestamp must be within 5 minutes. Add the signing token as the source's
secret (``webhooks secrets add``); a source can hold both during a switch.

The dedup id comes from signed parts only, when anything is signed: a signing-token delivery's
id is ``webhook-id`` (signed; GitLab sets it to the ``Idempotency-Key``), and the unsigned
``Idempotency-Key`` header is ignored, so a captured delivery re-sent with new
``Idempotency-Key`` values within the 5 minutes is a duplicate, not a new event. A secret-token
delivery signs nothing: its id is ``Idempotency-Key`` (a UUID GitLab keeps when it retries or
resends a delivery), else ``X-Gitlab-Event-UUID``. The type is ``X-Gitlab-Event``, unsigned in
both modes.
Retries: no fixed schedule is documented. A hook answering 5xx is disabled temporarily, with a
back-off growing to at most 24 hours, and a delivery can be resent by hand from the hook's
history (gitlab-org/gitlab#414893 tracks the unclear semantics). Three days is taken to cover
the back-off and a manual resend. Docs: https://docs.gitlab.com/user/project/integrations/webhooks/
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from typing import Any

from core.providers.base import (
    FIVE_MINUTES,
    AuthError,
    Challenge,
    EventMeta,
    Secrets,
    from_headers,
    header,
)
from core.providers.descriptions import described
from core.providers.standard import scheme

_signed_auth, _ = scheme(("webhook",))
# The id: webhook-id is signed (Idempotency-Key is not) when anything is.
_signed_fields = from_headers(id="webhook-id", type="x-gitlab-event")
_token_fields = from_headers(id=("idempotency-key", "x-gitlab-event-uuid"), type="x-gitlab-event")


def _signing_token(headers: Mapping[str, str]) -> bool:
    """Whether the delivery is verified as a signing-token (Standard Webhooks) one: the one
    test :func:`authenticate` and :func:`extract` share, so the id is read from what was
    verified."""
    return bool(headers.get("webhook-signature"))


def authenticate(
    headers: Mapping[str, str], body: bytes, secrets: Secrets, config: Mapping[str, Any]
) -> tuple[str, int | None]:
    if _signing_token(headers):  # the signing token: Standard Webhooks
        signing = [(i, s) for i, s in secrets if s.startswith("whsec_")]
        return _signed_auth(headers, body, signing, config)
    offered = header(headers, "x-gitlab-token").encode("utf-8")
    for secret_id, secret in secrets:
        if secret and hmac.compare_digest(secret.encode("utf-8"), offered):
            return secret_id, None
    raise AuthError("bad_signature")


def extract(
    headers: Mapping[str, str], body: bytes, config: Mapping[str, Any]
) -> EventMeta | Challenge:
    fields = _signed_fields if _signing_token(headers) else _token_fields
    return fields(headers, body, config)


def unsigned_type(config: Mapping[str, Any], pattern: str) -> str | None:
    """Every type is the unsigned ``X-Gitlab-Event``."""
    return "X-Gitlab-Event"


# The tolerance applies to signing-token deliveries only: a secret-token delivery has no time.
PROVIDER = described(
    "gitlab", authenticate, extract, tolerance=FIVE_MINUTES, type_rule=unsigned_type
)
