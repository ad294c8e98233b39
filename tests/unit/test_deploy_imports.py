"""The product packages' modules import one another without a circle, lazy imports included.

The graph is read from the source with :mod:`ast`, not from ``sys.modules``:
an import inside a function (run only when called) counts as an edge too, so a
circle that today works only because one side imports late is still caught.

Left out, because they are no edge of the module's own import:

* ``if TYPE_CHECKING:`` blocks (never run);
* ``if __name__ == "__main__":`` blocks: they run only in ``python -m pkg.mod``,
  where the file is the module ``__main__``, which nothing imports (e.g.
  deploy/render.py's block runs its ``main``).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("contract", "telemetry", "grammar_backend", "grammar_service", "triton_support", "pipeline", "llm_runtime",
            "client", "openai_api", "deploy")

#: The layers' upward edges, forbidden: a package and the project packages it must not import.
#: ``contract`` and ``telemetry`` are the floor; the grammar core computes and the service serves it;
#: the decode loop and the Triton glue sit side by side above the service, neither knowing the other.
FORBIDDEN_EDGES: dict[str, frozenset[str]] = {
    "contract": frozenset(PACKAGES) - {"contract"},
    "telemetry": frozenset(PACKAGES) - {"telemetry"},
    "client": frozenset(PACKAGES) - {"client", "contract"},
    "grammar_backend": frozenset(PACKAGES) - {"grammar_backend", "contract"},
    "grammar_service": frozenset({"triton_support", "pipeline", "llm_runtime", "client", "openai_api", "deploy"}),
    "llm_runtime": frozenset({"triton_support", "pipeline", "client", "openai_api", "deploy"}),
    "triton_support": frozenset({"llm_runtime", "pipeline", "client", "openai_api", "deploy"}),
}
#: What the grammar core never imports: it holds no sockets, threads, processes or shared memory
#: (:mod:`grammar_service` runs it on threads and processes, its transports carry the step).
CORE_FORBIDDEN = frozenset({"socket", "threading", "_thread", "multiprocessing", "mmap", "concurrent", "select",
                            "signal", "subprocess", "asyncio"})

Graph = dict[str, set[str]]


def module_files(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """``{dotted module name: file}`` of every ``.py`` file under ``root/<package>``."""
    modules: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _is_main_guard(test: ast.expr) -> bool:
    return (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "__name__"
            and len(test.comparators) == 1 and isinstance(test.comparators[0], ast.Constant)
            and test.comparators[0].value == "__main__")


def _imports(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement under ``node``, at any depth, outside the blocks left out (module docstring)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and (_is_type_checking(child.test) or _is_main_guard(child.test)):
            # The `else:` of such a block does run.
            for other in child.orelse:
                yield from _imports_of(other)
            continue
        yield from _imports_of(child)


def _imports_of(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node
    else:
        yield from _imports(node)


def _base(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module ``from <...> import`` names (relative imports resolved)."""
    if node.level == 0:
        return node.module or ""
    parts = module.split(".") if is_package else module.split(".")[:-1]
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join([*parts, node.module] if node.module else parts)


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """``name`` or its longest prefix that is a module of ``modules`` (``import a.b.c`` of a name in ``a.b``)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def imported_names(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every absolute name ``module`` imports, project or not (see the module docstring for what counts).

    ``from pkg import mod`` names the module ``pkg.mod`` where it is one of ``modules``; otherwise
    ``from mod import name`` names ``mod``.
    """
    names: set[str] = set()
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in _imports(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        else:
            base = _base(module, path.name == "__init__.py", node)
            names.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names)
    return names


def import_graph(modules: dict[str, Path]) -> Graph:
    """``{module: the modules of ``modules`` it imports}`` (see the module docstring for what counts)."""
    graph: Graph = {}
    for module, path in modules.items():
        known = (_known(name, modules) for name in imported_names(module, path, modules))
        graph[module] = {t for t in known if t is not None and t != module}
    return graph


