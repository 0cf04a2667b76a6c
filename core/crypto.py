"""Encryption at rest for source and route secrets, keyed from ``WEBHOOKS_SECRET_KEY``.

``WEBHOOKS_SECRET_KEY`` is one key or a comma-separated list, newest first (MultiFernet
semantics): new secrets are encrypted under the newest, every listed key decrypts. Rotation:
deploy ``NEW,OLD`` everywhere, run ``webhooks secrets rekey`` (re-encrypts every stored secret
under NEW; resumable and idempotent), then deploy ``NEW`` alone.

Each key is stretched with scrypt (N=2^15, r=8, p=1): a key may be a passphrase a person
chose, and scrypt makes guessing one from a stolen ciphertext expensive. A generated key
(:func:`new_key`: ``whk_`` and 32 random bytes in base64url, what ``make .env`` and ``webhooks
secrets new-key`` write) has 256 bits of entropy that no stretching adds to: its root is
derived with HKDF-SHA256 instead, which spares every process and every CLI run scrypt's
~0.1 s of CPU. Which derivation a key gets is read from the key itself, so keys of both kinds
sit in one list and ``rekey`` moves secrets between them.

The salt is fixed (:data:`_SCRYPT_SALT`), on purpose. A salt defeats precomputation across many
stored hashes; here there is one key per deployment, and every process must derive the same
Fernet key from it without storing anything beside the ciphertexts (a random salt would have to
be stored and shared, and losing it would lose every secret). What a fixed salt costs: an
attacker can precompute scrypt over a dictionary of passphrases once for every deployment of
this project, which is why keys are at least 32 characters and ``make .env`` writes random
ones; the purpose-bound salt still keeps these derived keys apart from any other scrypt use
of the same key material.

Ciphertexts written before keys were stretched (a SHA-256 of the key, fast to guess from)
still decrypt while ``WEBHOOKS_SECRET_KEY_LEGACY`` is true (the default), and ``rekey`` moves
them to the stretched key. ``webhooks secrets rekey --drop-legacy`` confirms none is left
(refused, changing nothing, while any is) so the setting can be turned off everywhere.

Every stored secret is bound to its place: the token's plaintext starts with the table, the
row's key and the purpose it was written for (:class:`Place`), inside Fernet's authenticated
token, so it is covered by the token's HMAC exactly as associated data is covered by an AEAD
tag. A ciphertext copied to another row, or from one purpose to another (a source's signing
secret pasted into a reconciliation credential, whose API base an attacker controls), fails to
open with :class:`SecretMisplaced`, counted and alerted, and is never used. Fernet is kept for
its key rotation (MultiFernet); the binding costs a few bytes per secret. Ciphertexts written
before binding existed open only for ``webhooks db upgrade`` and ``webhooks secrets rekey``,
which bind them in place (:class:`SecretUnbound` everywhere else).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import secrets as _secrets
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from cryptography.hazmat.primitives.hashes import SHA256
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from core.errors import WebhooksError

if TYPE_CHECKING:
    from core.providers.base import Provider

# A fixed, purpose-bound salt: the key itself is the secret; the salt keeps these derived keys
# apart from any other use of the same key material.
_SCRYPT_SALT = b"webhook-pipeline/secret-box/scrypt-v1"
_SCRYPT_N, _SCRYPT_R, _SCRYPT_P = 2**15, 8, 1
MIN_KEY_LENGTH = 32
# A generated key: this prefix, then GENERATED_KEY_BYTES random bytes in unpadded base64url.
GENERATED_KEY_PREFIX: Final = "whk_"
GENERATED_KEY_BYTES: Final = 32
_HKDF_SALT = b"webhook-pipeline/secret-box/hkdf-v1"
_HKDF_INFO = b"secret-box root"
_MIN_DISTINCT = 16


class SecretDecryptError(WebhooksError):
    """A stored secret could not be decrypted: WEBHOOKS_SECRET_KEY changed or data is corrupt."""

    reason = "undecryptable"


# What a stored secret is for: the purpose half of its binding (and a metric label).
SIGNING: Final = "signing_secret"  # source_secrets.ciphertext: verifies a provider's requests
# sources.reconcile_ciphertext: the source's provider API key, for its reconciliation and its
# subscription watchdog (reading the webhook endpoint, re-enabling it on --fix): one
# credential per source and provider account, never sent anywhere but its api_base.
RECONCILE: Final = "reconcile_credential"
ROUTE_SIGNING: Final = "route_secret"  # routes.signing_ciphertext: signs forwarded requests
PURPOSES: Final = (SIGNING, RECONCILE, ROUTE_SIGNING)
# How an operator puts a refused secret right, by its purpose.
_FIXES: Final = {
    SIGNING: "add a new one (webhooks secrets add SOURCE) and revoke this one",
    RECONCILE: "set the credential again (webhooks sources update SOURCE --api-key KEY)",
    ROUTE_SIGNING: "remove the route and add it again (it gets a new signing secret)",
}

# The bound plaintext: MARK, then table, row and purpose, each ended by a NUL, then the secret.
# A secret is text a person or a provider made, never starting with a NUL: an unbound
# plaintext (written before binding) cannot be mistaken for a bound one.
_MARK: Final = b"\x00bound1\x00"


@dataclass(frozen=True)
class Place:
    """Where a stored secret lives, sealed into its ciphertext: the table, the row's primary
    key (as text) and the purpose."""

    table: str
    row: str
    purpose: str

    def __post_init__(self) -> None:
        if self.purpose not in PURPOSES:
            raise ValueError(f"unknown secret purpose {self.purpose!r}")
        if any("\x00" in part or not part for part in (self.table, self.row)):
            raise ValueError("a secret's table and row are non-empty text without NUL")

    def encoded(self) -> bytes:
        return b"".join(part.encode() + b"\x00" for part in (self.table, self.row, self.purpose))

    def __str__(self) -> str:
        return f"{self.table} row {self.row} ({self.purpose})"


class SecretMisplaced(SecretDecryptError):
    """A stored ciphertext opened, but it was sealed for another row or purpose: it was copied
    there (a compromised database user, a restored backup, a careless migration). Never used;
    counted as ``webhooks_secret_misplaced_total``."""

    reason = "misplaced"

    def __init__(self, wanted: Place, found: Place | None) -> None:
        self.wanted, self.found = wanted, found
        super().__init__(
            f"the secret stored at {wanted} was sealed for "
            f"{found if found is not None else 'an unreadable place'}: it was copied there and"
            f" is refused; {_FIXES[wanted.purpose]}"
        )


class SecretUnbound(SecretDecryptError):
    """A stored ciphertext written before secrets were bound to their place: ``webhooks db
    upgrade`` or ``webhooks secrets rekey`` binds it; until then it is not used."""

    reason = "unbound"

    def __init__(self, wanted: Place) -> None:
        self.wanted = wanted
        super().__init__(
            f"the secret stored at {wanted} is not bound to its place yet: run"
            " `webhooks db upgrade` (or `webhooks secrets rekey`)"
        )


def source_secret_place(secret_id: str) -> Place:
    """A source's signing secret (``source_secrets``, keyed by its ``sec_...`` id)."""
    return Place("source_secrets", secret_id, SIGNING)


