"""`make bench`: this server against llama.cpp's `llama-server`, same model, same run.

For each repeat, each server is started in turn with the same settings (model file,
context, batch sizes, threads, flash attention; all layers on the GPU when there is one)
and driven by aiperf at every concurrency with greedy and typical sampling. Then
`llama-batched-bench` gives the backend's ceiling. One table per sampling setting, medians
over repeats, ours/theirs and ours/ceiling ratios, peak memory of both servers, and the
share of our step time spent in Python (from our /metrics).

"decode tok/s" = concurrency × the mean of each request's decode rate (tokens after the
first / time after the first token): the server-side analogue of batched-bench's S_TG.
"e2e tok/s" = all generated tokens / wall time of the run (prefill, HTTP and gaps included).

    python -m bench.compare                      # the full CPU run (minutes)
    python -m bench.compare --quick              # seconds: the harness end to end
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.aiperf_run import Cell, ensure_aiperf, ensure_tokenizer, run_aiperf
from bench.batched_bench import run_batched_bench
from bench.loadgen import run_load, run_lockstep
from bench.peers import Peers, ensure_peers
from bench.server_proc import (
    Server,
    free_port,
    on_gpu,
    served_model,
    start_process,
    start_server,
)

log = logging.getLogger("bench")
# Every field a row depends on is sent: neither server's defaults enter (ours resolve the
# unset fields to llama-server's, engine.sampling_defaults; "typical" is that chain).
SAMPLINGS: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0},
    "typical": {"temperature": 0.8, "top_p": 0.95, "top_k": 40, "min_p": 0.05},
}
SERVERS = ("ours", "llama-server")


@dataclass
class Setup:
    model: Path
    name: str
    n_ctx: int
    n_parallel: int
    threads: int
    gpu: bool
    ours_extra: list[str] = field(default_factory=list)
    theirs_extra: list[str] = field(default_factory=list)  # more llama-server options
    ours_default_threads: bool = False  # our server picks its own thread count
    n_batch: int = 2048
    n_ubatch: int = 512

    @classmethod
    def sized(
        cls, model: Path, conc: list[int], isl: int, osl: int, threads: int, gpu: bool
    ) -> Setup:
        """Both servers' settings for `conc` users of isl + osl tokens: N slots, a context
        that holds all of them (at least 4096), all cores unless `threads` is given."""
        return cls(
            model=model,
            name="bench-model",
            n_ctx=max(4096, max(conc) * (isl + osl + 64)),
            n_parallel=max(conc),
            threads=threads or (os.cpu_count() or 1),
            gpu=gpu,
        )

    def ours(self, log_path: Path) -> Server:
        return start_server(
            [
                "--model",
                str(self.model),
                "--served-model-name",
                self.name,
                "--n-ctx",
                str(self.n_ctx),
                "--n-seq-max",
                str(self.n_parallel),
                "--n-batch",
                str(self.n_batch),
                "--n-ubatch",
                str(self.n_ubatch),
                *([] if self.ours_default_threads else ["--threads", str(self.threads)]),
                "--flash-attn",
                "auto",
                "--n-gpu-layers",
                "-1" if self.gpu else "0",
                "--log-level",
                "warning",
                *self.ours_extra,
            ],
            log_path,
        )

    def theirs(self, exe: Path, log_path: Path) -> Server:
        port = free_port()
        cmd = [
            str(exe),
            "-m",
            str(self.model),
            "-a",
            self.name,
            "-c",
            str(self.n_ctx),
            "-np",
            str(self.n_parallel),
            "-b",
            str(self.n_batch),
            "-ub",
            str(self.n_ubatch),
            "-t",
            str(self.threads),
            "-tb",
            str(self.threads),
            "-fa",
            "auto",
            "-kvu",
            "--cache-ram",
            "0",
            "-ngl",
            "99" if self.gpu else "0",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *self.theirs_extra,
        ]
        return start_process(cmd, port, log_path)


@dataclass
class Results:
    cells: dict[str, list[Cell]] = field(default_factory=dict)  # "server|sampling|N"
    peak_rss_mib: dict[str, list[float]] = field(default_factory=dict)
    vram_mib: dict[str, list[float]] = field(default_factory=dict)
    profile: dict[str, list[dict[str, float]]] = field(default_factory=dict)  # ours, by cell
    ceiling: dict[int, list[float]] = field(default_factory=dict)
    lockstep: dict[str, list[float]] = field(default_factory=dict)  # "server|sampling|N"

    def add(self, server: str, sampling: str, n: int, cell: Cell) -> None:
        self.cells.setdefault(f"{server}|{sampling}|{n}", []).append(cell)

    def lockstep_med(self, server: str, sampling: str, n: int) -> float:
        return statistics.median(self.lockstep.get(f"{server}|{sampling}|{n}", [0.0]))

    def med(self, server: str, sampling: str, n: int, attr: str) -> float:
        cells = self.cells[f"{server}|{sampling}|{n}"]
        if attr == "decode_tok_s":
            return statistics.median(n * c.per_user_tok_s for c in cells)
        return float(statistics.median(getattr(c, attr) for c in cells))


PHASES = ("schedule", "fill", "decode", "sample", "gil", "postprocess", "other")


def step_counters(server: Server) -> dict[str, float]:
    """Our step count and seconds by phase so far (from /metrics)."""
    out = {}
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith("onegpu_step_duration_seconds_count "):
            out["steps"] = float(line.split()[1])
        elif line.startswith('onegpu_step_phase_seconds_total{phase="'):
            out[line.split('"')[1]] = float(line.split()[1])
        elif line.startswith("onegpu_decode_steps_total "):
            out["d:steps"] = float(line.split()[1])
        elif line.startswith('onegpu_decode_step_phase_seconds_total{phase="'):
            out["d:" + line.split('"')[1]] = float(line.split()[1])
    return out


def step_profile(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Milliseconds per step by phase between two readings: all steps (keys as PHASES),
    and the steps without prompt tokens ("d:" + phase)."""
    out: dict[str, float] = {}
    for pre in ("", "d:"):
        steps = after.get(pre + "steps", 0.0) - before.get(pre + "steps", 0.0)
        if steps:
            for p in PHASES:
                out[pre + p] = 1000 * (after[pre + p] - before.get(pre + p, 0.0)) / steps
    return out


