"""The image docker-compose.yml builds holds every package the project installs (Docker runs
no container on the test machine, so the Dockerfile is checked by reading it): until
2026-12-07 it copied neither ``core/`` (every process imports it) nor ``LICENSE`` (which
pyproject.toml's ``license-files`` names, so ``pip install .`` stopped)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _copied() -> set[str]:
    copied: set[str] = set()
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY "):
            copied.update(p.rstrip("/") for p in line.split()[1:-1])
    return copied


def test_the_image_copies_every_package_and_file_the_install_needs() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    needed = packages | {"pyproject.toml", project["project"]["readme"]}
    needed |= set(project["project"].get("license-files", []))
    assert needed <= _copied(), needed - _copied()
    for name in needed:
        assert (ROOT / name).exists(), name


def test_the_image_serves_its_docs_from_where_it_copies_them() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert "docs" in _copied()
    found = re.search(r"WEBHOOKS_CONSOLE_DOCS_DIR=(\S+)", text)
    assert found is not None
    assert found.group(1) == "/app/docs"
    assert re.search(r"^WORKDIR /app$", text, re.M)
