"""The package's layout: no import circles, and no layer reaching up into a higher one.

Read from the source with `ast` (nothing is imported), counting every import: module-level,
inside functions and under `TYPE_CHECKING` alike — a circle that only closes at run time is
still a circle a reader has to untangle.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "infemeral"

# Lowest first. A module may import its own layer and the ones below, never one above. Each layer is a
# set of top-level folders or modules: no package straddles two layers.
LAYERS = [
    ("foundation", ("infemeral.errors", "infemeral.files", "infemeral.logs", "infemeral.paths",
                    "infemeral.protocol", "infemeral.transport", "infemeral.settings_flags", "infemeral.devices",
                    "infemeral.threads")),
    ("storage, cache, model, weights, cloak", ("infemeral.storage", "infemeral.kvcache", "infemeral.layers",
                                               "infemeral.quant", "infemeral.cloak")),
    ("the laptop's half of the model", ("infemeral.client_half",)),
    ("server, speculation, evaluations", ("infemeral.server", "infemeral.speculation", "infemeral.eval")),
    ("SDK, audit", ("infemeral.client", "infemeral.audit")),
    ("OpenAI endpoint", ("infemeral.endpoint",)),
    ("command line", ("infemeral.cli",)),
]
FACADE = "infemeral"  # the package itself: `__version__`, and the public API loaded lazily from above


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The infemeral modules `name` imports, anywhere in its source."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()

    def resolve(dotted: str) -> str | None:
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import mod` imports the module pkg.mod; `from mod import name`, the module mod
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            if target.startswith("infemeral"):
                module = resolve(target)
                if module is not None and module != name:
                    found.add(module)
    return found


def import_graph() -> dict[str, set[str]]:
    found = modules()
    known = set(found)
    return {name: imports(name, path, known) for name, path in found.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each as a list of names."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def layer(module: str) -> int | None:
    best, rank = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, rank = len(prefix), i
    return rank


def test_the_import_graph_is_read_whole():
    graph = import_graph()
    assert {"infemeral.client.turn", "infemeral.server.service", "infemeral.storage.base"} <= set(graph)
    assert "infemeral.server.engine" in graph["infemeral.server.service"]


def test_no_import_circles():
    found = cycles(import_graph())
    assert not found, "import circles (each line: modules that import each other, directly or around a loop):\n" + \
        "\n".join("  " + " <-> ".join(c) for c in found)


def test_the_cycle_check_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_layer_imports_a_higher_one():
    graph = import_graph()
    upward = []
    for module, targets in graph.items():
        if module == FACADE:
            continue
        rank = layer(module)
        assert rank is not None, f"{module} belongs to no layer: add its folder to LAYERS in {Path(__file__).name}"
        for target in sorted(targets):
            target_rank = 0 if target == FACADE else layer(target)
            if target_rank is not None and target_rank > rank:
                upward.append(f"{module} ({LAYERS[rank][0]}) imports {target} ({LAYERS[target_rank][0]})")
    assert not upward, "imports that reach up a layer:\n" + "\n".join("  " + u for u in upward)


def test_the_storage_interface_knows_no_backend():
    graph = import_graph()
    assert not {t for t in graph["infemeral.storage.base"] if t.startswith("infemeral.storage.")}
