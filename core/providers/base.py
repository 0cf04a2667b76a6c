"""The documented path of the provider contract and its helpers, for provider modules and
plug-ins: ``from core.providers.base import Provider, body_hmac, json_fields``.

It gathers three modules, one per concern: :mod:`core.providers.contract` (what a provider
is, what it returns, its errors and limits), :mod:`core.providers.signatures` (helpers for
authentication) and :mod:`core.providers.parsing` (helpers for extraction). Everything is pure:
no I/O, no clock and no logging.
"""

from __future__ import annotations

# Star imports on purpose: this module's names are exactly the three modules' public names.
from core.providers.contract import *  # noqa: F403
from core.providers.parsing import *  # noqa: F403
from core.providers.signatures import *  # noqa: F403
