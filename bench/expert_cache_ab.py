"""The routed-expert cache against llama.cpp's best whole-layer placement, at equal VRAM.

For a VRAM size given as "the routed-expert bytes of K whole layers" and for each routing
(the model as written, uniform; and a copy rewritten by `bench.skew_router` at its
defaults, skewed and temporally local), in one run on one machine:

- llama-server `--n-cpu-moe L-K` (its best layout for that VRAM: the last K layers' experts
  on the GPU, the rest in RAM), through its OpenAI endpoint;
- ours with the same whole layers and no cache (`--cpu-experts` for the same layers);
- ours with every expert in RAM and a cache of S slots (+ n_expert_used pad slots) in each
  layer: S = K * n_expert / L - n_expert_used, the same VRAM;
- ours planned (`--expert-cache-slots auto`) under the VRAM the peer's process held, with the
  pick counts the cached server saw on this routing (`--pick-counts`): the split the planner
  chooses for that traffic, whole layers or slots, and a bank filled from those counts
  before the first request (the S slots row starts empty and fills by misses).

Each server gets the same users: N at once (1, 4, 8), each a prompt of random token ids and
`--osl` sampled tokens (`ignore_eos`), after a warm-up. Reported: output tok/s over the
wall time, and the per-user decode rate (tokens after the first / time after the first).
Our servers also report the GPU's share of expert picks: the cache's hits, the sampled
picks of resident layers, and the planner's expectation.

    python -m bench.expert_cache_ab --model M.gguf --peer-bin DIR --layers 15 27
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import re
import shutil
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.aiperf_run import Cell
from bench.compare import Setup, warm_up
from bench.loadgen import run_load
from bench.routing_curve import _counter
from bench.server_proc import Server
from bench.skew_router import skew_router
from bench.vram import VramPeak
from engine.gguf_meta import read_meta
from engine.plan import expert_layer

log = logging.getLogger("bench")
EXPERTS = "ffn_(up|down|gate|gate_up)_exps"


@dataclass
class Variant:
    label: str
    peer: bool
    args: list[str]
    auto: bool = False  # ours planned under the peer's VRAM with this routing's counts
    cells: dict[int, list[Cell]] = field(default_factory=dict)
    vram_mib: float | None = None
    notes: list[str] = field(default_factory=list)


def references(n_expert: int) -> list[Variant]:
    """Where the cache's path ends: every expert on the GPU, and every expert in RAM with a
    bank that holds them all (uploaded in the first steps, then every pick a hit) — what
    the two chains and their host round trip cost beyond the GPU's own compute."""
    return [
        Variant("ours, all on the GPU", False, []),
        Variant(
            "ours, --cpu-moe, every expert cached",
            False,
            [
                "--cpu-moe",
                "--expert-cache-slots",
                str(n_expert),
                "--expert-cache-uploads",
                str(n_expert),
            ],
        ),
    ]


def variants(n_layer: int, n_expert: int, n_used: int, k: int, admission: float) -> list[Variant]:
    """The four layouts of one VRAM size (module doc)."""
    n_cpu = n_layer - k
    slots = k * n_expert // n_layer - n_used
    in_ram = "|".join(str(i) for i in range(n_cpu))
    policy = ["--expert-cache-admission", str(admission)]
    return [
        Variant(f"llama-server --n-cpu-moe {n_cpu}", True, ["--n-cpu-moe", str(n_cpu)]),
        Variant(
            f"ours, the same {k} whole layers",
            False,
            ["--cpu-experts", rf"blk\.({in_ram})\.{EXPERTS}", "--expert-cache-slots", "0"],
        ),
        Variant(
            f"ours, --cpu-moe + {slots} slots",
            False,
            ["--cpu-moe", "--expert-cache-slots", str(slots), *policy],
        ),
        Variant(
            "ours, auto under the peer's VRAM",
            False,
            ["--expert-cache-slots", "auto", *policy],
            auto=True,
        ),
    ]


