"""Continuous-batching scheduler: which sequences run each step and how many tokens each.

Every step (`schedule`) spends a token budget of `max_num_batched_tokens`:

1. RUNNING sequences first, in arrival order. Each computes its not-yet-computed known tokens (one token,
   the last sampled one, for a decode; the rest of its prompt for a chunked prefill), cut to the budget
   left. When the KV pool cannot hold a running sequence's new tokens, the LATEST-arrived running
   sequence is preempted (blocks freed, `reset_for_recompute`, back into the waiting queue by arrival)
   and the allocation retried; a sequence may preempt itself, which ends this phase.
2. Then, unless something was preempted this step, WAITING and PREEMPTED sequences in arrival order
   while fewer than `max_num_seqs` run: the prefix-cache hit is taken without spending budget (the last
   known token is always recomputed), the rest is chunked to the budget left. A sequence that does not
   fit the KV pool blocks those behind it (strict FCFS).

A preempted sequence recomputes prompt + outputs as its "prompt"; its chunks are not sampled until all
its known tokens are computed (`ScheduledChunk.sample`). The plan's chunks are ordered by arrival.

Speculation (`speculative`): a running sequence that decodes (one known token left to compute) may add
drafted tokens to its chunk (`engine/speculative.py` proposes them, as many as its cost-aware draft length
allows at the step's number of running sequences, within the budget, its max_tokens and max_model_len,
only while the running sequences are at most `disable_by_batch_size`, and only when the pool holds them
without preempting anyone). `update` advances num_computed_tokens over the verified tokens only and gives
back the blocks past the known tokens, so the prefix cache (which registers full blocks of computed
tokens) never holds an unverified token.

Deterministic: the only inputs are the calls made on it; queues are lists kept sorted by arrival
number; no wall clock, no set or dict iteration. Every `schedule()` must be followed by `update()` with
its plan before the next `schedule()`.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING

from deterministic_inference.engine.admission import check_fits
from deterministic_inference.engine.kv_cache import KVCacheManager
from deterministic_inference.engine.model_runner import ModelRunnerOutput
from deterministic_inference.engine.outputs import RequestDelta
from deterministic_inference.engine.plan import ScheduledChunk, StepPlan
from deterministic_inference.engine.request import Request, RequestStatus
from deterministic_inference.engine.speculative import (
    PROBE_MIN_MATCH,
    DraftLength,
    NgramIndex,
    SpecDecodeStats,
    SpeculativeConfig,
)
from deterministic_inference.engine.update import StepUpdate
from deterministic_inference.errors import ConfigError, InvalidRequestError

if TYPE_CHECKING:
    from deterministic_inference.engine.draft_model import DraftModelProposer


class Scheduler:
    """FCFS continuous batching with chunked prefill, prefix-cache reuse and preemption by recompute."""

    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: tuple[int, ...] = (),
        speculative: SpeculativeConfig | None = None,
    ) -> None:
        for name, value in (
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("max_model_len", max_model_len),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name}: {value!r} must be a positive integer")
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids  # end a sequence unless its params say ignore_eos
        self.step = 0  # id of the next plan; the engine's logical clock
        self.num_preemptions = 0  # sequences preempted so far (metrics only)
        self._next_arrival = 0
        self._requests: dict[str, Request] = {}  # unfinished sequences by id (lookups only)
        self._waiting: list[Request] = []  # WAITING and PREEMPTED, sorted by arrival
        self._running: list[Request] = []  # RUNNING, sorted by arrival
        self.speculative = speculative  # None = no drafting
        self.spec_stats = SpecDecodeStats()
        self._draft_lengths: dict[str, DraftLength] = {}  # sequence id -> adaptive draft length
        self._ngram_indexes: dict[str, NgramIndex] = {}  # sequence id -> its n-grams (ngram drafts)
        self.draft_model: DraftModelProposer | None = None  # method draft_model (set by the engine)

    @property
    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def sequences(self) -> Mapping[str, Request]:
        """Unfinished sequences by id (read-only view)."""
        return MappingProxyType(self._requests)

    def get(self, request_id: str) -> Request | None:
        """The unfinished sequence with this id, or None."""
        return self._requests.get(request_id)

    def add(self, request: Request) -> None:
        """Queue a new sequence (FCFS); assigns its arrival number. Raises InvalidRequestError when its
        id is already queued or its prompt cannot fit max_model_len or the KV pool."""
        if request.request_id in self._requests:
            raise InvalidRequestError(
                f"request_id: {request.request_id!r} is already queued", param="request_id"
            )
        check_fits(
            request.num_prompt_tokens,
            request.params.max_tokens,
            self.max_model_len,
            self.kv.block_size,
            self.kv.num_blocks,
            window_blocks=self.kv.window_block_limit(self.max_num_batched_tokens),
        )
        request.arrival = self._next_arrival
        self._next_arrival += 1
        request.status = RequestStatus.WAITING
        self._requests[request.request_id] = request
        self._waiting.append(request)  # newest arrival: stays sorted

    def abort(self, request_id: str) -> None:
        """Stop a sequence now: free its blocks, status FINISHED_ABORTED. Unknown ids are ignored."""
        self.finish(request_id, RequestStatus.FINISHED_ABORTED)

    def finish(self, request_id: str, status: RequestStatus) -> None:
        """End a sequence with a finished `status` and free its KV blocks. Unknown ids are ignored."""
        if not status.is_finished:
            raise ValueError(f"status: {status.name} is not a finished status")
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        queue = self._running if request.status == RequestStatus.RUNNING else self._waiting
        queue.remove(request)
        self.kv.free(request)
        self._draft_lengths.pop(request_id, None)
        self._ngram_indexes.pop(request_id, None)
        if self.draft_model is not None:
            self.draft_model.forget(request_id)
        request.status = status

    def schedule(self) -> StepPlan:
        """The next step's plan (see the module docstring for the policy)."""
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted: list[str] = []
        drafts: dict[str, list[int]] = {}  # sequence id -> its drafted tokens this step
        budget = self._schedule_running(budget, scheduled, preempted, drafts)
        if not preempted:
            self._schedule_waiting(budget, scheduled)
        scheduled.sort(key=lambda item: item[0].arrival)
        self.num_preemptions += len(preempted)
        plan = StepPlan(
            step_id=self.step,
            chunks=tuple(
                self._chunk(request, count, drafts.get(request.request_id, []))
                for request, count in scheduled
            ),
            preempted_ids=tuple(preempted),
        )
        self.step += 1
        return plan

    def update(self, plan: StepPlan, output: ModelRunnerOutput) -> list[RequestDelta]:
        """Apply a computed plan: advance each chunk's sequence, store prompt logprobs, append the token
        sampled for chunks with `sample`, register newly full KV blocks, check stops and finish (freeing
        KV blocks). A sequence whose own sampling, scoring or detokenization failed finishes with
        FINISHED_ERROR and its siblings are aborted; no other sequence is touched. Returns one delta per
        request that changed, in plan order. Sequences finished or aborted since `schedule()` are
        skipped."""
        step = StepUpdate(self, output)
        for chunk in plan.chunks:
            request = self._requests.get(chunk.request_id)
            if request is None or request.num_computed_tokens != chunk.start_position:
                continue
            request.num_computed_tokens += len(chunk.token_ids) - chunk.num_draft_tokens
            before = len(request.output_token_ids)
            step.apply(request, chunk.sample)
            if chunk.num_draft_tokens:
                self._after_draft(request, output, len(request.output_token_ids) - before)
        return step.deltas()

    # -- internals -------------------------------------------------------------------------------

    def _schedule_running(
        self,
        budget: int,
        scheduled: list[tuple[Request, int]],
        preempted: list[str],
        drafts: dict[str, list[int]],
    ) -> int:
        index = 0
        while index < len(self._running) and budget > 0:
            request = self._running[index]
            count = min(request.num_tokens - request.num_computed_tokens, budget)
            proposed = self._propose(request, count, budget - count)
            if proposed and self.kv.allocate(request, count + len(proposed)):
                drafts[request.request_id] = proposed
                scheduled.append((request, count + len(proposed)))
                budget -= count + len(proposed)
                index += 1
                continue
            while not self.kv.allocate(request, count):
                victim = self._running[-1]  # latest arrival; never one already scheduled (earlier)
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    return budget
            scheduled.append((request, count))
            budget -= count
            index += 1
        return budget

    def _schedule_waiting(self, budget: int, scheduled: list[tuple[Request, int]]) -> None:
        while self._waiting and budget > 0 and len(self._running) < self.max_num_seqs:
            request = self._waiting[0]
            cached = self.kv.get_computed_prefix(request)
            count = min(request.num_tokens - cached, budget)
            if not self.kv.allocate(request, count):
                return
            self._waiting.pop(0)
            request.status = RequestStatus.RUNNING
            _insort(self._running, request)
            scheduled.append((request, count))
            budget -= count

    def _propose(self, request: Request, count: int, spare: int) -> list[int]:
        """Draft tokens for a decoding sequence (empty when speculation is off, the batch is above
        `disable_by_batch_size`, the sequence is not decoding its last known token, or nothing is
        proposed)."""
        config = self.speculative
        start = request.num_computed_tokens
        if config is None or count != 1 or request.num_tokens - start != 1:
            return []
        if not config.drafts_at(len(self._running)):
            return []
        if request.params.prompt_logprobs is not None and start < request.num_prompt_tokens:
            return []
        length = self._draft_lengths.setdefault(
            request.request_id, DraftLength(config.num_speculative_tokens)
        )
        room = min(
            spare,
            request.params.max_tokens - len(request.output_token_ids) - 1,
            self.max_model_len - request.num_tokens,
        )
        if room < 1:
            return []
        batch = len(self._running)
        limit = min(length.next(batch), room)
        if limit < 1:
            return []
        if self.draft_model is not None:
            drafts = self.draft_model.propose(request, limit)
        else:
            lookup_min = config.prompt_lookup_min
            if length.probing(batch):  # a probe drafts only from a long match (PROBE_MIN_MATCH)
                lookup_min = max(lookup_min, min(PROBE_MIN_MATCH, config.prompt_lookup_max))
            index = self._ngram_indexes.get(request.request_id)
            if index is None:
                index = NgramIndex(config.prompt_lookup_min, config.prompt_lookup_max)
                self._ngram_indexes[request.request_id] = index
            drafts = index.propose(request.all_token_ids, limit, lookup_min)
        if request.grammar is not None:  # its matcher never consumes an ending token (spec_verify)
            ending = set(request.params.stop_token_ids) | set(self.eos_token_ids)
            cut = next((i for i, token in enumerate(drafts) if token in ending), len(drafts))
            drafts = drafts[:cut]
        return drafts

    def _after_draft(self, request: Request, output: ModelRunnerOutput, emitted: int) -> None:
        """Count a verified draft, adapt the sequence's draft length, and roll back its KV: the blocks
        past its known tokens (they hold only rejected drafts) go back to the pool."""
        sequence_id = request.request_id
        drafted = output.drafted.get(sequence_id)
        if drafted is None:  # its sampling failed: nothing was verified
            return
        accepted = len(output.accepted.get(sequence_id, []))
        self.spec_stats.record(drafted, accepted, emitted, self._max_draft())
        request.num_draft_tokens += drafted  # the same counts per sequence, for the request's usage
        request.num_accepted_tokens += accepted
        length = self._draft_lengths.get(sequence_id)
        if length is not None:
            length.update(drafted, accepted)
        if not request.is_finished:
            self.kv.release_tail(request, request.num_tokens)

    def _max_draft(self) -> int:
        return 0 if self.speculative is None else self.speculative.num_speculative_tokens

    def _preempt(self, request: Request) -> None:
        self._running.remove(request)
        self.kv.free(request)
        request.reset_for_recompute()
        _insort(self._waiting, request)

    def _chunk(self, request: Request, count: int, drafts: list[int]) -> ScheduledChunk:
        start = request.num_computed_tokens
        end = start + count - len(drafts)
        return ScheduledChunk(
            request_id=request.request_id,
            token_ids=tuple(request.all_token_ids[start:end]) + tuple(drafts),
            start_position=start,
            block_ids=tuple(request.block_ids),
            sample=end == request.num_tokens,
            all_logits=request.params.prompt_logprobs is not None and start < request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            num_draft_tokens=len(drafts),
        )


def _insort(queue: list[Request], request: Request) -> None:
    """Insert keeping the queue sorted by arrival number."""
    bisect.insort(queue, request, key=lambda r: r.arrival)
