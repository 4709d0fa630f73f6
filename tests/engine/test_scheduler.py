"""Scheduler: token budget, chunked prefill, max_num_seqs, FCFS, preemption + recompute, prefix-cache skip.

`Harness` stands in for the model runner with plain bookkeeping: it keeps what each KV slot holds and
checks, before every chunk, that the sequence's cache holds exactly its known tokens for every earlier
position (so prefix hits, eviction and recompute are checked for content). `Scheduler.update` appends its
fake tokens and finishes sequences at max_tokens.
"""

from __future__ import annotations

import random

import pytest

from deterministic_inference.engine.kv_cache import KVCacheManager
from deterministic_inference.engine.model_runner import ModelRunnerOutput, SampledToken
from deterministic_inference.engine.plan import StepPlan
from deterministic_inference.engine.request import Request, RequestStatus
from deterministic_inference.engine.sampling_params import SamplingParams
from deterministic_inference.engine.scheduler import Scheduler
from deterministic_inference.errors import InvalidRequestError


def fake_token(request_id: str, index: int) -> int:
    """A deterministic 'sampled' token for output `index` of a sequence (no Python hash())."""
    return (sum(map(ord, request_id)) * 31 + index * 7) % 97


class Harness:
    def __init__(
        self,
        num_blocks: int = 64,
        block_size: int = 4,
        max_num_seqs: int = 8,
        budget: int = 64,
        caching: bool = True,
        max_model_len: int = 1024,
    ) -> None:
        self.kv = KVCacheManager(num_blocks, block_size, caching, hash_extra="test")
        self.scheduler = Scheduler(self.kv, max_num_seqs, budget, max_model_len)
        self.slots: dict[tuple[int, int], int] = {}
        self.plans: list[StepPlan] = []
        self.requests: dict[str, Request] = {}

    def add(self, request_id: str, prompt: list[int], max_tokens: int = 4, **params: object) -> Request:
        request = Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, **params), seed=0)  # type: ignore[arg-type]
        self.scheduler.add(request)
        self.requests[request_id] = request
        return request

    def step(self) -> StepPlan:
        plan = self.scheduler.schedule()
        self.plans.append(plan)
        size = self.kv.block_size
        output = ModelRunnerOutput()
        for chunk in plan.chunks:
            request = self.requests[chunk.request_id]
            known = request.all_token_ids
            end = chunk.start_position + len(chunk.token_ids)
            assert list(chunk.token_ids) == known[chunk.start_position : end]
            assert len(chunk.block_ids) == -(-end // size)
            for position in range(chunk.start_position):  # the cache holds every earlier token
                assert self.slots[(chunk.block_ids[position // size], position % size)] == known[position]
            for position in range(chunk.start_position, end):
                self.slots[(chunk.block_ids[position // size], position % size)] = known[position]
            assert chunk.sample == (end == request.num_tokens)
            if chunk.sample:
                token = fake_token(chunk.request_id, len(request.output_token_ids))
                output.sampled[chunk.request_id] = SampledToken(token, -1.0, [])
        self.scheduler.update(plan, output)
        return plan

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished:
                return
            self.step()
        raise AssertionError("did not finish")


def chunk_shape(plan: StepPlan) -> list[tuple[str, int, int, bool]]:
    return [(c.request_id, c.start_position, len(c.token_ids), c.sample) for c in plan.chunks]


@pytest.mark.parametrize(
    ("budget", "chunks"),
    [(7, [7, 7, 7, 7, 7, 5]), (16, [16, 16, 8]), (64, [40])],
)
def test_chunked_prefill_budgets(budget: int, chunks: list[int]) -> None:
    harness = Harness(budget=budget)
    harness.add("a", list(range(40)), max_tokens=3)
    harness.run()
    starts = [sum(chunks[:i]) for i in range(len(chunks))]
    expected = [[("a", s, n, s + n == 40)] for s, n in zip(starts, chunks, strict=True)]
    expected += [[("a", 40, 1, True)], [("a", 41, 1, True)]]  # decodes: the last sampled token
    assert [chunk_shape(p) for p in harness.plans] == expected
    assert harness.requests["a"].output_token_ids == [fake_token("a", i) for i in range(3)]
    assert harness.plans[-1].chunks[0].token_ids == (fake_token("a", 1),)


def test_running_decodes_first_then_waiting_prefill_chunked_to_the_budget() -> None:
    harness = Harness(budget=10)
    harness.add("a", list(range(5)), max_tokens=5)
    harness.add("b", list(range(100, 112)), max_tokens=2)
    assert chunk_shape(harness.step()) == [("a", 0, 5, True), ("b", 0, 5, False)]
    assert chunk_shape(harness.step()) == [("a", 5, 1, True), ("b", 5, 7, True)]
    assert chunk_shape(harness.step()) == [("a", 6, 1, True), ("b", 12, 1, True)]
    assert all(p.num_batched_tokens <= 10 for p in harness.plans)


def test_max_num_seqs_and_fcfs_order() -> None:
    harness = Harness(max_num_seqs=2, budget=100)
    for name in "abcde":
        harness.add(name, [ord(name)] * 3, max_tokens=2)
    assert [c.request_id for c in harness.step().chunks] == ["a", "b"]
    assert harness.scheduler.num_running == 2 and harness.scheduler.num_waiting == 3
    assert [c.request_id for c in harness.step().chunks] == ["a", "b"]  # both finish here
    assert [c.request_id for c in harness.step().chunks] == ["c", "d"]
    harness.run()
    assert [r.arrival for r in harness.requests.values()] == [0, 1, 2, 3, 4]
    assert all(len(p.chunks) <= 2 for p in harness.plans)


def test_head_of_line_request_that_does_not_fit_blocks_later_ones() -> None:
    harness = Harness(num_blocks=6, block_size=4, budget=100, caching=False)
    harness.add("a", list(range(12)), max_tokens=8)  # 3 blocks now, up to 5
    harness.add("b", list(range(16)), max_tokens=1)  # 4 blocks: does not fit yet
    harness.add("c", [1], max_tokens=1)  # would fit, but comes after b
    assert [c.request_id for c in harness.step().chunks] == ["a"]
    assert [c.request_id for c in harness.step().chunks] == ["a"]
    harness.run()
    ids = [[c.request_id for c in p.chunks] for p in harness.plans]
    assert ids == [["a"]] * 8 + [["b", "c"]]  # c waited behind b although it fit all along


def test_preemption_when_blocks_run_out_and_recompute() -> None:
    harness = Harness(num_blocks=4, block_size=4, budget=4, caching=False)
    a = harness.add("a", list(range(6)), max_tokens=8)
    b = harness.add("b", list(range(10, 16)), max_tokens=8)
    shapes = [chunk_shape(harness.step()) for _ in range(5)]
    assert shapes[:4] == [
        [("a", 0, 4, False)],
        [("a", 4, 2, True), ("b", 0, 2, False)],
        [("a", 6, 1, True), ("b", 2, 3, False)],
        [("a", 7, 1, True), ("b", 5, 1, True)],
    ]
    # a now needs a third block: b (latest arrival) is preempted, a runs alone
    assert harness.plans[4].preempted_ids == ("b",) and shapes[4] == [("a", 8, 1, True)]
    assert b.status == RequestStatus.PREEMPTED and b.block_ids == [] and b.num_computed_tokens == 0
    assert b.output_token_ids == [fake_token("b", 0)]  # its output is kept
    assert harness.scheduler.num_waiting == 1
    harness.run()
    # b is readmitted, preempted again (thrashing, as FCFS recompute does) until a finishes; then it
    # recomputes prompt + its output as a prompt: 7 tokens in chunks of 4 + 3, sampled only at the end.
    assert [p.preempted_ids for p in harness.plans] == [(), (), (), (), ("b",), (), ("b",), (), ("b",)] + [
        ()
    ] * 8
    assert [chunk_shape(p) for p in harness.plans[9:11]] == [[("b", 0, 4, False)], [("b", 4, 3, True)]]
    for request in (a, b):
        assert request.output_token_ids == [fake_token(request.request_id, i) for i in range(8)]
    assert harness.kv.free_block_ids() == [0, 1, 2, 3]


def test_a_sequence_can_preempt_itself() -> None:
    harness = Harness(num_blocks=3, block_size=2, budget=8, caching=False)
    a = harness.add("a", [1, 2], max_tokens=4)
    b = harness.add("b", [3, 4], max_tokens=4)
    harness.run()
    assert [(chunk_shape(p), p.preempted_ids) for p in harness.plans] == [
        ([("a", 0, 2, True), ("b", 0, 2, True)], ()),
        ([("a", 2, 1, True)], ("b",)),  # b is the latest arrival: it preempts itself for a
        ([("a", 3, 1, True)], ()),
        ([("a", 4, 1, True)], ()),
        ([("b", 0, 3, True)], ()),  # recompute prompt + 1 output, then sample output 2
        ([("b", 3, 1, True)], ()),
        ([("b", 4, 1, True)], ()),
    ]
    assert a.output_token_ids == [fake_token("a", i) for i in range(4)]
    assert b.output_token_ids == [fake_token("b", i) for i in range(4)]


def test_prefix_cache_hit_is_not_budgeted_and_last_token_recomputed() -> None:
    harness = Harness(block_size=4, budget=5)
    harness.add("a", list(range(20)), max_tokens=1)
    harness.run()
    harness.plans.clear()
    harness.add("b", list(range(16)) + [90, 91, 92, 93], max_tokens=1)
    harness.add("c", list(range(20)), max_tokens=1)
    plan = harness.step()
    assert [(c.request_id, c.start_position, len(c.token_ids), c.num_cached_tokens) for c in plan.chunks] == [
        ("b", 16, 4, 16),
        ("c", 16, 1, 16),  # identical prompt: its last block still has the last token recomputed
    ]
    harness.run()
    assert harness.kv.stats.hit_tokens == 32


def test_preempted_request_reuses_its_own_cached_blocks() -> None:
    harness = Harness(num_blocks=5, block_size=2, budget=16, caching=True)
    harness.add("a", [1, 2, 3], max_tokens=6)
    b = harness.add("b", [7, 8, 9, 10, 11], max_tokens=6)
    harness.run()
    shapes = [
        [(c.request_id, c.start_position, len(c.token_ids), c.num_cached_tokens) for c in p.chunks]
        for p in harness.plans
    ]
    assert [p.preempted_ids for p in harness.plans][:4] == [(), (), ("b",), ()]
    # b's cached blocks were released tail first, so a evicted the tail; b gets its head block back
    assert shapes[6] == [("b", 2, 5, 2)]
    assert b.num_preemptions == 1 and b.num_cached_tokens == 2
    assert b.output_token_ids == [fake_token("b", i) for i in range(6)]
    assert harness.kv.num_free_blocks == 5


def test_abort_frees_blocks_and_unknown_ids_are_ignored() -> None:
    harness = Harness(num_blocks=8, caching=False)
    a = harness.add("a", list(range(9)), max_tokens=4)
    harness.add("b", [1], max_tokens=4)
    harness.step()
    harness.scheduler.abort("a")
    harness.scheduler.abort("missing")
    assert a.status == RequestStatus.FINISHED_ABORTED and a.finish_reason == "abort"
    assert a.block_ids == [] and harness.scheduler.num_running == 1
    harness.run()
    assert harness.kv.free_block_ids() == list(range(8))


def test_add_rejects_duplicates_and_prompts_that_cannot_fit() -> None:
    harness = Harness(num_blocks=4, block_size=4, max_model_len=20)
    harness.add("a", [1])
    with pytest.raises(InvalidRequestError):
        harness.add("a", [2])
    with pytest.raises(InvalidRequestError):
        harness.add("long", list(range(20)))
    with pytest.raises(InvalidRequestError):
        harness.add("big", list(range(16)), max_tokens=2)  # 17 tokens of KV > 4 blocks of 4
    harness.add("fits", list(range(16)), max_tokens=1)


@pytest.mark.parametrize("seed", range(6))
def test_random_workloads_give_the_same_outputs_under_any_limits(seed: int) -> None:
    """Whatever the budget, pool size, max_num_seqs or caching, every sequence gets the same tokens and
    the cache always holds the right tokens (checked by the harness); afterwards every block is free."""
    rng = random.Random(seed)
    workload = [
        (f"r{i}", [rng.randrange(4) for _ in range(rng.randrange(1, 30))], rng.randrange(1, 12))
        for i in range(12)
    ]
    results = []
    for budget, num_blocks, max_seqs, caching in [(512, 200, 64, False), (7, 14, 3, True), (16, 20, 8, True)]:
        harness = Harness(
            num_blocks=num_blocks, block_size=4, max_num_seqs=max_seqs, budget=budget, caching=caching
        )
        for request_id, prompt, max_tokens in workload:
            harness.add(request_id, prompt, max_tokens=max_tokens)
        harness.run()
        results.append({r.request_id: r.output_token_ids for r in harness.requests.values()})
        assert harness.kv.num_free_blocks == num_blocks
        if caching:  # the tight settings exercise preemption, prefix hits and eviction
            assert any(p.preempted_ids for p in harness.plans)
            assert harness.kv.stats.hit_tokens > 0 and harness.kv.stats.evictions > 0
        cached = {b for b in range(num_blocks) if harness.kv.block_hash_of(b) is not None}
        assert harness.kv.free_block_ids() == [b for b in range(num_blocks) if b not in cached]
    assert results[0] == results[1] == results[2]
