"""The documented path of the providers' helpers, kept for plug-ins: :mod:`core.providers.base`."""

from core.providers.base import *  # noqa: F403 (the helpers, re-exported)
