"""What the process serves and where it put it: the model's name, whether it is still
loading, the weights by device and by llama.cpp buffer, and the placement plan's budgets.
Set once at start, never fed per step."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge


class ProcessMetrics:
    def __init__(self, r: CollectorRegistry, model_name: str) -> None:
        self.registry = r
        Gauge(
            "onegpu_loading",
            "1 while the model loads: the server listens before it serves",
            registry=r,
        ).set(0)
        info = Gauge("onegpu_model_info", "The served model", ["model"], registry=r)
        info.labels(model=model_name).set(1)

    def set_placement(
        self, placed: dict[str, tuple[int, int]], budgets: dict[str, int] | None
    ) -> None:
        """Where the weights live: `placed[device] = (bytes, tensors)` for "gpu" and
        "ram"; `budgets[device]` the plan's budgets when a plan decided the layout."""
        r = self.registry
        size = Gauge("onegpu_placement_bytes", "Weight bytes by device", ["device"], registry=r)
        count = Gauge(
            "onegpu_placement_tensors", "Weight tensors by device", ["device"], registry=r
        )
        for device, (nbytes, n) in placed.items():
            size.labels(device=device).set(nbytes)
            count.labels(device=device).set(n)
        if budgets:
            budget = Gauge(
                "onegpu_plan_budget_bytes", "The placement plan's memory budgets", ["device"],
                registry=r,
            )  # fmt: skip
            for device, v in budgets.items():
                budget.labels(device=device).set(v)

    def set_weight_buffers(self, by_buffer: dict[str, int]) -> None:
        """Weight bytes by llama.cpp buffer as the load allocated them (engine.weight_buffers):
        `CUDA_Host` is page-locked host memory, `CPU` plain, `CPU_Mapped` the mapped file."""
        size = Gauge("onegpu_weight_buffer_bytes", "Weight bytes by llama.cpp buffer",
                     ["buffer"], registry=self.registry)  # fmt: skip
        for name, nbytes in by_buffer.items():
            size.labels(buffer=name).set(nbytes)