def _load(url: str, name: str, users: list[int], isl: int, osl: int, seed: int) -> list[Cell]:
    sampling = {"temperature": 1.0, "seed": seed}
    return [
        asyncio.run(
            run_load(
                url,
                model=name,
                concurrency=n,
                requests=n,
                isl=isl,
                osl=osl,
                sampling=sampling,
                seed=seed + n,
            )
        )
        for n in users
    ]


def _expert_notes(srv: Server, log_path: Path) -> list[str]:
    """The GPU's share of picks as the server reports it, and the plan's expectation."""
    notes = []
    text = httpx.get(srv.url + "/metrics", timeout=30).text
    with contextlib.suppress(KeyError):  # no cache
        hits = _counter(text, "onegpu_expert_cache_picks_total", result="hit")
        misses = _counter(text, "onegpu_expert_cache_picks_total", result="miss")
        uploads = _counter(text, "onegpu_expert_cache_uploads_total")
        notes.append(
            f"cache hits {hits / max(1.0, hits + misses):.1%} of its picks, {uploads:.0f} uploads"
        )
    with contextlib.suppress(KeyError):  # no telemetry
        share = _counter(text, "onegpu_expert_gpu_pick_share")
        notes.append(f"sampled GPU-resident pick share {share:.1%}")
    plan = re.findall(
        r"expected GPU pick share [^\n]*|routed experts on GPU: [^\n]*",
        log_path.read_text(errors="replace"),
    )
    notes += plan[-2:]
    return notes


def run(args: argparse.Namespace) -> list[tuple[str, int, list[Variant]]]:
    model = Path(args.model).resolve()
    meta = read_meta(str(model))
    n_layer = len({expert_layer(t.name) for t in meta.tensors} - {-1})
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    models = {"uniform": model}
    if "skewed" in args.routings:
        skewed = work / "skewed.gguf"
        if not skewed.exists():  # a copy: the uniform one is measured too
            t0 = time.monotonic()
            shutil.copyfile(model, work / "skewed.tmp")
            skew_router(work / "skewed.tmp", skew=1.0, locality=0.5, context=64, boost=8.0)
            (work / "skewed.tmp").rename(skewed)
            log.info("skewed copy written in %.0f s", time.monotonic() - t0)
        models["skewed"] = skewed
    setup = Setup.sized(model, args.users, args.isl, args.osl, args.threads, gpu=True)
    results = []
    for routing in args.routings:
        setup.model = models[routing]
        counts = work / f"{routing}-counts.json"
        if args.references and routing == args.routings[0]:
            refs = references(meta.n_expert)
            for v in refs:
                _measure(args, setup, v, refs, counts, work / f"{routing}-ref")
            results.append((routing, 0, refs))
            print(report([(routing, 0, refs)]), flush=True)
        for k in args.layers:
            rows = variants(n_layer, meta.n_expert, meta.n_expert_used, k, args.admission)
            for rep in range(args.repeats):
                for v in rows:
                    _measure(args, setup, v, rows, counts, work / f"{routing}-{k}-{rep}")
            results.append((routing, k, rows))
            print(report([(routing, k, rows)]), flush=True)
    return results


