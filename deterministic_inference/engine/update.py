"""The update half of an engine step (`Scheduler.update`): apply what the runner computed to the
sequences, check stops, finish, and build the step's per-request deltas.

Per sequence, in plan order: store newly scored prompt logprobs (on the parent request), append the
sampled token, feed it to the sequence's grammar matcher (structured outputs), register newly full KV
blocks, push the token's text, check stops (EOS, stop token ids, stop strings, a grammar that can take
no further token: "stop", length), finish and free. Anything that raises for one sequence here (its
detokenization, its grammar, its stop check) or that the runner reported as that sequence's failure
ends that request alone with FINISHED_ERROR (siblings aborted, KV freed); other sequences are not
touched, so their bits are those they would have had anyway. Deltas are built after all sequences are
updated, in first-touched order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from deterministic_inference.engine.model_runner import ModelRunnerOutput, PromptLogprobs, SampledToken
from deterministic_inference.engine.outputs import (
    CompletionDelta,
    PromptData,
    RequestDelta,
    SpeculationCounts,
    join_pieces,
)
from deterministic_inference.engine.request import ParentRequest, Request, RequestStatus
from deterministic_inference.engine.step_sampling import failure_message

if TYPE_CHECKING:
    from deterministic_inference.engine.scheduler import Scheduler


class StepUpdate:
    """Applies one `ModelRunnerOutput` to the scheduler's sequences and collects the deltas."""

    def __init__(self, scheduler: Scheduler, output: ModelRunnerOutput) -> None:
        self.scheduler = scheduler
        self.output = output
        self._touched: dict[str, ParentRequest] = {}  # request id -> parent, first-touched order
        self._pieces: dict[str, list[CompletionDelta]] = {}

    def apply(self, request: Request, sample: bool) -> None:
        """Update one sequence whose chunk was computed (its num_computed_tokens already advanced)."""
        sequence_id = request.request_id
        failure = self.output.failures.get(sequence_id)
        if failure is not None:
            self._fail(request, failure)
            return
        prompt = self.output.prompt_logprobs.get(sequence_id)
        if prompt is not None:
            _store_prompt_logprobs(request.parent, prompt)
        if not sample:
            self.scheduler.kv.commit_full_blocks(request)
            return
        token = self.output.sampled[sequence_id]  # a missing token is an engine bug: let it raise
        if not self._emit(request, token):
            return
        for accepted in self.output.accepted.get(sequence_id, []):  # speculation's accepted run
            if request.is_finished:
                break
            request.num_computed_tokens += 1  # the draft this token follows was verified: its KV stands
            if not self._emit(request, accepted):
                return

    def _emit(self, request: Request, token: SampledToken) -> bool:
        """Append one chosen token to the sequence (grammar, KV blocks, text, stops, its piece); False
        when the sequence failed doing so."""
        sequence_id = request.request_id
        request.output_token_ids.append(token.token_id)
        self.scheduler.kv.commit_full_blocks(request)
        if request.grammar is not None:
            try:
                request.grammar.accept(token.token_id, self._ending_ids(request))
            except Exception as error:  # noqa: BLE001 - this sequence's failure alone
                message = failure_message(sequence_id, "checking its token against its grammar", error)
                self._fail(request, message)
                return False
        try:
            text = self._advance(request, token.token_id)
        except Exception as error:  # noqa: BLE001 - this sequence's failure alone
            self._fail(request, failure_message(sequence_id, "detokenizing its output", error))
            return False
        self._add_piece(request, _piece(request, token, text))
        return True

    def deltas(self) -> list[RequestDelta]:
        """One delta per touched request; the first delta of a request carries its prompt data."""
        deltas = []
        for request_id, parent in self._touched.items():
            prompt = None
            if not parent.prompt_sent:
                parent.prompt_sent = True
                prompt = _prompt_data(parent)
            pieces = sorted(self._pieces.get(request_id, []), key=lambda piece: piece.index)
            deltas.append(
                RequestDelta(
                    request_id=request_id,
                    outputs=pieces,
                    num_cached_tokens=parent.sequences[0].num_cached_tokens,
                    finished=parent.is_finished,
                    prompt=prompt,
                    error=parent.error,
                    speculation=self._speculation(parent),
                )
            )
        return deltas

    def _speculation(self, parent: ParentRequest) -> SpeculationCounts | None:
        """The request's draft and accepted tokens so far over its choices (None without speculation).
        Read after the scheduler counted this step's drafts (`Scheduler._after_draft`)."""
        if self.scheduler.speculative is None:
            return None
        return SpeculationCounts(
            num_draft_tokens=sum(s.num_draft_tokens for s in parent.sequences),
            num_accepted_tokens=sum(s.num_accepted_tokens for s in parent.sequences),
        )

    def _ending_ids(self, request: Request) -> tuple[int, ...]:
        """Token ids that end the sequence as soon as sampled (EOS unless ignore_eos, stop token ids):
        the grammar allows them only while accepting, and they are not part of its language."""
        params = request.params
        eos = () if params.ignore_eos else self.scheduler.eos_token_ids
        return eos + params.stop_token_ids

    def _advance(self, request: Request, token_id: int) -> str:
        """Push the token's text, apply the first stop that matches, return the newly visible text."""
        state = request.text
        params = request.params
        previous_length = len(state.text) if state is not None else 0
        if state is not None:
            state.push(token_id)
        status = None
        if not params.ignore_eos and token_id in self.scheduler.eos_token_ids:
            request.stop_reason, status = None, RequestStatus.FINISHED_STOPPED
        elif token_id in params.stop_token_ids:
            request.stop_reason, status = token_id, RequestStatus.FINISHED_STOPPED
        elif state is not None and (stop := state.match_stop(previous_length)) is not None:
            request.stop_reason, status = stop, RequestStatus.FINISHED_STOPPED
        elif request.grammar is not None and request.grammar.is_stopped:
            request.stop_reason, status = None, RequestStatus.FINISHED_STOPPED
        elif (
            len(request.output_token_ids) >= params.max_tokens
            or request.num_tokens >= self.scheduler.max_model_len
        ):
            status = RequestStatus.FINISHED_LENGTH
        if status is not None and state is not None:
            state.finish(cut_by_stop_string=isinstance(request.stop_reason, str))
        text = state.take_new_text(finished=status is not None) if state is not None else ""
        if status is not None:
            self.scheduler.finish(request.request_id, status)
        return text

    def _fail(self, request: Request, message: str) -> None:
        """End the request this sequence belongs to: FINISHED_ERROR here, siblings aborted, KV freed."""
        parent = request.parent
        if parent.error is None:
            parent.error = message
        ended = [request] + [s for s in parent.sequences if s is not request and not s.is_finished]
        self.scheduler.finish(request.request_id, RequestStatus.FINISHED_ERROR)
        for sibling in ended[1:]:
            self.scheduler.finish(sibling.request_id, RequestStatus.FINISHED_ABORTED)
        for sequence in ended:  # an empty last piece per choice ended here: "error", or "abort"
            piece = CompletionDelta(sequence.choice_index, [], [], [], "", sequence.finish_reason)
            self._add_piece(sequence, piece)

    def _add_piece(self, request: Request, piece: CompletionDelta) -> None:
        """Add a choice's piece; a second piece of the same choice in one step (speculation emits
        several tokens) is joined to its first, so a delta holds one piece per choice."""
        parent = request.parent
        self._touched.setdefault(parent.request_id, parent)
        pieces = self._pieces.setdefault(parent.request_id, [])
        for i, earlier in enumerate(pieces):
            if earlier.index == piece.index:
                pieces[i] = join_pieces(earlier, piece)
                return
        pieces.append(piece)


