"""`one-gpu experts`: read a server's `/experts` and print it as an operator reads it."""

from __future__ import annotations

import json
import urllib.request

import msgspec

from engine.expert_stats import ExpertReport


def fetch_report(url: str, top: int) -> ExpertReport:
    """GET a server's /experts."""
    with urllib.request.urlopen(f"{url.rstrip('/')}/experts?top={top}", timeout=30) as resp:
        return msgspec.json.decode(resp.read(), type=ExpertReport)


def fetch_counts(url: str) -> bytes:
    """GET a server's /experts/counts (the JSON `--pick-counts` reads)."""
    with urllib.request.urlopen(f"{url.rstrip('/')}/experts/counts", timeout=30) as resp:
        return bytes(resp.read())


def format_report(r: ExpertReport) -> str:
    """Shares first, then the most picked experts."""
    gib = r.gpu_expert_bytes / 2**30
    lines = [
        f"sampled steps {r.sampled_steps}, expert picks {r.picks}",
        f"picks served by GPU-resident expert tensors: {r.gpu_pick_share:.1%}",
        f"a per-expert hot set of the same VRAM ({gib:.2f} GiB, {r.hot_set_experts} experts) "
        f"would serve: {r.hot_set_pick_share:.1%}",
        "",
        f"{'layer':>5} {'expert':>6} {'picks':>10} {'share':>7}",
    ]
    lines += [f"{t.layer:>5} {t.expert:>6} {t.picks:>10} {t.share:>7.2%}" for t in r.top]
    return "\n".join(lines)


def report_json(r: ExpertReport) -> str:
    return json.dumps(msgspec.to_builtins(r), indent=2)
