"""Run a server (ours, or llama.cpp's `llama-server`) as a subprocess on a free loopback
port and wait until it is ready; used by the end-to-end tests and the benchmarks."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.vram import process_vram_mib

ROOT = Path(__file__).resolve().parent.parent  # the checkout: `python -m api.cli` runs from it


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
) -> Server:
    """Start `cmd` (listening on `port`) and wait until /health answers 200."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with log_path.open("wb") as logf:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=logf, stderr=subprocess.STDOUT, env=env)
    server = Server(proc, port, log_path)
    deadline = time.monotonic() + ready_timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log()}")
        try:
            if httpx.get(server.url + "/health", timeout=1.0).status_code == 200:
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
    cmd = [sys.executable, "-m", "api.cli", "serve", "--port", str(port), *args]
    return start_process(cmd, port, log_path, ready_timeout_s, env)
