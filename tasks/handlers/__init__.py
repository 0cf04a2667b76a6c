"""Delivery handlers: ``(event, ctx) -> None`` callables registered by name."""

from tasks.handlers.registry import Handler, HandlerRegistry, load_registry, register

__all__ = ["Handler", "HandlerRegistry", "load_registry", "register"]
