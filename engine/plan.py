"""The placement planner: which tensors live on the GPU and which in host RAM (pure).

`make_plan(meta, budgets, options)` is a function of the model's header, the two budgets
and the serving options; it touches no device, so it is tested without one, and applying
the plan (llama.cpp's tensor buffer-type overrides, `cpu_patterns`) is a separate step.

What goes where, and why:

- The VRAM budget first pays for what must be on the GPU whatever the model: the KV cache
  for every token the server reserves (llama.cpp keeps it beside the layers it serves),
  the compute buffers of each context, and a margin for the CUDA context and allocator
  slack. What remains holds weights.
- Every non-expert tensor (attention, norms, output, dense FFNs, shared experts) is read
  in full for every token, so each byte of them on the GPU saves a byte of host-memory
  traffic per token; they go first, and if they do not fit the plan is refused. The input
  embeddings are the exception: llama.cpp looks rows up on the host (`token_embd` is never
  offloaded), so they count as RAM.
- A routed expert tensor (`blk.N.ffn_{gate,up,down}_exps`, all experts of one layer) is
  read only for the `n_expert_used / n_expert` share of its rows a token picks, so per
  VRAM byte it saves that share of a byte per token — the same for every expert tensor of
  a model. With the value per byte tied, whole layers go to the GPU from the last layer
  down (the complement of llama.cpp's `--n-cpu-moe N`, which keeps the first N in RAM, so
  a plan compares like for like with it), then any single expert tensor of the remaining
  layers that still fits, so no usable VRAM is left over.
- Everything else is in host RAM, computed there by the CPU threads; the RAM budget pays
  for those tensors, the host-side compute and output buffers and a margin. A host that
  cannot hold them is refused rather than left to swap once the server runs.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Literal

import msgspec

from engine.expert_split import ExpertSplit, PickModel, cache_everywhere, split_experts
from engine.gguf_meta import ModelMeta, TensorInfo

Device = Literal["gpu", "ram"]
GiB = 1 << 30
MiB = 1 << 20
AUTO = -1  # PlanOptions.cache_slots: as many as serve the most picks

# llama.cpp's --cpu-moe pattern (common/arg.cpp), anchored: every routed expert tensor.
_EXPERT = re.compile(r"^blk\.(\d+)\.ffn_(up|down|gate|gate_up)_(ch|)exps\.")
_SHARED = re.compile(r"_(sh|ch)exp\b|_shexp")
_HOST_ONLY = ("token_embd.",)  # llama.cpp's input layer stays on the host


class Budgets(msgspec.Struct, frozen=True):
    vram: int  # bytes of GPU memory the plan may use
    ram: int  # bytes of host RAM the plan may use


def output_rows(seq_ids: int, prompt_logprob_rows: int) -> int:
    """The logit rows a context is sized for (`PlanOptions.n_outputs`): a row per llama.cpp
    sequence id (twice the server's ids where device greedy may run), or a scored prompt's
    call (engine.context)."""
    return max(2 * seq_ids, prompt_logprob_rows)


class PlanOptions(msgspec.Struct, frozen=True):
    kv_tokens: int = 16384  # KV cells over all sequences and contexts
    n_ubatch: int = 512
    contexts: int = 1  # llama contexts sharing the weights (each has compute buffers)
    # Logit rows a context's call may ask for (`output_rows`; engine.context sets llama.cpp's
    # n_outputs_max to them). 0: n_ubatch, llama.cpp's default sizing.
    n_outputs: int = 0
    # The CUDA context, cuBLAS workspace and allocator slack: what a process uses beyond the
    # buffers modelled here. Measured on an H200 (CUDA 13, nvidia-smi, a 30B MoE): 244-311 MiB
    # over three layouts (all on the GPU, half the experts in RAM, all in RAM); 384 MiB keeps
    # ~70 MiB over the worst of them. A larger margin leaves VRAM unused (llama.cpp's own
    # fitting keeps 1 GiB free); `--vram-margin` sets it.
    vram_margin: int = 384 * MiB
    ram_margin: int = 4 * GiB  # the process, Python, page-cache churn (at most 5% of RAM)
    # With experts in host RAM, split their VRAM between whole layers and a cache of single
    # experts (engine.expert_split) under this pick model (None: uniform routing): AUTO
    # slots a layer as the split decides, N exactly N, 0 no cache (whole layers, then
    # single tensors).
    cache_slots: int = 0
    picks: PickModel | None = None


class Reserve(msgspec.Struct, frozen=True):
    kv: int
    compute: int
    margin: int
    # Weights llama.cpp copies to the GPU while it runs: a tied output matrix (no
    # `output.weight`: `token_embd` is duplicated onto the output device) and, for ubatches
    # of >= 32 tokens, the expert tensors kept in RAM that it runs on the GPU (the copy
    # lives in the compute pool; two, so one can load while the other runs).
    copies: int = 0
    expert_cache: int = 0  # the routed-expert cache's slots (engine.expert_split)

    @property
    def total(self) -> int:
        return self.kv + self.compute + self.margin + self.copies + self.expert_cache


class Placed(msgspec.Struct, frozen=True):
    name: str
    device: Device
    nbytes: int
    group: str


class Plan(msgspec.Struct, frozen=True):
    model: str
    n_layer: int
    n_expert: int
    budgets: Budgets
    options: PlanOptions
    vram_reserve: Reserve
    ram_reserve: Reserve
    tensors: tuple[Placed, ...]
    split: ExpertSplit | None = None  # resident layers and cache slots, when cached

    def bytes_on(self, device: Device) -> int:
        return sum(t.nbytes for t in self.tensors if t.device == device)

    @property
    def vram_used(self) -> int:
        return self.bytes_on("gpu") + self.vram_reserve.total

    @property
    def ram_used(self) -> int:
        return self.bytes_on("ram") + self.ram_reserve.total

    @property
    def expert_layers_on_gpu(self) -> int:
        """Layers whose routed expert tensors are all on the GPU."""
        by_layer: dict[int, bool] = {}
        for t in self.tensors:
            if (layer := expert_layer(t.name)) >= 0:
                by_layer[layer] = by_layer.get(layer, True) and t.device == "gpu"
        return sum(by_layer.values())


class PlanDoesNotFit(Exception):
    """The host cannot hold the minimum layout; the message carries the numbers."""

    def __init__(
        self, resource: str, needed: int, available: int, detail: str, advice: list[str]
    ) -> None:
        self.resource = resource
        self.needed = needed
        self.available = available
        self.shortfall = needed - available
        self.advice = tuple(advice)
        super().__init__(
            f"{resource}: needs {_gib(needed)} ({detail}), has {_gib(available)}: "
            f"short by {_gib(self.shortfall)}. Would help: " + "; ".join(advice) + "."
        )


def group_of(name: str) -> str:
    """The table row a tensor belongs to."""
    if _EXPERT.match(name):
        return "routed experts"
    if name.startswith("token_embd."):
        return "embeddings"
    if name.startswith(("output.", "output_norm.")):
        return "output"
    if ".ffn_" in name and _SHARED.search(name):
        return "shared experts"
    if ".ffn_gate_inp" in name or ".exp_probs" in name:
        return "router"
    if ".attn_" in name:
        return "attention"
    if ".ffn_" in name and "norm" not in name:
        return "dense ffn"
    return "norms and other"


def compute_bytes(meta: ModelMeta, n_ubatch: int, n_outputs: int = 0) -> int:
    """A generous estimate of one context's compute buffer: the f32 logits of the rows
    that may be output (llama.cpp sizes them for min(n_ubatch, n_outputs_max) rows: every
    row by default) plus activations of a few dozen model widths for every row."""
    rows = min(n_outputs, n_ubatch) if n_outputs > 0 else n_ubatch
    return (rows * meta.n_vocab + n_ubatch * 64 * meta.n_embd) * 4


def reserves(
    meta: ModelMeta, opts: PlanOptions, ram_budget: int | None = None, experts_in_ram: bool = False
) -> tuple[Reserve, Reserve]:
    """(VRAM, RAM) set aside before any weight is placed. The RAM margin shrinks to 5% of
    a small RAM budget: a GPU host with a few GiB free must still serve a small model."""
    compute = compute_bytes(meta, opts.n_ubatch, opts.n_outputs) * opts.contexts
    names = {t.name: t.nbytes for t in meta.tensors}
    copies = names.get("token_embd.weight", 0) if "output.weight" not in names else 0
    if experts_in_ram and opts.n_ubatch >= 32:
        copies += 2 * max((t.nbytes for t in meta.tensors if expert_layer(t.name) >= 0), default=0)
    vram = Reserve(
        kv=opts.kv_tokens * meta.kv_bytes_per_token, compute=compute, margin=opts.vram_margin,
        copies=copies,
    )  # fmt: skip
    margin = opts.ram_margin if ram_budget is None else min(opts.ram_margin, ram_budget // 20)
    return vram, Reserve(kv=0, compute=compute, margin=margin)


def vram_for_expert_share(meta: ModelMeta, opts: PlanOptions, share: float) -> int:
    """The VRAM budget that holds the non-expert part, the reserves and `share` of the
    routed experts' bytes (benchmarks and tests use it to ask for "about half")."""
    vram, _ = reserves(meta, opts, experts_in_ram=share < 1)
    return vram.total + _dense_gpu_bytes(meta) + round(share * _expert_bytes(meta))


def _dense_gpu_bytes(meta: ModelMeta) -> int:
    """The non-expert tensors the GPU must hold (all but the host-only ones)."""
    return sum(
        t.nbytes for t in meta.tensors if expert_layer(t.name) < 0 and not _host_only(t.name)
    )


def _expert_bytes(meta: ModelMeta) -> int:
    return sum(t.nbytes for t in meta.tensors if expert_layer(t.name) >= 0)


def expert_layer(name: str) -> int:
    """The layer of a routed expert tensor, -1 for any other tensor."""
    m = _EXPERT.match(name)
    return int(m.group(1)) if m else -1


def _host_only(name: str) -> bool:
    return name.startswith(_HOST_ONLY)


def make_plan(meta: ModelMeta, budgets: Budgets, opts: PlanOptions) -> Plan:
    """Place every tensor of `meta` within `budgets` (see the module doc for the order)."""
    dense = _dense_gpu_bytes(meta)
    vram_res, ram_res = reserves(meta, opts, budgets.ram)
    if vram_res.total + dense + _expert_bytes(meta) > budgets.vram:
        vram_res, ram_res = reserves(meta, opts, budgets.ram, experts_in_ram=True)
    device: dict[str, Device] = {}
    experts = []
    for t in meta.tensors:
        if expert_layer(t.name) >= 0:
            experts.append(t)
        else:
            device[t.name] = "ram" if _host_only(t.name) else "gpu"
    free = budgets.vram - vram_res.total - dense
    if free < 0:
        raise PlanDoesNotFit(
            "VRAM",
            vram_res.total + dense,
            budgets.vram,
            f"non-expert tensors {_gib(dense)} + KV cache {_gib(vram_res.kv)} for "
            f"{opts.kv_tokens} tokens + compute {_gib(vram_res.compute)} + margin "
            f"{_gib(vram_res.margin)} + weight copies {_gib(vram_res.copies)}",
            _vram_advice(meta, budgets, opts, vram_res, dense),
        )

    # Whole layers from the last down; then first fit of single tensors in the same order.
    by_layer: dict[int, list[TensorInfo]] = defaultdict(list)
    for t in experts:
        by_layer[expert_layer(t.name)].append(t)
    order = sorted(by_layer, reverse=True)
    split = _split(meta, opts, by_layer, free) if opts.cache_slots and experts else None
    if split is not None:
        for n in order:
            for t in by_layer[n]:
                device[t.name] = "gpu" if n in split.resident else "ram"
        vram_res = msgspec.structs.replace(vram_res, expert_cache=split.bank_bytes)
        order = []
    partial_from = len(order)
    for i, n in enumerate(order):
        size = sum(t.nbytes for t in by_layer[n])
        if size > free:
            partial_from = i
            break
        free -= size
        for t in by_layer[n]:
            device[t.name] = "gpu"
    for n in order[partial_from:]:
        for t in sorted(by_layer[n], key=lambda t: -t.nbytes):
            if t.nbytes <= free:
                free -= t.nbytes
                device[t.name] = "gpu"
            else:
                device[t.name] = "ram"
    placed = tuple(
        Placed(name=t.name, device=device[t.name], nbytes=t.nbytes, group=group_of(t.name))
        for t in meta.tensors
    )
    plan = Plan(
        model=meta.name,
        n_layer=meta.n_layer,
        n_expert=meta.n_expert,
        budgets=budgets,
        options=opts,
        vram_reserve=vram_res,
        ram_reserve=ram_res,
        tensors=placed,
        split=split,
    )
    if plan.ram_used > budgets.ram:
        raise PlanDoesNotFit(
            "RAM",
            plan.ram_used,
            budgets.ram,
            f"tensors kept in host RAM {_gib(plan.bytes_on('ram'))} + host buffers "
            f"{_gib(ram_res.compute)} + margin {_gib(ram_res.margin)}, with "
            f"{_gib(plan.bytes_on('gpu'))} of weights already on the GPU",
            [
                f"{_gib(plan.ram_used - budgets.ram)} more host RAM (or a larger --ram-budget)",
                "a GPU with more memory (each GiB of VRAM takes a GiB of experts out of RAM)",
                "a smaller quantization of the model",
            ],
        )
    return plan


def _split(
    meta: ModelMeta, opts: PlanOptions, by_layer: dict[int, list[TensorInfo]], free: int
) -> ExpertSplit | None:
    """The cache's split when some layer stays in host RAM and a slot fits; None (whole
    layers, then single tensors) otherwise."""
    layer_bytes = {n: sum(t.nbytes for t in ts) for n, ts in by_layer.items()}
    if sum(layer_bytes.values()) <= free:
        return None
    model = opts.picks or PickModel(meta.n_expert)
    slots: int | None = opts.cache_slots
    if slots == AUTO:  # unmeasured routing: slots everywhere (engine.expert_split says why)
        slots = None if not model.uniform else cache_everywhere(
            layer_bytes, meta.n_expert, meta.n_expert_used, free
        )  # fmt: skip
    split = split_experts(layer_bytes, meta.n_expert, meta.n_expert_used, free, model, slots)
    return split if split.slots else None


def _vram_advice(
    meta: ModelMeta, budgets: Budgets, opts: PlanOptions, res: Reserve, dense: int
) -> list[str]:
    advice = []
    room_for_kv = budgets.vram - dense - res.compute - res.margin - res.copies
    if room_for_kv > 0 and meta.kv_bytes_per_token:
        fits = room_for_kv // meta.kv_bytes_per_token
        advice.append(
            f"a smaller context: at most {fits} KV tokens in all fit "
            f"(asked {opts.kv_tokens}: lower --ctx or --parallel)"
        )
    elif opts.n_ubatch > 64:
        advice.append("a smaller --n-ubatch (smaller compute buffers)")
    advice.append(f"a larger --vram-budget or a GPU with at least {_gib(dense + res.total)}")
    advice.append("a smaller quantization of the model's non-expert tensors")
    return advice


def cpu_patterns(plan: Plan) -> tuple[str, ...]:
    """llama.cpp tensor-override regexes (searched, first match wins) that send exactly the
    plan's RAM tensors to the host buffer: one pattern for the layers whose expert tensors
    are all in RAM, one listing any other tensor by its exact name. `token_embd` needs none."""
    expert_layers: dict[int, list[Placed]] = defaultdict(list)
    for t in plan.tensors:
        if (n := expert_layer(t.name)) >= 0:
            expert_layers[n].append(t)
    whole = sorted(n for n, ts in expert_layers.items() if all(t.device == "ram" for t in ts))
    singles = [
        t.name
        for t in plan.tensors
        if t.device == "ram" and not _host_only(t.name) and expert_layer(t.name) not in whole
    ]
    patterns = []
    if whole:
        layers = "|".join(str(n) for n in whole)
        patterns.append(rf"^blk\.(?:{layers})\.ffn_(?:up|down|gate|gate_up)_(?:ch|)exps\.")
    if singles:
        patterns.append("^(?:" + "|".join(re.escape(n) for n in singles) + ")$")
    return tuple(patterns)


def format_plan(plan: Plan) -> str:
    """The table `one-gpu plan` prints and `serve` logs."""
    rows: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for t in plan.tensors:
        row = rows[t.group]
        row[0] += 1
        row[1 if t.device == "gpu" else 2] += t.nbytes
    lines = [
        f"model {plan.model}: {plan.n_layer} layers, {plan.n_expert} routed experts per layer",
        f"{'group':<18}{'tensors':>8}{'on GPU':>12}{'in RAM':>12}",
    ]
    for g in sorted(rows, key=lambda g: -(rows[g][1] + rows[g][2])):
        n, gpu, ram = rows[g]
        lines.append(f"{g:<18}{n:>8}{_gib(gpu):>12}{_gib(ram):>12}")
    lines.append(
        f"{'total':<18}{len(plan.tensors):>8}{_gib(plan.bytes_on('gpu')):>12}"
        f"{_gib(plan.bytes_on('ram')):>12}"
    )
    v, r = plan.vram_reserve, plan.ram_reserve
    cache = f" + expert cache {_gib(v.expert_cache)}" if v.expert_cache else ""
    lines.append(
        f"GPU: weights {_gib(plan.bytes_on('gpu'))} + KV {_gib(v.kv)} "
        f"({plan.options.kv_tokens} tokens) + compute {_gib(v.compute)} "
        f"({plan.options.n_ubatch}-row batches) + weight copies "
        f"{_gib(v.copies)}{cache} + margin {_gib(v.margin)} = {_gib(plan.vram_used)} of "
        f"{_gib(plan.budgets.vram)} budget"
    )
    lines.append(
        f"RAM: weights {_gib(plan.bytes_on('ram'))} + host buffers {_gib(r.compute)} + "
        f"margin {_gib(r.margin)} = {_gib(plan.ram_used)} of {_gib(plan.budgets.ram)} budget"
    )
    if plan.n_expert:
        exp = [t for t in plan.tensors if t.group == "routed experts"]
        on = sum(t.nbytes for t in exp if t.device == "gpu")
        total = sum(t.nbytes for t in exp) or 1
        lines.append(
            f"routed experts on GPU: {plan.expert_layers_on_gpu} whole layers, "
            f"{_gib(on)} of {_gib(total)} ({100 * on / total:.1f}%)"
        )
    if plan.options.cache_slots and plan.split is None and experts_in_ram(plan):
        lines.append(
            "expert cache: none (under this pick model whole layers and single tensors serve "
            "more picks per byte than cache slots)"
        )
    if (sp := plan.split) is not None:
        measured = plan.options.picks is not None and not plan.options.picks.uniform
        share = (
            f"expected GPU pick share {sp.expected_share:.1%} (measured routing; "
            f"{sp.uniform_share:.1%} uniform"
            if measured
            else f"GPU pick share at least {sp.uniform_share:.1%} (routing not measured yet: "
            "uniform, the floor; the cache follows the traffic"
        )
        lines.append(
            f"expert cache: {sp.slots} slots (+{sp.pad} pad) in each of {len(sp.cached)} layers "
            f"in RAM, {_gib(sp.bank_bytes)}; {share}, {sp.resident_share:.1%} from resident "
            "layers)"
        )
    return "\n".join(lines)


def experts_in_ram(plan: Plan) -> bool:
    """Whether the plan leaves some routed expert tensor in host RAM."""
    return any(expert_layer(t.name) >= 0 and t.device == "ram" for t in plan.tensors)


def plan_to_json(plan: Plan) -> bytes:
    return msgspec.json.encode(plan)


def plan_from_json(data: bytes) -> Plan:
    """A saved plan (raises msgspec.ValidationError, a ValueError, on a malformed one)."""
    return msgspec.json.decode(data, type=Plan)


_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(i?)(b?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes in "80GiB", "80G" (both 1024^3), "80GB" (1000^3), "512M", "1.5T", "123"."""
    m = _SIZE.match(text)
    if m is None:
        raise ValueError(f"not a size: {text!r} (e.g. 80GiB, 96GB, 512M)")
    number, unit, binary, b = m.groups()
    power = "kmgt".find(unit.lower()) + 1 if unit else 0
    base = 1000 if (b and not binary and unit) else 1024
    return round(float(number) * float(base) ** power)


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"
