"""Every exception class the product defines derives from :class:`core.errors.WebhooksError`
and says in its docstring what it means (issue 31, item 5).

The classes are found by reading each product module (ast), then checked on the imported
class itself, so a class deriving from another project error counts through its base."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

from core.errors import WebhooksError

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("core", "models", "tasks", "ingest", "webhooks")
# Deliberately outside Exception, so no ``except Exception`` can swallow it: a WebhooksError
# base (an Exception) would change what catches it.
BASE_EXCEPTION_ONLY = {
    "tasks.pools.HardTimeLimitExceeded",
    # Raised into a runaway transform's thread: its `except Exception` must not swallow it.
    "tasks.transforms.TransformTimeLimit",
}


def product_exceptions() -> list[type[BaseException]]:
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "migrations" in path.relative_to(ROOT).parts:
                continue
            tree = ast.parse(path.read_text())
            classes = [n.name for n in tree.body if isinstance(n, ast.ClassDef) and n.bases]
            # A class made inside a function (to defer a heavy import) is no exception: an
            # exception there would escape this check, so its bases may not name one.
            for function in ast.walk(tree):
                if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                    continue
                for inner in ast.walk(function):
                    if isinstance(inner, ast.ClassDef):
                        bases = [ast.unparse(b) for b in inner.bases]
                        assert not any(b.endswith(("Error", "Exception")) for b in bases), (
                            f"{path}: exception class {inner.name} inside a function"
                        )
            if not classes:
                continue
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            module = importlib.import_module(name.removesuffix(".__init__"))
            for cls_name in classes:
                cls = getattr(module, cls_name, None)
                assert cls is not None, f"{name}.{cls_name}: not at module level"
                if isinstance(cls, type) and issubclass(cls, BaseException):
                    found.append(cls)
    return found


def test_every_product_exception_derives_from_the_base_and_says_what_it_means() -> None:
    classes = product_exceptions()
    assert len(classes) > 40  # the walk found them (47 when this test was written)
    qualified = {f"{c.__module__}.{c.__qualname__}": c for c in classes}
    assert set(qualified) >= BASE_EXCEPTION_ONLY
    rootless = [
        n
        for n, c in qualified.items()
        if n not in BASE_EXCEPTION_ONLY and not issubclass(c, WebhooksError)
    ]
    undocumented = [
        n for n, c in qualified.items() if not (c.__dict__.get("__doc__") or "").strip()
    ]
    assert rootless == []
    assert undocumented == []


def test_the_base_keeps_the_builtin_bases_callers_catch() -> None:
    """A class that was a ValueError still is one (``except ValueError`` catches it)."""
    from core.providers.registry import UnknownProvider  # noqa: PLC0415
    from models.queries import NotFoundError  # noqa: PLC0415

    assert issubclass(UnknownProvider, ValueError)
    assert issubclass(NotFoundError, ValueError)
    assert issubclass(NotFoundError, WebhooksError)
    assert not issubclass(WebhooksError, ValueError)
