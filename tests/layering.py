"""The package's layering, read from its imports (ast): what tests/test_layers.py holds the repository to.

Layers, each importing only those below it: models < decode < heads < trainer < scripts, benchmarks. Besides:
no import circle between files, no import of a headstart module inside a function (the way circles are usually
hidden), no private name imported from another file, and no head named (as a string) in the shared layers.
"""

from __future__ import annotations

import ast
from pathlib import Path

LAYERS = {"models": 1, "decode": 2, "heads": 3, "trainer": 4, "scripts": 5, "benchmarks": 5}
SHARED = ("models", "decode", "trainer")  # where no head may be named
HEAD_NAMES = ("eagle3", "eagle31", "eagle3.1", "medusa", "mtp", "hydra", "dflash", "peagle", "p-eagle", "p_eagle",
              "early-exit", "early_exit")
"""The heads this field trains (and headstart's catalog names): a string equal to one of them, in the shared layers,
is a branch on a head's name or a default that belongs in the head's folder."""


def module_of(root: Path, path: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(("headstart",) + (parts[:-1] if parts[-1] == "__init__" else parts))


def imported(path: Path, root: Path, node: ast.Import | ast.ImportFrom) -> list[tuple[str, str | None]]:
    """(module, name) pairs the statement imports, relative imports resolved; name None for ``import x``."""
    if isinstance(node, ast.Import):
        return [(a.name, None) for a in node.names]
    base = module_of(root, path).split(".")
    if node.level:
        keep = len(base) - node.level + (1 if path.name == "__init__.py" else 0)
        module = ".".join(base[:keep] + ([node.module] if node.module else []))
    else:
        module = node.module or ""
    return [(module, a.name) for a in node.names]


def files(root: Path) -> list[Path]:
    return sorted(p for top in LAYERS if (root / top).is_dir() for p in (root / top).rglob("*.py"))


def problems(root: Path) -> list[str]:
    """Every layering problem under ``root`` (the repository), one line each naming file and line."""
    found: list[str] = []
    modules = {module_of(root, p): p for p in files(root)}
    edges: dict[Path, set[Path]] = {}
    for path in modules.values():
        tree = ast.parse(path.read_text(), str(path))
        rel, top = path.relative_to(root), path.relative_to(root).parts[0]
        in_function = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                       for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for module, name in imported(path, root, node):
                if not module.startswith("headstart"):
                    continue
                layer = module.split(".")[1] if "." in module else None
                if layer in LAYERS and LAYERS[layer] > LAYERS[top]:
                    found.append(f"{rel}:{node.lineno}: {top}/ imports {module} ({layer}/ is above it)")
                if id(node) in in_function:
                    found.append(f"{rel}:{node.lineno}: imports {module} inside a function")
                if name and name.startswith("_") and not name.startswith("__"):
                    found.append(f"{rel}:{node.lineno}: imports the private name {name} from {module}")
                for candidate in (module, f"{module}.{name}" if name else None):
                    if candidate in modules and modules[candidate] != path:
                        edges.setdefault(path, set()).add(modules[candidate])
        if top in SHARED:
            for node in ast.walk(tree):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.lower() in HEAD_NAMES:
                    found.append(f"{rel}:{node.lineno}: names the head {node.value!r} (it belongs in heads/)")
    found += [f"import circle: {' -> '.join(str(p.relative_to(root)) for p in c)}" for c in circles(edges)]
    return found


def circles(edges: dict[Path, set[Path]]) -> list[list[Path]]:
    """The strongly connected components of more than one file (Tarjan's algorithm, iteratively)."""
    index: dict[Path, int] = {}
    low: dict[Path, int] = {}
    stack: list[Path] = []
    on_stack: set[Path] = set()
    out: list[list[Path]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def line_counts(root: Path) -> dict[str, int]:
    """Lines of Python per top-level package (the note's before/after table)."""
    return {top: sum(len(p.read_text().splitlines()) for p in (root / top).rglob("*.py"))
            for top in LAYERS if (root / top).is_dir()}


if __name__ == "__main__":
    import sys

    repo = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[1])
    for line in problems(repo):
        print(line)
    print(line_counts(repo))
