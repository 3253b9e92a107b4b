"""APIError and the error body each dialect's clients expect.

OpenAI: {"error": {"message", "type", "param", "code"}}; a failed Response: {"code", "message"}
Anthropic: {"type": "error", "error": {"type", "message"}}

The same error has the same type and code whether it is the body of an error response or, once a
stream has begun, an event in it.

The SDKs map the HTTP status to their exception classes; the `type` strings follow what the real
services send, so clients that inspect them (Codex reads `code`) behave as they would there.
"""

from __future__ import annotations

from collections.abc import Sequence

OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_exceeded",
    431: "invalid_request_error",
}
OPENAI_CODES = {401: "invalid_api_key", 429: "rate_limit_exceeded"}

ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    431: "invalid_request_error",
    503: "overloaded_error",
}


class APIError(Exception):
    """A request that cannot be served, with the HTTP status and the field at fault."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: Sequence[tuple[str, str]] = ()):
        # A message may quote the client's own text; an unpaired surrogate there (JSON allows
        # "\ud800") would make the error body itself unencodable.
        message = message.encode("utf-8", errors="backslashreplace").decode("utf-8")
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = tuple(headers)


def openai_error_body(error: APIError) -> dict:
    """An HTTP error body, and the same object where a Chat Completions stream carries the error."""
    error_type = OPENAI_TYPES.get(error.status, "server_error" if error.status >= 500 else "invalid_request_error")
    return {"error": {
        "message": error.message,
        "type": error_type,
        "param": error.param,
        "code": error.code or OPENAI_CODES.get(error.status),
    }}


def response_error(error: APIError) -> dict:
    """A failed Response's `error` (OpenAI Responses): {code, message}, the code that of the HTTP
    body, or its type where that has no code."""
    body = openai_error_body(error)["error"]
    return {"code": body["code"] or body["type"], "message": error.message}


def anthropic_error_body(error: APIError) -> dict:
    error_type = ANTHROPIC_TYPES.get(error.status, "api_error" if error.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": error_type, "message": error.message}}


def context_length_error(max_ctx: int, prompt_tokens: int, completion_tokens: int) -> APIError:
    # OpenAI's own wording: clients (and people) recognise it and know to trim the conversation.
    return APIError(
        400,
        f"This model's maximum context length is {max_ctx} tokens. However, you requested "
        f"{prompt_tokens + completion_tokens} tokens ({prompt_tokens} in the messages, {completion_tokens} in "
        f"the completion). Please reduce the length of the messages or completion.",
        param="messages",
        code="context_length_exceeded",
    )
