"""The walls of docs/ARCHITECTURE.md, read from the import statements themselves.

Every import counts, wherever it is written (module top, inside a function, under TYPE_CHECKING):
a lazy import is still a dependency, and a cycle through one is still a cycle.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from functools import cache
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ds4desk"
QT = ("PySide6", "qasync", "pyqtgraph", "ds4desk.ui", "ds4desk.app")
TORCH = (
    "torch",
    "ds4desk.engine.runtime",
    "ds4desk.engine.models",
    "ds4desk.engine.sampling",
    "ds4desk.engine.devices",
    "ds4desk.engine.loading",
)


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            # `from ds4desk.engine import engine` imports the module ds4desk.engine.engine.
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def offenders(folder: Path, banned: tuple[str, ...]) -> list[str]:
    found = []
    for path in sorted(folder.rglob("*.py")):
        for name in imported_modules(path):
            if any(name == b or name.startswith(b + ".") for b in banned):
                found.append(f"{path.relative_to(PACKAGE)} imports {name}")
    return found


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def import_graph() -> dict[str, frozenset[str]]:
    """Every ds4desk module -> the ds4desk modules it imports (a package counts as its __init__)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        targets = {n for n in imported_modules(path) if n in modules}
        graph[name] = frozenset(targets - {name})
    return graph


def outside_imports(prefix: str) -> set[str]:
    """The ds4desk modules outside `prefix` (a package) that its modules import."""
    inside = (prefix, prefix + ".")
    return {
        target
        for name, targets in import_graph().items()
        if name.startswith(inside) or name == prefix
        for target in targets
        if not (target == prefix or target.startswith(prefix + "."))
    }


def cycles(graph: dict[str, frozenset[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_graph_sees_the_imports_it_must() -> None:
    """The walls below are only as good as the graph: it must see top-level, lazy and
    TYPE_CHECKING imports, and `from package import module`."""
    graph = import_graph()
    assert "ds4desk.engine.engine" in graph["ds4desk.engine"]  # top level, from a package
    assert "ds4desk.engine.loader" in graph["ds4desk.engine.engine"]  # inside a method
    assert "ds4desk.engine.loading.source" in graph["ds4desk.engine.tokenizer"]  # under TYPE_CHECKING
    assert "ds4desk.app" in graph["ds4desk.cli"]  # the lazy way into the window
    assert cycles({"a": frozenset({"b"}), "b": frozenset({"c"}), "c": frozenset({"a"})}) == [["a", "b", "c"]]


def test_no_import_cycles_between_ds4desk_modules() -> None:
    assert cycles(import_graph()) == []


def test_engine_never_imports_qt() -> None:
    assert offenders(PACKAGE / "engine", QT) == []


def test_ui_never_imports_torch() -> None:
    assert offenders(PACKAGE / "ui", TORCH) == []


def test_only_the_app_opens_the_window() -> None:
    """The window's parts (model loader, park row, docks) are handed what they need; none reaches
    back into main_window."""
    importers = {name for name, targets in import_graph().items() if "ds4desk.ui.main_window" in targets}
    assert importers == {"ds4desk.app"}


def test_app_core_never_imports_qt() -> None:
    core = [p for p in PACKAGE.glob("*.py") if p.name != "app.py"]
    found = [
        f"{p.name} imports {n}"
        for p in core
        for n in imported_modules(p)
        if any(n == b or n.startswith(b + ".") for b in ("PySide6", "qasync", "ds4desk.ui"))
    ]
    # cli.py opens the window through a lazy `from ds4desk.app import run_app`, which is allowed.
    assert found == []


def test_kernels_know_no_model_and_no_checkpoint() -> None:
    """A kernel is a Triton function and its reference: it sees the weight formats' tables, never a
    model family, the loader or a checkpoint reader."""
    assert outside_imports("ds4desk.engine.kernels") <= {"ds4desk.engine.formats", "ds4desk.engine.api"}


def test_loading_reads_checkpoints_and_knows_nothing_above() -> None:
    """Checkpoint readers are the bottom of the engine: they name architectures through the
    registry, never a loader, a model family, the tokenizer or the engine thread."""
    assert outside_imports("ds4desk.engine.loading") <= {
        "ds4desk.engine.api",
        "ds4desk.engine.formats",
        "ds4desk.engine.models.registry",
    }


def test_models_never_reach_the_load_sequence_or_the_engine() -> None:
    above = {
        "ds4desk.engine.loader",
        "ds4desk.engine.preflight",
        "ds4desk.engine.engine",
        "ds4desk.engine.client",
        "ds4desk.engine.runtime",
        "ds4desk.engine.graphs",
        "ds4desk.engine.tokenizer",
        "ds4desk.engine.snapshots",
    }
    reached = outside_imports("ds4desk.engine.models")
    assert not reached & above
    assert not any(name.startswith("ds4desk.engine.loading") for name in reached)


def test_the_tokenizer_reads_no_checkpoint_layout() -> None:
    """The chat format follows the detected architecture; the tokenizer never learns how a
    checkpoint names or stores its tensors."""
    layout = {name for name in import_graph() if name.startswith("ds4desk.engine.loading.")}
    layout -= {"ds4desk.engine.loading.detect", "ds4desk.engine.loading.source"}
    assert not import_graph()["ds4desk.engine.tokenizer"] & layout


def torch_loaded_after(*modules: str) -> bool:
    code = f"import sys, {', '.join(modules)}; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={"QT_QPA_PLATFORM": "offscreen", "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip() == "True"


def test_public_faces_load_without_torch() -> None:
    """Importing the engine's public face and the UI must not drag torch in (the window shows first)."""
    assert not torch_loaded_after("ds4desk.engine", "ds4desk.ui.main_window", "ds4desk.app")


def test_what_the_window_and_check_ask_first_loads_without_torch() -> None:
    """The registry, the format tables, the split plan's data and checkpoint detection answer cheap
    questions (what is this path, which family runs it) before anything needs torch."""
    assert not torch_loaded_after(
        "ds4desk.engine.models.registry",
        "ds4desk.engine.formats",
        "ds4desk.engine.split",
        "ds4desk.engine.loading.detect",
        "ds4desk.cli",
        "ds4desk.session",
    )
    assert torch_loaded_after("ds4desk.engine.loader")  # the check above would notice torch
