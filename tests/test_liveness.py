"""Liveness apart from readiness: /livez 200 while the model loads, while serving and
while draining — the three states in which /health says 503, 200, 503. In process (the
app as `one-gpu serve` builds it), the load held at a gate, on a tiny generated model."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from starlette.testclient import TestClient

import api.app
from api.cli import _parser, serve_settings
from engine.load_progress import LoadProgress
from tests.tiny_gguf import write_llama


def test_livez_answers_while_loading_serving_and_draining(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = write_llama(tmp_path / "tiny.gguf", seed=2)
    args = _parser().parse_args(["serve", "--model", str(model), "--served-model-name", "tiny",
                                 "--n-ctx", "512", "--repro-slots", "0"])  # fmt: skip
    gate = threading.Event()
    real_load = api.app._load

    def held_load(s: api.app.ServerSettings, progress: LoadProgress) -> object:
        assert gate.wait(60), "the test never opened the gate"
        return real_load(s, progress)

    monkeypatch.setattr(api.app, "_load", held_load)
    app = api.app.build_app(serve_settings(args))
    with TestClient(app) as client:
        assert client.get("/health").status_code == 503  # loading
        live = client.get("/livez")
        assert (live.status_code, live.json()) == (200, {"status": "alive"})
        gate.set()
        deadline = time.monotonic() + 60
        while client.get("/health").status_code != 200:  # the load finishing, bounded
            assert time.monotonic() < deadline, "the model never came up"
            time.sleep(0.05)
        assert client.get("/livez").status_code == 200  # serving
        app.state.server.draining = True  # what the first SIGTERM sets (api.serve)
        assert client.get("/health").status_code == 503
        assert client.get("/livez").status_code == 200
        assert 'route="/livez"' in client.get("/metrics").text  # a route of its own label
