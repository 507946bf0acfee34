"""Run a server (ours, or llama.cpp's `llama-server`) as a subprocess on a free loopback
port and wait until it is ready; used by the end-to-end tests and the benchmarks."""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.vram import process_vram_mib

# the checkout: `python -m api.server.cli` runs from it
ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def peak_rss_mib(self) -> float:
        """Peak resident memory of the server process so far (VmHWM)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        raise RuntimeError("no VmHWM")

    def vram_mib(self) -> float | None:
        """GPU memory held by the process (nvidia-smi), None without a GPU."""
        return process_vram_mib(self.proc.pid)

    def stop(self) -> int:
        self.proc.terminate()
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def start_process(
    cmd: list[str],
    port: int,
    log_path: Path,
    ready_timeout_s: float = 300.0,
    env: dict[str, str] | None = None,
    ready_path: str = "/health",
) -> Server:
    """Start `cmd` (listening on `port`) and wait until `ready_path` answers 200."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with log_path.open("wb") as logf:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=logf, stderr=subprocess.STDOUT, env=env)
    server = Server(proc, port, log_path)
    deadline = time.monotonic() + ready_timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log()}")
        try:
            if httpx.get(server.url + ready_path, timeout=1.0).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.1)  # polling a readiness condition, bounded by the deadline
    server.stop()
    raise RuntimeError(f"server not ready in {ready_timeout_s}s:\n{server.log()}")


def start_server(
    args: list[str],
    log_path: Path,
    ready_timeout_s: float = 300.0,
    env: dict[str, str] | None = None,
) -> Server:
    """Start `one-gpu serve ARGS` on a free port (`env`: extra environment)."""
    port = free_port()
    cmd = [sys.executable, "-m", "api.server.cli", "serve", "--port", str(port), *args]
    return start_process(cmd, port, log_path, ready_timeout_s, env)


def start_many(starts: Sequence[Callable[[], Server]]) -> list[Server]:
    """Run the `starts` at once (each waits for its server to be ready): replicas load
    side by side. A failed start stops the servers that did start, then raises."""
    with ThreadPoolExecutor(max(1, len(starts))) as pool:
        futures = [pool.submit(start) for start in starts]
    started = [f.result() for f in futures if f.exception() is None]
    failed = [e for f in futures if (e := f.exception()) is not None]
    if failed:
        for srv in started:
            srv.stop()
        raise failed[0]
    return started


def served_model(path: str | None) -> Path:
    """The GGUF a benchmark serves: `path`, else the embedded default model."""
    if path:
        return Path(path)
    from engine.default_model import default_model_path

    return Path(default_model_path())


def add_pair_options(p: argparse.ArgumentParser) -> None:
    """Options of a benchmark that runs ours and llama-server on the same model."""
    p.add_argument("--gpu", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--peer-bin", help="prebuilt llama-server folder (default: build it)")
    p.add_argument("--cache", default=".bench")
    p.add_argument("--no-peer", action="store_true", help="ours only")
    p.add_argument("--ours-args", default="--repro-slots 0",
                   help="extra `one-gpu serve` options, quoted (default: no reproducible "
                   "lane, whose own KV would be memory llama-server does not get)")  # fmt: skip
    p.add_argument("--peer-args", default="", help="extra llama-server options, quoted")
    p.add_argument("--json", type=Path, help="write the raw results here")


def on_gpu(flag: bool | None) -> bool:
    """`--gpu`/`--no-gpu`, else whether this host has an NVIDIA GPU."""
    return flag if flag is not None else shutil.which("nvidia-smi") is not None
