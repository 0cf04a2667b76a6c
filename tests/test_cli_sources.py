"""The ``webhooks sources|secrets|routes`` commands, run as a user runs them (subprocess)."""

from __future__ import annotations

import json
import subprocess
import uuid
from functools import partial
from typing import Any

from sqlalchemy import Engine, text

from tests.conftest import BIN, run_each, test_env
from tests.leakcheck import remember


def webhooks(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "webhooks"), *args], env=test_env(), capture_output=True, text=True, timeout=60
    )


def count(engine: Engine, table: str) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text(f"SELECT count(*) FROM {table}")).scalar_one())  # noqa: S608


def test_source_lifecycle_prints_the_secret_once_and_never_again(engine: Engine) -> None:
    name = f"cli-{uuid.uuid4().hex[:8]}"
    added = webhooks(
        "sources", "add", name, "--provider", "standard", "--account", "acme", "--json"
    )
    assert added.returncode == 0, added.stderr
    view = json.loads(added.stdout)
    secret = view["secret"]
    remember(secret)
    assert secret.startswith("whsec_")
    assert view["id"].startswith("src_")
    assert view["url_path"] == f"/webhooks/{view['id']}"

    human = webhooks(
        "sources", "add", f"{name}-2", "--provider", "github", "--secret", "given-secret-value"
    )
    assert human.returncode == 0
    assert "given-secret-value" not in human.stdout  # a secret we were given is not echoed

    for args in (
        ("sources", "list"),
        ("sources", "list", "--json"),
        ("sources", "show", view["id"]),
        ("sources", "show", view["id"], "--json"),
        ("secrets", "list", view["id"], "--json"),
    ):
        result = webhooks(*args)
        assert result.returncode == 0, (args, result.stderr)
        assert secret not in result.stdout
        assert "given-secret-value" not in result.stdout

    shown = json.loads(webhooks("sources", "show", view["id"], "--json").stdout)
    assert shown["account"] == "acme"
    assert [s["id"] for s in shown["secrets"]] == [view["secret_id"]]


def test_secret_rotation_commands(engine: Engine) -> None:
    view = json.loads(
        webhooks(
            "sources", "add", f"rot-{uuid.uuid4().hex[:8]}", "--provider", "stripe", "--json"
        ).stdout
    )
    remember(view["secret"])
    added = webhooks("secrets", "add", view["id"])
    assert added.returncode == 0
    new_id = next(
        line.split()[-1] for line in added.stdout.splitlines() if line.startswith("secret id")
    )
    revoked = webhooks("secrets", "revoke", view["id"], view["secret_id"])
    assert revoked.returncode == 0
    listed = json.loads(webhooks("secrets", "list", view["id"], "--json").stdout)
    assert {s["id"]: s["revoked_at"] is not None for s in listed} == {
        view["secret_id"]: True,
        new_id: False,
    }
    again = webhooks("secrets", "revoke", view["id"], view["secret_id"])
    assert again.returncode == 1
    assert "no active secret" in again.stderr


def _revocations(engine: Engine, secret_id: str) -> list[Any]:
    with engine.connect() as conn:
        return list(
            conn.execute(
                text(
                    "SELECT operator, target, at, reason, via FROM audit_log"
                    " WHERE action = 'secret.revoke' AND target->>'secret' = :s"
                ),
                {"s": secret_id},
            ).all()
        )


def test_revoking_a_secret_is_audited_who_which_and_when(engine: Engine) -> None:
    view = json.loads(
        webhooks(
            "sources", "add", f"rev-{uuid.uuid4().hex[:8]}", "--provider", "stripe", "--json"
        ).stdout
    )
    remember(view["secret"])
    assert webhooks("secrets", "add", view["id"]).returncode == 0
    revoked = webhooks(
        "secrets", "revoke", view["id"], view["secret_id"], "--operator", "alice",
        "--reason", "leaked in a CI log",
    )  # fmt: skip
    assert revoked.returncode == 0, revoked.stderr
    [(operator, target, at, reason, via)] = _revocations(engine, view["secret_id"])
    assert operator == "alice"
    assert target == {"source": view["id"], "provider": "stripe", "secret": view["secret_id"]}
    assert reason == "leaked in a CI log"
    assert via == "cli"
    listed = json.loads(webhooks("secrets", "list", view["id"], "--json").stdout)
    [revoked_at] = [s["revoked_at"] for s in listed if s["id"] == view["secret_id"]]
    assert at.isoformat().replace("+00:00", "Z") == revoked_at.replace("+00:00", "Z")
    shown = json.loads(webhooks("audit", "list", "--action", "secret", "--json").stdout)
    assert any(a["target"].get("secret") == view["secret_id"] for a in shown)
    assert view["secret"] not in revoked.stdout + json.dumps(shown)  # ids only, never the secret
    # Refused (already revoked): nothing changes, no second audit row.
    again = webhooks("secrets", "revoke", view["id"], view["secret_id"])
    assert again.returncode == 1
    assert len(_revocations(engine, view["secret_id"])) == 1