def warm_up(server: Server, name: str) -> None:
    """A first request outside the measurements (graph allocation, page faults)."""
    body = {"model": name, "prompt": "Warm-up request, not measured.", "max_tokens": 8}
    httpx.post(server.base_url + "/completions", json=body, timeout=120).raise_for_status()


def run(args: argparse.Namespace) -> tuple[Results, Setup]:
    cache = Path(args.cache).resolve()
    gpu = on_gpu(args.gpu)
    if args.peer_bin:
        bin_dir = Path(args.peer_bin)
        peers = Peers(
            bin_dir / "llama-server", bin_dir / "llama-batched-bench", bin_dir / "llama-perplexity"
        )
    else:
        peers = ensure_peers(cache, cuda=gpu)
    model = Path(args.model) if args.model else _embedded()
    aiperf = ensure_aiperf(cache) if args.loadgen == "aiperf" else None
    tokenizer = ensure_tokenizer(aiperf, model, cache) if aiperf else None
    conc = args.concurrency
    setup = Setup.sized(model, conc, args.isl, args.osl, args.threads, gpu)
    setup.ours_extra = args.ours_args.split()
    run_dir = cache / "runs" / time.strftime("%Y%m%d-%H%M%S")
    res = Results()
    for rep in range(args.repeats):
        order = SERVERS if rep % 2 == 0 else SERVERS[::-1]  # alternate who goes first
        for who in order:
            d = run_dir / f"rep{rep}" / who
            d.mkdir(parents=True, exist_ok=True)
            srv = (
                setup.ours(d / "server.log")
                if who == "ours"
                else setup.theirs(peers.server, d / "server.log")
            )
            try:
                warm_up(srv, setup.name)
                for si, sname in enumerate(args.sampling):
                    for ci, n in enumerate(conc):
                        log.info("rep %d %s %s N=%d", rep, who, sname, n)
                        seed = 1000 * rep + 100 * si + ci  # same prompts for both servers
                        counters = step_counters(srv) if who == "ours" else {}
                        if aiperf is not None and tokenizer is not None:
                            cell = run_aiperf(
                                aiperf,
                                url=srv.url,
                                model=setup.name,
                                tokenizer=tokenizer,
                                concurrency=n,
                                requests=n * args.waves,
                                isl=args.isl,
                                osl=args.osl,
                                sampling=SAMPLINGS[sname],
                                out_dir=d / f"{sname}-c{n}",
                                seed=seed,
                            )
                        else:
                            cell = asyncio.run(
                                run_load(
                                    srv.base_url,
                                    model=setup.name,
                                    concurrency=n,
                                    requests=n * args.waves,
                                    isl=args.isl,
                                    osl=args.osl,
                                    sampling=SAMPLINGS[sname],
                                    seed=seed,
                                    osl_spread=args.osl_spread,
                                )
                            )
                        res.add(who, sname, n, cell)
                        if args.lockstep_waves:
                            rate = asyncio.run(
                                run_lockstep(
                                    srv.base_url, model=setup.name, concurrency=n,
                                    waves=args.lockstep_waves, isl=args.isl, osl=args.osl,
                                    sampling=SAMPLINGS[sname], seed=seed + 50,
                                )
                            )  # fmt: skip
                            res.lockstep.setdefault(f"{who}|{sname}|{n}", []).append(rate)
                        if who == "ours":
                            prof = step_profile(counters, step_counters(srv))
                            res.profile.setdefault(f"{sname}|{n}", []).append(prof)
                res.peak_rss_mib.setdefault(who, []).append(srv.peak_rss_mib())
                vram = srv.vram_mib()
                if vram is not None:
                    res.vram_mib.setdefault(who, []).append(vram)
            finally:
                srv.stop()
        ceiling = run_batched_bench(
            peers.batched_bench,
            model,
            npl=conc,
            isl=args.isl,
            osl=args.osl,
            n_ctx=setup.n_ctx,
            threads=setup.threads,
            gpu=gpu,
            log_path=run_dir / f"rep{rep}" / "batched-bench.txt",
        )
        for n, v in ceiling.items():
            res.ceiling.setdefault(n, []).append(v)
    (run_dir / "results.json").write_text(
        json.dumps(
            {
                "setup": {**asdict(setup), "model": str(model)},
                "args": vars(args),
                "results": asdict(res),
            },
            indent=1,
            default=str,
        )
    )
    log.info("raw results in %s", run_dir)
    return res, setup


