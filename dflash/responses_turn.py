"""A Responses request as one turn of a stored conversation, over HTTP or WebSocket alike:
`previous_response_id` brings in the conversation it continues, and the reply is stored (unless
`store` is false) for a later turn to continue and for GET /v1/responses/{id}.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import attrs

from dflash.protocols import responses
from dflash.protocols.canonical import Message
from dflash.protocols.errors import APIError
from dflash.protocols.response_store import ResponseStore


@attrs.frozen
class ResponsesTurn:
    request: responses.ResponsesRequest  # its generation holds the earlier turns too
    earlier: tuple[Message, ...] = ()  # the conversation of the previous response

    def renderer(self, model_id: str) -> responses.ResponseRender:
        return responses.ResponseRender(self.request, model=self.request.generation.model or model_id,
                                        created_at=int(time.time()))

    def conversation(self, output: tuple[Message, ...]) -> tuple[Message, ...]:
        """What a later turn continues: the earlier turns, this input, this output."""
        return responses.conversation(self.request, self.earlier, output)

    def store(self, store: ResponseStore, render: responses.ResponseRender, owner: str | None = None) -> None:
        """After the reply: keep it for a later turn, if the request allows."""
        if self.request.store:
            store.put(render.response_id, render.body(), self.conversation(render.output_messages()), owner)


def begin_turn(stores: ResponseStore | Sequence[ResponseStore], request: responses.ResponsesRequest, *,
               owner: str | None = None, missing_status: int = 404) -> ResponsesTurn:
    """The request after the conversation it continues, from the first store that has it;
    `missing_status` (code previous_response_not_found) if none does."""
    if request.previous_response_id is None:
        return ResponsesTurn(request)
    stores = (stores,) if isinstance(stores, ResponseStore) else stores
    previous = next((found for store in stores if (found := store.get(request.previous_response_id, owner))), None)
    if previous is None:
        raise APIError(missing_status, f"previous response {request.previous_response_id!r} is not stored (it "
                                       "was created with store=false on another connection, or the server "
                                       "restarted or forgot it)",
                       param="previous_response_id", code="previous_response_not_found")
    return ResponsesTurn(responses.continuing(request, previous.conversation), previous.conversation)
