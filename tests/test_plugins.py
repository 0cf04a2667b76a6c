"""The plug-in registry handlers and transforms share (tasks/plugins.py): both decorators and
both entry-point groups, from a real distribution on ``sys.path`` (a dist-info directory
with its ``entry_points.txt``, as ``pip install`` leaves it); each group scanned once per
process."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tasks.errors import HandlerRegistrationError, UnknownHandlerError
from tasks.handlers import load_registry, register
from tasks.handlers.registry import HANDLERS, UnregisteredHandlerError
from tasks.plugins import entry_point_plugins
from tasks.transforms import (
    TRANSFORMS,
    UnknownTransformError,
    UnregisteredTransformError,
    load_transforms,
    register_transform,
)


def _distribution(site: Path, name: str, entry_points: str, module: str) -> None:
    """An installed distribution in ``site``: its dist-info and its module."""
    info = site / f"{name}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(entry_points)
    (site / f"{name}.py").write_text(module)
    importlib.invalidate_caches()


PLUGIN = """
from tasks.transforms import Transformed

def ship(event, ctx):
    "Ships the event to the plug-in's own place."
    return None

def stamp(event):
    return Transformed(b"stamped")

NOT_CALLABLE = 42
"""


@pytest.fixture
def site(tmp_path: Path) -> Iterator[Path]:
    """A site directory on ``sys.path``, with the entry-point scans forgotten before and
    after (they are cached per process)."""
    entry_point_plugins.cache_clear()
    sys.path.insert(0, str(tmp_path))
    try:
        yield tmp_path
    finally:
        sys.path.remove(str(tmp_path))
        for name in [m for m in sys.modules if m.startswith("plugacme")]:
            del sys.modules[name]
        entry_point_plugins.cache_clear()


def test_both_entry_point_groups_register_from_an_installed_distribution(site: Path) -> None:
    _distribution(
        site,
        "plugacme",
        "[webhooks.handlers]\nacme_ship = plugacme:ship\n\n"
        "[webhooks.transforms]\nacme_stamp = plugacme:stamp\n",
        PLUGIN,
    )
    handlers, transforms = load_registry(), load_transforms()
    assert handlers.get("acme_ship").__name__ == "ship"
    assert transforms.get("acme_stamp").__name__ == "stamp"
    # Each kind sees its own group only, beside its built-ins and pyproject's entry points.
    assert "acme_stamp" not in handlers.names()
    assert "acme_ship" not in transforms.names()
    assert {"noop", "forward", "log", "stripe_subscription"} <= set(handlers.names())
    assert "data_object" in transforms.names()
    described = {info.name: info for info in handlers.describe()}
    assert described["acme_ship"].origin == "entry point (plugacme)"
    assert described["acme_ship"].summary == "Ships the event to the plug-in's own place."
    assert described["noop"].origin == "built-in"


def test_entry_points_are_scanned_once_per_process(site: Path) -> None:
    load_registry()
    load_transforms()
    # Installed after the first scan: this process does not see it ...
    _distribution(
        site,
        "plugacme",
        "[webhooks.handlers]\nlate_ship = plugacme:ship\n\n"
        "[webhooks.transforms]\nlate_stamp = plugacme:stamp\n",
        PLUGIN,
    )
    assert "late_ship" not in load_registry().names()
    assert "late_stamp" not in load_transforms().names()
    # ... a new one would (a new process scans again).
    entry_point_plugins.cache_clear()
    assert "late_ship" in load_registry().names()
    assert "late_stamp" in load_transforms().names()


def test_an_entry_point_that_is_not_callable_is_refused_naming_its_kind(site: Path) -> None:
    _distribution(
        site, "plugacme", "[webhooks.transforms]\nbroken = plugacme:NOT_CALLABLE\n", PLUGIN
    )
    with pytest.raises(HandlerRegistrationError, match="transform entry point 'broken'"):
        load_transforms()
    assert "broken" not in load_registry().names()  # the handlers' group is another


def test_one_name_twice_in_a_kind_is_refused_and_the_kinds_do_not_collide() -> None:
    with pytest.raises(HandlerRegistrationError, match="handler name 'log'"):
        register("log")(lambda event, ctx: None)
    with pytest.raises(HandlerRegistrationError, match="transform name 'data_object'"):
        register_transform("data_object")(lambda event: None)
    with pytest.raises(HandlerRegistrationError, match="a transform name must not be empty"):
        register_transform(" ")(lambda event: None)
    # A handler and a transform may share a name: two tables.
    shared = register_transform("log")(lambda event: None)
    try:
        assert load_transforms().get("log") is shared
        assert load_registry().get("log").__name__ == "log_handler"  # the built-in
    finally:
        del TRANSFORMS.registered["log"]
    assert "log" not in load_transforms().names()
    assert HANDLERS.registered["log"] is load_registry().get("log")


def test_each_kind_raises_its_own_errors_for_a_name_nothing_registers() -> None:
    with pytest.raises(UnknownHandlerError, match="no handler registered under 'nope'"):
        load_registry().get("nope")
    with pytest.raises(UnknownTransformError, match="no transform registered under 'nope'"):
        load_transforms().get("nope")
    with pytest.raises(UnregisteredHandlerError, match=r"unknown handler 'fowrard': did you"):
        load_registry().require("fowrard")
    with pytest.raises(UnregisteredTransformError, match=r"unknown transform 'data_objct'"):
        load_transforms().require("data_objct")
