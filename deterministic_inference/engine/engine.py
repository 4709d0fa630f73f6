"""The engine: add requests, step (schedule -> run -> sample -> update), collect outputs.

One engine step is three calls: `Scheduler.schedule()` builds a `StepPlan`, `ModelRunner.execute()`
computes the logits rows it asks for, the sampler picks tokens, and `Scheduler.update()` advances the
requests. Nothing here reads the wall clock or iterates an unordered collection, so the sequence of
plans is a pure function of the requests added and their order.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from deterministic_inference import fingerprint
from deterministic_inference.config import EngineConfig
from deterministic_inference.engine import sampler
from deterministic_inference.engine.kv_cache import KVCacheManager
from deterministic_inference.engine.model_runner import ModelRunner
from deterministic_inference.engine.outputs import RequestOutput
from deterministic_inference.engine.plan import ScheduledChunk, StepPlan
from deterministic_inference.engine.request import Request, RequestStatus
from deterministic_inference.engine.sampling_params import SamplingParams
from deterministic_inference.engine.scheduler import Scheduler
from deterministic_inference.engine.sequence_state import SequenceState
from deterministic_inference.engine.setup import (
    build_model,
    choose_num_kv_blocks,
    keep_freed_memory,
    release_freed_memory,
    resolve_dtype,
)
from deterministic_inference.errors import InvalidRequestError
from deterministic_inference.model.loader import LoadedModel, load_model
from deterministic_inference.ops.selfcheck import SelfCheckReport, run_selfcheck

# layer_hook(step_id, layer_index, request_ids, rows_per_request, hidden [T, hidden])
StepLayerHook = Callable[[int, int, list[str], list[int], torch.Tensor], None]


class Engine:
    """Offline engine over one model; not thread-safe (the async wrapper owns it from one thread)."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None, record_trace: bool = False):
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        keep_freed_memory()
        self.config = config
        self.loaded = loaded if loaded is not None else load_model(config.model, config.quantization)
        self.tokenizer = self.loaded.tokenizer
        self.spec = self.loaded.spec
        self.dtype_name = resolve_dtype(config.dtype)
        self.max_model_len = min(
            config.max_model_len or self.spec.max_position_embeddings, self.spec.max_position_embeddings
        )
        # The files' sha256 (a second for a 1 GB file) runs beside the build and the self-check:
        # hashlib releases the GIL while it hashes.
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="detinf-digest") as hashing:
            digest = hashing.submit(artifacts_digest, self.loaded.artifacts)
            self.model = build_model(self.loaded, config, self.dtype_name, self.max_model_len)
            self.selfcheck_report: SelfCheckReport | None = None
            if config.batch_invariant and config.selfcheck:
                # Refuse invariant mode on hardware where any op probe differs (names op and shape).
                self.selfcheck_report = run_selfcheck(
                    self.spec, self.model.numerics, config.threads, self.model.probe_linears()
                )
                self.selfcheck_report.raise_if_failed()
            self.model_digest = digest.result()
        self.fingerprint = fingerprint.engine_fingerprint(
            self.model_digest, config.numerics(self.dtype_name, self.model.weight_formats)
        )
        self.system_fingerprint = fingerprint.system_fingerprint(self.fingerprint)
        num_blocks = choose_num_kv_blocks(config, self.spec, self.max_model_len, self.dtype_name)
        self.kv = KVCacheManager(
            num_blocks, config.kv_block_size, config.enable_prefix_caching, self.system_fingerprint
        )
        self.scheduler = Scheduler(
            self.kv, config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len
        )
        self.runner = ModelRunner(self.model, num_blocks, config.kv_block_size)
        release_freed_memory()  # the load's and the self-check's temporaries
        self.record_trace = record_trace
        self.trace: list[StepPlan] = []
        self._states: dict[str, SequenceState] = {}  # sequence id -> state
        self._groups: dict[str, list[str]] = {}  # request id -> its sequence ids, choice order
        self._prompts: dict[str, list[int]] = {}
        self._next_step = 0
        self._next_auto_id = 0

    @property
    def model_artifacts(self) -> tuple[Path, ...]:
        """Files the model was loaded from."""
        return self.loaded.artifacts

    def encode_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a prompt given as text or as ids (validated against the vocabulary)."""
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
        if not ids:
            raise InvalidRequestError("prompt: is empty; give at least one token", param="prompt")
        vocab = self.spec.vocab_size
        for token in ids:
            if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < vocab:
                raise InvalidRequestError(
                    f"prompt: token id {token!r} is outside [0, {vocab})", param="prompt"
                )
        return ids

    def add_request(
        self, prompt: str | Sequence[int], params: SamplingParams, request_id: str | None = None
    ) -> str:
        """Queue a request (expanded into n sequences); returns its id. Raises InvalidRequestError."""
        ids = self.encode_prompt(prompt)
        if len(ids) + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the context of "
                f"{self.max_model_len} tokens; shorten the prompt or lower max_tokens",
                param="max_tokens" if len(ids) < self.max_model_len else "prompt",
            )
        if request_id is None:
            request_id = f"req-{self._next_auto_id}"
            self._next_auto_id += 1
        if request_id in self._groups:
            raise InvalidRequestError(f"request_id: {request_id!r} is already in use", param="request_id")
        sequence_ids = []
        for choice in range(params.n):
            sequence_id = f"{request_id}-{choice}"
            request = Request(sequence_id, ids, params, params.choice_seed(self.config.seed, choice))
            self._states[sequence_id] = SequenceState(
                request=request,
                choice_index=choice,
                decoder=self.tokenizer.incremental_decoder(),
                eos_token_ids=self.tokenizer.eos_token_ids,
                max_model_len=self.max_model_len,
            )
            self.scheduler.add(request)
            sequence_ids.append(sequence_id)
        self._groups[request_id] = sequence_ids
        self._prompts[request_id] = ids
        return request_id

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its KV blocks; unknown or finished ids are ignored."""
        for sequence_id in self._groups.pop(request_id, []):
            state = self._states.pop(sequence_id)
            if not state.request.is_finished:
                self.scheduler.abort(sequence_id)
        self._prompts.pop(request_id, None)

    @property
    def has_unfinished(self) -> bool:
        """True while any added request still has work."""
        return self.scheduler.has_unfinished

    def step(self, layer_hook: StepLayerHook | None = None) -> list[RequestOutput]:
        """One engine step; returns the outputs of every request that changed (finished ones last seen)."""
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        if self.record_trace:
            self.trace.append(plan)
        hook = None
        if layer_hook is not None:
            request_ids = [chunk.request_id for chunk in plan.chunks]
            rows = [len(chunk.token_ids) for chunk in plan.chunks]

            def hook(layer_index: int, hidden: torch.Tensor) -> None:
                layer_hook(plan.step_id, layer_index, request_ids, rows, hidden)

        logits = self.runner.execute(plan, hook)
        self._collect_prompt_logprobs(plan.chunks, logits)
        sampled = self._sample(plan.chunks, logits)
        changed = self.scheduler.update(plan, {seq_id: token for seq_id, (token, _, _) in sampled.items()})
        for request in changed:
            token, logprob, top = sampled[request.request_id]
            request.output_logprobs.append(logprob)
            if request.params.logprobs is not None:
                request.output_top_logprobs.append(top)
            state = self._states[request.request_id]
            status = state.on_token(token)
            if status is not None:
                self.scheduler.finish(request.request_id, status)
                state.on_finish()
        return self._outputs_for(sorted({self._request_of(r.request_id) for r in changed}))

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
        layer_hook: StepLayerHook | None = None,
    ) -> list[RequestOutput]:
        """Run prompts together (batched) to completion; outputs in prompt order."""
        params_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params_list) != len(prompts):
            raise InvalidRequestError(
                "params: need one SamplingParams per prompt, or a single one", param="params"
            )
        request_ids = [self.add_request(prompt, p) for prompt, p in zip(prompts, params_list, strict=True)]
        while self.has_unfinished:
            self.step(layer_hook)
        outputs = self._outputs_for(request_ids)
        for request_id in request_ids:
            self._release(request_id)
        return outputs

    def stream(self, prompt: str | Sequence[int], params: SamplingParams) -> Iterator[RequestOutput]:
        """Generate one request, yielding its output after every step that changed it (last: finished)."""
        request_id = self.add_request(prompt, params)
        try:
            while True:
                for output in self.step():
                    if output.request_id == request_id:
                        yield output
                        if output.finished:
                            return
        finally:
            self.abort(request_id)

    def flush_prefix_cache(self) -> int:
        """Drop every cached KV block no running request holds; returns how many were dropped."""
        return self.kv.flush()

    def stats(self) -> dict[str, Any]:
        """Counters for metrics: queue sizes, KV blocks, prefix-cache hits."""
        return {
            "num_waiting": self.scheduler.num_waiting,
            "num_running": self.scheduler.num_running,
            "kv_blocks_total": self.runner.num_blocks,
            "kv_blocks_used": self.kv.num_used_blocks,
            "prefix_cache": vars(self.kv.stats).copy(),
        }

    def release(self, request_id: str) -> None:
        """Forget a finished request's bookkeeping (the server calls this after its last output)."""
        self._release(request_id)

    def _release(self, request_id: str) -> None:
        for sequence_id in self._groups.pop(request_id, []):
            self._states.pop(sequence_id, None)
        self._prompts.pop(request_id, None)

    def _request_of(self, sequence_id: str) -> str:
        return sequence_id.rsplit("-", 1)[0]

    def _sample(
        self, chunks: tuple[ScheduledChunk, ...], logits: list[torch.Tensor | None]
    ) -> dict[str, tuple[int, float, list[tuple[int, float]]]]:
        """Sample one token for every chunk that ends its known tokens; rows are independent."""
        rows, requests = [], []
        for chunk, chunk_logits in zip(chunks, logits, strict=True):
            if chunk.sample and chunk_logits is not None:
                rows.append(chunk_logits[-1])
                requests.append(self._states[chunk.request_id].request)
        if not rows:
            return {}
        result = sampler.sample(
            sampler.as_batch(rows),
            [r.params for r in requests],
            [r.seed for r in requests],
            [len(r.output_token_ids) for r in requests],
            [r.all_token_ids for r in requests],
            [r.output_token_ids for r in requests],
        )
        return {
            request.request_id: (result.token_ids[i], result.logprobs[i], result.top_logprobs[i])
            for i, request in enumerate(requests)
        }

    def _collect_prompt_logprobs(
        self, chunks: tuple[ScheduledChunk, ...], logits: list[torch.Tensor | None]
    ) -> None:
        """Logprob of each prompt token given the tokens before it, from chunks that asked for all rows."""
        for chunk, chunk_logits in zip(chunks, logits, strict=True):
            if not chunk.all_logits or chunk_logits is None:
                continue
            state = self._states[chunk.request_id]
            request = state.request
            k = request.params.prompt_logprobs or 0
            if not state.prompt_logprobs:
                state.prompt_logprobs.append(None)  # position 0 has no logprob
                state.prompt_top_logprobs.append([])
            prompt = request.prompt_token_ids
            # Row r predicts prompt[start + r + 1]; keep the rows whose target is a prompt position not
            # collected yet (a recompute after preemption covers positions already collected).
            start = chunk.start_position
            first_row = max(0, len(state.prompt_logprobs) - 1 - start)
            end_row = min(len(chunk.token_ids), len(prompt) - 1 - start)
            if first_row >= end_row:
                continue
            targets = prompt[start + first_row + 1 : start + end_row + 1]
            values, tops = sampler.prompt_logprobs(chunk_logits[first_row:end_row], targets, k)
            state.prompt_logprobs.extend(values)
            state.prompt_top_logprobs.extend(tops)

    def _outputs_for(self, request_ids: Sequence[str]) -> list[RequestOutput]:
        outputs = []
        for request_id in request_ids:
            states = [self._states[s] for s in self._groups.get(request_id, [])]
            if not states:
                continue
            first = states[0]
            wants_prompt = first.request.params.prompt_logprobs is not None
            outputs.append(
                RequestOutput(
                    request_id=request_id,
                    prompt_token_ids=list(self._prompts[request_id]),
                    outputs=[state.completion() for state in states],
                    prompt_logprobs=list(first.prompt_logprobs) if wants_prompt else None,
                    prompt_top_logprobs=[list(t) for t in first.prompt_top_logprobs]
                    if wants_prompt
                    else None,
                    num_cached_tokens=first.request.num_cached_tokens,
                    finished=all(state.request.is_finished for state in states),
                )
            )
        return outputs


def artifacts_digest(paths: Sequence[Path]) -> str:
    """sha256 over the sorted (file name, file sha256) pairs of the model's artifacts."""
    outer = hashlib.sha256()
    for path in sorted(paths, key=lambda p: p.name):
        inner = hashlib.sha256()
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                inner.update(block)
        outer.update(f"{path.name}\0{inner.hexdigest()}\n".encode())
    return "sha256:" + outer.hexdigest()


__all__ = ["Engine", "RequestStatus", "artifacts_digest"]
