"""One sequence's detokenized text: incremental decoding, stop strings, and what was already emitted."""

from __future__ import annotations

from dataclasses import dataclass

from deterministic_inference.engine.outputs import find_stop, held_back_length
from deterministic_inference.model.tokenizer import IncrementalDecoder


@dataclass
class SequenceState:
    """The text of one sequence, built token by token. `Scheduler.update` pushes each new token and
    takes the text that became visible since the previous step (`take_new_text`): while the sequence
    runs, a tail that could still become a stop string is held back, so emitted text is never cut."""

    decoder: IncrementalDecoder
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    text: str = ""  # everything decoded so far (cut at the stop string once one matched)
    emitted: int = 0  # characters of `text` already handed out in deltas

    def push(self, token_id: int) -> None:
        """Append the text of a new output token."""
        self.text += self.decoder.push(token_id)

    def match_stop(self, previous_length: int) -> str | None:
        """The stop string that now occurs in the text (searched from where the last token's text could
        have completed one), cutting the text there; None when no stop string matched."""
        if not self.stop:
            return None
        found = find_stop(self.text, self.stop, previous_length)
        if found is None:
            return None
        index, stop = found
        end = index + len(stop) if self.include_stop_str_in_output else index
        self.text = self.text[:end]
        return stop

    def finish(self, cut_by_stop_string: bool) -> None:
        """Flush the decoder's held-back bytes, unless a stop string already cut the text."""
        tail = self.decoder.flush()
        if not cut_by_stop_string:
            self.text += tail

    def take_new_text(self, finished: bool) -> str:
        """Text that became visible since the last call (all of it once finished)."""
        visible = len(self.text)
        if not finished and self.stop:
            visible -= held_back_length(self.text, self.stop)
        piece = self.text[self.emitted : visible] if visible > self.emitted else ""
        self.emitted = max(self.emitted, visible)
        return piece
