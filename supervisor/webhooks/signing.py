"""Standard Webhooks signatures: HMAC-SHA256 of `id.timestamp.body`, base64, as `v1,…`.

Receivers verify with the `standardwebhooks` packages (PyPI, npm, …); the tests do.
"""

from __future__ import annotations

import base64
import hashlib
import hmac


def signature(key: bytes, webhook_id: str, timestamp: int, body: str) -> str:
    signed = f"{webhook_id}.{timestamp}.{body}".encode()
    return "v1," + base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()


def headers(key: bytes, webhook_id: str, timestamp: int, body: str) -> dict[str, str]:
    """The request headers of one attempt (the timestamp is the attempt's)."""
    return {
        "content-type": "application/json",
        "webhook-id": webhook_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": signature(key, webhook_id, timestamp, body),
        "user-agent": "derivd-webhooks",
    }
