"""The house's layers: every import of remax_megatron (module-level, function-level and TYPE_CHECKING
ones alike, parsed with ast, and the module names a dict holds as strings: lazy exports, the engine
registry's "module:Class") points down or sideways, never up, and no two packages import each
other, directly or round a circle. A new top-level module or package must be given a layer here.

Units are the subpackages (remax_megatron/models/, ...) and the top-level modules (config.py, ...);
an import inside one unit is not counted.
"""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent / "remax_megatron"
# a string that names a module: "remax_megatron.models.hf_config", "remax_megatron.rollout.native:NativeEngine"
MODULE_STRING = re.compile(r"(remax_megatron(?:\.\w+)+)(?::\w+)?")

# Bottom to top: a unit imports units of its own layer or below.
LAYERS = [
    # foundation: the config tree, integer size rules, process groups, console, lazy exports, start-up clock
    {"lazy", "sizes", "parallel", "config", "console", "startup_times"},
    # tensors in, tensors out: loss terms, fused kernels, FLOP counts, run-health and host-memory helpers
    {"algo", "kernels", "flops", "health", "memory"},
    # models: HF config -> megatron, families, builders; their weights (mapping, load, export)
    {"models", "weights"},
    # the components of a step and of a run (agent: tools and the sandbox that multi-turn rollouts call)
    {
        "builtin",
        "batching",
        "rollout",
        "agent",
        "reward",
        "data",
        "checkpoint",
        "optimizer",
        "metrics",
        "resume",
        "run_lock",
    },
    # top: the trainer and its parts, start-up, the entry points (train, launch, plan) and process control
    {
        "trainer",
        "update",
        "step_metrics",
        "evaluation",
        "run_control",
        "startup",
        "train",
        "launch",
        "plan",
        "processes",
    },
]
LAYER = {unit: k for k, units in enumerate(LAYERS) for unit in units}


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _targets(path: pathlib.Path, module: str) -> list[tuple[str, int]]:
    """(imported remax_megatron module, line) of every import statement in the file, wherever it is."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source == "remax_megatron":  # from remax_megatron import sizes
                out += [(f"{source}.{a.name}", node.lineno) for a in node.names]
            else:
                out.append((source, node.lineno))
        elif isinstance(node, ast.Dict):  # {name: "remax_megatron.x.y"}: imported by name later
            out += [
                (MODULE_STRING.fullmatch(v.value).group(1), v.lineno)
                for v in node.values
                if isinstance(v, ast.Constant) and isinstance(v.value, str) and MODULE_STRING.fullmatch(v.value)
            ]
    return [(t, line) for t, line in out if t.startswith("remax_megatron.")]


def _unit(module: str) -> str:
    return module.split(".")[1]


def import_graph() -> dict[tuple[str, str], list[str]]:
    """{(from unit, to unit): ["path:line imports module", ...]} between different units."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        module = _module_name(path)
        if module == "remax_megatron":
            continue
        for target, line in _targets(path, module):
            a, b = _unit(module), _unit(target)
            if a != b:
                edges.setdefault((a, b), []).append(f"{path.relative_to(ROOT.parent)}:{line} imports {target}")
    return edges


def _cycles(edges) -> list[list[str]]:
    """The strongly connected components of more than one unit (Tarjan)."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_every_unit_has_a_layer():
    units = {
        p.stem if p.is_file() else p.name
        for p in ROOT.iterdir()
        if (p.suffix == ".py" and p.name != "__init__.py") or (p / "__init__.py").is_file()
    }
    missing = sorted(units - set(LAYER))
    assert not missing, f"give these a layer in tests/test_imports.py LAYERS: {missing}"


def test_no_import_points_up():
    up = [
        f"{a} (layer {LAYER[a]}) -> {b} (layer {LAYER[b]}): {where}"
        for (a, b), sites in sorted(import_graph().items())
        if LAYER.get(b, -1) > LAYER.get(a, -1)
        for where in sites
    ]
    print("\n".join(up))
    assert not up, f"{len(up)} upward import(s):\n" + "\n".join(up)


def test_no_cycle_between_packages():
    edges = import_graph()
    cycles = _cycles(edges)
    lines = []
    for component in cycles:
        lines.append(
            " <-> ".join(component)
            + ": "
            + "; ".join(
                site for (a, b), sites in sorted(edges.items()) if a in component and b in component for site in sites
            )
        )
    print("\n".join(lines))
    assert not cycles, f"{len(cycles)} import cycle(s) between packages:\n" + "\n".join(lines)
