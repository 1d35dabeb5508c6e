"""The package's layout in figures: rooms (modules), top-level modules, folders, import arrows
(every import of one nmt_cli module by another, annotations and lazy imports included), circles,
arrows that climb a floor (tests/unit/test_layers.py's floors), the largest modules.

    python benchmarks/layout.py [REV]     # REV: a git revision (default: the working tree)
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "unit"))


def sources(rev: str | None) -> dict[str, str]:
    """Each module of nmt_cli (dotted name) and its text, at `rev` or in the working tree."""

    def read(path: str) -> str:
        if rev is None:
            return (ROOT / path).read_text()
        shown = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True, text=True)
        return shown.stdout

    if rev is None:
        paths = [p.relative_to(ROOT).as_posix() for p in (ROOT / "nmt_cli").rglob("*.py")]
    else:
        listed = subprocess.run(
            ["git", "ls-tree", "-r", "--name-only", rev, "nmt_cli"], cwd=ROOT, capture_output=True, text=True
        )
        paths = [p for p in listed.stdout.split() if p.endswith(".py")]
    return {p[:-3].replace("/", ".").removesuffix(".__init__"): read(p) for p in paths}


def graph_of(texts: dict[str, str]) -> dict[str, set[str]]:
    graph = {}
    for name, text in texts.items():
        found = set()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("nmt_cli"):
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    found.add(sub if sub in texts else node.module)
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.startswith("nmt_cli")}
        graph[name] = found - {name, "nmt_cli"}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, done = [], set()

    def visit(m: str, stack: list[str]) -> None:
        if m in stack:
            found.append(stack[stack.index(m) :] + [m])
            return
        if m in done:
            return
        stack.append(m)
        for o in sorted(graph.get(m, ())):
            visit(o, stack)
        stack.pop()
        done.add(m)

    for m in sorted(graph):
        visit(m, [])
    return found


def main() -> None:
    from test_layers import _floor

    rev = sys.argv[1] if len(sys.argv) > 1 else None
    texts = sources(rev)
    graph = graph_of(texts)
    arrows = sum(len(v) for v in graph.values())
    up = [
        (m, o) for m, imported in graph.items() for o in imported if m != "nmt_cli" and _floor(o) > _floor(m)
    ]
    top = [m for m in texts if m.count(".") == 1 and m not in ("nmt_cli.__main__",)]
    folders = sorted({m.split(".")[1] for m in texts if m.count(".") >= 2})
    sizes = sorted(((t.count("\n"), m) for m, t in texts.items()), reverse=True)
    print(f"revision: {rev or 'working tree'}")
    print(f"rooms (modules): {len(texts)}; at the top: {len(top)}; folders: {len(folders)}", end=" ")
    print(f"({', '.join(folders)})")
    print(f"import arrows: {arrows}; circles: {len(circles(graph))}; arrows that climb a floor: {len(up)}")
    for m, o in up:
        print(f"  up: {m} -> {o}")
    for c in circles(graph):
        print("  circle: " + " -> ".join(c))
    print("over 400 lines: " + (", ".join(f"{m} {n}" for n, m in sizes if n > 400) or "none"))
    print("largest: " + ", ".join(f"{m} {n}" for n, m in sizes[:3]))


if __name__ == "__main__":
    main()
