"""A GGUF from the Hugging Face hub (or any server speaking its file API, HF_ENDPOINT),
for `one-gpu run --hf-repo REPO --hf-file FILE`, and `one-gpu download` (the same fetch,
then exit: a Kubernetes init container fills the model volume with it before the server
starts, so the server's start does not count the transfer against its startup probe).

Through `huggingface_hub`, into its cache (HF_HUB_CACHE, ~/.cache/huggingface/hub by
default; `--hf-cache` names another), so a file fetched by other tools is not fetched
again. A split GGUF (`…-00001-of-00003.gguf`) is fetched whole, every part. Before any
byte is fetched: the parts not in the cache are sized against the free disk. A transfer
that breaks is resumed where it stopped (the hub client's `.incomplete` file and an HTTP
range). Each fetched part is checked against the hub's SHA-256 (its large files' ETag);
a mismatch is deleted and refused. Offline, a model already in the cache is served from
it; one that is not is a clear error, not a stack trace.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

SPLIT = re.compile(r"^(?P<stem>.*)-(?P<i>\d{5})-of-(?P<n>\d{5})\.gguf$")
SHA256 = re.compile(r"^[0-9a-f]{64}$")


class DownloadError(RuntimeError):
    """What stopped a download, in words for the operator."""


@dataclass(frozen=True, slots=True)
class Source:
    repo: str
    filename: str
    revision: str | None = None
    cache: Path | None = None  # None: huggingface_hub's own cache

    @property
    def parts(self) -> list[str]:
        """Every file of the model: a split GGUF's parts, from whichever part was named."""
        m = SPLIT.match(self.filename)
        if not m:
            return [self.filename]
        n = int(m["n"])
        return [f"{m['stem']}-{i:05d}-of-{n:05d}.gguf" for i in range(1, n + 1)]

    def where(self) -> str:
        from huggingface_hub import constants

        return str(self.cache or constants.HF_HUB_CACHE)


def fetch(src: Source) -> Path:
    """The model's first part on local disk (llama.cpp finds the others beside it)."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = str(src.cache) if src.cache else None
    have = {p: _cached(src, p) for p in src.parts}
    missing = [p for p, path in have.items() if path is None]
    if not missing:
        return Path(str(have[src.parts[0]]))
    try:
        metas = [
            get_hf_file_metadata(
                hf_hub_url(src.repo, p, revision=src.revision, endpoint=endpoint())
            )
            for p in missing
        ]
    except Exception as e:  # offline, refused, unknown repo: say what and where
        raise DownloadError(
            f"cannot fetch {src.repo}/{missing[0]} from {endpoint()} ({_why(e)}), and it is "
            f"not in the cache {src.where()}: connect, or give --model PATH"
        ) from None
    need = sum(max((m.size or 0) - _arrived(src, m.etag), 0) for m in metas)
    free = shutil.disk_usage(_existing(Path(src.where()))).free
    if need > free:
        raise DownloadError(
            f"{src.repo}: {len(missing)} file(s) of {need / 2**30:.1f} GiB to fetch, "
            f"{free / 2**30:.1f} GiB free in {src.where()}"
        )
    for part, meta in zip(missing, metas, strict=True):
        try:
            path = Path(
                hf_hub_download(
                    src.repo, part, revision=src.revision, cache_dir=cache, endpoint=endpoint()
                )
            )
        except LocalEntryNotFoundError as e:
            raise DownloadError(f"{src.repo}/{part}: {_why(e)}") from None
        _check(path, meta.etag, f"{src.repo}/{part}")
        have[part] = str(path)
    return Path(str(have[src.parts[0]]))


def _arrived(src: Source, etag: str | None) -> int:
    """Bytes of a broken transfer of this file already on disk (the hub client's
    `blobs/<etag>.incomplete`, which it resumes): they need no more room."""
    if not etag:
        return 0
    from huggingface_hub.constants import HF_HUB_CACHE

    root = Path(src.cache) if src.cache else Path(HF_HUB_CACHE)
    blob = root / f"models--{src.repo.replace('/', '--')}" / "blobs" / f"{etag}.incomplete"
    return blob.stat().st_size if blob.is_file() else 0


def _cached(src: Source, part: str) -> str | None:
    from huggingface_hub import try_to_load_from_cache

    got = try_to_load_from_cache(
        src.repo, part, cache_dir=str(src.cache) if src.cache else None, revision=src.revision
    )
    return got if isinstance(got, str) else None


def _check(path: Path, etag: str | None, name: str) -> None:
    """The hub names a large file's content by its SHA-256 (the ETag): the bytes on disk
    must have it. A mismatch is removed (blob and link), so the next try fetches again."""
    want = (etag or "").strip('"').removeprefix("W/").strip('"')
    if not SHA256.match(want):
        return  # a small file kept in git: named by its git hash, nothing to compare
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    if h.hexdigest() != want:
        blob = path.resolve()
        path.unlink(missing_ok=True)
        blob.unlink(missing_ok=True)
        raise DownloadError(f"{name}: checksum mismatch (SHA-256 {h.hexdigest()}, hub {want})")


def _existing(p: Path) -> Path:
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co")


def _why(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="one-gpu download",
        description="fetch a GGUF (a split one whole) into the hub cache, check it, print "
        "the path of its first part and exit; `one-gpu run` with the same --hf-* options "
        "then serves it from the cache, offline too",
    )
    add_hub_options(p, required=True)
    return p


def add_hub_options(p: argparse.ArgumentParser, required: bool) -> None:
    """--hf-repo, --hf-file, --hf-revision, --hf-cache: the same for `download` and `run`,
    so that an init container and the server it prepares name the model alike."""
    p.add_argument("--hf-repo", required=required, help="hub repository (HF_ENDPOINT)")
    p.add_argument("--hf-file", required=required,
                   help="the GGUF in it (a split model: any part; all come)")  # fmt: skip
    p.add_argument("--hf-revision", help="branch, tag or commit (default: main)")
    p.add_argument(
        "--hf-cache", type=Path,
        help="where models are kept (default: HF_HUB_CACHE, ~/.cache/huggingface/hub)",
    )  # fmt: skip


def main(argv: Sequence[str]) -> int:
    """`one-gpu download`: 0 with the model in the cache (fetched now or before), 2 with
    the reason it is not."""
    args = parser().parse_args(argv)
    src = Source(args.hf_repo, args.hf_file, args.hf_revision, args.hf_cache)
    try:
        path = fetch(src)
    except DownloadError as e:
        sys.stderr.write(f"one-gpu download: {e}\n")
        return 2
    sys.stdout.write(f"{path}\n")
    return 0