def reconcile_place(source_id: int) -> Place:
    """A source's reconciliation credential (``sources.reconcile_ciphertext``)."""
    return Place("sources", str(source_id), RECONCILE)


def route_secret_place(route_id: int) -> Place:
    """A forward route's signing secret (``routes.signing_ciphertext``)."""
    return Place("routes", str(route_id), ROUTE_SIGNING)


def _split(plaintext: bytes) -> tuple[Place | None, bytes]:
    """(its place, the secret) of a bound plaintext; (None, plaintext) of an unbound one."""
    if not plaintext.startswith(_MARK):
        return None, plaintext
    parts = plaintext[len(_MARK) :].split(b"\x00", 3)
    if len(parts) != 4:
        raise SecretDecryptError("stored secret has a malformed binding")
    table, row, purpose, secret = parts
    try:
        return Place(table.decode(), row.decode(), purpose.decode()), secret
    except (UnicodeDecodeError, ValueError):
        raise SecretDecryptError("stored secret has a malformed binding") from None


def new_key() -> str:
    """A fresh generated key for ``WEBHOOKS_SECRET_KEY`` (HKDF-derived, see the module)."""
    return GENERATED_KEY_PREFIX + _secrets.token_urlsafe(GENERATED_KEY_BYTES)


def _generated(key: str) -> bytes | None:
    """The random bytes of a generated key; None for a key of another form (a passphrase).
    ValueError for a key that claims the form and does not have it: it is never stretched
    instead, so a mistyped generated key cannot quietly become a passphrase."""
    if not key.startswith(GENERATED_KEY_PREFIX):
        return None
    encoded = key[len(GENERATED_KEY_PREFIX) :]
    try:
        raw = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4))
    except ValueError:
        raw = b""
    if len(raw) != GENERATED_KEY_BYTES or base64.urlsafe_b64encode(raw).rstrip(b"=") != (
        encoded.encode()
    ):
        raise ValueError(
            f"starts with {GENERATED_KEY_PREFIX} but is not {GENERATED_KEY_BYTES} bytes in"
            " base64url: use `webhooks secrets new-key` for a new one"
        )
    # 43 random characters show ~30 distinct ones; under 16 (odds below 1e-9) was typed.
    if len(set(encoded)) < _MIN_DISTINCT:
        raise ValueError(
            f"starts with {GENERATED_KEY_PREFIX} but is not random (it skips scrypt, so it"
            " must be): use `webhooks secrets new-key` for a new one"
        )
    return raw


