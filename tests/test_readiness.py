"""Readiness: the server listens before the model has loaded, and says so — /health 503
`loading` and the API a 503 error body until it serves, then 200 — so a load balancer, a
container HEALTHCHECK or Kubernetes can tell a loading server from a dead one. In process
(the app as `one-gpu serve` builds it), with the load held at a gate: the real load, only
later."""

from __future__ import annotations

import logging
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from starlette.testclient import TestClient

import api.server.app
from api.server.cli import _parser, serve_settings
from bench.server_proc import free_port
from engine.load_progress import LoadProgress
from tests.tiny_gguf import Shape, write_hollow_llama, write_llama

ROOT = Path(__file__).resolve().parents[1]


def test_health_says_loading_until_the_model_serves_and_livez_stays_200(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    model = write_llama(tmp_path / "tiny.gguf", seed=2)
    args = _parser().parse_args(["serve", "--model", str(model), "--served-model-name", "tiny",
                                 "--n-ctx", "512", "--repro-slots", "0"])  # fmt: skip
    settings = serve_settings(args)
    gate = threading.Event()
    real_load = api.server.app.load_model

    def held_load(s: api.server.app.ServerSettings, progress: LoadProgress) -> object:
        assert gate.wait(60), "the test never opened the gate"
        return real_load(s, progress)

    monkeypatch.setattr(api.server.app, "load_model", held_load)
    caplog.set_level(logging.INFO, logger="engine.load_progress")
    with TestClient(api.server.app.build_app(settings)) as client:  # lifespan started: listening
        health = client.get("/health")
        assert health.status_code == 503
        assert health.json() == {"status": "loading", "progress": 0.0}
        live = client.get("/livez")  # liveness: a loading server is not restarted
        assert (live.status_code, live.json()) == (200, {"status": "alive"})
        early = client.post("/v1/completions", json={"model": "tiny", "prompt": "a"})
        assert early.status_code == 503
        assert "loading" in early.json()["error"]["message"]
        scrape = client.get("/metrics")  # Prometheus sees the process up, and loading
        assert scrape.status_code == 200 and "onegpu_loading 1.0" in scrape.text
        assert "onegpu_load_progress 0.0000" in scrape.text
        gate.set()
        deadline = time.monotonic() + 60
        while client.get("/health").status_code != 200:  # the load finishing, bounded
            assert time.monotonic() < deadline, "the model never came up"
            time.sleep(0.05)
        done = client.post(
            "/v1/completions", json={"model": "tiny", "prompt": "a", "max_tokens": 2}
        )
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 2
        assert "onegpu_loading 0.0" in client.get("/metrics").text
        assert client.get("/livez").status_code == 200  # serving
        client.app.state.server.draining = True  # type: ignore[attr-defined]  # SIGTERM's
        assert client.get("/health").status_code == 503
        assert client.get("/livez").status_code == 200  # draining: not a restart either
        assert 'route="/livez"' in client.get("/metrics").text  # a route label of its own
    # the log followed the load, a line a tenth of the weights
    lines = [r.getMessage() for r in caplog.records if r.name == "engine.load_progress"]
    assert lines[-1].startswith("loading the weights: 100% in ") and "GiB/s" in lines[-1]


def test_a_model_that_does_not_load_ends_the_server_with_an_error(tmp_path: Path) -> None:
    """Listening first must not turn a failed load into a server that answers 503 forever:
    it stops, exits 1 and says why."""
    good = write_llama(tmp_path / "tiny.gguf", seed=2).read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good[: len(good) // 2])  # a valid header, tensors missing
    out = subprocess.run(
        [sys.executable, "-m", "api.server.cli", "serve", "--model", str(cut), "--port",
         str(free_port()), "--repro-slots", "0"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert out.returncode == 1
    assert f"could not load the model: llama.cpp could not load {cut}" in out.stderr


def test_a_stop_signal_during_the_load_abandons_it_and_exits_cleanly(tmp_path: Path) -> None:
    """A large model takes minutes to load: a server stopped in that time stops at the next
    tensor (the progress it had reached in the log), exits as a stopped server does and
    never serves. The model
    is 5.3 GB of zeros in a sparse file, read whole (`--no-mmap`): ~3.5 s here, while the
    signal comes as soon as /metrics shows the first tensors in."""
    shape = Shape(n_layer=16, n_embd=4096, n_head=32, n_head_kv=8, head_dim=128, n_ff=11008)
    model = write_hollow_llama(tmp_path / "big.gguf", shape)
    port = free_port()
    log_path = tmp_path / "server.log"
    with log_path.open("wb") as logf:
        proc = subprocess.Popen(
            [sys.executable, "-m", "api.server.cli", "serve", "--model", str(model), "--no-mmap",
             "--port", str(port), "--n-ctx", "512", "--repro-slots", "0"],
            cwd=ROOT, stdout=logf, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        progress = 0.0
        while progress == 0.0:  # until the load is under way, bounded by the deadline
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, "the load never showed progress"
            try:
                text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
                progress = float(re.findall(r"^onegpu_load_progress (\S+)$", text, re.M)[0])
            except httpx.TransportError:  # not listening yet
                time.sleep(0.02)  # polling a condition, bounded by the deadline
        assert progress < 1.0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) in (0, -signal.SIGTERM)  # (uvicorn re-raises what it handled)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = log_path.read_text()
    cut = re.search(r"load of \S+ cancelled at (\d+)%: stopping", out)
    assert cut is not None and int(cut.group(1)) < 100, out
    assert "serving " not in out and "Traceback" not in out
