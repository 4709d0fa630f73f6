"""The `draft_model` proposer: a smaller model with the target's vocabulary, run by the same engine code
in the same process, drafts K tokens greedily for each speculating sequence.

The draft model only proposes; the target verifies every position exactly (`engine/spec_verify.py`), so
what the draft computes (its numerics, its KV, its greedy choice) changes the acceptance rate and the
speed, never a token or a logprob of the output.

Each target sequence has a shadow sequence in the draft model's own KV pool. Before drafting, the
shadow keeps the longest prefix of its computed tokens that still equals the target's known tokens (a
rejected draft's K/V is simply overwritten later: attention never reads a slot past a row's own
position), then computes the rest of the known tokens in one chunk and decodes K - 1 more tokens one at
a time. Sequences are drafted one after another (no batching across sequences).
"""

from __future__ import annotations

from pathlib import Path

import torch

from deterministic_inference.config import EngineConfig
from deterministic_inference.engine.kv_cache import KVCacheManager
from deterministic_inference.engine.model_runner import ModelRunner
from deterministic_inference.engine.plan import ScheduledChunk, StepPlan
from deterministic_inference.engine.request import Request
from deterministic_inference.engine.sampling_params import SamplingParams
from deterministic_inference.engine.setup import build_model, choose_num_kv_blocks
from deterministic_inference.errors import ConfigError, DetinfError
from deterministic_inference.model.loader import load_model


class DraftModelProposer:
    """Greedy drafts from a smaller model with the same vocabulary (see the module docstring)."""

    def __init__(
        self, path: str, target: EngineConfig, dtype_name: str, vocab_size: int, max_model_len: int
    ) -> None:
        field = "speculative_config.model"
        if not Path(path).expanduser().exists():
            raise ConfigError(
                f"{field}: {path} does not exist; give the draft model's GGUF file or HF directory"
            )
        try:
            loaded = load_model(path)
        except DetinfError as error:
            raise ConfigError(f"{field}: {error}") from None
        if loaded.spec.vocab_size != vocab_size:
            raise ConfigError(
                f"{field}: the draft's vocabulary has {loaded.spec.vocab_size} tokens, the target's "
                f"{vocab_size}; use a draft model with the target's vocabulary"
            )
        # the draft's own cache stays in the model dtype: its proposals never change a bit (kv_cache_dtype)
        config = target.replace(
            model=path, num_kv_blocks=None, speculative_config=None, kv_cache_dtype="auto"
        )
        self.max_model_len = min(max_model_len, loaded.spec.max_position_embeddings)
        model = build_model(loaded, config, dtype_name, self.max_model_len)
        num_blocks = choose_num_kv_blocks(config, loaded.spec, self.max_model_len, dtype_name)
        self.kv = KVCacheManager(num_blocks, config.kv_block_size, False, "draft")
        self.runner = ModelRunner(model, num_blocks, config.kv_block_size)
        self._shadows: dict[str, Request] = {}  # target sequence id -> its shadow in the draft's pool
        self._step = 0

    def propose(self, sequence: Request, count: int) -> list[int]:
        """Up to `count` greedy draft tokens after the sequence's known tokens; [] when the draft's pool
        or context cannot hold them (then the sequence decodes plainly this step)."""
        known = sequence.all_token_ids
        if count < 1 or len(known) + count > self.max_model_len:
            return []
        shadow = self._shadow(sequence.request_id, known)
        drafts: list[int] = []
        pending = known[shadow.num_computed_tokens :]  # tokens the draft has not computed yet
        while len(drafts) < count:
            token = self._next(shadow, pending)
            if token is None:
                return drafts
            drafts.append(token)
            shadow.prompt_token_ids.append(token)
            pending = [token]
        return drafts

    def forget(self, sequence_id: str) -> None:
        """The target sequence finished: free its shadow's blocks."""
        shadow = self._shadows.pop(sequence_id, None)
        if shadow is not None:
            self.kv.free(shadow)

    def _shadow(self, sequence_id: str, known: list[int]) -> Request:
        """The sequence's shadow with its computed tokens cut back to the prefix shared with `known`
        (always leaving at least the last known token to compute, so there is a logits row)."""
        shadow = self._shadows.get(sequence_id)
        if shadow is None:
            shadow = Request(f"draft-{sequence_id}", list(known), SamplingParams(), seed=0)
            self._shadows[sequence_id] = shadow
        computed = shadow.prompt_token_ids[: shadow.num_computed_tokens]
        common = 0
        limit = min(len(computed), len(known) - 1)
        while common < limit and computed[common] == known[common]:
            common += 1
        shadow.num_computed_tokens = common
        shadow.prompt_token_ids = list(known)
        return shadow

    def _next(self, shadow: Request, pending: list[int]) -> int | None:
        """Compute `pending` (the shadow's uncomputed tail) and return the greedy next token."""
        if not self.kv.allocate(shadow, len(pending)):
            return None
        start = shadow.num_computed_tokens
        chunk = ScheduledChunk(
            request_id=shadow.request_id,
            token_ids=tuple(pending),
            start_position=start,
            block_ids=tuple(shadow.block_ids),
            sample=True,
            all_logits=False,
        )
        logits = self.runner.execute(StepPlan(self._step, (chunk,)))[0]  # [1, V] fp32
        self._step += 1
        shadow.num_computed_tokens = start + len(pending)
        if logits is None:
            raise RuntimeError("draft model: a sampled chunk returned no logits row")
        return int(torch.argmax(logits[-1]))
