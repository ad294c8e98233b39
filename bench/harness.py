"""What the benchmark scripts share: paths, command-line options, the JSON writer, figures and the served stack.

Every script in ``bench/`` imports this module before any of the project's
packages: importing it puts the repository root on ``sys.path`` (run as a
script, ``sys.path[0]`` is ``bench/``, and the packages live at the root).

* Paths: :data:`REPO`, the default models and tokenizers (:data:`MODEL_DIR`,
  :data:`TINY_DIR` via :func:`tiny_checkpoint`, :data:`QWEN_DIR`), the
  project's own schemas (:data:`OWN_SCHEMAS`).
* Command line: :func:`bench_parser` and one ``add_*`` function per option
  that more than one script takes (``--json``, ``--quick``, ``--plot``,
  ``--seed``, ``--rows``, the data folder, ``--model-dir``, ...), so each
  option has one spelling, type and help text.
* Results: :func:`write_json`, the one way a script writes its ``--json``
  file.
* Figures: :func:`figure`, a headless matplotlib figure saved as a PNG.
* The served stack: :func:`render_values` and :func:`serve`, which renders
  ``model_repository/`` into a temporary folder, starts the server (in this
  process with :class:`deploy.server.TritonServer`, or as ``python -m
  deploy`` in a child process), waits until it is ready and stops it after
  the ``with`` block.

Nothing here imports from ``tests/``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

REPO: Final = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from deploy.server import TritonServer

BENCH: Final = REPO / "bench"
#: The embedded default model (``make model``).
MODEL_DIR: Final = REPO / "build" / "models" / "smollm2-135m-instruct"
#: The tiny random Llama (:func:`tiny_checkpoint`): a forward of a few ms, a GPU step's stand-in.
TINY_DIR: Final = REPO / "build" / "models" / "tiny-llama"
#: Written last by :func:`tiny_checkpoint`: the folder is complete.
TINY_MARKER: Final = "tiny_model.json"
#: Qwen3's tokenizer (``make tokenizers``) and its logits width (the tokenizer itself has 151,669 tokens).
QWEN_DIR: Final = REPO / "build" / "tokenizers" / "qwen3"
QWEN_VOCAB: Final = 151_936
#: The MaskBench folder the data-driven scripts are usually given.
DATA_DIR: Final = REPO.parent / "shared" / "data" / "maskbench-dev"
#: The project's hand-written schemas (data files read, never imported).
OWN_SCHEMAS: Final = REPO / "tests" / "fixtures" / "schemas"
#: The render values every served run starts from.
VALUES: Final = REPO / "deploy" / "values.json"
#: The served ensemble the clients call.
ENSEMBLE: Final = "constrained_llm"
#: ``BENCH_QUICK=1`` in the environment turns ``--quick`` on where :func:`add_quick` is given ``env=True``.
QUICK_ENV: Final = "BENCH_QUICK"
#: How long a launched server may take to be ready.
READY_TIMEOUT_S: Final = 300.0


def tiny_checkpoint(path: Path = TINY_DIR) -> Path:
    """The tiny stand-in checkpoint, built once (``build_tiny_llama`` with a ChatML template).

    Parameters
    ----------
    path : Path
        Where it lives; built there unless :data:`TINY_MARKER` says it is complete.

    Returns
    -------
    Path
        ``path``.
    """
    if (path / TINY_MARKER).is_file():
        return path
    from standins.tiny_model import CHATML, build_tiny_llama

    # The llm model's context is 2,048 tokens (llm_runtime.model_config): the
    # checkpoint must take as many positions.
    build_tiny_llama(path, chat_template=CHATML, max_position_embeddings=2048)
    return path


# --------------------------------------------------------------------------- command line
def bench_parser(doc: str | None, *, whole_doc: bool = False) -> argparse.ArgumentParser:
    """An argument parser whose description is a script's docstring.

    Parameters
    ----------
    doc : str or None
        The script's ``__doc__``.
    whole_doc : bool
        Show all of it in ``--help`` (default: its first paragraph).

    Returns
    -------
    argparse.ArgumentParser
        With the description's line breaks kept as written.
    """
    text = doc or ""
    if not whole_doc:
        text = text.split("\n\n")[0]
    return argparse.ArgumentParser(description=text or None, formatter_class=argparse.RawDescriptionHelpFormatter)


def _with_default(help_text: str, default: object) -> str:
    # argparse fills %(default)s in; a None default means the script picks one later and says so itself.
    return help_text if default is None else f"{help_text} (default %(default)s)"


def add_data_dir(parser: argparse.ArgumentParser, *, metavar: str = "DATA_DIR") -> None:
    """The positional MaskBench folder, as ``args.data``.

    Parameters
    ----------
    parser : argparse.ArgumentParser
    metavar : str
        Its name in the usage line.
    """
    parser.add_argument("data", type=Path, metavar=metavar,
                        help=f"folder of MaskBench-format *.json files, e.g. {os.path.relpath(DATA_DIR, REPO)}")


def add_model_dir(parser: argparse.ArgumentParser, default: Path | None = MODEL_DIR, *, positional: bool = False,
                  help_text: str = "model folder") -> None:
    """The model folder, as ``args.model_dir``: ``--model-dir`` or a positional argument.

    Parameters
    ----------
    parser : argparse.ArgumentParser
    default : Path or None
        None: the option's value is None unless given (the script picks the
        model), or, positional, the argument is required.
    positional : bool
        A positional argument (optional where ``default`` is given).
    help_text : str
        What it is; the default is appended.
    """
    if positional:
        if default is None:
            parser.add_argument("model_dir", type=Path, help=help_text)
        else:
            parser.add_argument("model_dir", type=Path, nargs="?", default=default,
                                help=_with_default(help_text, default))
        return
    parser.add_argument("--model-dir", type=Path, default=default, help=_with_default(help_text, default))


def add_max_tokens(parser: argparse.ArgumentParser, default: int | None, help_text: str = "per request") -> None:
    """``--max-tokens N``: each request's ``max_tokens``.

    Parameters
    ----------
    parser : argparse.ArgumentParser
    default : int or None
        None: the script sets it after parsing (from ``--quick``); ``help_text`` then names the defaults.
    help_text : str
    """
    parser.add_argument("--max-tokens", type=int, default=default, help=_with_default(help_text, default))


def add_rounds(parser: argparse.ArgumentParser, default: int | None,
               help_text: str = "interleaved measured rounds") -> None:
    """``--rounds N``: how often the modes' interleaved measurements repeat.

    Parameters
    ----------
    parser : argparse.ArgumentParser
    default : int or None
        None: the script sets it after parsing (from ``--quick``).
    help_text : str
    """
    parser.add_argument("--rounds", type=int, default=default, help=_with_default(help_text, default))


def add_min_seconds(parser: argparse.ArgumentParser, default: float) -> None:
    """``--min-seconds S``: each round measures each concurrency at least this long.

    Parameters
    ----------
    parser : argparse.ArgumentParser
    default : float
    """
    parser.add_argument("--min-seconds", type=float, default=default,
                        help="each round measures each concurrency at least this long, repeating its batches "
                             "(default %(default)s)")


def add_rows(parser: argparse.ArgumentParser, default: int, help_text: str) -> None:
    """``--rows N``: how many sequences one step or batch holds.

    Parameters
    ----------
    parser : argparse.ArgumentParser
    default : int
    help_text : str
        What a row is in this script.
    """
    parser.add_argument("--rows", type=int, default=default, help=_with_default(help_text, default))


def add_concurrency(parser: argparse.ArgumentParser, default: int) -> None:
    """``--concurrency N``: streams in flight at a time.

    Parameters
    ----------
    parser : argparse.ArgumentParser
    default : int
    """
    parser.add_argument("--concurrency", type=int, default=default, help="streams at a time (default %(default)s)")


def add_count(parser: argparse.ArgumentParser, default: int, help_text: str = "schemas in the seeded sample") -> None:
    """``--count N``: the size of the seeded schema sample.

    Parameters
    ----------
    parser : argparse.ArgumentParser
    default : int
    help_text : str
    """
    parser.add_argument("--count", type=int, default=default, help=_with_default(help_text, default))


def add_seed(parser: argparse.ArgumentParser, default: int, what: str = "sample") -> None:
    """``--seed N``.

    Parameters
    ----------
    parser : argparse.ArgumentParser
    default : int
    what : str
        What it seeds.
    """
    parser.add_argument("--seed", type=int, default=default, help=f"{what} seed (default %(default)s)")


def add_backend(parser: argparse.ArgumentParser, default: str, help_text: str, *, auto: bool = True) -> None:
    """``--backend NAME``: the grammar option ``backend``, its values from :mod:`contract` (their one home).

    Parameters
    ----------
    parser : argparse.ArgumentParser
    default : str
    help_text : str
    auto : bool
        ``auto`` is a choice too (the policy's values), else only the backends themselves.
    """
    import contract

    choices = contract.POLICIES["backend"] if auto else contract.BACKENDS
    parser.add_argument("--backend", choices=choices, default=default, help=_with_default(help_text, default))


def add_phase_timeout(parser: argparse.ArgumentParser, default: float | None, help_text: str = "") -> None:
    """``--timeout S``: seconds per phase of one schema's work in a child process.

    Parameters
    ----------
    parser : argparse.ArgumentParser
    default : float or None
        None: the script sets it after parsing; ``help_text`` then names the default.
    help_text : str
        Appended to the help (e.g. the default the script picks).
    """
    text = f"seconds per phase of one schema{f' {help_text}' if help_text else ''}"
    parser.add_argument("--timeout", type=float, default=default, help=_with_default(text, default))


def add_walks(parser: argparse.ArgumentParser, unit: str, max_steps: int) -> None:
    """``--walks N`` and ``--max-steps N`` of the random-walk fuzzers.

    Parameters
    ----------
    parser : argparse.ArgumentParser
    unit : str
        What is walked (``schema``, ``pattern``).
    max_steps : int
        The default of ``--max-steps``.
    """
    parser.add_argument("--walks", type=int, default=3, help=f"walks per {unit} and grammar (default %(default)s)")
    parser.add_argument("--max-steps", type=int, default=max_steps,
                        help="most tokens before closing (default %(default)s)")


def add_quick(parser: argparse.ArgumentParser, help_text: str, *, env: bool = False) -> None:
    """``--quick``: a shorter run.

    Parameters
    ----------
    parser : argparse.ArgumentParser
    help_text : str
        What it shortens.
    env : bool
        ``BENCH_QUICK=1`` (:data:`QUICK_ENV`) turns it on too: the Makefile's bench targets pass it so.
    """
    default = env and os.environ.get(QUICK_ENV) == "1"
    parser.add_argument("--quick", action="store_true", default=default,
                        help=f"{help_text} (also {QUICK_ENV}=1)" if env else help_text)


def add_json(parser: argparse.ArgumentParser, what: str = "every figure") -> None:
    """``--json PATH``: where :func:`write_json` writes the results (None: nowhere).

    Parameters
    ----------
    parser : argparse.ArgumentParser
    what : str
        What the file holds.
    """
    parser.add_argument("--json", type=Path, default=None, help=f"write {what} here")


def add_plot(parser: argparse.ArgumentParser, what: str = "a PNG") -> None:
    """``--plot PATH``: where :func:`figure` saves the PNG (None: none drawn).

    Parameters
    ----------
    parser : argparse.ArgumentParser
    what : str
        What the figure shows.
    """
    parser.add_argument("--plot", type=Path, default=None, help=f"write {what} here")


def add_quiet(parser: argparse.ArgumentParser) -> None:
    """``--quiet``: no progress lines on stderr.

    Parameters
    ----------
    parser : argparse.ArgumentParser
    """
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


# --------------------------------------------------------------------------- results
def _jsonable(value: Any) -> Any:
    import numpy as np

    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def write_json(path: Path, doc: Any, *, allow_nan: bool = True) -> None:
    """Write ``doc`` to ``path`` as indented UTF-8 JSON (the folder made first).

    NumPy scalars are written as Python numbers.

    Parameters
    ----------
    path : Path
    doc : Any
        Anything :func:`json.dumps` takes, NumPy scalars included.
    allow_nan : bool
        False: a NaN or infinity raises instead of writing ``NaN``, which
        strict JSON readers refuse (for scripts that map them to null first).

    Raises
    ------
    ValueError
        A NaN or infinity under ``allow_nan=False``.
    TypeError
        Something JSON cannot hold.
    """
    text = json.dumps(doc, indent=1, ensure_ascii=False, allow_nan=allow_nan, default=_jsonable)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n", encoding="utf-8")


# --------------------------------------------------------------------------- figures
@contextlib.contextmanager
def figure(path: Path, title: str, *, columns: int, size: tuple[float, float]) -> Iterator[list[Axes]]:
    """One row of ``columns`` plots for the block, then saved as a PNG at ``path`` (the folder made first).

    matplotlib is imported here, with the Agg backend (no display: the bench
    hosts have none), so a run without ``--plot`` does not need it.

    Parameters
    ----------
    path : Path
    title : str
        The figure's title.
    columns : int
    size : tuple of float
        Width and height in inches.

    Yields
    ------
    list of matplotlib.axes.Axes
        The plots, left to right.  Nothing is saved when the block raises.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, columns, figsize=size, squeeze=False)
    try:
        yield list(axes[0])
        fig.suptitle(title)
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path)
    finally:
        plt.close(fig)


