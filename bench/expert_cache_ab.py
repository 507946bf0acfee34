"""The routed-expert cache against llama.cpp's best whole-layer placement, at equal VRAM.

For a VRAM size given as "the routed-expert bytes of K layers" (`--layers`; K may be a
fraction: a layer's gate, up and down tensors are placed one by one) or as a share of all
of them (`--vram-share`), and for each routing of `bench.skew_router`'s presets (`uniform`:
the model as written; `skewed`; `measured`, a real model's LRU curve), set in place in the
model file (its routing tensors saved beside the work files the first time, the file as
written again at the end), in one run on one machine:

- llama-server with the last K layers' expert tensors on the GPU and the rest in RAM
  (`-ot REGEX=CPU`; `--n-cpu-moe L-K` for whole K): its best layout for that VRAM — a
  layer with any expert tensor in RAM pays the host round trip, so whole layers on the GPU
  and at most one split layer;
- ours with the same tensors in RAM and no cache (`--cpu-experts REGEX`);
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
picks of resident layers, and the planner's expectation. With `--json`, every layout's
split (resident, cached and uncached layers in RAM, the cache's hit share) goes with its
figures: what `bench.hybrid_model` fits its constants to.

    python -m bench.expert_cache_ab --model M.gguf --peer-bin DIR --layers 15 27
    python -m bench.expert_cache_ab --model SLICE.gguf --peer-bin DIR --vram-share 0.38 \\
        --routings measured skewed uniform
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import re
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
from bench.skew_router import PRESETS, preset, set_routing
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
    split: dict[str, float] = field(default_factory=dict)  # bench.hybrid_model.Layout
    hit_by_users: dict[int, float] = field(default_factory=dict)  # the cache's, each N
    resident: float | None = None  # expert layers on the GPU as placed (None: all, or the
    # layers the cache leaves resident)


def misses_on_gpu(rows: list[Variant]) -> list[Variant]:
    """Each of our cached rows again with the misses computed by the GPU from host RAM in
    place (`--expert-cache-misses gpu`, patch 0006): no CPU split in a cached layer."""
    cached = [v for v in rows if not v.peer and "--expert-cache-slots" in v.args
              and v.args[v.args.index("--expert-cache-slots") + 1] != "0"]  # fmt: skip
    return rows + [Variant(v.label + ", misses on the GPU", False,
                           [*v.args, "--expert-cache-misses", "gpu"], auto=v.auto,
                           resident=v.resident) for v in cached]  # fmt: skip


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


def in_ram_regex(n_layer: int, tensors: int) -> str:
    """The expert tensors left in RAM when the last `tensors` of the 3 * n_layer (gate, up,
    down a layer) are on the GPU: whole layers from the last down, then one layer's down,
    up, gate in that order."""
    whole, part = divmod(tensors, 3)
    ram = [str(i) for i in range(n_layer - whole - (1 if part else 0))]
    groups = [rf"blk\.({'|'.join(ram)})\.{EXPERTS}"] if ram else []
    if part:
        left = ["gate", "up", "down"][: 3 - part]
        groups.append(rf"blk\.{n_layer - whole - 1}\.ffn_({'|'.join(left)})_exps")
    return "|".join(groups)


def variants(
    n_layer: int, n_expert: int, n_used: int, tensors: int, admission: float,
    peer_read: bool = False,
) -> list[Variant]:  # fmt: skip
    """The layouts of one VRAM size (module doc): `tensors` expert tensors' bytes; with
    `peer_read`, llama-server a second time reading the model (`-lm none`: its weights in
    RAM page-locked, as ours are) — its best of the two is the peer."""
    k = tensors / 3
    slots = tensors * n_expert // (3 * n_layer) - n_used
    in_ram = in_ram_regex(n_layer, tensors)
    policy = ["--expert-cache-admission", str(admission)]
    if tensors % 3 == 0:
        peer = Variant(f"llama-server --n-cpu-moe {n_layer - tensors // 3}", True,
                       ["--n-cpu-moe", str(n_layer - tensors // 3)], resident=k)  # fmt: skip
    else:
        peer = Variant(f"llama-server -ot (the last {k:.2f} layers on the GPU)", True,
                       ["-ot", f"{in_ram}=CPU"], resident=k)  # fmt: skip
    peers = [peer]
    if peer_read:
        peers.append(Variant(peer.label + " -lm none", True, [*peer.args, "-lm", "none"],
                             resident=k))  # fmt: skip
    return [
        *peers,
        Variant(
            f"ours, the same {k:g} layers" if tensors % 3 else f"ours, the same {k:g} whole layers",
            False,
            ["--cpu-experts", in_ram, "--expert-cache-slots", "0"],
            resident=k,
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


PHASES = ("schedule", "fill", "decode", "mask_wait", "sample", "gil", "postprocess", "other")


@dataclass(frozen=True, slots=True)
class Counters:
    """Our server's counters at one moment: the cache's picks and its decode steps' phases."""

    hits: float = 0.0
    misses: float = 0.0
    steps: float = 0.0
    phases: tuple[float, ...] = (0.0,) * len(PHASES)

    @classmethod
    def read(cls, url: str) -> Counters:
        text = httpx.get(url + "/metrics", timeout=30).text

        def get(name: str, **labels: str) -> float:
            try:
                return _counter(text, name, **labels)
            except KeyError:
                return 0.0

        return cls(
            get("onegpu_expert_cache_picks_total", result="hit"),
            get("onegpu_expert_cache_picks_total", result="miss"),
            get("onegpu_decode_steps_total"),
            tuple(get("onegpu_decode_step_phase_seconds_total", phase=p) for p in PHASES),
        )

    def since(self, before: Counters) -> str:
        """What one load's decode steps cost (ms a step by phase) and the cache's hit share
        over them: the profile of a row."""
        steps = self.steps - before.steps
        picks = (self.hits - before.hits) + (self.misses - before.misses)
        out = [f"cache hits {(self.hits - before.hits) / picks:.1%}"] if picks else []
        if steps:
            ms = [(p, 1e3 * (a - b) / steps) for p, a, b in
                  zip(PHASES, self.phases, before.phases, strict=True)]  # fmt: skip
            out.append(f"{sum(v for _, v in ms):.1f} ms a decode step (" + ", ".join(
                f"{p} {v:.1f}" for p, v in ms if v >= 0.05) + ")")  # fmt: skip
        return "; ".join(out)


