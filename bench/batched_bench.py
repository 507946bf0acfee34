"""The backend's ceiling: `llama-batched-bench` on the same model and settings.

It prefills N prompts, then decodes N sequences together with no sampling, HTTP or
Python: its decode rate (S_TG) is what a server on these libraries can at best approach.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from bench.vram import VramPeak


def run_batched_bench(
    exe: Path,
    model: Path,
    *,
    npl: list[int],
    isl: int,
    osl: int,
    n_ctx: int,
    threads: int,
    gpu: bool,
    log_path: Path,
    extra: tuple[str, ...] = (),
    vram: list[float] | None = None,
) -> dict[int, float]:
    """Decode tok/s summed over N sequences (S_TG), by N. `extra`: more arguments (e.g.
    `--n-cpu-moe 24`); `vram`, when given, receives the process's peak GPU MiB."""
    cmd = [
        str(exe),
        "-m",
        str(model),
        "-c",
        str(n_ctx),
        "-b",
        "2048",
        "-ub",
        "512",
        "-npp",
        str(isl),
        "-ntg",
        str(osl),
        "-npl",
        ",".join(map(str, npl)),
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "-fa",
        "auto",
        "-kvu",
        "-ngl",
        "99" if gpu else "0",
        *extra,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with VramPeak(proc.pid) as peak:
        stdout, stderr = proc.communicate()
    log_path.write_text(" ".join(cmd) + "\n" + stdout + stderr)
    if proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, cmd, stdout, stderr)
    if vram is not None and peak.peak_mib is not None:
        vram.append(peak.peak_mib)
    return parse(stdout)


def parse(table: str) -> dict[int, float]:
    rows: dict[int, float] = {}
    header: list[str] | None = None
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if "S_TG t/s" in cells:
            header = cells
        elif header and len(cells) == len(header) and cells[0].isdigit():
            rec = dict(zip(header, cells, strict=True))
            rows[int(rec["B"])] = float(rec["S_TG t/s"])
    if not rows:
        raise RuntimeError(f"no results in llama-batched-bench output:\n{table}")
    return rows
