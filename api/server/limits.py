"""The bounds that keep one request, client or connection from taking the server from
everyone else (`one-gpu serve` options; defaults documented in the README)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RequestLimits:
    max_bytes: int = 4 * 2**20  # --max-request-bytes: larger bodies are a 413
    body_timeout_s: float = 60.0  # --body-timeout: the whole body arrives within this (408)
    max_messages: int = 4096  # --max-messages: per chat request
    # Prompts rendered and tokenized at once, in worker threads: one keeps up with a
    # server's traffic (~1.5 MB of text a second) and leaves the other cores to the engine.
    prompt_workers: int = 1


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    max_connections: int = 1024  # --max-connections: open at once; idle ones make way
    header_timeout_s: float = 10.0  # --header-timeout: a request's headers arrive within this
    keep_alive_s: float = 15.0  # --keep-alive-timeout: an idle connection is closed after this
    max_header_bytes: int = 64 * 1024  # a request's line and headers
