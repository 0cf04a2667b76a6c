"""Reconciliation's client (issue 34 item 4, a security review's findings): each provider's
client (GitHub over httpx, the ``stripe`` and ``svix`` libraries) against a real fake API on
loopback that goes bad: a redirect to another host, a body over the size cap (declared or
not), a body that trickles, an answer that never starts, a TLS handshake that never ends, and
an ``api_base`` whose name resolves off loopback (plain http) or to a private or metadata
address. The only stand-in is the resolver, where a test needs a name to resolve to an
address this machine cannot serve."""

from __future__ import annotations

import ipaddress
import json
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any, BinaryIO
from urllib.parse import urlsplit

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session, sessionmaker

from core import outbound
from core.settings import Settings
from tasks.reconcile import transport
from tasks.reconcile.paging import ApiError, Page, Unreachable
from tests.conftest import test_env
from tests.factories import make_source
from tests.fake_providers import FakeStripe, Seen, Streamed, serving
from tests.leakcheck import remember
from tests.operators_support import cli

PROVIDERS = ("stripe", "github", "svix")
HOOK = "repos/octo/hello/hooks/42"
CAP = transport.MAX_RESPONSE_BYTES


PREFIX = {"stripe": "rk_test", "github": "ghp", "svix": "sk"}


def _token(provider: str) -> str:
    token = f"{PREFIX[provider]}_{uuid.uuid4().hex}"
    remember(token)
    return token


def _fetcher(
    provider: str, token: str, base: str, *, allow_private: bool = False
) -> Callable[[str | None], Page]:
    """The provider's listing, as a run makes it (tasks.reconcile.run.fetcher)."""
    from tasks.reconcile.github_api import deliveries_fetcher
    from tasks.reconcile.stripe_api import events_fetcher
    from tasks.reconcile.svix_api import messages_fetcher

    since = datetime.now(UTC) - timedelta(hours=1)
    if provider == "stripe":
        return events_fetcher(token, base, since, "we_1Recon", allow_private=allow_private)
    if provider == "github":
        return deliveries_fetcher(token, base, HOOK, since, allow_private=allow_private)
    return messages_fetcher(token, base, "app_x", since, allow_private=allow_private)


def _valid(path: str) -> Any:
    """A well-formed, empty answer to whatever the provider's listing asks first."""
    if path.startswith("/v1/webhook_endpoints/"):
        return {"id": "we_1Recon", "object": "webhook_endpoint", "enabled_events": ["*"]}
    if path == "/v1/events":
        return {"object": "list", "url": "/v1/events", "has_more": False, "data": []}
    if path.startswith("/api/v1/app/"):
        return {"data": [], "iterator": None, "prevIterator": None, "done": True}
    return []  # GitHub's deliveries


class Hostile:
    """A provider API gone bad: every request is recorded, then answered by ``behaviour``
    (method, path) -> (status, headers, body: JSON or :class:`Streamed`)."""

    def __init__(self, token: str, behaviour: Callable[[str, str], Any]) -> None:
        self.token = token
        self.behaviour = behaviour
        self.seen: list[Seen] = []
        self.lock = threading.Lock()
        self.url = ""

    def answer(
        self, method: str, path: str, query: dict[str, list[str]], auth: str | None
    ) -> tuple[int, dict[str, str], Any]:
        with self.lock:
            self.seen.append(
                Seen(method, path, query, time.monotonic(), auth == f"Bearer {self.token}")
            )
        status, headers, body = self.behaviour(method, path)
        return status, headers, body


def _recorder(token: str) -> Hostile:
    """A well-behaved API: answers each listing's first request with an empty page."""
    return Hostile(token, lambda _method, path: (200, {}, _valid(path)))


