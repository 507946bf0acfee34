"""The meaning of router pick counts: GPU pick share and the per-expert hot set (pure)."""

from __future__ import annotations

import numpy as np

from engine.expert_stats import ExpertLayout, layout_of, report


def _tensors(n_layer: int, per_kind: int) -> list[tuple[str, int]]:
    out = [("token_embd.weight", 10_000), ("blk.0.ffn_gate_inp.weight", 99)]
    for i in range(n_layer):
        out += [(f"blk.{i}.ffn_{k}_exps.weight", per_kind) for k in ("gate", "up", "down")]
        out.append((f"blk.{i}.attn_q.weight", 7))
    return out


def test_layout_counts_only_routed_experts_and_their_gpu_share() -> None:
    ram = {"blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight", "blk.0.ffn_down_exps.weight",
           "blk.1.ffn_down_exps.weight"}  # fmt: skip
    lay = layout_of(_tensors(3, 400), 3, 4, lambda name: name not in ram)
    assert lay.expert_bytes == (300, 300, 300)  # 3 tensors x 400 bytes / 4 experts
    assert lay.gpu_fraction == (0.0, 2 / 3, 1.0)
    assert lay.gpu_bytes == 800 + 1200


def test_gpu_share_weights_picks_by_where_their_layer_lives() -> None:
    lay = ExpertLayout(n_expert=4, expert_bytes=(300, 300, 300), gpu_fraction=(0.0, 0.5, 1.0))
    counts = np.array([[10, 0, 0, 0], [4, 4, 0, 0], [1, 1, 1, 1]])
    r = report(counts, lay, sampled_steps=3, top=2)
    assert r.picks == 22 and r.picks_per_layer == (10, 8, 4)
    assert r.gpu_picks == 0.5 * 8 + 4
    assert abs(r.gpu_pick_share - 8 / 22) < 1e-12
    assert [(t.layer, t.expert, t.picks) for t in r.top] == [(0, 0, 10), (1, 0, 4)]


def test_hot_set_takes_the_most_picked_experts_that_fit_the_same_vram() -> None:
    # 600 bytes of expert VRAM today (layer 2 half on the GPU) = two 300-byte experts.
    lay = ExpertLayout(n_expert=4, expert_bytes=(300, 300, 300), gpu_fraction=(0.0, 0.0, 0.5))
    counts = np.array([[50, 1, 0, 0], [0, 30, 0, 0], [5, 5, 5, 4]])
    r = report(counts, lay, sampled_steps=1)
    assert r.hot_set_experts == 2
    assert abs(r.hot_set_pick_share - 80 / 100) < 1e-12
    assert abs(r.gpu_pick_share - 0.5 * 19 / 100) < 1e-12


def test_no_picks_and_no_gpu_give_zero_shares() -> None:
    lay = ExpertLayout(n_expert=2, expert_bytes=(8,), gpu_fraction=(0.0,))
    r = report(np.zeros((1, 2), dtype=np.int64), lay, sampled_steps=0)
    assert r.picks == 0 and r.gpu_pick_share == 0.0 and r.hot_set_pick_share == 0.0 and r.top == ()


def test_hot_set_counts_only_picked_experts_of_moe_layers() -> None:
    """A dense first layer (no expert bytes) and experts nobody picked are not "held":
    with VRAM for everything, the hot set is the experts that were picked."""
    lay = ExpertLayout(n_expert=4, expert_bytes=(0, 300, 300), gpu_fraction=(0.0, 1.0, 1.0))
    counts = np.array([[0, 0, 0, 0], [5, 0, 2, 0], [0, 1, 0, 0]])
    r = report(counts, lay, sampled_steps=1)
    assert r.hot_set_experts == 3 and r.hot_set_pick_share == 1.0
