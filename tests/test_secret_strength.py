"""Secret strength (issue 11, finding 6): weak source secrets and admin tokens are refused with
a clear message before anything is written; ``--allow-weak-secret`` lets a short non-whsec
secret through and is audited; ``make .env`` writes a file only its owner can read."""

from __future__ import annotations

import base64
import getpass
import json
import os
import secrets
import stat
import subprocess
import uuid
from pathlib import Path

import pytest
from pydantic import ValidationError
from sqlalchemy import Engine, func, select, text
from sqlalchemy.orm import Session, sessionmaker

from core.crypto import SUPPLIED_KEY_FORMATS, SecretBox, generate_secret
from core.providers import BUILTIN_PROVIDERS as PROVIDERS
from core.providers import get_provider
from core.settings import Settings, SettingsError, load_settings
from core.token_strength import MIN_ADMIN_TOKEN_BITS, estimate_bits
from models import catalog
from models.catalog import CatalogError
from models.schema import Source, SourceSecret
from tests.conftest import BIN, make_settings, test_env
from tests.leakcheck import remember

ROOT = Path(__file__).resolve().parent.parent
WEAK_WHSEC = ("whsec_", "whsec_AA==", "whsec_" + base64.b64encode(b"\x01" * 23).decode())
STRONG_WHSEC = "whsec_" + base64.b64encode(b"twenty-four-bytes-key!!!").decode()  # 24 bytes
SHORT_GITHUB = "fifteen-chars!!"  # 15 characters


def webhooks(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "webhooks"), *args],
        env=test_env(**env),
        capture_output=True,
        text=True,
        timeout=60,
    )


def counts(engine: Engine) -> tuple[int, int, int]:
    with engine.connect() as conn:
        return tuple(  # type: ignore[return-value]
            int(conn.execute(text(f"SELECT count(*) FROM {table}")).scalar_one())  # noqa: S608
            for table in ("sources", "source_secrets", "audit_log")
        )


def weak_audits(engine: Engine, source_id: str) -> list[dict[str, object]]:
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT operator, action, reason, target, via FROM audit_log"
                " WHERE action = 'weak_secret' AND target->>'source' = :source ORDER BY id"
            ),
            {"source": source_id},
        ).mappings()
        return [dict(r) for r in rows]


def test_sanity_of_the_fixtures() -> None:
    assert len(SHORT_GITHUB) == 15
    assert len(base64.b64decode(STRONG_WHSEC.removeprefix("whsec_"))) == 24
    remember(STRONG_WHSEC, SHORT_GITHUB)


@pytest.mark.parametrize("provider", ["standard", "svix"])
@pytest.mark.parametrize("secret", WEAK_WHSEC)
def test_short_whsec_secrets_are_refused_on_create_and_nothing_is_written(
    engine: Engine, provider: str, secret: str
) -> None:
    before = counts(engine)
    for extra in ((), ("--allow-weak-secret",)):  # the flag does not lower the whsec minimum
        result = webhooks(
            "sources", "add", f"weak-{uuid.uuid4().hex[:8]}", "--provider", provider,
            "--secret", secret, *extra,
        )  # fmt: skip
        assert result.returncode == 1, result.stdout
        assert "at least 24 bytes" in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
    assert counts(engine) == before


@pytest.mark.parametrize("provider", ["standard", "svix"])
def test_short_whsec_secret_is_refused_on_rotation_and_a_24_byte_one_is_accepted(
    engine: Engine, provider: str
) -> None:
    added = webhooks(
        "sources", "add", f"strong-{uuid.uuid4().hex[:8]}", "--provider", provider,
        "--secret", STRONG_WHSEC, "--json",
    )  # fmt: skip
    assert added.returncode == 0, added.stderr
    source_id = json.loads(added.stdout)["id"]
    assert STRONG_WHSEC not in added.stdout
    before = counts(engine)
    for secret in WEAK_WHSEC:
        refused = webhooks("secrets", "add", source_id, "--secret", secret)
        assert refused.returncode == 1
        assert "at least 24 bytes" in refused.stderr, refused.stderr
    assert counts(engine) == before
    rotated = webhooks("secrets", "add", source_id, "--secret", STRONG_WHSEC)
    assert rotated.returncode == 0, rotated.stderr
    assert counts(engine)[1] == before[1] + 1
    assert weak_audits(engine, source_id) == []


