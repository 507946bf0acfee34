"""End to end: a tiny MoE model served under a VRAM budget that leaves part of its experts
in host RAM — the tensors land where the plan says (llama.cpp's own placement report), the
answers are those of the model served without a plan, the router telemetry's pick counts
add up to the tokens the model processed, and `one-gpu plan` prints and refuses as
documented."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bench.server_proc import ROOT, Server, free_port, start_server
from engine._capi import llama
from engine.config import DEFAULT_PROMPT_LOGPROB_ROWS
from engine.devices import gpu_memory
from engine.gguf_meta import read_meta
from engine.plan import PlanOptions, output_rows, vram_for_expert_share
from tests.test_api_e2e import client, metrics
from tests.tiny_gguf import Shape, write_qwen3moe

pytestmark = pytest.mark.e2e

SHAPE = Shape(n_layer=4)
N_CTX, N_UBATCH, N_SEQ, N_CACHED = 1024, 128, 4, 8
# `plan` for the server below: its N_CTX cells shared by N_SEQ sequences (and N_CACHED
# prefix-cache holders, which cost a row of logits each)
PLAN_CTX = ["--ctx", str(N_CTX // N_SEQ), "--parallel", str(N_SEQ), "--cache-seqs", str(N_CACHED)]
EXPERT = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")
COMMON = ["--n-ctx", str(N_CTX), "--n-ubatch", str(N_UBATCH), "--n-seq-max", str(N_SEQ),
          "--cache-seqs", str(N_CACHED), "--threads", "2", "--repro-slots", "0"]  # fmt: skip


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_qwen3moe(tmp_path_factory.mktemp("moe") / "moe.gguf", seed=5, shape=SHAPE)


@pytest.fixture(scope="module")
def budget(model: Path) -> int:
    """Room for the non-expert part, the server's reserves and 60% of the expert bytes:
    two layers' experts whole on the GPU, one tensor of a third."""
    rows = output_rows(N_SEQ + N_CACHED, DEFAULT_PROMPT_LOGPROB_ROWS)
    opts = PlanOptions(kv_tokens=N_CTX, n_ubatch=N_UBATCH, n_outputs=rows)
    return vram_for_expert_share(read_meta(model), opts, 0.6)


def one_gpu(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "api.server.cli", *args], cwd=ROOT, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip


