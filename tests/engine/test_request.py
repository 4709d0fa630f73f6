"""Request status ordering, finish reasons and recompute bookkeeping."""

from __future__ import annotations

import pytest

from deterministic_inference.engine.request import Request, RequestStatus
from deterministic_inference.engine.sampling_params import SamplingParams
from deterministic_inference.errors import InvalidRequestError


def test_status_order_and_finish_reasons() -> None:
    unfinished = [RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.PREEMPTED]
    assert not any(s.is_finished for s in unfinished)
    assert [s.finish_reason for s in unfinished] == [None, None, None]
    assert RequestStatus.FINISHED_STOPPED.finish_reason == "stop"
    assert RequestStatus.FINISHED_LENGTH.finish_reason == "length"
    assert RequestStatus.FINISHED_ABORTED.finish_reason == "abort"
    assert RequestStatus.FINISHED_ERROR.finish_reason == "error"
    assert all(s.is_finished for s in RequestStatus if s > RequestStatus.PREEMPTED)


def test_tokens_and_recompute_keep_outputs() -> None:
    request = Request("r", [1, 2, 3], SamplingParams(), seed=5)
    request.output_token_ids += [9, 8]
    request.num_computed_tokens = 4
    request.block_ids = [3, 4]
    request.num_cached_tokens = 2
    request.status = RequestStatus.RUNNING
    assert request.all_token_ids == [1, 2, 3, 9, 8]
    assert request.num_tokens == 5 and request.num_prompt_tokens == 3
    request.reset_for_recompute()
    assert request.status == RequestStatus.PREEMPTED and not request.is_finished
    assert request.num_computed_tokens == 0 and request.block_ids == [] and request.num_cached_tokens == 0
    assert request.output_token_ids == [9, 8]
    assert request.num_preemptions == 1


@pytest.mark.parametrize("prompt", [[], [1, -2], [1, True]])
def test_invalid_prompt(prompt: list[int]) -> None:
    with pytest.raises(InvalidRequestError) as info:
        Request("r", prompt, SamplingParams(), seed=0)
    assert info.value.param == "prompt"
