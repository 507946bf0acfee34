"""Write the JSON schemas of the custom resources deploy/k8s uses (tests/test_k8s_manifests
validates the rendered manifests against them, offline).

Source: the cloudcoil model packages on PyPI, whose pydantic models are generated from
each project's CRD (its openAPIV3Schema): field names, types, required fields, enums and
patterns. Not installed with the project; in a scratch environment:
    python -m venv /tmp/crd && /tmp/crd/bin/pip install \\
        cloudcoil-models-keda==2.16.1.0 cloudcoil-models-prometheus-operator==0.80.1.0
    /tmp/crd/bin/python deploy/k8s/schemas/write_schemas.py

An object that lists its fields admits no others (`additionalProperties: false`), as the
API server's strict field validation (kubectl's default) refuses unknown fields of a
structural CRD; pydantic's schema leaves that out (its models ignore extra fields).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def closed(node: Any) -> Any:
    """`node` with every object schema that names its properties closed to others."""
    if isinstance(node, dict):
        out = {k: closed(v) for k, v in node.items()}
        if "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(node, list):
        return [closed(v) for v in node]
    return node


def main() -> None:
    from cloudcoil.models.keda.v1alpha1 import ScaledObject
    from cloudcoil.models.prometheus_operator.v1 import ServiceMonitor

    for name, model, source in (
        ("scaledobject-keda-v1alpha1", ScaledObject, "cloudcoil-models-keda==2.16.1.0"),
        ("servicemonitor-monitoring-v1", ServiceMonitor,
         "cloudcoil-models-prometheus-operator==0.80.1.0"),
    ):  # fmt: skip
        schema = closed(model.model_json_schema(by_alias=True))
        schema["$comment"] = f"written by write_schemas.py from {source} (PyPI)"
        path = HERE / f"{name}.json"
        path.write_text(json.dumps(schema, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