class Padded:
    """A body of ``total`` bytes: the answer's JSON, then spaces (still JSON). ``sent`` counts
    what the server could write before the client closed the connection; ``done`` is set when
    it stopped writing."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.sent = 0
        self.done = threading.Event()

    def body(self, path: str, *, declared: bool) -> Streamed:
        doc = json.dumps(_valid(path)).encode()

        def write(out: BinaryIO) -> None:
            chunk = b" " * 65536
            try:
                out.write(doc)
                self.sent += len(doc)
                while self.sent < self.total:
                    piece = chunk[: self.total - self.sent]
                    out.write(piece)
                    self.sent += len(piece)
            except OSError:  # the client stopped reading and closed the connection
                pass
            finally:
                self.done.set()

        return Streamed(write, self.total if declared else None)


class StandInDns:
    """The resolver's stand-in: ``answers[name]`` are the addresses ``name`` resolves to."""

    def __init__(self, answers: dict[str, list[str]]) -> None:
        self.answers = answers
        self.lookups: list[str] = []

    def __call__(self, host: str, port: int) -> list[Any]:
        self.lookups.append(host)
        return [ipaddress.ip_address(a) for a in self.answers[host]]


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A loopback port whose connections the kernel accepts (the listen backlog) and nobody
    ever answers: no HTTP answer, no TLS handshake."""
    server = socket.create_server(("127.0.0.1", 0), backlog=16)
    try:
        yield int(server.getsockname()[1])
    finally:
        server.close()


# Redirects ------------------------------------------------------------------------------------


@pytest.mark.parametrize("provider", PROVIDERS)
def test_no_client_follows_a_redirect_to_another_host(provider: str) -> None:
    """The API answers 302 to another plain-http host: an error naming the status, the key
    never in it, and the other host never asked (the stripe library's default client, requests,
    followed such a redirect before)."""
    token = _token(provider)
    elsewhere = _recorder(token)
    with serving(elsewhere):
        moved = f"http://localhost:{urlsplit(elsewhere.url).port}"

        def redirect(_method: str, path: str) -> tuple[int, dict[str, str], Any]:
            return 302, {"Location": f"{moved}{path}"}, {"moved": "elsewhere"}

        api = Hostile(token, redirect)
        with serving(api):
            with pytest.raises(ApiError) as refused:
                _fetcher(provider, token, api.url)(None)
            assert len(api.seen) == 1
            if provider == "github":
                from tasks.reconcile.github_api import redeliver

                with pytest.raises(ApiError) as also:
                    redeliver(token, api.url, HOOK, "1")
                assert also.value.status == 302
            if provider == "svix":
                from tasks.reconcile.svix_api import recover

                with pytest.raises(ApiError) as also:
                    recover(token, api.url, "app_x", "ep_x", datetime.now(UTC))
                assert also.value.status == 302
    assert elsewhere.seen == []
    assert not isinstance(refused.value, Unreachable)  # not tried again
    assert refused.value.status == 302
    message = str(refused.value)
    assert "answered a redirect (302): refused" in message
    assert token not in message
    assert "elsewhere" not in message  # nothing of the API's body


# The size cap ---------------------------------------------------------------------------------


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "until-close"])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_a_body_over_the_cap_is_refused_without_being_read_whole(
    provider: str, declared: bool
) -> None:
    """A valid answer padded to 8 times the cap: refused with a clear error (the cap in it),
    whether the length is declared (refused before the body is read) or the body just goes on;
    the client closes the connection instead of reading the rest, so the server cannot write
    it all."""
    token = _token(provider)
    padded = Padded(8 * CAP)
    api = Hostile(token, lambda _m, path: (200, {}, padded.body(path, declared=declared)))
    with serving(api):
        with pytest.raises(ApiError) as refused:
            _fetcher(provider, token, api.url)(None)
        assert padded.done.wait(10)
    assert refused.value.status == 200
    assert f"answered a body larger than {CAP // (1024 * 1024)} MiB: refused" in str(refused.value)
    assert padded.sent < padded.total // 2
    assert len(api.seen) == 1


def test_a_body_at_the_cap_is_read() -> None:
    """The cap refuses what is over it, not what reaches it."""
    token = _token("github")
    padded = Padded(CAP)
    api = Hostile(token, lambda _m, path: (200, {}, padded.body(path, declared=False)))
    with serving(api):
        page = _fetcher("github", token, api.url)(None)
    assert page.events == []
    assert padded.sent == CAP


def test_a_compressed_body_is_refused_and_identity_is_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A body's compressed size says nothing about what it decodes to: the client asks for
    none (Accept-Encoding: identity) and refuses an encoded one."""
    import tests.fake_providers as fakes

    token = _token("github")
    asked: list[str | None] = []
    serve = fakes._Handler.do_GET

    def spy(handler: Any) -> None:
        asked.append(handler.headers.get("Accept-Encoding"))
        serve(handler)

    monkeypatch.setattr(fakes._Handler, "do_GET", spy)
    api = Hostile(token, lambda _m, _p: (200, {"Content-Encoding": "gzip"}, []))
    with serving(api), pytest.raises(ApiError) as refused:
        _fetcher("github", token, api.url)(None)
    assert "answered an encoded body (gzip) it was not asked for" in str(refused.value)
    assert asked == ["identity"]


