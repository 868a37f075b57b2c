"""Secrets at rest: stored secrets encrypted with the configured Fernet keys, and API tokens
kept as hashes.

HOSTING_ENCRYPTION_KEYS is a comma-separated list: the first key encrypts, every key
decrypts, so keys can be rotated by putting a new key first.
"""

import hashlib
from functools import lru_cache

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from django.conf import settings

REDACTED = "***"


class SecretDecryptionError(Exception):
    """A stored secret could not be decrypted with any configured key."""


@lru_cache(maxsize=4)
def _fernet(keys: tuple[str, ...]) -> MultiFernet:
    try:
        return MultiFernet([Fernet(key.encode()) for key in keys])
    except (ValueError, TypeError) as exc:
        raise ValueError(
            "HOSTING_ENCRYPTION_KEYS must be comma-separated Fernet keys "
            "(generate one with: python -c 'from cryptography.fernet import Fernet; "
            "print(Fernet.generate_key().decode())')"
        ) from exc


def fernet() -> MultiFernet:
    return _fernet(tuple(settings.HOSTING_ENCRYPTION_KEYS))


def encrypt(plaintext: str) -> str:
    return fernet().encrypt(plaintext.encode()).decode()


def decrypt(token: str) -> str:
    if not token:
        return ""
    try:
        return fernet().decrypt(token.encode()).decode()
    except InvalidToken:
        # Never include the token itself: it would leak ciphertext into logs.
        raise SecretDecryptionError("a stored secret could not be decrypted with HOSTING_ENCRYPTION_KEYS") from None


def rotate(token: str) -> str:
    """Re-encrypt a stored secret with the current first key."""
    return fernet().rotate(token.encode()).decode() if token else token


def hash_token(raw: str) -> str:
    """What is stored of an API token. Tokens carry 256 random bits, so a plain SHA-256 is
    enough (no stretching needed)."""
    return hashlib.sha256(raw.encode()).hexdigest()
