"""Per-sequence engine bookkeeping: detokenized text, stop conditions, prompt logprobs."""

from __future__ import annotations

from dataclasses import dataclass, field

from deterministic_inference.engine.outputs import CompletionOutput, find_stop, held_back_length
from deterministic_inference.engine.request import Request, RequestStatus
from deterministic_inference.model.tokenizer import IncrementalDecoder


@dataclass
class SequenceState:
    """One sequence's text and stop handling; the engine owns one per `Request`."""

    request: Request
    choice_index: int
    decoder: IncrementalDecoder
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    text: str = ""
    prompt_logprobs: list[float | None] = field(default_factory=list)
    prompt_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)

    def on_token(self, token_id: int) -> RequestStatus | None:
        """Update text after a new output token; returns the finished status to apply, if any."""
        request = self.request
        params = request.params
        previous_length = len(self.text)
        self.text += self.decoder.push(token_id)
        if not params.ignore_eos and token_id in self.eos_token_ids:
            request.stop_reason = None
            return RequestStatus.FINISHED_STOPPED
        if token_id in params.stop_token_ids:
            request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        if params.stop:
            found = find_stop(self.text, params.stop, previous_length)
            if found is not None:
                index, stop = found
                self.text = (
                    self.text[: index + len(stop)] if params.include_stop_str_in_output else self.text[:index]
                )
                request.stop_reason = stop
                return RequestStatus.FINISHED_STOPPED
        if len(request.output_token_ids) >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def on_finish(self) -> None:
        """Flush the decoder's held-back bytes unless a stop string already cut the text."""
        tail = self.decoder.flush()
        if not isinstance(self.request.stop_reason, str):
            self.text += tail

    def completion(self) -> CompletionOutput:
        """The choice as seen by the user now: text held back while it may still become a stop string."""
        request = self.request
        text = self.text
        if not request.is_finished and request.params.stop:
            text = text[: len(text) - held_back_length(text, request.params.stop)]
        return CompletionOutput(
            index=self.choice_index,
            token_ids=list(request.output_token_ids),
            logprobs=list(request.output_logprobs),
            top_logprobs=[list(step) for step in request.output_top_logprobs],
            text=text,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
        )
