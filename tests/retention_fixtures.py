"""The fixtures ``settings``, ``engine`` and ``sessions`` of the retention modules: their own
partition-mode database (:func:`tests.retention_support.retention_database`), not the suite's
shared one, whose other modules' days and leases a maintenance run would otherwise act on.

Imported by each retention module (fixtures found in a module's namespace override the
conftest's for that module only); not a plugin, or they would replace the suite's for all."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from core.settings import Settings


@pytest.fixture(scope="session", name="settings")
def retention_settings(retention_database: tuple[Settings, Engine, Any]) -> Settings:
    return retention_database[0]


@pytest.fixture(scope="session", name="engine")
def retention_engine(retention_database: tuple[Settings, Engine, Any]) -> Engine:
    return retention_database[1]


@pytest.fixture(scope="session", name="sessions")
def retention_sessions(
    retention_database: tuple[Settings, Engine, sessionmaker[Session]],
) -> sessionmaker[Session]:
    return retention_database[2]
