"""TensorRT-LLM's speculative decoding as the operator sets it: ``TRTLLM_SPECULATIVE_CONFIG``.

The value is TensorRT-LLM's own ``speculative_config`` in the dict form its
users already write in ``extra_llm_api_options`` YAML and NVIDIA's Triton
LLM-API model (``decoding_type`` plus the config class's fields), as one JSON
object, e.g. ``{"decoding_type": "NGram", "max_draft_len": 4,
"max_matching_ngram_size": 2}``.  It is checked here, before the model
loads, with a message naming the key at fault; the engine then builds
TensorRT-LLM's config object from it (:meth:`SpeculativeConfig.build`) and
passes ``LLM(speculative_config=obj)``, which is the LLM API's supported route
(a raw dict is not dispatched to its class by the 1.2-era ``BaseLlmArgs``).

NOT RUN where this project is tested (no ``tensorrt_llm`` wheel, no GPU): the
field tables below were read from the stored versions of
``tensorrt_llm/llmapi/llm_args.py`` around 1.2.1 (the 1.2.1 tag itself is not
stored): the ``from_dict`` design of the 1.2.0rc line, where
``DecodingBaseConfig.from_dict`` maps ``MTP``, ``Medusa``, ``Eagle``,
``Lookahead``, ``NGram``, ``DraftTarget``, ``SaveState``, ``UserProvided`` and
``AUTO`` to their classes (exact, case-sensitive), and a 1.2.1 schema extract
that renames the draft model field ``speculative_model`` (alias
``speculative_model_dir``).  So on the real package :meth:`SpeculativeConfig.build`
checks every key against the class's ``model_fields`` and passes the draft
model under whichever name is a field; ``deploy/gpu/preflight.sh`` runs a
served request with speculation on the first GPU host.

Which ``SpeculativeDecodingMode`` a config gives (``_torch/speculative/interface.py``
at b35ac1b6, 1.2.0rc2; the config classes' ``spec_dec_mode``):

==========================================================  ====================
config                                                      mode
==========================================================  ====================
``Eagle``, ``eagle3_one_model`` true (TensorRT-LLM's        EAGLE3_ONE_MODEL
default)
``Eagle``, ``eagle3_one_model`` false (a draft model)       EAGLE3
``MTP``, ``mtp_eagle_one_model`` and ``use_mtp_vanilla``    MTP_EAGLE
false
``MTP``, ``use_mtp_vanilla`` true                           MTP
``MTP``, otherwise                                          MTP_EAGLE_ONE_MODEL (MTP for a
                                                            checkpoint of several MTP layers)
``DraftTarget``                                             DRAFT_TARGET
``NGram``                                                   NGRAM
==========================================================  ====================

Every mode of the table is served in ``grammar_mode: processor`` (the
grammar decoder's draft rows, :mod:`llm_runtime.grammar_hook`); the engine
still reads the mode the executor really runs
(:func:`llm_runtime.trtllm_decoder.speculative_mode`) and refuses one it does
not know.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Final

import contract
from grammar_backend.errors import ConfigError

__all__ = ["SPECULATIVE_TYPES", "SpeculativeConfig", "SpeculativeType", "parse_speculative_config"]

_NAME: Final = "trtllm_speculative_config"
#: The draft model's folder.  TensorRT-LLM 1.2.0rc names the field ``speculative_model_dir``; 1.2.1 names it
#: ``speculative_model`` and keeps the old name as an alias: both are taken here, and passed under the name the
#: installed class has.
_MODEL_KEYS: Final = ("speculative_model_dir", "speculative_model")


@dataclass(frozen=True)
class _Field:
    """One key's type: ``int`` (with its bounds), ``bool``, ``str`` or a list of ``int``."""

    kind: str
    low: int = 0
    high: int | None = None

    def check(self, key: str, value: object) -> None:
        if self.kind == "bool":
            ok = isinstance(value, bool)
            want = "true or false"
        elif self.kind == "str":
            ok = isinstance(value, str) and bool(value)
            want = "a non-empty string"
        elif self.kind == "ints":
            ok = isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                                 for v in value)
            want = "a list of non-negative integers"
        else:
            ok = (isinstance(value, int) and not isinstance(value, bool) and value >= self.low
                  and (self.high is None or value <= self.high))
            want = f"an integer in {self.low}..{self.high}" if self.high is not None else f"an integer >= {self.low}"
        if not ok:
            raise ConfigError(f"{_NAME}: {key} must be {want}, got {json.dumps(value)}")


# The draft length bound is the grammar decoder's (GrammarModelDecoder refuses a longer layout at build time);
# TensorRT-LLM itself sets none.
_DRAFT_LEN: Final = _Field("int", 1, contract.MAX_DRAFT_TOKENS)
_CHAIN: Final = {"max_draft_len": _DRAFT_LEN, "max_concurrency": _Field("int", 1)}
_DRAFT_MODEL: Final = {**_CHAIN, **{key: _Field("str") for key in _MODEL_KEYS}}