def _load(
    srv: Server, name: str, users: list[int], isl: int, osl: int, seed: int, ours: bool
) -> tuple[list[Cell], dict[int, str], dict[int, float]]:
    """Each N's cell; with our server, each N's profile and the cache's hit share in it."""
    sampling = {"temperature": 1.0, "seed": seed}
    cells, profile, hits = [], {}, {}
    for n in users:
        before = Counters.read(srv.url) if ours else None
        cells.append(asyncio.run(run_load(srv.base_url, model=name, concurrency=n, requests=n,
                                          isl=isl, osl=osl, sampling=sampling,
                                          seed=seed + n)))  # fmt: skip
        if before is not None:
            after = Counters.read(srv.url)
            profile[n] = after.since(before)
            picks = (after.hits - before.hits) + (after.misses - before.misses)
            if picks:
                hits[n] = (after.hits - before.hits) / picks
    return cells, profile, hits


def _expert_notes(srv: Server, log_path: Path) -> tuple[list[str], float, int]:
    """The GPU's share of picks as the server reports it, and the plan's expectation; the
    cache's hit share and its layers (0, 0 without a cache)."""
    notes = []
    hit, cached = 0.0, 0
    text = httpx.get(srv.url + "/metrics", timeout=30).text
    with contextlib.suppress(KeyError):  # no cache
        hits = _counter(text, "onegpu_expert_cache_picks_total", result="hit")
        misses = _counter(text, "onegpu_expert_cache_picks_total", result="miss")
        uploads = _counter(text, "onegpu_expert_cache_uploads_total")
        cached = int(_counter(text, "onegpu_expert_cache_layers"))
        hit = hits / max(1.0, hits + misses)
        notes.append(f"cache hits {hit:.1%} of its picks, {uploads:.0f} uploads")
    with contextlib.suppress(KeyError):  # no telemetry
        share = _counter(text, "onegpu_expert_gpu_pick_share")
        notes.append(f"sampled GPU-resident pick share {share:.1%}")
    plan = re.findall(
        r"expected GPU pick share [^\n]*|routed experts on GPU: [^\n]*|weights by buffer: [^\n]*",
        log_path.read_text(errors="replace"),
    )
    notes += plan[-3:]
    return notes, hit, cached


