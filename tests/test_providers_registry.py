"""The provider registry (issue 13): built-ins, plug-in loading and its errors, the CLI listing,
and that nothing else keeps its own list of providers."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import uuid
from datetime import timedelta
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest
from sqlalchemy import Engine, text

from core.crypto import SUPPLIED_KEY_FORMATS, generate_secret
from core.providers import BUILTIN_PROVIDERS, Provider, ProviderPluginError, registry
from core.providers.base import AUTH_REASONS
from core.settings import Settings
from core.ttl import TtlOverrides, derive_ttl, known_providers
from tests.conftest import BIN, make_settings, test_env

ROOT = Path(__file__).resolve().parent.parent
GROUP = registry.ENTRY_POINT_GROUP


def ep(name: str, value: str) -> EntryPoint:
    return EntryPoint(name=name, value=value, group=GROUP)


def test_builtins_are_registered_in_listing_order_with_a_whole_contract() -> None:
    found = registry.load(discover=list)
    assert tuple(found) == BUILTIN_PROVIDERS
    assert set(BUILTIN_PROVIDERS) <= set(known_providers())
    for name, provider in found.items():
        assert isinstance(provider, Provider)
        assert provider.name == name
        assert provider.retry_window > timedelta(0), name
        assert provider.citation.strip(), name
        assert provider.signed.strip(), name
        assert provider.summary.strip(), name


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (ep("nope", "no_such_module_xyz:PROVIDER"), "cannot be loaded: ModuleNotFoundError"),
        (ep("nope", "os:sep"), "is a str, not an core.providers.Provider"),
        (ep("other", "core.providers.github:PROVIDER"), "entry point's name must be"),
        (ep("stripe", "core.providers.stripe:PROVIDER"), "reuses the name"),
        (ep("boom", "builtins:dict.fromkeys"), "failed to build its provider"),
    ],
)
def test_a_broken_plugin_is_a_clear_error_naming_it(entry: EntryPoint, message: str) -> None:
    with pytest.raises(ProviderPluginError, match=message) as caught:
        registry.load(discover=lambda: [entry])
    assert repr(entry.name) in str(caught.value)
    assert entry.value in str(caught.value)


def test_a_plugin_provider_object_or_factory_is_registered() -> None:
    github = registry.get("github")
    renamed = Provider(
        name="acme",
        authenticate=github.authenticate,
        extract=github.extract,
        retry_window=timedelta(hours=1),
        citation="https://acme.example/webhooks",
        signed="body only",
        tolerance=None,
    )
    here = sys.modules[__name__]
    here.ACME = renamed  # type: ignore[attr-defined]
    here.make_acme = lambda: renamed  # type: ignore[attr-defined]
    for value in (f"{__name__}:ACME", f"{__name__}:make_acme"):
        found = registry.load(discover=lambda v=value: [ep("acme", v)])  # type: ignore[misc]
        assert found["acme"] is renamed
        assert tuple(found)[-1] == "acme"


def test_unknown_provider_names_every_known_one() -> None:
    with pytest.raises(registry.UnknownProvider, match="unknown provider 'paypal'; one of stripe"):
        registry.get("paypal")


@pytest.mark.parametrize("provider", BUILTIN_PROVIDERS)
def test_generated_secrets_follow_the_registry_key_format(provider: str) -> None:
    found = registry.get(provider)
    if found.key_format in SUPPLIED_KEY_FORMATS:  # public keys, Adyen's hex key: never made
        with pytest.raises(ValueError, match="issued by the sender"):
            generate_secret(provider)
        return
    secret = generate_secret(provider)
    if found.key_format == "whsec":
        assert secret.startswith("whsec_")
    assert secret.startswith(found.key_prefix)


def test_models_do_not_import_ingest_and_nothing_else_lists_providers() -> None:
    for path in sorted((ROOT / "models").rglob("*.py")):
        text = path.read_text()
        assert not re.search(r"^\s*(from|import) ingest\b", text, re.M), path
    # The old lists are gone: a provider is added in its module and the registry only.
    for path in ("models/schema.py", "core/ttl.py", "core/crypto.py", "models/catalog.py"):
        text = (ROOT / path).read_text()
        assert '"shopify"' not in text, path
        assert "PROVIDERS" not in text, path


def test_reasons_are_metric_safe() -> None:
    assert all(r.isidentifier() for r in AUTH_REASONS)


def test_providers_list_shows_each_contract_and_the_ttl_that_follows() -> None:
    result = subprocess.run(
        [str(BIN / "webhooks"), "providers", "list", "--json"],
        env=test_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    views = {v["name"]: v for v in json.loads(result.stdout)}
    assert tuple(views)[: len(BUILTIN_PROVIDERS)] == BUILTIN_PROVIDERS
    settings = make_settings()
    for name in BUILTIN_PROVIDERS:
        provider, view = registry.get(name), views[name]
        assert view["signed"] == provider.signed
        assert view["citation"] == provider.citation
        assert view["retry_window_s"] == provider.retry_window.total_seconds()
        ttl = derive_ttl(name, TtlOverrides(), settings)
        assert view["dedup_ttl_s"] == ttl.total.total_seconds()
        assert view["dedup_ttl_s"] > view["retry_window_s"]
    assert views["github"]["tolerance_s"] is None
    assert views["stripe"]["tolerance_s"] == 300
    assert views["hmac"]["tolerance"] == "by config"

    human = subprocess.run(
        [str(BIN / "webhooks"), "providers", "list", "--wide"],  # issue 20: prose is --wide
        env={**test_env(), "COLUMNS": "400"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert human.returncode == 0, human.stderr
    for name in BUILTIN_PROVIDERS:
        assert name in human.stdout
    assert "https://docs.svix.com/retries" in human.stdout


def test_the_readme_table_lists_every_provider_with_its_figures() -> None:
    from core.durations import format_duration

    readme = (ROOT / "docs" / "providers.md").read_text()  # the README's providers table
    settings = make_settings()
    for name in BUILTIN_PROVIDERS:
        provider = registry.get(name)
        row = next((line for line in readme.splitlines() if line.startswith(f"| `{name}` |")), "")
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert len(cells) == 6, f"README has no providers-table row for {name}"
        assert cells[1] == provider.signed, name
        assert cells[3] == format_duration(provider.retry_window), name
        ttl = derive_ttl(name, TtlOverrides(), settings).total
        assert cells[4] == format_duration(ttl), name


def test_a_source_whose_plugin_is_gone_is_listed_and_does_not_stop_a_process(
    engine: Engine, settings: Settings
) -> None:
    from models import catalog

    public = f"src_gone{uuid.uuid4().hex[:12]}"
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO sources (public_id, name, provider) "
                "VALUES (:p, :p, 'uninstalled_plugin')"
            ),
            {"p": public},
        )
    try:
        catalog.report_raised_ttls(engine, settings, process="test")  # warns, never raises
        listed = subprocess.run(
            [str(BIN / "webhooks"), "sources", "list", "--json"],
            env=test_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert listed.returncode == 0, listed.stderr
        view = next(v for v in json.loads(listed.stdout) if v["id"] == public)
        assert "'uninstalled_plugin' is not installed" in view["warning"]
    finally:
        with engine.begin() as conn:
            conn.execute(text("DELETE FROM sources WHERE public_id = :p"), {"p": public})
