"""Typed API errors and their OpenAI error bodies.

Every failure a client can cause is one of these classes; the app maps each class to its
status and body (`{"error": {"message", "type", "param", "code"}}`), never by message text.
"""

from __future__ import annotations

import logging
import re

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from api.server.wire import ENCODER, ErrorBody, ErrorDetail

log = logging.getLogger(__name__)


class APIError(Exception):
    status = 500
    type = "server_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def headers(self) -> dict[str, str]:
        return {}


class InvalidRequest(APIError):
    status = 400
    type = "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


class ReproducibleLaneUnavailable(InvalidRequest):
    code = "reproducible_lane_unavailable"


class NotReproducible(InvalidRequest):
    """The request asks the reproducible lane for something it cannot make reproducible."""

    code = "not_reproducible"


class Unsupported(InvalidRequest):
    """A field that would change the output and that this server does not implement yet:
    refused, never silently ignored."""

    code = "unsupported_parameter"


class PayloadTooLarge(APIError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class RequestTimeout(APIError):
    """The body did not arrive in time; the rest of it is unread, so the connection ends."""

    status = 408
    type = "invalid_request_error"
    code = "request_timeout"

    def headers(self) -> dict[str, str]:
        return {"Connection": "close"}


class ClientGone(APIError):
    """The client left before its request was read: nobody to answer, nothing to log but
    a line."""

    status = 499
    type = "invalid_request_error"
    code = "client_closed_request"


class ModelNotFound(APIError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class RouteNotFound(APIError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class MethodNotAllowed(APIError):
    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"


class Unauthorized(APIError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class ServerBusy(APIError):
    status = 429
    type = "rate_limit_error"
    code = "queue_full"

    def __init__(self, message: str, *, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class ServiceUnavailable(APIError):
    status = 503
    type = "server_error"
    code = "unavailable"


class GenerationFailed(APIError):
    status = 500
    type = "server_error"
    code = "generation_failed"


_PATH = re.compile(r"at `\$\.?([^`]*)`")
_MISSING = re.compile(r"missing required field `([^`]+)`")


def from_decode_error(err: msgspec.DecodeError) -> InvalidRequest:
    """A msgspec failure as a 400 naming the field (msgspec puts its path in the message)."""
    text = str(err)
    m = _PATH.search(text)
    param = m.group(1) if m and m.group(1) else None
    missing = _MISSING.search(text)
    if missing:
        param = f"{param}.{missing.group(1)}" if param else missing.group(1)
    if isinstance(err, msgspec.ValidationError):
        return InvalidRequest(f"Invalid request: {text}", param=param)
    return InvalidRequest(f"Malformed JSON body: {text}")


def error_response(err: APIError) -> Response:
    body = ErrorBody(ErrorDetail(err.message, err.type, err.param, err.code))
    return Response(
        ENCODER.encode(body),
        status_code=err.status,
        media_type="application/json",
        headers=err.headers(),
    )


async def handle_api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    if isinstance(exc, ClientGone):
        client = request.client
        log.info("%s: %s", f"{client.host}:{client.port}" if client else "client", exc.message)
    return error_response(exc)
