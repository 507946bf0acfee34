"""What every answer shares on the wire, whatever its protocol: one JSON encoder (made
once), and the error envelope the server answers in by default — OpenAI's
`{"error": {"message", "type", "param", "code"}}`, for every route but Anthropic's (which
wrap the same errors in their own, api.protocols.anthropic.wire)."""

from __future__ import annotations

import msgspec
from msgspec import Struct

ENCODER = msgspec.json.Encoder()


class ErrorDetail(Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(Struct):
    error: ErrorDetail
