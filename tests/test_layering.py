"""The package layers: the scheduler core and the engine never reach up into the API, and
no two modules import each other, directly or around a loop (a cycle makes every module
on it load only in one order, and none of them can be understood alone).

Inside the API, one rule per boundary (docs/design/request-path.md): a protocol
(`api.protocols.<wire>`) imports the pipeline and the server's shared parts, never another
protocol; the pipeline imports no protocol; the server imports protocols only where it
mounts their routes (`api.server.app`)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("api", "engine", "scheduler", "deploy")


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (at any level of the file, type-checking
    imports included: a cycle through them is still one for a reader)."""
    files = {
        ".".join(f.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): f
        for pkg in PACKAGES
        for f in (ROOT / pkg).rglob("*.py")
    }
    graph: dict[str, set[str]] = {}
    for name, f in files.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                deps |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        graph[name] = {d for d in deps if d in files and d != name}
    return graph


def test_the_scheduler_and_the_engine_do_not_import_the_api() -> None:
    graph = import_graph()
    assert len(graph) > 50, "the walk found the packages"
    up = {
        (m, d) for m, ds in graph.items() for d in ds
        if m.split(".")[0] in ("scheduler", "engine") and d.split(".")[0] == "api"
    }  # fmt: skip
    assert not up, up


def test_no_module_imports_itself_around_a_loop() -> None:
    graph = import_graph()
    state: dict[str, int] = {}  # 1: on the walk's path, 2: done
    cycles: list[list[str]] = []

    def walk(m: str, path: list[str]) -> None:
        state[m] = 1
        path.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycles.append([*path[path.index(d) :], d])
            elif d not in state:
                walk(d, path)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            walk(m, [])
    assert not cycles, cycles


PROTOCOLS = "api.protocols"
MOUNT = "api.server.app"  # the one server module that knows the protocols


def _package(module: str, root: str) -> str | None:
    """The package right under `root` that `module` belongs to (`api.protocols.openai` for
    `api.protocols.openai.chat`), or None outside `root` or for `root`'s own modules."""
    if not module.startswith(root + "."):
        return None
    rest = module.removeprefix(root + ".").split(".")
    return f"{root}.{rest[0]}" if len(rest) > 1 else None


def test_the_protocols_are_packages_found_on_disk() -> None:
    found = {_package(m, PROTOCOLS) for m in import_graph()} - {None}
    assert found >= {f"{PROTOCOLS}.{p}" for p in ("openai", "anthropic", "llama")}, found


def test_a_protocol_never_imports_another() -> None:
    graph = import_graph()
    crossing = {
        (m, d) for m, ds in graph.items() for d in ds
        if (mine := _package(m, PROTOCOLS)) is not None
        and _package(d, PROTOCOLS) not in (None, mine)
    }  # fmt: skip
    assert not crossing, crossing


def test_the_pipeline_imports_no_protocol() -> None:
    graph = import_graph()
    up = {
        (m, d) for m, ds in graph.items() for d in ds
        if m.startswith("api.pipeline") and d.startswith(PROTOCOLS)
    }  # fmt: skip
    assert not up, up


def test_the_server_imports_protocols_only_where_it_mounts_them() -> None:
    graph = import_graph()
    assert any(d.startswith(PROTOCOLS) for d in graph[MOUNT]), "the routes are mounted there"
    elsewhere = {
        (m, d) for m, ds in graph.items() for d in ds
        if m.startswith("api.server") and m != MOUNT and d.startswith(PROTOCOLS)
    }  # fmt: skip
    assert not elsewhere, elsewhere