def split_keys(secret_key: str) -> list[str]:
    """The keys of ``WEBHOOKS_SECRET_KEY``, newest first; raises ValueError if one is short
    or is a malformed generated key."""
    keys = [k.strip() for k in secret_key.split(",")]
    if not keys or any(not k for k in keys):
        raise ValueError("an empty key in the list")
    short = [i for i, k in enumerate(keys, start=1) if len(k) < MIN_KEY_LENGTH]
    if short:
        raise ValueError(
            f"key {short[0]} of {len(keys)} is shorter than {MIN_KEY_LENGTH} characters"
        )
    for i, key in enumerate(keys, start=1):
        try:
            _generated(key)
        except ValueError as exc:
            raise ValueError(f"key {i} of {len(keys)} {exc}") from None
    return keys


@functools.lru_cache(maxsize=16)  # derived once per key and process: scrypt is slow on purpose
def stretched_key(key: str) -> bytes:
    """The 32 bytes derived from one key of ``WEBHOOKS_SECRET_KEY`` (scrypt, or HKDF for a
    generated key): the Fernet key of the stored secrets, and the root other purposes derive
    their own keys from with an HMAC naming the purpose (:mod:`core.send_marks`), so no
    purpose can stand in for another."""
    raw = _generated(key)
    if raw is not None:
        hkdf = HKDF(algorithm=SHA256(), length=32, salt=_HKDF_SALT, info=_HKDF_INFO)
        return hkdf.derive(raw)
    return hashlib.scrypt(
        key.encode(),
        salt=_SCRYPT_SALT,
        n=_SCRYPT_N,
        r=_SCRYPT_R,
        p=_SCRYPT_P,
        maxmem=64 * 1024 * 1024,
        dklen=32,
    )


def _stretched(key: str) -> Fernet:
    return Fernet(base64.urlsafe_b64encode(stretched_key(key)))


def _legacy(key: str) -> Fernet:
    digest = hashlib.sha256(b"webhooks-secret-box:" + key.encode()).digest()
    return Fernet(base64.urlsafe_b64encode(digest))


class SecretBox:
    def __init__(self, secret_key: str, *, legacy: bool = True) -> None:
        keys = split_keys(secret_key)
        self._current = _stretched(keys[0])
        stretched = [self._current, *(_stretched(k) for k in keys[1:])]
        legacies = [_legacy(k) for k in keys]
        self._stretched, self._legacy = MultiFernet(stretched), MultiFernet(legacies)
        # WEBHOOKS_SECRET_KEY_LEGACY: the old derivation decrypts too (never encrypts).
        self._fernet = MultiFernet(stretched + legacies if legacy else stretched)
        self._cache: dict[bytes, tuple[Place | None, str]] = {}

    def seal(self, plaintext: str, place: Place) -> bytes:
        """``plaintext`` encrypted under the newest key, bound to ``place``."""
        return self._current.encrypt(_MARK + place.encoded() + plaintext.encode())

    def open(self, ciphertext: bytes, place: Place) -> str:
        """The secret stored at ``place``: :class:`SecretMisplaced` when it was sealed for
        another place, :class:`SecretUnbound` when it was written before binding, and
        SecretDecryptError when no listed key decrypts it."""
        found, value = self._read(ciphertext)
        if found == place:
            return value
        refused: SecretDecryptError = (
            SecretUnbound(place) if found is None else SecretMisplaced(place, found)
        )
        # Imported on refusal only: settings import this module, and a worker chooses
        # prometheus' multi-process mode after its settings load, before core.metrics loads.
        from core import metrics  # noqa: PLC0415 (see above)

        metrics.SECRETS_REFUSED.labels(place.purpose, refused.reason).inc()
        raise refused

    def readable(self, ciphertext: bytes) -> bool:
        """Whether a listed key decrypts it, wherever it belongs (the start-up key check)."""
        try:
            self._read(ciphertext)
        except SecretDecryptError:
            return False
        return True

    def _read(self, ciphertext: bytes) -> tuple[Place | None, str]:
        hit = self._cache.get(ciphertext)
        if hit is not None:
            return hit
        try:
            raw = self._fernet.decrypt(ciphertext)
        except InvalidToken:
            raise SecretDecryptError("stored secret cannot be decrypted with this key") from None
        found, secret = _split(raw)
        value = (found, secret.decode())
        if len(self._cache) > 10_000:
            self._cache.clear()
        self._cache[ciphertext] = value
        return value

    def is_current(self, ciphertext: bytes, place: Place) -> bool:
        """Encrypted under the newest key and bound to ``place`` already (nothing for
        ``rekey`` to do)."""
        try:
            raw = self._current.decrypt(ciphertext)
        except InvalidToken:
            return False
        return _split(raw)[0] == place

    def needs_legacy(self, ciphertext: bytes) -> bool:
        """Readable only through the legacy SHA-256 derivation of a listed key (whether or not
        this box uses it): what ``rekey --drop-legacy`` refuses to leave behind."""
        try:
            self._stretched.decrypt(ciphertext)
        except InvalidToken:
            pass
        else:
            return False
        try:
            self._legacy.decrypt(ciphertext)
        except InvalidToken:
            return False
        return True

    def rebound(self, ciphertext: bytes, place: Place) -> bytes:
        """The same secret under the newest key, bound to ``place``: what ``rekey`` and ``db
        upgrade`` write. An unbound ciphertext (written before binding) is bound where it
        stands; one sealed for another place stays refused (:class:`SecretMisplaced`), and
        SecretDecryptError if no listed key decrypts it."""
        found, value = self._read(ciphertext)
        if found is not None and found != place:
            raise SecretMisplaced(place, found)
        return self.seal(value, place)


