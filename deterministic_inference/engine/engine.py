"""The engine: add requests, step (schedule -> execute -> update), collect per-step deltas or outputs.

One engine step is three calls: `Scheduler.schedule()` builds a `StepPlan`, `ModelRunner.run()` computes
the logits rows it asks for and samples them into a typed `ModelRunnerOutput`, and `Scheduler.update()`
appends the tokens, checks stops, finishes and frees, returning the step's `RequestDelta`s (only what is
new). Nothing here reads the wall clock or iterates an unordered collection, so the sequence of plans is
a pure function of the requests added and their order.

The offline API (`step`, `generate`, `stream`) folds the deltas into full `RequestOutput`s; the server
consumes the deltas themselves (`step_deltas`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from deterministic_inference import fingerprint
from deterministic_inference.config import EngineConfig
from deterministic_inference.engine.admission import AdmissionLimits
from deterministic_inference.engine.draft_model import DraftModelProposer
from deterministic_inference.engine.faults import FaultInjection
from deterministic_inference.engine.grammar import GrammarCompiler
from deterministic_inference.engine.grammar_state import SequenceGrammar
from deterministic_inference.engine.kv_cache import KVCacheManager
from deterministic_inference.engine.model_runner import ModelRunner
from deterministic_inference.engine.outputs import OutputAssembler, RequestDelta, RequestOutput
from deterministic_inference.engine.plan import StepPlan
from deterministic_inference.engine.request import ParentRequest, Request, RequestStatus
from deterministic_inference.engine.sampling_params import SamplingParams
from deterministic_inference.engine.scheduler import Scheduler
from deterministic_inference.engine.sequence_state import SequenceState
from deterministic_inference.engine.setup import (
    build_model,
    choose_num_kv_blocks,
    keep_freed_memory,
    kv_cache_format,
    model_numerics,
    release_freed_memory,
    resolve_dtype,
    return_freed_memory,
)
from deterministic_inference.engine.weight_update import swap_weights
from deterministic_inference.errors import InvalidRequestError
from deterministic_inference.model.decoder import DecoderModel
from deterministic_inference.model.loader import LoadedModel, load_model
from deterministic_inference.ops.selfcheck import SelfCheck, SelfCheckReport
from deterministic_inference.workflow.artifacts import hash_file

# layer_hook(step_id, layer_index, request_ids, rows_per_request, hidden [T, hidden])
StepLayerHook = Callable[[int, int, list[str], list[int], torch.Tensor], None]


class Engine:
    """Offline engine over one model; not thread-safe (the async wrapper owns it from one thread).

    `faults` injects test-only failures (see `engine/faults.py`); it is a constructor argument, never
    something a request can reach."""

    def __init__(
        self,
        config: EngineConfig,
        loaded: LoadedModel | None = None,
        record_trace: bool = False,
        faults: FaultInjection | None = None,
    ):
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        return_freed_memory()  # until the load and self-check are done (then keep_freed_memory)
        self.config = config
        self.loaded = loaded if loaded is not None else load_model(config.model, config.quantization)
        self.tokenizer = self.loaded.tokenizer
        self.spec = self.loaded.spec
        self.dtype_name = resolve_dtype(config.dtype, config.batch_invariant)
        self.kv_cache_format = kv_cache_format(config, self.spec, self.dtype_name)  # refuses before the build
        self.max_model_len = min(
            config.max_model_len or self.spec.max_position_embeddings, self.spec.max_position_embeddings
        )
        self.model, self.selfcheck_report, self.model_digest = self._build_checked_model()
        self.fingerprint = fingerprint.engine_fingerprint(
            self.model_digest,
            config.numerics(self.dtype_name, self.model.weight_formats, self.model.model_ops),
            portable=self.model.ops.portable,
        )
        self.system_fingerprint = fingerprint.system_fingerprint(self.fingerprint)
        self.faults = faults or FaultInjection()
        self._set_up_scheduling()
        # structured outputs: compiles each constraint once (thread-safe; the server calls it off-thread)
        self.grammars = GrammarCompiler(self.tokenizer, self.spec.vocab_size)
        keep_freed_memory()
        release_freed_memory()  # whatever the load and the self-check left in the heap
        self.record_trace = record_trace
        self.trace: list[StepPlan] = []
        self._parents: dict[str, ParentRequest] = {}  # unfinished requests by id
        self._assembled: dict[str, OutputAssembler] = {}  # offline API: outputs folded from deltas
        self._steps_run = 0
        self._next_auto_id = 0

    def _build_checked_model(self) -> tuple[DecoderModel, SelfCheckReport | None, str]:
        """The model to serve, whether this hardware may run it invariantly, and its files' digest.

        In invariant mode the engine refuses hardware where any op probe differs (naming op and shape):
        the probes that need no weights run before the model is built, so their buffers never add to
        its memory; those of its real linears and blocks run after. The files' sha256 (a second for a
        1 GB file) runs beside the build and the self-check: hashlib releases the GIL while it hashes."""
        config = self.config
        selfcheck = None
        if config.batch_invariant and config.selfcheck:
            numerics = model_numerics(config, self.dtype_name)
            selfcheck = SelfCheck(self.spec, numerics, config.threads, self.kv_cache_format)
        report: SelfCheckReport | None = None
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="detinf-digest") as hashing:
            digest = hashing.submit(artifacts_digest, self.loaded.artifacts)
            if selfcheck is not None:
                selfcheck.probe_ops()
            model = build_model(self.loaded, config, self.dtype_name, self.max_model_len)
            if selfcheck is not None:
                release_freed_memory()  # the build's freed temporaries: the probes' buffers go on top
                report = selfcheck.probe_weights(model.probe_linears(), model.probe_blocks())
                report.raise_if_failed()
            return model, report, digest.result()

    def _set_up_scheduling(self) -> None:
        """How many KV blocks the pool may hold, and the parts that schedule requests into them: the KV
        cache manager (prefix cache keyed by the system fingerprint), the scheduler, the model runner
        and the admission limits requests are checked against."""
        config = self.config
        num_blocks = choose_num_kv_blocks(config, self.spec, self.max_model_len, self.dtype_name)
        window = self.spec.all_layers_window if config.free_kv_outside_window else 0
        self.kv = KVCacheManager(
            num_blocks,
            config.kv_block_size,
            config.enable_prefix_caching,
            self.system_fingerprint,
            sliding_window=window,
        )
        self.scheduler = Scheduler(
            self.kv,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.max_model_len,
            self.tokenizer.eos_token_ids,
            config.speculative_config,
        )
        spec = config.speculative_config
        if spec is not None and spec.method == "draft_model" and spec.model is not None:
            self.scheduler.draft_model = DraftModelProposer(
                spec.model, config, self.dtype_name, self.spec.vocab_size, self.max_model_len
            )
        self.runner = ModelRunner(
            self.model, num_blocks, config.kv_block_size, self.faults.sample_fn(),
            self.kv_cache_format,
        )  # fmt: skip
        self.limits = AdmissionLimits(
            self.spec.vocab_size,
            self.max_model_len,
            config.kv_block_size,
            num_blocks,
            self.kv.window_block_limit(config.max_num_batched_tokens),
        )

    @property
    def model_artifacts(self) -> tuple[Path, ...]:
        """Files the model was loaded from."""
        return self.loaded.artifacts

    def encode_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a prompt given as text or as ids (validated against the vocabulary)."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
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
        """Queue a request (expanded into n sequences); returns its id. Raises InvalidRequestError (and
        then adds nothing)."""
        ids = self.limits.check(self.encode_prompt(prompt), params)
        if request_id is None:
            request_id = f"req-{self._next_auto_id}"
            self._next_auto_id += 1
        if request_id in self._parents or request_id in self._assembled:
            raise InvalidRequestError(f"request_id: {request_id!r} is already in use", param="request_id")
        spec = params.structured_output
        compiled = None if spec is None else self.grammars.compile(spec)  # cached: the server compiled it
        parent = ParentRequest(request_id, ids, params)
        for choice in range(params.n):
            text = SequenceState(
                self.faults.decoder(self.tokenizer, ids), params.stop, params.include_stop_str_in_output
            )
            sequence = Request(
                f"{request_id}-{choice}",
                ids,
                params,
                params.choice_seed(self.config.seed, choice),
                parent=parent,
                choice_index=choice,
                text=text,
                grammar=None if compiled is None else SequenceGrammar(compiled, params.stop_token_ids),
            )
            self.scheduler.add(sequence)
        self._parents[request_id] = parent
        return request_id

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its KV blocks; unknown or finished ids are ignored."""
        parent = self._parents.pop(request_id, None)
        if parent is not None:
            for sequence in parent.sequences:
                self.scheduler.abort(sequence.request_id)
        self._assembled.pop(request_id, None)

    @property
    def has_unfinished(self) -> bool:
        """True while any added request still has work."""
        return self.scheduler.has_unfinished

    @property
    def num_unfinished_requests(self) -> int:
        """Requests added and not finished or aborted."""
        return len(self._parents)

    def step_deltas(self, layer_hook: StepLayerHook | None = None) -> list[RequestDelta]:
        """One engine step (schedule -> execute -> update); returns a delta per request that changed."""
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        self.faults.before_step(self._steps_run)
        self._steps_run += 1
        if self.record_trace:
            self.trace.append(plan)
        hook = None
        if layer_hook is not None:
            request_ids = [chunk.request_id for chunk in plan.chunks]
            rows = [len(chunk.token_ids) for chunk in plan.chunks]

            def hook(layer_index: int, hidden: torch.Tensor) -> None:
                layer_hook(plan.step_id, layer_index, request_ids, rows, hidden)

        output = self.runner.run(plan, self.scheduler.sequences, hook)
        deltas = self.scheduler.update(plan, output)
        for delta in deltas:
            if delta.finished:
                self._parents.pop(delta.request_id, None)
        return deltas

    def step(self, layer_hook: StepLayerHook | None = None) -> list[RequestOutput]:
        """One engine step; returns the full output (so far) of every request that changed, in arrival
        order. Outputs stay available until `release` (or `abort`)."""
        return [self._fold(delta).output() for delta in self.step_deltas(layer_hook)]

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
            for delta in self.step_deltas(layer_hook):
                self._fold(delta)
        outputs = [self._assembled[request_id].output() for request_id in request_ids]
        for request_id in request_ids:
            self.release(request_id)
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
            self.release(request_id)

    def flush_prefix_cache(self) -> int:
        """Drop every cached KV block no running request holds; returns how many were dropped."""
        return self.kv.flush()

    def update_weights(self, weights: Mapping[str, torch.Tensor], param: str = "weights") -> str:
        """Serve `weights` (HF name -> float tensor, e.g. `rl.Policy.engine_weights()`) from now on and
        return the new system_fingerprint. Only between requests: raises EngineBusyError while any is in
        flight, InvalidRequestError (naming `param`) when the tensors are not exactly the model's;
        either way the old weights keep serving. Flushes the prefix cache (`engine/weight_update.py`)."""
        return swap_weights(self, weights, param)

    def stats(self) -> dict[str, Any]:
        """Counters for metrics: queue sizes, KV blocks, prefix-cache hits, preemptions, and the
        invariance mode with the start-up self-check's outcome."""
        report = self.selfcheck_report
        return {
            "num_waiting": self.scheduler.num_waiting,
            "num_running": self.scheduler.num_running,
            "num_preemptions": self.scheduler.num_preemptions,
            "kv_blocks_total": self.runner.num_blocks,
            "kv_blocks_used": self.kv.num_used_blocks,
            "prefix_cache": vars(self.kv.stats).copy(),
            "spec_decode": self.scheduler.spec_stats.snapshot(),
            "batch_invariant": self.config.batch_invariant,
            "selfcheck": None if report is None else {"passed": report.ok, "probes": len(report.results),
                                                      "seconds": report.seconds},
        }

    def release(self, request_id: str) -> None:
        """Forget a request: abort it if it is unfinished, and drop its assembled output."""
        self.abort(request_id)

    def _fold(self, delta: RequestDelta) -> OutputAssembler:
        assembler = self._assembled.get(delta.request_id)
        if assembler is None:
            assembler = self._assembled[delta.request_id] = OutputAssembler(delta)
        else:
            assembler.add(delta)
        return assembler


def artifacts_digest(paths: Sequence[Path]) -> str:
    """sha256 over the sorted (file name, file sha256) pairs of the model's artifacts."""
    outer = hashlib.sha256()
    for path in sorted(paths, key=lambda p: p.name):
        inner = hash_file(path, progress=False).removeprefix("sha256:")
        outer.update(f"{path.name}\0{inner}\n".encode())
    return "sha256:" + outer.hexdigest()


__all__ = ["Engine", "RequestStatus", "artifacts_digest"]
