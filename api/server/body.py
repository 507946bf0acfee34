"""Read and decode a request body within bounds, so no body can hold the server.

The body is refused by its declared length before a byte is read (413), counted as it
arrives when it has none (chunked), and must arrive within a time bound (408; a client
that trickles a body would otherwise hold a connection and a task forever). Every way a
body can fail to decode — malformed JSON, invalid UTF-8 inside a string, nesting deeper
than the decoder recurses, a wrong type — is a 400 naming what it can, never a 500.
"""

from __future__ import annotations

from typing import Any, TypeVar

import anyio
import msgspec
from starlette.requests import ClientDisconnect, Request

from api.server.errors import (
    ClientGone,
    InvalidRequest,
    PayloadTooLarge,
    RequestTimeout,
    from_decode_error,
)
from api.server.limits import RequestLimits

T = TypeVar("T")


async def read_body(request: Request, limits: RequestLimits) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limits.max_bytes:
        raise _too_large(int(declared), limits)
    parts: list[bytes] = []
    size = 0
    try:
        with anyio.fail_after(limits.body_timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limits.max_bytes:
                    raise _too_large(size, limits)
                parts.append(chunk)
    except TimeoutError:
        raise RequestTimeout(
            f"the request body did not arrive within {limits.body_timeout_s:g} s"
        ) from None
    except ClientDisconnect:
        raise ClientGone("client disconnected while sending the body") from None
    return b"".join(parts)


def _too_large(size: int, limits: RequestLimits) -> PayloadTooLarge:
    return PayloadTooLarge(
        f"the request body is {size} bytes or more; this server accepts at most "
        f"{limits.max_bytes} bytes (--max-request-bytes)"
    )


def decode(body: bytes, decoder: msgspec.json.Decoder[Any]) -> Any:
    """The body as the decoder's type; every failure a 400."""
    try:
        return decoder.decode(body)
    except msgspec.DecodeError as e:
        raise from_decode_error(e) from None
    except UnicodeDecodeError as e:  # invalid UTF-8 inside a JSON string
        raise InvalidRequest(f"Malformed JSON body: invalid UTF-8 at byte {e.start}") from None
    except RecursionError:
        raise InvalidRequest("Malformed JSON body: nested too deeply") from None


async def read_json(request: Request, decoder: msgspec.json.Decoder[T], limits: RequestLimits) -> T:
    result: T = decode(await read_body(request, limits), decoder)
    return result
