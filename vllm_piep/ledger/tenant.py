"""A request's tenant as the billing ledger stores it: the configured header's value, else the
OpenAI `user` field, else none; optionally one-way hashed. A value with control characters, a
lone surrogate or over `MAX_TENANT_BYTES` is rejected (the row has no tenant; the rejection is
counted), never stored raw."""

from __future__ import annotations

import hashlib
import hmac

MAX_TENANT_BYTES = 256


def clean_tenant(value: object, hash_key: bytes | None = None) -> tuple[str | None, bool]:
    """(the tenant to store, whether `value` was rejected). `hash_key`: store HMAC-SHA256 of
    the value under this key (hex, 32 characters) instead of the value."""
    if value is None or value == "":
        return None, False
    if not isinstance(value, str):
        return None, True
    try:
        raw = value.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate (JSON allows "\ud800"): not text
        return None, True
    if len(raw) > MAX_TENANT_BYTES or any(ord(c) < 32 or 127 <= ord(c) < 160 for c in value):
        return None, True
    if hash_key is not None:
        return hmac.new(hash_key, raw, hashlib.sha256).hexdigest()[:32], False
    return value, False
