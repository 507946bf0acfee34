"""End to end: the routed-expert cache in a served model (`--expert-cache-slots`).

A tiny random qwen3moe with its experts in host RAM (`--cpu-moe`) and 4 slots a layer; no
GPU here, so the bank is on the CPU, which computes the same graph a GPU bank would. What a
user relies on: answers equal those of a server without the cache, the metrics tell hits,
misses and uploads, the reproducible lane never goes through the cache, and the pick counts
the server saves size the cache in `one-gpu plan`.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from bench.server_proc import Server, on_gpu, start_many, start_server
from engine.expert_split import load_picks
from tests.test_kv_pressure_e2e import _metric
from tests.tiny_gguf import Shape, write_qwen3moe

pytestmark = pytest.mark.e2e
SHAPE = Shape(n_layer=4, n_embd=64, n_expert=16, n_expert_used=4, n_ff_exp=32)
PROMPTS = ["the capital of france is", "one two three four", "water is a good thing to"]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_qwen3moe(tmp_path_factory.mktemp("ec") / "moe.gguf", shape=SHAPE, seed=5)


def _serve(model: Path, name: str, *extra: str, served: str = "tiny") -> Server:
    return start_server(
        ["--model", str(model), "--served-model-name", served, "--n-ctx", "2048",
         "--n-seq-max", "4", "--cpu-moe", "--expert-sample-rate", "1", *extra],
        model.parent / f"{name}.log",
    )  # fmt: skip


def cached_and_plain(model: Path, served: str = "tiny") -> Iterator[tuple[Server, Server]]:
    """Two servers of `model`, experts in RAM: one with a 4-slot cache, one without,
    started side by side; stopped when the generator ends."""
    cached, plain = start_many([
        lambda: _serve(model, "cached", "--expert-cache-slots", "4", served=served),
        lambda: _serve(model, "plain", "--expert-cache-slots", "0", served=served),
    ])  # fmt: skip
    try:
        yield cached, plain
    finally:
        cached.stop()
        plain.stop()


@pytest.fixture(scope="module")
def servers(model: Path) -> Iterator[tuple[Server, Server]]:
    yield from cached_and_plain(model)


def _answers(server: Server, logprobs: int | None = None, **extra: object) -> list[Any]:
    """Greedy answers to PROMPTS: texts, or (text, top logprobs) pairs with `logprobs`."""
    client = OpenAI(base_url=server.base_url, api_key="x", _strict_response_validation=True)
    out: list[Any] = []
    for p in PROMPTS:
        r = client.completions.create(
            model="tiny", prompt=p, max_tokens=24, temperature=0, logprobs=logprobs,
            extra_body=extra or None,
        )  # fmt: skip
        c = r.choices[0]
        out.append(c.text if logprobs is None else (c.text, c.logprobs and c.logprobs.top_logprobs))
    return out


def _cache(server: Server) -> tuple[float, float, float]:
    hits = _metric(server, "onegpu_expert_cache_picks_total", result="hit")
    misses = _metric(server, "onegpu_expert_cache_picks_total", result="miss")
    return hits, misses, _metric(server, "onegpu_expert_cache_uploads_total")


def test_answers_with_the_cache_equal_answers_without_it(servers: tuple[Server, Server]) -> None:
    cached, plain = servers
    assert _metric(cached, "onegpu_expert_cache_slots") == 4
    assert _metric(cached, "onegpu_expert_cache_layers") == SHAPE.n_layer
    before = _cache(cached)
    assert _answers(cached) == _answers(plain)
    hits, misses, uploads = (a - b for a, b in zip(_cache(cached), before, strict=True))
    # every decode step's picks are counted (4 a layer a token, 4 layers); the prompts go
    # through too (a few tokens each, within the cache's batch bound)
    assert hits + misses >= len(PROMPTS) * 23 * SHAPE.n_expert_used * SHAPE.n_layer
    assert hits > 0 and misses > 0 and uploads > 0
    by_layer = [
        _metric(cached, "onegpu_expert_cache_layer_picks_total", layer=str(il), result=r)
        for il in range(SHAPE.n_layer) for r in ("hit", "miss")
    ]  # fmt: skip
    assert sum(by_layer) == sum(_cache(cached)[:2])  # the layers' counts add up to the total
    assert "onegpu_expert_cache_picks_total" not in httpx.get(plain.url + "/metrics").text


def test_the_reproducible_lane_never_goes_through_the_cache(
    servers: tuple[Server, Server],
) -> None:
    """Its own context never has a cache: its picks are never counted, and its answers
    under others' load (which fills and turns over the cache) equal an idle plain
    server's, logprobs included."""
    cached, plain = servers
    before = _cache(cached)
    repro = _answers(cached, strata_reproducible="required")
    assert _cache(cached) == before  # no picks counted, nothing uploaded
    alone = _answers(plain, strata_reproducible="required", logprobs=2)
    with ThreadPoolExecutor(4) as pool:
        load = [pool.submit(_answers, cached) for _ in range(3)]
        loaded = _answers(cached, strata_reproducible="required", logprobs=2)
        for f in load:
            f.result()
    assert _cache(cached) != before  # the load went through the cache meanwhile
    assert loaded == alone and repro == [a[0] for a in alone]


