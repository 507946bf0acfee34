"""deploy/'s monitoring: Prometheus's config and alert rules are valid (`promtool`); every
metric a dashboard panel or an alert reads is one the server serves; and a real Prometheus
scraping a server under load answers a TTFT quantile.

Prometheus comes from Debian's package, which `make test` installs when it can; where it
cannot, these tests are skipped with the reason (the rest of the suite does not need it).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from bench.server_proc import Server, free_port, start_process, start_server
from tests.tiny_gguf import write_qwen3moe

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
NO_PROMETHEUS = "Debian's prometheus package is not installed (make test installs it as root)"


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name}: {NO_PROMETHEUS}")
    return path


def _expressions() -> list[tuple[str, str]]:
    """(where, PromQL) of every dashboard panel target and alert rule."""
    dash = json.loads((DEPLOY / "grafana/dashboards/one-gpu.json").read_text())
    out = [(f"panel {p['title']!r}", t["expr"]) for p in dash["panels"] for t in p["targets"]]
    rules = yaml.safe_load((DEPLOY / "prometheus/alerts.yml").read_text())
    out += [(f"alert {r['alert']}", r["expr"]) for g in rules["groups"] for r in g["rules"]]
    return out


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A MoE model with router telemetry on, so the expert panels have their series."""
    d = tmp_path_factory.mktemp("monitoring")
    model = write_qwen3moe(d / "moe.gguf", seed=4)
    srv = start_server(
        ["--model", str(model), "--served-model-name", "moe", "--n-ctx", "1024",
         "--repro-slots", "0", "--expert-sample-rate", "1"],
        d / "server.log",
    )  # fmt: skip
    yield srv
    srv.stop()


def _load(srv: Server, n: int = 8) -> None:
    body = {"model": "moe", "prompt": "abc", "max_tokens": 8, "temperature": 0}

    def one(_: int) -> int:
        return httpx.post(srv.base_url + "/completions", json=body, timeout=60).status_code

    with ThreadPoolExecutor(4) as pool:
        codes = list(pool.map(one, range(n)))
    assert codes == [200] * n
    httpx.post(srv.base_url + "/completions", json={"model": "nope", "prompt": "a"})  # a 404


def test_promtool_accepts_the_config_and_the_rules() -> None:
    promtool = _tool("promtool")
    for args in (["check", "config", "prometheus.yml"], ["check", "rules", "alerts.yml"]):
        out = subprocess.run([promtool, *args], cwd=DEPLOY / "prometheus",
                             capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
        assert out.returncode == 0, out.stdout + out.stderr


def test_every_metric_the_dashboard_and_alerts_read_is_served(moe: Server) -> None:
    _load(moe)
    text = httpx.get(moe.url + "/metrics").text
    served = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    for where, expr in _expressions():
        for name in re.findall(r"\bonegpu_[a-z_]+", expr):
            assert name in served, f"{where} reads {name}, which /metrics does not have"


def test_prometheus_scrapes_the_server_under_load_and_answers_a_ttft_quantile(
    moe: Server, tmp_path: Path
) -> None:
    prometheus = _tool("prometheus")
    config = yaml.safe_load((DEPLOY / "prometheus/prometheus.yml").read_text())
    config["global"]["scrape_interval"] = "1s"
    config["scrape_configs"][0]["static_configs"] = [{"targets": [f"127.0.0.1:{moe.port}"]}]
    config["rule_files"] = [str(DEPLOY / "prometheus/alerts.yml")]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    prom = start_process(
        [prometheus, f"--config.file={tmp_path / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
        port, tmp_path / "prometheus.log", ready_path="/-/ready",
    )  # fmt: skip
    query = ("histogram_quantile(0.9, sum by (le) "
             "(rate(onegpu_time_to_first_token_seconds_bucket[30s])))")  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        value = float("nan")
        while not value > 0:  # scrapes before and after some load: the rate is defined
            assert time.monotonic() < deadline, f"no TTFT quantile from Prometheus: {value}"
            _load(moe, 4)
            got = httpx.get(f"http://127.0.0.1:{port}/api/v1/query", params={"query": query})
            result = got.json()["data"]["result"]
            value = float(result[0]["value"][1]) if result else float("nan")
        assert value < 60  # seconds: a quantile of this server's real TTFTs
        up = httpx.get(f"http://127.0.0.1:{port}/api/v1/query",
                       params={"query": 'up{job="one-gpu"}'}).json()["data"]["result"]  # fmt: skip
        assert [r["value"][1] for r in up] == ["1"]
    finally:
        prom.stop()
