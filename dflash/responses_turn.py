"""A Responses request as one turn of a stored conversation, over HTTP or WebSocket alike:
`previous_response_id` brings in the conversation it continues, and the reply is stored (unless
`store` is false) for a later turn to continue and for GET /v1/responses/{id}.
"""

from __future__ import annotations

import time

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

    def store(self, store: ResponseStore, render: responses.ResponseRender) -> None:
        """After the reply: keep it for a later turn, if the request allows."""
        if self.request.store:
            store.put(render.response_id, render.body(),
                      responses.conversation(self.request, self.earlier, render.output_messages()))


def begin_turn(store: ResponseStore, request: responses.ResponsesRequest) -> ResponsesTurn:
    """The request after the conversation it continues; a 404 if that is not stored."""
    if request.previous_response_id is None:
        return ResponsesTurn(request)
    previous = store.get(request.previous_response_id)
    if previous is None:
        raise APIError(404, f"previous response {request.previous_response_id!r} is not stored (it was "
                            "created with store=false, or the server restarted or forgot it)",
                       param="previous_response_id")
    return ResponsesTurn(responses.continuing(request, previous.conversation), previous.conversation)
