"""The package's import graph has no cycle, and imports run down the layers of the architecture.

The graph is read from the source with `ast` (nothing is imported): an edge a -> b for every
`import` / `from ... import` in module a, wherever it stands (a lazy import inside a function
is a dependency all the same, only a later one). `from pkg import name` points at `pkg.name`
when that is a module and at `pkg` otherwise. A cycle, or an import that climbs LAYERS (the
picture in docs/architecture.md, section 2), is reported with the import statements (file:line),
so the failure says what to move. A module LAYERS does not name is not checked for climbing.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import expresslane

Graph = dict[str, dict[str, str]]  # module -> {imported module: "file:line" of the import}


def modules(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under the package folder `root`."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _targets(name: str, is_package: bool, node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative: strip the module itself (unless a package), then level - 1 more
        parts = name.split(".")[: len(name.split(".")) - (0 if is_package else 1)]
        parts = parts[: len(parts) - (node.level - 1)]
        base = ".".join(parts + ([node.module] if node.module else []))
    return [f"{base}.{alias.name}" for alias in node.names]  # a name, or a module under base


def import_graph(root: Path, package: str) -> Graph:
    mods = modules(root, package)
    graph: Graph = {m: {} for m in mods}
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in _targets(name, path.name == "__init__.py", node):
                hit = _owner(target, mods)  # `from pkg import module`: the module, not pkg
                if hit and hit != name:
                    graph[name].setdefault(hit, f"{path.relative_to(root.parent)}:{node.lineno}")
    return graph


def _owner(target: str, mods: dict[str, Path]) -> str | None:
    """The module of ours that `target` (a module or a name inside one) belongs to."""
    while target and target not in mods:
        target = target.rpartition(".")[0]
    return target or None


def cycles(graph: Graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def describe(graph: Graph, comp: list[str]) -> str:
    edges = [f"{a} -> {b} ({graph[a][b]})" for a in comp for b in sorted(graph[a]) if b in comp]
    return "import cycle: " + "; ".join(edges)


# docs/architecture.md, section 2, top to bottom: a module may import its own layer and below.
LAYERS = [
    ("__main__", "cli"),
    ("evals", "bench.free_grammar"),
    ("serve",),
    ("bench",),
    ("parallel.launch",),
    ("assets",),
    ("train",),
    ("textgen",),
    ("parallel",),
    ("engine", "structured.decoding"),
    ("speculative.decoder", "speculative.draft_model"),
    ("step.choose", "step.captures"),
    ("step.graph", "step.split"),
    ("step.packed", "step.prefill", "step.pooling"),
    ("step.persistent", "step.persistent_plan", "step.persistent_tasks", "kernels.aot"),
    ("step.fused", "step.native"),
    ("step.protocol",),
    ("kernels", "kernels.prefill_norm"),
    ("checkpoint", "weights.packing", "weights.packed_modules", "weights.stored"),
    ("generation",),
    ("model",),
    ("prefix", "speculative.drafting", "speculative"),
    (
        "sampling.sampler",
        "cache",
        "rope",
        "presets",
        "weights.quant",
        "weights.gpu_pack",
        "weights.blocks",
        "step.threads",
        "step.heap",
        "step",
        "weights",
        "structured.grammar",
        "structured",
    ),
    ("tokenizer",),
    ("config", "sampling.params", "sampling.defaults"),
    ("hf_config",),
    ("errors",),
]


def layer_of(module: str, package: str = "expresslane") -> int | None:
    """Index in LAYERS of the longest name that `module` is, or lies inside; None if unnamed."""
    rest = module.removeprefix(package + ".")
    best = None
    for i, names in enumerate(LAYERS):
        for name in names:
            if (rest == name or rest.startswith(name + ".")) and (
                best is None or len(name) > best[1]
            ):
                best = (i, len(name))
    return None if best is None else best[0]


def climbing(graph: Graph) -> list[str]:
    """Imports from a lower layer to a higher one, as 'a -> b (file:line)'."""
    out = []
    for a, targets in graph.items():
        for b, where in targets.items():
            la, lb = layer_of(a), layer_of(b)
            if la is not None and lb is not None and lb < la:
                out.append(f"{a} (layer {la}) -> {b} (layer {lb}) ({where})")
    return out


@pytest.fixture(scope="module")
def graph() -> Graph:
    return import_graph(Path(expresslane.__file__).parent, "expresslane")


def test_package_has_no_import_cycle(graph):
    assert len(graph) > 50 and graph["expresslane.engine"], "the graph was not read"
    found = cycles(graph)
    assert not found, "\n".join(describe(graph, c) for c in found)


def test_imports_run_down_the_layers(graph):
    assert layer_of("expresslane.parallel.launch") == 4 and layer_of("expresslane.cli.run") == 0
    assert layer_of("expresslane.parallel.engine") == 8
    assert layer_of("expresslane.kernels.aot") == 14 and layer_of("expresslane.kernels.ref") == 17
    fake = {"expresslane.model": {"expresslane.engine": "m.py:1", "expresslane.config": "m.py:2"}}
    (only,) = climbing(fake)  # model -> config runs down; model -> engine climbs
    assert only == "expresslane.model (layer 20) -> expresslane.engine (layer 9) (m.py:1)"
    up = climbing(graph)
    assert not up, "imports that climb the layers of docs/architecture.md:\n" + "\n".join(up)


def test_detector_sees_lazy_and_relative_cycles(tmp_path):
    """The checker itself: a cycle closed by a lazy relative import inside a function is found;
    `from . import sub` in a package's own module is not a cycle through the package."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import f\n")
    (pkg / "a.py").write_text("from .b import g\n\ndef f():\n    return g()\n")
    (pkg / "b.py").write_text("def g():\n    from .a import f\n    return f\n")
    (pkg / "sub" / "__init__.py").write_text("from .x import h\n")
    (pkg / "sub" / "x.py").write_text("from . import y\nh = y\n")
    (pkg / "sub" / "y.py").write_text("import os\n")
    graph = import_graph(pkg, "pkg")
    assert cycles(graph) == [["pkg.a", "pkg.b"]]
    assert "pkg/b.py:2" in describe(graph, ["pkg.a", "pkg.b"])
    assert graph["pkg.sub.x"] == {"pkg.sub.y": "pkg/sub/x.py:1"}


WITHOUT_TRITON = """
import importlib.util, sys
find = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a: None if name.startswith("triton") else find(name, *a)

class NoTriton:  # a CPU install: triton is the `gpu` extra
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "triton":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, NoTriton())
from expresslane.__main__ import main
sys.exit(main(["run", "--prompt", "def f(", "--max-tokens", "2", "--device", "cpu"]))
"""


def test_a_cpu_install_without_triton_imports_and_runs():
    """triton is an optional extra: the engine, its step choice (which names the GPU steps)
    and `run` work without it; the kernel modules are imported only where they run."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", WITHOUT_TRITON], capture_output=True, text=True,
                         env=env, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]


def test_the_top_level_stays_small():
    """Issue 25's layout: at most 14 modules beside __init__ and __main__ at the package's top;
    the rest lives in the folders that show the architecture (step/, weights/, sampling/...)."""
    root = Path(expresslane.__file__).parent
    top = sorted(p.stem for p in root.glob("*.py") if p.stem not in ("__init__", "__main__"))
    assert len(top) <= 14, top