@dataclass(frozen=True)
class SpeculativeType:
    """A ``decoding_type`` this engine serves.

    Attributes
    ----------
    class_name : str
        The config class in ``tensorrt_llm.llmapi``.
    fields : Mapping[str, _Field]
        The keys taken besides ``decoding_type``.
    required : tuple of str
        Keys that must be given (TensorRT-LLM's own validators fail on them
        later, after the model loads, or, for ``max_matching_ngram_size``,
        default to 0, which its NGram check refuses).
    draft_model : bool
        Whether a draft model folder is required.
    """

    class_name: str
    fields: Mapping[str, _Field]
    required: tuple[str, ...]
    draft_model: bool


#: The served ``decoding_type`` values and their keys (linear drafts only: an Eagle tree, ``eagle_choices`` or
#: ``use_dynamic_tree``, lays out ``max_total_draft_tokens`` rows that are not one chain after the row's token,
#: which the grammar rows do not serve).  ``Eagle3`` is the later spelling of ``Eagle`` (TensorRT-LLM PR 10124).
_EAGLE: Final = SpeculativeType("EagleDecodingConfig",
                                {**_DRAFT_MODEL, "eagle3_one_model": _Field("bool"),
                                 "eagle3_layers_to_capture": _Field("ints"), "eagle3_model_arch": _Field("str")},
                                ("max_draft_len",), draft_model=True)
SPECULATIVE_TYPES: Final[Mapping[str, SpeculativeType]] = {
    "Eagle": _EAGLE,
    "Eagle3": _EAGLE,
    "DraftTarget": SpeculativeType("DraftTargetDecodingConfig", _DRAFT_MODEL, ("max_draft_len",), draft_model=True),
    "NGram": SpeculativeType("NGramDecodingConfig",
                             {**_CHAIN, "max_matching_ngram_size": _Field("int", 1), "is_keep_all": _Field("bool"),
                              "is_use_oldest": _Field("bool"), "is_public_pool": _Field("bool")},
                             ("max_draft_len", "max_matching_ngram_size"), draft_model=False),
    # MTP's draft length is num_nextn_predict_layers (TensorRT-LLM overwrites max_draft_len with it).
    "MTP": SpeculativeType("MTPDecodingConfig",
                           {"num_nextn_predict_layers": _DRAFT_LEN, "use_mtp_vanilla": _Field("bool"),
                            "mtp_eagle_one_model": _Field("bool"), "max_concurrency": _Field("int", 1)},
                           (), draft_model=False),
}

#: ``decoding_type`` values TensorRT-LLM 1.2.1 knows that this engine refuses, and why.
_REFUSED_TYPES: Final = {
    "Medusa": "runs on TensorRT-LLM's TensorRT engine backend only (supports_backend), not the PyTorch backend",
    "Lookahead": "runs on TensorRT-LLM's TensorRT engine backend only (supports_backend), not the PyTorch backend",
    "UserProvided": "needs a Python Drafter object, which a setting cannot hold",
    "AUTO": "is resolved inside the executor (an NGram config chosen from max_batch_size); name NGram and its "
            "max_draft_len and max_matching_ngram_size instead",
    "SaveState": "saves hidden states for training a drafter and forces max_batch_size 1; it is not a way to serve",
}
_REFUSED_KEYS: Final = {
    "eagle_choices": "an Eagle tree's draft rows are not one chain after the row's token, which the grammar rows "
                     "serve",
    "use_dynamic_tree": "an Eagle tree's draft rows are not one chain after the row's token, which the grammar rows "
                        "serve",
    "max_total_draft_tokens": "is derived by TensorRT-LLM (max_draft_len for a chain of drafts)",
}


