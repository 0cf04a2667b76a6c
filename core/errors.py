"""The root of every error this project raises.

``except WebhooksError`` catches any of them, and nothing a library raises. Each class keeps
its other bases (``class UnknownProvider(WebhooksError, ValueError)``), so every handler that
caught a ``ValueError`` or a ``RuntimeError`` before still catches it.
"""

from __future__ import annotations


class WebhooksError(Exception):
    """An error this project raises (never one of a library it uses)."""
