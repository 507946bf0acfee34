"""`one-gpu run --hf-repo/--hf-file`'s download (deploy.download) against a local server
speaking the hub's file API (tests.fake_hub, HF_ENDPOINT): a tiny generated GGUF in two
splits, fetched whole; resumed after a transfer that broke; refused on a checksum
mismatch, offline, or short of disk; not fetched again when it is in the cache."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub.constants
import pytest

import deploy.download
from bench.server_proc import free_port, start_process
from deploy.download import DownloadError, Source, fetch
from tests.fake_hub import Hub, serve
from tests.test_deploy_run import answers_then_stops
from tests.tiny_gguf import write_qwen3moe

ROOT = Path(__file__).resolve().parents[1]

REPO = "org/tiny-moe"
FIRST, SECOND = "tiny-00001-of-00002.gguf", "tiny-00002-of-00002.gguf"


@pytest.fixture(scope="module")
def parts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    d = tmp_path_factory.mktemp("gguf")
    write_qwen3moe(d / "tiny.gguf", seed=3, split_max_tensors=14)
    got = {p.name: p.read_bytes() for p in sorted(d.glob("tiny-*.gguf"))}
    assert list(got) == [FIRST, SECOND]
    return got


@pytest.fixture
def hub(parts: dict[str, bytes], monkeypatch: pytest.MonkeyPatch) -> Iterator[Hub]:
    with serve(Hub(REPO, dict(parts))) as h:
        monkeypatch.setenv("HF_ENDPOINT", h.url)
        yield h


def _src(tmp_path: Path, name: str = SECOND) -> Source:
    return Source(REPO, name, cache=tmp_path / "hub")


def test_a_split_model_is_fetched_whole_from_any_part(
    hub: Hub, parts: dict[str, bytes], tmp_path: Path
) -> None:
    first = fetch(_src(tmp_path))  # the second part named: both come
    assert first.name == FIRST
    assert first.read_bytes() == parts[FIRST]
    assert (first.parent / SECOND).read_bytes() == parts[SECOND]
    assert hub.gets(FIRST) == [None] and hub.gets(SECOND) == [None]


def test_a_broken_transfer_resumes_where_it_stopped(
    hub: Hub, parts: dict[str, bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the hub client writes what it has read in chunks (10 MiB): here files are small
    monkeypatch.setattr(huggingface_hub.constants, "DOWNLOAD_CHUNK_SIZE", 4096)
    hub.cut_once.add(SECOND)
    first = fetch(_src(tmp_path, FIRST))
    assert (first.parent / SECOND).read_bytes() == parts[SECOND]
    first_get, again = hub.gets(SECOND)
    assert first_get is None and again is not None  # the rest, not all again:
    resumed_at = int(again.removeprefix("bytes=").removesuffix("-"))
    assert 0 < resumed_at <= len(parts[SECOND]) // 2  # (what had arrived, in whole chunks)


def test_a_checksum_mismatch_is_refused_and_removed(hub: Hub, tmp_path: Path) -> None:
    hub.corrupt.add(FIRST)
    with pytest.raises(DownloadError, match=rf"{REPO}/{FIRST}: checksum mismatch"):
        fetch(_src(tmp_path))
    assert not [p for p in (tmp_path / "hub").rglob(FIRST) if p.exists()]


def test_offline_without_the_file_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    with pytest.raises(DownloadError) as e:
        fetch(_src(tmp_path))
    msg = str(e.value)
    assert msg.startswith(f"cannot fetch {REPO}/{FIRST} from http://127.0.0.1:9 (")
    assert msg.endswith(f"not in the cache {tmp_path / 'hub'}: connect, or give --model PATH")


def test_a_model_in_the_cache_is_not_fetched_again_even_offline(
    hub: Hub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = fetch(_src(tmp_path))
    seen = len(hub.requests)
    assert fetch(_src(tmp_path)) == first and len(hub.requests) == seen
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    assert fetch(_src(tmp_path)) == first


def test_too_little_disk_is_refused_before_any_byte(
    hub: Hub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = deploy.download.shutil.disk_usage

    def tiny(path: str | Path) -> object:
        return real(path)._replace(free=1000)

    monkeypatch.setattr(deploy.download.shutil, "disk_usage", tiny)
    with pytest.raises(DownloadError, match=r"2 file\(s\) of .* GiB to fetch, 0.0 GiB free"):
        fetch(_src(tmp_path))
    assert hub.gets(FIRST) == [] and hub.gets(SECOND) == []


def test_a_broken_transfer_needs_room_only_for_what_is_missing(
    hub: Hub, parts: dict[str, bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Most of both parts arrived before the transfer broke: the disk needs room for the
    rest only (the check counted whole files before, and refused this fetch)."""
    blobs = tmp_path / "hub" / f"models--{REPO.replace('/', '--')}" / "blobs"
    blobs.mkdir(parents=True)
    for data in parts.values():
        sha = hashlib.sha256(data).hexdigest()
        (blobs / f"{sha}.incomplete").write_bytes(data[:-100])
    real = deploy.download.shutil.disk_usage

    def short(path: str | Path) -> object:  # room for the missing 200 bytes and a little
        return real(path)._replace(free=1000)

    # (our check alone: the hub client's own one warns, and would on this little room)
    monkeypatch.setattr(deploy.download, "shutil", SimpleNamespace(disk_usage=short))
    first = fetch(_src(tmp_path))
    assert first.read_bytes() == parts[FIRST]
    assert (first.parent / SECOND).read_bytes() == parts[SECOND]