def _embedded() -> Path:
    return served_model(None)


_ATTRS = (
    "decode_tok_s",
    "output_tok_s",
    "slowest_user_tok_s",
    "ttft_p50",
    "ttft_p99",
    "itl_p50",
    "itl_p99",
    "tail_p50",
)


def report(res: Results, args: argparse.Namespace) -> str:
    out = []
    for s in args.sampling:
        out += [
            f"\n### {s} sampling ({SAMPLINGS[s]})\n",
            "| N | decode tok/s ours | llama-server | ours/theirs | batched-bench | "
            "ours/ceiling | all-N decode tok/s ours / theirs | all-N ours/ceiling | "
            "e2e tok/s ours / theirs | slowest user ours / theirs | "
            "TTFT p50, p99 ms ours | theirs | ITL p50, p99 ms ours | theirs |",
            "|---" * 14 + "|",
        ]
        for n in args.concurrency:
            o = {a: res.med("ours", s, n, a) for a in _ATTRS}
            t = {a: res.med("llama-server", s, n, a) for a in _ATTRS}
            ceil = statistics.median(res.ceiling[n])
            lo, lt = (res.lockstep_med(w, s, n) for w in SERVERS)
            out.append(
                f"| {n} | {o['decode_tok_s']:.1f} | {t['decode_tok_s']:.1f} | "
                f"{o['decode_tok_s'] / t['decode_tok_s']:.2f} | {ceil:.1f} | "
                f"{o['decode_tok_s'] / ceil:.2f} | {lo:.1f} / {lt:.1f} | {lo / ceil:.2f} | "
                f"{o['output_tok_s']:.1f} / {t['output_tok_s']:.1f} | "
                f"{o['slowest_user_tok_s']:.1f} / {t['slowest_user_tok_s']:.1f} | "
                f"{o['ttft_p50']:.0f}, {o['ttft_p99']:.0f} | "
                f"{t['ttft_p50']:.0f}, {t['ttft_p99']:.0f} | "
                f"{o['itl_p50']:.1f}, {o['itl_p99']:.1f} | {t['itl_p50']:.1f}, {t['itl_p99']:.1f} |"
            )
    out += [
        "\nA request's end: ms from its last text to the stream's end (usage, [DONE], the "
        "body closed), p50, ours / llama-server; with TTFT, what a closed-loop user waits "
        "beyond decode\n",
        "| sampling | N | tail ms ours / theirs |",
        "|---|---|---|",
    ]
    for s in args.sampling:
        for n in args.concurrency:
            ours, theirs = (res.med(w, s, n, "tail_p50") for w in SERVERS)
            out.append(f"| {s} | {n} | {ours:.1f} / {theirs:.1f} |")
    rss = {k: statistics.median(v) for k, v in res.peak_rss_mib.items()}
    out.append(
        f"\nPeak RSS (MiB, median): ours {rss['ours']:.0f}, llama-server "
        f"{rss['llama-server']:.0f}, difference {rss['ours'] - rss['llama-server']:+.0f}"
    )
    if res.vram_mib:
        vr = {k: statistics.median(v) for k, v in res.vram_mib.items()}
        out.append(
            f"VRAM (MiB): ours {vr.get('ours', 0):.0f}, llama-server "
            f"{vr.get('llama-server', 0):.0f}"
        )
    for pre, title in (("", "all steps"), ("d:", "steps without prompt tokens")):
        out.append(
            f"\nOur step profile, {title}: ms per step (median over repeats); "
            "python = all but decode\n"
        )
        out.append("| sampling | N | " + " | ".join(PHASES) + " | python share |")
        out.append("|---" * (len(PHASES) + 3) + "|")
        for key, profs in res.profile.items():
            have = [x for x in profs if pre + "decode" in x]
            if not have:
                continue
            med = {p: statistics.median(x[pre + p] for x in have) for p in PHASES}
            total = sum(med.values())
            share = (total - med["decode"]) / total if total else 0.0
            cells = " | ".join(f"{med[p]:.2f}" for p in PHASES)
            out.append(f"| {key.replace('|', ' | ')} | {cells} | {100 * share:.1f}% |")
    return "\n".join(out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", help="GGUF (default: the embedded Gemma 3 270M)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16])
    p.add_argument("--sampling", nargs="+", choices=list(SAMPLINGS), default=list(SAMPLINGS))
    p.add_argument("--isl", type=int, default=128, help="prompt tokens")
    p.add_argument("--osl", type=int, default=64, help="generated tokens per request")
    p.add_argument("--osl-spread", type=float, default=0.0,
                   help="each request osl x (1 +- up to this), alike for both servers")  # fmt: skip
    p.add_argument("--waves", type=int, default=3, help="requests per user per cell")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--lockstep-waves", type=int, default=2,
        help="per cell, waves of N requests sent together, for the all-N decode rate (0 = off)",
    )  # fmt: skip
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--gpu", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--cache", default=".bench", help="peers, aiperf venv, tokenizers, runs")
    p.add_argument(
        "--loadgen",
        choices=["aiperf", "openai"],
        default="openai",
        help="openai: bench/loadgen.py, one light process (the default: on a 2-core host "
        "aiperf's own processes take a core and halve both servers' throughput); "
        "aiperf: NVIDIA's load generator, in its own venv",
    )
    p.add_argument("--peer-bin", help="prebuilt llama-server and llama-batched-bench folder")
    p.add_argument("--ours-args", default="", help="extra `one-gpu serve` options, quoted")
    p.add_argument("--quick", action="store_true", help="seconds: N=2, greedy, 1 repeat")
    args = p.parse_args(argv)
    if args.quick:
        args.concurrency, args.sampling, args.repeats = [2], ["greedy"], 1
        args.isl, args.osl, args.waves, args.lockstep_waves = 32, 8, 1, 1
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    res, setup = run(args)
    print(
        f"model {setup.model.name}, n_ctx {setup.n_ctx}, parallel {setup.n_parallel}, "
        f"threads {setup.threads}, gpu {setup.gpu}, isl {args.isl}, osl {args.osl}, "
        f"{args.repeats} repeats"
    )
    print(report(res, args))


if __name__ == "__main__":
    main()
