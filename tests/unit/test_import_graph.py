"""The import graph of src/: no circles in either wing (function-local imports count: they are how
the circles hid), and the wings' borders hold (flash_common imports only the standard library;
flash_cli reaches flash_vllm only for the patch registry behind `flash patches --expected`)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGES = ("flash_cli", "flash_vllm", "flash_common")
# flash_cli -> flash_vllm edges allowed: `flash patches --expected` prints the plugin's registry.
CLI_TO_PLUGIN = {("flash_cli.commands.patches", "flash_vllm.registry")}


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for f in (SRC / pkg).rglob("*.py"):
            parts = list(f.relative_to(SRC).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = f
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        here = mod if is_pkg else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    origin = ".".join(base + ([node.module] if node.module else []))
                else:
                    origin = node.module or ""
                targets = [f"{origin}.{a.name}" if f"{origin}.{a.name}" in mods else origin for a in node.names]
            for t in targets:
                while t and t not in mods and "." in t:
                    t = t.rpartition(".")[0]
                if t in mods and t != mod:
                    edges[mod].add(t)
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_no_import_circles():
    found = circles(graph())
    assert found == [], "import circles (break them: a leaf module, an injected dependency): " + "; ".join(
        " <-> ".join(c) for c in found)


def test_the_check_sees_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_graph_reads_function_local_and_relative_imports():
    g = graph()
    assert "flash_vllm.patches.p01_ple_mmap.guard" in g["flash_vllm.patches.p01_ple_mmap.v029"]  # inside a function
    assert "flash_vllm.ple.consts" in g["flash_vllm.ple.native_nb"]
    assert "flash_common.releases" in g["flash_cli.settings"]


def test_flash_common_stands_alone():
    g = graph()
    for mod, path in modules().items():
        if not mod.startswith("flash_common"):
            continue
        assert not {t for t in g[mod] if not t.startswith("flash_common")}, mod
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and not node.level else [])
            for name in names:
                top = name.split(".")[0]
                assert top in sys.stdlib_module_names or top == "flash_common", f"{mod} imports {name}"


def test_host_never_reaches_into_the_plugin():
    g = graph()
    crossing = {(m, t) for m, ts in g.items() if m.startswith("flash_cli") for t in ts if t.startswith("flash_vllm")}
    assert crossing <= CLI_TO_PLUGIN, sorted(crossing - CLI_TO_PLUGIN)
    plugin_to_host = {(m, t) for m, ts in g.items() if m.startswith("flash_vllm") for t in ts if t.startswith("flash_cli")}
    assert plugin_to_host == set()
