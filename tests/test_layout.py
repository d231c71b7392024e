"""The floors of the code (README, Layout): every import points to a lower floor, or stays in its package.

Read from the source with `ast` (function-level imports included), so a violation fails here before
it can work by accident of import order."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# package (or module) -> floor; an import must go to a strictly lower floor unless it stays inside
# the same entry. The longest matching prefix decides.
FLOORS = {
    "vlora_kernels": 0, "zoo": 0, "world": 0, "heads": 0, "serve.lazy": 0,
    "adapters": 1, "serve.forward": 1,
    "serve.models": 2, "serve.lora": 2, "serve.orchestrator": 2,
    "serve.engine": 3, "train": 3, "fusion": 3,
    "serve.rpc": 4, "serve.sim": 4,
    "serve.distributed": 5, "serve.http": 5, "apps.common": 5,
    "apps.video_analytics": 6, "apps.visual_retrieval": 6,
    "bench": 7,
    "vlora": 8,
}
TOP = {name.split(".")[0] for name in FLOORS}


def _entry(module: str) -> str | None:
    best = None
    for name in FLOORS:
        if (module == name or module.startswith(name + ".")) and (best is None or len(name) > len(best)):
            best = name
    return best


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] not in TOP:
            continue
        name = ".".join(rel.with_suffix("").parts)
        out[name[: -len(".__init__")] if name.endswith(".__init__") else name] = path
    return out


def _imports(module: str, path: Path) -> set[str]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
    return {name for name in found if name.split(".")[0] in TOP}


def _violations() -> list[str]:
    bad = []
    for module, path in sorted(_modules().items()):
        here = _entry(module)
        if here is None:
            continue
        for target in sorted(_imports(module, path)):
            there = _entry(target)
            if there is None or there == here:
                continue
            if FLOORS[there] >= FLOORS[here]:
                bad.append(f"{module} (floor {FLOORS[here]}) imports {target} (floor {FLOORS[there]})")
            if here.startswith("apps.") and there.startswith("serve.") and there != "serve.rpc":
                bad.append(f"{module}: applications reach the server only through serve.rpc, not {target}")
    return bad


def test_every_import_points_down():
    assert _violations() == []


def test_every_package_has_a_floor():
    unplaced = sorted({m.rsplit(".", 1)[0] if "." in m else m for m in _modules() if _entry(m) is None})
    # the package faces of serve and apps themselves sit above nothing they import eagerly
    assert set(unplaced) <= {"serve", "apps"}, unplaced


def test_benchmarks_live_in_bench_only():
    # (vlora/commands/bench.py is the `vlora bench` command, which runs them)
    strays = sorted(str(p.relative_to(ROOT)) for p in ROOT.rglob("*bench*.py")
                    if p.relative_to(ROOT).parts[0] in TOP - {"bench", "vlora"})
    assert strays == []