def test_a_short_whsec_key_is_refused_whatever_the_providers_format(engine: Engine) -> None:
    """Issue 18, item 8: GitLab's secret format is text, but a whsec_ key is its signing token
    (Standard Webhooks): 10 characters of it were accepted. The whsec rule applies to it, with
    or without --allow-weak-secret; a 24-byte one, and GitLab's plain token, still pass."""
    name = f"gl-{uuid.uuid4().hex[:8]}"
    before = counts(engine)
    for extra in ((), ("--allow-weak-secret",)):
        refused = webhooks(
            "sources", "add", name, "--provider", "gitlab", "--secret", "whsec_abcd", *extra
        )
        assert refused.returncode == 1, refused.stdout
        assert "at least 24 bytes" in refused.stderr, refused.stderr
        assert "whsec_abcd" not in refused.stderr
    assert counts(engine) == before
    added = webhooks(
        "sources", "add", name, "--provider", "gitlab", "--secret", STRONG_WHSEC, "--json"
    )
    assert added.returncode == 0, added.stderr
    source_id = json.loads(added.stdout)["id"]
    again = webhooks("secrets", "add", source_id, "--secret", "whsec_abcd")
    assert (again.returncode, "at least 24 bytes" in again.stderr) == (1, True), again.stderr
    plain = webhooks("secrets", "add", source_id, "--secret", "gitlab-plain-token-ok")
    assert plain.returncode == 0, plain.stderr
    assert len("whsec_abcd") == 10
    # Stripe's keys are whsec_ + text (the whole string is the key): its own rule applies.
    assert catalog.check_secret_strength("stripe", generate_secret("stripe")) is False


def test_a_short_github_secret_is_refused_unless_allowed_and_then_audited(engine: Engine) -> None:
    name = f"gh-{uuid.uuid4().hex[:8]}"
    before = counts(engine)
    refused = webhooks("sources", "add", name, "--provider", "github", "--secret", SHORT_GITHUB)
    assert refused.returncode == 1
    assert "at least 16 characters" in refused.stderr, refused.stderr
    assert "--allow-weak-secret" in refused.stderr
    assert counts(engine) == before

    allowed = webhooks(
        "sources", "add", name, "--provider", "github", "--secret", SHORT_GITHUB,
        "--allow-weak-secret", "--json",
    )  # fmt: skip
    assert allowed.returncode == 0, allowed.stderr
    view = json.loads(allowed.stdout)
    assert "secret" not in view  # a secret we were given is not echoed
    # One source, one secret, and two audit rows: the source added, the weak secret allowed.
    assert counts(engine) == (before[0] + 1, before[1] + 1, before[2] + 2)
    audits = weak_audits(engine, view["id"])
    assert len(audits) == 1
    assert audits[0]["operator"] == getpass.getuser()
    assert audits[0]["reason"] == "weak secret allowed"
    assert audits[0]["target"]["secret"] == view["secret_id"]  # type: ignore[index]

    # Rotation: the same rule, the same audit.
    middle = counts(engine)
    again = webhooks("secrets", "add", view["id"], "--secret", "short")
    assert again.returncode == 1
    assert "at least 16 characters" in again.stderr
    assert counts(engine) == middle
    allowed_again = webhooks(
        "secrets", "add", view["id"], "--secret", "short-again", "--allow-weak-secret"
    )
    assert allowed_again.returncode == 0, allowed_again.stderr
    assert len(weak_audits(engine, view["id"])) == 2

    # A long enough secret with the flag is simply accepted: nothing weak to audit.
    strong = webhooks(
        "secrets", "add", view["id"], "--secret", "sixteen-chars-ok", "--allow-weak-secret"
    )
    assert strong.returncode == 0, strong.stderr
    assert len(weak_audits(engine, view["id"])) == 2


