"""Build-time checks of the container images' Python environments (no GPU, no model, no network).

Run by the ``RUN`` steps of ``deploy/docker/Dockerfile*``, and by
``tests/unit/test_deploy_images.py -k dockerfile`` against this checkout's
venv with the exact arguments the Dockerfiles give, so a check that cannot
pass fails in ``make test``, not on a build host::

    python3 -m deploy.image_check grammar requirements-gpu-grammar.txt
    python3 -m deploy.image_check llm requirements-gpu-llm.txt --before llm-env.before.json

``grammar``
    The environment of the grammar-side models (Triton ``EXECUTION_ENV_PATH``
    in the GPU image, the one venv on CPU): every ``name==version`` line of
    the requirements file is installed at that version, and the grammar
    libraries import (versions are read from the distributions' metadata:
    xgrammar 0.2.9 has no ``__version__``).
``llm``
    TensorRT-LLM's environment, where the ``llm`` model runs: tensorrt_llm is
    installed at :data:`llm_runtime.trtllm_api.TRTLLM_VERSION` (its
    metadata only: importing it needs a GPU driver), the additions file pins
    none of the packages TensorRT-LLM owns, what the project's install changed
    broke no requirement (:func:`check_changes`), and the ``llm`` model's
    imports load with xgrammar, llguidance and transformers blocked (it uses
    none of TensorRT-LLM's copies), native mode's constraint mapping included.

What the project's install changed is judged, not every requirement upstream
declares: NVIDIA's image does not satisfy all of TensorRT-LLM's own
``Requires-Dist``.  TensorRT-LLM 1.2.1's ``requirements.txt`` lists
``opencv-python-headless`` (its ``setup.py`` makes every line an
``install_requires``), and the 26.07 image uninstalls it right after installing
tensorrt_llm (tensorrtllm_backend ``dockerfile/Dockerfile.triton.trt_llm_backend``
on branch r26.07 at 3bc11537, lines 164-165: the cherry-pick of 0b9d7d5a
"Removing unused package"; ``tests/fixtures/trtllm/tensorrt_llm-requires.txt``).
So the Dockerfile records the environment as NVIDIA left it
(``python3 -m pip list --format=json > llm-env.before.json``) before it
installs ``requirements-gpu-llm.txt``, and the check compares the two.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Final

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

__all__ = [
    "BLOCKED_IN_LLM",
    "CheckError",
    "Environment",
    "check_changes",
    "check_llm_environment",
    "check_llm_imports",
    "check_pins",
    "check_requirements_hold",
    "main",
    "pinned_requirements",
    "read_snapshot",
]

REPO: Final = Path(__file__).resolve().parents[1]
#: What the grammar-side models, the launcher and the gateway import (each must load in their
#: environment); ``deploy.launch`` (``python -m deploy``) pulls in the server, the supervisor, the
#: gateway and its ``grpc.health.v1`` service.
GRAMMAR_IMPORTS: Final = ("numpy", "torch", "xgrammar", "llguidance", "jsonschema", "tokenizers", "transformers",
                          "grpc", "tritonclient.grpc", "grpc_health.v1", "deploy.launch")
#: TensorRT-LLM's copies of these are left alone: the ``llm`` model must import none of them.
BLOCKED_IN_LLM: Final = ("xgrammar", "llguidance", "transformers", "tvm_ffi")
#: Packages TensorRT-LLM pins that the llm-side additions must never name.
TRTLLM_OWNED: Final = frozenset({"tensorrt-llm", "torch", "xgrammar", "llguidance", "apache-tvm-ffi",
                                 "transformers", "tokenizers", "numpy", "flashinfer-python", "triton"})
LLM_MODEL: Final = REPO / "model_repository" / "llm" / "1" / "model.py"
#: One constraint of each kind ``grammar_mode: native`` maps to TensorRT-LLM's own decoder (Lark is
#: refused there), as preprocessing's validated wire form (the only form the llm model gets).  The
#: check maps each with the blocks on: a lazy import of a grammar library on that path fails the
#: build, not the first request of that kind.
NATIVE_SAMPLES: Final = (
    ("json_schema", '{"type":"object","properties":{"a":{"type":"integer"}},"required":["a"]}'),
    ("json_object", ""),
    ("regex", "[a-z]+"),
    ("ebnf", 'root ::= "x"'),
    ("choice", '["north","south"]'),
    ("structural_tag", '{"type":"structural_tag","format":{"type":"const_string","value":"hi"}}'),
)


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
            pins[canonicalize_name(req.name)] = spec[0].version
    return pins


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


@dataclass(frozen=True)
class Environment:
    """The distributions of a Python environment, read from their metadata.

    Attributes
    ----------
    versions : dict of str to str
        ``{canonical name: version}``.
    requires : dict of str to tuple of str
        ``{canonical name: its Requires-Dist lines}``.
    """

    versions: dict[str, str]
    requires: dict[str, tuple[str, ...]]

    @classmethod
    def read(cls, path: Sequence[str] | None = None) -> Environment:
        """The distributions on ``path`` (default ``sys.path``); the first of a name wins, as an import finds it."""
        versions: dict[str, str] = {}
        requires: dict[str, tuple[str, ...]] = {}
        for dist in metadata.distributions(path=list(sys.path if path is None else path)):
            name = dist.metadata["Name"]
            if not name or canonicalize_name(name) in versions:
                continue
            versions[canonicalize_name(name)] = dist.version
            requires[canonicalize_name(name)] = tuple(dist.requires or ())
        return cls(versions, requires)


def read_snapshot(path: Path) -> dict[str, str]:
    """``{canonical name: version}`` from ``pip list --format=json`` output (the environment before an install).

    Raises
    ------
    CheckError
        The file cannot be read or is not pip's JSON list.
    """
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        return {canonicalize_name(str(d["name"])): str(d["version"]) for d in doc}
    except (OSError, ValueError, TypeError, KeyError) as err:
        raise CheckError(f"{path}: not the output of `pip list --format=json` taken before the install: {err}") from err


def _applies(req: Requirement) -> bool:
    # Requirements behind an extra, or whose marker does not hold here, do not apply.
    return req.marker is None or req.marker.evaluate({"extra": ""})


def _unmet(req: Requirement, versions: Mapping[str, str]) -> str | None:
    installed = versions.get(canonicalize_name(req.name))
    if installed is None:
        return f"{req} (not installed)"
    if not req.specifier.contains(installed, prereleases=True):
        return f"{req} (installed: {installed})"
    return None


def _same_version(a: str | None, b: str | None) -> bool:
    """Equal as versions: ``pip list`` prints them normalized (25.7), metadata as written (25.07)."""
    if a is None or b is None:
        return a is b
    try:
        return Version(a) == Version(b)
    except InvalidVersion:
        return a == b


def check_requirements_hold(requirements: Iterable[str], what: str, versions: Mapping[str, str]) -> None:
    """Each requirement string (as in a requirements file) is satisfied by ``versions``.

    Raises
    ------
    CheckError
        Naming each unsatisfied requirement and what is installed instead.
    """
    problems = [p for text in requirements if _applies(req := Requirement(text)) and (p := _unmet(req, versions))]
    if problems:
        raise CheckError(f"{what} no longer holds: " + "; ".join(problems))


def check_changes(before: Mapping[str, str], env: Environment) -> list[str]:
    """What an install changed (``before`` -> ``env``) broke nothing; returns the changes, one line each.

    A changed distribution (added, removed, or at another version) must keep
    every requirement that names it, and an added or changed one must have all
    of its own requirements met; none may be one TensorRT-LLM owns
    (:data:`TRTLLM_OWNED`).  Requirements that were already unmet before and
    name nothing that changed are not the install's doing and are left alone
    (see the module docstring: the NGC image's own ``opencv-python-headless``).

    Raises
    ------
    CheckError
        Naming each broken requirement and each owned package that changed.
    """
    after = env.versions
    changed = {n for n in before.keys() | after.keys() if not _same_version(before.get(n), after.get(n))}
    problems = [f"{n} changed ({before.get(n, 'absent')} -> {after.get(n, 'absent')}): TensorRT-LLM owns it"
                for n in sorted(changed & TRTLLM_OWNED)]
    for dist in sorted(after):
        for text in env.requires[dist]:
            try:
                req = Requirement(text)
            except InvalidRequirement as err:
                if dist in changed:  # an unchanged distribution's metadata is not the install's to judge
                    problems.append(f"{dist} {after[dist]} declares an invalid requirement {text!r}: {err}")
                continue
            if (dist in changed or canonicalize_name(req.name) in changed) and _applies(req):
                unmet = _unmet(req, after)
                if unmet:
                    problems.append(f"{dist} {after[dist]} requires {unmet}")
    if problems:
        raise CheckError("the install broke TensorRT-LLM's environment: " + "; ".join(problems))
    return [f"{n} {before.get(n, 'absent')} -> {after.get(n, 'absent')}" for n in sorted(changed)]


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
    """Import what the ``llm`` model imports, and its TensorRT-LLM engine, with :data:`BLOCKED_IN_LLM` blocked,
    and map :data:`NATIVE_SAMPLES` as native mode does.

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
    from grammar_backend.spec import ConstraintKind, ConstraintOptions, ConstraintSpec
    from llm_runtime.mask import ConstraintRequest
    from llm_runtime.trtllm_engine import native_guided_kwargs

    for kind, payload in NATIVE_SAMPLES:
        wire = ConstraintSpec(ConstraintKind(kind), payload, ConstraintOptions(), None).wire()
        try:
            native_guided_kwargs(ConstraintRequest(kind, payload, wire["options"], validated=True))
        except ImportError as err:
            raise CheckError(f"native mode's mapping of a {kind} constraint imports what TensorRT-LLM's "
                             f"environment must not load: {err}") from err
    return [*modules, f"native mode's mapping of {', '.join(k for k, _ in NATIVE_SAMPLES)}"]


def check_grammar(requirements: Path) -> list[str]:
    """The ``grammar`` role (see the module docstring); returns what was found."""
    found = check_pins(requirements)
    for module in GRAMMAR_IMPORTS:
        try:
            importlib.import_module(module)
        except ImportError as err:
            raise CheckError(f"{module} does not import: {err}") from err
    return found


def check_llm_environment(additions: Path, before: Path, env: Environment) -> list[str]:
    """The ``llm`` role's metadata checks on ``env`` (see the module docstring); returns what was found.

    Parameters
    ----------
    additions : Path
        ``requirements-gpu-llm.txt``, the project's install into TensorRT-LLM's environment.
    before : Path
        ``pip list --format=json`` of the environment before that install.
    env : Environment
        The environment now.
    """
    from llm_runtime.trtllm_api import TRTLLM_VERSION

    owned = sorted(canonicalize_name(r.name) for r in _requirements(additions)
                   if canonicalize_name(r.name) in TRTLLM_OWNED)
    if owned:
        raise CheckError(f"{additions.name} names {', '.join(owned)}: TensorRT-LLM pins those in its environment")
    version = env.versions.get("tensorrt-llm")
    if version is None:
        raise CheckError("tensorrt_llm is not installed in this environment (the llm model's, in the NGC "
                         "trtllm-python-py3 image)")
    if version != TRTLLM_VERSION:
        raise CheckError(f"tensorrt_llm is {version}; the engine is written against {TRTLLM_VERSION}")
    changes = check_changes(read_snapshot(before), env)
    check_requirements_hold([str(r) for r in _requirements(additions)], additions.name, env.versions)
    return [f"tensorrt-llm {version}", f"changed by {additions.name}: {', '.join(changes) or 'nothing'}"]


def check_llm(additions: Path, before: Path) -> list[str]:
    """The ``llm`` role (see the module docstring); returns what was found."""
    imported = check_llm_imports()  # first: nothing of llm_runtime may be imported before the block
    found = check_llm_environment(additions, before, Environment.read())
    return [*found, *(f"imports {m}" for m in imported)]


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (1: a check failed)."""
    parser = argparse.ArgumentParser(prog="python -m deploy.image_check", description=__doc__.splitlines()[0])
    parser.add_argument("role", choices=("grammar", "llm"))
    parser.add_argument("requirements", type=Path, help="the requirements file installed for this role")
    parser.add_argument("--before", type=Path, help="llm: `pip list --format=json` of the environment taken "
                                                    "before the requirements were installed (required)")
    args = parser.parse_args(argv)
    if args.role == "llm" and args.before is None:
        parser.error("llm: --before is required (the environment before requirements-gpu-llm.txt was installed)")
    try:
        found = check_grammar(args.requirements) if args.role == "grammar" else check_llm(args.requirements, args.before)
    except (CheckError, OSError) as err:
        print(f"image_check {args.role}: FAILED: {err}", file=sys.stderr)
        return 1
    print(f"image_check {args.role}: ok ({sys.prefix}): {', '.join(found)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
