"""Per-sequence grammar state and the step's token masks, filled beside the forward pass.

Each constrained sequence (each of n choices) owns a `SequenceGrammar`: a fresh llguidance matcher of its
compiled grammar plus the count of output tokens it consumed. Its invariant: the matcher has consumed
exactly this sequence's output tokens, in order. `sync` restores it whenever that count and the output
disagree (it replays the outputs from the start state), so the state follows preemption and recompute
(outputs are kept, the matcher with them), prefix-cache hits and chunked prefill (they change which
prompt rows are computed, never the outputs) by construction.

The mask of a sequence at step t is therefore a function of its grammar and its own tokens so far, never
of other rows: `StepMasks` fills, for each sampled constrained row, llguidance's bitmask from that row's
own matcher into that row's own slice, then widens it with the row's end tokens (below). The fill needs
only tokens known before the step, so `start_masks` runs it in a worker thread while the model computes
the step's logits (llguidance releases the GIL and fills rows in parallel); the sampler joins it.

End tokens (documented choice): llguidance allows the model's EOS ids when the grammar is in an accepting
state; the sequence's own `stop_token_ids` are allowed then too (they end a request the same way). When
a consumed token leaves the grammar stopped (nothing more can follow), the sequence finishes with
finish_reason "stop" (`Scheduler.update`). A sampled token the matcher rejects cannot happen with the
mask applied; if it ever does, or the matcher fails (a step limit), that request alone fails.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import torch

from deterministic_inference.engine.grammar import CompiledGrammar
from deterministic_inference.engine.plan import StepPlan
from deterministic_inference.engine.request import Request

logger = logging.getLogger("detinf.engine")


def bitmask_words(vocab_size: int) -> int:
    """32-bit words of one row of a token bitmask (one bit per token id)."""
    return (vocab_size + 31) // 32


def fill_bitmasks(
    executor: llguidance.LLExecutor, matchers: Sequence[llguidance.LLMatcher], vocab_size: int
) -> torch.Tensor:
    """-> [R, W] int32: row i the allowed-token bits of matchers[i], filled by llguidance's thread pool.

    Written here rather than taken from `llguidance.torch`, whose import compiles a kernel with
    torch.compile and so imports torch's dynamo and inductor: ~1-2 s of every process start."""
    bitmask = torch.full((len(matchers), bitmask_words(vocab_size)), -1, dtype=torch.int32)
    pairs = [(matcher, row) for row, matcher in enumerate(matchers)]
    executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), bitmask.shape[1] * 4, len(matchers))
    return bitmask


def fill_bitmask(matcher: llguidance.LLMatcher, vocab_size: int) -> torch.Tensor:
    """-> [1, W] int32: the allowed-token bits of one matcher, filled on this thread."""
    bitmask = torch.full((1, bitmask_words(vocab_size)), -1, dtype=torch.int32)
    matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.shape[1] * 4)
    return bitmask


class GrammarViolation(RuntimeError):
    """A token the sequence's grammar does not allow reached its matcher (never with the mask applied)."""


class SequenceGrammar:
    """One sequence's matcher; it has consumed exactly `consumed` of the sequence's output tokens."""

    def __init__(self, compiled: CompiledGrammar, stop_token_ids: Sequence[int] = ()) -> None:
        self.compiled = compiled
        self.matcher = compiled.new_matcher()
        self.stop_token_ids = tuple(stop_token_ids)  # allowed (and ending) while the grammar accepts
        self.consumed = 0

    @property
    def is_stopped(self) -> bool:
        """True when the grammar can take no further token: the sequence is complete."""
        return self.matcher.is_stopped() and not self.matcher.is_error()

    @property
    def error(self) -> str | None:
        """The matcher's error (a rejected token or an exceeded step limit), None when healthy."""
        if not self.matcher.is_error():
            return None
        return self.matcher.get_error() or "unknown grammar error"

    def sync(self, output_token_ids: Sequence[int]) -> None:
        """Make the matcher's state "consumed exactly `output_token_ids`" (replays them from the start
        state when the count differs, e.g. after a test rebuilt the outputs)."""
        if self.consumed == len(output_token_ids):
            return
        self.matcher = self.compiled.new_matcher()
        self.consumed = 0
        for token_id in output_token_ids:
            self.accept(token_id, ())

    def accept(self, token_id: int, ending: Sequence[int]) -> None:
        """Consume one sampled token. A token in `ending` (EOS / stop ids ending the sequence now) is
        counted but not fed to the grammar; a rejected token raises GrammarViolation."""
        self.consumed += 1
        if token_id in ending:
            return
        if not self.matcher.consume_token(token_id):
            raise GrammarViolation(
                f"token {token_id} is not allowed by the grammar ({self.matcher.get_error()})"
            )

    def widen(self, allowed: torch.Tensor) -> None:
        """Allow the sequence's stop token ids in its row `allowed` [V] bool while the grammar accepts."""
        if self.stop_token_ids and self.matcher.is_accepting():
            ids = [t for t in self.stop_token_ids if t < allowed.shape[0]]
            allowed[torch.tensor(ids, dtype=torch.int64)] = True