@pytest.mark.e2e
def test_run_fetches_a_split_model_and_serves_it(hub: Hub, tmp_path: Path) -> None:
    """`one-gpu run --hf-repo/--hf-file`: both parts fetched into the named cache, the
    server loads the split model from its first part and answers; a dry run fetches
    nothing and names what it would."""
    cache = tmp_path / "models"
    cmd = [sys.executable, "-m", "api.server.cli", "run", "--hf-repo", REPO, "--hf-file", SECOND,
           "--hf-cache", str(cache), "--served-model-name", "tiny", "--host", "127.0.0.1",
           "--n-ctx", "512", "--repro-slots", "0"]  # fmt: skip
    env = {"HF_ENDPOINT": hub.url, "ONEGPU_SYSFS": str(tmp_path / "no-sysfs")}
    dry = subprocess.run([*cmd, "--dry-run"], cwd=ROOT, env={**os.environ, **env},
                         capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert dry.returncode == 0, dry.stderr
    assert f"{hub.url}/{REPO}/resolve/main/{FIRST}" in dry.stdout.splitlines()
    assert hub.requests == [] and not cache.exists()
    port = free_port()
    srv = start_process([*cmd, "--port", str(port)], port, tmp_path / "run.log", env=env)
    answers_then_stops(srv, 2)
    assert hub.gets(FIRST) == [None] and hub.gets(SECOND) == [None]
    assert "binding: none (no NVIDIA GPU on this host)" in srv.log()


def _download(*args: str, endpoint: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_ENDPOINT": endpoint}
    return subprocess.run(
        [sys.executable, "-m", "api.server.cli", "download", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_the_download_command_fetches_checks_and_exits(
    hub: Hub, parts: dict[str, bytes], tmp_path: Path
) -> None:
    """`one-gpu download` (a Kubernetes init container's command): the whole split model
    into the cache, its first part's path on stdout, exit 0; run again offline, the cache
    answers; a model neither there nor reachable is exit 2 and one line that says so."""
    cache = tmp_path / "models"
    opts = ("--hf-repo", REPO, "--hf-file", SECOND, "--hf-cache", str(cache))
    got = _download(*opts, endpoint=hub.url)
    assert got.returncode == 0, got.stderr
    first = Path(got.stdout.strip())
    assert first.name == FIRST and first.read_bytes() == parts[FIRST]
    assert (first.parent / SECOND).read_bytes() == parts[SECOND]
    again = _download(*opts, endpoint="http://127.0.0.1:9")  # nothing listens there
    assert again.returncode == 0 and again.stdout == got.stdout, again.stderr
    bad = _download("--hf-repo", REPO, "--hf-file", "other.gguf", "--hf-cache", str(cache),
                    endpoint="http://127.0.0.1:9")  # fmt: skip
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.startswith(f"one-gpu download: cannot fetch {REPO}/other.gguf from ")


def test_a_checksum_mismatch_fails_the_download_command(hub: Hub, tmp_path: Path) -> None:
    hub.corrupt.add(FIRST)
    got = _download("--hf-repo", REPO, "--hf-file", FIRST, "--hf-cache", str(tmp_path / "m"),
                    endpoint=hub.url)  # fmt: skip
    assert got.returncode == 2
    assert f"one-gpu download: {REPO}/{FIRST}: checksum mismatch" in got.stderr
