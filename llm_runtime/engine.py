"""The PyTorch decode engine: a local Hugging Face causal LM with a slot-based KV cache.

Cache layout
------------
Every live sequence owns one *slot* of a preallocated per-layer key/value buffer
``[max_batch_size, kv_heads, capacity, head_dim]``.  Live sequences always occupy
slots ``0 .. B-1`` (a sequence that leaves is replaced by the one in the last
slot, a single copy of that sequence's cache), so the keys a decode step attends
to are the *view* ``buffer[:B, :, :L]`` (``L`` = longest live sequence + 1): no
per-step copy.  Sequences of different lengths share the step through a boolean
attention mask ``[B, 1, 1, L]`` and per-row position ids; the new token's key and
value are scattered into ``buffer[row, :, length[row]]``.

The alternative, one ``transformers.DynamicCache`` per sequence merged (padded and
concatenated) for every step and split afterwards, copies the whole live cache
twice per step, and that copy grows with the cached length; the slot layout's
only per-step copies are the B new key/value rows (``python bench/kv_cache_bench.py
build/models/smollm2-135m-instruct --threads 1 --prompt 400``: 159 against 224 ms
per decode step; every length in docs/benchmarks.md).

The model runs with ``attn_implementation="sdpa"``: with one query token,
transformers packs grouped-query heads (``pack_gqa``) instead of repeating the
key/value heads, so the strided cache view goes straight into
``scaled_dot_product_attention``.  Models with sliding-window or linear-attention
layers are refused (:class:`grammar_backend.errors.ConfigError`): their caches
are not plain full-attention caches.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM
from transformers.cache_utils import Cache

from .checkpoint import checkpoint_end_tokens
from .errors import EngineError, RequestError, config_error

__all__ = ["Engine", "TorchEngine", "TorchEngineConfig", "checkpoint_end_tokens"]

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(frozen=True)
class TorchEngineConfig:
    """Settings of :class:`TorchEngine`.

    Attributes
    ----------
    device : str
        ``"cpu"`` or ``"cuda"`` (``"cuda:N"`` accepted).
    dtype : str
        ``"float32"`` (default; the CPU path), ``"bfloat16"`` or ``"float16"``.
    max_batch_size : int
        Number of KV-cache slots = most sequences decoded together.
    max_seq_len : int
        Longest sequence (prompt + generated) a slot holds; at most the model's
        ``max_position_embeddings``.
    initial_cache_len : int
        Initial slot length; the buffers double (up to ``max_seq_len``) when a
        sequence outgrows them, so memory follows the longest live sequence.
    num_threads : int or None
        ``torch.set_num_threads`` value (process-wide); ``None`` leaves it alone.
        Measure on the target machine (``bench/kv_cache_bench.py MODEL_DIR
        --threads N``, then served with ``bench/e2e_bench.py``): on a 2-core
        machine shared with other processes OpenMP's spinning workers lose
        their cores to the other processes and to the grammar worker thread,
        and the served default (``TORCH_THREADS`` 2) was chosen end to end
        (docs/benchmarks.md).
    """

    # No defaults: LlmModelConfig (max_batch, max_seq_len) holds the one default of each.
    max_batch_size: int
    max_seq_len: int
    device: str = "cpu"
    dtype: str = "float32"
    initial_cache_len: int = 256
    num_threads: int | None = None

    def __post_init__(self) -> None:
        if not (self.device == "cpu" or self.device == "cuda" or self.device.startswith("cuda:")):
            raise config_error("engine.device", f"must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.dtype not in _DTYPES:
            raise config_error("engine.dtype", f"must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        for name in ("max_batch_size", "max_seq_len", "initial_cache_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise config_error(f"engine.{name}", f"must be a positive integer, got {value!r}")
        if self.num_threads is not None and (
            not isinstance(self.num_threads, int) or isinstance(self.num_threads, bool) or self.num_threads < 1
        ):
            raise config_error("engine.num_threads", f"must be a positive integer or None, got {self.num_threads!r}")


class Engine(Protocol):
    """What :class:`llm_runtime.scheduler.Scheduler` needs from an engine.

    ``prefill`` registers a sequence and returns the logits of its first generated
    token (``prefill_batch``: several, in one forward; ``prefill_chunk``: one
    prompt over several forwards); ``decode`` runs ONE forward for every live
    sequence; ``release`` frees a sequence's cache.  Logits are float32
    ``[.., vocab_size]`` on :attr:`device`.
    """

    @property
    def vocab_size(self) -> int: ...
    @property
    def eos_token_ids(self) -> frozenset[int]: ...
    @property
    def max_batch_size(self) -> int: ...
    @property
    def max_seq_len(self) -> int: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def tokenizer(self) -> Tokenizer: ...
    def prefill(self, seq_id: int, prompt_ids: Sequence[int] | np.ndarray) -> torch.Tensor: ...
    def prefill_batch(
        self, seq_ids: Sequence[int], prompts: Sequence[Sequence[int] | np.ndarray]
    ) -> torch.Tensor: ...
    def prefill_chunk(self, seq_id: int, prompt_ids: Sequence[int] | np.ndarray, stop: int) -> torch.Tensor | None: ...
    def decode(self, seq_ids: Sequence[int], tokens: Sequence[int] | np.ndarray) -> torch.Tensor: ...
    def extend(self, seq_ids: Sequence[int], tokens: np.ndarray, counts: np.ndarray | None,
               every: bool = False) -> torch.Tensor: ...
    def release(self, seq_id: int) -> None: ...
    def truncate(self, seq_id: int, length: int) -> None: ...
    def length(self, seq_id: int) -> int: ...


class _SlotKVCache(Cache):
    """Per-layer key/value slot buffers, written in place by the model's attention.

    One instance serves every forward; :meth:`set_prefill` / :meth:`set_decode` tell
    the next forward where to write and what to return.  Buffers are allocated on
    the first ``update`` of each layer (shapes come from the model's own key
    states, so any head layout works) and zero-filled: masked positions are
    multiplied by an attention weight of exactly 0, which is only harmless for
    finite values.
    """

    def __init__(self, num_slots: int, capacity: int, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__(layers=[])
        self._num_slots = num_slots
        self._capacity = capacity
        self._device = device
        self._dtype = dtype
        self._keys: list[torch.Tensor] = []
        self._values: list[torch.Tensor] = []
        self._decode = False
        self._prefill_slots: list[int] = []
        self._prefill_lens: list[int] = []
        self._prefill_width = 0
        self._batch = 0
        self._ctx = 0
        self._first = 0
        self._rows = torch.zeros(0, dtype=torch.long)
        self._pos = torch.zeros(0, dtype=torch.long)

    @property
    def capacity(self) -> int:
        return self._capacity

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self._keys, *self._values))

    def ensure_capacity(self, length: int) -> None:
        """Grow every slot to hold ``length`` positions (doubling; one copy per growth)."""
        if length <= self._capacity:
            return
        new_cap = max(length, 2 * self._capacity)
        for store in (self._keys, self._values):
            for i, old in enumerate(store):
                grown = torch.zeros(
                    (old.shape[0], old.shape[1], new_cap, old.shape[3]), dtype=old.dtype, device=old.device
                )
                grown[:, :, : self._capacity].copy_(old)
                store[i] = grown
        self._capacity = new_cap

    def set_prefill(self, slots: list[int], lengths: list[int], width: int) -> None:
        """The next forward prefills left-padded prompts: row ``i`` holds ``lengths[i]``
        tokens at the end of ``width`` positions, for slot ``slots[i]``."""
        self._decode = False
        self._prefill_slots = slots
        self._prefill_lens = lengths
        self._prefill_width = width

    def set_decode(self, batch: int, rows: torch.Tensor, pos: torch.Tensor, ctx: int, first: int = 0) -> None:
        """The next forward feeds ``pos.shape[1]`` tokens per row: row ``i``'s
        token ``j`` goes to slot ``rows[i, 0]`` at position ``pos[i, j]``; the
        rows attend to slots ``first .. first + batch - 1``."""
        self._decode = True
        self._batch = batch
        self._rows = rows
        self._pos = pos
        self._ctx = ctx
        self._first = first

    def move_slot(self, src: int, dst: int, length: int) -> None:
        for store in (self._keys, self._values):
            for buf in store:
                buf[dst, :, :length].copy_(buf[src, :, :length])

    def update(  # type: ignore[override]
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx == len(self._keys):
            shape = (self._num_slots, key_states.shape[1], self._capacity, key_states.shape[3])
            self._keys.append(torch.zeros(shape, dtype=self._dtype, device=self._device))
            vshape = (self._num_slots, value_states.shape[1], self._capacity, value_states.shape[3])
            self._values.append(torch.zeros(vshape, dtype=self._dtype, device=self._device))
        elif layer_idx > len(self._keys):
            raise EngineError(f"cache layer {layer_idx} updated before layer {len(self._keys)}")
        keys = self._keys[layer_idx]
        values = self._values[layer_idx]
        if self._decode:
            # [B, H, K, D] -> [B, K, H, D]: the layout of the advanced-index target.
            keys[self._rows, :, self._pos] = key_states.transpose(1, 2)
            values[self._rows, :, self._pos] = value_states.transpose(1, 2)
            lo, hi = self._first, self._first + self._batch
            return keys[lo:hi, :, : self._ctx], values[lo:hi, :, : self._ctx]
        # Prefill attends within the prompts only: the batch's own keys, while each
        # row's real positions (the last lengths[i] of the padded width) go to its slot.
        w = self._prefill_width
        for i, (slot, t) in enumerate(zip(self._prefill_slots, self._prefill_lens, strict=True)):
            keys[slot, :, :t] = key_states[i, :, w - t :]
            values[slot, :, :t] = value_states[i, :, w - t :]
        return key_states, value_states


def _as_id_list(ids: Any) -> list[int]:
    if isinstance(ids, int):
        return [ids]
    if isinstance(ids, (list, tuple)):
        return [int(x) for x in ids]
    return [int(x) for x in np.asarray(ids).reshape(-1)]


class TorchEngine:
    """A local Hugging Face causal LM decoding many sequences in one batched forward.

    Parameters
    ----------
    model_dir : str or Path
        A local checkpoint folder (``config.json``, weights, ``tokenizer.json``);
        loaded with ``local_files_only=True``: nothing is downloaded.
    config : TorchEngineConfig
        Device, dtype, slot count and lengths.

    Raises
    ------
    grammar_backend.errors.ConfigError
        If the folder is missing or not loadable, has no ``tokenizer.json`` or no
        end token, the model has non-full-attention layers, or ``max_seq_len``
        exceeds the model's ``max_position_embeddings``.

    Notes
    -----
    Not thread-safe: one thread (the scheduler loop) drives it.
    """

    def __init__(self, model_dir: str | Path, config: TorchEngineConfig) -> None:
        cfg = config
        self._config = cfg
        path = Path(model_dir)
        if not path.is_dir():
            raise config_error("model_dir", f"{str(path)!r} is not a directory")
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise config_error("model_dir", f"{str(path)!r} has no tokenizer.json")
        if cfg.num_threads is not None:
            torch.set_num_threads(cfg.num_threads)
        dtype = _DTYPES[cfg.dtype]
        device = torch.device(cfg.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise config_error("engine.device", "CUDA was requested but torch.cuda.is_available() is False")
        try:
            model = AutoModelForCausalLM.from_pretrained(
                str(path), local_files_only=True, dtype=dtype, attn_implementation="sdpa"
            )
        except (OSError, ValueError, KeyError) as err:
            raise config_error("model_dir", f"cannot load a causal LM from {str(path)!r}: {err}") from err
        model.eval()
        torch.nn.Module.to(model, device)  # (transformers types its own `to` wrapper too narrowly)
        mcfg = model.config
        layer_types = getattr(mcfg, "layer_types", None)
        if layer_types is not None and any(t != "full_attention" for t in layer_types):
            raise config_error("model_dir", f"layer types {sorted(set(layer_types))} are not supported (full attention only)")
        if getattr(mcfg, "use_sliding_window", False) and getattr(mcfg, "sliding_window", None):
            raise config_error("model_dir", "sliding-window attention is not supported (full attention only)")
        max_pos = getattr(mcfg, "max_position_embeddings", None)
        if isinstance(max_pos, int) and cfg.max_seq_len > max_pos:
            raise config_error(
                "engine.max_seq_len", f"{cfg.max_seq_len} exceeds the model's max_position_embeddings {max_pos}"
            )
        params = inspect.signature(model.forward).parameters
        if "cache" in params:
            self._cache_kw = "cache"
        elif "past_key_values" in params:
            self._cache_kw = "past_key_values"
        else:
            raise config_error("model_dir", f"{type(model).__name__}.forward takes no cache argument")
        if "logits_to_keep" not in params:
            raise config_error("model_dir", f"{type(model).__name__}.forward has no logits_to_keep argument")
        out_emb = model.get_output_embeddings()
        if out_emb is None:
            raise config_error("model_dir", f"{type(model).__name__} has no output embeddings")
        self._vocab_size = int(out_emb.weight.shape[0])

        self._eos = checkpoint_end_tokens(path)
        self._tokenizer = Tokenizer.from_file(str(tok_file))
        self._model = model
        self._device = device
        self._dtype = dtype
        self._path = path

        s = cfg.max_batch_size
        self._cache = _SlotKVCache(s, min(cfg.initial_cache_len, cfg.max_seq_len), device, dtype)
        self._slot_of: dict[int, int] = {}
        self._seq_at: list[int] = []  # slot -> seq id, for slots 0 .. live-1
        self._lengths = np.zeros(s, dtype=np.int64)  # cached tokens per slot
        # The one prompt being prefilled in chunks (prefill_chunk): its id, its checked tokens and how
        # many of them are cached.  It waits in the last slot, which no live sequence reaches while it
        # does (it holds one of the max_batch_size slots), and moves to its live slot when complete.
        self._partial: tuple[int, np.ndarray, int] | None = None
        self._arange = torch.arange(cfg.max_seq_len + 1, device=device)
        self._rows = torch.arange(s, device=device)

    # -- properties ---------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Width of the logits (the model's padded vocabulary)."""
        return self._vocab_size

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """End tokens from ``generation_config.json`` and ``config.json``."""
        return self._eos

    @property
    def max_batch_size(self) -> int:
        return self._config.max_batch_size

    @property
    def max_seq_len(self) -> int:
        return self._config.max_seq_len

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def tokenizer(self) -> Tokenizer:
        """The checkpoint's ``tokenizer.json`` as a :class:`tokenizers.Tokenizer`."""
        return self._tokenizer

    @property
    def model(self) -> torch.nn.Module:
        return self._model  # type: ignore[no-any-return]

    @property
    def live_count(self) -> int:
        return len(self._seq_at)

    @property
    def cache_bytes(self) -> int:
        """Bytes held by the KV slot buffers."""
        return self._cache.nbytes()

    def length(self, seq_id: int) -> int:
        """Number of cached tokens of ``seq_id``."""
        return int(self._lengths[self._slot(seq_id)])

    def _slot(self, seq_id: int) -> int:
        try:
            return self._slot_of[seq_id]
        except KeyError as err:
            raise EngineError(f"sequence {seq_id} is not live in the engine") from err

    def _forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor,
                 keep: torch.Tensor | int | None = None) -> torch.Tensor:
        """Logits of the last position (``[B, V]``), or of positions ``keep`` (``[B, len(keep), V]``;
        ``0``: every position, ``[B, K, V]``)."""
        kwargs: dict[str, Any] = {
            "input_ids": input_ids,
            "position_ids": position_ids,
            "attention_mask": mask,
            self._cache_kw: self._cache,
            "use_cache": True,
            "logits_to_keep": 1 if keep is None else keep,
        }
        out = self._model(**kwargs)
        logits: torch.Tensor = out.logits[:, -1, :] if keep is None else out.logits
        if logits.dtype != torch.float32:
            logits = logits.float()
        return logits

    # -- operations ---------------------------------------------------------
    def prefill(self, seq_id: int, prompt_ids: Sequence[int] | np.ndarray) -> torch.Tensor:
        """Register ``seq_id``, run its prompt, and return the next-token logits.

        Parameters
        ----------
        seq_id : int
            A sequence id not live in the engine.
        prompt_ids : sequence of int
            The prompt tokens (at least one, at most ``max_seq_len``).

        Returns
        -------
        torch.Tensor
            float32 ``[vocab_size]`` logits of the first generated token.

        Raises
        ------
        EngineError
            If ``seq_id`` is live or every slot is taken.
        RequestError
            If the prompt is empty, too long, or has an id outside the vocabulary.
        """
        return self.prefill_batch([seq_id], [prompt_ids])[0]

    @torch.no_grad()
    def prefill_batch(
        self, seq_ids: Sequence[int], prompts: Sequence[Sequence[int] | np.ndarray]
    ) -> torch.Tensor:
        """Register sequences and run their prompts in ONE forward.

        The prompts are left-padded to the longest, so every row's last real
        token sits in the last position (one row of logits each); padded
        positions attend only to themselves (a fully masked row would turn
        into NaN and reach the real rows through the next layer's values) and
        are never written to the cache.  One forward for the prompts that join
        together cut time to first token p50 at 8 streams from 786 to 598 ms
        constrained (``bench/e2e_bench.py --rounds 2 --max-tokens 32``, SmolLM2;
        docs/benchmarks.md, batched prefill).

        Parameters
        ----------
        seq_ids : sequence of int
            Sequence ids not live in the engine, each once.
        prompts : sequence of sequence of int
            ``prompts[i]`` for ``seq_ids[i]`` (each at least one, at most ``max_seq_len`` tokens).

        Returns
        -------
        torch.Tensor
            float32 ``[len(seq_ids), vocab_size]``: row ``i`` holds the logits of
            ``seq_ids[i]``'s first generated token.

        Raises
        ------
        EngineError
            If an id is live or repeated, or the slots do not suffice.
        RequestError
            If a prompt is empty, too long, or has an id outside the vocabulary
            (nothing is registered then).
        """
        ids_list = [int(s) for s in seq_ids]
        n = len(ids_list)
        if n == 0 or n != len(prompts):
            raise EngineError(f"prefill_batch needs one prompt per sequence, got {n} ids and {len(prompts)} prompts")
        if len(set(ids_list)) != n or any(s in self._slot_of for s in ids_list):
            raise EngineError("prefill_batch got a sequence id twice or one already live in the engine")
        first = len(self._seq_at)
        if first + n + (self._partial is not None) > self._config.max_batch_size:
            raise EngineError(f"all {self._config.max_batch_size} cache slots are taken")
        if self._partial is not None and self._partial[0] in ids_list:
            raise EngineError(f"sequence {self._partial[0]} is being prefilled in chunks")
        arrays = [self._checked_prompt(p) for p in prompts]
        lengths = [int(a.shape[0]) for a in arrays]
        w = max(lengths)
        self._cache.ensure_capacity(w)
        host = np.zeros((n, w), dtype=np.int64)
        offsets = np.array([w - t for t in lengths], dtype=np.int64)
        for i, a in enumerate(arrays):
            host[i, offsets[i]:] = a
            host[i, : offsets[i]] = a[0]  # any valid id: padded positions never reach a real row
        input_ids = torch.from_numpy(host).to(self._device)
        off = torch.from_numpy(offsets).to(self._device).view(n, 1)
        pos = self._arange[:w].view(1, w)
        position_ids = (pos - off).clamp_(min=0)
        q = pos.view(1, w, 1)
        k = pos.view(1, 1, w)
        mask = ((k <= q) & (k >= off.view(n, 1, 1))) | (k == q)
        slots = list(range(first, first + n))
        self._cache.set_prefill(slots, lengths, w)
        logits = self._forward(input_ids, position_ids, mask.view(n, 1, w, w))
        for seq_id, slot, t in zip(ids_list, slots, lengths, strict=True):
            self._slot_of[seq_id] = slot
            self._seq_at.append(seq_id)
            self._lengths[slot] = t
        return logits

    def _checked_prompt(self, prompt_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """The prompt as int64 ``[T]``, or RequestError naming what is wrong with it."""
        ids = np.asarray(prompt_ids, dtype=np.int64).reshape(-1)
        t = int(ids.shape[0])
        if t == 0:
            raise RequestError("prompt_token_ids", "must not be empty")
        if t > self._config.max_seq_len:
            raise RequestError("prompt_token_ids", f"{t} tokens exceed max_seq_len {self._config.max_seq_len}")
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self._vocab_size:
            raise RequestError("prompt_token_ids", f"ids must be in [0, {self._vocab_size}), got [{lo}, {hi}]")
        return ids

    @torch.no_grad()
    def prefill_chunk(self, seq_id: int, prompt_ids: Sequence[int] | np.ndarray, stop: int) -> torch.Tensor | None:
        """Run the next part of a long prompt: its tokens from what is cached up to ``stop``.

        A prompt prefilled in one forward holds every decoding sequence for
        that whole forward (seconds for 1,000 tokens of SmolLM2-135M on a CPU,
        where prefill costs the same per token at any chunk size:
        docs/benchmarks.md, chunked prefill).
        In chunks, the scheduler runs a decode step between two of them.
        The first call registers ``seq_id`` (not live until its last chunk
        ran); each later call continues where the last stopped, attending to
        the positions cached before.

        Parameters
        ----------
        seq_id : int
            A sequence not live in the engine: the one being prefilled in
            chunks, or (no chunk ran yet) a new one.
        prompt_ids : sequence of int
            The whole prompt, the same at every call (checked at the first).
        stop : int
            How many of its tokens are cached after this call
            (more than now, at most the prompt's length).

        Returns
        -------
        torch.Tensor or None
            float32 ``[vocab_size]`` logits of the first generated token once
            ``stop`` reaches the prompt's end (``seq_id`` is then live, as
            after :meth:`prefill`); None before.

        Raises
        ------
        EngineError
            If another prompt is being prefilled in chunks, ``seq_id`` is live,
            no slot is free, or ``stop`` is out of range (nothing changes).
        RequestError
            If the prompt is empty, too long, or has an id outside the vocabulary.
        """
        partial = self._partial
        if partial is None:
            if seq_id in self._slot_of:
                raise EngineError(f"sequence {seq_id} is live in the engine")
            if len(self._seq_at) >= self._config.max_batch_size:
                raise EngineError(f"all {self._config.max_batch_size} cache slots are taken")
            prompt, done = self._checked_prompt(prompt_ids), 0
        elif partial[0] != seq_id:
            raise EngineError(f"sequence {partial[0]} is being prefilled in chunks, not {seq_id}")
        else:
            _, prompt, done = partial
            if len(prompt_ids) != prompt.shape[0]:
                raise EngineError(f"sequence {seq_id}: its prompt changed between chunks")
        total = int(prompt.shape[0])
        if not done < stop <= total:
            raise EngineError(f"sequence {seq_id}: chunk end {stop} is not in {done + 1}..{total}")
        slot = self._config.max_batch_size - 1
        k = stop - done
        self._partial = None  # a failed forward leaves nothing registered
        self._cache.ensure_capacity(stop)
        input_ids = torch.from_numpy(prompt[done:stop]).to(self._device).view(1, k)
        pos = self._arange[done:stop].view(1, k)
        mask = (self._arange[:stop].view(1, 1, stop) <= pos.view(1, k, 1)).view(1, 1, k, stop)
        self._cache.set_decode(1, self._rows[slot:slot + 1].view(1, 1), pos, stop, first=slot)
        logits = self._forward(input_ids, pos, mask)
        if stop < total:
            self._partial = (seq_id, prompt, stop)
            return None
        live = len(self._seq_at)
        if live != slot:
            self._cache.move_slot(slot, live, total)
        self._slot_of[seq_id] = live
        self._seq_at.append(seq_id)
        self._lengths[live] = total
        return logits[0]

    @torch.no_grad()
    def decode(self, seq_ids: Sequence[int], tokens: Sequence[int] | np.ndarray) -> torch.Tensor:
        """Feed one token to every live sequence in ONE forward.

        Parameters
        ----------
        seq_ids : sequence of int
            Every live sequence, each once, in any order.
        tokens : sequence of int
            ``tokens[i]`` is the last sampled token of ``seq_ids[i]``.

        Returns
        -------
        torch.Tensor
            float32 ``[len(seq_ids), vocab_size]``; row ``i`` belongs to ``seq_ids[i]``.

        Raises
        ------
        EngineError
            If ``seq_ids`` is not exactly the live set or a sequence is full.
        """
        toks = np.asarray(tokens, dtype=np.int64).reshape(-1, 1)
        return self.extend(seq_ids, toks, None)

    @torch.no_grad()
    def extend(self, seq_ids: Sequence[int], tokens: np.ndarray, counts: np.ndarray | None,
               every: bool = False) -> torch.Tensor:
        """Feed one or more tokens to every live sequence in ONE forward (jump-forward, speculation).

        Rows are right-padded to the longest: a padded position is written to
        the row's cache past its length, where the attention mask hides it
        until a real token overwrites it, so it never reaches a real row.  The
        padding is paid by every row (the step times by width: docs/benchmarks.md,
        jump-forward; :class:`~llm_runtime.grammar_phase.JumpPolicy` measures
        them while serving).

        Parameters
        ----------
        seq_ids : sequence of int
            Every live sequence, each once, in any order.
        tokens : np.ndarray
            int ``[B, K]``; row ``i``'s first ``counts[i]`` entries are fed to ``seq_ids[i]``.
        counts : np.ndarray or None
            int ``[B]``, each in ``1..K``; ``None``: every row feeds ``K`` tokens.
        every : bool
            Return the logits after every fed position (speculation verifies
            each draft), not only after each row's last token.

        Returns
        -------
        torch.Tensor
            float32 ``[B, vocab_size]``: row ``i`` holds the logits after
            ``seq_ids[i]``'s last fed token; with ``every``, ``[B, K,
            vocab_size]``: ``[i, j]`` after its token ``j`` (padded positions'
            logits are meaningless).  A sequence that keeps fewer of the fed
            tokens (rejected drafts) is :meth:`truncate`-d after.

        Raises
        ------
        EngineError
            If ``seq_ids`` is not exactly the live set, the shapes or counts do
            not fit, or a sequence would pass ``max_seq_len``.
        """
        ids = _as_id_list(seq_ids)
        b = len(ids)
        if b != len(self._seq_at) or b == 0:
            raise EngineError(f"decode needs every live sequence ({len(self._seq_at)}), got {b}")
        toks = np.asarray(tokens, dtype=np.int64)
        if toks.ndim != 2 or toks.shape[0] != b or toks.shape[1] == 0:
            raise EngineError(f"decode got tokens of shape {toks.shape} for {b} sequences")
        k = int(toks.shape[1])
        if counts is not None:
            cnt = np.asarray(counts, dtype=np.int64).reshape(-1)
            if cnt.shape[0] != b or int(cnt.min()) < 1 or int(cnt.max()) > k:
                raise EngineError(f"decode token counts must be {b} values in 1..{k}")
        slots = [self._slot(s) for s in ids]
        in_order = slots == list(range(b))
        if not in_order and len(set(slots)) != b:
            raise EngineError("decode got a sequence id twice")
        lengths = self._lengths[:b]
        host = np.empty((b, k), dtype=np.int64)
        added = np.empty(b, dtype=np.int64)
        if in_order:
            host[:] = toks
            added[:] = k if counts is None else cnt
        else:
            host[slots] = toks
            added[slots] = k if counts is None else cnt
        if int((lengths + added).max()) > self._config.max_seq_len:
            raise EngineError(f"a sequence reached max_seq_len {self._config.max_seq_len}")
        ctx = int(lengths.max()) + k  # padded positions land in the cache too
        self._cache.ensure_capacity(ctx)
        input_ids = torch.from_numpy(host).to(self._device)
        pos = torch.from_numpy(lengths.copy()).to(self._device).view(b, 1) + self._arange[:k].view(1, k)
        mask = (self._arange[:ctx].view(1, 1, ctx) <= pos.view(b, k, 1)).view(b, 1, k, ctx)
        self._cache.set_decode(b, self._rows[:b].view(b, 1), pos, ctx)
        if every:
            logits = self._forward(input_ids, pos, mask, keep=0)
        elif k == 1 or counts is None:
            logits = self._forward(input_ids, pos, mask)
        else:
            # Only each row's last real position reaches the LM head.
            last = torch.from_numpy(added - 1).to(self._device)
            keep, which = torch.unique(last, return_inverse=True)
            all_logits = self._forward(input_ids, pos, mask, keep=keep)
            logits = all_logits[torch.arange(b, device=self._device), which]
        self._lengths[:b] += added
        if in_order:
            return logits
        return logits[torch.tensor(slots, device=self._device)]

    def truncate(self, seq_id: int, length: int) -> None:
        """Keep only the first ``length`` cached positions of ``seq_id`` (a value check dropped tokens).

        The positions past it stay in the slot, hidden by the attention mask
        until the next tokens overwrite them, as padded positions are.

        Raises
        ------
        EngineError
            If ``seq_id`` is not live or ``length`` is not in ``0..length(seq_id)``.
        """
        slot = self._slot(seq_id)
        if not 0 <= length <= int(self._lengths[slot]):
            raise EngineError(f"sequence {seq_id}: cannot truncate {int(self._lengths[slot])} cached tokens "
                              f"to {length}")
        self._lengths[slot] = length

    @torch.no_grad()
    def release(self, seq_id: int) -> None:
        """Free ``seq_id``'s slot (the last live slot moves into it: one cache copy), or drop the
        prompt being prefilled in chunks.

        Raises
        ------
        EngineError
            If ``seq_id`` is neither live nor being prefilled.
        """
        if self._partial is not None and self._partial[0] == seq_id:
            self._partial = None  # its slot is overwritten by the next chunked prompt
            return
        slot = self._slot(seq_id)
        last = len(self._seq_at) - 1
        if slot != last:
            moved = self._seq_at[last]
            self._cache.move_slot(last, slot, int(self._lengths[last]))
            self._seq_at[slot] = moved
            self._slot_of[moved] = slot
            self._lengths[slot] = self._lengths[last]
        self._seq_at.pop()
        del self._slot_of[seq_id]
        self._lengths[last] = 0

    def release_all(self) -> None:
        """Free every slot (after a failed forward, the scheduler starts clean)."""
        self._slot_of.clear()
        self._seq_at.clear()
        self._lengths[:] = 0
        self._partial = None
