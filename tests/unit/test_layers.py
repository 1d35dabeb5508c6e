"""The package's layers import one way: configs at the bottom, the engine above them, the
commands on top."""

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "nmt_cli"


def _runtime_nodes(tree: ast.AST):
    """Every node of `tree` but those under `if TYPE_CHECKING:` (imports for annotations only,
    which never run)."""
    yield tree
    for child in ast.iter_child_nodes(tree):
        if not (isinstance(child, ast.If) and getattr(child.test, "id", None) == "TYPE_CHECKING"):
            yield from _runtime_nodes(child)


def _imports(annotations: bool = False) -> dict[str, set[str]]:
    """Each module's imports of other nmt_cli modules, at any depth of its code that runs (and,
    with `annotations`, under `if TYPE_CHECKING:` too)."""
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        name = name.removesuffix(".__init__")
        found = set()
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree) if annotations else _runtime_nodes(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("nmt_cli"):
                for alias in node.names:  # `from nmt_cli import ui` names a module
                    sub = f"{node.module}.{alias.name}"
                    found.add(
                        sub if (PACKAGE.parent / (sub.replace(".", "/") + ".py")).exists() else node.module
                    )
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.startswith("nmt_cli")}
        graph[name] = found - {name, "nmt_cli"}
    return graph


def test_no_module_imports_in_a_circle():
    """Not even for an annotation: a circle that only the type checker walks still ties two
    rooms together. (The package's root is left out: every import of a module imports it.)"""
    graph = _imports(annotations=True)
    done, active = set(), []

    def visit(module):
        if module in active:
            raise AssertionError("import circle: " + " -> ".join(active[active.index(module) :] + [module]))
        if module in done:
            return
        active.append(module)
        for other in graph.get(module, ()):
            visit(other)
        active.pop()
        done.add(module)

    for module in graph:
        visit(module)


def test_lower_layers_do_not_import_upward():
    graph = _imports()
    for module, imported in graph.items():
        if module.startswith("nmt_cli.config"):
            assert all(m.startswith("nmt_cli.config") or m == "nmt_cli.errors" for m in imported), module
    assert graph["nmt_cli.vocab"] <= {"nmt_cli.errors", "nmt_cli.files"}
    assert graph["nmt_cli.files"] == {"nmt_cli.errors"}
    for module, imported in graph.items():
        if module.startswith("nmt_cli.engine"):
            assert all(
                m.startswith(("nmt_cli.engine", "nmt_cli.config"))
                or m in {"nmt_cli.errors", "nmt_cli.files", "nmt_cli.shards", "nmt_cli.vocab"}
                for m in imported
            ), (module, imported)


def _commands() -> set[str]:
    """The modules at the top named after a command of `nmt` (the steps)."""
    import typer

    from nmt_cli.cli import app

    names = {name.replace("-", "_") for name in typer.main.get_command(app).commands}  # type: ignore[attr-defined]
    return {p.stem for p in PACKAGE.glob("*.py")} & names


COMMANDS = _commands()


def _floor(module: str) -> int:
    """The house's floors, bottom up: the ground (flat modules and the configs), the engine, the
    wings (data/, inference/), hf/ (over inference's models and packages), the server, the
    commands (one flat module each), the face (the CLI, the package's Python API)."""
    parts = module.split(".")
    if module in ("nmt_cli", "nmt_cli.__main__") or parts[1] == "cli":
        return 6
    if parts[1] in COMMANDS:
        return 5
    wings = {"engine": 1, "data": 2, "inference": 2, "hf": 3, "serve": 4}
    return wings.get(parts[1], 0)


def test_the_house_imports_down_its_floors():
    """Each module imports its own floor or the floors below; the ground is flat modules (no
    folder but config/), every wing's folder says what it may import, and data/ and inference/,
    side by side, import neither each other nor hf/."""
    graph = _imports()
    for module, imported in graph.items():
        for other in imported:
            assert _floor(other) <= _floor(module), f"{module} imports {other}, a floor above it"
            wings = {(module + ".").split(".")[1], other.split(".")[1]}
            assert wings != {"data", "inference"}, f"{module} imports {other}"
        if _floor(module) == 0:
            assert module.count(".") == 1 or module.startswith("nmt_cli.config"), module
    for wing in ("data", "inference", "hf", "serve", "engine"):
        doc = ast.get_docstring(ast.parse((PACKAGE / wing / "__init__.py").read_text()))
        assert doc, wing
    # the file list at the top is the command list and the ground; a module there that serves
    # one room alone is that room's library, which belongs in its wing
    top = {f"nmt_cli.{p.stem}" for p in PACKAGE.glob("*.py")} - {"nmt_cli.__init__", "nmt_cli.__main__"}
    assert len(COMMANDS) >= 9, COMMANDS  # prep, bpe, train, average, plot, translate, score, ...
    for module in top:
        if _floor(module) == 0:
            users = {m for m, imported in graph.items() if module in imported}
            assert len({m.split(".")[1] for m in users}) >= 2, (module, users)


def _loaded_by(module: str) -> set[str]:
    code = f"import sys, {module}; print(' '.join(sys.modules))"
    return set(
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout.split()
    )


def test_the_engine_and_translate_load_only_what_they_need():
    trainer = _loaded_by("nmt_cli.engine.trainer")
    assert not trainer & {
        "rich",
        "sacrebleu",
        "sentencepiece",
        "sacremoses",
        "nmt_cli.bpe",
        "nmt_cli.metrics",
        "nmt_cli.prep",
        "nmt_cli.ui",
    }
    translator = _loaded_by("nmt_cli.inference.translator")
    assert not translator & {
        "nmt_cli.engine.trainer",
        "nmt_cli.prep",
        "nmt_cli.data.fetch",
        "nmt_cli.engine.distributed",
    }