def split_of(v: Variant, n_layer: int, hit: float, cached: int) -> dict[str, float]:
    """The layout a row measured, for bench.hybrid_model: a cache's layers are in RAM and
    the rest resident (the planner caches every layer it leaves in RAM); whole-layer rows
    as placed; llama-server's experts in RAM are the mapped file's unless it read the model
    (`-lm none`), ours are read into buffers of its own."""
    if cached:
        return {"resident": n_layer - cached, "cached": cached, "in_ram": 0.0, "hit": hit}
    resident = n_layer if v.resident is None else v.resident
    mapped = v.peer and "-lm" not in v.args
    return {"resident": resident, "cached": 0, "in_ram": n_layer - resident, "hit": 0.0,
            "mapped": mapped}  # fmt: skip


def sizes(args: argparse.Namespace, n_layer: int) -> list[int]:
    """The VRAM sizes asked for, in expert tensors (3 a layer)."""
    out = [round(3 * k) for k in args.layers or []]
    out += [round(3 * n_layer * f) for f in args.vram_share or []]
    return out or [round(3 * n_layer / 3)]


def run(args: argparse.Namespace) -> list[tuple[str, float, list[Variant]]]:
    model = Path(args.model).resolve()
    meta = read_meta(str(model))
    n_layer = len({expert_layer(t.name) for t in meta.tensors} - {-1})
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    originals = work / f"{model.stem}-routing-originals.npz"
    setup = Setup.sized(model, args.users, args.isl, args.osl, args.threads, gpu=not args.cpu)
    results: list[tuple[str, float, list[Variant]]] = []
    try:
        for routing in args.routings:
            t0 = time.monotonic()
            set_routing(model, preset(routing, model), originals)
            log.info("routing %s set in %.0f s", routing, time.monotonic() - t0)
            counts = work / f"{routing}-counts.json"
            if args.references and routing == args.routings[0]:
                refs = references(meta.n_expert)[: 1 if args.references == "gpu" else 2]
                refs = misses_on_gpu(refs) if args.misses_gpu else refs
                for v in refs:
                    _measure(args, setup, v, refs, counts, work / f"{routing}-ref", n_layer)
                results.append((routing, 0, refs))
                print(report([(routing, 0, refs)]), flush=True)
            for tensors in sizes(args, n_layer):
                rows = variants(n_layer, meta.n_expert, meta.n_expert_used, tensors,
                                args.admission, args.peer_read)  # fmt: skip
                rows = misses_on_gpu(rows) if args.misses_gpu else rows
                for rep in range(args.repeats):
                    for v in rows:
                        stem = work / f"{routing}-{tensors}-{rep}"
                        _measure(args, setup, v, rows, counts, stem, n_layer)
                results.append((routing, tensors / 3, rows))
                print(report([(routing, tensors / 3, rows)]), flush=True)
    finally:  # the model as written again
        if originals.exists():
            set_routing(model, PRESETS["uniform"], originals)
    return results