def bitmask_to_allowed(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """llguidance bitmask [R, W] int32 (bit j of word w = token 32 w + j) -> allowed [R, V] bool."""
    bits = (bitmask[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1  # [R, W, 32]
    return bits.flatten(1)[:, :vocab_size].to(torch.bool)


class StepMasks:
    """The masks of one step's sampled constrained rows: sequence id -> allowed [V] bool, or failure."""

    def __init__(self) -> None:
        self.allowed: dict[str, torch.Tensor] = {}
        self.failures: dict[str, str] = {}  # sequence id -> why its row cannot be sampled


def constrained_rows(plan: StepPlan, sequences: Mapping[str, Request]) -> list[Request]:
    """Sequences of the plan that sample this step under a grammar, in plan order."""
    rows = []
    for chunk in plan.chunks:
        sequence = sequences.get(chunk.request_id)
        if chunk.sample and sequence is not None and sequence.grammar is not None:
            rows.append(sequence)
    return rows


def fill_masks(rows: list[Request], vocab_size: int, executor: llguidance.LLExecutor) -> StepMasks:
    """Fill every row's mask from its own matcher (row i writes only slice i of the bitmask)."""
    masks = StepMasks()
    grammars: list[tuple[Request, SequenceGrammar]] = []
    for sequence in rows:
        grammar = sequence.grammar
        if grammar is None:  # constrained_rows keeps only constrained sequences
            raise RuntimeError(f"sequence {sequence.request_id} has no grammar to fill a mask from")
        try:
            grammar.sync(sequence.output_token_ids)
        except GrammarViolation as error:
            masks.failures[sequence.request_id] = str(error)
            continue
        grammars.append((sequence, grammar))
    if not grammars:
        return masks
    bitmask = fill_bitmasks(executor, [g.matcher for _, g in grammars], vocab_size)  # [R, W] int32
    allowed = bitmask_to_allowed(bitmask, vocab_size)  # [R, V]
    for i, (sequence, grammar) in enumerate(grammars):
        row = allowed[i].clone()  # [V], its own storage
        grammar.widen(row)
        if grammar.error is not None:
            masks.failures[sequence.request_id] = f"grammar error: {grammar.error}"
        elif not bool(row.any()):
            masks.failures[sequence.request_id] = "the grammar allows no next token"
        else:
            masks.allowed[sequence.request_id] = row
    return masks


class PendingMasks:
    """A step's masks being filled in the worker thread, and the sequences they are for."""

    def __init__(self, sequence_ids: list[str], future: Future[StepMasks]) -> None:
        self.sequence_ids = sequence_ids
        self.future = future

    def result(self) -> StepMasks:
        """Wait for the fill. If the fill itself raised (a grammar-engine bug), every constrained row of
        the step fails (their own requests only), with the traceback in the log."""
        try:
            return self.future.result()
        except Exception as error:  # noqa: BLE001 - confined to the constrained rows of this step
            logger.error("filling grammar masks failed", exc_info=error)
            masks = StepMasks()
            for sequence_id in self.sequence_ids:
                masks.failures[sequence_id] = f"filling its grammar mask raised {type(error).__name__}"
            return masks


class MaskFiller:
    """Fills a step's masks in one worker thread, so the fill overlaps the forward pass."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        # the fill thread and llguidance's executor, made together at the first constrained step
        self._workers: tuple[ThreadPoolExecutor, llguidance.LLExecutor] | None = None

    def start(self, plan: StepPlan, sequences: Mapping[str, Request]) -> PendingMasks | None:
        """Begin filling the masks of the plan's sampled constrained rows; None when there are none."""
        rows = constrained_rows(plan, sequences)
        if not rows:
            return None
        if self._workers is None:
            pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="detinf-masks")
            self._workers = (pool, llguidance.LLExecutor())
        pool, executor = self._workers
        future = pool.submit(fill_masks, rows, self.vocab_size, executor)
        return PendingMasks([s.request_id for s in rows], future)