# Time -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("provider", PROVIDERS)
def test_a_trickling_body_is_cut_at_the_calls_timeout(
    provider: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each read gets a byte in time, so a per-read timeout never fires; the call's own
    deadline (here 1 s) does. The body would take 10 s."""
    monkeypatch.setattr(transport, "CALL_TIMEOUT", 1.0)
    token = _token(provider)
    stop = threading.Event()

    def trickle(_method: str, path: str) -> tuple[int, dict[str, str], Any]:
        doc = json.dumps(_valid(path)).encode().ljust(200)

        def write(out: BinaryIO) -> None:
            for byte in doc:
                if stop.wait(0.05):
                    return
                try:
                    out.write(bytes([byte]))
                except OSError:
                    return

        return 200, {}, Streamed(write, len(doc))

    api = Hostile(token, trickle)
    with serving(api):
        try:
            started = time.monotonic()
            with pytest.raises(ApiError) as late:
                _fetcher(provider, token, api.url)(None)
            took = time.monotonic() - started
        finally:
            stop.set()
    assert str(late.value).endswith("did not answer within 1 s")
    assert late.value.status is None
    assert not isinstance(late.value, Unreachable)
    assert 1.0 <= took < 4.0


@pytest.mark.parametrize("scheme", ["http", "https"], ids=["no-answer", "no-tls-handshake"])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_an_api_that_never_answers_or_never_finishes_tls_is_cut_at_the_calls_timeout(
    provider: str, scheme: str, silent_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The connection is accepted and nothing ever comes back: over http the answer never
    starts (the read), over https the handshake never ends (the connect). Both within the
    call's timeout."""
    monkeypatch.setattr(transport, "CALL_TIMEOUT", 1.0)
    token = _token(provider)
    started = time.monotonic()
    with pytest.raises(ApiError) as late:
        _fetcher(provider, token, f"{scheme}://127.0.0.1:{silent_port}")(None)
    took = time.monotonic() - started
    assert str(late.value).endswith("did not answer within 1 s")
    assert 1.0 <= took < 4.0


# Addresses ------------------------------------------------------------------------------------


@pytest.mark.parametrize("provider", PROVIDERS)
def test_plain_http_to_a_name_resolving_off_loopback_is_refused_at_connect_time(
    provider: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``http://localhost:PORT`` passes when it is set (localhost is loopback); when the
    connection is made the name resolves to a private address: refused before connecting,
    whatever allow_private says (the key would cross a network in clear). Once it resolves
    to loopback again, the same base reaches the API."""
    token = _token(provider)
    api = _recorder(token)
    with serving(api):
        base = f"http://localhost:{urlsplit(api.url).port}"
        dns = StandInDns({"localhost": ["10.20.30.40"]})
        monkeypatch.setattr(outbound, "resolve", dns)
        for allow_private in (False, True):
            with pytest.raises(ApiError) as refused:
                _fetcher(provider, token, base, allow_private=allow_private)(None)
            assert "plain http to an address that is not loopback: refused" in str(refused.value)
            assert refused.value.status is None
            assert not isinstance(refused.value, Unreachable)
        assert dns.lookups == ["localhost", "localhost"]
        assert api.seen == []

        dns.answers["localhost"] = ["::ffff:10.20.30.40", "127.0.0.1"]  # one off loopback
        with pytest.raises(ApiError):
            _fetcher(provider, token, base)(None)
        assert api.seen == []

        dns.answers["localhost"] = ["127.0.0.1"]
        page = _fetcher(provider, token, base)(None)
    assert page.events == []
    assert len(api.seen) >= 1
    assert all(s.authorised for s in api.seen)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_https_to_a_private_or_metadata_address_is_refused_at_connect_time(
    provider: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A name resolving to a private address is refused unless the source allows private
    addresses; to a metadata or link-local address whatever it allows. Nothing is connected."""
    monkeypatch.setattr(transport, "CALL_TIMEOUT", 1.0)
    token = _token(provider)
    dns = StandInDns(
        {
            "api.internal.test": ["192.168.7.20"],
            "meta.test": ["169.254.169.254"],
            "linklocal.test": ["fe80::1"],
        }
    )
    monkeypatch.setattr(outbound, "resolve", dns)
    with pytest.raises(ApiError) as private:
        _fetcher(provider, token, "https://api.internal.test:8443")(None)
    assert "private address: refused unless the source sets --config allow_private=true" in (
        str(private.value)
    )
    for name, says in (("meta.test", "cloud metadata"), ("linklocal.test", "link-local")):
        with pytest.raises(ApiError) as refused:
            _fetcher(provider, token, f"https://{name}", allow_private=True)(None)
        assert f"api_base is a {says} address: refused whatever" in str(refused.value)
    assert token not in str(private.value)
    assert dns.lookups == ["api.internal.test", "meta.test", "linklocal.test"]


def test_a_private_address_the_source_allows_is_connected_to(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With allow_private the guard lets a private address through: the call goes (to a
    documentation address nothing answers, so it ends as not answered, not as refused)."""
    monkeypatch.setattr(transport, "CALL_TIMEOUT", 1.0)
    monkeypatch.setattr(outbound, "resolve", StandInDns({"api.internal.test": ["192.0.2.1"]}))
    token = _token("github")
    with pytest.raises(ApiError) as failed:
        _fetcher("github", token, "https://api.internal.test:8443", allow_private=True)(None)
    assert "did not answer" in str(failed.value)
    assert "refused" not in str(failed.value)


# Through the CLI ------------------------------------------------------------------------------


def test_api_base_is_judged_when_set_and_a_refusal_changes_nothing(
    sessions: sessionmaker[Session], settings: Settings
) -> None:
    """``sources update --config api_base=...``: a metadata host or address, a link-local
    one and a private one (without allow_private) are refused in one line naming the class,
    and nothing changes; allow_private=true lets the private one be set; loopback over plain
    http still may be."""
    env = test_env()
    made = make_source(sessions, settings, provider="github")
    remember(made.secret)
    key = _token("github")
    for config, says in (
        ("api_base=https://169.254.169.254", "api_base is a cloud metadata address"),
        ("api_base=https://metadata.google.internal", "api_base is a cloud metadata host"),
        ("api_base=https://[fe80::1]:8443", "api_base is a link-local address"),
        ("api_base=https://10.1.2.3", "api_base is a private address: refused unless"),
        ("api_base=http://10.1.2.3", "plain http is allowed only to loopback"),
        ("allow_private=maybe", "option allow_private must be true or false"),
    ):
        bad = cli(
            "sources", "update", made.name, "--api-key", key, "--config", config, env=env
        )  # fmt: skip
        assert bad.returncode == 1, config
        assert says in bad.stderr, (config, bad.stderr)
        assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr
        assert key not in bad.stdout + bad.stderr
    shown = json.loads(cli("sources", "show", made.name, "--json", env=env).stdout)
    assert shown["config"] == {}
    assert shown["reconcile"]["api_key"] == "not set"  # not even the key given with them

    ok = cli(
        "sources", "update", made.name, "--config", "api_base=https://10.1.2.3",
        "--config", "allow_private=yes", env=env,
    )  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    shown = json.loads(cli("sources", "show", made.name, "--json", env=env).stdout)
    assert shown["config"] == {"api_base": "https://10.1.2.3", "allow_private": "true"}
    loopback = cli(
        "sources", "update", made.name, "--config", "api_base=http://localhost:9",
        "--config", "allow_private=false", env=env,
    )  # fmt: skip
    assert loopback.returncode == 0, loopback.stderr


def test_a_run_redirected_elsewhere_fails_clearly_and_accepts_nothing(
    engine: Engine, sessions: sessionmaker[Session], settings: Settings
) -> None:
    """The review's finding end to end: a Stripe source whose API answers 302 to another
    plain-http host serving a real-looking events list (a fake Stripe with a missing event).
    The run exits 1 with the redirect as its error, asks the other host nothing and accepts
    nothing; no line of its output carries the key."""
    key = _token("stripe")
    elsewhere = FakeStripe(key)
    elsewhere.add_event(f"evt_{uuid.uuid4().hex[:20]}", int(time.time()) - 60)
    with serving(elsewhere):
        moved = f"http://localhost:{urlsplit(elsewhere.url).port}"
        api = Hostile(key, lambda _m, path: (302, {"Location": f"{moved}{path}"}, {}))
        with serving(api):
            made = make_source(sessions, settings, provider="stripe", routes=[{"handler": "log"}])
            remember(made.secret)
            done = cli(
                "sources", "update", made.name, "--api-key", key,
                "--config", f"api_base={api.url}", "--config", "endpoint_id=we_1Recon",
                env=test_env(),
            )  # fmt: skip
            assert done.returncode == 0, done.stderr
            run = cli("reconcile", made.name, "--json", env=test_env(), timeout=120)
    assert run.returncode == 1
    view = json.loads(run.stdout)
    assert view["error"] == (
        f"Stripe API at {api.url} answered a redirect (302): refused, reconciliation follows"
        " none (set api_base to where the API is)"
    )
    assert view["listed"] == 0
    assert view["recovered"] == 0
    assert elsewhere.seen == []
    assert key not in run.stdout + run.stderr
    with engine.connect() as conn:
        receipts = conn.execute(
            text("SELECT count(*) FROM receipts WHERE source_id = :s"), {"s": made.id}
        ).scalar_one()
    assert receipts == 0
