"""Secret tokens: minted once, stored only as a hash, compared by hash."""

import hashlib
import secrets


def mint_token(prefix: str) -> str:
    return f"{prefix}_{secrets.token_urlsafe(32)}"


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()
