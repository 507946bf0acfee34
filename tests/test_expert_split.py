"""The split of the experts' VRAM between resident layers and the routed-expert cache
(pure): what each pick model chooses, the budget it keeps, and what `one-gpu plan` prints
for the reference model."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from engine.expert_split import PickModel, picks_model, split_experts
from engine.plan import AUTO, Budgets, format_plan, make_plan, plan_from_json, plan_to_json
from tests.test_plan import EXPERT, GB, REFERENCE_OPTS, deepseek_like

LAYERS = {n: 120 * 1000 for n in range(10)}  # 10 MoE layers, 1000 bytes an expert
N_EXPERT, USED = 120, 8


def _zipf(n_layer: int, n_expert: int, s: float, seed: int = 0) -> np.ndarray:
    """Pick counts where expert rank r takes a share ~ 1/r^s (each layer its own order)."""
    rng = np.random.default_rng(seed)
    w = 1 / np.arange(1, n_expert + 1) ** s
    return np.stack([rng.permutation(w) * 1e6 for _ in range(n_layer)]).round()


def test_uniform_routing_keeps_whole_layers_and_gives_the_rest_to_slots() -> None:
    # room for 4 layers and 100 experts' bytes: 4 resident, the 6 others 100/6 - 8 pad = 8
    sp = split_experts(LAYERS, N_EXPERT, USED, 4 * 120_000 + 100_000, PickModel(N_EXPERT))
    assert sp.resident == (6, 7, 8, 9) and sp.cached == (0, 1, 2, 3, 4, 5)
    assert sp.slots == 8 and sp.pad == USED
    assert sp.bank_bytes == 6 * (8 + USED) * 1000 <= 100_000
    assert sp.expected_share == sp.uniform_share == pytest.approx((4 + 6 * 8 / 120) / 10)


def test_skewed_routing_trades_resident_layers_for_slots_in_every_layer() -> None:
    """Zipf-like routing: a few experts of each layer take most picks, so slots in all ten
    layers serve more picks than whole layers of the same bytes."""
    model = picks_model(_zipf(10, N_EXPERT, 1.2))
    free = 4 * 120_000 + 100_000
    sp = split_experts(LAYERS, N_EXPERT, USED, free, model)
    whole = split_experts(LAYERS, N_EXPERT, USED, free, model, slots=0)
    assert len(sp.resident) < 4 and sp.slots > 20
    assert sp.expected_share > whole.expected_share + 0.2
    # were routing uniform after all, the split chosen for it would have done better
    flat = split_experts(LAYERS, N_EXPERT, USED, free, PickModel(N_EXPERT))
    assert sp.uniform_share < flat.uniform_share
    used = sum(LAYERS[n] for n in sp.resident) + sp.bank_bytes
    assert used <= free


def test_the_pick_model_of_measured_counts() -> None:
    even = picks_model(np.full((4, N_EXPERT), 50))
    assert even.hit(30) == pytest.approx(30 / N_EXPERT) and even.hit(N_EXPERT) == 1.0
    skewed = picks_model(_zipf(4, N_EXPERT, 1.0))
    curve = np.array(skewed.curve)
    assert curve[0] == 0 and curve[-1] == 1 and np.all(np.diff(curve) >= 0)
    assert skewed.hit(12) > 0.5  # a tenth of the experts, most of the picks
    assert picks_model(np.zeros((4, N_EXPERT))).uniform  # nothing measured yet


def test_the_reference_model_prints_its_split_and_stays_within_budget() -> None:
    """`one-gpu plan` on the DeepSeek-sized model, 96 GB of VRAM and 280 GB of RAM: resident
    layers and cache slots under uniform routing, and under routing as skewed as the
    reference system's traffic (its hot ~38% of experts take about 9 picks in 10)."""
    meta = deepseek_like()
    budgets = Budgets(vram=96 * GB, ram=280 * GB)
    opts = msgspec.structs.replace(REFERENCE_OPTS, cache_slots=AUTO)
    # Routing not measured: the static model would keep whole layers (a slot is worth a
    # resident expert less its layer's pads), but a cache follows the traffic, so every
    # layer in RAM gets slots (engine.expert_split says what the GPU measured).
    flat = make_plan(meta, budgets, opts)
    plain = make_plan(meta, budgets, REFERENCE_OPTS)
    fs = flat.split
    assert fs is not None and fs.resident == () and len(fs.cached) == 44 and fs.slots > 0
    assert flat.vram_used <= budgets.vram and flat.ram_used <= budgets.ram
    assert fs.uniform_share == pytest.approx(fs.slots / meta.n_expert)
    assert fs.slots / meta.n_expert > plain.expert_layers_on_gpu / 44 - 0.05  # bytes alike
    assert "routing not measured yet" in format_plan(flat)

    hot = picks_model(_zipf(47, meta.n_expert, 1.1, seed=1))
    assert hot.hit(round(0.38 * meta.n_expert)) > 0.85  # like the reference's traffic
    plan = make_plan(meta, budgets, msgspec.structs.replace(opts, picks=hot))
    sp = plan.split
    assert sp is not None and sp.slots >= 1 and len(sp.resident) + len(sp.cached) == 44
    assert len(sp.resident) < plain.expert_layers_on_gpu
    assert plan.vram_used <= budgets.vram and plan.ram_used <= budgets.ram
    cached = {f"blk.{n}." for n in sp.cached}
    for t in plan.tensors:  # a cached layer's experts are all in host RAM (the patch's rule)
        if EXPERT.search(t.name) and t.name[: t.name.index(".", 4) + 1] in cached:
            assert t.device == "ram"
    assert sp.expected_share > 0.8 > sp.uniform_share
    text = format_plan(plan)
    assert f"expert cache: {sp.slots} slots (+6 pad) in each of {len(sp.cached)} layers" in text
    assert "measured routing" in text
    assert plan_from_json(plan_to_json(plan)) == plan


def test_without_the_cache_the_plan_is_unchanged() -> None:
    meta = deepseek_like()
    budgets = Budgets(vram=96 * GB, ram=280 * GB)
    plain = make_plan(meta, budgets, REFERENCE_OPTS)
    assert plain.split is None and plain.vram_reserve.expert_cache == 0
    assert "expert cache" not in format_plan(plain)


def test_a_fixed_cache_size_keeps_the_most_resident_layers_that_leave_room_for_it() -> None:
    free = 4 * 120_000 + 100_000
    sp = split_experts(LAYERS, N_EXPERT, USED, free, PickModel(N_EXPERT), slots=20)
    # 3 resident leave 220,000 bytes: 7 layers x (20 + 8) x 1000 = 196,000 fit
    assert sp.slots == 20 and sp.resident == (7, 8, 9) and sp.bank_bytes == 196_000
    none = split_experts(LAYERS, N_EXPERT, USED, 10_000, PickModel(N_EXPERT), slots=20)
    assert none.slots == 0 and none.resident == ()  # it fits nowhere: no cache