def test_saved_pick_counts_are_what_the_planner_reads(
    servers: tuple[Server, Server], model: Path, tmp_path: Path
) -> None:
    """`one-gpu experts --save-counts` writes the server's sampled picks; `one-gpu plan
    --pick-counts` reads them (how they size the cache: tests/test_expert_split.py) and
    refuses a file that is not such a table, saying so."""
    cached, _ = servers
    _answers(cached)
    counts = tmp_path / "picks.json"
    subprocess.run(
        [sys.executable, "-m", "api.server.cli", "experts", "--url", cached.url, "--save-counts",
         str(counts)],
        check=True, capture_output=True,
    )  # fmt: skip
    picks = load_picks(counts.read_bytes())
    assert picks.n_expert == SHAPE.n_expert and not picks.uniform
    assert picks.hit(SHAPE.n_expert_used) > SHAPE.n_expert_used / SHAPE.n_expert  # measured
    plan = [sys.executable, "-m", "api.server.cli", "plan", str(model), "--vram-budget", "1GiB",
            "--ram-budget", "8GiB", "--ctx", "2048"]  # fmt: skip
    ok = subprocess.run([*plan, "--pick-counts", str(counts)], capture_output=True, text=True)
    assert ok.returncode == 0 and "routed experts on GPU: 4 whole layers" in ok.stdout
    counts.write_text('{"counts": [[1, 2], [3]]}')
    bad = subprocess.run([*plan, "--pick-counts", str(counts)], capture_output=True, text=True)
    assert bad.returncode == 2 and "cannot read --pick-counts" in bad.stderr


@pytest.mark.parametrize("where", ["cpu", "gpu"])
def test_q4_0_experts_in_ram_are_cached(tmp_path: Path, where: str) -> None:
    """Q4_0 experts (the benchmarks' type) kept in RAM are cached too: llama.cpp repacks
    such tensors for the CPU's kernels on AVX2 hosts, even mapped, and a repacked tensor is
    not the GGUF bytes the bank copies — with the cache on they stay plain. Without that the
    cache was silently off for Q4_0 models. With `--expert-cache-misses gpu` the GPU reads
    the misses from RAM in place (every layer, on a GPU host; none on the CPU, where the
    server says so and serves as before)."""
    path = write_qwen3moe(tmp_path / "moe-q4.gguf", shape=SHAPE, seed=5, wtype="q4_0")
    server = _serve(path, "q4", "--expert-cache-slots", "4", "--expert-cache-misses", where)
    try:
        assert _metric(server, "onegpu_expert_cache_layers") == SHAPE.n_layer
        if where == "gpu":
            on = SHAPE.n_layer if on_gpu(None) else 0
            assert f"misses of {on} of {SHAPE.n_layer} layers on the GPU" in server.log()
        _answers(server)
        hits, misses, _ = _cache(server)
        assert hits + misses >= len(PROMPTS) * 23 * SHAPE.n_expert_used * SHAPE.n_layer
    finally:
        server.stop()


def test_a_restart_starts_from_the_counts_the_last_run_saved(model: Path, tmp_path: Path) -> None:
    """A server saves its sampled pick counts when it stops; the next start of the same
    model reads them without --pick-counts and fills its bank with each layer's most picked
    experts before the first request (the fill costs no request an upload), evictable."""
    state = tmp_path / "state"
    first = _serve(model, "first", "--expert-cache-slots", "4", "--state-dir", str(state))
    _answers(first)
    first.stop()
    saved = list((state / "picks").glob("*.json"))
    assert len(saved) == 1 and not load_picks(saved[0].read_bytes()).uniform
    second = _serve(model, "second", "--expert-cache-slots", "4", "--state-dir", str(state))
    try:
        filled = _cache(second)
        assert filled == (0, 0, 4 * SHAPE.n_layer)  # no pick yet, every slot uploaded
        assert "uploaded from" in second.log() and str(saved[0]) in second.log()
        _answers(second)
        hits, misses, _ = (a - b for a, b in zip(_cache(second), filled, strict=True))
        assert hits > 0 and misses > 0
    finally:
        second.stop()
    other = _serve(model, "other", "--expert-cache-slots", "4", "--state-dir", "none")
    try:
        assert _cache(other) == (0, 0, 0)  # no state: an empty bank
    finally:
        other.stop()