def _measure(
    args: argparse.Namespace,
    setup: Setup,
    v: Variant,
    rows: list[Variant],
    counts: Path,
    stem: Path,
    n_layer: int,
) -> None:
    log_path = stem.with_name(f"{stem.name}-{rows.index(v)}.log")
    t0 = time.monotonic()
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
    ready = f"ready in {time.monotonic() - t0:.0f} s"
    try:
        with VramPeak(srv.proc.pid) as peak:
            warm_up(srv, setup.name)
            cells, profile, hits = _load(srv, setup.name, args.users, args.isl, args.osl,
                                         args.seed, ours=not v.peer)  # fmt: skip
        for n, c in zip(args.users, cells, strict=True):
            v.cells.setdefault(n, []).append(c)
            print(
                f"{v.label} N={n}: {c.output_tok_s:.1f} tok/s, per user {c.per_user_tok_s:.1f}"
                + (f"; {profile[n]}" if profile.get(n) else ""),
                flush=True,
            )
        v.hit_by_users.update(hits)
        if peak.peak_mib is not None:
            v.vram_mib = max(peak.peak_mib, v.vram_mib or 0.0)
        if v.peer:
            v.notes = [ready]
            v.split = split_of(v, n_layer, 0.0, 0)
        else:
            notes, hit, cached = _expert_notes(srv, log_path)
            v.notes = [ready, *notes]
            v.split = split_of(v, n_layer, hit, cached)
            if "--cpu-moe" in v.args:  # what the next start of this routing plans for
                counts.write_bytes(httpx.get(srv.url + "/experts/counts", timeout=30).content)
    finally:
        srv.stop()


def report(results: list[tuple[str, float, list[Variant]]]) -> str:
    out = [
        "| routing | VRAM for experts | layout | VRAM MiB | N | tok/s | per user | vs peer |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for routing, k, rows in results:
        peers = [v for v in rows if v.peer]
        for v in rows:
            vram = f"{v.vram_mib:.0f}" if v.vram_mib is not None else "-"
            for n, cells in sorted(v.cells.items()):
                tok = statistics.median(c.output_tok_s for c in cells)
                user = statistics.median(c.per_user_tok_s for c in cells)
                theirs = [statistics.median(c.output_tok_s for c in p.cells[n])
                          for p in peers if p.cells.get(n)]  # fmt: skip
                ratio = tok / max(theirs) if theirs else 0  # against the peer's best
                size = f"{k:g} layers" if k else "reference"
                out.append(
                    f"| {routing} | {size} | {v.label} | {vram} | {n} | {tok:.1f} "
                    f"| {user:.1f} | {ratio:.2f} |"
                )
        for v in rows:
            if v.notes:
                size = f"{k:g}" if k else "-"
                out.append(f"| {routing} | {size} | {v.label}: {'; '.join(v.notes)} |||||||")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True, help="an MoE GGUF with F32/F16 routers")
    p.add_argument("--peer-bin", required=True, help="folder with llama-server")
    p.add_argument("--layers", type=float, nargs="+",
                   help="VRAM sizes: the routed-expert bytes of K layers (in thirds)")  # fmt: skip
    p.add_argument("--vram-share", type=float, nargs="+",
                   help="VRAM sizes: a share of all routed-expert bytes (0.38: the reference "
                        "system's), to the nearest expert tensor")  # fmt: skip
    p.add_argument("--routings", nargs="+", choices=sorted(PRESETS), default=["skewed", "uniform"])
    p.add_argument("--cpu", action="store_true", help="no GPU (a dry run of the flow)")
    p.add_argument("--peer-read", action=argparse.BooleanOptionalAction, default=True,
                   help="also llama-server with -lm none (the peer: the better)")  # fmt: skip
    p.add_argument("--misses-gpu", action="store_true",
                   help="each cached row also with --expert-cache-misses gpu")  # fmt: skip
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
        nargs="?",
        const="all",
        choices=["all", "gpu"],
        help="also all on the GPU, and every expert cached (first routing; gpu: the first only)",
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--work", default=".bench/expert-cache-ab")
    p.add_argument("--json", type=Path, help="write the figures (and each row's split) here")
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
                        "split": v.split,
                        "hit_by_users": v.hit_by_users,
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
