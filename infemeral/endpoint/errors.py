"""How the endpoint fails: an infemeral error as the HTTP status and OpenAI error body an API client can act on."""

from __future__ import annotations

from infemeral.endpoint.schema import RequestError
from infemeral.errors import NoChatTemplate, StatusError

HTTP_STATUS = {  # gRPC status of an infemeral error -> (HTTP status, OpenAI error type)
    "INVALID_ARGUMENT": (400, "invalid_request_error"),
    "OUT_OF_RANGE": (400, "invalid_request_error"),
    "ABORTED": (409, "conflict_error"),
    "RESOURCE_EXHAUSTED": (429, "rate_limit_error"),
    "UNAVAILABLE": (503, "server_error"),
    "DEADLINE_EXCEEDED": (504, "server_error"),
}


def to_request_error(e: Exception) -> RequestError:
    """An infemeral error as the HTTP status and OpenAI error an API client can act on."""
    if isinstance(e, RequestError):
        return e
    if isinstance(e, NoChatTemplate):
        return RequestError(400, str(e), param="messages", code="no_chat_template")
    if isinstance(e, StatusError):
        name = e.code.name
        status, kind = HTTP_STATUS.get(name, (502, "server_error"))
        message = str(e)
        if name == "UNAVAILABLE":
            message = f"the infemeral server is unreachable or unavailable: {e}"
        elif name == "ABORTED":
            message = (f"the turn was aborted and nothing was committed; the conversation is as it was, so the "
                       f"request can be sent again: {e}")
        elif name in ("UNAUTHENTICATED", "PERMISSION_DENIED"):
            message = f"the infemeral server refused this endpoint (check INFEMERAL_API_KEY and TLS settings): {e}"
        headers = {"Retry-After": "1"} if status in (409, 429, 503) else None
        return RequestError(status, message, type=kind, code=name.lower(), headers=headers)
    return RequestError(500, str(e), type="server_error", code="internal_error")
