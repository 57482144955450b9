"""The Python package's structure (docs/ARCHITECTURE.md, "Package map"): its modules
import one another without circles, and the algorithms (quantizers, pruning,
calibration) stand on a floor below the layouts and the modules, returning codes."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "torch_marlin"
ALGORITHMS = ("torch_marlin.quantize", "torch_marlin.sparsity", "torch_marlin.gptq", "torch_marlin.sparsegpt",
              "torch_marlin.calibration")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules():
    """{module name: path} of the package's Python files."""
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(name: str, path: Path, known) -> set:
    """The package's modules that `name` imports anywhere in its file (function bodies too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            # `from package import module` imports the module; `from module import name`, the module.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in known and t not in (name, "torch_marlin"))
    return found


def _graph():
    """{module: the package's modules it imports}. torch_marlin/__init__.py, which imports
    everything to hand the public names on, is left out (every module imports the package)."""
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()
            if name != "torch_marlin" and ".mslsim" not in name}  # the emulator: a package of its own


def test_no_import_circles():
    graph = _graph()
    state = {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                circle = stack[stack.index(nxt):] + [nxt]
                raise AssertionError("import circle: " + " -> ".join(circle))
            if nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def test_algorithms_import_no_layout_or_module():
    """quantize, sparsity, gptq, sparsegpt and calibration return codes, scales and zeros;
    the layouts pack them (they find a layout through torch_marlin.layout_registry)."""
    graph = _graph()
    for name in ALGORITHMS:
        above = sorted(m for m in graph[name] if m.startswith("torch_marlin.layouts") or m in (
            "torch_marlin.linear", "torch_marlin.moe", "torch_marlin.model") or m.startswith("torch_marlin.hf"))
        assert not above, f"{name} imports {above}"