def find_cycle(graph: Graph) -> list[str] | None:
    """One import circle of ``graph`` as ``[a, b, ..., a]``, or ``None`` when there is none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found is not None:
                    return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start)
            if found is not None:
                return found
    return None


def test_product_packages_import_without_a_circle() -> None:
    modules = module_files(REPO, PACKAGES)
    assert {"deploy.server", "deploy.supervisor", "deploy.launch", "contract"} <= set(modules)
    graph = import_graph(modules)
    # The launcher's modules, as the split into deploy/launch.py intends.
    assert {"deploy.server", "deploy.supervisor", "deploy.health"} <= graph["deploy.launch"]
    assert "deploy.server" in graph["deploy.supervisor"]
    assert not {"deploy.launch", "deploy.supervisor"} & graph["deploy.server"]
    # The TensorRT-LLM engine imports its decoder lazily (grammar_mode processor); both take the
    # version pin and the API check from llm_runtime.trtllm_api, which imports neither.
    assert "llm_runtime.trtllm_decoder" in graph["llm_runtime.trtllm_engine"]
    assert "llm_runtime.trtllm_api" in graph["llm_runtime.trtllm_decoder"]
    assert not {"llm_runtime.trtllm_engine", "llm_runtime.trtllm_decoder"} & graph["llm_runtime.trtllm_api"]
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_no_layer_imports_one_above_it() -> None:
    modules = module_files(REPO, PACKAGES)
    graph = import_graph(modules)
    upward = sorted(f"{module} -> {target}" for module, targets in graph.items() for target in targets
                    if target.split(".")[0] in FORBIDDEN_EDGES.get(module.split(".")[0], frozenset()))
    assert upward == []
    # The edges the rules are about exist, so a rule is not vacuous.
    assert "grammar_backend.protocol" in graph["llm_runtime.mask"]
    assert "grammar_service.transport.channel" in graph["llm_runtime.remote_mask"]
    assert "telemetry" in graph["llm_runtime.scheduler"] and "telemetry" in graph["triton_support.metrics"]


def test_the_grammar_core_holds_no_threads_sockets_processes_or_shared_memory() -> None:
    modules = module_files(REPO, PACKAGES)
    found = sorted(f"{module}: {name}" for module, path in modules.items() if module.split(".")[0] == "grammar_backend"
                   for name in imported_names(module, path, modules) if name.split(".")[0] in CORE_FORBIDDEN)
    assert found == []
    service = {name.split(".")[0] for module, path in modules.items() if module.startswith("grammar_service")
               for name in imported_names(module, path, modules)}
    assert {"threading", "socket", "concurrent", "select"} <= service  # where they went


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("import threading\n", {"threading"}),
        ("from concurrent.futures import Future\n", {"concurrent.futures"}),
        ("def f():\n    import socket\n", {"socket"}),
        ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import mmap\n", {"typing"}),
        ("from . import b\n", {"pkg.b"}),
    ],
    ids=["import", "from", "lazy", "type-checking", "relative"],
)
def test_imported_names(tmp_path: Path, text: str, names: set[str]) -> None:
    (tmp_path / "pkg").mkdir()
    for name, body in {"__init__.py": "", "a.py": text, "b.py": ""}.items():
        (tmp_path / "pkg" / name).write_text(body)
    modules = module_files(tmp_path, ("pkg",))
    assert imported_names("pkg.a", modules["pkg.a"], modules) == names


# The checker itself, on small packages: (files, the circle it must report or None).
@pytest.mark.parametrize(
    ("files", "cycle"),
    [
        ({"a.py": "import pkg.b\n", "b.py": "def f():\n    from pkg import a\n"}, ["pkg.a", "pkg.b", "pkg.a"]),
        ({"a.py": "from . import b\n", "b.py": "from .a import x\n"}, ["pkg.a", "pkg.b", "pkg.a"]),
        ({"a.py": "from pkg.b import x\n",
          "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import y\n"}, None),
        ({"a.py": "from pkg.b import x\n",
          "b.py": "import typing\nif typing.TYPE_CHECKING:\n    pass\nelse:\n    import pkg.a\n"},
         ["pkg.a", "pkg.b", "pkg.a"]),
        ({"a.py": "from pkg.b import x\n", "b.py": 'if __name__ == "__main__":\n    from pkg.a import main\n'}, None),
        ({"__init__.py": "from pkg.a import x\n", "a.py": "import os\n"}, None),
        ({"a.py": "import pkg\n", "__init__.py": "class C:\n    def m(self):\n        import pkg.a\n"},
         ["pkg", "pkg.a", "pkg"]),
    ],
    ids=["lazy", "relative", "type-checking", "type-checking-else", "main-guard", "init-imports-child",
         "init-lazy"],
)
def test_find_cycle(tmp_path: Path, files: dict[str, str], cycle: list[str] | None) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    for name, text in files.items():
        (tmp_path / "pkg" / name).write_text(text)
    assert find_cycle(import_graph(module_files(tmp_path, ("pkg",)))) == cycle