@pytest.fixture(scope="module")
def planned(model: Path, budget: int, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("planned") / "server.log"
    srv = start_server(
        ["--model", str(model), *COMMON, "--vram-budget", str(budget),
         "--expert-sample-rate", "1", "--log-level", "debug"],
        log,
    )  # fmt: skip
    yield srv
    srv.stop()


def _plan_json(model: Path, budget: int) -> dict:
    out = one_gpu(
        "plan", str(model), "--vram-budget", str(budget), "--ram-budget", "8GiB",
        *PLAN_CTX, "--n-ubatch", str(N_UBATCH), "--json",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_plan_cli_places_whole_layers_from_the_last_down_and_prints_a_table(
    model: Path, budget: int
) -> None:
    plan = _plan_json(model, budget)
    ram = {t["name"] for t in plan["tensors"] if t["device"] == "ram"}
    experts_in_ram = sorted(n for n in ram if EXPERT.match(n))
    # 12 expert tensors of equal size, 60% of them fit: 7 on the GPU (layers 3 and 2
    # whole, one of layer 1), the other 5 in RAM (layer 0 whole, two of layer 1).
    assert len(experts_in_ram) == 5
    assert {n for n in experts_in_ram if n.startswith("blk.0.")} == {
        f"blk.0.ffn_{w}_exps.weight" for w in ("gate", "up", "down")
    }
    assert not any(n.startswith(("blk.2.", "blk.3.")) for n in experts_in_ram)
    assert ram - set(experts_in_ram) == {"token_embd.weight"}
    table = one_gpu("plan", str(model), "--vram-budget", str(budget), *PLAN_CTX,
                    "--n-ubatch", str(N_UBATCH))  # fmt: skip
    assert table.returncode == 0
    assert re.search(r"routed experts\s+12\s", table.stdout)
    assert "routed experts on GPU: 2 whole layers" in table.stdout


def test_a_larger_vram_margin_leaves_more_experts_in_ram(model: Path, budget: int) -> None:
    """--vram-margin is VRAM the plan keeps free: the same budget with a margin larger by
    two expert tensors' bytes (32 KiB each here) holds two fewer; not a size is refused."""

    def gpu_experts(*extra: str) -> set[str]:
        out = one_gpu(
            "plan", str(model), "--vram-budget", str(budget), "--ram-budget", "8GiB",
            *PLAN_CTX, "--n-ubatch", str(N_UBATCH), "--json", *extra,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        placed = json.loads(out.stdout)["tensors"]
        return {t["name"] for t in placed if EXPERT.match(t["name"]) and t["device"] == "gpu"}

    default = gpu_experts()
    assert default == gpu_experts("--vram-margin", "384MiB")
    wider = gpu_experts("--vram-margin", f"{384 * 2**20 + 2 * 32768}")
    assert wider < default and len(wider) == len(default) - 2
    bad = one_gpu("plan", str(model), "--vram-budget", str(budget), "--vram-margin", "some")
    assert bad.returncode == 2 and "not a size" in bad.stderr


def test_plan_cli_refuses_a_gpu_too_small_with_the_numbers(model: Path) -> None:
    out = one_gpu("plan", str(model), "--vram-budget", "64MiB", "--ctx", "4096")
    assert out.returncode == 2
    assert "VRAM: needs" in out.stderr and "has 0.06 GiB: short by" in out.stderr
    assert "Would help:" in out.stderr
    bad = one_gpu("plan", str(model), "--vram-budget", "lots")
    assert bad.returncode == 2 and "not a size" in bad.stderr
    nobody = one_gpu("experts", "--url", f"http://127.0.0.1:{free_port()}")
    assert nobody.returncode == 2 and "cannot reach" in nobody.stderr
    # Without a budget the plan is for this host's GPU; with none, it says what to give.
    default = one_gpu("plan", str(model), "--ctx", "256")
    if gpu_memory(llama()):
        assert default.returncode == 0, default.stderr
    else:
        assert default.returncode == 2 and "give --vram-budget" in default.stderr


def test_serve_refuses_a_plan_that_does_not_fit_and_a_plan_for_another_model(
    model: Path, tmp_path: Path
) -> None:
    out = one_gpu("serve", "--model", str(model), *COMMON, "--vram-budget", "64MiB")
    assert out.returncode == 2 and "not serving: VRAM: needs" in out.stderr
    other = write_qwen3moe(tmp_path / "other.gguf", shape=Shape(n_layer=3))
    saved = one_gpu("plan", str(other), "--vram-budget", "8GiB", "--json")
    assert saved.returncode == 0
    (tmp_path / "plan.json").write_text(saved.stdout)
    out = one_gpu("serve", "--model", str(model), *COMMON, "--plan", str(tmp_path / "plan.json"))
    assert out.returncode == 2 and "is not a plan for" in out.stderr
    # The model's own plan, saved on a bigger host, is re-checked against this one's budget.
    mine = one_gpu("plan", str(model), "--vram-budget", "8GiB", "--json")
    (tmp_path / "mine.json").write_text(mine.stdout)
    out = one_gpu(
        "serve", "--model", str(model), *COMMON, "--plan", str(tmp_path / "mine.json"),
        "--vram-budget", "64MiB",
    )  # fmt: skip
    assert out.returncode == 2 and "does not fit this host" in out.stderr


def test_tensors_land_where_the_plan_says(planned: Server, model: Path, budget: int) -> None:
    plan = _plan_json(model, budget)
    want = sorted(
        t["name"]
        for t in plan["tensors"]
        if t["device"] == "ram" and t["name"] != "token_embd.weight"
    )
    # llama.cpp's loader reports each tensor it moved to the host buffer.
    got = sorted(
        m.group(1)
        for m in re.finditer(r"tensor (\S+) \(.*\) buffer type overridden to", planned.log())
    )
    assert got == want


def _greedy(srv: Server, prompt: str, n: int) -> tuple[str, int, int, str]:
    c = client(srv)
    r = c.completions.create(
        model=c.models.list().data[0].id, prompt=prompt, max_tokens=n, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert r.usage is not None
    ch = r.choices[0]
    return ch.text, r.usage.prompt_tokens, r.usage.completion_tokens, ch.finish_reason


def _experts(srv: Server) -> dict:
    r = httpx.get(srv.url + "/experts", params={"top": 100})
    assert r.status_code == 200
    return r.json()


def test_answers_match_the_model_served_without_a_plan_and_picks_add_up(
    planned: Server, model: Path, tmp_path: Path
) -> None:
    before = _experts(planned)
    text, n_prompt, n_gen, finish = _greedy(planned, "the capital of france is", 12)
    after = _experts(planned)
    assert finish == "length" and n_gen == 12
    # Every step is sampled (rate 1): each layer's picks are n_used per row it computed.
    # All prompt rows and every generated token but the last pass layers 0..L-2; llama.cpp
    # computes only output rows in the last layer (one per step).
    used = SHAPE.n_expert_used
    per_layer = [
        a - b for a, b in zip(after["picks_per_layer"], before["picks_per_layer"], strict=True)
    ]
    assert per_layer[:-1] == [used * (n_prompt + n_gen - 1)] * (SHAPE.n_layer - 1)
    assert per_layer[-1] == used * n_gen
    assert after["picks"] == sum(after["picks_per_layer"])
    assert sum(t["picks"] for t in after["top"]) == after["picks"]  # top 100 >= 4 x 4 experts
    m = metrics(planned)
    by_residence = (
        m["onegpu_expert_picks_total{residence=gpu}"]
        + m["onegpu_expert_picks_total{residence=ram}"]
    )
    assert by_residence == pytest.approx(after["picks"])
    assert (
        m["onegpu_expert_sampled_steps_total"] >= after["sampled_steps"] > before["sampled_steps"]
    )
    assert m["onegpu_plan_budget_bytes{device=gpu}"] > 0
    assert m["onegpu_placement_tensors{device=gpu}"] + m[
        "onegpu_placement_tensors{device=ram}"
    ] == len(read_meta(model).tensors)

    # The operator's view of the same counts: `one-gpu experts`.
    cli = one_gpu("experts", "--url", planned.url, "--top", "3", "--json")
    assert cli.returncode == 0, cli.stderr
    assert (
        json.loads(cli.stdout)["picks"] == after["picks"]
        and len(json.loads(cli.stdout)["top"]) == 3
    )
    table = one_gpu("experts", "--url", planned.url)
    assert "picks served by GPU-resident expert tensors" in table.stdout

    plain = start_server(
        ["--model", str(model), *COMMON, "--expert-sample-rate", "0"], tmp_path / "plain.log"
    )
    try:
        assert _greedy(plain, "the capital of france is", 12) == (text, n_prompt, n_gen, finish)
        # Telemetry off: the endpoint says so, and nothing was attached.
        r = httpx.get(plain.url + "/experts")
        assert r.status_code == 400 and "expert telemetry is off" in r.json()["error"]["message"]
        off = one_gpu("experts", "--url", plain.url)
        assert off.returncode == 2 and "expert telemetry is off" in off.stderr
    finally:
        plain.stop()
