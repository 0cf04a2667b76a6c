"""Encryption at rest for source and route secrets (Fernet keyed from WEBHOOKS_SECRET_KEY)."""

from __future__ import annotations

import base64
import hashlib
import secrets as _secrets

from cryptography.fernet import Fernet, InvalidToken


class SecretDecryptError(Exception):
    """A stored secret could not be decrypted: WEBHOOKS_SECRET_KEY changed or data is corrupt."""


class SecretBox:
    def __init__(self, secret_key: str) -> None:
        digest = hashlib.sha256(b"webhooks-secret-box:" + secret_key.encode()).digest()
        self._fernet = Fernet(base64.urlsafe_b64encode(digest))
        self._cache: dict[bytes, str] = {}

    def encrypt(self, plaintext: str) -> bytes:
        return self._fernet.encrypt(plaintext.encode())

    def decrypt(self, ciphertext: bytes) -> str:
        hit = self._cache.get(ciphertext)
        if hit is not None:
            return hit
        try:
            value = self._fernet.decrypt(ciphertext).decode()
        except InvalidToken:
            raise SecretDecryptError("stored secret cannot be decrypted with this key") from None
        if len(self._cache) > 10_000:
            self._cache.clear()
        self._cache[ciphertext] = value
        return value


def generate_secret(provider: str) -> str:
    """A new random signing secret in the provider's format."""
    raw = _secrets.token_bytes(32)
    if provider in ("standard", "svix"):
        return "whsec_" + base64.b64encode(raw).decode()
    if provider == "stripe":
        return "whsec_" + _secrets.token_urlsafe(32)
    return _secrets.token_urlsafe(32)


def public_id(prefix: str) -> str:
    """A random, non-secret identifier such as ``src_3kTMd...`` used in URLs and the CLI."""
    return f"{prefix}_{_secrets.token_urlsafe(15).replace('-', 'x').replace('_', 'z')}"
