"""The package's modules import each other without a cycle (each file one idea, layered)."""
import ast
from pathlib import Path

import loopscale

SRC = Path(loopscale.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, name: str, modules: set[str]) -> set[str]:
    """loopscale modules that `path` imports anywhere (top level or inside functions)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "loopscale"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] != "loopscale":
                continue
            for a in node.names:  # `from . import data` imports the module loopscale.data
                found.add(f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod)
    return found


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in SRC.rglob("*.py")}
    # edges into a package's __init__ (`from . import __version__`) are left out: every module
    # of a package runs its __init__ first anyway, and no cycle can run through it
    packages = {n for n, p in files.items() if p.name == "__init__.py"}
    return {name: {m for m in imports(path, name, set(files)) if m in files and m != name and m not in packages}
            for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(n):
        state[n] = "open"
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == "open":
                return stack[stack.index(m):] + [m]
            if m not in state and (c := visit(m)):
                return c
        stack.pop()
        state[n] = "done"
        return None
    for n in sorted(graph):
        if n not in state and (c := visit(n)):
            return c
    return None


def test_the_import_graph_is_acyclic():
    graph = import_graph()
    assert {"loopscale.train", "loopscale.diagnostics", "loopscale.halting"} <= graph.keys()
    assert "loopscale.evaluate" in graph["loopscale.halting"]  # edges are found
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def imports_of_every_module() -> dict[str, set[str]]:
    """{module: every loopscale module it imports anywhere}, package __init__s included (unlike
    import_graph, whose cycle check leaves the edges into packages out)."""
    files = {module_name(p): p for p in SRC.rglob("*.py")}
    return {name: imports(path, name, set(files)) for name, path in files.items()}


def in_cli(module: str) -> bool:
    return module == "loopscale.cli" or module.startswith("loopscale.cli.")


def test_no_module_outside_the_command_line_imports_it():
    edges = imports_of_every_module()
    assert "loopscale.cli" in edges and "loopscale.cli.run" in edges
    assert any(in_cli(m) for m in edges["loopscale.cli.eval"])  # edges into loopscale.cli are found
    offenders = sorted(f"{name} imports {m}" for name, found in edges.items()
                       if not in_cli(name) for m in found if in_cli(m))
    assert not offenders, "the command line is the top layer: " + "; ".join(offenders)
