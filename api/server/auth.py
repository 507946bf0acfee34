"""API keys: who may call, and who a caller is for the queue's fair share.

Keys come from `--api-key` (repeatable), `--api-key-file` (one a line) and
`ONEGPU_API_KEY`; a file or the environment keeps them out of `ps`, and no key is ever
logged. A key comes as `Authorization: Bearer KEY` or, as Anthropic's clients send it,
`x-api-key: KEY`. A presented key is hashed and compared with every key's hash in constant time —
all of them, whether or not one matched — so neither the answer's timing nor the hashes'
shared prefixes tell an attacker anything. A caller is known by its key's index (several
connections, one client), else by its connection.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Callable
from pathlib import Path

from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from api.server.errors import APIError, Unauthorized

ENV_VAR = "ONEGPU_API_KEY"


def load_keys(given: list[str], files: list[Path]) -> tuple[str, ...]:
    """Every configured key: the options', each file's non-empty, non-`#` lines, the
    environment's (comma-separated)."""
    keys = [k for k in given if k]
    for f in files:
        for line in f.read_text("utf-8").splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                keys.append(line)
    keys += [k.strip() for k in os.environ.get(ENV_VAR, "").split(",") if k.strip()]
    return tuple(dict.fromkeys(keys))


class KeySet:
    def __init__(self, keys: tuple[str, ...]) -> None:
        self._digests = [hashlib.sha256(k.encode()).digest() for k in keys]

    def __bool__(self) -> bool:
        return bool(self._digests)

    def match(self, authorization: bytes) -> int | None:
        """The index of the key in `Authorization: Bearer KEY`, or None."""
        scheme, _, token = authorization.partition(b" ")
        found = self.match_key(token.strip())
        return found if scheme.lower() == b"bearer" else None

    def match_key(self, key: bytes) -> int | None:
        """The index of `key` (`x-api-key: KEY`), or None."""
        digest = hashlib.sha256(key).digest()
        found = None
        for i, d in enumerate(self._digests):
            if hmac.compare_digest(digest, d):
                found = i
        return found


def client_of(scope: Scope) -> str:
    """The fairness unit: the caller's key when it used one, else its connection."""
    key = scope.get("state", {}).get("api_key_index")
    if key is not None:
        return f"key:{key}"
    client = scope.get("client")
    return f"conn:{client[0]}:{client[1]}" if client else "conn:?"


class BearerAuth:
    """`Authorization: Bearer KEY` (or `x-api-key: KEY`) on /v1 routes and /tokenize,
    /detokenize, and on /metrics and /experts when `protect_metrics` is set; /health
    stays open for load balancers. A refusal is in the envelope of the route's API
    (Anthropic's under /v1/messages): `error_for(path, err)`, which the app that mounts
    the protocols hands in (api.server.app), so that no other server module knows them."""

    def __init__(
        self, app: ASGIApp, keys: KeySet, protect_metrics: bool,
        error_for: Callable[[str, APIError], Response],
    ) -> None:  # fmt: skip
        self.app = app
        self.keys = keys
        self.error_for = error_for
        api = ("/v1", "/tokenize", "/detokenize")
        self.prefixes = (*api, "/metrics", "/experts") if protect_metrics else api

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(self.prefixes):
            got = key = b""
            for name, value in scope["headers"]:
                if name == b"authorization":
                    got = value
                elif name == b"x-api-key":
                    key = value.strip()
            index = self.keys.match(got)  # either header may carry the key
            if index is None:
                index = self.keys.match_key(key)
            if index is None:
                err = Unauthorized("invalid or missing API key")
                resp = self.error_for(scope["path"], err)
                await resp(scope, receive, send)
                return
            scope.setdefault("state", {})["api_key_index"] = index
        await self.app(scope, receive, send)
