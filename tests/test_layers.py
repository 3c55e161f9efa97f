"""Imports go one way (docs/ARCHITECTURE.md): every module's imports, read with ast.

    core            sans-I/O decisions: the standard library only (no torch, asyncio, sockets)
    boot            process start-up before torch (selfcmd, overlay): the standard library only
    model, wire     siblings above core: neither imports the other
    pipeline        above model and wire
    node            above pipeline
    cli             above everything in the engine
    app             above the engine; the engine never imports the app (nor testkit)
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RANK = {"boot": 0, "core": 0, "model": 1, "wire": 1, "pipeline": 2, "node": 3, "cli": 4, "__main__": 5}
# what a sans-I/O core may not touch, even lazily
CORE_FORBIDDEN = {"torch", "asyncio", "socket", "websockets", "aiohttp", "transformers", "numpy"}


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> list[tuple[str, int]]:
    """Absolute names of every module imported anywhere in the file (lazy imports too)."""
    tree = ast.parse(path.read_text(), str(path))
    me = module_name(path).split(".")
    package = me if path.name == "__init__.py" else me[:-1]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append((mod, node.lineno))
            # `from engine.wire import frames` imports the module engine.wire.frames
            out += [(f"{mod}.{a.name}", node.lineno) for a in node.names]
    return out


def engine_modules() -> list[Path]:
    return sorted((ROOT / "engine").rglob("*.py"))


def layer(mod: str) -> str | None:
    parts = mod.split(".")
    if parts[0] != "engine" or len(parts) < 2:
        return None
    return parts[1]


def known(mod: str) -> bool:
    """Whether mod names a module or package of ours (not a name inside one)."""
    rel = Path(*mod.split("."))
    return (ROOT / rel).with_suffix(".py").exists() or (ROOT / rel / "__init__.py").exists()


def test_engine_top_level_holds_only_the_cli_and_the_layers():
    top = {p.name for p in (ROOT / "engine").iterdir() if not p.name.startswith((".", "__pycache__"))}
    assert top == {"__init__.py", "__main__.py", "cli", "boot", "core", "model", "wire",
                   "pipeline", "node"}


@pytest.mark.parametrize("path", engine_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_go_down_only(path):
    me = layer(module_name(path))
    for mod, line in imports_of(path):
        top = mod.split(".")[0]
        where = f"{path.relative_to(ROOT)}:{line} imports {mod}"
        assert top not in ("app", "testkit", "tests", "bench"), f"{where}: the engine never imports {top}"
        if me in ("core", "boot"):
            assert top not in CORE_FORBIDDEN, f"{where}: {me} imports nothing heavy"
        other = layer(mod)
        if other is None or other == me or not known(mod):
            continue
        assert RANK[other] < RANK[me], f"{where}: {me} may not import {other} (up or sideways)"


def test_no_import_cycles():
    """Module-level imports between our modules form no cycle (lazy ones inside functions
    are allowed to point down only, which the test above checks)."""
    graph: dict[str, set[str]] = {}
    for path in engine_modules():
        me = module_name(path)
        tree = ast.parse(path.read_text())
        deps = set()
        for node in tree.body:   # module level only: what runs at import time
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            deps |= {n for n in names if n.startswith("engine.") and known(n) and n != me}
        graph[me] = deps
    seen, stack = set(), []

    def visit(m):
        if m in stack:
            raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(m):] + [m]))
        if m in seen:
            return
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            visit(d)
        stack.pop()
        seen.add(m)

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))
    try:
        for m in sorted(graph):
            visit(m)
    finally:
        sys.setrecursionlimit(limit)   # a raised limit would leak into later tests (JSON nesting depth)


def test_the_app_reaches_the_engine_only_through_the_launcher():
    """The GUI is a client of the node's API: it never imports torch or the engine, except
    app/launcher.py, which hands `potluck <command>` to the engine's CLI, and engine.boot
    (standard library only: how to start the engine, which torch it will import)."""
    for path in sorted((ROOT / "app").rglob("*.py")):
        for mod, line in imports_of(path):
            top = mod.split(".")[0]
            if path.name == "launcher.py" and mod.startswith("engine.cli"):
                continue
            if mod == "engine.boot" or mod.startswith("engine.boot."):
                continue
            assert top not in ("engine", "torch", "transformers"), f"{path.relative_to(ROOT)}:{line} imports {mod}"


def test_the_layer_check_catches_an_upward_import(tmp_path, monkeypatch):
    """The check itself: a core module importing the pipeline is refused."""
    fake = ROOT / "engine" / "core" / "_layer_probe.py"
    assert not fake.exists()
    try:
        fake.write_text("from engine.pipeline.head import Head\n")
        with pytest.raises(AssertionError, match="core may not import pipeline"):
            test_imports_go_down_only(fake)
    finally:
        fake.unlink()


MAX_LINES = 800   # a module past this holds more than one thing: split it by what it holds


@pytest.mark.parametrize("path", sorted([*(ROOT / "engine").rglob("*.py"), *(ROOT / "app").rglob("*.py")]),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_every_module_is_a_room_a_newcomer_can_read(path):
    """No module of the engine or the app over MAX_LINES, and each says what it holds."""
    text = path.read_text(encoding="utf-8")
    lines = text.count("\n")
    assert lines <= MAX_LINES, f"{path.relative_to(ROOT)} has {lines} lines: split it by what it holds"
    if text.strip():
        assert ast.get_docstring(ast.parse(text)), f"{path.relative_to(ROOT)} has no docstring saying what it holds"