def test_the_check_runs_before_anything_is_flushed(
    sessions: sessionmaker[Session], settings: Settings
) -> None:
    """In the caller's own transaction too: nothing is added, not even uncommitted."""
    box = SecretBox(settings.secret_key.get_secret_value())
    with sessions() as session, session.begin():
        before = (
            session.scalar(select(func.count()).select_from(Source)),
            session.scalar(select(func.count()).select_from(SourceSecret)),
        )
        for provider, secret in (("standard", "whsec_AA=="), ("github", SHORT_GITHUB)):
            with pytest.raises(CatalogError):
                catalog.create_source(
                    session, box, settings, name=f"x-{uuid.uuid4().hex[:8]}",
                    provider=provider, secret=secret,
                )  # fmt: skip
        assert not session.new
        after = (
            session.scalar(select(func.count()).select_from(Source)),
            session.scalar(select(func.count()).select_from(SourceSecret)),
        )
        assert after == before
        session.rollback()


@pytest.mark.parametrize("provider", PROVIDERS)
def test_generated_secrets_pass_the_check(provider: str) -> None:
    if get_provider(provider).key_format in SUPPLIED_KEY_FORMATS:  # the sender issues it
        with pytest.raises(ValueError, match="issued by the sender"):
            generate_secret(provider)
        return
    made = {generate_secret(provider) for _ in range(20)}
    assert len(made) == 20  # random, from `secrets`
    for secret in made:
        assert catalog.check_secret_strength(provider, secret) is False
        if provider in ("standard", "svix"):
            assert len(base64.b64decode(secret.removeprefix("whsec_"))) >= 24
        else:
            assert len(secret) >= 16


def test_a_generated_secret_is_accepted_by_the_cli(engine: Engine) -> None:
    for provider in ("svix", "github"):
        added = webhooks(
            "sources", "add", f"gen-{uuid.uuid4().hex[:8]}", "--provider", provider, "--json"
        )
        assert added.returncode == 0, added.stderr
        view = json.loads(added.stdout)
        remember(view["secret"])
        assert weak_audits(engine, view["id"]) == []


def test_a_short_admin_token_is_refused_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(ValidationError) as direct:
        make_settings(admin_token="t" * 31)
    assert "WEBHOOKS_ADMIN_TOKEN" in str(direct.value)
    assert "32" in str(direct.value)

    # 32 random characters are enough; empty or unset means no admin API, as before.
    random32 = secrets.token_urlsafe(24)
    assert len(random32) == 32
    token = make_settings(admin_token=random32).admin_token
    assert token is not None
    assert token.get_secret_value() == random32
    empty = make_settings(admin_token="").admin_token
    assert empty is not None
    assert empty.get_secret_value() == ""
    assert make_settings().admin_token is None

    # From the environment, as processes load it: the message names the variable, never the
    # value.
    monkeypatch.setenv("WEBHOOKS_ADMIN_TOKEN", "short-token")
    with pytest.raises(SettingsError) as loaded:
        load_settings()
    assert "WEBHOOKS_ADMIN_TOKEN" in str(loaded.value)
    assert "short-token" not in str(loaded.value)


def test_a_short_admin_token_stops_the_cli_at_start() -> None:
    result = webhooks("sources", "list", WEBHOOKS_ADMIN_TOKEN="too-short")
    assert result.returncode == 1
    assert "WEBHOOKS_ADMIN_TOKEN" in result.stderr
    assert "Traceback" not in result.stderr


