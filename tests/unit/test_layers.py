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


def _imports() -> dict[str, set[str]]:
    """Each module's imports of other nmt_cli modules, at any depth of its code that runs."""
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        name = name.removesuffix(".__init__")
        found = set()
        for node in _runtime_nodes(ast.parse(path.read_text())):
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
    graph = _imports()
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


def test_the_hugging_face_wing_keeps_to_its_docstring():
    """hf/ imports the ground, the configs and the engine's checkpoint rules; only the commands
    (cli/) import it."""
    graph = _imports()
    ground = {"nmt_cli.errors", "nmt_cli.files", "nmt_cli.models", "nmt_cli.vocab", "nmt_cli.export"}
    ground |= {"nmt_cli.normalize", "nmt_cli.textio"}
    for module, imported in graph.items():
        if module.startswith("nmt_cli.hf"):
            assert all(
                m.startswith(("nmt_cli.hf", "nmt_cli.config")) or m in ground | {"nmt_cli.engine.checkpoint"}
                for m in imported
            ), (module, imported)
        elif any(m.startswith("nmt_cli.hf") for m in imported):
            assert module.startswith("nmt_cli.cli"), module


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
    translator = _loaded_by("nmt_cli.translator")
    assert not translator & {
        "nmt_cli.engine.trainer",
        "nmt_cli.prep",
        "nmt_cli.fetch",
        "nmt_cli.engine.distributed",
    }
