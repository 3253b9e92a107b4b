"""Which conversation a request continues, as the agents name it; a cluster routes by it.

Agents send a stable id per session: Codex its `session_id` header and, on the Responses API,
`prompt_cache_key`; Claude Code a `metadata.user_id` that ends in `_session_<uuid>`. The OpenAI
`user` field is left out on purpose: it names a person, not a conversation, and routing all of
someone's conversations to one replica would pile them up there.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

MAX_KEY_CHARS = 256  # an id longer than this is still an id; keep what the router hashes small


def conversation_key(*, session_header: str | None = None, prompt_cache_key: str | None = None,
                     metadata: Mapping[str, Any] | None = None) -> str | None:
    """The first id the client sent, most specific first; None when it sent none."""
    user_id = (metadata or {}).get("user_id")
    for candidate in (prompt_cache_key, session_header, user_id if isinstance(user_id, str) else None):
        if candidate:
            return candidate[:MAX_KEY_CHARS]
    return None
