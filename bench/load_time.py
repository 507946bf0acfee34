"""How long a large model takes to serve, and what its load locks in host memory.

Starts our server on a model three ways with the same placement (`serve` options after
`--`, e.g. a VRAM budget and the expert cache): read into host memory (the default with
weights in RAM on a GPU: page-locked), mapped (`--mmap`), and read with pinning refused
(`GGML_CUDA_NO_PINNED=1`, what ggml does when the driver will not lock the memory). For
each: seconds from the process's start to `/health` 200, the weights by llama.cpp buffer
(`onegpu_weight_buffer_bytes`: `CUDA_Host` is page-locked), the peak resident memory, one
answered request, and whether the log warns that weights are not page-locked.

    python -m bench.load_time --model SLICE.gguf -- --vram-budget 14GiB
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import httpx
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from bench.server_proc import start_server

MODES = {
    "read": ([], {}),
    "mapped": (["--mmap"], {}),
    "pinning refused": ([], {"GGML_CUDA_NO_PINNED": "1"}),
}
GiB = 1 << 30


def buffers(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            if s.name == "onegpu_weight_buffer_bytes":
                out[s.labels["buffer"]] = s.value
    return out


def one(model: str, mode: str, serve_args: list[str], work: Path) -> str:
    extra, env = MODES[mode]
    t0 = time.monotonic()
    srv = start_server(
        ["--model", model, "--served-model-name", "m", "--n-ctx", "4096", "--repro-slots", "0",
         *extra, *serve_args],
        work / f"load-{mode.replace(' ', '-')}.log", ready_timeout_s=900, env=env,
    )  # fmt: skip
    try:
        ready = time.monotonic() - t0
        client = OpenAI(base_url=srv.base_url, api_key="x", _strict_response_validation=True)
        r = client.completions.create(model="m", prompt="The load check", max_tokens=8)
        got = buffers(srv.url)
        rss = srv.peak_rss_mib() / 1024
        warned = "not page-locked" in srv.log()
    finally:
        srv.stop()
    pinned = sum(v for k, v in got.items() if k.endswith("_Host")) / GiB
    kinds = ", ".join(f"{k} {v / GiB:.1f}" for k, v in sorted(got.items()))
    answered = r.usage.completion_tokens if r.usage else 0
    return (f"| {mode} | {ready:.1f} | {pinned:.1f} | {kinds} | {rss:.1f} | "
            f"{'yes' if warned else 'no'} | {answered} |")  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    p.add_argument("--work", type=Path, default=Path("/tmp"))
    p.add_argument("serve_args", nargs="*", help="`one-gpu serve` options (after --)")
    a = p.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    size = Path(a.model).stat().st_size / GiB
    print(f"{a.model}: {size:.1f} GiB; serve options: {' '.join(a.serve_args)}")
    print("| load | s to /health 200 | page-locked GiB | weights by buffer, GiB | "
          "peak RSS GiB | log warns 'not page-locked' | tokens answered |")  # fmt: skip
    print("|---|---:|---:|---|---:|---|---:|")
    for mode in a.modes:
        print(one(a.model, mode, a.serve_args, a.work), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
