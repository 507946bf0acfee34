from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from bench.server_proc import Server, start_server

MODEL = "gemma-3-270m"


@pytest.fixture(scope="session", autouse=True)
def _state_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The servers the tests start save router pick counts (engine.pick_store) under a
    directory of this run, not the user's state directory."""
    old = os.environ.get("ONEGPU_STATE_DIR")
    os.environ["ONEGPU_STATE_DIR"] = str(tmp_path_factory.mktemp("state"))
    yield
    if old is None:
        del os.environ["ONEGPU_STATE_DIR"]
    else:
        os.environ["ONEGPU_STATE_DIR"] = old


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The embedded model served as `make serve` would, with a small per-step budget so
    long prompts are visibly chunked, and a set stall target (the default lets a CPU's
    steps run longer where it needs larger chunks to prefill efficiently)."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    srv = start_server(
        [
            "--n-ctx",
            "16384",
            "--n-seq-max",
            "24",
            "--max-num-batched-tokens",
            "512",
            "--max-stall-ms",
            "250",
        ],
        log,
    )
    yield srv
    srv.stop()