def _measure(
    args: argparse.Namespace,
    setup: Setup,
    v: Variant,
    rows: list[Variant],
    counts: Path,
    stem: Path,
) -> None:
    log_path = stem.with_name(f"{stem.name}-{rows.index(v)}.log")
    if v.peer:
        setup.theirs_extra = v.args
        srv = setup.theirs(Path(args.peer_bin) / "llama-server", log_path)
    else:
        extra = list(v.args)
        if v.auto:
            peer = rows[0].vram_mib
            if peer is None:
                v.notes.append("no peer VRAM figure: not run")
                return
            extra += ["--vram-budget", f"{int(peer)}MiB"]
            if counts.exists():
                extra += ["--pick-counts", str(counts)]
        # no counts saved between our servers: each starts as its row says (the slots row
        # with an empty bank; auto with the counts it is given, which also fill its bank)
        setup.ours_extra = ["--repro-slots", "0", "--log-level", "info", "--state-dir", "none",
                            *extra]  # fmt: skip
        srv = setup.ours(log_path)
    try:
        with VramPeak(srv.proc.pid) as peak:
            warm_up(srv, setup.name)
            cells = _load(srv.base_url, setup.name, args.users, args.isl, args.osl, args.seed)
        for n, c in zip(args.users, cells, strict=True):
            v.cells.setdefault(n, []).append(c)
            print(
                f"{v.label} N={n}: {c.output_tok_s:.1f} tok/s, per user {c.per_user_tok_s:.1f}",
                flush=True,
            )
        if peak.peak_mib is not None:
            v.vram_mib = max(peak.peak_mib, v.vram_mib or 0.0)
        if not v.peer:
            v.notes = _expert_notes(srv, log_path)
            if "--cpu-moe" in v.args:  # what the next start of this routing plans for
                counts.write_bytes(httpx.get(srv.url + "/experts/counts", timeout=30).content)
    finally:
        srv.stop()


def report(results: list[tuple[str, int, list[Variant]]]) -> str:
    out = [
        "| routing | VRAM for experts | layout | VRAM MiB | N | tok/s | per user | vs peer |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for routing, k, rows in results:
        peer = rows[0] if rows[0].peer else None
        for v in rows:
            vram = f"{v.vram_mib:.0f}" if v.vram_mib is not None else "-"
            for n, cells in sorted(v.cells.items()):
                tok = statistics.median(c.output_tok_s for c in cells)
                user = statistics.median(c.per_user_tok_s for c in cells)
                theirs = peer.cells.get(n) if peer else None
                ratio = tok / statistics.median(c.output_tok_s for c in theirs) if theirs else 0
                size = f"{k} layers" if k else "reference"
                out.append(
                    f"| {routing} | {size} | {v.label} | {vram} | {n} | {tok:.1f} "
                    f"| {user:.1f} | {ratio:.2f} |"
                )
        for v in rows:
            if v.notes:
                out.append(f"| {routing} | {k or '-'} | {v.label}: {'; '.join(v.notes)} |||||||")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True, help="an MoE GGUF with F32/F16 routers")
    p.add_argument("--peer-bin", required=True, help="folder with llama-server")
    p.add_argument(
        "--layers",
        type=int,
        nargs="+",
        default=[15, 27],
        help="VRAM sizes: the routed-expert bytes of K whole layers",
    )
    p.add_argument(
        "--routings", nargs="+", choices=["skewed", "uniform"], default=["skewed", "uniform"]
    )
    p.add_argument("--users", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--isl", type=int, default=64)
    p.add_argument("--osl", type=int, default=128)
    p.add_argument("--threads", type=int, default=0, help="both servers (default: all cores)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument(
        "--admission", type=float, default=0.0, help="our cached servers' --expert-cache-admission"
    )
    p.add_argument(
        "--references",
        action="store_true",
        help="also all on the GPU, and every expert cached (each routing)",
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--work", default=".bench/expert-cache-ab")
    p.add_argument("--json", type=Path, help="write the figures here too")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    results = run(args)
    print(report(results))
    if args.json:
        args.json.write_text(
            json.dumps(
                [
                    {
                        "routing": r,
                        "layers": k,
                        "layout": v.label,
                        "vram_mib": v.vram_mib,
                        "notes": v.notes,
                        "cells": {n: [c.output_tok_s for c in cs] for n, cs in v.cells.items()},
                        "per_user": {
                            n: [c.per_user_tok_s for c in cs] for n, cs in v.cells.items()
                        },
                    }
                    for r, k, rows in results
                    for v in rows
                ],
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
