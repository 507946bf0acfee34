"""Peak GPU memory of a process while it runs: nvidia-smi polled from a thread.

Polling can miss a short spike, so the figure is a lower bound on the true peak; the
benchmarks poll every 0.2 s over runs of tens of seconds, where the steady footprint
(weights, KV, compute buffers) is what matters.
"""

from __future__ import annotations

import subprocess
import threading


def process_vram_mib(pid: int) -> float | None:
    """GPU memory held by `pid` now; None without a GPU or when it holds none."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None
    for line in out.splitlines():
        p, mem = (x.strip() for x in line.split(","))
        if p == str(pid):
            return float(mem)
    return None


class VramPeak:
    """`with VramPeak(pid) as v: ...` then `v.peak_mib` (None when never seen)."""

    def __init__(self, pid: int, every_s: float = 0.2) -> None:
        self.pid = pid
        self.every_s = every_s
        self.peak_mib: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            v = process_vram_mib(self.pid)
            if v is not None and (self.peak_mib is None or v > self.peak_mib):
                self.peak_mib = v
            self._stop.wait(self.every_s)

    def __enter__(self) -> VramPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