def _piece(request: Request, token: SampledToken, text: str) -> CompletionDelta:
    wants_top = request.params.logprobs is not None
    return CompletionDelta(
        index=request.choice_index,
        token_ids=[token.token_id],
        logprobs=[token.logprob],
        top_logprobs=[token.top_logprobs] if wants_top else [],
        text=text,
        finish_reason=request.finish_reason,
        stop_reason=request.stop_reason,
    )


def _prompt_data(parent: ParentRequest) -> PromptData:
    wants = parent.params.prompt_logprobs is not None
    return PromptData(
        token_ids=parent.prompt_token_ids,
        num_choices=len(parent.sequences),
        logprobs=list(parent.prompt_logprobs) if wants else None,
        top_logprobs=[list(t) for t in parent.prompt_top_logprobs] if wants else None,
    )


def _store_prompt_logprobs(parent: ParentRequest, scored: PromptLogprobs) -> None:
    """Extend the parent's prompt logprobs with the positions it does not have yet (a sibling scoring
    the same positions in the same step gives the same bits: they are a function of the prompt)."""
    if not parent.prompt_logprobs:
        parent.prompt_logprobs.append(None)  # position 0 has no logprob
        parent.prompt_top_logprobs.append([])
    skip = len(parent.prompt_logprobs) - scored.first_position
    if skip < 0:
        raise RuntimeError(
            f"prompt logprobs of {parent.request_id!r}: positions {len(parent.prompt_logprobs)} to "
            f"{scored.first_position - 1} were never scored"
        )
    parent.prompt_logprobs.extend(scored.values[skip:])
    parent.prompt_top_logprobs.extend(scored.top_logprobs[skip:])
