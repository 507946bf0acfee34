"""LiteLLM in front of the server, as many teams put it between their tools and their
models: its SDK with the server as an OpenAI-compatible provider (`openai/<name>`) and as
an Anthropic one (`anthropic/<name>`) — a completion, a streamed `acompletion`, and a forced
tool call — on the embedded model (the session `server`).

The SDK runs in a program of its own (`tests/litellm_calls.py`), as it does in front of a
server; every request it makes goes to the server's loopback port, and it uses its bundled
model list (no download at import).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.server_proc import ROOT, Server
from tests.conftest import MODEL

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
def test_litellm_answers_streams_and_calls_a_tool_through_either_provider(
    server: Server, kind: str
) -> None:
    """`completion` answers with text and usage; `acompletion(stream=True)` streams the
    text in more than one chunk and ends with a finish reason; a named tool forced comes
    back as one call in OpenAI's shape whichever provider LiteLLM spoke to, its arguments
    valid JSON for the function."""
    base = server.base_url if kind == "openai" else server.url
    run = subprocess.run([sys.executable, "-m", "tests.litellm_calls", kind, base, MODEL],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert isinstance(got["text"], str) and got["text"].strip(), got
    assert got["usage"][0] > 0 and got["usage"][1] > 0, got
    assert len(got["pieces"]) > 1 and got["stream_finish"] in ("stop", "length"), got
    assert [name for name, _ in got["calls"]] == ["get_weather"], got
    assert isinstance(json.loads(got["calls"][0][1]).get("city"), str), got
    assert got["call_finish"] == "tool_calls", got
