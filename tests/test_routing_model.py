"""The benchmarks' routing model (`bench.skew_router`): a random MoE model routes about
uniformly; rewritten, a small routed-expert cache serves several times more of its picks,
measured the way `bench.routing_curve` measures it (a served model, several users)."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import pytest

from bench.routing_curve import measure
from bench.skew_router import skew_router
from tests.tiny_gguf import Shape, write_qwen3moe

pytestmark = pytest.mark.e2e
SHAPE = Shape(n_layer=2, n_embd=128, n_head=4, n_head_kv=2, head_dim=32, n_expert=32,
              n_expert_used=4, n_ff_exp=32)  # fmt: skip
SLOTS = 4


def test_the_skewed_router_puts_most_picks_on_a_few_experts(tmp_path: Path) -> None:
    uniform = write_qwen3moe(tmp_path / "uniform.gguf", shape=SHAPE, seed=2)
    skewed = tmp_path / "skewed.gguf"
    shutil.copyfile(uniform, skewed)
    assert skew_router(skewed, skew=1.0, locality=0.5, context=64, boost=8.0) == SHAPE.n_layer
    args = argparse.Namespace(users=2, prompt=16, out=64, rounds=1, admission=0.0)
    flat = measure(uniform, "uniform", SLOTS, SHAPE.n_expert, args, tmp_path)
    hot = measure(skewed, "skewed", SLOTS, SHAPE.n_expert, args, tmp_path)
    share = SLOTS / SHAPE.n_expert  # 12.5%: what uniform routing gives
    assert flat.picks > 0 and hot.picks > 0
    assert flat.hit_rate < 2 * share
    assert hot.hit_rate > 2.5 * share and hot.pinned > 2.5 * share
