"""The ``public_url`` option of providers whose signature covers the URL they post to.

Twilio, Square and HubSpot sign the URL the sender was configured with. Behind a proxy or a
load balancer the receiver cannot know it (and must not trust the ``Host`` header for it: a
client chooses that), so the source states it: ``--config public_url=https://...``, exactly as
entered at the sender (scheme, host, port, path and query, byte for byte).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from core.providers.contract import one_option


def validate(config: Mapping[str, Any]) -> dict[str, Any]:
    """``public_url`` required, an absolute http(s) URL with a host and no fragment."""
    one_option(config, "public_url", required=True)
    url = config.get("public_url")
    if not isinstance(url, str) or not url:
        raise ValueError(
            "needs public_url (the URL the sender is configured to post to; its signature "
            "covers it): --config public_url=https://..."
        )
    parts = urlsplit(url)
    if parts.scheme not in ("https", "http") or not parts.hostname or parts.fragment:
        raise ValueError("public_url must be an absolute http(s) URL with a host, no fragment")
    if any(c.isspace() for c in url) or not url.isascii():
        raise ValueError("public_url must be ASCII without spaces (as the sender sends it)")
    return {"public_url": url}


def public_url(config: Mapping[str, Any]) -> str:
    url = config.get("public_url")
    if not isinstance(url, str) or not url:
        # A source created before the option was required: no URL, nothing can verify.
        raise ValueError("source has no public_url")
    return url