# --------------------------------------------------------------------------- the served stack
def render_values(model_dir: Path, overrides: Mapping[str, str] | None = None) -> dict[str, str]:
    """The render values of a served run: ``deploy/values.json``, ``MODEL_DIR`` and ``overrides``.

    Parameters
    ----------
    model_dir : Path
        The model (or, for a grammar-only repository, tokenizer) folder; resolved.
    overrides : mapping, optional
        Values that win over the file's.

    Returns
    -------
    dict
        Key -> value, as :func:`deploy.render.render_repository` takes them.
    """
    from deploy.render import load_values

    values = load_values(VALUES)
    values["MODEL_DIR"] = str(model_dir.resolve())
    values.update(overrides or {})
    return values


@dataclass
class Served:
    """The server of a :func:`serve` block.

    Attributes
    ----------
    url : str
        ``host:port`` of the public gRPC endpoint (the gateway).
    metrics_url : str
        ``http://host:port/metrics``.
    openai_url : str or None
        The OpenAI-compatible endpoint's base URL (None: off).
    pid : int
        The top of the server's process tree: the launcher (``python -m
        deploy``, with the gateway) or, in this process, tritonserver.
    log : Path
        tritonserver's log file, in the temporary folder (gone after the block).
    triton : TritonServer or None
        The in-process server (its internal endpoint and headers); None when launched.
    ready_s : float
        Seconds from the start to ready.
    exit_status : int or None
        Set at teardown.
    log_text : str
        The log, read at teardown before the temporary folder goes ('' until then).
    """

    url: str
    metrics_url: str
    openai_url: str | None
    pid: int
    log: Path
    triton: TritonServer | None = None
    ready_s: float = 0.0
    exit_status: int | None = None
    log_text: str = ""