def test_make_env_writes_a_file_only_its_owner_can_read(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WEBHOOKS_")}
    result = subprocess.run(
        ["make", "-s", "-f", str(ROOT / "Makefile"), "-C", str(tmp_path), ".env",
         "PYTHON=python3"],
        env={**env, "MAKEFLAGS": ""},
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    written = tmp_path / ".env"
    assert stat.S_IMODE(written.stat().st_mode) == 0o600
    values = dict(line.split("=", 1) for line in written.read_text().splitlines())
    assert {"WEBHOOKS_SECRET_KEY", "WEBHOOKS_ADMIN_TOKENS"} <= set(values)
    name, token = values["WEBHOOKS_ADMIN_TOKENS"].split(":", 1)  # a named token: ops
    assert name == "ops"
    assert len(token) >= 32
    # The settings take it, its entropy estimate well above the floor.
    made = make_settings(admin_tokens=values["WEBHOOKS_ADMIN_TOKENS"])
    assert list(made.admin_tokens_by_name()) == ["ops"]
    assert estimate_bits(token) >= 1.5 * MIN_ADMIN_TOKEN_BITS
    assert len(values["WEBHOOKS_SECRET_KEY"]) >= 32


def test_a_refused_setting_is_never_quoted_in_the_error() -> None:
    """Built directly (not through load_settings), a refused secret still never appears in
    the error's text, which may reach a log line."""
    import pydantic

    from core.settings import Settings

    short = "tooshort-but-secret-" + "q" * 5
    with pytest.raises(pydantic.ValidationError) as refused:
        Settings(secret_key="k" * 40, admin_token=short)  # type: ignore[arg-type]
    assert short not in str(refused.value)
    with pytest.raises(pydantic.ValidationError) as refused_key:
        Settings(secret_key=short)  # type: ignore[arg-type]
    assert short not in str(refused_key.value)


# Issue 34 item 7: length alone let these through (each has 32+ characters).
PREDICTABLE = (
    "a" * 40,
    "passwordpasswordpassword12345678",
    "abcdefghijklmnopqrstuvwxyz0123456789",
    "Tr0ub4dor&3Tr0ub4dor&3Tr0ub4dor&3",
    "adm_e2e_" + "t" * 24,
)


@pytest.mark.parametrize("token", PREDICTABLE)
def test_a_predictable_admin_token_is_refused_by_name_never_quoted(token: str) -> None:
    assert len(token) >= 32
    base = {k: getattr(make_settings(), k) for k in ("database_url", "secret_key")}
    with pytest.raises(SettingsError) as single:
        load_settings(**base, admin_token=token)
    with pytest.raises(SettingsError) as named:
        load_settings(**base, admin_tokens=f"ci:{secrets.token_urlsafe(32)},ops:{token}")
    for refused, who in ((single, "WEBHOOKS_ADMIN_TOKEN:"), (named, "the token named 'ops'")):
        text = str(refused.value)
        assert who in text, text
        assert "too predictable" in text
        assert f"at least {MIN_ADMIN_TOKEN_BITS} expected" in text
        assert "secrets.token_urlsafe(32)" in text  # how to make a good one
        assert token not in text
        assert token[:12] not in text
        assert "'ci'" not in text  # the good one is not blamed


def test_a_predictable_admin_token_stops_the_cli_at_start() -> None:
    result = webhooks("sources", "list", WEBHOOKS_ADMIN_TOKENS="ops:" + "a" * 40)
    assert result.returncode == 1
    assert "the token named 'ops'" in result.stderr
    assert "too predictable" in result.stderr
    assert "a" * 40 not in result.stderr
    assert "Traceback" not in result.stderr


def test_random_tokens_pass_the_estimate_with_margin() -> None:
    """What ``make .env`` generates (``secrets.token_urlsafe(32)``) and the forms the suite and
    the docs use pass with room to spare; the predictable ones score far below."""
    generated = [estimate_bits(secrets.token_urlsafe(32)) for _ in range(2000)]
    assert min(generated) >= 1.5 * MIN_ADMIN_TOKEN_BITS, min(generated)
    hexes = [estimate_bits(uuid.uuid4().hex + uuid.uuid4().hex) for _ in range(200)]
    assert min(hexes) >= 1.5 * MIN_ADMIN_TOKEN_BITS
    for token in PREDICTABLE:
        assert estimate_bits(token) < MIN_ADMIN_TOKEN_BITS / 1.5, token
    make_settings(admin_tokens=f"ops:{secrets.token_urlsafe(32)}")  # accepted
