"""Render a Triton model repository from templates.

Usage::

    python -m deploy.render --src model_repository --dst build/model_repository \\
        --set MODEL_DIR=/abs/path --values values.json

Every ``config.pbtxt.in`` (or plain ``config.pbtxt``) under ``--src`` has its
``${KEY}`` placeholders substituted and is written as ``config.pbtxt`` under
``--dst``; every other file (``model.py``, version directories, ...) is copied
byte for byte.  Rendering fails loudly, before ``--dst`` is touched, when

* a template uses a placeholder that no value fills (the message names the file
  and the placeholder),
* a value is given that no template uses (a misspelt ``--set`` key would
  otherwise be ignored silently),
* a key is malformed, given twice, or a model directory holds both
  ``config.pbtxt`` and ``config.pbtxt.in``.

``--dst`` is replaced atomically as far as POSIX allows: the repository is
rendered into a temporary sibling directory, then swapped in with two
``rename(2)`` calls, so a reader (or a crashed render) never sees a half-written
repository; the previous one is removed only after the swap.

Only ``${KEY}`` (braces required, ``KEY`` = ``[A-Za-z_][A-Za-z0-9_]*``) is a
placeholder; ``$$`` is a literal ``$``.  Any other ``$`` sequence in a template
is an error, because protobuf text format never needs a bare ``$`` and a typo
such as ``$MODEL_DIR`` must not reach Triton unrendered.

A value is written escaped for a protobuf text string (``\\``, ``\"``, ``\'``
and control characters as octal escapes, :func:`pbtxt_escape`): every string
placeholder sits between double quotes, so a value holding a quote or a
backslash (a JSON object, a Windows path, a regex) reaches the model as it was
given instead of breaking the file Triton parses.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

__all__ = [
    "RenderError",
    "RenderResult",
    "load_values",
    "main",
    "parse_assignments",
    "pbtxt_escape",
    "render_repository",
    "render_template",
]

TEMPLATE_SUFFIX: Final = ".in"
CONFIG_NAME: Final = "config.pbtxt"
TEMPLATE_NAME: Final = CONFIG_NAME + TEMPLATE_SUFFIX

_KEY_RE: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# One alternation so that a single left-to-right scan classifies every `$`:
# escaped `$$`, a well-formed `${KEY}`, or anything else (an error).
_TOKEN_RE: Final = re.compile(r"\$(?:(?P<escaped>\$)|\{(?P<key>[A-Za-z_][A-Za-z0-9_]*)\}|(?P<bad>))")
# What a protobuf text string literal cannot hold as it is: backslash, quotes, control characters.
_ESCAPE_RE: Final = re.compile(r"[\\\"'\x00-\x1f\x7f]")
_ESCAPES: Final = {"\\": "\\\\", '"': '\\"', "'": "\\'"}
# Files that are build debris, never part of a model repository.
_IGNORED_NAMES: Final = frozenset({"__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache"})
_IGNORED_SUFFIXES: Final = (".pyc", ".pyo", "~", ".swp")


class RenderError(ValueError):
    """A template, a value or the source tree is not valid for rendering.

    The message names the file (relative to the source root where possible)
    and the placeholder or key at fault.
    """


@dataclass(frozen=True)
class RenderResult:
    """What :func:`render_repository` produced.

    Attributes
    ----------
    dst : Path
        The rendered repository.
    configs : tuple[str, ...]
        ``config.pbtxt`` files written, relative to ``dst``, sorted.
    copied : tuple[str, ...]
        Other files copied verbatim, relative to ``dst``, sorted.
    used_keys : frozenset[str]
        Placeholders that were substituted at least once.
    """

    dst: Path
    configs: tuple[str, ...]
    copied: tuple[str, ...]
    used_keys: frozenset[str]


def _check_key(key: str, origin: str) -> None:
    if not _KEY_RE.fullmatch(key):
        raise RenderError(f"{origin}: invalid key {key!r}: must match [A-Za-z_][A-Za-z0-9_]*")


def parse_assignments(items: Sequence[str]) -> dict[str, str]:
    """Parse ``KEY=VALUE`` strings (the ``--set`` arguments).

    Parameters
    ----------
    items : Sequence[str]
        Each item is ``KEY=VALUE``; the value may be empty and may contain ``=``.

    Returns
    -------
    dict[str, str]
        The assignments in order.

    Raises
    ------
    RenderError
        If an item has no ``=``, an invalid key, or a key is repeated.
    """
    values: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise RenderError(f"--set {item!r}: expected KEY=VALUE")
        _check_key(key, f"--set {item!r}")
        if key in values:
            raise RenderError(f"--set {key}: given more than once")
        values[key] = value
    return values


def load_values(path: Path) -> dict[str, str]:
    """Load placeholder values from a JSON object file.

    Values must be strings, integers or booleans (booleans render as
    ``true``/``false``, the protobuf text spelling); anything else is rejected
    rather than rendered through ``str()`` into something Triton misreads.

    Raises
    ------
    RenderError
        If the file is unreadable, not a JSON object, or holds a bad key/value.
    """
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise RenderError(f"{path}: cannot read values file: {err.strerror}") from err
    except json.JSONDecodeError as err:
        raise RenderError(f"{path}: invalid JSON at line {err.lineno} column {err.colno}: {err.msg}") from err
    if not isinstance(data, dict):
        raise RenderError(f"{path}: values file must hold a JSON object, got {type(data).__name__}")
    values: dict[str, str] = {}
    for key, value in data.items():
        _check_key(key, str(path))
        if isinstance(value, bool):
            values[key] = "true" if value else "false"
        elif isinstance(value, (str, int)):
            values[key] = str(value)
        else:
            raise RenderError(f"{path}: {key}: value must be a string, integer or boolean, got {type(value).__name__}")
    return values


def pbtxt_escape(value: str) -> str:
    """``value`` as the inside of a protobuf text string literal (what ``TextFormat`` unescapes back to it).

    Backslashes and both quote characters get a backslash; control characters
    (a newline would end the literal) become three-digit octal escapes.  A
    value without any of these (every number, name and path the shipped
    values hold) is unchanged.
    """
    return _ESCAPE_RE.sub(lambda m: _ESCAPES.get(m.group(0)) or f"\\{ord(m.group(0)):03o}", value)


def render_template(text: str, values: Mapping[str, str], *, origin: str) -> tuple[str, frozenset[str]]:
    """Substitute ``${KEY}`` placeholders in one template.

    Parameters
    ----------
    text : str
        The template text.
    values : Mapping[str, str]
        Placeholder values.
    origin : str
        Name of the template, used in error messages.

    Returns
    -------
    tuple[str, frozenset[str]]
        The rendered text and the keys it used.

    Raises
    ------
    RenderError
        On an unfilled placeholder (all of them are listed) or a stray ``$``.
    """
    missing: list[str] = []
    used: set[str] = set()

    def replace(match: re.Match[str]) -> str:
        if match.group("escaped") is not None:
            return "$"
        key = match.group("key")
        if key is None:
            line = text.count("\n", 0, match.start()) + 1
            snippet = text[match.start() : match.start() + 12].splitlines()[0]
            raise RenderError(
                f"{origin}:{line}: stray '$' in {snippet!r}: write placeholders as ${{KEY}} and a literal '$' as '$$'"
            )
        if key not in values:
            if key not in missing:
                missing.append(key)
            return match.group(0)
        used.add(key)
        return pbtxt_escape(values[key])

    rendered = _TOKEN_RE.sub(replace, text)
    if missing:
        names = ", ".join("${" + key + "}" for key in missing)
        raise RenderError(f"{origin}: unfilled placeholder(s) {names}")
    return rendered, frozenset(used)


def _ignored(name: str) -> bool:
    return name in _IGNORED_NAMES or name.endswith(_IGNORED_SUFFIXES)


def _render_into(src: Path, out: Path, values: Mapping[str, str]) -> tuple[list[str], list[str], set[str]]:
    configs: list[str] = []
    copied: list[str] = []
    used: set[str] = set()
    for root, dirs, files in os.walk(src, followlinks=False):
        root_path = Path(root)
        rel_root = root_path.relative_to(src)
        dirs[:] = sorted(d for d in dirs if not _ignored(d))
        (out / rel_root).mkdir(parents=True, exist_ok=True)
        names = set(files)
        if CONFIG_NAME in names and TEMPLATE_NAME in names:
            raise RenderError(
                f"{rel_root / TEMPLATE_NAME}: both {CONFIG_NAME} and {TEMPLATE_NAME} exist; keep only the template"
            )
        for name in sorted(names):
            if _ignored(name):
                continue
            rel = rel_root / name
            source = root_path / name
            if name in (CONFIG_NAME, TEMPLATE_NAME):
                try:
                    text = source.read_text(encoding="utf-8")
                except UnicodeDecodeError as err:
                    raise RenderError(f"{rel}: not UTF-8 text: {err.reason} at byte {err.start}") from err
                rendered, keys = render_template(text, values, origin=str(rel))
                used |= keys
                target_rel = rel_root / CONFIG_NAME
                (out / target_rel).write_text(rendered, encoding="utf-8")
                configs.append(target_rel.as_posix())
            else:
                # copy2 keeps the mode bits: model.py files need not be executable,
                # but anything a model ships as a helper script must stay so.
                shutil.copy2(source, out / rel, follow_symlinks=True)
                copied.append(rel.as_posix())
    return configs, copied, used


#: Triton's Python-backend parameter naming a model's own Python environment.
EXECUTION_ENV_PARAMETER: Final = "EXECUTION_ENV_PATH"


def _execution_env_line(model: str, path: str) -> str:
    if not path.startswith("/") or any(c in path for c in '"\\\n$'):
        raise RenderError(f"--execution-env {model}={path}: the path must be absolute, without quotes, "
                          "backslashes, newlines or '$'")
    return f'parameters {{ key: "{EXECUTION_ENV_PARAMETER}" value: {{ string_value: "{path}" }} }}\n'


def render_repository(src: Path, dst: Path, values: Mapping[str, str],
                      execution_env: Mapping[str, str] | None = None) -> RenderResult:
    """Render the model repository ``src`` into ``dst``, replacing ``dst``.

    Parameters
    ----------
    src : Path
        The template repository (one directory per model).
    dst : Path
        Where the rendered repository goes; any previous content is replaced.
    values : Mapping[str, str]
        Placeholder values; every key must be used by some template.
    execution_env : Mapping[str, str], optional
        Model name -> the Python environment (a directory with ``bin/activate``)
        its stub runs in: Triton's ``EXECUTION_ENV_PATH``.  The GPU image gives
        the grammar-side models the project's xgrammar and llguidance there,
        apart from TensorRT-LLM's own pins (deploy/docker/Dockerfile).

    Returns
    -------
    RenderResult
        What was written.

    Raises
    ------
    RenderError
        On any template or value problem; ``dst`` is then left untouched.
    """
    src = src.resolve()
    dst = dst.resolve()
    if not src.is_dir():
        raise RenderError(f"--src {src}: not a directory")
    if dst == src or src in dst.parents or dst in src.parents:
        raise RenderError(f"--dst {dst}: must not overlap --src {src}")
    for key in values:
        _check_key(key, "values")
    dst.parent.mkdir(parents=True, exist_ok=True)
    # The temp dir is a sibling of dst so the final rename stays on one filesystem.
    staging = Path(tempfile.mkdtemp(prefix=f".{dst.name}.render-", dir=dst.parent))
    try:
        out = staging / "repo"
        configs, copied, used = _render_into(src, out, values)
        if not configs:
            raise RenderError(f"--src {src}: no {TEMPLATE_NAME} or {CONFIG_NAME} found")
        unused = sorted(set(values) - used)
        if unused:
            raise RenderError(f"value(s) {', '.join(unused)} not used by any template under {src}")
        for model, path in sorted((execution_env or {}).items()):
            config = out / model / CONFIG_NAME
            if not config.is_file():
                raise RenderError(f"--execution-env {model}: no such model under {src}")
            text = config.read_text(encoding="utf-8")
            if EXECUTION_ENV_PARAMETER in text:
                raise RenderError(f"--execution-env {model}: its config already names {EXECUTION_ENV_PARAMETER}")
            config.write_text(text + _execution_env_line(model, path), encoding="utf-8")
        old = staging / "old"
        # rename(2) of a directory onto an existing non-empty directory fails, so
        # move the old tree aside first; the gap between the two renames is the
        # only moment dst does not exist.
        if dst.exists() or dst.is_symlink():
            os.rename(dst, old)
        os.rename(out, dst)
    finally:
        shutil.rmtree(staging, ignore_errors=False)
    return RenderResult(
        dst=dst,
        configs=tuple(sorted(configs)),
        copied=tuple(sorted(copied)),
        used_keys=frozenset(used),
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the process exit status."""
    parser = argparse.ArgumentParser(prog="python -m deploy.render", description="Render a Triton model repository from templates.")
    parser.add_argument("--src", type=Path, required=True, help="template model repository")
    parser.add_argument("--dst", type=Path, required=True, help="rendered model repository (replaced)")
    parser.add_argument("--set", dest="assignments", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--values", type=Path, help="JSON object of KEY: value (--set wins on conflict)")
    parser.add_argument("--execution-env", dest="envs", action="append", default=[], metavar="MODEL=PATH",
                        help=f"run MODEL's Python stub in the environment at PATH ({EXECUTION_ENV_PARAMETER})")
    args = parser.parse_args(argv)
    try:
        values = load_values(args.values) if args.values is not None else {}
        values.update(parse_assignments(args.assignments))
        envs: dict[str, str] = {}
        for item in args.envs:
            model, sep, path = item.partition("=")
            if not sep or not model or model in envs:
                raise RenderError(f"--execution-env {item!r}: expected MODEL=PATH, each model once")
            envs[model] = path
        result = render_repository(args.src, args.dst, values, envs)
    except RenderError as err:
        print(f"render: error: {err}", file=sys.stderr)
        return 2
    print(f"render: wrote {len(result.configs)} config(s), copied {len(result.copied)} file(s) into {result.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
