"""The benchmark harness cannot rot: a quick `bench.compare` runs both real servers, the
real llama.cpp peers and the load driver end to end; the parsers read real outputs."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.aiperf_run import cell_from_aiperf
from bench.batched_bench import parse

DATA = Path(__file__).parent / "data"
ROOT = Path(__file__).resolve().parent.parent


def test_batched_bench_table_is_parsed_by_batch_size() -> None:
    rows = parse((DATA / "batched_bench.txt").read_text())
    assert sorted(rows) == [1, 4, 8, 16, 32]
    assert all(v > 0 for v in rows.values())
    assert rows[32] == 2358.13  # S_TG of the B=32 row
    assert rows[16] > rows[1]  # batching raises the summed decode rate
    with pytest.raises(RuntimeError):
        parse("no table here")


def test_aiperf_export_maps_to_a_cell() -> None:
    d = json.loads((DATA / "aiperf_profile_export.json").read_text())
    cell = cell_from_aiperf(d)
    assert cell.output_tok_s == d["output_token_throughput"]["avg"]
    assert cell.slowest_user_tok_s == d["output_token_throughput_per_user"]["min"]
    assert cell.ttft_p99 == d["time_to_first_token"]["p99"]
    assert cell.requests == int(d["request_count"]["avg"])
    d["error_summary"] = [{"count": 3}]
    with pytest.raises(RuntimeError, match="errors"):
        cell_from_aiperf(d)


@pytest.mark.e2e
def test_quick_benchmark_compares_both_servers_and_the_ceiling() -> None:
    """`python -m bench.compare --quick`: builds (once) and runs llama-server and
    llama-batched-bench beside our server and prints the comparison table."""
    out = subprocess.run(
        [sys.executable, "-m", "bench.compare", "--quick"],
        cwd=ROOT, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    row = re.search(r"^\| 2 \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|",
                    out.stdout, re.M)  # fmt: skip
    assert row, out.stdout
    ours, theirs, ratio, ceiling, ours_vs_ceiling = map(float, row.groups())
    assert ours > 0 and theirs > 0 and ceiling > 0
    # the table's figures are rounded to 2 decimals, so a ratio of them is only that close
    assert ratio == pytest.approx(ours / theirs, rel=0.01, abs=0.011)
    assert ours_vs_ceiling == pytest.approx(ours / ceiling, rel=0.01, abs=0.011)
    rss = re.search(r"Peak RSS \(MiB, median\): ours (\d+), llama-server (\d+)", out.stdout)
    assert rss and int(rss.group(1)) > 100 and int(rss.group(2)) > 100
    profile = r"^\| greedy \| 2 \| ([\d.]+ \| ){7}[\d.]+% \|$"
    assert len(re.findall(profile, out.stdout, re.M)) == 2, out.stdout  # all, decode-only


def test_telemetry_cost_benchmark_runs_and_reports_every_class(tmp_path: Path) -> None:
    """`bench.tap_cost` on a tiny MoE model: one table row per N, the three step classes
    measured, a cost in percent."""
    from tests.tiny_gguf import Shape, write_qwen3moe

    model = write_qwen3moe(tmp_path / "moe.gguf", shape=Shape(n_layer=3))
    out = subprocess.run(
        [sys.executable, "-m", "bench.tap_cost", "--model", str(model), "--concurrency", "1", "2",
         "--steps", "40", "--isl", "8", "--n-ctx", "512"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    rows = [ln for ln in out.stdout.splitlines() if re.match(r"\| \d+ \|", ln)]
    assert [r.split("|")[1].strip() for r in rows] == ["1", "2"]
    for r in rows:
        cells = [c.strip() for c in r.strip("|").split("|")]
        assert all(float(c) > 0 for c in cells[1:4]) and cells[4].endswith("%")


@pytest.mark.e2e
def test_kv_pressure_benchmark_runs_ours_and_llama_server(tmp_path: Path) -> None:
    """`bench.kv_pressure` on the embedded model and a pool for about two prompts: a row
    per server; ours finishes every request whole, serial and together."""
    out = subprocess.run(
        [sys.executable, "-m", "bench.kv_pressure", "--no-gpu", "--scenario", "ten",
         "--n-ctx", "512", "--osl", "16", "--json", str(tmp_path / "k.json")],
        cwd=ROOT, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    rows = {ln.split("|")[1].strip(): ln for ln in out.stdout.splitlines() if ln.startswith("| ")}
    assert {"ours", "llama-server"} <= set(rows), out.stdout
    assert rows["ours"].rstrip(" |").endswith("0/10"), rows["ours"]  # no bad reply
    raw = json.loads((tmp_path / "k.json").read_text())
    [trial] = raw["results"]["ours"]["trials"]["ten"]
    assert trial["serial_violations"] == [] and trial["together_violations"] == []


@pytest.mark.e2e
def test_a_short_soak_of_mixed_traffic_leaks_nothing(tmp_path: Path) -> None:
    """`bench.soak` for half a minute: every kind of request is sent, none gets a 5xx, and
    once drained no lane holds a request, a KV cell or a swapped cell. (Memory flatness
    needs the full 30 minutes: `make soak`.)"""
    report = tmp_path / "soak.json"
    out = subprocess.run(
        [sys.executable, "-m", "bench.soak", "--minutes", "0.5", "--warmup-minutes", "0.1",
         "--rss-slack-mib", "4096", "--json", str(report)],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    r = json.loads(report.read_text())
    assert set(r["requests"]) >= {"chat_stream", "long_prompt", "cancelled_stream"}
    assert r["num_5xx"] == 0 and r["drained"] and all(r["checks"].values())
