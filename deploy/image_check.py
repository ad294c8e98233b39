"""Build-time checks of the container images' Python environments (no GPU, no model, no network).

Run by the ``RUN`` steps of ``deploy/docker/Dockerfile*``, and by
``tests/unit/test_deploy_images.py -k dockerfile`` against this checkout's
venv with the exact arguments the Dockerfiles give, so a check that cannot
pass fails in ``make test``, not on a build host::

    python3 -m deploy.image_check grammar requirements-gpu-grammar.txt
    python3 -m deploy.image_check llm requirements-gpu-llm.txt

``grammar``
    The environment of the grammar-side models (Triton ``EXECUTION_ENV_PATH``
    in the GPU image, the one venv on CPU): every ``name==version`` line of
    the requirements file is installed at that version, and the grammar
    libraries import (versions are read from the distributions' metadata:
    xgrammar 0.2.9 has no ``__version__``).
``llm``
    TensorRT-LLM's environment, where the ``llm`` model runs: tensorrt_llm is
    installed at :data:`llm_runtime.trtllm_api.TRTLLM_VERSION` (its
    metadata only: importing it needs a GPU driver), every requirement it
    declares is still satisfied (nothing installed here replaced one of its
    pins), the additions file pins none of the packages TensorRT-LLM owns, and
    the ``llm`` model's imports load with xgrammar, llguidance and
    transformers blocked (it uses none of TensorRT-LLM's copies).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import sys
from collections.abc import Iterable, Iterator, Sequence
from importlib import metadata
from pathlib import Path
from typing import Final

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet

__all__ = [
    "BLOCKED_IN_LLM",
    "CheckError",
    "check_llm_imports",
    "check_pins",
    "check_requirements_hold",
    "main",
    "pinned_requirements",
]

REPO: Final = Path(__file__).resolve().parents[1]
#: What the grammar-side models, the launcher and the gateway import (each must load in their
#: environment); ``deploy.server`` pulls in the gateway and its ``grpc.health.v1`` service.
GRAMMAR_IMPORTS: Final = ("numpy", "torch", "xgrammar", "llguidance", "jsonschema", "tokenizers", "transformers",
                          "grpc", "tritonclient.grpc", "grpc_health.v1", "deploy.server")
#: TensorRT-LLM's copies of these are left alone: the ``llm`` model must import none of them.
BLOCKED_IN_LLM: Final = ("xgrammar", "llguidance", "transformers", "tvm_ffi")
#: Packages TensorRT-LLM pins that the llm-side additions must never name.
TRTLLM_OWNED: Final = frozenset({"tensorrt-llm", "torch", "xgrammar", "llguidance", "apache-tvm-ffi",
                                 "transformers", "tokenizers", "numpy", "flashinfer-python", "triton"})
LLM_MODEL: Final = REPO / "model_repository" / "llm" / "1" / "model.py"


class CheckError(Exception):
    """An image environment is not what the project needs (the message says what and why)."""


def _requirements(path: Path) -> Iterator[Requirement]:
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            yield Requirement(line)
        except InvalidRequirement as err:
            raise CheckError(f"{path.name}:{number}: {err}") from err


def pinned_requirements(path: Path) -> dict[str, str]:
    """``{canonical name: version}`` of every ``name==version`` line of a requirements file."""
    pins: dict[str, str] = {}
    for req in _requirements(path):
        spec = list(req.specifier)
        if len(spec) == 1 and spec[0].operator == "==":
            pins[_canonical(req.name)] = spec[0].version
    return pins


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def check_pins(path: Path) -> list[str]:
    """Every pin of ``path`` is installed at its version; returns ``name version`` lines.

    Raises
    ------
    CheckError
        Listing each package missing or at another version.
    """
    found, problems = [], []
    for name, version in sorted(pinned_requirements(path).items()):
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            problems.append(f"{name} is not installed (needs {version})")
            continue
        # A local version label (torch 2.13.0+cpu) satisfies its release's pin, as pip has it.
        if not SpecifierSet(f"=={version}").contains(installed, prereleases=True):
            problems.append(f"{name} is {installed}, {path.name} pins {version}")
        found.append(f"{name} {installed}")
    if problems:
        raise CheckError("; ".join(problems))
    return found


def check_requirements_hold(requirements: Iterable[str], what: str) -> None:
    """Each requirement string (as in a distribution's ``Requires-Dist``) is satisfied.

    Requirements behind an extra, or whose marker does not apply here, are skipped.

    Raises
    ------
    CheckError
        Naming each unsatisfied requirement and what is installed instead.
    """
    problems = []
    for text in requirements:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            installed = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            problems.append(f"{req} (not installed)")
            continue
        if not req.specifier.contains(installed, prereleases=True):
            problems.append(f"{req} (installed: {installed})")
    if problems:
        raise CheckError(f"{what} no longer holds: " + "; ".join(problems))


def _model_imports(model_py: Path) -> list[str]:
    modules: set[str] = set()
    for node in ast.walk(ast.parse(model_py.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules.add(node.module)
        elif isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
    modules.discard("triton_python_backend_utils")  # the stub's own module
    return sorted(modules)


def check_llm_imports(model_py: Path = LLM_MODEL) -> list[str]:
    """Import what the ``llm`` model imports, and its TensorRT-LLM engine, with :data:`BLOCKED_IN_LLM` blocked.

    Changes ``sys.modules`` of the calling process: run it in a process of its own.

    Raises
    ------
    CheckError
        The first import that fails, with its error.
    """
    for name in BLOCKED_IN_LLM:
        sys.modules[name] = None  # type: ignore[assignment]  # makes any import of it fail
    modules = [*_model_imports(model_py), "llm_runtime.trtllm_engine"]
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as err:
            raise CheckError(f"the llm model's import of {module} failed in TensorRT-LLM's environment "
                             f"(xgrammar, llguidance and transformers are TensorRT-LLM's there): {err}") from err
    return modules


def check_grammar(requirements: Path) -> list[str]:
    """The ``grammar`` role (see the module docstring); returns what was found."""
    found = check_pins(requirements)
    for module in GRAMMAR_IMPORTS:
        try:
            importlib.import_module(module)
        except ImportError as err:
            raise CheckError(f"{module} does not import: {err}") from err
    return found


def check_llm(additions: Path) -> list[str]:
    """The ``llm`` role (see the module docstring); returns what was found."""
    imported = check_llm_imports()  # first: nothing of llm_runtime may be imported before the block
    from llm_runtime.trtllm_api import TRTLLM_VERSION

    owned = sorted(_canonical(r.name) for r in _requirements(additions) if _canonical(r.name) in TRTLLM_OWNED)
    if owned:
        raise CheckError(f"{additions.name} names {', '.join(owned)}: TensorRT-LLM pins those in its environment")
    try:
        version = metadata.version("tensorrt_llm")
    except metadata.PackageNotFoundError as err:
        raise CheckError("tensorrt_llm is not installed in this environment (the llm model's, in the NGC "
                         "trtllm-python-py3 image)") from err
    if version != TRTLLM_VERSION:
        raise CheckError(f"tensorrt_llm is {version}; the engine is written against {TRTLLM_VERSION}")
    check_requirements_hold(metadata.requires("tensorrt_llm") or [], f"tensorrt_llm {version}'s Requires-Dist")
    check_requirements_hold([str(r) for r in _requirements(additions)], additions.name)
    return [f"tensorrt-llm {version}", *(f"imports {m}" for m in imported)]


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (1: a check failed)."""
    parser = argparse.ArgumentParser(prog="python -m deploy.image_check", description=__doc__.splitlines()[0])
    parser.add_argument("role", choices=("grammar", "llm"))
    parser.add_argument("requirements", type=Path, help="the requirements file installed for this role")
    args = parser.parse_args(argv)
    try:
        found = check_grammar(args.requirements) if args.role == "grammar" else check_llm(args.requirements)
    except (CheckError, OSError) as err:
        print(f"image_check {args.role}: FAILED: {err}", file=sys.stderr)
        return 1
    print(f"image_check {args.role}: ok ({sys.prefix}): {', '.join(found)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
