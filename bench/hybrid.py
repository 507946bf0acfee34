"""Hybrid MoE serving on one GPU: a VRAM budget that leaves part of the experts in RAM.

In one run, for each layout — all on the GPU; our planner under `--vram-budget`; every
routed expert in host RAM (`--cpu-moe`) — it serves the model with our server and measures
the all-N decode rate (N requests together, tokens per second while all N decode: what
`llama-batched-bench` reports as S_TG), and runs `llama-batched-bench` with the matching
llama.cpp placement: `--n-cpu-moe N` keeps the first N layers' experts on the CPU. For the
budget row it tries the N our plan implies and one layer fewer, and reports which of them
fit the budget by their measured VRAM peak. VRAM is the process's own, from nvidia-smi.

    python3 -m bench.hybrid --model M.gguf --peer-bin DIR --vram-budget 10GiB
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.batched_bench import run_batched_bench
from bench.compare import Setup, warm_up
from bench.loadgen import run_lockstep
from bench.vram import VramPeak

log = logging.getLogger("bench")
GREEDY = {"temperature": 0}


@dataclass
class Row:
    layout: str
    ours_args: list[str]
    peers: list[tuple[str, list[str]]]  # (label, llama-batched-bench extra args)
    ours: dict[int, list[float]] = field(default_factory=dict)  # one figure per repeat
    ours_vram: float | None = None  # the highest peak over repeats
    peer: dict[str, dict[int, list[float]]] = field(default_factory=dict)
    peer_vram: dict[str, float | None] = field(default_factory=dict)


def _plan_cpu_layers(model: Path, budget: str, kv_tokens: int) -> tuple[str, int, str]:
    """The budget in bytes, the layers whose experts our plan does not hold entirely on the
    GPU (llama.cpp's `--n-cpu-moe` N for the same budget), and the plan's table.

    `half-experts` is the non-expert part, the KV, half the routed experts' bytes and the
    buffers with llama.cpp's own fitting margin (1 GiB) — not our server's margin, so the
    budget does not move with what our planner reserves, and any VRAM the plan leaves
    unused is room the peer may take (it is measured, not planned)."""
    from api.server.planning import PlanRequest, plan_model
    from engine.gguf_meta import read_meta
    from engine.plan import GiB, PlanOptions, expert_layer, format_plan, vram_for_expert_share

    meta = read_meta(model)
    # the server's: --repro-slots 0, n_ubatch 512, 32 sequences
    opts = PlanOptions(kv_tokens=kv_tokens, n_outputs=64)  # device greedy: 2 x 32 ids
    if budget == "half-experts":  # llama.cpp's buffers: logits for every row of a ubatch
        fixed = PlanOptions(kv_tokens=kv_tokens, vram_margin=GiB)
        budget = str(vram_for_expert_share(meta, fixed, 0.5))
    plan = plan_model(meta, PlanRequest(vram_budget=budget, options=opts))
    moe_layers = {expert_layer(t.name) for t in plan.tensors} - {-1}
    return budget, len(moe_layers) - plan.expert_layers_on_gpu, format_plan(plan)


def run(args: argparse.Namespace) -> list[Row]:
    model = Path(args.model)
    conc = args.concurrency
    setup = Setup.sized(model, conc, args.isl, args.osl, args.threads, gpu=True)
    # Our server with its default threads unless --threads is given: with tensors in RAM it
    # leaves a core to its Python threads (engine.config); the peer gets every core.
    setup.ours_default_threads = not args.threads
    budget, n_cpu, plan_text = _plan_cpu_layers(model, args.vram_budget, setup.n_ctx)
    args.vram_budget = budget
    print(plan_text, flush=True)
    rows = {
        "gpu": Row("all on the GPU", [], [("n-cpu-moe 0", [])]),
        "planned": Row(
            f"planned, --vram-budget {args.vram_budget}",
            ["--vram-budget", args.vram_budget],
            [(f"n-cpu-moe {n}", ["--n-cpu-moe", str(n)]) for n in (n_cpu, n_cpu - 1) if n >= 0],
        ),
        "cpu-moe": Row("experts in RAM (--cpu-moe)", ["--cpu-moe"], [("cpu-moe", ["--cpu-moe"])]),
    }
    chosen = [rows[k] for k in args.layouts]
    bin_dir = Path(args.peer_bin)
    run_dir = Path(args.cache) / "runs" / ("hybrid-" + time.strftime("%Y%m%d-%H%M%S"))
    run_dir.mkdir(parents=True, exist_ok=True)
    for rep in range(args.repeats):  # ours and the peers alternate within each repeat
        for i, row in enumerate(chosen):
            _run_ours(args, setup, row, run_dir / f"ours-{rep}-{i}.log")
            for label, extra in row.peers:
                vram: list[float] = []
                rates = run_batched_bench(
                    bin_dir / "llama-batched-bench", model, npl=conc, isl=args.isl,
                    osl=args.osl, n_ctx=setup.n_ctx, threads=setup.threads, gpu=True,
                    log_path=run_dir / f"batched-{rep}-{i}-{label.replace(' ', '_')}.log",
                    extra=(*extra, *args.peer_args.split()), vram=vram,
                )  # fmt: skip
                for n, r in rates.items():
                    row.peer.setdefault(label, {}).setdefault(n, []).append(r)
                if vram:
                    row.peer_vram[label] = max(vram[0], row.peer_vram.get(label) or 0.0)
                print(f"peer  {label}: {rates} (VRAM {vram[:1]})", flush=True)
    return chosen


def _run_ours(args: argparse.Namespace, setup: Setup, row: Row, log_path: Path) -> None:
    setup.ours_extra = ["--repro-slots", "0", *args.ours_args.split(), *row.ours_args]
    srv = setup.ours(log_path)
    try:
        with VramPeak(srv.proc.pid) as peak:
            warm_up(srv, setup.name)
            for n in args.concurrency:
                rate = asyncio.run(
                    run_lockstep(
                        srv.base_url, model=setup.name, concurrency=n, waves=args.waves,
                        isl=args.isl, osl=args.osl, sampling=GREEDY,
                    )
                )  # fmt: skip
                row.ours.setdefault(n, []).append(rate)
                print(f"ours  {row.layout} N={n}: {rate:.1f} tok/s", flush=True)
        if peak.peak_mib is not None:
            row.ours_vram = max(peak.peak_mib, row.ours_vram or 0.0)
        if row.ours_args:
            _print_pick_share(srv.url, row.layout)
    finally:
        srv.stop()


def _print_pick_share(url: str, layout: str) -> None:
    """What the router telemetry saw during the run (the server samples 2% of steps)."""
    from api.server.experts_client import fetch_report

    try:
        r = fetch_report(url, 5)
    except Exception as e:  # telemetry off, or not an MoE model: the run still counts
        print(f"experts {layout}: no telemetry ({e})", flush=True)
        return
    print(
        f"experts {layout}: {r.sampled_steps} sampled steps, GPU pick share "
        f"{r.gpu_pick_share:.3f}, hot-set share {r.hot_set_pick_share:.3f}",
        flush=True,
    )


def report(rows: list[Row], budget_mib: float) -> str:
    out = [
        "| layout | N | ours tok/s | ours VRAM MiB | llama-batched-bench | its tok/s "
        "| its VRAM MiB | fits budget | ours/it |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        for label, rates in row.peer.items():
            pv = row.peer_vram.get(label)
            fits = "yes" if pv is not None and pv <= budget_mib else "no"
            for n, ours_runs in sorted(row.ours.items()):
                ours = statistics.median(ours_runs)
                theirs = statistics.median(rates.get(n, [0.0]))
                ratio = f"{ours / theirs:.2f}" if theirs else "-"
                ov = f"{row.ours_vram:.0f}" if row.ours_vram is not None else "-"
                pvs = f"{pv:.0f}" if pv is not None else "-"
                out.append(
                    f"| {row.layout} | {n} | {ours:.1f} | {ov} | {label} | {theirs:.1f} | {pvs} "
                    f"| {fits} | {ratio} |"
                )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--peer-bin", required=True, help="folder with llama-batched-bench")
    p.add_argument(
        "--vram-budget", required=True,
        help="e.g. 10GiB, or half-experts: room for about half the routed experts",
    )  # fmt: skip
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--isl", type=int, default=128)
    p.add_argument("--osl", type=int, default=64)
    p.add_argument("--waves", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="both sides (default: each its own)")
    p.add_argument("--ours-args", default="", help='extra server options, e.g. "--threads 15"')
    p.add_argument(
        "--peer-args", default="", help='extra llama-batched-bench options, e.g. "-lm none"'
    )
    p.add_argument("--layouts", nargs="+", choices=["gpu", "planned", "cpu-moe"],
                   default=["gpu", "planned", "cpu-moe"])  # fmt: skip
    p.add_argument("--repeats", type=int, default=1, help="alternate all; report medians")
    p.add_argument("--cache", default=".bench")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    from engine.plan import parse_size

    rows = run(args)
    print(report(rows, parse_size(args.vram_budget) / 2**20))


if __name__ == "__main__":
    main()