class KeyMismatch(WebhooksError):  # noqa: N818 (the agreed name)
    """``WEBHOOKS_SECRET_KEY`` cannot decrypt stored secrets: a fresh ``.env`` against an
    existing database, or a key dropped from the list too early. Every signed request would
    fail, so processes refuse to start with this one line instead."""

    def __init__(self, unreadable: int, checked: int) -> None:
        self.unreadable, self.checked = unreadable, checked
        super().__init__(
            f"WEBHOOKS_SECRET_KEY cannot decrypt {unreadable} of the {checked} stored secrets "
            "checked: this database was written with another key. Set WEBHOOKS_SECRET_KEY "
            "back to it (or list it after the new one, NEW,OLD, and run "
            "`webhooks secrets rekey`), or use another database (WEBHOOKS_DATABASE_URL)"
        )


def check_keys(box: SecretBox, ciphertexts: Iterable[bytes]) -> int:
    """How many stored secrets were checked; :class:`KeyMismatch` (with the count that no
    listed key decrypts) when any of them cannot be read. A sample of the stored secrets is
    enough: one key writes them all, so a wrong key fails on every one."""
    checked = unreadable = 0
    for ciphertext in ciphertexts:
        checked += 1
        if not box.readable(ciphertext):
            unreadable += 1
    if unreadable:
        raise KeyMismatch(unreadable, checked)
    return checked


def _provider(name: str) -> Provider:
    """The registry's provider ``name`` (UnknownProvider, a ValueError, if nobody registered it)."""
    # The SecretBox alone (every CLI command's key check, the workers) needs no provider.
    from core.providers import registry  # noqa: PLC0415 (the provider package imports every built-in provider module, ~40 ms of a CLI run that names no provider)

    return registry.get(name)


def key_format(provider: str) -> str:
    """``whsec`` (``whsec_`` + base64 of the key) or ``text`` (the string is the key), from
    the provider registry; UnknownProvider (a ValueError) for a name nobody registered."""
    return _provider(provider).key_format


def key_prefix(provider: str) -> str:
    """What the provider's own keys start with (Stripe: ``whsec_``, its whole string being the
    key), from the provider registry."""
    return _provider(provider).key_prefix


def generate_secret(provider: str) -> str:
    """A new random signing secret in the provider's format (its registry entry says which)."""
    found = _provider(provider)
    if found.key_format == "whsec":
        return "whsec_" + base64.b64encode(_secrets.token_bytes(32)).decode()
    if found.key_format in SUPPLIED_KEY_FORMATS:
        raise ValueError(
            f"a {provider} key is issued by the sender ({SUPPLIED_KEY_FORMATS[found.key_format]})"
            ": pass it with --secret (it is not generated)"
        )
    return found.key_prefix + _secrets.token_urlsafe(32)


# Key formats the sender issues (public keys, Adyen's HMAC key): given by the user, never
# generated here.
SUPPLIED_KEY_FORMATS = {
    "ed25519": "its public key",
    "p256": "its public key",
    "hex": "a hex HMAC key",
}


def check_key(provider: str, secret: str) -> None:
    """ValueError (saying what the key should be) when ``secret`` is not in the format the
    provider's keys have (Discord: 64 hex; SendGrid: base64 P-256; Adyen: hex)."""
    check = _provider(provider).check_secret
    if check is not None:
        check(secret)


def public_id(prefix: str) -> str:
    """A random, non-secret identifier such as ``src_3kTMd...`` used in URLs and the CLI."""
    return f"{prefix}_{_secrets.token_urlsafe(15).replace('-', 'x').replace('_', 'z')}"