def _free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports."""
    from deploy.server import find_free_port

    ports: list[int] = []
    while len(ports) < n:
        port = find_free_port()
        if port not in ports:
            ports.append(port)
    return ports


@contextlib.contextmanager
def _launched(repo: Path, log: Path, models: Sequence[str], openai: bool) -> Iterator[Served]:
    """``python -m deploy`` on free loopback ports for the block; stopped (SIGTERM) after.

    ``openai``: with the OpenAI-compatible endpoint too (the launcher's
    ``--openai-port 0`` means off, so a free port is picked here); ready once
    the launcher prints its URL.  The launcher's stdout (Triton's log lines
    included) is read to the end on a thread, so the pipe never fills.

    Raises
    ------
    RuntimeError
        The launcher exited, or was not ready within :data:`READY_TIMEOUT_S`.
    """
    grpc, http, metrics, oai = _free_ports(4)
    cmd = [sys.executable, "-m", "deploy", "--model-repository", str(repo), "--grpc-port", str(grpc),
           "--http-port", str(http), "--metrics-port", str(metrics)]
    for model in models:
        cmd += ["--model", model]
    cmd += ["--log-file", str(log)]
    if openai:
        cmd += ["--openai-port", str(oai)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: collections.deque[str] = collections.deque(maxlen=40)
    urls: dict[str, str] = {}
    ready = threading.Event()

    def read() -> None:
        if proc.stdout is None:
            return
        for line in proc.stdout:
            lines.append(line.rstrip())
            if line.startswith("server: openai: "):
                urls["openai"] = line.removeprefix("server: openai: ").strip()
            # The launcher prints its OpenAI URL after its ready line.
            if ("server: ready:" in line and not openai) or "openai" in urls:
                ready.set()

    reader = threading.Thread(target=read, name="launcher-output", daemon=True)
    reader.start()
    served: Served | None = None
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not ready.wait(0.2):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = "\n".join(lines)
                raise RuntimeError(f"the launcher was not ready (exit status {proc.poll()}):\n{tail}")
        served = Served(f"127.0.0.1:{grpc}", f"http://127.0.0.1:{metrics}/metrics", urls.get("openai"), proc.pid, log)
        yield served
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        reader.join(5)
        if served is not None:
            served.exit_status = proc.returncode


@contextlib.contextmanager
def _in_process(repo: Path, log: Path, models: Sequence[str]) -> Iterator[Served]:
    """:class:`deploy.server.TritonServer` (tritonserver, with the gateway in this process) for the block."""
    from deploy.server import ServerConfig, TritonServer

    server = TritonServer(ServerConfig(model_repository=repo, models=tuple(models), log_file=log))
    served: Served | None = None
    server.start()
    try:
        server.wait_ready()
        if server.pid is None:
            raise RuntimeError("the server has no process")
        served = Served(server.grpc_url, server.metrics_url, None, server.pid, log, triton=server)
        yield served
    finally:
        code = server.stop()
        if served is not None:
            served.exit_status = code


@contextlib.contextmanager
def serve(values: Mapping[str, str], *, prefix: str, models: Sequence[str] = (ENSEMBLE,), launcher: bool = False,
          openai: bool = False, prune: bool = False, extra_models: Sequence[Path] = ()) -> Iterator[Served]:
    """Render ``model_repository/`` with ``values`` into a temporary folder and serve it for the block.

    The server listens on free loopback ports and is stopped when the block
    ends, however it ends; then :attr:`Served.log_text` and
    :attr:`Served.exit_status` are set (the temporary folder is gone).

    Parameters
    ----------
    values : mapping
        Render values (:func:`render_values`).
    prefix : str
        The temporary folder's name prefix (which script it belongs to).
    models : sequence of str
        The models the server must have loaded to be ready.
    launcher : bool
        Start ``python -m deploy`` as a child process, as ``make serve`` does:
        the gateway runs there, apart from this client (its CPU is the
        launcher's, not this process's).  Default: tritonserver driven from
        this process (:class:`deploy.server.TritonServer`), the gateway here.
    openai : bool
        With the OpenAI-compatible endpoint (launched only).
    prune : bool
        Serve only ``models``: the rendered models not named there are removed.
    extra_models : sequence of Path
        Model folders copied into the repository as they are (bench-only models).

    Yields
    ------
    Served
        Its endpoints, process and log.

    Raises
    ------
    ValueError
        ``openai`` without ``launcher``.
    deploy.render.RenderError
        The values do not render.
    RuntimeError
        The server did not become ready (:class:`deploy.server.ServerStartError` in this process).
    """
    if openai and not launcher:
        raise ValueError("the OpenAI endpoint is served by the launcher: openai=True needs launcher=True")
    from deploy.render import render_repository

    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        repo = Path(tmp) / "model_repository"
        render_repository(REPO / "model_repository", repo, values)
        if prune:
            for model in repo.iterdir():  # the server loads every model of its repository
                if model.name not in models:
                    shutil.rmtree(model)
        for folder in extra_models:
            shutil.copytree(folder, repo / folder.name)
        log = Path(tmp) / "tritonserver.log"
        t0 = time.perf_counter()
        server = _launched(repo, log, models, openai) if launcher else _in_process(repo, log, models)
        with server as served:
            served.ready_s = time.perf_counter() - t0
            yield served
        served.log_text = log.read_text(encoding="utf-8", errors="replace") if log.is_file() else ""