@dataclass(frozen=True)
class SpeculativeConfig:
    """A checked ``speculative_config``.

    Attributes
    ----------
    decoding_type : str
        A key of :data:`SPECULATIVE_TYPES`.
    fields : tuple of (str, object)
        The other keys as given, the draft model's under ``speculative_model_dir``.
    """

    decoding_type: str
    fields: tuple[tuple[str, Any], ...]

    @property
    def kind(self) -> SpeculativeType:
        """The decoding type's table entry."""
        return SPECULATIVE_TYPES[self.decoding_type]

    @property
    def draft_len(self) -> int:
        """Draft tokens a row may carry (TensorRT-LLM's ``max_total_draft_tokens`` for a chain)."""
        given = dict(self.fields)
        if self.decoding_type == "MTP":
            return int(given.get("num_nextn_predict_layers", 1))
        return int(given["max_draft_len"])

    @property
    def mode(self) -> str:
        """The ``SpeculativeDecodingMode`` name this config gives (see the module's table)."""
        given = dict(self.fields)
        if self.decoding_type in ("Eagle", "Eagle3"):
            return "EAGLE3_ONE_MODEL" if given.get("eagle3_one_model", True) else "EAGLE3"
        if self.decoding_type == "MTP":
            if given.get("use_mtp_vanilla", False):
                return "MTP"
            return "MTP_EAGLE_ONE_MODEL" if given.get("mtp_eagle_one_model", True) else "MTP_EAGLE"
        return {"DraftTarget": "DRAFT_TARGET", "NGram": "NGRAM"}[self.decoding_type]

    def build(self, llmapi: ModuleType) -> Any:
        """TensorRT-LLM's config object (``tensorrt_llm.llmapi``'s class), for ``LLM(speculative_config=...)``.

        Raises
        ------
        grammar_backend.errors.ConfigError
            The installed class lacks a key (a release other than the one
            read), the draft model folder is missing, or TensorRT-LLM's own
            validation refuses the values.
        """
        name = self.kind.class_name
        if self.decoding_type == "Eagle3" and hasattr(llmapi, "Eagle3DecodingConfig"):
            name = "Eagle3DecodingConfig"
        cls = getattr(llmapi, name, None)
        if cls is None:
            raise ConfigError(f"{_NAME}: tensorrt_llm.llmapi has no {name} (decoding_type {self.decoding_type})")
        known = set(getattr(cls, "model_fields", {}))
        kwargs: dict[str, Any] = {k: list(v) if isinstance(v, tuple) else v for k, v in self.fields}
        model = kwargs.pop("speculative_model_dir", None)
        if model is not None:
            if not Path(str(model)).is_dir():
                raise ConfigError(f"{_NAME}: the draft model folder {model!r} does not exist")
            kwargs["speculative_model" if "speculative_model" in known else "speculative_model_dir"] = model
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ConfigError(f"{_NAME}: the installed TensorRT-LLM's {name} has no field {', '.join(unknown)} "
                              f"(its fields: {', '.join(sorted(known))})")
        try:
            return cls(**kwargs)
        except (ValueError, TypeError, AssertionError) as err:  # pydantic's ValidationError is a ValueError
            raise ConfigError(f"{_NAME}: TensorRT-LLM refuses {name}({kwargs}): {err}") from err


def parse_speculative_config(text: str) -> SpeculativeConfig | None:
    """Check ``TRTLLM_SPECULATIVE_CONFIG`` (empty: no speculative decoding).

    Raises
    ------
    grammar_backend.errors.ConfigError
        Not a JSON object, a ``decoding_type`` not served (named, with the
        reason), an unknown key, a value of the wrong type or range, a required
        key missing, or both spellings of the draft model key.
    """
    if not text.strip():
        return None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{_NAME}: not JSON ({err.msg} at column {err.colno})") from err
    if not isinstance(data, dict):
        raise ConfigError(f"{_NAME}: must be a JSON object with decoding_type, got {type(data).__name__}")
    decoding_type = data.pop("decoding_type", None)
    if decoding_type in _REFUSED_TYPES:
        raise ConfigError(f"{_NAME}: decoding_type {decoding_type} {_REFUSED_TYPES[decoding_type]}")
    if not isinstance(decoding_type, str) or decoding_type not in SPECULATIVE_TYPES:
        raise ConfigError(f"{_NAME}: decoding_type must be one of {', '.join(SPECULATIVE_TYPES)}, "
                          f"got {json.dumps(decoding_type)}")
    kind = SPECULATIVE_TYPES[decoding_type]
    for key, value in data.items():
        if key in _REFUSED_KEYS:
            raise ConfigError(f"{_NAME}: {key} is not taken: {_REFUSED_KEYS[key]}")
        field = kind.fields.get(key)
        if field is None:
            raise ConfigError(f"{_NAME}: decoding_type {decoding_type} takes {', '.join(sorted(kind.fields))}, "
                              f"not {key}")
        field.check(key, value)
    missing = [key for key in kind.required if key not in data]
    models = [key for key in _MODEL_KEYS if key in data]
    if len(models) > 1:
        raise ConfigError(f"{_NAME}: give the draft model once, as speculative_model_dir or speculative_model")
    if kind.draft_model and not models:
        missing.append("speculative_model_dir")
    if missing:
        raise ConfigError(f"{_NAME}: decoding_type {decoding_type} needs {', '.join(missing)}")
    if models:
        data["speculative_model_dir"] = data.pop(models[0])
    # Lists become tuples: the config is frozen (build() hands TensorRT-LLM lists again).
    return SpeculativeConfig(decoding_type, tuple(sorted((k, tuple(v) if isinstance(v, list) else v)
                                                         for k, v in data.items())))
