"""Measure the KV-cache layout of :class:`llm_runtime.engine.TorchEngine`.

Compares, on the same model, prompts and greedy tokens:

* ``slot``: the engine's slot buffer (the decode step attends to a view of the
  live slots; the new key/value is scattered in place);
* ``merge``: one cache per sequence, merged for every step (left-padded into a
  fresh batch tensor per layer) and split back afterwards (each sequence's cache
  re-materialised with the new position) -- what batching per-sequence
  ``transformers.DynamicCache`` objects costs.

Both paths must produce the same greedy tokens (checked), so the figures compare
equal work.  Run::

    python bench/kv_cache_bench.py MODEL_DIR [--batch 8] [--steps 24] [--prompt 128]
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

import harness  # before the project's packages: it puts the repository root on sys.path
import numpy as np
import torch
from transformers.cache_utils import Cache

from llm_runtime.engine import TorchEngine, TorchEngineConfig


class _MergeCache(Cache):
    """Per-sequence caches merged into a padded batch for one forward, then split."""

    def __init__(self) -> None:
        super().__init__(layers=[])
        self.seq_keys: list[list[torch.Tensor]] = []  # [seq][layer] -> [1, H, len, D]
        self.seq_values: list[list[torch.Tensor]] = []
        self.merged_k: list[torch.Tensor] = []
        self.merged_v: list[torch.Tensor] = []
        self.prefill = True

    def update(  # type: ignore[override]
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.prefill:
            self.seq_keys[-1].append(key_states.clone())
            self.seq_values[-1].append(value_states.clone())
            return key_states, value_states
        k = torch.cat([self.merged_k[layer_idx], key_states], dim=2)
        v = torch.cat([self.merged_v[layer_idx], value_states], dim=2)
        self.merged_k[layer_idx] = k
        self.merged_v[layer_idx] = v
        return k, v

    def merge(self, lengths: list[int]) -> int:
        """Left-pad every sequence's cache into one batch tensor per layer."""
        width = max(lengths)
        self.merged_k.clear()
        self.merged_v.clear()
        for layer in range(len(self.seq_keys[0])):
            ref = self.seq_keys[0][layer]
            k = ref.new_zeros((len(lengths), ref.shape[1], width, ref.shape[3]))
            v = torch.zeros_like(k)
            for i, n in enumerate(lengths):
                k[i, :, width - n :] = self.seq_keys[i][layer][0]
                v[i, :, width - n :] = self.seq_values[i][layer][0]
            self.merged_k.append(k)
            self.merged_v.append(v)
        return width

    def split(self, lengths: list[int]) -> None:
        """Give every sequence back its own cache, one position longer."""
        width = self.merged_k[0].shape[2]
        for layer in range(len(self.merged_k)):
            for i, n in enumerate(lengths):
                self.seq_keys[i][layer] = self.merged_k[layer][i : i + 1, :, width - n - 1 :].clone()
                self.seq_values[i][layer] = self.merged_v[layer][i : i + 1, :, width - n - 1 :].clone()


class _MergeRunner:
    """Greedy decoding of ``prompts`` with per-sequence caches merged for every step."""

    def __init__(self, engine: TorchEngine, prompts: list[list[int]]) -> None:
        self.model = engine.model
        self.cache = _MergeCache()
        self.outs: list[list[int]] = []
        with torch.inference_mode():
            for p in prompts:
                self.cache.seq_keys.append([])
                self.cache.seq_values.append([])
                t = len(p)
                mask = torch.ones((t, t), dtype=torch.bool).tril_().view(1, 1, t, t)
                logits = self.model(
                    input_ids=torch.tensor([p]), position_ids=torch.arange(t).view(1, t), attention_mask=mask,
                    cache=self.cache, use_cache=True, logits_to_keep=1,
                ).logits[0, -1]
                self.outs.append([int(logits.argmax())])
        self.cache.prefill = False
        self.lengths = [len(p) for p in prompts]

    @torch.inference_mode()
    def step(self) -> float:
        t0 = time.perf_counter()
        b = len(self.lengths)
        width = self.cache.merge(self.lengths)
        pos = torch.tensor(self.lengths)
        ar = torch.arange(width + 1)
        mask = (ar.view(1, -1) >= (width - pos).view(-1, 1)).view(b, 1, 1, width + 1)
        logits = self.model(
            input_ids=torch.tensor([[o[-1]] for o in self.outs]), position_ids=pos.view(b, 1), attention_mask=mask,
            cache=self.cache, use_cache=True, logits_to_keep=1,
        ).logits[:, -1]
        self.cache.split(self.lengths)
        elapsed = time.perf_counter() - t0
        for i in range(b):
            self.outs[i].append(int(logits[i].argmax()))
            self.lengths[i] += 1
        return elapsed


class _SlotRunner:
    """Greedy decoding of ``prompts`` through the engine's slot cache."""

    def __init__(self, engine: TorchEngine, prompts: list[list[int]]) -> None:
        self.engine = engine
        self.outs = [[int(engine.prefill(i, p).argmax())] for i, p in enumerate(prompts)]
        self.ids = list(range(len(prompts)))

    def step(self) -> float:
        t0 = time.perf_counter()
        logits = self.engine.decode(self.ids, np.array([o[-1] for o in self.outs]))
        elapsed = time.perf_counter() - t0
        for i in self.ids:
            self.outs[i].append(int(logits[i].argmax()))
        return elapsed


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point; prints a JSON line of figures."""
    ap = harness.bench_parser(__doc__, whole_doc=True)
    harness.add_model_dir(ap, None, positional=True)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--prompt", type=int, default=128, help="shortest prompt; row i adds 15*i tokens")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    engine = TorchEngine(
        args.model_dir,
        TorchEngineConfig(max_batch_size=args.batch, max_seq_len=1024, initial_cache_len=512, num_threads=args.threads),
    )
    rng = np.random.default_rng(0)
    top = min(engine.vocab_size, engine.tokenizer.get_vocab_size())
    prompts = [rng.integers(3, top, size=args.prompt + 15 * i).tolist() for i in range(args.batch)]
    slot = _SlotRunner(engine, prompts)
    merge = _MergeRunner(engine, prompts)
    slot.step()  # warm-up
    merge.step()
    slot_t: list[float] = []
    merge_t: list[float] = []
    # Interleaved, so that load from other processes hits both layouts alike.
    for _ in range(args.steps):
        slot_t.append(slot.step())
        merge_t.append(merge.step())
    result = {
        "batch": args.batch,
        "prompt_lengths": [len(p) for p in prompts],
        "steps": args.steps,
        "threads": torch.get_num_threads(),
        "slot_ms_median": 1e3 * statistics.median(slot_t),
        "merge_ms_median": 1e3 * statistics.median(merge_t),
        "same_tokens": slot.outs == merge.outs,
        "cache_bytes": engine.cache_bytes,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
