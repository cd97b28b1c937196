"""The package's layers, checked on its source: no import cycles (function-level imports count), no private
names imported across top-level packages, no import that runs up the layers, and no Lightning in the feature
packages.

Layers (README, "Layout"): backbones, text, types, trainer -> kernels -> datamodules, metrics, envs, rewards,
quantization, eviction, pruning, sae -> rl, lm, lora, modules, callbacks -> evaluation -> cli. A module
may import from its own layer and below. Kernels' private Triton files are private to the kernels package.
Feature packages hold a method's non-Lightning building blocks; its Callbacks and LightningModules live in
``callbacks/`` and ``modules/`` (the placement rule of ``lightning_llm/__init__.py``).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "lightning_llm"
LAYERS = {
    **dict.fromkeys(["backbones", "text", "types", "trainer"], 0),
    "kernels": 1,
    **dict.fromkeys(
        ["datamodules", "metrics", "envs", "rewards", "quantization", "eviction", "pruning", "sae"], 2
    ),
    **dict.fromkeys(["rl", "lm", "lora", "modules", "callbacks"], 3),
    "evaluation": 4,
    **dict.fromkeys(["cli", "__main__"], 5),
}


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path) -> list[tuple[str, str | None]]:
    """``(imported module, imported name or None)`` for every ``lightning_llm`` import, lazy ones included."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            out += [(base, alias.name) for alias in node.names]
    return [(base, name) for base, name in out if base.split(".")[0] == "lightning_llm"]


def _top(module: str) -> str:
    return module.split(".")[1] if "." in module else ""


#: Packages of non-Lightning building blocks (placement rule): they import no ``lightning``.
FEATURES = ("lora", "sae", "quantization", "pruning", "eviction", "kernels")

EDGES: dict[str, set[str]] = defaultdict(set)
PRIVATE: list[str] = []
for _module, _path in MODULES.items():
    for _base, _name in _imports(_module, _path):
        _target = _resolve(f"{_base}.{_name}" if _name else _base)
        if _target is None:
            continue
        if _target != _module and not _module.startswith(_target + "."):
            EDGES[_module].add(_target)
        if _top(_target) != _top(_module):
            private_name = _name is not None and _name.startswith("_") and not _name.startswith("__")
            private_module = any(p.startswith("_") and not p.startswith("__") for p in _target.split(".")[1:])
            if private_name or private_module:
                PRIVATE.append(f"{_module} imports {_name or ''} from {_target}")


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), packages and their own modules aside."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in EDGES.get(v, ()):
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
            nested = all(
                any(o != x and (o.startswith(x + ".") or x.startswith(o + ".")) for o in component)
                for x in component
            )
            if len(component) > 1 and not nested:
                found.append(sorted(component))

    for v in list(MODULES):
        if v not in index:
            visit(v)
    return found


def test_every_top_level_package_has_a_layer():
    tops = {_top(m) for m in MODULES if "." in m}
    assert tops <= set(LAYERS), f"packages without a layer: {sorted(tops - set(LAYERS))}"


def test_no_import_cycles():
    assert _cycles() == []


def test_no_private_names_across_packages():
    assert PRIVATE == []


def _imports_lightning(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        if any(name.split(".")[0] in ("lightning", "pytorch_lightning") for name in names):
            return True
    return False


def test_feature_packages_import_no_lightning():
    """Callbacks and LightningModules of a method live in callbacks/ and modules/, not in its feature package."""
    lightning = [m for m, path in MODULES.items() if _top(m) in FEATURES and _imports_lightning(path)]
    assert lightning == []
    assert _imports_lightning(ROOT / "callbacks" / "expert_pruning.py")  # the check sees a Lightning import


def test_imports_only_run_down_the_layers():
    upward = [
        f"{a} imports {b}"
        for a, targets in EDGES.items()
        for b in targets
        if "." in a and "." in b and LAYERS[_top(b)] > LAYERS[_top(a)]
    ]
    assert upward == []


@pytest.mark.parametrize(
    ("module", "target"),
    [("lightning_llm.text", "lightning_llm.datamodules"), ("lightning_llm.types", "lightning_llm.envs")],
)
def test_the_check_would_see_a_violation(module, target):
    """The checks run on real edges: adding one upward edge is reported (guards against a vacuous test)."""
    assert LAYERS[_top(target)] > LAYERS[_top(module)]
    EDGES[module].add(target)
    try:
        with pytest.raises(AssertionError):
            test_imports_only_run_down_the_layers()
    finally:
        EDGES[module].discard(target)


def test_a_cycle_would_be_seen():
    a, b = "lightning_llm.rewards", "lightning_llm.metrics"
    added = [(x, y) for x, y in ((a, b), (b, a)) if y not in EDGES[x]]
    for x, y in added:
        EDGES[x].add(y)
    try:
        assert any(a in component and b in component for component in _cycles())
    finally:
        for x, y in added:
            EDGES[x].discard(y)
