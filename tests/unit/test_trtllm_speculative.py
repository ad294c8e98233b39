"""TRTLLM_SPECULATIVE_CONFIG: TensorRT-LLM's ``speculative_config`` checked before the model loads, then built.

The config classes below stand in for ``tensorrt_llm.llmapi``'s (no wheel
here) with the fields of the stored 1.2.0rc ``llm_args.py``
(``speculative_model_dir``) and of the 1.2.1 schema (``speculative_model``),
as :mod:`llm_runtime.trtllm_speculative` records; the real classes are
checked by :meth:`SpeculativeConfig.build` on the first GPU host.
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict, model_validator

from grammar_backend.errors import ConfigError
from llm_runtime.model_config import LlmModelConfig
from llm_runtime.trtllm_engine import TrtllmConfig
from llm_runtime.trtllm_speculative import SpeculativeConfig, parse_speculative_config

NGRAM = '{"decoding_type": "NGram", "max_draft_len": 4, "max_matching_ngram_size": 2}'


@pytest.mark.parametrize(
    ("text", "decoding_type", "fields", "mode", "draft_len"),
    [
        (NGRAM, "NGram", (("max_draft_len", 4), ("max_matching_ngram_size", 2)), "NGRAM", 4),
        ('{"decoding_type": "NGram", "max_draft_len": 16, "max_matching_ngram_size": 3, "is_keep_all": false}',
         "NGram", (("is_keep_all", False), ("max_draft_len", 16), ("max_matching_ngram_size", 3)), "NGRAM", 16),
        ('{"decoding_type": "Eagle", "max_draft_len": 3, "speculative_model_dir": "/m/e"}',
         "Eagle", (("max_draft_len", 3), ("speculative_model_dir", "/m/e")), "EAGLE3_ONE_MODEL", 3),
        (('{"decoding_type": "Eagle3", "max_draft_len": 3, "speculative_model": "/m/e", "eagle3_one_model": false,'
         ' "eagle3_layers_to_capture": [1, 20]}'),
         "Eagle3", (("eagle3_layers_to_capture", (1, 20)), ("eagle3_one_model", False), ("max_draft_len", 3),
                    ("speculative_model_dir", "/m/e")), "EAGLE3", 3),
        ('{"decoding_type": "DraftTarget", "max_draft_len": 5, "speculative_model": "/m/d"}',
         "DraftTarget", (("max_draft_len", 5), ("speculative_model_dir", "/m/d")), "DRAFT_TARGET", 5),
        ('{"decoding_type": "MTP"}', "MTP", (), "MTP_EAGLE_ONE_MODEL", 1),
        ('{"decoding_type": "MTP", "num_nextn_predict_layers": 3, "use_mtp_vanilla": true}',
         "MTP", (("num_nextn_predict_layers", 3), ("use_mtp_vanilla", True)), "MTP", 3),
        ('{"decoding_type": "MTP", "mtp_eagle_one_model": false}', "MTP", (("mtp_eagle_one_model", False),),
         "MTP_EAGLE", 1),
    ],
)
def test_served_configs_and_their_modes(text: str, decoding_type: str, fields: tuple[tuple[str, object], ...],
                                        mode: str, draft_len: int) -> None:
    config = parse_speculative_config(text)
    assert config == SpeculativeConfig(decoding_type, fields)
    assert (config.mode, config.draft_len) == (mode, draft_len)


@pytest.mark.parametrize("text", ["", "  "])
def test_empty_is_no_speculation(text: str) -> None:
    assert parse_speculative_config(text) is None


P = "^trtllm_speculative_config: "


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("{", P + r"not JSON \(Expecting property name enclosed in double quotes at column 2\)$"),
        ('["NGram"]', P + "must be a JSON object with decoding_type, got list$"),
        ('{"max_draft_len": 4}', P + r"decoding_type must be one of Eagle, Eagle3, DraftTarget, NGram, MTP, got null$"),
        ('{"decoding_type": "ngram"}', P + 'decoding_type must be one of .*, got "ngram"$'),
        ('{"decoding_type": "Medusa"}', P + "decoding_type Medusa runs on TensorRT-LLM's TensorRT engine backend only"),
        ('{"decoding_type": "AUTO"}', P + "decoding_type AUTO is resolved inside the executor"),
        ('{"decoding_type": "UserProvided"}', P + "decoding_type UserProvided needs a Python Drafter object"),
        ('{"decoding_type": "SaveState"}', P + "decoding_type SaveState saves hidden states"),
        ('{"decoding_type": "NGram", "max_draft_len": 4}', P + "decoding_type NGram needs max_matching_ngram_size$"),
        ('{"decoding_type": "Eagle"}', P + "decoding_type Eagle needs max_draft_len, speculative_model_dir$"),
        ('{"decoding_type": "NGram", "max_draft_len": 17, "max_matching_ngram_size": 2}',
         P + "max_draft_len must be an integer in 1..16, got 17$"),
        ('{"decoding_type": "NGram", "max_draft_len": true, "max_matching_ngram_size": 2}',
         P + "max_draft_len must be an integer in 1..16, got true$"),
        ('{"decoding_type": "NGram", "max_draft_len": 4, "max_matching_ngram_size": 0}',
         P + "max_matching_ngram_size must be an integer >= 1, got 0$"),
        ('{"decoding_type": "NGram", "max_draft_len": 4, "max_matching_ngram_size": 2, "is_keep_all": "yes"}',
         P + 'is_keep_all must be true or false, got "yes"$'),
        ('{"decoding_type": "NGram", "max_draft_len": 4, "max_matching_ngram_size": 2, "prompt_lookup": 1}',
         P + "decoding_type NGram takes is_keep_all, is_public_pool, is_use_oldest, max_concurrency, max_draft_len, "
             "max_matching_ngram_size, not prompt_lookup$"),
        ('{"decoding_type": "NGram", "max_draft_len": 4, "max_matching_ngram_size": 2, "speculative_model": "/m"}',
         P + "decoding_type NGram takes .*, not speculative_model$"),
        ('{"decoding_type": "Eagle", "max_draft_len": 3, "speculative_model": "/m", "speculative_model_dir": "/m"}',
         P + "give the draft model once, as speculative_model_dir or speculative_model$"),
        ('{"decoding_type": "Eagle", "max_draft_len": 3, "speculative_model": "/m", "eagle_choices": [[0]]}',
         P + "eagle_choices is not taken: an Eagle tree's draft rows are not one chain"),
        ('{"decoding_type": "Eagle", "max_draft_len": 3, "speculative_model": "/m", "use_dynamic_tree": true}',
         P + "use_dynamic_tree is not taken"),
        ('{"decoding_type": "Eagle", "max_draft_len": 3, "speculative_model": ""}',
         P + 'speculative_model must be a non-empty string, got ""$'),
        ('{"decoding_type": "Eagle", "max_draft_len": 3, "speculative_model": "/m", "eagle3_layers_to_capture": [-1]}',
         P + r"eagle3_layers_to_capture must be a list of non-negative integers, got \[-1\]$"),
        ('{"decoding_type": "MTP", "max_draft_len": 3}', P + "decoding_type MTP takes .*, not max_draft_len$"),
        ('{"decoding_type": "MTP", "num_nextn_predict_layers": 0}',
         P + "num_nextn_predict_layers must be an integer in 1..16, got 0$"),
        ('{"decoding_type": "NGram", "max_draft_len": 4, "max_matching_ngram_size": 2, "max_total_draft_tokens": 4}',
         P + "max_total_draft_tokens is not taken: is derived by TensorRT-LLM"),
    ],
)
def test_refused_configs_name_the_key(text: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_speculative_config(text)


# -- build(): the config object, against stand-ins of the two field spellings ---------------------------------------
class _Base(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_draft_len: int | None = None
    max_concurrency: int | None = None


class _NGramConfig(_Base):
    max_matching_ngram_size: int = 0
    is_keep_all: bool = True
    is_use_oldest: bool = True
    is_public_pool: bool = True

    @model_validator(mode="after")
    def _check(self) -> _NGramConfig:
        if not self.max_draft_len or self.max_draft_len > 8:  # a stand-in rule, to see TensorRT-LLM's own refusal
            raise ValueError("max_draft_len must be > 0 for NGram")
        return self


class _EagleOld(_Base):
    speculative_model_dir: str | None = None
    eagle3_one_model: bool = True


class _EagleNew(_Base):
    speculative_model: str | None = None
    eagle3_one_model: bool = True


def _llmapi(**classes: type) -> types.ModuleType:
    module = types.ModuleType("tensorrt_llm.llmapi")
    for name, cls in classes.items():
        setattr(module, name, cls)
    return module


@pytest.mark.parametrize(("cls", "key"), [(_EagleOld, "speculative_model_dir"), (_EagleNew, "speculative_model")])
def test_build_passes_the_draft_model_under_the_installed_name(tmp_path: Path, cls: type, key: str) -> None:
    config = parse_speculative_config(
        f'{{"decoding_type": "Eagle", "max_draft_len": 3, "speculative_model": "{tmp_path}", "eagle3_one_model": false}}')
    assert config is not None
    built = config.build(_llmapi(EagleDecodingConfig=cls))
    assert built == cls(**{"max_draft_len": 3, key: str(tmp_path), "eagle3_one_model": False})


def test_build_takes_eagle3_class_where_installed(tmp_path: Path) -> None:
    class _Eagle3(_EagleNew):
        pass

    config = parse_speculative_config(f'{{"decoding_type": "Eagle3", "max_draft_len": 2, "speculative_model": "{tmp_path}"}}')
    assert config is not None
    assert type(config.build(_llmapi(EagleDecodingConfig=_EagleNew, Eagle3DecodingConfig=_Eagle3))) is _Eagle3
    assert type(config.build(_llmapi(EagleDecodingConfig=_EagleNew))) is _EagleNew


@pytest.mark.parametrize(
    ("text", "classes", "match"),
    [
        (NGRAM, {}, r"^trtllm_speculative_config: tensorrt_llm\.llmapi has no NGramDecodingConfig \(decoding_type NGram\)$"),
        ('{"decoding_type": "NGram", "max_draft_len": 4, "max_matching_ngram_size": 2, "max_concurrency": 8}',
         {"NGramDecodingConfig": type("_Older", (BaseModel,), {"__annotations__": {"max_draft_len": int}})},
         ("^trtllm_speculative_config: the installed TensorRT-LLM's NGramDecodingConfig has no field "
         r"max_concurrency, max_matching_ngram_size \(its fields: max_draft_len\)$")),
        ('{"decoding_type": "NGram", "max_draft_len": 9, "max_matching_ngram_size": 2}',
         {"NGramDecodingConfig": _NGramConfig},
         r"(?s)^trtllm_speculative_config: TensorRT-LLM refuses NGramDecodingConfig\(.*max_draft_len must be > 0 for NGram"),
        ('{"decoding_type": "Eagle", "max_draft_len": 3, "speculative_model": "/no/such/folder"}',
         {"EagleDecodingConfig": _EagleNew},
         "^trtllm_speculative_config: the draft model folder '/no/such/folder' does not exist$"),
    ],
)
def test_build_refusals(text: str, classes: dict[str, type], match: str) -> None:
    config = parse_speculative_config(text)
    assert config is not None
    with pytest.raises(ConfigError, match=match) as caught:
        config.build(_llmapi(**classes))
    if "refuses" in match:
        assert isinstance(caught.value.__cause__, ValueError)


def test_build_ngram() -> None:
    config = parse_speculative_config(NGRAM)
    assert config is not None
    assert config.build(_llmapi(NGramDecodingConfig=_NGramConfig)) == _NGramConfig(max_draft_len=4,
                                                                                 max_matching_ngram_size=2)


# -- where the setting is checked: before the model loads -------------------------------------------------------
@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"engine": "torch", "trtllm_speculative_config": NGRAM},
         (r"^llm: trtllm_speculative_config applies to engine 'tensorrt_llm' only \(the torch engine's speculation is "
         r"draft_tokens\)$")),
        ({"engine": "tensorrt_llm", "trtllm_speculative_config": '{"decoding_type": "NGram"}'},
         "^trtllm_speculative_config: decoding_type NGram needs max_draft_len, max_matching_ngram_size$"),
        ({"engine": "tensorrt_llm", "trtllm_sampler": "TRTLLMSampler",
          "trtllm_speculative_config": '{"decoding_type": "MTP"}'},
         "^trtllm_sampler: TensorRT-LLM 1.2.1 does not run TRTLLMSampler with decoding_type MTP"),
    ],
)
def test_llm_model_config_checks_it_before_loading(fields: dict[str, str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        LlmModelConfig(model_dir="m", **fields)  # type: ignore[arg-type]


@pytest.mark.parametrize("grammar_mode", ["processor", "native"])
@pytest.mark.parametrize("text", [NGRAM, '{"decoding_type": "MTP"}',
                                  '{"decoding_type": "Eagle", "max_draft_len": 3, "speculative_model": "/m"}'])
def test_served_in_both_grammar_modes(grammar_mode: str, text: str) -> None:
    config = LlmModelConfig(model_dir="m", engine="tensorrt_llm", grammar_mode=grammar_mode,
                            trtllm_speculative_config=text).trtllm_config()
    assert config == TrtllmConfig(model_dir="m", max_batch=16, max_seq_len=2048, grammar_mode=grammar_mode,
                                  speculative=parse_speculative_config(text))
