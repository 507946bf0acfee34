"""Drive a server with aiperf (NVIDIA's load generator) and read back its figures.

aiperf lives in its own virtualenv under the bench cache (it pins many packages of its
own); it is given a Hugging Face tokenizer exported from the GGUF (offline) and takes
generated-token counts from the servers' own `usage`.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
AIPERF = "aiperf==0.13.0"
ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Cell:
    """One aiperf run's figures (times in ms, rates in tokens/s)."""

    output_tok_s: float  # generated tokens / benchmark wall time, all users
    per_user_tok_s: float  # mean of each request's decode rate
    slowest_user_tok_s: float
    ttft_p50: float
    ttft_p99: float
    itl_p50: float
    itl_p99: float
    requests: int
    output_tokens: int
    # ms from a stream's last text to its end (usage, [DONE], the body closed): what a
    # closed-loop user waits between one answer and the next beside TTFT (bench.loadgen)
    tail_p50: float = 0.0


def ensure_aiperf(cache: Path) -> Path:
    venv = cache / "aiperf-venv"
    exe = venv / "bin" / "aiperf"
    if not exe.exists():
        log.info("installing %s into %s", AIPERF, venv)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
        subprocess.run([*pip, AIPERF, "gguf==0.19.0"], check=True)
    return exe


def ensure_tokenizer(aiperf: Path, model: Path, cache: Path) -> Path:
    out = cache / "tokenizers" / model.stem
    if not (out / "tokenizer.json").exists():
        py = aiperf.parent / "python"
        subprocess.run(
            [str(py), "-m", "bench.export_tokenizer", str(model), str(out)], check=True, cwd=ROOT
        )
    return out


def run_aiperf(
    aiperf: Path,
    *,
    url: str,
    model: str,
    tokenizer: Path,
    concurrency: int,
    requests: int,
    isl: int,
    osl: int,
    sampling: dict[str, Any],
    out_dir: Path,
    seed: int = 1,
) -> Cell:
    # Every request gets a distinct prompt and there is no warm-up phase (it would replay
    # the measured prompts); the caller varies the seed per cell. llama-server reuses a
    # slot's KV for a repeated prompt prefix, and this server has no prefix cache yet.
    fixed = (
        "--endpoint-type completions --streaming --ui none --no-server-metrics "
        "--use-server-token-count --isl-stddev 0 --osl-stddev 0 --workers-max 1 "
        "--dataset-sampling-strategy sequential --extra-inputs ignore_eos:true "
        "--extra-inputs cache_prompt:false --connection-reuse-strategy never"
    )
    cmd = [str(aiperf), "profile", *fixed.split()]
    cmd += ["--model", model, "--url", url, "--tokenizer", str(tokenizer)]
    cmd += ["--concurrency", str(concurrency), "--request-count", str(requests)]
    cmd += ["--num-dataset-entries", str(requests), "--random-seed", str(seed)]
    cmd += ["--isl", str(isl), "--osl", str(osl), "--artifact-dir", str(out_dir)]
    for k, v in sampling.items():
        cmd += ["--extra-inputs", f"{k}:{v}"]
    out_dir.mkdir(parents=True, exist_ok=True)
    with (out_dir / "aiperf.stdout").open("w") as f:
        subprocess.run(cmd, check=True, stdout=f, stderr=subprocess.STDOUT, cwd=out_dir)
    return cell_from_aiperf(json.loads((out_dir / "profile_export_aiperf.json").read_text()))


def cell_from_aiperf(d: dict[str, Any]) -> Cell:
    """Our figures from aiperf's `profile_export_aiperf.json`."""
    if d.get("error_summary"):
        raise RuntimeError(f"aiperf saw errors: {d['error_summary']}")
    return Cell(
        output_tok_s=d["output_token_throughput"]["avg"],
        per_user_tok_s=d["output_token_throughput_per_user"]["avg"],
        slowest_user_tok_s=d["output_token_throughput_per_user"]["min"],
        ttft_p50=d["time_to_first_token"]["p50"],
        ttft_p99=d["time_to_first_token"]["p99"],
        itl_p50=d["inter_token_latency"]["p50"],
        itl_p99=d["inter_token_latency"]["p99"],
        requests=int(d["request_count"]["avg"]),
        output_tokens=int(d["total_output_tokens"]["avg"]),
    )