def test_routes_add_with_glob_and_forward_options(engine: Engine) -> None:
    view = json.loads(
        webhooks(
            "sources", "add", f"rt-{uuid.uuid4().hex[:8]}", "--provider", "stripe", "--json"
        ).stdout
    )
    remember(view["secret"])
    route = webhooks(
        "routes", "add", view["id"], "--handler", "log", "--events", "invoice.*", "--json"
    )
    assert route.returncode == 0, route.stderr
    assert json.loads(route.stdout)["events"] == "invoice.*"
    forward = webhooks(
        "routes",
        "add",
        view["id"],
        "--handler",
        "forward",
        "--option",
        "url=http://127.0.0.1:9/hook",
        "--option",
        "allow_private=true",
        "--json",
    )
    assert forward.returncode == 0, forward.stderr
    created = json.loads(forward.stdout)
    remember(created["signing_secret"])
    assert created["options"] == {"url": "http://127.0.0.1:9/hook", "allow_private": "true"}
    assert created["signing_secret"].startswith("whsec_")
    listed = webhooks("routes", "list", view["id"], "--json")
    assert created["signing_secret"] not in listed.stdout
    assert [r["handler"] for r in json.loads(listed.stdout)] == ["log", "forward"]


def _forward(source: str, *options: str) -> tuple[str, ...]:
    pairs = [arg for option in options for arg in ("--option", option)]
    return ("routes", "add", source, "--handler", "forward", *pairs)


def test_bad_input_is_a_clear_error_and_changes_nothing(engine: Engine) -> None:
    view = json.loads(
        webhooks(
            "sources", "add", f"bad-{uuid.uuid4().hex[:8]}", "--provider", "shopify", "--json"
        ).stdout
    )
    remember(view["secret"])
    sources, routes = count(engine, "sources"), count(engine, "routes")
    cases = [
        (("sources", "add", "x", "--provider", "paypal"), "unknown provider"),
        # Issue 20: a capital letter or a typo gets the likely name, as handlers do.
        (("sources", "add", "x", "--provider", "Stripe"), "did you mean 'stripe'?"),
        (("sources", "add", "x", "--provider", "githbu"), "did you mean 'github'?"),
        (("sources", "add", "x", "--provider", "stripe", "--queue-lag", "soon"), "not a duration"),
        (
            (
                "sources",
                "add",
                "x",
                "--provider",
                "stripe",
                "--queue-lag",
                "0s",
                "--clock-skew",
                "0s",
                "--replay-grace",
                "0s",
            ),
            "not above",
        ),
        (("sources", "add", "x", "--provider", "hmac", "--config", "algorithm=md5"), "algorithm"),
        (("routes", "add", view["id"], "--handler", "forward"), "url="),
        # Issue 18, item 7: addresses a forward may not reach, refused when the route is made.
        (_forward(view["id"], "url=http://127.0.0.1:8001/admin"), "allow_private=true"),
        (_forward(view["id"], "url=https://10.1.2.3/h"), "a private address"),
        (_forward(view["id"], "url=https://[fe80::1]/h", "allow_private=true"), "link-local"),
        (
            _forward(view["id"], "url=http://169.254.169.254/latest", "allow_private=true"),
            "cloud metadata",
        ),
        (_forward(view["id"], "url=https://h.example/h", "allow_private=maybe"), "true or false"),
        (("routes", "add", view["id"], "--handler", "log", "--option", "novalue"), "KEY=VALUE"),
        (("routes", "add", "src_nope", "--handler", "log"), "no such source"),
        (("sources", "show", "src_nope"), "no such source"),
    ]
    results = run_each(partial(webhooks, *args) for args, _ in cases)
    for (args, message), result in zip(cases, results, strict=True):
        assert result.returncode == 1, (args, result.stdout)
        assert message in result.stderr, (args, result.stderr)
        assert "Traceback" not in result.stderr
        # Issue 36 item 4: the error names the docs section on sources and routes.
        doc = "docs/routing.md" if args[0] == "routes" else "docs/providers.md#providers"
        assert result.stderr.rstrip().endswith(f"(see {doc})"), args
    assert (count(engine, "sources"), count(engine, "routes")) == (sources, routes)
