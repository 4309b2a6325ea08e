"""API keys at the front door: with `--api-key` (or $TANDEM_API_KEY) set, the OpenAI API (/v1/*) needs
`Authorization: Bearer <key>` and gRPC Generate the same as `authorization` metadata; /health, /metrics,
gRPC health and reflection stay open (probes and scrapers carry no key)."""

from __future__ import annotations

import hmac


def key_matches(authorization: str, api_key: str) -> bool:
    """`Bearer <key>`, compared in constant time."""
    return hmac.compare_digest(authorization.encode(), f"Bearer {api_key}".encode())
