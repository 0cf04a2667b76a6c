"""The documented import path of the provider contract, kept for plug-ins written against it.

The providers live on the ground floor, in :mod:`core.providers` (they are pure functions of
headers and body); ``from ingest.providers import Provider`` keeps working. New code imports
:mod:`core.providers`.
"""

from core.providers import *  # noqa: F403 (the documented names, re-exported)
from core.providers import __all__ as __all__
