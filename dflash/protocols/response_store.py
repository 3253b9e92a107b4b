"""Stored Responses (`store: true`): GET /v1/responses/{id} and `previous_response_id` read them.

In memory, least recently used first out, capped by count: a local server keeps what a client is
likely to chain from, not an archive. A restart forgets everything (a later reference is a 404).
"""

from __future__ import annotations

from collections import OrderedDict

import attrs

from dflash.protocols.canonical import Message

MAX_STORED = 256


@attrs.frozen
class StoredResponse:
    body: dict  # the response object as the client received it
    conversation: tuple[Message, ...]  # its input and its output: what a follow-up continues
    owner: str | None = None  # who may read or continue it (the API key's digest); None: anyone


class ResponseStore:
    def __init__(self, max_stored: int = MAX_STORED):
        self.max_stored = max_stored
        self._stored: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._stored)

    def put(self, response_id: str, body: dict, conversation: tuple[Message, ...], owner: str | None = None) -> None:
        self._stored[response_id] = StoredResponse(body, conversation, owner)
        self._stored.move_to_end(response_id)
        while len(self._stored) > self.max_stored:
            self._stored.popitem(last=False)

    def get(self, response_id: str, owner: str | None = None) -> StoredResponse | None:
        """The response, if stored and `owner`'s; another owner's is as if it did not exist."""
        stored = self._stored.get(response_id)
        if stored is None or stored.owner != owner:
            return None
        self._stored.move_to_end(response_id)
        return stored
